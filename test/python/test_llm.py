"""Model calls: the completion-mode Agent step against the scripted LLM server.

Every test runs for both wire formats (provider openai and anthropic): a model
config whose base_url is the scripted server (TUVL_LLM_URL) and whose model is
the name of a script registered for the test alone, so that the server's
request log (GET /_log?model=NAME) holds exactly the requests of that test.
What the server received is read from that log; what tuvl kept is read from
tuvl.events (one llm_turn per model call) and tuvl.runs.

Covered: the answer and its journal (tokens, finish reason, request and
response bodies, the shape of each provider's request and headers);
outcome.enum and outcome.write; every fault the server can inject, with the
retries counted at the server; the API key (sent only in its header, found
nowhere else); private "_" keys (never sent); the workers as well as
tuvl.run(); and kill -9 of a worker while a call is in flight.
"""
import json
import os
import socket
import time
import urllib.request
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import (SERVER_LOG, connect, journal_violations, kill_worker, q, q1,
                      wait_run_finished, wait_until)
from llmutil import script, sent

LLM_URL = os.environ.get("TUVL_LLM_URL")
LLM_ROOT = LLM_URL[: -len("/v1")] if LLM_URL and LLM_URL.endswith("/v1") else LLM_URL

pytestmark = pytest.mark.skipif(not LLM_URL, reason="TUVL_LLM_URL is not set (run through test/run)")

PROVIDERS = ["openai", "anthropic"]
OUTSIDER = "tuvl_llm_outsider"
SYSTEM = "You answer in one short sentence."

# Never let an http_proxy variable send the tests' own requests elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------------------
# The scripted LLM server


def new_name(prefix="l"):
    """A fresh identifier (script, model config and workflow name at once)."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------
# Model configs and workflows


def register_llm(conn, name, provider, model=None, timeout="10s", key_secret=None, params=None):
    lines = [f"name: {name}", f"provider: {provider}", f"base_url: {LLM_URL}",
             f"model: {model or name}", f"timeout: {timeout}"]
    if key_secret:
        lines.append(f"api_key_secret: {key_secret}")
    if params:
        lines.append(f"params: {json.dumps(params)}")
    q(conn, "SELECT tuvl.register_llm(%s)", ("\n".join(lines) + "\n",))


def agent_workflow(name, model, prompt="Greet {{ name }}.", system=SYSTEM, extra="",
                   routes="{ default: done, error: oops }", ends="", answer="ask_result"):
    """One completion Agent `ask`; end `done` answers the context key `answer`
    (the default output key), end `oops` the error and its type."""
    system_line = f"      system: {json.dumps(system)}\n" if system is not None else ""
    return (
        f"name: {name}\n"
        "steps:\n"
        "  - id: ask\n"
        "    kind: Agent\n"
        "    mode: completion\n"
        "    agent:\n"
        f"      model: {model}\n"
        f"{system_line}"
        f"      prompt: {json.dumps(prompt)}\n"
        f"{extra}"
        f"    routes: {routes}\n"
        "ends:\n"
        f'  - {{ id: done, status: completed, response: "{{{{ {answer} }}}}" }}\n'
        '  - { id: oops, status: completed, response: { error: "{{ _last_error }}", '
        'type: "{{ _last_error_type }}" } }\n'
        f"{ends}")


def make_agent(conn, provider, turns, extra="", timeout="10s", key_secret=None, params=None,
               **wf):
    """A script, a model config and a workflow, all named alike; returns the name."""
    name = new_name()
    script(name, turns)
    register_llm(conn, name, provider, timeout=timeout, key_secret=key_secret, params=params)
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name, extra=extra, **wf),))
    return name


def retry_yaml(on=None, attempts=None, backoff=None):
    parts = []
    if on is not None:
        parts.append(f"on: [{', '.join(on)}]")
    if attempts is not None:
        parts.append(f"attempts: {attempts}")
    if backoff is not None:
        parts.append(f"backoff: {backoff}")
    return "      retry: { " + ", ".join(parts) + " }\n"


# ---------------------------------------------------------------------------
# Runs and the journal


def execute(conn, workflow, data=None, mode="sync", timeout=60):
    """Run workflow once: {run_id, status, end, response, error, context}."""
    payload = json.dumps(data if data is not None else {"name": "Ada"})
    if mode == "sync":
        run_id = q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (workflow, payload))["run_id"]
    else:
        run_id = q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (workflow, payload))
        status = q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))
        assert status in ("completed", "failed"), f"run {run_id} is still {status} after {timeout} s"
    status, end, response, error, context = q(
        conn, "SELECT status, end_name, response, error, context FROM tuvl.runs WHERE id = %s",
        (run_id,))[0]
    return {"run_id": run_id, "status": status, "end": end, "response": response,
            "error": error, "context": context}


def events(conn, run_id, event_type=None):
    """[(type, tokens, latency_ms, payload)] of a run, in order."""
    rows = q(conn, "SELECT type, tokens, latency_ms, payload FROM tuvl.events "
                   "WHERE run_id = %s ORDER BY seq", (run_id,))
    return [r for r in rows if event_type is None or r[0] == event_type]


def turns_of(conn, run_id):
    return [r[3] for r in events(conn, run_id, "llm_turn")]


def completed_event(conn, run_id):
    done = [r[3] for r in events(conn, run_id, "agent_completed")]
    assert len(done) == 1, done
    return done[0]


def error_of(res):
    assert res["status"] == "completed" and res["end"] == "oops", res
    return res["response"]["error"], res["response"]["type"]


def gaps(requests):
    return [b["t"] - a["t"] for a, b in zip(requests, requests[1:])]


def answer_text(provider, response):
    """The answer's text in a provider response body."""
    if provider == "openai":
        return response["choices"][0]["message"]["content"]
    return "".join(b["text"] for b in response["content"] if b["type"] == "text")


@pytest.fixture(params=PROVIDERS)
def provider(request):
    return request.param


@pytest.fixture(params=["sync", "worker"])
def mode(request):
    return request.param


@pytest.fixture
def conn(db, conns):
    return conns(db)


# ---------------------------------------------------------------------------
# A text answer


