"""Replay: pinned fixtures re-executed with every outside result served from the journal.

tuvl.pin_run(run_id) exports an ended run as a fixture (the workflow source,
input, end, response and every model answer, HTTP response, Human data and
approval decision, in order); tuvl.replay(fixture) runs the current version
of the workflow in the calling transaction, serving each outside result from
the fixture instead of asking for it, and raises SQLSTATE 22000 at the first
divergence; tuvl.replay_divergence(fixture) returns NULL or that message.

The model runs here talk to a scripted LLM server of the test's own
(test/servers/llm_server.py started on a free port), which each test stops
before replaying: a replay that asked the model for anything would fail.
The HTTP tools call the project's HTTP test server (TUVL_HTTP_PORT), whose
request log proves that the replay sent nothing.  SQL steps really execute
during a replay; their rows land in rp.calls.

Covered: replay of an autonomous agent with a SQL tool and an HTTP tool with
the model server stopped (same end and response, zero tokens, nothing sent,
no trace of the replay's own run); the divergences an edit causes (a route,
the steering, a tool's URL, a second model call, a step removed); the
Idempotency-Key of a compensating APICall (what the server received = the
recorded journal = key_base-<entry seq>-0 = what the replay's request
carried) and ctx.idempotency_key of a Functional step; pin_run errors;
replay_divergence; a replay rolled back with its transaction; Human data and
approval decisions served from the recording; redaction of private keys.
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, wait_until

HTTP_PORT = int(os.environ.get("TUVL_HTTP_PORT") or 0)
HTTP_BASE = f"http://127.0.0.1:{HTTP_PORT}"
PYTHON = os.environ.get("TUVL_PYTHON") or "/usr/bin/python3"
LLM_SERVER = os.path.join(os.path.dirname(__file__), "..", "servers", "llm_server.py")

pytestmark = pytest.mark.skipif(not HTTP_PORT, reason="TUVL_HTTP_PORT is not set (run through test/run)")

# Never let an http_proxy variable send the tests' own requests elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

SCHEMA = """
CREATE SCHEMA rp;
CREATE TABLE rp.calls (id bigserial PRIMARY KEY, tag text, what text, key text);
CREATE FUNCTION rp.record(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    INSERT INTO rp.calls (tag, what, key) VALUES (ctx ->> 'tag', coalesce(ctx ->> 'note', 'record'),
                                                  ctx ->> 'idempotency_key')
    RETURNING jsonb_build_object('recorded', what, 'key', key) $$;
CREATE FUNCTION rp.nap(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    SELECT pg_sleep(1.5); SELECT '{}'::jsonb $$;
-- what the replay's own journal held, before it was deleted
CREATE TABLE rp.seen (run_id bigint, seq int, type text, agent_id text, payload jsonb);
CREATE FUNCTION rp.see() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO rp.seen SELECT NEW.run_id, e.seq, e.type, e.agent_id, e.payload
            FROM tuvl._journal_events(NEW.seq, NEW.events) e;
        RETURN NULL;
    END $$;
"""


def _json(url, method="GET", body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=10) as resp:
        return json.loads(resp.read().decode())


def http_requests(token):
    """The requests the HTTP test server received whose path holds token."""
    return [r for r in _json(HTTP_BASE + "/_log")["requests"] if token in r["path"]]


def port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class LlmServer:
    """A scripted LLM server of our own, on a free port, that a test can stop."""

    def __init__(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.proc = subprocess.Popen([PYTHON, LLM_SERVER, "--port", str(self.port)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        wait_until(lambda: port_open(self.port), 15, interval=0.05,
                   message=f"the scripted LLM server on port {self.port}")
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def script(self, name, turns):
        assert _json(f"http://127.0.0.1:{self.port}/_script", "POST",
                     {"name": name, "turns": turns})["ok"]

    def sent(self, model):
        return _json(f"http://127.0.0.1:{self.port}/_log?model={model}")["requests"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        assert not port_open(self.port), "the LLM server still listens"


@pytest.fixture
def llm():
    server = LlmServer()
    yield server
    server.stop()


def new_name(prefix="rp"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def rdb(db):
    conn = connect(db)
    try:
        q(conn, SCHEMA)
    finally:
        conn.close()
    return db


@pytest.fixture
def conn(rdb, conns):
    return conns(rdb)


@pytest.fixture(params=["openai", "anthropic"])
def provider(request):
    return request.param


def register_llm(conn, llm, name, provider="openai"):
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: {provider}\nbase_url: {llm.url}\nmodel: {name}\ntimeout: 10s\n",))


def register(conn, source):
    return q1(conn, "SELECT tuvl.register_workflow(%s)", (source,))


def start(conn, name, data):
    return q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (name, json.dumps(data)))


def wait(conn, run_id, timeout=20):
    return q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))


def run_row(conn, run_id):
    status, end, response, error = q(conn, "SELECT status, end_name, response, error FROM tuvl.runs "
                                           "WHERE id = %s", (run_id,))[0]
    return {"status": status, "end": end, "response": response, "error": error}


def pin(conn, run_id):
    return q1(conn, "SELECT tuvl.pin_run(%s)", (run_id,))


def replay(conn, fixture):
    return q1(conn, "SELECT tuvl.replay(%s::jsonb)", (json.dumps(fixture),))


def divergence(conn, fixture):
    return q1(conn, "SELECT tuvl.replay_divergence(%s::jsonb)", (json.dumps(fixture),))


def replay_error(conn, fixture):
    with pytest.raises(psycopg2.errors.DataException) as exc:
        replay(conn, fixture)
    assert exc.value.pgcode == "22000"
    return exc.value.diag.message_primary, exc.value.diag.message_detail


def counts(conn):
    return q(conn, "SELECT (SELECT count(*) FROM tuvl.runs), (SELECT count(*) FROM tuvl.events)")[0]


def events(conn, run_id):
    return q(conn, "SELECT seq, type, agent_id, payload, tokens FROM tuvl.events WHERE run_id = %s "
                   "ORDER BY seq", (run_id,))


# ---------------------------------------------------------------------------
# An autonomous agent replayed with the model server stopped


def agent_source(name, token, route="done", steering="You triage refund requests.",
                 url_path="json"):
    return f"""
name: {name}
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: {name}
      steering: {json.dumps(steering)}
      tools:
        - {{ ref: record }}
        - {{ ref: lookup, parameters: {{ type: object, properties: {{ order: {{ type: integer }} }} }} }}
    routes: {{ default: {route}, error: oops }}
  - id: record
    kind: Functional
    description: Record a note about the request
    function: rp.record
  - id: lookup
    kind: APICall
    description: Look an order up
    http: {{ url: "{HTTP_BASE}/{url_path}?token={token}", query: {{ order: "{{{{ order }}}}" }} }}
ends:
  - {{ id: done, status: completed, response: {{ answer: "{{{{ triage_result }}}}", tag: "{{{{ tag }}}}" }} }}
  - {{ id: reviewed, status: completed, response: {{ answer: "{{{{ triage_result }}}}", tag: "{{{{ tag }}}}" }} }}
  - {{ id: oops, status: failed, response: "{{{{ _last_error }}}}" }}
"""


def test_an_agent_run_replays_with_the_model_server_stopped_and_edits_diverge(conn, llm, provider):
    name = new_name()
    tag = new_name("t")
    token = new_name("tok")
    llm.script(name, [
        {"tool_calls": [{"name": "record", "arguments": {"note": f"{tag} seen"}},
                        {"name": "lookup", "arguments": {"order": 1017}}],
         "usage": {"prompt_tokens": 40, "completion_tokens": 10}},
        {"text": "Refund approved for order 1017.",
         "usage": {"prompt_tokens": 60, "completion_tokens": 8}}])
    register_llm(conn, llm, name, provider)
    register(conn, agent_source(name, token))
    run_id = start(conn, name, {"tag": tag, "_card": "4242"})
    assert wait(conn, run_id) == "completed"
    recorded = run_row(conn, run_id)
    assert recorded["response"] == {"answer": "Refund approved for order 1017.", "tag": tag}
    assert len(llm.sent(name)) == 2 and len(http_requests(token)) == 1
    tokens = sum(e[4] or 0 for e in events(conn, run_id) if e[1] == "llm_turn")
    assert tokens == 118

    fixture = pin(conn, run_id)
    assert fixture["tuvl_fixture"] == 1
    assert (fixture["workflow"], fixture["version"], fixture["run_id"]) == (name, 1, run_id)
    assert (fixture["status"], fixture["end"], fixture["response"]) == \
        ("completed", "done", recorded["response"])
    assert fixture["input"] == {"tag": tag, "_card": "[redacted]"}
    assert fixture["tokens"] == tokens
    assert [(e["step"], e["type"]) for e in fixture["effects"]] == [
        ("triage", "llm"), ("triage", "http"), ("triage", "llm")]
    assert fixture["effects"][1]["request"]["method"] == "GET"
    assert fixture["effects"][1]["request"]["url"] == f"{HTTP_BASE}/json?token={token}&order=1017"
    assert fixture["effects"][1]["result"]["status"] == 200
    assert fixture["source"] == q1(conn, "SELECT source FROM tuvl.workflows WHERE name = %s", (name,))
    assert fixture["key_base"].endswith(f"-{run_id}")

    llm.stop()  # from here on, any model call would fail
    before = counts(conn)
    rows_before = q1(conn, "SELECT count(*) FROM rp.calls WHERE tag = %s", (tag,))
    logged = len(_json(HTTP_BASE + "/_log")["requests"])
    result = replay(conn, fixture)
    assert len(_json(HTTP_BASE + "/_log")["requests"]) == logged, "the replay sent no HTTP request"
    assert result == {"status": "completed", "end": "done", "response": recorded["response"],
                      "effects_served": 3, "effects_live": 0, "transitions": result["transitions"],
                      "tokens_spent": 0, "tokens_recorded": tokens, "workflow_version": 1,
                      "cost_recorded": 0}   # its model config has no price
    assert result["transitions"] >= 3
    assert len(http_requests(token)) == 1
    # the replay's own run and journal are gone; the SQL tool really ran again
    assert counts(conn) == before
    assert q1(conn, "SELECT count(*) FROM rp.calls WHERE tag = %s", (tag,)) == rows_before + 1
    assert divergence(conn, fixture) is None

    # a changed route: a different end
    register(conn, agent_source(name, token, route="reviewed"))
    message, _ = replay_error(conn, fixture)
    assert message == (f'replay of run {run_id} diverged: the recorded run ended at end "done", '
                       f'the replay at end "reviewed"')
    assert divergence(conn, fixture) == message
    # a changed steering: another request to the model
    register(conn, agent_source(name, token, steering="You triage refund requests politely."))
    message, detail = replay_error(conn, fixture)
    assert message == (f'replay of run {run_id} diverged: step "triage" sent the model a different '
                       f'request than the recording (effect 1)')
    assert "Recorded: " in detail and "politely" in detail
    # a changed URL of the HTTP tool
    register(conn, agent_source(name, token, url_path="text"))
    message, _ = replay_error(conn, fixture)
    assert message == (f'replay of run {run_id} diverged: step "triage" sent GET '
                       f'{HTTP_BASE}/text?token={token}&order=1017, but the recording sent GET '
                       f'{HTTP_BASE}/json?token={token}&order=1017 (effect 2)')
    # the workflow as recorded replays again
    register(conn, fixture["source"])
    assert replay(conn, fixture)["workflow_version"] == 5
    assert len(http_requests(token)) == 1 and counts(conn) == before


def completion_source(name, second=False, answer="ask_result"):
    extra = ("    routes: { default: ask2 }\n"
             "  - id: ask2\n    kind: Agent\n    mode: completion\n"
             f"    agent: {{ model: {name}, prompt: \"Again: {{{{ ask_result }}}}\" }}\n"
             "    routes: { default: done }\n") if second else "    routes: { default: done }\n"
    return (f"name: {name}\nsteps:\n"
            "  - id: ask\n    kind: Agent\n    mode: completion\n"
            f"    agent: {{ model: {name}, prompt: \"Summarize {{{{ topic }}}}\" }}\n"
            f"{extra}"
            "ends:\n"
            f"  - {{ id: done, status: completed, response: \"{{{{ {answer} }}}}\" }}\n")


def test_a_replay_that_needs_an_effect_the_recording_lacks_or_leaves_one_unused(conn, llm):
    name = new_name()
    llm.script(name, [{"text": "a short summary"}])
    register_llm(conn, llm, name)
    register(conn, completion_source(name))
    run_id = q1(conn, "SELECT tuvl.run(%s, '{\"topic\": \"refunds\"}')", (name,))["run_id"]
    fixture = pin(conn, run_id)
    llm.stop()
    assert replay(conn, fixture)["response"] == "a short summary"
    # a second model call: the recording holds one answer only
    register(conn, completion_source(name, second=True))
    message, detail = replay_error(conn, fixture)
    assert message == (f'replay of run {run_id} diverged: step "ask2" asked for a model call, '
                       f'which the recording does not hold')
    assert detail == "All 1 recorded effects were used."
    # no model call at all: the recorded answer is left over
    register(conn, f"name: {name}\nsteps:\n  - id: ask\n    kind: Router\n    on: x\n"
                   "    routes: { default: done }\nends:\n  - { id: done, status: completed, "
                   "response: \"a short summary\" }\n")
    message, _ = replay_error(conn, fixture)
    assert message == (f'replay of run {run_id} diverged: the replay used 0 of the 1 recorded '
                       f'effects; the next one is a llm of step "ask"')


# ---------------------------------------------------------------------------
# Idempotency keys


def test_a_compensating_apicall_sends_the_key_the_replay_computes(conn):
    name = new_name()
    token = new_name("tok")
    register(conn, f"""
name: {name}
steps:
  - id: charge
    kind: APICall
    http: {{ method: POST, url: "{HTTP_BASE}/json?token={token}&op=charge", body: {{ amount: 5 }},
            idempotency: auto }}
    compensate: refund
  - id: mark
    kind: Functional
    function: rp.record
    routes: {{ default: cancelled }}
  - id: refund
    kind: APICall
    http: {{ method: DELETE, url: "{HTTP_BASE}/json?token={token}&op=refund", idempotency: auto }}
ends:
  - {{ id: cancelled, status: completed, rollback: true, response: {{ key: "{{{{ mark_result.key }}}}" }} }}
""")
    run_id = start(conn, name, {"tag": token})
    assert wait(conn, run_id) == "compensated"
    sent = {r["path"].rsplit("op=", 1)[1]: r for r in http_requests(token)}
    assert sorted(sent) == ["charge", "refund"] and sent["refund"]["method"] == "DELETE"
    ev = events(conn, run_id)
    started = {a: s for s, t, a, _, _ in ev if t == "agent_started"}
    journaled = {a: p["request"]["idempotency_key"] for _, t, a, p, _ in ev if t == "tool_call"}
    fixture = pin(conn, run_id)
    base = fixture["key_base"]
    for step in ("charge", "refund"):
        # the key the server received = the recorded journal's = key_base-<entry seq>-0
        assert sent[step]["headers"]["idempotency-key"] == journaled[step] == \
            f"{base}-{started[step]}-0"
    # ctx.idempotency_key of a Functional step follows the same formula
    assert run_row(conn, run_id)["response"] == {"key": f"{base}-{started['mark']}-0"}
    assert [(e["step"], e["type"]) for e in fixture["effects"]] == [("charge", "http"), ("refund", "http")]

    # the replay's requests (journaled, never sent) carry the recorded run's keys
    q(conn, "CREATE TRIGGER see AFTER INSERT ON tuvl.journal FOR EACH ROW EXECUTE FUNCTION rp.see()")
    try:
        q(conn, "TRUNCATE rp.seen")
        result = replay(conn, fixture)
    finally:
        q(conn, "DROP TRIGGER see ON tuvl.journal")
    assert (result["status"], result["response"], result["effects_served"]) == \
        ("compensated", {"key": f"{base}-{started['mark']}-0"}, 2)
    seen = q(conn, "SELECT run_id, agent_id, payload -> 'request' FROM rp.seen "
                   "WHERE type = 'tool_call' ORDER BY seq")
    assert {r[0] for r in seen} != {run_id} and len({r[0] for r in seen}) == 1
    assert [(a, r["method"], r["idempotency_key"]) for _, a, r in seen] == [
        ("charge", "POST", journaled["charge"]), ("refund", "DELETE", journaled["refund"])]
    assert len(http_requests(token)) == 2, "the replay sent nothing"
    # the replay's Functional saw the recorded run's key too
    assert q(conn, "SELECT key FROM rp.calls WHERE tag = %s ORDER BY id", (token,)) == \
        [(f"{base}-{started['mark']}-0",)] * 2


# ---------------------------------------------------------------------------
# pin_run, replay_divergence, transactions


SQL_FLOW = """
name: %s
steps:
  - id: note
    kind: ModelOp
    sql: INSERT INTO rp.calls (tag, what) VALUES ($1, 'note') RETURNING what
    params: ["{{ tag }}"]
  - id: check
    kind: Router
    on: "{{ note_result.0.what }}"
    routes: { note: done, default: other }
ends:
  - { id: done, status: completed, response: { tag: "{{ tag }}", _private: "{{ tag }}" } }
  - { id: other, status: completed, response: other }
"""


def test_pin_run_refuses_runs_that_have_not_ended(conn):
    name = new_name()
    register(conn, f"name: {name}\nsteps:\n  - id: nap\n    kind: Functional\n    function: rp.nap\n"
                   "  - id: ask\n    kind: Human\n    form: { type: object }\nends:\n"
                   "  - { id: done, status: completed }\n")
    run_id = start(conn, name, {})
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "running",
               10, message="the run to start")
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as exc:
        pin(conn, run_id)
    assert exc.value.diag.message_primary == f"run {run_id} has not ended: its status is running"
    assert exc.value.diag.message_hint == "Pin a run once it has ended."
    assert wait(conn, run_id) == "waiting_human"
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
        pin(conn, run_id)
    q(conn, "SELECT tuvl.abort_run(%s, 'not needed')", (run_id,))
    # an operator's abort is part of the fixture: the replay is aborted where the recording was
    fixture = pin(conn, run_id)
    assert fixture["effects"][-1] == {"step": fixture["effects"][-1]["step"], "type": "abort",
                                      "result": {"at": "between", "reason": "not needed", "by": "postgres"}}
    result = replay(conn, fixture)
    assert result["status"] == "aborted", result
    with pytest.raises(psycopg2.errors.UndefinedObject) as exc:
        pin(conn, 987654321)
    assert exc.value.diag.message_primary == "run 987654321 does not exist"
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as exc:
        replay(conn, {"workflow": name})
    assert exc.value.diag.message_primary == "not a tuvl replay fixture"
    # replay_divergence reports divergences only: a broken fixture still raises
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        divergence(conn, {"workflow": name})


def test_replay_divergence_returns_null_or_the_message_and_private_keys_are_redacted(conn):
    name = new_name()
    tag = new_name("t")
    register(conn, SQL_FLOW % name)
    run_id = q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (name, json.dumps({"tag": tag, "_pin": "1234"})))["run_id"]
    assert run_row(conn, run_id)["response"] == {"tag": tag, "_private": tag}
    fixture = pin(conn, run_id)
    assert fixture["input"] == {"tag": tag, "_pin": "[redacted]"}
    assert fixture["response"] == {"tag": tag, "_private": "[redacted]"}
    assert fixture["effects"] == [] and fixture["tokens"] == 0
    assert divergence(conn, fixture) is None
    assert replay(conn, fixture)["response"] == {"tag": tag, "_private": "[redacted]"}
    # another response
    changed = dict(fixture, response={"tag": "someone else", "_private": "[redacted]"})
    message = divergence(conn, changed)
    assert message == f"replay of run {run_id} diverged: the replay's response differs from the recording's"
    # another status
    assert divergence(conn, dict(fixture, status="failed")) == \
        f"replay of run {run_id} diverged: the recorded run ended failed, the replay completed"
    # a workflow of this name must exist
    with pytest.raises(psycopg2.errors.UndefinedObject):
        replay(conn, dict(fixture, workflow="no_such_workflow"))


def test_a_replay_rolled_back_with_its_transaction_leaves_nothing(rdb, conns):
    conn = conns(rdb)
    name = new_name()
    tag = new_name("t")
    register(conn, SQL_FLOW % name)
    run_id = q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (name, json.dumps({"tag": tag})))["run_id"]
    fixture = pin(conn, run_id)
    before = counts(conn)
    tx = conns(rdb, autocommit=False)
    assert replay(tx, fixture)["end"] == "done"
    assert replay(tx, fixture)["end"] == "done"
    # the ModelOp really inserted, twice, inside this transaction
    assert q1(tx, "SELECT count(*) FROM rp.calls WHERE tag = %s", (tag,)) == 3
    tx.rollback()
    assert q1(conn, "SELECT count(*) FROM rp.calls WHERE tag = %s", (tag,)) == 1
    assert counts(conn) == before
    # a divergence raised inside a transaction aborts only what the caller chooses
    q(tx, "SAVEPOINT s")
    with pytest.raises(psycopg2.errors.DataException):
        replay(tx, dict(fixture, end="other"))
    q(tx, "ROLLBACK TO SAVEPOINT s")
    assert replay(tx, fixture)["status"] == "completed"
    tx.commit()
    assert q1(conn, "SELECT count(*) FROM rp.calls WHERE tag = %s", (tag,)) == 2
    assert counts(conn) == before, "a committed replay leaves no run and no journal either"


# ---------------------------------------------------------------------------
# People in the loop


def test_human_data_and_approval_decisions_are_served_from_the_recording(conn, llm):
    name = new_name()
    tag = new_name("t")
    llm.script(name, [
        {"tool_calls": [{"name": "record", "arguments": {"note": "refund 40"}}]},
        {"tool_calls": [{"name": "record", "arguments": {"note": "refund 4000"}}]},
        {"text": "one refund recorded, one refused"}])
    register_llm(conn, llm, name)
    register(conn, f"""
name: {name}
steps:
  - id: review
    kind: Human
    form: {{ type: object, required: [ok], properties: {{ ok: {{ type: boolean }} }} }}
    output: review
    routes: {{ default: gate }}
  - id: gate
    kind: Router
    on: "{{{{ review.ok }}}}"
    routes: {{ "true": act, default: refused }}
  - id: act
    kind: Agent
    mode: autonomous
    agent:
      model: {name}
      tools: [ {{ ref: record, approval: true }} ]
    routes: {{ default: done }}
  - id: record
    kind: Functional
    description: Record a refund
    function: rp.record
ends:
  - {{ id: done, status: completed, response: "{{{{ act_result }}}}" }}
  - {{ id: refused, status: completed, response: refused }}
""")
    run_id = start(conn, name, {"tag": tag})
    assert wait(conn, run_id) == "waiting_human"
    q(conn, "SELECT tuvl.submit(%s, '{\"ok\": true}')", (run_id,))
    assert wait(conn, run_id) == "waiting_approval"
    q(conn, "SELECT tuvl.decide(%s, true, 'small amount')", (run_id,))
    assert wait(conn, run_id) == "waiting_approval"
    q(conn, "SELECT tuvl.decide(%s, false, 'too much')", (run_id,))
    assert wait(conn, run_id) == "completed"
    assert run_row(conn, run_id)["response"] == "one refund recorded, one refused"
    assert q(conn, "SELECT what FROM rp.calls WHERE tag = %s", (tag,)) == [("refund 40",)]

    fixture = pin(conn, run_id)
    effects = fixture["effects"]
    assert [(e["step"], e["type"]) for e in effects] == [
        ("review", "human"), ("act", "llm"), ("act", "approval"), ("act", "llm"), ("act", "approval"),
        ("act", "llm")]
    assert effects[0]["result"] == {"op": "human", "data": {"ok": True}, "by": "postgres"}
    assert (effects[2]["result"]["approved"], effects[2]["result"]["note"]) == (True, "small amount")
    assert (effects[4]["result"]["approved"], effects[4]["result"]["note"]) == (False, "too much")
    llm.stop()
    before = counts(conn)
    result = replay(conn, fixture)
    assert (result["status"], result["response"], result["effects_served"]) == \
        ("completed", "one refund recorded, one refused", 6)
    # the approved call ran again, the refused one did not; the replay never waited
    assert q(conn, "SELECT what FROM rp.calls WHERE tag = %s", (tag,)) == [("refund 40",)] * 2
    assert counts(conn) == before
    # another person's answer: the Router takes the other route
    other = json.loads(json.dumps(fixture))
    other["effects"][0]["result"]["data"] = {"ok": False}
    message, _ = replay_error(conn, other)
    assert message == (f'replay of run {run_id} diverged: the recorded run ended at end "done", '
                       f'the replay at end "refused"')


def test_a_replay_needs_no_secret_and_the_fixture_holds_none(conn):
    name = new_name()
    token = new_name("tok")
    secret = "sk-" + uuid.uuid4().hex
    q(conn, "SELECT tuvl.set_secret(%s, %s)", (name, secret))
    register(conn, f"""
name: {name}
steps:
  - id: call
    kind: APICall
    http:
      url: "{HTTP_BASE}/json?token={token}"
      query: {{ key: "{{{{ secrets.{name} }}}}" }}
      headers: {{ Authorization: "Bearer {{{{ secrets.{name} }}}}" }}
    output: res
    routes: {{ default: done }}
ends:
  - {{ id: done, status: completed, response: "{{{{ res.status }}}}" }}
""")
    run_id = q1(conn, "SELECT tuvl.run(%s)", (name,))["run_id"]
    (request,) = http_requests(token)
    assert request["headers"]["authorization"] == f"Bearer {secret}"
    fixture = pin(conn, run_id)
    assert secret not in json.dumps(fixture)
    assert "[redacted]" in fixture["effects"][0]["request"]["url"]
    # a database without the secret (a CI database, say) replays the fixture
    q(conn, "DELETE FROM tuvl.secrets WHERE name = %s", (name,))
    assert replay(conn, fixture)["response"] == 200
    assert len(http_requests(token)) == 1


def test_live_steps_make_their_effects_for_real_and_the_rest_is_served(conn):
    """replay(fixture, live => array[...]) runs the named steps' effects for real
    (the change engine's check: the changed step live, the rest recorded)."""
    name = new_name()
    token = new_name("live")
    register(conn, f"""
name: {name}
steps:
  - id: first
    kind: APICall
    http: {{ url: "{HTTP_BASE}/json?token={token}-first" }}
    output: a
    routes: {{ default: second }}
  - id: second
    kind: APICall
    http: {{ url: "{HTTP_BASE}/json?token={token}-second" }}
    output: b
    routes: {{ default: done }}
ends:
  - {{ id: done, status: completed, response: [ "{{{{ a.status }}}}", "{{{{ b.status }}}}" ] }}
""")
    run_id = q1(conn, "SELECT tuvl.run(%s)", (name,))["run_id"]
    assert len(http_requests(token)) == 2
    fixture = pin(conn, run_id)
    res = q1(conn, "SELECT tuvl.replay(%s::jsonb, live => array['second'])", (json.dumps(fixture),))
    assert (res["status"], res["response"]) == ("completed", [200, 200]), res
    assert (res["effects_served"], res["effects_live"]) == (1, 1), res
    paths = [r["path"] for r in http_requests(token)]
    assert len(paths) == 3 and f"{token}-second" in paths[-1], paths
    # without live, nothing is sent
    assert replay(conn, fixture)["effects_live"] == 0 and len(http_requests(token)) == 3
    assert q1(conn, "SELECT tuvl.replay_divergence(%s::jsonb, array['first'])", (json.dumps(fixture),)) is None
    assert len(http_requests(token)) == 4
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(conn, "SELECT tuvl.replay(%s::jsonb, live => array['nope'])", (json.dumps(fixture),))
    assert f'live names step "nope", which workflow "{name}" does not have' in str(e.value)
    assert q1(conn, "SELECT tuvl.replay(NULL)") is None
