"""Hostile servers: no response, however crafted, crashes a worker or the journal.

A malicious HTTP API, model provider or MCP server on 127.0.0.1 (hostile.py)
answers with what parsers choke on: JSON nested 100,000 levels deep, numbers
that overflow PostgreSQL's numeric (1e1000000), header bytes that are not
UTF-8 (in an APICall's headers, an Mcp-Session-Id, a redirect's Location).
On 0.2.0 the first kind crashed the worker (the error path freed the
transfer, then forgetting the run wrote into it) and the postmaster
restarted the whole cluster, after which the run was claimed again and the
same request sent again, 81 times in a minute; the second kind was stored as
it came, after which the journal could not be read at all (XX001).

Here each such response must be the step's error (journaled, its `error`
route taken, `_last_error_type` set), sent once, with the worker that got
it still the same process and the journal readable.  And a run whose worker
keeps dying while it holds it is retried at most tuvl.max_recoveries times.
"""
import json
import os
import signal
import time

import psycopg2
import pytest

import re

from conftest import CRASH_PATTERN, ServerLog, connect, q, q1, wait_until, worker_pids
from hostile import HostileServer, deep_json, mcp_script, response

PROVIDERS = ["openai", "anthropic", "openai_responses"]
MODES = ["worker", "sync"]

# Response bodies a parser cannot take: each must become the step's error.
BAD_BODIES = {
    "deep_array": deep_json(),
    "deep_object": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "huge_exponent": b'{"n": 1e1000000}',
    "huge_integer": b'{"n": ' + b"9" * 200_000 + b"}",
    "bad_unicode_escape": b'{"s": "\\ud800"}',
}


@pytest.fixture(scope="module")
def conn(db, request):
    c = connect(db)
    request.addfinalizer(c.close)
    return c


@pytest.fixture
def hostile():
    servers = []

    def make(script=None, default=None):
        s = HostileServer(script, default)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def finish(conn, workflow, data, mode, timeout=30):
    """Run the workflow; returns (run id, status, end, response)."""
    if mode == "sync":
        out = q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (workflow, json.dumps(data)))
        run_id = out["run_id"]
    else:
        run_id = q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (workflow, json.dumps(data)))
        q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))
    return q(conn, "SELECT id, status, end_name, response FROM tuvl.runs WHERE id = %s", (run_id,))[0]


def assert_survived(conn, db, log, mark, pids):
    """No process crashed, the workers are the same processes, the journal reads."""
    text = log.since(mark)
    assert not re.search(CRASH_PATTERN, text), text[-3000:]
    assert worker_pids(db) == pids
    assert q1(conn, "SELECT count(*) FROM tuvl.events") > 0
    assert q1(conn, "SELECT count(*) FROM tuvl.journal") > 0