def test_text_answer_is_written_and_journaled_as_one_llm_turn(conn, provider, mode):
    key = "sk-test-" + uuid.uuid4().hex
    q(conn, "SELECT tuvl.set_secret('llm_text_key', %s)", (key,))
    name = make_agent(conn, provider, [{"text": "Hello, Ada!",
                                        "usage": {"prompt_tokens": 31, "completion_tokens": 4}}],
                      key_secret="llm_text_key")
    res = execute(conn, name, {"name": "Ada"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["response"] == "Hello, Ada!"
    assert res["context"]["ask_result"] == "Hello, Ada!"

    # What the server received
    reqs = sent(name)
    assert len(reqs) == 1
    req = reqs[0]
    assert req["status"] == 200 and req["turn"] == 0
    body = req["body"]
    assert body["model"] == name
    if provider == "openai":
        assert req["path"] == "/v1/chat/completions"
        assert body["messages"] == [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": "Greet Ada."}]
        assert "system" not in body
        assert req["headers"]["authorization"] == f"Bearer {key}"
        assert "x-api-key" not in req["headers"]
    else:
        assert req["path"] == "/v1/messages"
        assert body["system"] == SYSTEM
        assert body["messages"] == [{"role": "user",
                                     "content": [{"type": "text", "text": "Greet Ada."}]}]
        assert body["max_tokens"] == 1024
        assert req["headers"]["anthropic-version"] == "2023-06-01"
        assert req["headers"]["x-api-key"] == key
        assert "authorization" not in req["headers"]
    assert req["headers"]["content-type"] == "application/json"

    # What tuvl journaled
    evs = events(conn, res["run_id"])
    assert [e[0] for e in evs] == ["run_queued", "run_started", "agent_started", "llm_turn",
                                   "agent_completed", "signal", "checkpoint", "run_completed"]
    _, tokens, latency, turn = evs[3]
    assert tokens == 35
    assert turn["tokens"] == {"prompt": 31, "completion": 4, "total": 35}
    assert turn["provider"] == provider and turn["model"] == name
    assert turn["status"] == 200 and "error" not in turn
    assert turn["finish_reason"] == ("stop" if provider == "openai" else "end_turn")
    assert turn["position"] == 0
    assert turn["request"] == body, "the journaled request is the body the server received"
    assert answer_text(provider, turn["response"]) == "Hello, Ada!"
    usage = turn["response"]["usage"]
    assert usage == ({"prompt_tokens": 31, "completion_tokens": 4, "total_tokens": 35}
                     if provider == "openai" else {"input_tokens": 31, "output_tokens": 4})
    assert latency is not None and latency >= 0 and turn["latency_ms"] >= 0
    done = evs[4][3]
    assert done == {"signal": "default", "output_key": "ask_result", "output": "Hello, Ada!"}
    assert q1(conn, "SELECT step_state FROM tuvl.runs WHERE id = %s", (res["run_id"],)) is None
    assert journal_violations(conn, [res["run_id"]]) == []


def test_length_finish_reason_is_journaled(conn, provider):
    name = make_agent(conn, provider, [{"text": "Hello, A", "finish": "length"}])
    res = execute(conn, name)
    assert res["end"] == "done" and res["response"] == "Hello, A", res
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["finish_reason"] == ("length" if provider == "openai" else "max_tokens")


def test_default_usage_counts_tokens_in_column_and_payload(conn, provider):
    name = make_agent(conn, provider, [{"text": "Hi there, I am a model answering you."}])
    res = execute(conn, name)
    assert res["end"] == "done", res
    ((_, tokens, _, turn),) = events(conn, res["run_id"], "llm_turn")
    t = turn["tokens"]
    assert t["prompt"] > 0 and t["completion"] > 0
    assert t["total"] == t["prompt"] + t["completion"] == tokens


def test_outcome_write_and_params_shape_the_request(conn, provider):
    name = new_name()
    script(name, [{"text": "Dear Ada"}])
    register_llm(conn, name, provider, params={"temperature": 0, "max_tokens": 64, "top_p": 0.5})
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(
        name, name, system=None, prompt="Write to {{ name }} about {{ order.id }} ({{ order }})",
        extra="      outcome: { write: letter }\n", answer="letter"),))
    res = execute(conn, name, {"name": "Ada", "order": {"id": 7}})
    assert res["end"] == "done" and res["response"] == "Dear Ada", res
    assert res["context"]["letter"] == "Dear Ada" and "ask_result" not in res["context"]
    assert completed_event(conn, res["run_id"])["output_key"] == "letter"
    (req,) = sent(name)
    body = req["body"]
    assert body["temperature"] == 0 and body["top_p"] == 0.5 and body["max_tokens"] == 64
    prompt = 'Write to Ada about 7 ({"id": 7})'
    if provider == "openai":
        # no system template and no enum: no system message at all
        assert body["messages"] == [{"role": "user", "content": prompt}]
    else:
        assert "system" not in body
        assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": prompt}]}]


def test_replacing_a_model_config_takes_effect_for_the_next_run(conn, provider):
    name = make_agent(conn, provider, [{"text": "from the first model"}])
    other = script(new_name(), [{"text": "from the second model"}])
    assert execute(conn, name)["response"] == "from the first model"
    register_llm(conn, name, provider, model=other)
    assert q1(conn, "SELECT definition ->> 'model' FROM tuvl.llms WHERE name = %s", (name,)) == other
    res = execute(conn, name)
    assert res["response"] == "from the second model", res
    assert len(sent(name)) == 1 and len(sent(other)) == 1
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["model"] == other


def test_register_llm_rejects_bad_configs(conn):
    bad = [
        ("name: x\nprovider: gemini\nbase_url: http://h/v1\nmodel: m\n", "provider must be openai, openai_responses or anthropic"),
        ("name: x\nprovider: openai\nbase_url: ftp://h/v1\nmodel: m\n", "base_url must be an http or https URL"),
        ("name: x\nprovider: openai\nbase_url: http://h/v1\n", 'missing required key "model"'),
        ("name: x\nprovider: openai\nbase_url: http://h/v1\nmodel: m\ntimeout: soon\n", "timeout must be a duration"),
        ("name: x\nprovider: openai\nbase_url: http://h/v1\nmodel: m\nparams: [1]\n", "params must be a mapping"),
        ("name: 'a b'\nprovider: openai\nbase_url: http://h/v1\nmodel: m\n", "needs a name"),
    ]
    for source, message in bad:
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            q(conn, "SELECT tuvl.register_llm(%s)", (source,))
        assert message in str(e.value), (source, str(e.value))


def test_an_unknown_model_config_is_refused_at_registration(conn):
    """Not when a run reaches the step: another role could register the
    name meanwhile and receive the run's prompts (test_hostile_roles.py)."""
    name = new_name()
    with pytest.raises(psycopg2.errors.InvalidObjectDefinition) as e:
        q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, "no_such_model"),))
    assert 'model config "no_such_model" does not exist' in str(e.value)


def test_a_missing_key_secret_takes_the_error_route_and_sends_nothing(conn, provider):
    name = make_agent(conn, provider, [{"text": "never"}], key_secret="llm_never_set")
    res = execute(conn, name)
    error, kind = error_of(res)
    # the principal (postgres) may read the secrets' names: it is told the secret is missing
    assert error == f'secret "llm_never_set" named by LLM config "{name}" does not exist', error
    assert kind == "llm_error"
    assert sent(name) == [] and turns_of(conn, res["run_id"]) == []


# ---------------------------------------------------------------------------
# outcome.enum

ENUM_EXTRA = "      outcome: { enum: [approve, reject], write: decision }\n"
ENUM_ROUTES = "{ approve: approved, reject: rejected, error: oops }"
ENUM_ENDS = ('  - { id: approved, status: completed, response: { approved: "{{ decision }}" } }\n'
             '  - { id: rejected, status: completed, response: { rejected: "{{ decision }}" } }\n')


def enum_agent(conn, provider, text):
    return make_agent(conn, provider, [{"text": text}], extra=ENUM_EXTRA, routes=ENUM_ROUTES,
                      ends=ENUM_ENDS, prompt="Refund {{ amount }} EUR?")


@pytest.mark.parametrize("text,written", [
    ('{"result": {"greeting": "Hi"}}', {"greeting": "Hi"}),
    ('```json\n{"greeting": "Hi"}\n```', {"greeting": "Hi"}),
    ("[1, 2]", [1, 2]),
    ("Hello, Ada!", "Hello, Ada!"),
])
def test_without_an_enum_the_answer_is_written_as_an_autonomous_agent_writes_it(
        conn, provider, text, written):
    """One outcome contract for both modes of the Agent step: the answer's
    result, else its parsed JSON, else its text."""
    name = make_agent(conn, provider, [{"text": text}])
    res = execute(conn, name, {"name": "Ada"})
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["context"]["ask_result"] == written
    assert [r[3] for r in events(conn, res["run_id"], "signal")] == [{"signal": "default"}]


