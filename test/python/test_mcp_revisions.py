"""MCP protocol revisions: the stateless 2026-07-28 revision beside 2025-11-25.

tuvl asks a server it does not know which revisions it speaks
(server/discover), remembers the answer per URL in the process, calls a
2026-07-28 server statelessly (one tools/call carrying _meta and the
MCP-Protocol-Version, Mcp-Method and Mcp-Name headers; no initialize, no
session), falls back to initialize for a server that does not offer it, and
negotiates down (a stateless call answered 400/-32022) or up (an initialize
answered -32022 by a server naming 2026-07-28) within a step.

The servers are the scripted 2026-07-28 server of test/servers
(mcp_stateless_server.py, started here on free ports with the revisions each
test needs) and, for 2025-11-25 with sessions, the third-party reference
server test/lib.sh starts (TUVL_MCP_URL).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from conftest import connect, kill_worker, q, q1, register_workflows, wait_run_finished, wait_until
from httputil import MCP_URL, execute, payloads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = os.path.join(ROOT, "test", "servers", "mcp_stateless_server.py")
V26 = "2026-07-28"
V25 = "2025-11-25"

WORKFLOW = """
name: mcp_rev
steps:
  - id: tool
    kind: MCP
    mcp: { url: "{{ url }}", tool: "{{ tool }}", arguments: "{{ args }}" }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}", type: "{{ _last_error_type }}" } }
"""


class Stateless:
    """A scripted 2026-07-28 server on a free port."""

    def __init__(self, *args):
        self.err = tempfile.NamedTemporaryFile(prefix="mcp26.", suffix=".err", delete=False)
        self.proc = subprocess.Popen([sys.executable, SERVER, "--port", "0", *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.err)
        deadline = time.monotonic() + 15
        while True:
            with open(self.err.name) as f:
                line = f.readline()
            if line.endswith("\n") and ":" in line:
                self.port = int(line.rsplit(":", 1)[1])
                break
            assert self.proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/mcp"

    def _json(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def log(self):
        return self._json("GET", "/_log")["requests"]

    def methods(self):
        return [e["method"] for e in self.log()]

    def clear(self):
        self._json("DELETE", "/_log")

    def speak(self, *versions):
        self._json("POST", "/_config", {"versions": list(versions)})

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        self.err.close()
        os.unlink(self.err.name)


@pytest.fixture
def server():
    srv = Stateless()
    yield srv
    srv.stop()


@pytest.fixture
def only25():
    srv = Stateless("--versions", V25)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def wf(db):
    return register_workflows(db, WORKFLOW)

ELICIT = """
name: mcp_rev_{policy}
steps:
  - id: tool
    kind: MCP
    mcp:
      url: "{{{{ url }}}}"
      tool: confirm
      arguments: {{ operation: "{{{{ op }}}}" }}
      elicitation: {policy}
    output: res
    routes: {{ default: done, error: oops }}
ends:
  - {{ id: done, status: completed, response: "{{{{ res }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}" }} }}
