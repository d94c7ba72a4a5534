"""Helpers of the HTTP and MCP effect suites (test_http.py, test_mcp.py).

- the scriptable HTTP test server that test/lib.sh starts (TUVL_HTTP_PORT):
  its request log (GET /_log) and its reset (DELETE /_log);
- executing a run through the synchronous tuvl.run() or through the
  background workers (tuvl.start_run + tuvl.wait), with the same result shape;
- reading a run's journal;
- small servers of our own, on any 127.x.y.z address: a recording server
  (to prove that a refused request was never sent) and a scripted MCP
  server (to exercise the event-stream parser with what the reference
  server never sends: progress notifications, comments, CRLF, multi-line
  data, answers to other ids, a lost session);
- finding, stopping and starting the process that listens on a port.
"""
import json
import re
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import q, q1, wait_until

HTTP_PORT = int(os.environ.get("TUVL_HTTP_PORT") or 0)
HTTP_BASE = f"http://127.0.0.1:{HTTP_PORT}"
MCP_URL = os.environ.get("TUVL_MCP_URL")
MCP_PORT = int(os.environ.get("TUVL_MCP_PORT") or 0) or (
    urllib.parse.urlparse(MCP_URL).port if MCP_URL else 0)

# Never let an http_proxy variable route the tests' own requests elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def unique(prefix="t"):
    """A token no other test (or earlier run of this one) uses."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------
# The HTTP test server


def _call(method, url, timeout=10):
    req = urllib.request.Request(url, method=method)
    with _OPENER.open(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def http_log():
    """{'requests': [{method, path, headers (lower-case), body, t}], 'peak': n}."""
    return _call("GET", f"{HTTP_BASE}/_log")


def clear_server_log():
    """Clear the log and the counters; returns the requests in flight right now."""
    _call("DELETE", f"{HTTP_BASE}/_log")
    # DELETE sets the peak to what is in flight at that moment.
    return http_log()["peak"]


def requests_with(token):
    """The logged requests whose path contains token, in arrival order."""
    return [r for r in http_log()["requests"] if token in r["path"]]


def query_of(request):
    """The query parameters of a logged request (last value of each)."""
    return {k: v[-1] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(request["path"]).query,
                                                        keep_blank_values=True).items()}


def closed_port():
    """A port on 127.0.0.1 nobody listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------------------
# Runs


def execute(conn, workflow, data=None, mode="sync", timeout=30):
    """Run workflow once and return {run_id, status, end, response, error}.

    mode "sync": tuvl.run() in this session (effects performed inline);
    mode "worker": tuvl.start_run() and tuvl.wait(), the background workers
    perform the effects.
    """
    payload = json.dumps(data or {})
    if mode == "sync":
        return q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (workflow, payload))
    assert mode == "worker", mode
    run_id = q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (workflow, payload))
    status = q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))
    assert status in ("completed", "failed", "aborted"), \
        f"run {run_id} is still {status} after {timeout} s"
    status, end, response, error = q(conn, "SELECT status, end_name, response, error "
                                           "FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    return {"run_id": run_id, "status": status, "end": end, "response": response, "error": error}


def journal(conn, run_id, types=None):
    """[(seq, type, agent_id, payload, ts_epoch, latency_ms)] of a run, in order."""
    rows = q(conn, "SELECT seq, type, agent_id, payload, extract(epoch FROM ts)::float8, latency_ms "
                   "FROM tuvl.events WHERE run_id = %s ORDER BY seq", (run_id,))
    if types is not None:
        rows = [r for r in rows if r[1] in types]
    return rows


def payloads(conn, run_id, event_type):
    return [r[3] for r in journal(conn, run_id, (event_type,))]


def event_gap(conn, run_id, first_type, second_type):
    """Seconds between the first event of one type and the last of another."""
    rows = journal(conn, run_id)
    t0 = min(r[4] for r in rows if r[1] == first_type)
    t1 = max(r[4] for r in rows if r[1] == second_type)
    return t1 - t0


# ---------------------------------------------------------------------------
# Servers of our own


class _QuietHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n).decode("utf-8", "replace") if n else ""

    def send(self, code, body=b"", ctype="application/json", headers=None):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        if data or code != 202:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class BackgroundServer:
    """A ThreadingHTTPServer on host:<free port> in a daemon thread; records requests."""

    def __init__(self, handler_class, host="127.0.0.1"):
        self.requests = []
        self.deletes = []
        self.lock = threading.Lock()
        outer = self

        class Handler(handler_class):
            server_state = outer

        self.httpd = _Server((host, 0), Handler)
        self.host = host
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self):
        return f"http://{self.host}:{self.port}"

    def record(self, handler, body):
        with self.lock:
            self.requests.append({"method": handler.command, "path": handler.path,
                                  "headers": {k.lower(): v for k, v in handler.headers.items()},
                                  "body": body, "t": time.time()})

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _RecordingHandler(_QuietHandler):
    def handle_any(self):
        body = self.read_body()
        self.server_state.record(self, body)
        self.send(200, json.dumps({"ok": True, "recorded": True}))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = handle_any


