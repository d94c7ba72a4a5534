"""The MCP client: tuvl.mcp_list_tools() and the MCP step over streamable HTTP.

Most tests talk to the reference server @modelcontextprotocol/server-everything
that test/lib.sh starts (TUVL_MCP_URL), through the synchronous tuvl.run()
and through the background workers.  The journal must show every JSON-RPC
message as a tool_call / tool_result pair: server/discover (which these 2025
servers refuse), initialize, the initialized notification and tools/call on
a backend's first call, tools/call alone on
the next ones (the session is cached), and after the server lost the session
the failed call, a new handshake and the repeated call.

The reference server answers with an event stream holding one priming event
and the response; since tuvl sends no progress token it sends no progress
notifications.  A scripted server of our own (httputil.ScriptedMcpServer)
covers what it never sends: comments, progress notifications, answers to
other request ids, data split over several lines, CRLF line ends, plain JSON
and batch answers, and a session forgotten with 404.
"""
import json
import re
import os
import signal
import socket
import subprocess
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import TMPDIR, connect, journal_violations, q, q1, register_workflows, wait_until
from httputil import (MCP_PORT, MCP_URL, ScriptedMcpServer, execute, payloads,
                      pids_listening_on, port_open, unique, wait_port)

pytestmark = pytest.mark.skipif(not MCP_URL, reason="TUVL_MCP_URL is not set (run through test/run)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCP_BIN = os.path.join(ROOT, "test", "servers", "mcp", "node_modules", ".bin", "mcp-server-everything")

WORKFLOWS = [
    # any tool of any server, the arguments given whole
    """
name: mcp_any
steps:
  - id: tool
    kind: MCP
    mcp: { url: "{{ url }}", tool: "{{ tool }}", arguments: "{{ args }}" }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}", type: "{{ _last_error_type }}" } }
""",
    """
name: mcp_echo
steps:
  - id: echo
    kind: MCP
    mcp: { url: "%(url)s", tool: echo, arguments: { message: "hello {{ who }}" } }
    routes: { default: add }
  - id: add
    kind: MCP
    mcp: { url: "%(url)s", tool: get-sum, arguments: { a: "{{ a }}", b: "{{ b }}" } }
    output: sum
    routes: { default: done }
ends:
  - { id: done, status: completed, response: { echo: "{{ echo_result }}", sum: "{{ sum }}" } }
""" % {"url": MCP_URL},
    """
name: mcp_secret
steps:
  - id: echo
    kind: MCP
    mcp: { url: "%(url)s", tool: echo, arguments: { message: "token {{ secrets.mcp_token }}" } }
    output: res
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
""" % {"url": MCP_URL},
]


@pytest.fixture(scope="module")
def wf(db):
    return register_workflows(db, *WORKFLOWS)


@pytest.fixture(params=["sync", "worker"])
def mode(request):
    return request.param


@pytest.fixture
def conn(wf, conns):
    return conns(wf)


@pytest.fixture(scope="session")
def mcp_restarts():
    """The MCP servers this session started in place of the original one.

    They stay up for the rest of the session (later tests use the server) and
    are stopped when it ends, since test/run only stops what it started.
    """
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def restart_mcp_server(started):
    """Stop whatever listens on TUVL_MCP_PORT and start the reference server
    there again, exactly as test/lib.sh does."""
    pids = pids_listening_on(MCP_PORT)
    assert pids, f"nothing listens on the MCP port {MCP_PORT}"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for proc in started:
        if proc.pid in pids:
            proc.wait(10)
    wait_until(lambda: not pids_listening_on(MCP_PORT) and not port_open(MCP_PORT), 10,
               message="the MCP server to stop")
    log = open(os.path.join(TMPDIR, "mcp.log"), "ab")
    try:
        proc = subprocess.Popen([MCP_BIN, "streamableHttp"], cwd=ROOT,
                                env=dict(os.environ, PORT=str(MCP_PORT)),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()
    started.append(proc)
    wait_port(MCP_PORT, 30)


def rpcs(conn, run_id):
    """The JSON-RPC methods of the run's tool_call events, in order."""
    return [p["request"].get("rpc") for p in payloads(conn, run_id, "tool_call")]


def results(conn, run_id):
    return [p["result"] for p in payloads(conn, run_id, "tool_result")]


def call(conn, tool, args, mode="sync", url=MCP_URL):
    return execute(conn, "mcp_any", {"url": url, "tool": tool, "args": args}, mode)


def completed(res):
    assert res["status"] == "completed" and res["end"] == "done", res
    return res["response"]


# ---------------------------------------------------------------------------
# tools/list


def test_list_tools_gives_names_and_input_schemas(conn):
    tools = q1(conn, "SELECT tuvl.mcp_list_tools(%s)", (MCP_URL,))
    assert isinstance(tools, list)
    by_name = {t["name"]: t for t in tools}
    for name in ("echo", "get-sum", "get-structured-content", "trigger-long-running-operation"):
        assert name in by_name, sorted(by_name)
    assert all(isinstance(t.get("inputSchema"), dict) and t["inputSchema"].get("type") == "object"
               for t in tools), [t["name"] for t in tools if "inputSchema" not in t]
    echo = by_name["echo"]
    assert echo["inputSchema"]["properties"]["message"]["type"] == "string"
    assert "message" in echo["inputSchema"]["required"]
    assert echo.get("description")
    assert set(by_name["get-sum"]["inputSchema"]["properties"]) == {"a", "b"}


def test_list_tools_refuses_a_host_outside_the_allow_list(conn):
    with pytest.raises(psycopg2.errors.InsufficientPrivilege, match="not allowed"):
        q1(conn, "SELECT tuvl.mcp_list_tools(%s)", (f"http://127.0.0.2:{MCP_PORT}/mcp",))


# ---------------------------------------------------------------------------
# tools/call


def test_tools_are_called_with_templated_arguments(conn, mode):
    who = unique("w")
    res = execute(conn, "mcp_echo", {"who": who, "a": 2, "b": 3}, mode)
    out = completed(res)
    text = f"Echo: hello {who}"
    assert out["echo"] == {"text": text, "content": [{"type": "text", "text": text}]}
    assert out["sum"]["text"] == "The sum of 2 and 3 is 5."
    assert out["sum"]["content"] == [{"type": "text", "text": "The sum of 2 and 3 is 5."}]
    calls = payloads(conn, res["run_id"], "tool_call")
    assert [c["request"]["tool"] for c in calls if c["request"]["rpc"] == "tools/call"] == ["echo", "get-sum"]
    assert all(c["request"]["url"] == MCP_URL and c["request"]["method"] == "POST" for c in calls)
    assert journal_violations(conn, [res["run_id"]]) == []


def test_structured_content_is_kept(conn, mode):
    out = completed(call(conn, "get-structured-content", {"location": "Chicago"}, mode))
    assert out["structuredContent"] == {"temperature": 36, "conditions": "Light rain / drizzle",
                                        "humidity": 82}
    assert json.loads(out["text"]) == out["structuredContent"]


@pytest.mark.parametrize("tool,args,expected", [
    ("no-such-tool", {}, "Tool no-such-tool not found"),
    ("get-sum", {"a": "two", "b": 3}, "Invalid arguments for tool get-sum"),
])
def test_tool_errors_take_the_error_route_with_the_server_message(conn, mode, tool, args, expected):
    res = call(conn, tool, args, mode)
    assert res["status"] == "completed" and res["end"] == "oops", res
    assert expected in res["response"]["error"], res["response"]
    assert res["response"]["type"] == "mcp_tool_error"
    if tool == "get-sum":
        assert "expected number" in res["response"]["error"]
    done = payloads(conn, res["run_id"], "agent_completed")[0]
    assert done["signal"] == "error" and expected in done["error"]


def test_long_running_operation_completes_with_its_final_text(conn, mode):
    started = time.monotonic()
    out = completed(call(conn, "trigger-long-running-operation", {"duration": 1, "steps": 3}, mode))
    assert out["text"] == "Long running operation completed. Duration: 1 seconds, Steps: 3."
    assert time.monotonic() - started >= 1.0


def test_secrets_in_arguments_are_sent_but_never_stored(conn, mode):
    secret = "mcp-" + unique("s")
    q(conn, "SELECT tuvl.set_secret('mcp_token', %s)", (secret,))
    res = execute(conn, "mcp_secret", {}, mode)
    out = completed(res)
    # the server echoed it; tuvl kept it redacted
    assert out["text"] == "Echo: token [redacted]", out
    assert secret not in json.dumps(res)
    for table in ("tuvl.events", "tuvl.runs"):
        assert q1(conn, f"SELECT count(*) FROM {table} t WHERE strpos(t::text, %s) > 0", (secret,)) == 0


# ---------------------------------------------------------------------------
# Sessions


def test_first_call_initializes_and_later_calls_reuse_the_session(wf, conns):
    c = conns(wf)       # a new backend: no session cached
    first = call(c, "echo", {"message": "one"})
    second = call(c, "echo", {"message": "two"})
    assert completed(first)["text"] == "Echo: one" and completed(second)["text"] == "Echo: two"
    run1, run2 = first["run_id"], second["run_id"]
    # server/discover first: the reference server is a 2025 one (it refuses
    # a request outside a session), so the step initializes
    assert rpcs(c, run1) == ["server/discover", "initialize", "notifications/initialized", "tools/call"]
    r1 = results(c, run1)[1:]
    assert [r["op"] for r in r1] == ["initialize", "initialized", "call"]
    assert r1[0]["status"] == 200 and r1[1]["status"] == 202 and r1[2]["status"] == 200
    session = r1[0]["headers"]["mcp-session-id"]
    assert session and r1[1]["session"] == session and r1[2]["session"] == session
    assert r1[2]["version"] == "2025-11-25"

    assert rpcs(c, run2) == ["tools/call"], "the second run must reuse the session"
    r2 = results(c, run2)
    assert r2[0]["session"] == session and r2[0]["status"] == 200
    for run_id in (run1, run2):
        assert [p["position"] for p in payloads(c, run_id, "tool_call")] == \
            list(range(len(rpcs(c, run_id))))


def test_session_lost_by_a_server_restart_is_recovered(wf, conns, mcp_restarts):
    c = conns(wf)
    before = call(c, "echo", {"message": "before"})
    assert completed(before)["text"] == "Echo: before"
    old_session = [r for r in results(c, before["run_id"])
                   if r["op"] == "initialize"][0]["headers"]["mcp-session-id"]
    # the workers hold sessions too
    for i in range(4):
        completed(call(c, "echo", {"message": f"worker before {i}"}, "worker"))

    restart_mcp_server(mcp_restarts)

    res = call(c, "echo", {"message": "after"})
    assert completed(res)["text"] == "Echo: after"
    assert rpcs(c, res["run_id"]) == ["tools/call", "initialize", "notifications/initialized", "tools/call"]
    r = results(c, res["run_id"])
    assert r[0]["op"] == "call" and r[0]["status"] in (400, 404), r[0]
    assert r[0]["session"] == old_session
    assert r[1]["status"] == 200
    new_session = r[1]["headers"]["mcp-session-id"]
    assert new_session and new_session != old_session
    assert r[3]["status"] == 200 and r[3]["session"] == new_session
    assert journal_violations(c, [res["run_id"]]) == []
    # (whether the new session is cached: test_the_session_made_in_a_recovery_is_cached)
    assert completed(call(c, "echo", {"message": "again"}))["text"] == "Echo: again"
    # the workers recover as well
    for i in range(4):
        assert completed(call(c, "echo", {"message": f"worker after {i}"}, "worker"))["text"] == \
            f"Echo: worker after {i}"


# ---------------------------------------------------------------------------
# A scripted server: what the reference server never sends


@pytest.fixture(scope="module")
def scripted():
    srv = ScriptedMcpServer()
    yield srv
    srv.close()


def test_event_stream_with_comments_notifications_and_split_data_is_parsed(conn, mode, scripted):
    say = unique("say")
    res = call(conn, "chatty", {"say": say}, mode, url=scripted.url)
    out = completed(res)
    assert out["text"] == f"chatty: {say}\nsecond block"
    assert out["content"] == [{"type": "text", "text": f"chatty: {say}"},
                              {"type": "text", "text": "second block"}]
    # what the server received for this call
    body = [r for r in scripted.requests if say in r["body"]]
    assert len(body) == 1
    headers = body[0]["headers"]
    assert "application/json" in headers["accept"] and "text/event-stream" in headers["accept"]
    assert headers["content-type"] == "application/json"
    assert headers["mcp-session-id"].startswith("scripted-")
    assert headers["mcp-protocol-version"] == "2025-11-25"
    msg = json.loads(body[0]["body"])
    assert msg["jsonrpc"] == "2.0" and msg["method"] == "tools/call"
    assert msg["params"] == {"name": "chatty", "arguments": {"say": say}}


@pytest.mark.parametrize("tool", ["plain", "batch", "eof"])
def test_json_batch_and_unterminated_stream_answers_are_parsed(conn, mode, scripted, tool):
    say = unique("say")
    out = completed(call(conn, tool, {"say": say}, mode, url=scripted.url))
    assert out["text"] == f"{tool}: {say}\nsecond block"


def test_handshake_messages_are_well_formed(wf, conns, scripted):
    c = conns(wf)
    start = len(scripted.requests)
    completed(call(c, "plain", {"say": "x"}, url=scripted.url))
    got = scripted.requests[start:]
    msgs = [json.loads(r["body"]) for r in got]
    assert [m["method"] for m in msgs] == ["server/discover", "initialize", "notifications/initialized",
                                           "tools/call"]
    discover, init, note, tcall = msgs
    # ids are the effects' idempotency keys: strings no other request repeats
    assert re.fullmatch(r"tuvl-[0-9a-f]{16}-\d+-\d+-0", discover["id"]), discover["id"]
    assert init["id"] == discover["id"][:-1] + "1"
    assert init["params"]["protocolVersion"] == "2025-11-25"
    assert init["params"]["clientInfo"]["name"] == "tuvl" and "capabilities" in init["params"]
    assert "mcp-session-id" not in got[1]["headers"]
    assert "id" not in note, "a notification has no id"
    assert got[2]["headers"]["mcp-session-id"] == got[3]["headers"]["mcp-session-id"]
    assert tcall["id"] == discover["id"][:-1] + "3"


def test_session_forgotten_with_404_is_recovered(wf, conns, scripted):
    c = conns(wf)
    completed(call(c, "plain", {"say": "one"}, url=scripted.url))
    scripted.forget_sessions()
    start = len(scripted.requests)
    res = call(c, "chatty", {"say": "two"}, url=scripted.url)
    assert completed(res)["text"] == "chatty: two\nsecond block"
    assert rpcs(c, res["run_id"]) == ["tools/call", "initialize", "notifications/initialized", "tools/call"]
    assert results(c, res["run_id"])[0]["status"] == 404
    log = scripted.rpc_log()[start:]
    assert [m for m, _, _ in log] == ["tools/call", "initialize", "notifications/initialized", "tools/call"]
    assert log[0][1] != log[3][1] and log[1][1] is None and log[2][1] == log[3][1]


def test_a_tool_error_result_takes_the_error_route(conn, mode, scripted):
    res = call(conn, "nope", {}, mode, url=scripted.url)
    assert res["end"] == "oops", res
    assert "unknown tool nope" in res["response"]["error"]
    assert res["response"]["type"] == "mcp_tool_error"


def test_a_json_rpc_error_takes_the_error_route(conn, mode, scripted):
    res = call(conn, "rpcerror", {}, mode, url=scripted.url)
    assert res["end"] == "oops", res
    assert "scripted failure" in res["response"]["error"]
    assert res["response"]["type"] == "mcp_error"
    done = payloads(conn, res["run_id"], "agent_completed")[0]
    assert "-32603" in done.get("detail", ""), done


def test_a_server_that_cannot_be_reached_is_an_mcp_error(conn, mode):
    """The client raises unclassified; the step classifies what it raises."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = call(conn, "echo", {"message": "x"}, mode, url=f"http://127.0.0.1:{port}/mcp")
    assert res["end"] == "oops", res
    assert res["response"]["error"].startswith("MCP server/discover failed"), res
    assert res["response"]["type"] == "mcp_error", res


def test_list_tools_follows_next_cursor(conn, scripted):
    tools = q1(conn, "SELECT tuvl.mcp_list_tools(%s)", (scripted.url,))
    assert sorted(t["name"] for t in tools) == ["chatty", "plain"]


def test_the_session_made_in_a_recovery_is_cached(wf, conns, scripted):
    c = conns(wf)
    completed(call(c, "plain", {"say": "one"}, url=scripted.url))
    scripted.forget_sessions()
    res = call(c, "plain", {"say": "two"}, url=scripted.url)
    assert rpcs(c, res["run_id"]) == ["tools/call", "initialize", "notifications/initialized", "tools/call"]
    recovered = results(c, res["run_id"])[1]["headers"]["mcp-session-id"]
    res = call(c, "plain", {"say": "three"}, url=scripted.url)
    assert completed(res)["text"] == "plain: three\nsecond block"
    assert rpcs(c, res["run_id"]) == ["tools/call"], "the recovered session was not reused"
    assert results(c, res["run_id"])[0]["session"] == recovered


def test_concurrent_calls_on_a_shared_session_are_all_answered(conn):
    """16 runs call a tool that takes a second, at once, in the workers: each
    worker shares one session among its runs, and each request has an id no
    other request of the session has, so the reference server (built on the
    official SDK) answers every one of them, in about a second."""
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("SELECT array_agg(tuvl.start_run('mcp_any', jsonb_build_object('url', %s::text, "
                    "'tool', 'trigger-long-running-operation', 'args', '{\"duration\": 1, \"steps\": 1}'::jsonb))) "
                    "FROM generate_series(1, 16)", (MCP_URL,))
        ids = cur.fetchone()[0]
        cur.execute("COMMIT")
    started = time.monotonic()
    for run_id in ids:
        assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    took = time.monotonic() - started
    rows = q(conn, "SELECT end_name, response FROM tuvl.runs WHERE id = ANY(%s)", (ids,))
    assert all(end == "done" and "Long running operation completed" in json.dumps(resp) for end, resp in rows), rows
    assert took < 10, f"the calls took {took:.1f} s: some waited for an answer that went to another call"


def test_sessions_a_worker_does_not_keep_are_ended_when_their_step_is_done(conn, scripted):
    """Runs that start together on a worker with no session for a server each
    open one (the handshake is slow here); the worker keeps one per server and
    ends every other with DELETE as soon as its step's call is answered, so a
    server (or a stdio bridge) is not left with abandoned sessions."""
    url = scripted.url + "?init_delay=0.3&drop=" + unique("s")
    start = len(scripted.requests)
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("SELECT array_agg(tuvl.start_run('mcp_any', jsonb_build_object('url', %s::text, "
                    "'tool', 'plain', 'args', '{\"say\": \"hi\"}'::jsonb))) FROM generate_series(1, 12)", (url,))
        ids = cur.fetchone()[0]
        cur.execute("COMMIT")
    for run_id in ids:
        assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    workers = q1(conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                       "AND datname = current_database()")
    mine = [r for r in scripted.requests[start:] if r["path"].endswith(url[len(scripted.url):])]
    called = {r["headers"].get("mcp-session-id") for r in mine if json.loads(r["body"])["method"] == "tools/call"}
    assert None not in called and len(called) > workers, (called, workers)

    def live():
        return called - {d["session"] for d in scripted.deletes}
    wait_until(lambda: len(live()) <= workers, 10, message="the DELETEs of the sessions no worker keeps")
    ended = [d for d in scripted.deletes if d["session"] in called]
    assert all(d["known"] and d["headers"]["mcp-protocol-version"] == "2025-11-25" for d in ended), ended
    # the sessions kept are still used: a later run makes no new handshake
    start = len(scripted.requests)
    run_id = q1(conn, "SELECT tuvl.start_run('mcp_any', jsonb_build_object('url', %s::text, 'tool', 'plain', "
                      "'args', '{\"say\": \"again\"}'::jsonb))", (url,))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    later = [json.loads(r["body"])["method"] for r in scripted.requests[start:] if r["path"].endswith(url[len(scripted.url):])]
    assert later == ["tools/call"], later
    assert {r["headers"].get("mcp-session-id") for r in scripted.requests[start:]} <= live()


HEADERS_WORKFLOW = """
name: {name}
steps:
  - id: tool
    kind: MCP
    mcp:
      url: "{{{{ url }}}}"
      tool: plain
      arguments: {{ say: hi }}
      headers: {{ Authorization: "Bearer {{{{ secrets.{secret} }}}}", X-Tenant: "{{{{ tenant }}}}" }}
    output: res
ends:
  - {{ id: done, status: completed, response: "{{{{ res }}}}" }}
"""


def test_mcp_headers_go_with_every_message_and_sessions_follow_them(wf, conns, scripted):
    c = conns(wf)
    name = unique("mcp_hdr")
    q(c, "SELECT tuvl.set_secret('mcp_hdr_token', 'tok-s3cret')")
    q(c, "SELECT tuvl.register_workflow(%s)", (HEADERS_WORKFLOW.format(name=name, secret="mcp_hdr_token"),))
    start = len(scripted.requests)
    res = execute(c, name, {"url": scripted.url, "tenant": "acme"})
    assert res["status"] == "completed", res
    got = scripted.requests[start:]
    assert [json.loads(r["body"])["method"] for r in got] == ["server/discover", "initialize",
                                                              "notifications/initialized", "tools/call"]
    assert {r["headers"]["authorization"] for r in got} == {"Bearer tok-s3cret"}
    assert {r["headers"]["x-tenant"] for r in got} == {"acme"}
    assert q1(c, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND payload::text LIKE '%%tok-s3cret%%'",
              (res["run_id"],)) == 0
    # the same credentials reuse this backend's session; other ones get their own
    start = len(scripted.requests)
    execute(c, name, {"url": scripted.url, "tenant": "acme"})
    assert [json.loads(r["body"])["method"] for r in scripted.requests[start:]] == ["tools/call"]
    start = len(scripted.requests)
    execute(c, name, {"url": scripted.url, "tenant": "globex"})
    assert [json.loads(r["body"])["method"] for r in scripted.requests[start:]][0] == "initialize"


def test_list_tools_sends_its_headers(conn, scripted):
    q(conn, "SELECT tuvl.set_secret('mcp_list_token', 'list-s3cret')")
    start = len(scripted.requests)
    tools = q1(conn, "SELECT tuvl.mcp_list_tools(%s, %s::jsonb)",
               (scripted.url, json.dumps({"Authorization": "Bearer {{ secrets.mcp_list_token }}"})))
    assert sorted(t["name"] for t in tools) == ["chatty", "plain"]
    assert {r["headers"].get("authorization") for r in scripted.requests[start:]} == {"Bearer list-s3cret"}
    assert q1(conn, "SELECT tuvl.mcp_list_tools(NULL)") is None


def test_mcp_headers_must_be_a_mapping(conn):
    src = ("name: v\nsteps:\n  - { id: t, kind: MCP, mcp: { url: 'http://x/mcp', tool: t, headers: [a] } }\n")
    rows = [r[1:] for r in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,))
            if r[0] == "error"]
    assert any(p == "steps[0].mcp.headers" and m.startswith("headers must be a mapping") for p, m in rows), rows


def test_a_protocol_revision_tuvl_does_not_implement_is_refused_clearly(conn, scripted, monkeypatch):
    import httputil
    scripted.forget_sessions()
    monkeypatch.setattr(httputil, "MCP_VERSION", "2099-01-01")
    res = call(conn, "plain", {"say": "x"}, url=scripted.url + "?v=future")
    assert res["end"] == "oops", res
    assert res["response"]["error"] == ("MCP initialize failed: the server speaks protocol revision "
                                        "2099-01-01, which tuvl does not implement"), res
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.mcp_list_tools(%s)", (scripted.url + "?v=future2",))
    assert "protocol revision 2099-01-01" in str(e.value)
    # an earlier revision this client implements is accepted
    monkeypatch.setattr(httputil, "MCP_VERSION", "2025-06-18")
    assert completed(call(conn, "plain", {"say": "y"}, url=scripted.url + "?v=older"))


def test_a_process_ends_its_sessions_when_it_exits(wf, scripted):
    """A backend that ran an MCP step holds a session; when it exits it sends
    DELETE with the session's id (and the step's headers), so the server can
    free it.  mcp_list_tools() ends its own session at once."""
    c = connect(wf)
    try:
        completed(call(c, "plain", {"say": "bye"}, url=scripted.url + "?exit=1"))
        sid = [r["headers"]["mcp-session-id"] for r in scripted.requests
               if "exit=1" in r["path"] and "mcp-session-id" in r["headers"]][-1]
        before = len(scripted.deletes)
    finally:
        c.close()
    wait_until(lambda: any(d["session"] == sid for d in scripted.deletes[before:]), 10,
               message="the exiting backend's DELETE")
    (d,) = [d for d in scripted.deletes if d["session"] == sid]
    assert d["known"] and d["headers"]["mcp-protocol-version"] == "2025-11-25"
    c = connect(wf)
    try:
        before = len(scripted.deletes)
        q1(c, "SELECT tuvl.mcp_list_tools(%s)", (scripted.url + "?list=1",))
        assert [d["known"] for d in scripted.deletes[before:]] == [True]
    finally:
        c.close()