def test_enum_answer_routes_by_its_outcome_and_writes_its_result(conn, provider):
    name = enum_agent(conn, provider, '{"outcome": "reject", "result": {"reason": "over the limit"}}')
    res = execute(conn, name, {"amount": 900})
    assert res["end"] == "rejected", res
    assert res["response"] == {"rejected": {"reason": "over the limit"}}
    assert res["context"]["decision"] == {"reason": "over the limit"}
    assert [r[3] for r in events(conn, res["run_id"], "signal")] == [{"signal": "reject"}]
    # the strict answer format is in the system prompt, after the step's own system text
    (req,) = sent(name)
    system = (req["body"]["messages"][0]["content"] if provider == "openai"
              else req["body"]["system"])
    if provider == "openai":
        assert req["body"]["messages"][0]["role"] == "system"
    assert system.startswith(SYSTEM + "\n\n")
    assert '{"outcome": <one of "approve", "reject">, "result": <your answer>}' in system
    assert "Do not wrap it in markdown code fences." in system


def test_enum_answer_in_a_json_code_fence_is_accepted(conn, provider):
    name = enum_agent(conn, provider, '```json\n{"outcome": "approve", "result": "refund 90 EUR"}\n```\n')
    res = execute(conn, name, {"amount": 90})
    assert res["end"] == "approved", res
    assert res["context"]["decision"] == "refund 90 EUR"


def test_enum_answer_without_result_writes_the_whole_object(conn, provider):
    name = enum_agent(conn, provider, '```\n{"outcome": "approve"}\n```')
    res = execute(conn, name, {"amount": 90})
    assert res["end"] == "approved", res
    assert res["context"]["decision"] == {"outcome": "approve"}


def test_the_echo_script_answers_the_first_enum_value(conn, provider):
    name = new_name()
    register_llm(conn, name, provider, model="echo")
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(
        name, name, extra=ENUM_EXTRA, routes=ENUM_ROUTES, ends=ENUM_ENDS,
        prompt="Refund {{ amount }} EUR?"),))
    res = execute(conn, name, {"amount": 5})
    assert res["end"] == "approved", res
    assert res["context"]["decision"] == "Summary: Refund 5 EUR?"


def test_an_outcome_outside_the_enum_takes_the_error_route(conn, provider):
    name = enum_agent(conn, provider, '{"outcome": "maybe", "result": "not sure"}')
    res = execute(conn, name, {"amount": 90})
    error, kind = error_of(res)
    assert error == 'the model answered outcome "maybe", which is not in outcome.enum', error
    assert kind == "invalid_outcome"
    assert "decision" not in res["context"]
    assert [r[3]["signal"] for r in events(conn, res["run_id"], "signal")] == ["error"]
    assert len(sent(name)) == 1, "an answer outside the enum is not retried"
    assert len(turns_of(conn, res["run_id"])) == 1


@pytest.mark.parametrize("text", ["I would approve it.", '{"result": "approve"}',
                                  '["approve"]', '{"outcome": 1}', ""])
def test_an_answer_that_is_not_the_json_format_takes_the_error_route(conn, provider, text):
    name = enum_agent(conn, provider, text)
    res = execute(conn, name, {"amount": 90})
    error, kind = error_of(res)
    assert kind == "invalid_outcome"
    assert ("not a JSON object" in error or 'no "outcome" string' in error), error
    assert "decision" not in res["context"]
    assert len(sent(name)) == 1


def test_an_enum_answer_without_an_error_route_fails_the_run(conn, provider):
    name = make_agent(conn, provider, [{"text": "no idea"}], extra=ENUM_EXTRA,
                      routes="{ approve: approved, reject: rejected }", ends=ENUM_ENDS)
    res = execute(conn, name)
    assert res["status"] == "failed", res
    assert 'step "ask" failed' in res["error"] and "not a JSON object" in res["error"], res


# ---------------------------------------------------------------------------
# Faults and retries

FAST = retry_yaml(on=["timeout", "error"], attempts=3, backoff="100ms")


def test_429_is_retried_after_retry_after(conn, provider, mode):
    name = make_agent(conn, provider, [{"fault": "429", "times": 1, "retry_after": 1,
                                        "text": "after the rate limit"}], extra=FAST)
    res = execute(conn, name, mode=mode)
    assert res["end"] == "done" and res["response"] == "after the rate limit", res
    reqs = sent(name)
    assert [r["status"] for r in reqs] == [429, 200]
    (gap,) = gaps(reqs)
    assert 0.95 <= gap < 3, f"the retry came {gap:.2f} s after a 429 with Retry-After: 1"
    assert reqs[0]["body"] == reqs[1]["body"]
    turns = turns_of(conn, res["run_id"])
    assert [t["status"] for t in turns] == [429, 200]
    assert "HTTP 429" in turns[0]["error"] and turns[0]["tokens"]["total"] == 0
    assert [t["position"] for t in turns] == [0, 1]


def test_retry_after_overrides_the_backoff(conn, provider):
    # a 5 s backoff, but the server asks for half a second
    name = make_agent(conn, provider, [{"fault": "429", "times": 1, "retry_after": 0.5,
                                        "text": "ok"}],
                      extra=retry_yaml(on=["error"], attempts=2, backoff="5s"))
    res = execute(conn, name)
    assert res["end"] == "done", res
    (gap,) = gaps(sent(name))
    assert 0.45 <= gap < 2.5, f"retry {gap:.2f} s after Retry-After 0.5 (backoff 5 s)"


def test_429_without_retry_after_waits_for_the_backoff(conn, provider):
    name = make_agent(conn, provider, [{"fault": "429", "times": 1, "text": "ok"}],
                      extra=retry_yaml(attempts=2, backoff="700ms"))
    res = execute(conn, name)
    assert res["end"] == "done", res
    (gap,) = gaps(sent(name))
    # backoff plus up to 50 % jitter
    assert 0.65 <= gap < 1.05 + 1.0, gap


@pytest.mark.parametrize("fault", ["500", "529", "408"])
def test_transient_status_is_retried_until_it_succeeds(conn, provider, fault):
    name = make_agent(conn, provider, [{"fault": fault, "times": 2, "text": "third time lucky"}],
                      extra=FAST)
    res = execute(conn, name)
    assert res["end"] == "done" and res["response"] == "third time lucky", res
    reqs = sent(name)
    status = {"500": 500, "408": 408, "529": 503 if provider == "openai" else 529}[fault]
    assert [r["status"] for r in reqs] == [status, status, 200]
    assert len({json.dumps(r["body"], sort_keys=True) for r in reqs}) == 1
    # exponential backoff from 100 ms: ~100-150 ms, then ~200-300 ms
    g = gaps(reqs)
    assert g[0] >= 0.09 and g[1] >= 0.19, g
    assert g[0] < 1.5 and g[1] < 1.5, g
    turns = turns_of(conn, res["run_id"])
    assert [t["status"] for t in turns] == [status, status, 200]
    assert all(f"HTTP {status}" in t["error"] for t in turns[:2])
    assert sum(r[1] for r in events(conn, res["run_id"], "llm_turn")) == turns[2]["tokens"]["total"]
    assert journal_violations(conn, [res["run_id"]]) == []


def test_5xx_retry_through_the_workers(conn, provider):
    name = make_agent(conn, provider, [{"fault": "500", "times": 2, "text": "worker answer"}],
                      extra=FAST)
    res = execute(conn, name, mode="worker")
    assert res["end"] == "done" and res["response"] == "worker answer", res
    assert [r["status"] for r in sent(name)] == [500, 500, 200]
    assert len(turns_of(conn, res["run_id"])) == 3