"""


@pytest.fixture(scope="module")
def elicit_wf(wf):
    conn = connect(wf)
    for policy in ("accept_defaults", "decline"):
        q(conn, "SELECT tuvl.register_workflow(%s)", (ELICIT.format(policy=policy),))
    conn.close()
    return wf


def call(conn, url, tool, args, mode="sync"):
    return execute(conn, "mcp_rev", {"url": url, "tool": tool, "args": args}, mode)


def rpcs(conn, run_id):
    return [p["request"].get("rpc") for p in payloads(conn, run_id, "tool_call")]


def completed(res):
    assert res["status"] == "completed" and res["end"] == "done", res
    return res["response"]


def test_a_stateless_server_is_called_without_handshake_or_session(wf, conns, server):
    c = conns(wf)       # a new backend: it knows no server yet
    first = call(c, server.url, "add", {"a": 2, "b": 40})
    assert completed(first)["text"] == "The sum of 2 and 40 is 42"
    assert completed(first)["structuredContent"] == {"sum": 42}
    assert rpcs(c, first["run_id"]) == ["server/discover", "tools/call"]
    ops = payloads(c, first["run_id"], "tool_result")
    assert [r["result"]["op"] for r in ops] == ["discover", "call"]
    assert ops[1]["result"]["version"] == V26 and "session" not in ops[1]["result"]
    log = server.log()
    assert [e["method"] for e in log] == ["server/discover", "tools/call"]
    tcall = log[1]
    assert tcall["version"] == V26 and tcall["status"] == 200
    h = tcall["headers"]
    assert h["mcp-protocol-version"] == V26 and h["mcp-method"] == "tools/call" and h["mcp-name"] == "add"
    assert "mcp-session-id" not in h
    meta = tcall["body"]["params"]["_meta"]
    assert meta["io.modelcontextprotocol/protocolVersion"] == V26
    # mcp.elicitation ask, the default: the server may ask a person (test_mcp_elicitation.py)
    assert meta["io.modelcontextprotocol/clientCapabilities"] == {
        "elicitation": {"form": {}}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
    assert meta["io.modelcontextprotocol/clientInfo"]["name"] == "tuvl"
    # the journal keeps the call's tool and arguments, not the _meta
    assert payloads(c, first["run_id"], "tool_call")[1]["request"]["arguments"] == {"a": 2, "b": 40}

    # the process remembers the revision: the next call is one request
    second = call(c, server.url, "echo", {"text": "again"})
    assert completed(second)["text"] == "again"
    assert rpcs(c, second["run_id"]) == ["tools/call"]
    assert server.methods() == ["server/discover", "tools/call", "tools/call"]


def test_workers_call_a_stateless_server_too(wf, conns, server):
    c = conns(wf)
    for i in range(3):
        assert completed(call(c, server.url, "echo", {"text": f"w{i}"}, "worker"))["text"] == f"w{i}"
    methods = server.methods()
    assert "initialize" not in methods and methods.count("tools/call") == 3
    assert all("mcp-session-id" not in e["headers"] for e in server.log())


def test_a_2025_server_is_initialized_after_discovery_fails(wf, conns, only25):
    c = conns(wf)
    res = call(c, only25.url, "echo", {"text": "old"})
    assert completed(res)["text"] == "old"
    assert rpcs(c, res["run_id"]) == ["server/discover", "initialize", "notifications/initialized",
                                      "tools/call"]
    init = [e for e in only25.log() if e["method"] == "initialize"][0]
    assert init["body"]["params"]["protocolVersion"] == V25
    # remembered: no second discovery
    res = call(c, only25.url, "echo", {"text": "old again"})
    assert rpcs(c, res["run_id"]) == ["initialize", "notifications/initialized", "tools/call"]


@pytest.mark.skipif(not MCP_URL, reason="TUVL_MCP_URL is not set (run through test/run)")
def test_the_reference_2025_server_keeps_its_session(wf, conns):
    c = conns(wf)
    first = call(c, MCP_URL, "echo", {"message": "one"})
    assert completed(first)["text"] == "Echo: one"
    assert rpcs(c, first["run_id"]) == ["server/discover", "initialize", "notifications/initialized",
                                        "tools/call"]
    r = [p["result"] for p in payloads(c, first["run_id"], "tool_result")]
    assert r[0]["op"] == "discover" and r[0]["status"] >= 400
    second = call(c, MCP_URL, "echo", {"message": "two"})
    assert rpcs(c, second["run_id"]) == ["tools/call"]


def test_a_server_that_stops_speaking_2026_is_negotiated_down(wf, conns, server):
    c = conns(wf)
    completed(call(c, server.url, "echo", {"text": "new"}))
    server.speak(V25)
    res = call(c, server.url, "echo", {"text": "down"})
    assert completed(res)["text"] == "down"
    assert rpcs(c, res["run_id"]) == ["tools/call", "initialize", "notifications/initialized", "tools/call"]
    refused = payloads(c, res["run_id"], "tool_result")[0]["result"]
    assert refused["status"] == 400 and refused["body"]["error"]["code"] == -32022
    # the process now knows it as a 2025 server
    res = call(c, server.url, "echo", {"text": "down again"})
    assert rpcs(c, res["run_id"]) == ["initialize", "notifications/initialized", "tools/call"]


def test_a_server_that_speaks_only_2026_is_negotiated_up(wf, conns, only25):
    c = conns(wf)
    completed(call(c, only25.url, "echo", {"text": "old"}))
    only25.speak(V26)
    res = call(c, only25.url, "echo", {"text": "up"})
    assert completed(res)["text"] == "up"
    assert rpcs(c, res["run_id"]) == ["initialize", "tools/call"]
    res = call(c, only25.url, "echo", {"text": "up again"})
    assert rpcs(c, res["run_id"]) == ["tools/call"]


def test_errors_and_tool_errors_on_the_stateless_revision(wf, conns, server):
    c = conns(wf)
    res = call(c, server.url, "fail", {})
    assert res["end"] == "oops" and res["response"]["type"] == "mcp_tool_error"
    assert "the tool failed" in res["response"]["error"]
    res = call(c, server.url, "nosuch", {})
    assert res["end"] == "oops" and res["response"]["type"] == "mcp_error"
    assert "Unknown tool: nosuch" in res["response"]["error"]
    # a call that needs a person's input waits for one (test_mcp_elicitation.py)
    res = call(c, server.url, "confirm", {"operation": "deploy"})
    assert res["status"] == "waiting_human", res
    q(c, "SELECT tuvl.abort_run(%s)", (res["run_id"],))


def test_list_tools_is_stateless_on_a_2026_server(wf, conns, server):
    c = conns(wf)
    tools = q1(c, "SELECT tuvl.mcp_list_tools(%s)", (server.url,))
    assert [t["name"] for t in tools] == ["echo", "add", "slow", "fail", "confirm", "long",
                                           "ask_on_stream"]
    log = server.log()
    assert [e["method"] for e in log] == ["server/discover", "tools/list"]
    assert log[1]["version"] == V26 and log[1]["headers"]["mcp-method"] == "tools/list"
    assert "mcp-name" not in log[1]["headers"]


def test_a_server_refusing_both_revisions_fails_without_looping(wf, conns):
    """A hostile server: offers 2026-07-28, refuses it with -32022 naming it,
    and refuses initialize the same way.  The step must end, in three requests."""
    import http.server
    import threading
    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(msg["method"])
            if msg["method"] == "server/discover":
                body, status = {"jsonrpc": "2.0", "id": msg["id"],
                                "result": {"supportedVersions": [V26]}}, 200
            else:
                body, status = {"jsonrpc": "2.0", "id": msg.get("id"),
                                "error": {"code": -32022, "message": "no",
                                          "data": {"supported": [V26], "requested": V26}}}, 400
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        c = conns(wf)
        res = call(c, f"http://127.0.0.1:{srv.server_address[1]}/mcp", "echo", {"text": "x"})
        assert res["end"] == "oops" and res["response"]["type"] == "mcp_error", res
        assert "initialize failed: the server answered HTTP 400" in res["response"]["error"]
        assert seen == ["server/discover", "tools/call", "initialize"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_ordinary_role_calls_a_stateless_server(wf, conns, server):
    admin = conns(wf)
    role = "mcprev_user"
    q(admin, f"DROP ROLE IF EXISTS {role}")
    q(admin, f"CREATE ROLE {role} LOGIN")
    q(admin, f"GRANT tuvl_user TO {role}")
    try:
        c = conns(wf, user=role)
        res = call(c, server.url, "echo", {"text": "as a user"})
        assert completed(res)["text"] == "as a user"
        assert "initialize" not in server.methods()
    finally:
        q(admin, f"DROP OWNED BY {role}")
        q(admin, f"DROP ROLE {role}")


def test_kill_9_during_a_stateless_call_resumes_without_any_session(wf, conns, server, server_log):
    c = conns(wf)
    run_id = q1(c, "SELECT tuvl.start_run('mcp_rev', %s::jsonb)",
                (json.dumps({"url": server.url, "tool": "slow", "args": {"ms": 6000}}),))
    # the server logs a request when it arrives: the call is in flight now
    wait_until(lambda: "tools/call" in server.methods(), 20, message="the call to reach the server")
    holder = q1(c, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
    assert holder
    kill_worker(holder, server_log)
    c2 = connect(wf)
    try:
        wait_run_finished(c2, run_id, timeout=60)
        res = q1(c2, "SELECT pg_catalog.jsonb_build_object('status', status, 'response', response) "
                     "FROM tuvl.runs WHERE id = %s", (run_id,))
        assert res["status"] == "completed" and res["response"]["text"] == "slept 6000", res
    finally:
        c2.close()
    log = server.log()
    methods = [e["method"] for e in log]
    assert "initialize" not in methods and all("mcp-session-id" not in e["headers"] for e in log)
    calls = [e for e in log if e["method"] == "tools/call"]
    # the call resent after the crash carries the same JSON-RPC id (its effect's key)
    assert len(calls) >= 2 and len({e["body"]["id"] for e in calls}) == 1


@pytest.mark.parametrize("remembered", [False, True])
def test_a_stateless_call_replays_with_zero_requests(wf, conns, server, remembered):
    """Pinned and replayed: every answer comes from the fixture, whatever the
    replaying process remembers of the server (nothing, or its revision)."""
    c = conns(wf)
    if remembered:
        completed(call(c, server.url, "echo", {"text": "warm"}))
    res = call(c, server.url, "add", {"a": 1, "b": 2})
    assert completed(res)["text"] == "The sum of 1 and 2 is 3"
    fixture = q1(c, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
    c2 = conns(wf)      # another process: it knows nothing of the server
    if not remembered:
        completed(call(c2, server.url, "echo", {"text": "learn"}))
    server.clear()
    out = q1(c2, "SELECT tuvl.replay(%s::jsonb)", (json.dumps(fixture),))
    assert out["end"] == "done" and out["response"]["text"] == "The sum of 1 and 2 is 3", out
    assert out["effects_served"] == len(fixture["effects"])
    assert server.log() == [], "the replay sent a request"



@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_input_required_is_answered_with_the_schema_defaults(elicit_wf, conns, server, mode):
    c = conns(elicit_wf)
    res = execute(c, "mcp_rev_accept_defaults", {"url": server.url, "op": "deploy"}, mode)
    assert completed(res)["text"] == "deploy: accepted confirmed=false note=none"
    assert rpcs(c, res["run_id"])[-2:] == ["tools/call", "tools/call"]
    calls = [e for e in server.log() if e["method"] == "tools/call"]
    assert len(calls) == 2
    first, retry = calls[0]["body"]["params"], calls[1]["body"]["params"]
    caps = first["_meta"]["io.modelcontextprotocol/clientCapabilities"]
    assert caps == {"elicitation": {"form": {}}, "extensions": {"io.modelcontextprotocol/tasks": {}}}
    assert "inputResponses" not in first
    assert retry["inputResponses"] == {"confirm": {"action": "accept",
                                                   "content": {"confirmed": False, "note": "none"}}}
    assert retry["requestState"] and retry["arguments"] == {"operation": "deploy"}
    assert calls[0]["body"]["id"] != calls[1]["body"]["id"]
    # the answer given is journaled with the retried call
    journaled = payloads(c, res["run_id"], "tool_call")[-1]["request"]
    assert journaled["input_responses"]["confirm"]["action"] == "accept"


def test_input_required_is_declined(elicit_wf, conns, server):
    c = conns(elicit_wf)
    res = execute(c, "mcp_rev_decline", {"url": server.url, "op": "drop"})
    assert completed(res)["text"] == "drop: declined"
    retry = [e for e in server.log() if e["method"] == "tools/call"][1]["body"]["params"]
    assert retry["inputResponses"] == {"confirm": {"action": "decline"}}


def test_an_elicited_call_replays_with_zero_requests(elicit_wf, conns, server):
    c = conns(elicit_wf)
    res = execute(c, "mcp_rev_accept_defaults", {"url": server.url, "op": "ship"})
    assert completed(res)["text"] == "ship: accepted confirmed=false note=none"
    fixture = q1(c, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
    server.clear()
    out = q1(conns(elicit_wf), "SELECT tuvl.replay(%s::jsonb)", (json.dumps(fixture),))
    assert out["response"]["text"] == "ship: accepted confirmed=false note=none", out
    assert out["effects_served"] == len(fixture["effects"])
    assert server.log() == []


def test_the_elicitation_key_is_validated_with_its_path(wf, conns):
    c = conns(wf)
    bad = ELICIT.format(policy="maybe").replace("mcp_rev_maybe", "mcp_rev_bad")
    found = q(c, "SELECT severity, path, message FROM tuvl.validate(%s)", (bad,))
    assert found == [("error", "steps[0].mcp.elicitation",
                      "elicitation must be ask (the run waits for a person's answer, tuvl.submit() or "
                      "tuvl.reject()), accept_defaults (answer the server's questions with the "
                      "defaults of its schema) or decline (line 10, column 20)")], found
    for policy in ("ask", "accept_defaults", "decline"):
        assert q(c, "SELECT * FROM tuvl.validate(%s)", (ELICIT.format(policy=policy),)) == []