APICALL = """
name: {name}
steps:
  - id: call
    kind: APICall
    http: {{ url: "{{{{ url }}}}", retry: {{ attempts: 1 }} }}
    output: res
    routes: {{ default: done, error: oops }}
ends:
  - {{ id: done, status: completed, response: "{{{{ res }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""


def register_apicall(conn, name):
    q(conn, "SELECT tuvl.register_workflow(%s)", (APICALL.format(name=name),))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(BAD_BODIES))
def test_an_unparseable_api_response_is_the_steps_error(conn, db, hostile, kind, mode):
    server = hostile({"/x": response(200, BAD_BODIES[kind])})
    register_apicall(conn, "hostile_api")
    log = ServerLog()
    mark = log.mark()
    pids = worker_pids(db)
    run_id, status, end, resp = finish(conn, "hostile_api", {"url": server.base + "/x"}, mode)
    assert (status, end) == ("completed", "oops"), resp
    assert resp["type"] == "http_error"
    assert "response body" in resp["error"], resp
    assert any(w in resp["error"] for w in ("JSON", "deeper than 512", "cannot store")), resp
    assert server.count("/x") == 1
    assert_survived(conn, db, log, mark, pids)
    # what the server sent is journaled as the step's result: a body_error
    result = q1(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'tool_result'",
                (run_id,))
    assert result["result"]["body_error"], result


def header_script(value):
    return response(200, b'{"ok": true}', headers=[("X-Hostile", value), ("X-Fine", "yes")])


@pytest.mark.parametrize("mode", MODES)
def test_header_bytes_that_are_not_utf8_never_reach_the_journal(conn, db, hostile, mode):
    server = hostile({"/h": header_script(b"caf\xe9 \xff\xfe end"),
                      "/r": response(302, b"", headers=[("Location", b"/h\xff\xfe?x=\xc3")])})
    register_apicall(conn, "hostile_headers")
    log = ServerLog()
    mark = log.mark()
    pids = worker_pids(db)
    run_id, status, end, resp = finish(conn, "hostile_headers", {"url": server.base + "/h"}, mode)
    assert (status, end) == ("completed", "done"), resp
    assert resp["headers"]["x-fine"] == "yes"
    # the bad bytes became U+FFFD; the rest of the value is kept
    assert resp["headers"]["x-hostile"] == "caf\ufffd \ufffd\ufffd end"
    # a Location with bad bytes is refused (there is no such URL to follow)
    run2, status2, end2, resp2 = finish(conn, "hostile_headers", {"url": server.base + "/r"}, mode)
    assert (status2, end2) == ("completed", "oops"), resp2
    assert_survived(conn, db, log, mark, pids)
    # every reader of the journal still works
    for rid in (run_id, run2):
        assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s", (rid,)) > 0
        assert q1(conn, "SELECT tuvl.pin_run(%s) IS NOT NULL", (rid,))
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE payload::text LIKE '%%caf%%'") >= 1


def chat_body(provider, text="fine"):
    if provider == "anthropic":
        return {"id": "m", "type": "message", "role": "assistant", "model": "x",
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 1, "output_tokens": 1}}
    if provider == "openai_responses":
        return {"id": "r", "object": "response", "status": "completed",
                "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": text}]}],
                "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}
    return {"id": "c", "object": "chat.completion", "model": "x",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


MODEL_PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
               "openai_responses": "/v1/responses"}

AGENT = """
name: {name}
steps:
  - id: ask
    kind: Agent
    mode: completion
    agent: {{ model: {model}, prompt: "Say hi.", retry: {{ attempts: 1 }} }}
    routes: {{ default: done, error: oops }}