def test_permanent_500_gives_up_after_the_attempts(conn, provider, mode):
    name = make_agent(conn, provider, [{"fault": "500", "message": "the model is down"}],
                      extra=FAST)
    res = execute(conn, name, mode=mode)
    error, kind = error_of(res)
    assert error == "the model answered HTTP 500: the model is down", error
    assert kind == "llm_error"
    assert [r["status"] for r in sent(name)] == [500, 500, 500]
    assert len(turns_of(conn, res["run_id"])) == 3
    done = completed_event(conn, res["run_id"])
    assert done["signal"] == "error" and done["error_type"] == "llm_error"
    assert done["detail"] == "Gave up after 3 attempts.", done
    assert res["context"]["_last_error"] == error


def test_default_retry_is_three_attempts_with_a_one_second_backoff(conn, provider):
    name = make_agent(conn, provider, [{"fault": "500"}])
    res = execute(conn, name)
    error, _ = error_of(res)
    assert "HTTP 500" in error
    reqs = sent(name)
    assert len(reqs) == 3
    g = gaps(reqs)
    # 1 s then 2 s, each plus up to 50 % jitter
    assert 0.95 <= g[0] < 1.5 + 0.6 and 1.95 <= g[1] < 3.0 + 0.6, g


def test_attempts_one_means_no_retry(conn, provider):
    name = make_agent(conn, provider, [{"fault": "500", "times": 1, "text": "x"}],
                      extra=retry_yaml(attempts=1))
    error, _ = error_of(execute(conn, name))
    assert "HTTP 500" in error
    assert len(sent(name)) == 1


def test_retry_on_timeout_only_does_not_retry_errors(conn, provider):
    name = make_agent(conn, provider, [{"fault": "500", "times": 1, "text": "x"}],
                      extra=retry_yaml(on=["timeout"], attempts=3, backoff="100ms"))
    error, kind = error_of(execute(conn, name))
    assert "HTTP 500" in error and kind == "llm_error"
    assert len(sent(name)) == 1


def test_exhausted_quota_is_final_and_its_message_surfaces(conn, provider, mode):
    name = make_agent(conn, provider, [{"fault": "quota"}], extra=FAST)
    res = execute(conn, name, mode=mode)
    error, kind = error_of(res)
    if provider == "openai":
        assert error.startswith("the model answered HTTP 429: You exceeded your current quota"), error
    else:
        assert error.startswith("the model answered HTTP 400: Your credit balance is too low"), error
    assert kind == "llm_error"
    assert len(sent(name)) == 1, "an account out of money is never retried"
    assert "detail" not in completed_event(conn, res["run_id"])


def test_quota_is_final_even_with_retry_after(conn, provider):
    name = make_agent(conn, provider, [{"fault": "quota", "retry_after": 1}], extra=FAST)
    error, _ = error_of(execute(conn, name))
    assert "quota" in error or "credit balance" in error, error
    assert len(sent(name)) == 1


def test_bad_request_is_final_with_the_providers_message(conn, provider):
    name = make_agent(conn, provider, [{"fault": "bad_request",
                                        "message": "messages: too long for this model"}],
                      extra=FAST)
    res = execute(conn, name)
    error, kind = error_of(res)
    assert error == "the model answered HTTP 400: messages: too long for this model", error
    assert kind == "llm_error"
    assert len(sent(name)) == 1
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["status"] == 400 and turn["response"]["error"]["message"] == \
        "messages: too long for this model"


@pytest.mark.parametrize("status", ["401", "404"])
def test_other_4xx_are_final(conn, provider, status):
    name = make_agent(conn, provider, [{"fault": status}], extra=FAST)
    error, _ = error_of(execute(conn, name))
    assert f"HTTP {status}" in error
    assert len(sent(name)) == 1


def test_malformed_body_is_a_final_error(conn, provider):
    name = make_agent(conn, provider, [{"fault": "malformed", "times": 1, "text": "x"}], extra=FAST)
    res = execute(conn, name)
    error, kind = error_of(res)
    assert error == "the model's response is not a JSON object (malformed or truncated)", error
    assert kind == "llm_error"
    assert len(sent(name)) == 1
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["status"] == 200 and turn["error"] == error


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_empty_answer_is_a_clear_error(conn, provider):
    name = make_agent(conn, provider, [{"fault": "empty", "times": 1, "text": "x"}], extra=FAST)
    res = execute(conn, name)
    error, kind = error_of(res)
    if provider == "openai":
        assert error == "the model's response has no choices", error
    else:
        assert "no content" in error or "empty" in error, error
    assert kind == "llm_error"
    assert "ask_result" not in res["context"]
    assert len(sent(name)) == 1


def test_truncated_body_is_a_transport_error_and_is_retried(conn, provider):
    name = make_agent(conn, provider, [{"fault": "truncated", "times": 1, "text": "whole answer"}],
                      extra=FAST)
    res = execute(conn, name)
    assert res["end"] == "done" and res["response"] == "whole answer", res
    assert len(sent(name)) == 2
    turns = turns_of(conn, res["run_id"])
    assert turns[0]["status"] is None
    assert turns[0]["error"].startswith("could not reach the model: "), turns[0]
    assert turns[1]["status"] == 200


def test_permanently_truncated_body_gives_up(conn, provider):
    name = make_agent(conn, provider, [{"fault": "truncated", "text": "whole answer"}], extra=FAST)
    res = execute(conn, name)
    error, kind = error_of(res)
    assert error.startswith("could not reach the model: ") and kind == "llm_error", error
    assert len(sent(name)) == 3
    assert completed_event(conn, res["run_id"])["detail"] == "Gave up after 3 attempts."


def test_hang_past_the_timeout_is_retried(conn, provider, mode):
    name = make_agent(conn, provider, [{"fault": "hang", "times": 1, "text": "awake"}],
                      extra=FAST, timeout="1s")
    t0 = time.monotonic()
    res = execute(conn, name, mode=mode)
    took = time.monotonic() - t0
    assert res["end"] == "done" and res["response"] == "awake", res
    assert 1.0 <= took < 6, took
    reqs = sent(name)
    assert len(reqs) == 2
    assert reqs[0]["status"] is None, "the first request was never answered"
    g = gaps(reqs)[0]
    assert 1.05 <= g < 3, f"retry {g:.2f} s after the first request (timeout 1 s + ~100 ms)"
    turns = turns_of(conn, res["run_id"])
    assert turns[0]["status"] is None and "timed out" in turns[0]["error"], turns[0]
    assert 950 <= turns[0]["latency_ms"] < 3000


def test_hang_is_not_retried_when_retry_is_on_error_only(conn, provider):
    name = make_agent(conn, provider, [{"fault": "hang", "times": 1, "text": "awake"}],
                      extra=retry_yaml(on=["error"], attempts=3, backoff="100ms"), timeout="1s")
    res = execute(conn, name)
    error, kind = error_of(res)
    assert "timed out" in error and kind == "timeout", (error, kind)
    assert len(sent(name)) == 1


def test_permanent_hang_gives_up_after_the_attempts(conn, provider):
    name = make_agent(conn, provider, [{"fault": "hang"}], extra=FAST, timeout="1s")
    t0 = time.monotonic()
    res = execute(conn, name)
    took = time.monotonic() - t0
    error, kind = error_of(res)
    assert "timed out" in error and kind == "timeout"
    assert len(sent(name)) == 3
    assert 3.0 <= took < 8, took
    assert completed_event(conn, res["run_id"])["detail"] == "Gave up after 3 attempts."


def test_a_refused_connection_is_retried(conn, provider):
    # a port nobody listens on
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    name = new_name()
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: {provider}\nbase_url: http://127.0.0.1:{port}/v1\nmodel: m\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name, extra=FAST),))
    res = execute(conn, name)
    error, kind = error_of(res)
    assert error.startswith("could not reach the model: ") and kind == "llm_error", error
    assert len(turns_of(conn, res["run_id"])) == 3


