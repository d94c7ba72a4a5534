"""MCP: a call's event stream closed before the answer is resumed.

A scripted 2025-11-25 server (here, in a thread) answers tools/call with an
event stream that names its event (id:, retry:) and closes before the
answer; the answer comes on the GET that resumes the stream (with
Last-Event-ID), which the server then keeps open, as the conformance
suite's sse-retry server does.
"""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import register_workflows
from httputil import execute, payloads

WORKFLOW = """
name: mcp_resume
steps:
  - id: tool
    kind: MCP
    mcp: { url: "{{ url }}", tool: slow, arguments: {}, timeout: 10s }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res.text }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}" } }
"""


class Resuming(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        st = self.server.st
        st["log"].append(("POST", msg.get("method"), dict(self.headers), time.monotonic()))
        if msg.get("method") == "initialize":
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": {
                "protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                "serverInfo": {"name": "resuming", "version": "1"}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Mcp-Session-Id", "s-1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif "id" not in msg:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif msg["method"] == "tools/call":
            st["pending"] = msg["id"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(f"id: ev-{st['n']}\nretry: {st['retry']}\ndata: \n\n".encode())
            self.wfile.flush()
            st["closed"] = time.monotonic()
            self.close_connection = True
        else:   # server/discover: not a 2026-07-28 server
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                               "error": {"code": -32601, "message": "Method not found"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_GET(self):
        st = self.server.st
        st["log"].append(("GET", None, dict(self.headers), time.monotonic()))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if st["answer_on_get"]:
            answer = {"jsonrpc": "2.0", "id": st["pending"],
                      "result": {"content": [{"type": "text", "text": "resumed"}]}}
            self.wfile.write(f"id: ev-2\ndata: \n\nevent: message\nid: ev-3\ndata: {json.dumps(answer)}\n\n".encode())
            self.wfile.flush()
            time.sleep(5)       # and keep the stream open
        else:
            self.wfile.write(b"id: ev-again\nretry: 100\ndata: \n\n")
            self.close_connection = True


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Resuming)
    srv.daemon_threads = True
    srv.st = {"log": [], "n": 1, "retry": 400, "pending": None, "closed": None, "answer_on_get": True}
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/mcp"
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def wf(db):
    return register_workflows(db, WORKFLOW)


@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_a_stream_closed_before_the_answer_is_resumed_with_last_event_id(wf, conns, server, mode):
    c = conns(wf)
    started = time.monotonic()
    res = execute(c, "mcp_resume", {"url": server.url}, mode)
    assert res["end"] == "done" and res["response"] == "resumed", res
    # the GET came after the retry delay, with the last event's id and the session
    gets = [e for e in server.st["log"] if e[0] == "GET"]
    assert len(gets) == 1
    headers = {k.lower(): v for k, v in gets[0][2].items()}
    assert headers["last-event-id"] == "ev-1"
    assert headers["mcp-session-id"] == "s-1"
    assert "text/event-stream" in headers["accept"]
    assert gets[0][3] - server.st["closed"] >= 0.4
    # a stream kept open after the answer does not wait for the timeout
    assert time.monotonic() - started < 5
    calls = [p["request"] for p in payloads(c, res["run_id"], "tool_call")]
    assert calls[-1]["method"] == "GET" and calls[-1]["last_event_id"] == "ev-1"


def test_a_stream_that_never_answers_is_resumed_three_times(wf, conns, server):
    c = conns(wf)
    server.st["answer_on_get"] = False
    res = execute(c, "mcp_resume", {"url": server.url})
    assert res["end"] == "oops", res
    assert "the event stream ended 4 times without the answer" in res["response"]["error"]
    assert len([e for e in server.st["log"] if e[0] == "GET"]) == 3