ends:
  - {{ id: done, status: completed, response: "{{{{ ask_result }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["deep_array", "huge_exponent"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_an_unparseable_model_answer_is_the_steps_error(conn, db, hostile, provider, kind, mode):
    server = hostile({MODEL_PATHS[provider]: response(200, BAD_BODIES[kind])})
    name = f"hostile_model_{provider}"
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: {provider}\nbase_url: {server.base}/v1\nmodel: m\ntimeout: 5s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (AGENT.format(name=name, model=name),))
    log = ServerLog()
    mark = log.mark()
    pids = worker_pids(db)
    run_id, status, end, resp = finish(conn, name, {}, mode)
    assert (status, end) == ("completed", "oops"), resp
    assert server.count(MODEL_PATHS[provider]) == 1
    assert_survived(conn, db, log, mark, pids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_model_answer_nested_deep_inside_valid_json_is_the_steps_error(conn, db, hostile,
                                                                        provider, mode):
    """Valid JSON whose text is fine but whose other fields nest 100,000 deep."""
    body = json.dumps(chat_body(provider)).encode()
    body = body[:-1] + b', "extra": ' + deep_json() + b"}"
    server = hostile({MODEL_PATHS[provider]: response(200, body)})
    name = f"hostile_nested_{provider}"
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: {provider}\nbase_url: {server.base}/v1\nmodel: m\ntimeout: 5s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (AGENT.format(name=name, model=name),))
    log = ServerLog()
    mark = log.mark()
    pids = worker_pids(db)
    run_id, status, end, resp = finish(conn, name, {}, mode)
    assert (status, end) == ("completed", "oops"), resp
    assert server.count(MODEL_PATHS[provider]) == 1
    assert_survived(conn, db, log, mark, pids)


MCP_WF = """
name: {name}
steps:
  - id: tool
    kind: MCP
    mcp: {{ url: "{{{{ url }}}}", tool: echo, arguments: {{ message: hi }} }}
    output: res
    routes: {{ default: done, error: oops }}
ends:
  - {{ id: done, status: completed, response: "{{{{ res }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""


def sse(data):
    return b"event: message\r\ndata: " + data + b"\r\n\r\n"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framing", ["json", "sse"])
@pytest.mark.parametrize("kind", ["deep_array", "huge_exponent"])
def test_an_unparseable_mcp_answer_is_the_steps_error(conn, db, hostile, framing, kind, mode):
    def answer(rid):
        if kind == "deep_array":
            msg = b'{"jsonrpc": "2.0", "id": %s, "result": ' % json.dumps(rid).encode() + deep_json() + b"}"
        else:
            msg = b'{"jsonrpc": "2.0", "id": %s, "result": {"n": 1e1000000}}' % json.dumps(rid).encode()
        if framing == "sse":
            return response(200, sse(msg), ctype="text/event-stream")
        return response(200, msg)

    server = hostile({"/mcp": mcp_script(answer)})
    name = f"hostile_mcp_{framing}"
    q(conn, "SELECT tuvl.register_workflow(%s)", (MCP_WF.format(name=name),))
    log = ServerLog()
    mark = log.mark()
    pids = worker_pids(db)
    run_id, status, end, resp = finish(conn, name, {"url": server.base + "/mcp"}, mode)
    assert (status, end) == ("completed", "oops"), resp
    calls = [r for r in server.requests if b"tools/call" in r["body"]]
    assert len(calls) == 1
    assert_survived(conn, db, log, mark, pids)


@pytest.mark.parametrize("mode", MODES)
def test_an_mcp_session_id_that_is_not_utf8_never_reaches_the_journal(conn, db, hostile, mode):
    def answer(method, path, headers, body):
        msg = json.loads(body or b"{}")
        rid = msg.get("id")
        if msg.get("method") == "initialize":
            result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                      "serverInfo": {"name": "hostile", "version": "1"}}
            return response(200, json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}),
                            headers=[("Mcp-Session-Id", b"s\xff\xfe1")])
        if method == "DELETE" or msg.get("method", "").startswith("notifications/"):
            return response(202, b"", ctype=None)
        return response(200, json.dumps({"jsonrpc": "2.0", "id": rid,
                                         "result": {"content": [{"type": "text", "text": "ok"}]}}))

    server = hostile({"/mcp": answer})
    name = "hostile_mcp_session"
    q(conn, "SELECT tuvl.register_workflow(%s)", (MCP_WF.format(name=name),))
    log = ServerLog()
    mark = log.mark()
    pids = worker_pids(db)
    run_id, status, end, resp = finish(conn, name, {"url": server.base + "/mcp"}, mode)
    # a session id that is not visible ASCII is the server's error (the spec's rule)
    assert (status, end) == ("completed", "oops"), resp
    assert_survived(conn, db, log, mark, pids)
    assert q1(conn, "SELECT tuvl.pin_run(%s) IS NOT NULL", (run_id,))


# ---------------------------------------------------------------------------
# An abort stops a model call waiting out a Retry-After


@pytest.mark.parametrize("provider", PROVIDERS)
def test_abort_stops_a_model_call_waiting_out_retry_after(conn, hostile, provider):
    """0.2.0: the abort waited for the delay, and the retries were sent anyway."""
    limited = response(429, b'{"error": {"message": "slow down"}}', headers=[("Retry-After", "4")])
    server = hostile({MODEL_PATHS[provider]: limited})
    name = f"hostile_429_{provider}"
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: {provider}\nbase_url: {server.base}/v1\nmodel: m\ntimeout: 5s\n",))
    wf = AGENT.format(name=name, model=name).replace("retry: { attempts: 1 }", "retry: { attempts: 5 }")
    q(conn, "SELECT tuvl.register_workflow(%s)", (wf,))
    run_id = q1(conn, "SELECT tuvl.start_run(%s, '{}')", (name,))
    wait_until(lambda: server.count(MODEL_PATHS[provider]) >= 1, 10, message="the first request")
    time.sleep(0.3)
    t0 = time.monotonic()
    q(conn, "SELECT tuvl.abort_run(%s, 'enough')", (run_id,))
    assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "aborted"
    took = time.monotonic() - t0
    assert took < 2, f"the abort took {took:.1f} s"
    time.sleep(5)
    assert server.count(MODEL_PATHS[provider]) == 1


def test_abort_stops_an_autonomous_agent_waiting_out_retry_after(conn, hostile):
    limited = response(429, b'{"error": {"message": "slow down"}}', headers=[("Retry-After", "4")])
    server = hostile({"/v1/chat/completions": limited})
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: hostile_429_auto\nprovider: openai\nbase_url: {server.base}/v1\nmodel: m\ntimeout: 5s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", ("""
name: hostile_429_auto
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: hostile_429_auto
      tools: [{ ref: lookup }]
      outcome: { enum: [resolved] }
      retry: { attempts: 5 }
    routes: { resolved: done, aborted: stopped, error: done }
  - { id: lookup, kind: ModelOp, description: Look something up, sql: "SELECT 1 AS one" }
ends:
  - { id: done, status: completed }
  - { id: stopped, status: completed, response: aborted }
""",))
    run_id = q1(conn, "SELECT tuvl.start_run('hostile_429_auto', '{}')")
    wait_until(lambda: server.count() >= 1, 10, message="the first request")
    time.sleep(0.3)
    t0 = time.monotonic()
    q(conn, "SELECT tuvl.abort_run(%s, 'enough')", (run_id,))
    assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) in ("aborted", "completed")
    assert time.monotonic() - t0 < 2
    time.sleep(5)
    assert server.count() == 1


# ---------------------------------------------------------------------------
# Crash loops: a run whose worker keeps dying is retried tuvl.max_recoveries times
# (last in the module: they restart the server, which closes the module's connection)


SLOW = """
name: hostile_slow
steps:
  - id: call
    kind: APICall
    http: { url: "{{ url }}", timeout: 60s, retry: { attempts: 1 } }
    routes: { default: done }
ends:
  - { id: done, status: completed }
"""


def test_a_run_whose_worker_keeps_dying_fails_after_max_recoveries(db, hostile, set_gucs,
                                                                   server_log):
    """Each time the request arrives, its worker is killed (as a crash on the
    response would): the request is sent 1 + max_recoveries times, then the
    run fails with recovery_limit instead of looping."""
    set_gucs({"tuvl.max_recoveries": ("2", "2")})

    def slow(method, path, headers, body):
        time.sleep(30)
        return response(200, b"{}")

    server = hostile({"/slow": slow})
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (SLOW,))
    run_id = q1(conn, "SELECT tuvl.start_run('hostile_slow', %s::jsonb)",
                (json.dumps({"url": server.base + "/slow"}),))
    for n in range(1, 4):
        wait_until(lambda: server.count("/slow") >= n, 30, message=f"request {n}")
        holder = wait_until(lambda: q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s",
                                       (run_id,)), 10, message="the run's holder",
                            ignore=(psycopg2.OperationalError, psycopg2.InterfaceError))
        mark = server_log.mark()
        os.kill(holder, signal.SIGKILL)
        server_log.wait_for(mark, r"database system is ready to accept connections", 60)
        conn = wait_until(lambda: connect(db), 30, ignore=(psycopg2.OperationalError,))
    status = q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,))
    assert status == "failed"
    ctx, err = q(conn, "SELECT context, error FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert ctx["_last_error_type"] == "recovery_limit"
    assert "2" in err
    time.sleep(1)
    assert server.count("/slow") == 3
    failed = q1(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'run_failed'",
                (run_id,))
    assert failed["error"] == err
    conn.close()


def test_progress_between_crashes_resets_the_count(db, hostile, set_gucs, server_log):
    """A run that gets further after each crash is not in a crash loop: with
    tuvl.max_recoveries = 1, a crash in step a and another in step b still
    let it complete, since a checkpoint came between them."""
    set_gucs({"tuvl.max_recoveries": ("1", "1")})

    def slow(method, path, headers, body):
        time.sleep(30)
        return response(200, b"{}")

    server = hostile({"/a": slow, "/b": slow})
    conn = connect(db)
    wf = """
name: hostile_progress
steps:
  - { id: a, kind: APICall, http: { url: "{{ base }}/a", timeout: 60s, retry: { attempts: 1 } }, timeout: 60s, routes: { default: b } }
  - { id: b, kind: APICall, http: { url: "{{ base }}/b", timeout: 60s, retry: { attempts: 1 } }, timeout: 60s, routes: { default: done } }
ends:
  - { id: done, status: completed }
"""
    q(conn, "SELECT tuvl.register_workflow(%s)", (wf,))
    run_id = q1(conn, "SELECT tuvl.start_run('hostile_progress', %s::jsonb)",
                (json.dumps({"base": server.base}),))
    for path in ("/a", "/b"):
        wait_until(lambda: server.count(path) >= 1, 30, message=f"the request to {path}")
        holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        # sent again once, and this time it answers
        server.script[path] = response(200, b"{}")
        mark = server_log.mark()
        os.kill(holder, signal.SIGKILL)
        server_log.wait_for(mark, r"database system is ready to accept connections", 60)
        conn = wait_until(lambda: connect(db), 30, ignore=(psycopg2.OperationalError,))
        assert q1(conn, "SELECT recoveries FROM tuvl.runs WHERE id = %s", (run_id,)) <= 1
        wait_until(lambda: server.count(path) >= 2, 30, message=f"the request to {path} again")
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert (server.count("/a"), server.count("/b")) == (2, 2)
    conn.close()