def test_a_host_outside_the_allow_list_is_refused(conn, provider):
    name = new_name()
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: {provider}\nbase_url: http://127.0.0.2:9/v1\nmodel: m\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name, extra=FAST),))
    res = execute(conn, name)
    error, _ = error_of(res)
    assert "is not allowed" in error, error
    assert turns_of(conn, res["run_id"]) == []


# ---------------------------------------------------------------------------
# The API key


@pytest.fixture(scope="module")
def outsider(db):
    """A plain role that can connect to the module's database."""
    admin = connect("postgres")
    q(admin, f"DROP ROLE IF EXISTS {OUTSIDER}")
    q(admin, f"CREATE ROLE {OUTSIDER} LOGIN IN ROLE tuvl_user")
    yield OUTSIDER
    try:
        q(admin, f"DROP OWNED BY {OUTSIDER}")
    except psycopg2.Error:
        pass
    try:
        conn = connect(db)
        q(conn, f"DROP OWNED BY {OUTSIDER}")
        conn.close()
        q(admin, f"DROP ROLE IF EXISTS {OUTSIDER}")
    except psycopg2.Error:
        pass
    admin.close()


def all_text(conn):
    """Every place a run keeps text: the journal and the runs table."""
    return (q1(conn, "SELECT coalesce(string_agg(payload::text, ' '), '') FROM tuvl.events") + " " +
            q1(conn, "SELECT coalesce(string_agg(concat_ws(' ', input::text, context::text, "
                     "response::text, error, step_state::text), ' '), '') FROM tuvl.runs"))


def server_log_text():
    with open(SERVER_LOG, encoding="utf-8", errors="replace") as f:
        return f.read()


def test_the_api_key_is_sent_only_in_its_header(conn, provider, mode):
    key = "sk-" + uuid.uuid4().hex
    secret = "llm_key_" + uuid.uuid4().hex[:8]
    q(conn, "SELECT tuvl.set_secret(%s, %s)", (secret, key))
    # the provider echoes the key in its answers: tuvl must scrub it from what it keeps
    ok = make_agent(conn, provider, [{"text": f"your key is {key}"}], key_secret=secret)
    bad = make_agent(conn, provider, [{"fault": "bad_request",
                                       "message": f"Incorrect API key provided: {key}"}],
                     key_secret=secret)
    flaky = make_agent(conn, provider, [{"fault": "500", "message": f"key {key} is unlucky"}],
                       key_secret=secret, extra=FAST)

    res = execute(conn, ok, mode=mode)
    assert res["end"] == "done", res
    assert res["response"] == "your key is [redacted]"
    error, _ = error_of(execute(conn, bad, mode=mode))
    assert error == "the model answered HTTP 400: Incorrect API key provided: [redacted]", error
    res = execute(conn, flaky, mode=mode)
    error, _ = error_of(res)
    assert error == "the model answered HTTP 500: key [redacted] is unlucky", error
    assert completed_event(conn, res["run_id"])["detail"] == "Gave up after 3 attempts."

    for name in (ok, bad, flaky):
        for req in sent(name):
            if provider == "openai":
                assert req["headers"]["authorization"] == f"Bearer {key}"
            else:
                assert req["headers"]["x-api-key"] == key
            assert key not in json.dumps(req["body"])

    assert key not in all_text(conn)
    assert key not in server_log_text()
    assert q1(conn, "SELECT count(*) FROM tuvl.llms WHERE definition::text LIKE %s",
              (f"%{key}%",)) == 0


def test_a_key_with_json_special_characters_is_scrubbed_in_every_form(conn, provider):
    key = 'sk-"q\\' + uuid.uuid4().hex + '/+='
    q(conn, "SELECT tuvl.set_secret('llm_odd_key', %s)", (key,))
    name = make_agent(conn, provider, [{"fault": "bad_request", "message": f"bad key {key}"}],
                      key_secret="llm_odd_key")
    res = execute(conn, name)
    error, _ = error_of(res)
    assert error == "the model answered HTTP 400: bad key [redacted]", error
    (req,) = sent(name)
    assert req["headers"]["authorization" if provider == "openai" else "x-api-key"].endswith(key)
    escaped = json.dumps(key)[1:-1]
    text = all_text(conn)
    assert key not in text and escaped not in text
    assert key not in server_log_text()


def test_a_key_in_the_conversation_is_scrubbed_from_the_journaled_request(conn, provider):
    """The request is journaled as it was sent, but with the config's key
    scrubbed: a prompt that carries the key (here the run's input) sends it
    to the model, and the llm_turn's request keeps [redacted] in its place,
    however JSON escapes it."""
    key = 'sk-"q\\' + uuid.uuid4().hex
    secret = "llm_conv_" + uuid.uuid4().hex[:8]
    q(conn, "SELECT tuvl.set_secret(%s, %s)", (secret, key))
    name = make_agent(conn, provider, [{"text": "hello"}], key_secret=secret)
    res = execute(conn, name, {"name": key})
    assert res["end"] == "done", res
    (req,) = sent(name)
    assert any(f"Greet {key}." in s for s in json_strings(req["body"])), req["body"]
    request = q1(conn, "SELECT payload->'request' FROM tuvl.events "
                       "WHERE run_id = %s AND type = 'llm_turn'", (res["run_id"],))
    assert any("Greet [redacted]." in s for s in json_strings(request)), request
    text = json.dumps(request)
    assert key[-32:] not in text and json.dumps(key)[1:-1] not in text
    assert q1(conn, "SELECT tuvl.llm_request(run_id, seq) FROM tuvl.events "
                    "WHERE run_id = %s AND type = 'llm_turn'", (res["run_id"],)) == request


def json_strings(v):
    """Every string in a JSON value, keys and values."""
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from json_strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from json_strings(x)


def test_secrets_are_not_readable_by_other_roles(db, conn, outsider, conns):
    q(conn, "SELECT tuvl.set_secret('llm_hidden', 'sk-hidden-value')")
    name = new_name()
    register_llm(conn, name, "anthropic", key_secret="llm_hidden")
    other = conns(db, user=outsider)
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(other, "SELECT value FROM tuvl.secrets")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(other, "SELECT name FROM tuvl.secrets")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(other, "SELECT tuvl.set_secret('llm_hidden', 'overwritten')")
    # the model configs are readable by everyone: they name the secret, never hold it
    source, definition = q(other, "SELECT source, definition::text FROM tuvl.llms WHERE name = %s",
                           (name,))[0]
    assert "api_key_secret: llm_hidden" in source
    assert "sk-hidden-value" not in source + definition
    assert q1(conn, "SELECT value FROM tuvl.secrets WHERE name = 'llm_hidden'") == "sk-hidden-value"


def test_a_plain_role_runs_an_agent_with_a_shared_config(db, conn, outsider, conns, provider):
    key = "sk-" + uuid.uuid4().hex
    secret = "llm_shared_" + provider
    q(conn, "SELECT tuvl.set_secret(%s, %s)", (secret, key))
    name = new_name()
    script(name, [{"text": "hello from a shared model"}])
    register_llm(conn, name, provider, key_secret=secret)
    # a model config of another role needs its use granted (docs/security.md)
    q(conn, "SELECT tuvl.grant_use('llm', %s, %s)", (name, outsider))
    other = conns(db, user=outsider)
    q(other, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name),))
    # without a grant for the key the outsider's run sends nothing
    res = execute(other, name)
    assert res["end"] != "done" and sent(name) == [], res
    assert res["context"]["_last_error"] == \
        f'secret "{secret}" named by LLM config "{name}" is not available to role "{outsider}"'

    q(conn, "SELECT tuvl.grant_secret(%s, %s)", (secret, outsider))
    res = execute(other, name)
    assert res["end"] == "done" and res["response"] == "hello from a shared model", res
    ((_, tokens, _, turn),) = events(other, res["run_id"], "llm_turn")
    assert tokens > 0 and turn["model"] == name
    (req,) = sent(name)
    assert key in (req["headers"].get("authorization", "") + req["headers"].get("x-api-key", ""))