def recording_server(host="127.0.0.1"):
    """Answers 200 to everything and remembers each request."""
    return BackgroundServer(_RecordingHandler, host)


# A scripted MCP server (streamable HTTP, protocol 2025-11-25).

MCP_VERSION = "2025-11-25"


def _sse(events, crlf=True):
    """An event stream from a list of events, each a list of field lines."""
    nl = "\r\n" if crlf else "\n"
    return "".join("".join(line + nl for line in ev) + nl for ev in events)


class _McpHandler(_QuietHandler):
    """Tools (all answer through an event stream unless said otherwise):

    chatty     a comment, a priming event, progress notifications, an answer
               to another request id and the answer split over two data lines,
               CRLF line ends, sent in chunks with pauses
    plain      the answer as application/json
    batch      a JSON array holding a notification and the answer
    rpcerror   a JSON-RPC error instead of a result
    (other)    a result with isError: true

tools/list answers in two pages (nextCursor).
    eof        LF line ends, and the last event is not followed by a blank line
    """

    def do_DELETE(self):
        """The client ends its session (kept apart from the JSON-RPC requests)."""
        state = self.server_state
        self.read_body()
        sid = self.headers.get("Mcp-Session-Id")
        with state.lock:
            known = sid in state.sessions
            state.sessions.discard(sid)
            state.deletes.append({"session": sid, "headers": {k.lower(): v for k, v in self.headers.items()},
                                  "known": known, "t": time.time()})
        return self.send(200 if known else 404, "")

    def do_POST(self):
        state = self.server_state
        body = self.read_body()
        state.record(self, body)
        msg = json.loads(body)
        method = msg.get("method")
        sid = self.headers.get("Mcp-Session-Id")
        if method == "initialize":
            # ?init_delay=S: a slow handshake, so that runs starting together all open one
            m = re.search(r"init_delay=([0-9.]+)", self.path)
            if m:
                time.sleep(float(m.group(1)))
            with state.lock:
                state.counter += 1
                new = f"scripted-{state.counter}"
                state.sessions.add(new)
            result = {"protocolVersion": MCP_VERSION, "capabilities": {"tools": {}},
                      "serverInfo": {"name": "scripted", "version": "1"}}
            return self.send(200, json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}),
                             headers={"Mcp-Session-Id": new})
        if sid not in state.sessions:
            return self.send(404, json.dumps({"jsonrpc": "2.0", "id": msg.get("id"),
                                              "error": {"code": -32001, "message": "Session not found"}}))
        if method == "notifications/initialized":
            return self.send(202)
        if method == "tools/list":
            # two pages, as a server with many tools sends them
            cursor = (msg.get("params") or {}).get("cursor")
            schema = {"type": "object", "properties": {"say": {"type": "string"}}}
            if cursor is None:
                result = {"tools": [{"name": "chatty", "inputSchema": schema}], "nextCursor": "page-2"}
            else:
                result = {"tools": [{"name": "plain", "inputSchema": schema}]}
            return self.send(200, json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}))
        if method != "tools/call":
            return self.send(400, json.dumps({"jsonrpc": "2.0", "id": msg.get("id"),
                                              "error": {"code": -32601, "message": "no such method"}}))
        rid = msg["id"]
        tool = msg["params"]["name"]
        args = msg["params"].get("arguments") or {}
        text = f"{tool}: {args.get('say', '')}"
        answer = {"jsonrpc": "2.0", "id": rid,
                  "result": {"content": [{"type": "text", "text": text},
                                         {"type": "text", "text": "second block"}]}}
        progress = [{"jsonrpc": "2.0", "method": "notifications/progress",
                     "params": {"progressToken": "p", "progress": i, "total": 3}} for i in (1, 2, 3)]
        if tool == "plain":
            return self.send(200, json.dumps(answer))
        if tool == "batch":
            return self.send(200, json.dumps([progress[0], answer]))
        if tool == "rpcerror":
            return self.send(200, json.dumps({"jsonrpc": "2.0", "id": rid,
                                              "error": {"code": -32603, "message": "scripted failure"}}))
        if tool == "eof":
            stream = _sse([["event: message", "data: " + json.dumps(progress[0])]], crlf=False)
            stream += "event: message\ndata: " + json.dumps(answer)
            return self.send(200, stream, "text/event-stream")
        if tool != "chatty":
            fail = dict(answer)
            fail["result"] = {"content": [{"type": "text", "text": f"unknown tool {tool}"}],
                              "isError": True}
            return self.send(200, json.dumps(fail))
        # an answer to another request of the session (ids are strings or numbers)
        other = {"jsonrpc": "2.0", "id": f"{rid}-other" if isinstance(rid, str) else rid + 1000,
                 "result": {"content": [{"type": "text", "text": "not yours"}]}}
        whole = json.dumps(answer)
        cut = whole.index('"result"')
        chunks = [
            ": keep-alive comment\r\n\r\n",
            _sse([["id: e0", "retry: 1000", "data:"]]),
            *[_sse([["event: message", "id: e%d" % i, "data: " + json.dumps(p)]])
              for i, p in enumerate(progress, 1)],
            _sse([["event: message", "data: " + json.dumps(other)]]),
            _sse([["event: message", "id: e9", "data: " + whole[:cut], "data: " + whole[cut:]]]),
        ]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            data = chunk.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.05)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class ScriptedMcpServer(BackgroundServer):
    def __init__(self, host="127.0.0.1"):
        self.sessions = set()
        self.counter = 0
        super().__init__(_McpHandler, host)

    @property
    def url(self):
        return f"{self.base}/mcp"

    def forget_sessions(self):
        """As a restarted server would: every session id becomes unknown (404)."""
        with self.lock:
            self.sessions.clear()

    def rpc_log(self):
        """[(rpc method, session header, protocol version header)] in arrival order."""
        with self.lock:
            return [(json.loads(r["body"]).get("method"), r["headers"].get("mcp-session-id"),
                     r["headers"].get("mcp-protocol-version")) for r in self.requests]


# ---------------------------------------------------------------------------
# Processes and ports


def port_open(port, host="127.0.0.1"):
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_port(port, timeout=20, host="127.0.0.1"):
    return wait_until(lambda: port_open(port, host), timeout, interval=0.1,
                      message=f"something to listen on {host}:{port}")


def _listening_inodes(port):
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except OSError:
            continue
    return inodes


def pids_listening_on(port):
    """Pids of the processes holding a listening socket on port (from /proc)."""
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    pids = set()
    if not wanted:
        return pids
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(f"{fd_dir}/{fd}") in wanted:
                        pids.add(int(pid))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return pids