def test_who_may_register_and_replace_a_model_config(db, conn, outsider, conns):
    other = conns(db, user=outsider)
    mine = new_name("mine")
    theirs = new_name("theirs")
    register_llm(other, mine, "openai")
    assert q1(conn, "SELECT owner::text FROM tuvl.llms WHERE name = %s", (mine,)) == outsider
    register_llm(conn, theirs, "openai")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege) as e:
        register_llm(other, theirs, "anthropic")
    assert f'LLM config "{theirs}" belongs to another role' in str(e.value)
    assert q1(conn, "SELECT provider FROM tuvl.llms WHERE name = %s", (theirs,)) == "openai"
    # the owner replaces its own config; a superuser may not, until it is handed over
    register_llm(other, mine, "anthropic")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        register_llm(conn, mine, "openai", model="gpt-x")
    q(conn, "SELECT tuvl.transfer('llm', %s, 'postgres')", (mine,))
    register_llm(conn, mine, "openai", model="gpt-x")
    assert q(conn, "SELECT provider, definition ->> 'model', owner::text FROM tuvl.llms WHERE name = %s",
             (mine,)) == [("openai", "gpt-x", "postgres")]


# ---------------------------------------------------------------------------
# Private context keys

SSN = "123-45-6789"


def test_private_keys_are_never_sent_to_the_model(conn, provider, mode):
    name = make_agent(conn, provider, [{"text": "Summary: {{last_user}}"}],
                      prompt="Summarize the customer {{ name }}.",
                      system="You summarize customers.")
    res = execute(conn, name, {"_ssn": SSN, "name": "x"}, mode)
    assert res["end"] == "done" and res["response"] == "Summary: Summarize the customer x.", res
    (req,) = sent(name)
    assert SSN not in json.dumps(req) and "_ssn" not in json.dumps(req["body"])
    (turn,) = turns_of(conn, res["run_id"])
    assert SSN not in json.dumps(turn["request"])
    # the private key stays in the context
    assert res["context"]["_ssn"] == SSN


@pytest.mark.parametrize("where", ["prompt", "system"])
def test_a_template_naming_a_private_key_fails_and_sends_nothing(conn, provider, where):
    templates = {"prompt": "Check {{ _ssn }} for {{ name }}.", "system": SYSTEM}
    if where == "system":
        templates = {"prompt": "Check {{ name }}.", "system": "The SSN is {{ _ssn }}."}
    name = make_agent(conn, provider, [{"text": "never"}], **templates)
    res = execute(conn, name, {"_ssn": SSN, "name": "x"})
    error, kind = error_of(res)
    assert kind == "template_error", (error, kind)
    assert "_ssn" in error and SSN not in error, error
    assert sent(name) == []
    assert turns_of(conn, res["run_id"]) == []


def test_secrets_cannot_be_used_in_prompts(conn, provider):
    q(conn, "SELECT tuvl.set_secret('llm_prompt_secret', 'sk-not-for-models')")
    name = make_agent(conn, provider, [{"text": "never"}],
                      system="The key is {{ secrets.llm_prompt_secret }}.")
    res = execute(conn, name)
    error, kind = error_of(res)
    assert error == "secrets are not available in this template" and kind == "template_error"
    assert sent(name) == []


def test_the_echo_script_never_sees_private_keys(conn, provider):
    name = new_name()
    register_llm(conn, name, provider, model="echo")
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(
        name, name, prompt="Customer {{ name }} with {{ plan }}"),))
    res = execute(conn, name, {"_ssn": SSN, "_card": "4111", "name": "x", "plan": "gold"})
    assert res["response"] == "Summary: Customer x with gold", res
    (turn,) = turns_of(conn, res["run_id"])
    assert SSN not in json.dumps(turn) and "4111" not in json.dumps(turn)


# ---------------------------------------------------------------------------
# Counting tokens


def test_tokens_per_run_and_per_workflow(conn, provider):
    name = make_agent(conn, provider, [{"fault": "500", "times": 1, "text": "two calls",
                                        "usage": {"prompt_tokens": 100, "completion_tokens": 20}}],
                      extra=FAST)
    ids = [execute(conn, name)["run_id"] for _ in range(2)]
    # the failed first call of the first run used no tokens; the retry of that
    # run and the second run (its counter is spent) used 120 each
    rows = q(conn, "SELECT run_id, count(*), sum(tokens), "
                   "sum((payload -> 'tokens' ->> 'prompt')::int) "
                   "FROM tuvl.events WHERE type = 'llm_turn' AND run_id = ANY(%s) "
                   "GROUP BY run_id ORDER BY run_id", (ids,))
    assert rows == [(ids[0], 2, 120, 100), (ids[1], 1, 120, 100)], rows
    assert q(conn, """SELECT r.workflow, date_trunc('day', e.ts) = date_trunc('day', now()),
                             count(*), sum(e.tokens)
                        FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id
                       WHERE e.type = 'llm_turn' AND r.workflow = %s
                       GROUP BY 1, 2""", (name,)) == [(name, True, 3, 240)]


# ---------------------------------------------------------------------------
# kill -9 of a worker while a call is in flight


def test_crash_kill_9_while_a_call_is_in_flight_resends_it_once(db, provider, server_log):
    conn = connect(db)
    try:
        name = make_agent(conn, provider, [{"text": "slow answer", "latency_ms": 3000}])
        run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"name\": \"Ada\"}')", (name,))
        wait_until(lambda: len(sent(name)) == 1, 10, message="the request to reach the server")
        holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        assert holder, "a worker holds the run"
        assert q1(conn, "SELECT backend_type FROM pg_stat_activity WHERE pid = %s",
                  (holder,)) == "tuvl worker"
    finally:
        conn.close()
    kill_worker(holder, server_log)
    conn = connect(db)
    try:
        wait_run_finished(conn, run_id)
        status, end, response, attempt = q(
            conn, "SELECT status, end_name, response, attempt FROM tuvl.runs WHERE id = %s",
            (run_id,))[0]
        assert (status, end, response) == ("completed", "done", "slow answer")
        assert attempt >= 2, "the run was claimed again after the crash"
        reqs = sent(name)
        assert len(reqs) == 2, [(r["status"], r.get("disconnected")) for r in reqs]
        assert reqs[0]["status"] is None, "the first request never got its answer to tuvl"
        assert reqs[1]["status"] == 200
        assert reqs[0]["body"] == reqs[1]["body"]
        assert len(turns_of(conn, run_id)) == 1, "exactly one llm_turn for the call"
        assert journal_violations(conn, [run_id]) == []
        assert [e[0] for e in events(conn, run_id)].count("agent_started") == 1
    finally:
        conn.close()


def test_crash_kill_9_during_the_backoff_before_a_retry_loses_no_attempt(db, server_log):
    conn = connect(db)
    try:
        name = make_agent(conn, "openai", [{"fault": "500", "times": 1, "text": "retried"}],
                          extra=retry_yaml(attempts=3, backoff="3s"))
        run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"name\": \"Ada\"}')", (name,))
        # the failed first call is journaled, then the run waits out the backoff
        wait_until(lambda: len(turns_of(conn, run_id)) == 1, 10,
                   message="the failed first call to be journaled")
        holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        assert holder and len(sent(name)) == 1
    finally:
        conn.close()
    kill_worker(holder, server_log)
    conn = connect(db)
    try:
        wait_run_finished(conn, run_id)
        assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,)) == "retried"
        assert [r["status"] for r in sent(name)] == [500, 200]
        assert [t["status"] for t in turns_of(conn, run_id)] == [500, 200]
        assert journal_violations(conn, [run_id]) == []
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# Guardrails of a completion agent: input and output gates


def register_guardrail(conn, check):
    name = new_name("guard")
    q(conn, "SELECT tuvl.register_artifact(%s)",
      (f"name: {name}\ntype: guardrail\nchecks:\n  - {check}\n",))
    return name


GUARD_ENDS = ('  - { id: blocked, status: completed, response: { error: "{{ _last_error }}", '
              'type: "{{ _last_error_type }}" } }\n')


def guarded(conn, provider, turns, gate, guard, prompt="Greet {{ name }}."):
    return make_agent(conn, provider, turns, prompt=prompt,
                      extra=f"      guardrails: {{ {gate}: [artifact://{guard}@1] }}\n",
                      routes="{ default: done, error: oops, guardrail_violation: blocked }",
                      ends=GUARD_ENDS)


def test_a_completion_agents_input_gate_stops_the_call_before_it_is_sent(conn, provider, mode):
    guard = register_guardrail(conn, "{ check: regex_deny, pattern: 'Mallory' }")
    name = guarded(conn, provider, [{"text": "never"}], "input", guard)
    res = execute(conn, name, {"name": "Mallory"}, mode)
    assert res["end"] == "blocked", res
    assert res["response"] == {
        "type": "guardrail_violation",
        "error": f'guardrail "{guard}" (version 1) stopped the model\'s input at the input gate: '
                 "check 1 (regex_deny): the content matches Mallory"}
    assert sent(name) == []
    # the same guardrail lets another name through
    res = execute(conn, name, {"name": "Ada"}, mode)
    assert res["end"] == "done" and res["response"] == "never", res


def test_a_completion_agents_output_gate_stops_the_answer_before_it_is_written(conn, provider):
    guard = register_guardrail(conn, "{ check: max_length, max: 5 }")
    name = guarded(conn, provider, [{"text": "Hello, Ada!"}], "output", guard)
    res = execute(conn, name, {"name": "Ada"})
    assert res["end"] == "blocked", res
    assert "stopped the final answer at the output gate: check 1 (max_length): the content has " \
           "11 characters, more than 5" in res["response"]["error"]
    assert "ask_result" not in res["context"]
    assert len(sent(name)) == 1
    assert [r[3] for r in events(conn, res["run_id"], "signal")] == [{"signal": "guardrail_violation"}]


def test_a_tools_gate_on_a_completion_agent_is_a_validation_error(conn):
    guard = register_guardrail(conn, "{ check: max_length, max: 5 }")
    src = agent_workflow("tools_gate", "m",
                         extra=f"      guardrails: {{ tools: [artifact://{guard}@1] }}\n",
                         routes="{ default: done, error: oops, guardrail_violation: done }")
    rows = q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,))
    assert any(r[0] == "error" and r[1].startswith("steps[0].agent.guardrails.tools") for r in rows), rows


def test_a_completion_agents_pii_mask_masks_the_prompt_and_the_answer(conn, provider):
    guard = register_guardrail(conn, "{ check: pii_mask, patterns: [email] }")
    name = make_agent(conn, provider, [{"text": "I wrote to bob@example.org."}],
                      prompt="Write to {{ name }}.",
                      extra=(f"      guardrails: {{ input: [artifact://{guard}@1], "
                             f"output: [artifact://{guard}@1] }}\n"),
                      routes="{ default: done, error: oops, guardrail_violation: blocked }",
                      ends=GUARD_ENDS)
    res = execute(conn, name, {"name": "ada@example.com"})
    assert res["end"] == "done", res
    assert res["response"] == "I wrote to [email]."
    body = json.dumps(sent(name)[0]["body"])
    assert "ada@example.com" not in body and "Write to [email]." in body
    # the input as given is journaled by run_queued; nothing the step journals holds it
    leaks = q(conn, "SELECT type FROM tuvl.events WHERE run_id = %s AND "
                    "(payload::text LIKE '%%bob@example.org%%' OR payload::text LIKE '%%ada@example.com%%')",
              (res["run_id"],))
    assert leaks == [("run_queued",)], leaks



# ---------------------------------------------------------------------------
# Provider details: headers, missing call ids, token details, streaming


def test_config_headers_are_sent_with_secrets_and_never_journaled(conn, provider):
    name = new_name()
    script(name, [{"text": "Hi."}])
    q(conn, "SELECT tuvl.set_secret('llm_header_key', 'hdr-s3cret-value')")
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: {provider}\nbase_url: {LLM_URL}\nmodel: {name}\n"
        "headers: { api-key: '{{ secrets.llm_header_key }}', OpenAI-Project: proj_1, "
        "anthropic-beta: 'tools-2024-04-04' }\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name),))
    res = execute(conn, name)
    assert res["response"] == "Hi.", res
    (req,) = sent(name)
    assert req["headers"]["api-key"] == "hdr-s3cret-value"
    assert req["headers"]["openai-project"] == "proj_1"
    assert req["headers"]["anthropic-beta"] == "tools-2024-04-04"
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND payload::text LIKE "
                    "'%%hdr-s3cret%%'", (res["run_id"],)) == 0


@pytest.mark.parametrize("extra,message", [
    ("headers: [a]", "headers must be a mapping"),
    ("headers: { Content-Type: text/plain }", 'header "Content-Type" is set by tuvl'),
    ("headers: { 'bad header': x }", '"bad header" is not a header name'),
    ("headers: { X-N: 3 }", 'header "X-N" must be text'),
    ("params: { stream: true }", "params.stream is not available in this version of tuvl"),
])
def test_bad_headers_and_streaming_are_refused_at_registration(conn, extra, message):
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.register_llm(%s)", (
            f"name: {new_name()}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: m\n{extra}\n",))
    assert message in str(e.value), str(e.value)


def test_tool_calls_without_ids_get_ids_the_answers_refer_to(conn, provider):
    """Some OpenAI-compatible servers send tool calls without an id: tuvl
    makes one, and the tool's answer refers to it (the scripted server
    refuses a conversation whose tool calls have no ids)."""
    name = new_name()
    script(name, [{"tool_calls": [{"name": "lookup", "arguments": {"q": "a"}}], "no_ids": True},
                  {"text": "Found it."}])
    register_llm(conn, name, provider)
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - id: triage\n    kind: Agent\n    mode: autonomous\n"
        f"    agent:\n      model: {name}\n      steering: Look it up.\n      tools: [{{ ref: lookup }}]\n"
        "    routes: { default: done, error: oops }\n"
        "  - { id: lookup, kind: ModelOp, description: Look up, sql: 'SELECT 1 AS one' }\n"
        "ends:\n  - { id: done, status: completed, response: '{{ triage_result }}' }\n"
        "  - { id: oops, status: completed, response: '{{ _last_error }}' }\n",))
    res = execute(conn, name)
    assert res["response"] == "Found it.", res
    second = sent(name)[1]["body"]
    text = json.dumps(second)
    assert "call_tuvl_0_" in text, text
    ids = set()
    for m in second.get("messages", []):
        for tc in m.get("tool_calls") or []:
            ids.add(tc["id"])
        if m.get("role") == "tool":
            assert m["tool_call_id"] in ids
        for block in m.get("content") if isinstance(m.get("content"), list) else []:
            if block.get("type") == "tool_use":
                ids.add(block["id"])
            if block.get("type") == "tool_result":
                assert block["tool_use_id"] in ids
    assert ids and all(i.startswith("call_tuvl_0_") for i in ids), ids


def test_cached_and_reasoning_tokens_are_journaled(conn, provider):
    name = make_agent(conn, provider, [{"text": "Hi.", "usage": {"prompt_tokens": 100, "completion_tokens": 40},
                                        "cached_tokens": 64, "reasoning_tokens": 30}])
    res = execute(conn, name)
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["tokens"]["cached"] == 64
    if provider == "openai":
        assert turn["tokens"]["reasoning"] == 30
    assert turn["tokens"]["total"] == 140


def test_an_empty_anthropic_answer_keeps_its_finish_reason(conn):
    name = make_agent(conn, "anthropic", [{"fault": "empty"}], extra=retry_yaml(attempts=1))
    res = execute(conn, name)
    assert res["end"] == "oops", res
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["finish_reason"] == "end_turn" and "no content" in turn["error"], turn


# ---------------------------------------------------------------------------
# provider: openai_responses (the OpenAI Responses API)


def test_responses_request_is_input_items_and_the_answer_is_read_from_output(conn, mode):
    name = make_agent(conn, "openai_responses", [{"text": "Hello, Ada.", "cached_tokens": 8,
                                                  "reasoning_tokens": 5,
                                                  "usage": {"prompt_tokens": 30, "completion_tokens": 12}}],
                      key_secret=None, params={"reasoning": {"effort": "low"}})
    res = execute(conn, name, mode=mode)
    assert (res["end"], res["response"]) == ("done", "Hello, Ada."), res
    (req,) = sent(name)
    assert req["path"] == "/v1/responses"
    body = req["body"]
    assert "messages" not in body and body["instructions"] == SYSTEM
    assert body["input"] == [{"role": "user", "content": "Greet Ada."}]
    assert body["reasoning"] == {"effort": "low"}
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["provider"] == "openai_responses" and turn["finish_reason"] == "stop"
    assert turn["tokens"] == {"prompt": 30, "completion": 12, "total": 42, "cached": 8, "reasoning": 5}
    assert turn["response"]["object"] == "response"


def test_responses_cut_short_and_empty_answers(conn):
    name = make_agent(conn, "openai_responses", [{"text": "Hello, A", "finish": "length"}])
    res = execute(conn, name)
    assert res["end"] == "done", res
    (turn,) = turns_of(conn, res["run_id"])
    assert turn["finish_reason"] == "length" and turn["response"]["status"] == "incomplete"
    name = make_agent(conn, "openai_responses", [{"fault": "empty"}], extra=retry_yaml(attempts=1))
    res = execute(conn, name)
    assert error_of(res) == ("the model's response has no output (no text and no tool call)", "llm_error")


def test_responses_sends_the_key_and_refuses_nothing_else(conn):
    q(conn, "SELECT tuvl.set_secret('responses_key', 'sk-resp-123')")
    name = make_agent(conn, "openai_responses", [{"text": "ok"}], key_secret="responses_key")
    assert execute(conn, name)["end"] == "done"
    (req,) = sent(name)
    assert req["headers"]["authorization"] == "Bearer sk-resp-123"
    assert "sk-resp-123" not in json.dumps(q(conn, "SELECT payload FROM tuvl.events"))


# ---------------------------------------------------------------------------
# structured_outputs


@pytest.mark.parametrize("provider", ["openai", "openai_responses"])
def test_structured_outputs_send_the_outcome_contract_as_a_json_schema(conn, provider):
    name = new_name()
    script(name, [{"text": '{"outcome": "refund", "result": "charged twice"}'}])
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: {provider}\nbase_url: {LLM_URL}\nmodel: {name}\nstructured_outputs: true\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(
        name, name, extra="      outcome: { enum: [refund, reply] }\n",
        routes="{ refund: done, reply: done, error: oops }"),))
    res = execute(conn, name)
    assert (res["end"], res["response"]) == ("done", "charged twice"), res
    (req,) = sent(name)
    schema = {"type": "object", "properties": {"outcome": {"type": "string", "enum": ["refund", "reply"]},
                                               "result": {}},
              "required": ["outcome", "result"]}
    if provider == "openai":
        assert req["body"]["response_format"] == {"type": "json_schema", "json_schema": {
            "name": "tuvl_answer", "schema": schema}}
    else:
        assert req["body"]["text"] == {"format": {"type": "json_schema", "name": "tuvl_answer", "schema": schema}}
    # the format is still stated in the prompt, and an answer is still checked
    system = req["body"]["messages"][0]["content"] if provider == "openai" else req["body"]["instructions"]
    assert '"outcome"' in system


def test_structured_outputs_are_off_by_default_and_params_win(conn):
    name = make_agent(conn, "openai", [{"text": '{"outcome": "reply", "result": "x"}'}],
                      extra="      outcome: { enum: [reply] }\n", routes="{ reply: done, error: oops }")
    assert execute(conn, name)["end"] == "done"
    (req,) = sent(name)
    assert "response_format" not in req["body"]
    name = new_name()
    script(name, [{"text": '{"outcome": "reply", "result": "x"}'}])
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: {name}\nstructured_outputs: true\n"
        "params: { response_format: { type: json_object } }\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(
        name, name, extra="      outcome: { enum: [reply] }\n", routes="{ reply: done, error: oops }"),))
    assert execute(conn, name)["end"] == "done"
    (req,) = sent(name)
    assert req["body"]["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("extra,message", [
    ("structured_outputs: true\n",
     'LLM config "x": structured_outputs is not available for provider anthropic'),
    ("structured_outputs: yes please\n", 'LLM config "x": structured_outputs must be true or false'),
])
def test_structured_outputs_are_checked_at_registration(conn, extra, message):
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.register_llm(%s)", (
            f"name: x\nprovider: anthropic\nbase_url: {LLM_URL}\nmodel: m\n{extra}",))
    assert e.value.pgerror.split("\n")[0] == "ERROR:  " + message


# ---------------------------------------------------------------------------
# Versions of a model config


def test_a_run_keeps_the_model_config_it_started_with(conn):
    """register_llm() makes a new version; a run in flight goes on with the
    version current when it started, a run started after uses the new one."""
    cfg, first, second = new_name("cfg"), new_name(), new_name()
    script(first, [{"text": "from the first version"}] * 2)
    script(second, [{"text": "from the second version"}])
    register_llm(conn, cfg, "openai", model=first)
    wf = new_name("w")
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {wf}
steps:
  - {{ id: nap, kind: Sleep, for: 2s, routes: {{ default: ask }} }}
  - {{ id: ask, kind: Agent, mode: completion, agent: {{ model: {cfg}, prompt: Hello }},
      routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "{{{{ ask_result }}}}" }}
""",))
    old = q1(conn, "SELECT tuvl.start_run(%s)", (wf,))
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (old,)) == "sleeping", 10,
               message="the run to sleep")
    register_llm(conn, cfg, "openai", model=second)
    assert q(conn, "SELECT version, definition ->> 'model' FROM tuvl.llm_versions WHERE name = %s ORDER BY 1",
             (cfg,)) == [(1, first), (2, second)]
    assert q1(conn, "SELECT version FROM tuvl.llms WHERE name = %s", (cfg,)) == 2
    new = q1(conn, "SELECT tuvl.start_run(%s)", (wf,))
    for run_id in (old, new):
        assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (old,)) == "from the first version"
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (new,)) == "from the second version"
    assert len(sent(first)) == 1 and len(sent(second)) == 1
    versions = q(conn, "SELECT run_id, payload ->> 'config_version' FROM tuvl.events "
                       "WHERE run_id = ANY(%s) AND type = 'llm_turn' ORDER BY run_id", ([old, new],))
    assert versions == [(old, "1"), (new, "2")], versions
