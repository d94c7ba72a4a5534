#!/usr/bin/env python3
"""A scripted MCP server of the stateless revision 2026-07-28, for tuvl's tests.

Written from the published 2026-07-28 specification (there is no third-party
server of that revision on npm yet); the 2025-11-25 servers of the suite stay
the third-party ones (test/lib.sh).  Standard library only.

    python3 test/servers/mcp_stateless_server.py --port N
        [--versions 2026-07-28,2025-11-25] [--sse] [--auth AS_URL]
        [--scopes "mcp:tools"] [--log-max N]

--port 0 picks a free port; the one line on stderr names the port bound:
"MCP 2026-07-28 server on 127.0.0.1:PORT".

The MCP endpoint is POST /mcp (streamable HTTP, one JSON-RPC request per
POST; a batch is refused).  GET and DELETE /mcp are 405: the revision has no
standalone stream and no session.

Versions.  --versions lists the revisions the server speaks, newest first
(default 2026-07-28,2025-11-25).  2026-07-28 is stateless: no initialize, no
Mcp-Session-Id; every request carries in params._meta
"io.modelcontextprotocol/protocolVersion" and
"io.modelcontextprotocol/clientCapabilities" (an object), and the request
headers MCP-Protocol-Version (equal to the _meta version), Mcp-Method (equal
to the method) and, for tools/call, Mcp-Name (equal to params.name).  A
header that does not match the body is HTTP 400 with JSON-RPC error -32001
(HeaderMismatch).  A request for a revision the server does not speak (in
_meta, or a request without _meta when no 2025 revision is listed) is HTTP
400 with error -32022 (UnsupportedProtocolVersion), data {"supported": [...],
"requested": "..."}.  server/discover answers {supportedVersions,
capabilities, serverInfo, instructions} and needs no _meta.  When a 2025
revision is listed, a request without the _meta version is served as that
revision, statelessly (initialize answers with it and sets no session; a
2026-07-28 initialize is answered with the newest 2025 revision listed).
Every 2026-07-28 result carries "resultType" ("complete", or
"input_required").

Tools (tools/list):

  echo      {text}: the text back (also as structuredContent {"text": ...})
  add       {a, b}: "The sum of a and b is a+b", structuredContent {"sum"}
  slow      {ms}: sleeps ms milliseconds (at most 60000), then "slept ms"
  fail      {}: a tool error (isError true, text "the tool failed")
  confirm   {operation}: needs a person's answer.  On 2026-07-28 the first
            call returns resultType "input_required" with inputRequests
            {"confirm": {"method": "elicitation/create", "params": {"mode":
            "form", "message": "Confirm <operation>?", "requestedSchema":
            {confirmed: boolean (default false), note: string (default
            "none")}}}} and an opaque requestState; the client retries the
            same tools/call with params.inputResponses {"confirm": {"action":
            "accept"|"decline"|"cancel", "content": {...}}} and
            params.requestState as received.  The answer: "<operation>:
            accepted confirmed=<c> note=<n>", or "<operation>: declined" /
            "cancelled".  A retry whose requestState is not the one issued for
            these arguments is error -32602.  On a 2025 revision the tool
            answers "<operation>: no elicitation on this revision" (a tool
            error).
  long      {ms, poll_ms, fail}: a long call.  A client that declares the
            tasks extension (clientCapabilities.extensions
            "io.modelcontextprotocol/tasks") gets a task at once:
            resultType "task", a taskId, status "working", pollIntervalMs
            poll_ms (default 200); tasks/get {taskId} answers "working"
            until ms (default 1000) have passed since the call, then
            "completed" with the result "worked <ms>" (or, with fail,
            "failed" with a JSON-RPC error "the long work failed").  Without
            the extension the call sleeps ms and answers.  tasks/cancel
            {taskId} cancels it.  Tasks live in the server's memory.
  ask_on_stream  {}: on a 2025 revision, the server-initiated elicitation
            of that revision: the answer is an event stream holding an
            elicitation/create request (id "elicit-1", the confirm schema),
            kept open 20 s for a client's answer that this server never reads,
            then ended without the tool's answer.  On 2026-07-28 a tool error.

Responses are application/json, or with --sse (or ?sse=1 on the URL) a
text/event-stream of one priming event (an id and empty data) and one event
holding the response.

Authorization (--auth AS_URL, the OAuth authorization server of
test/servers/oauth_server.py): every POST /mcp needs "Authorization: Bearer
<token>", checked with the authorization server's introspection endpoint
(active, audience = this server's /mcp URL, scopes).  Without a valid token:
401 with WWW-Authenticate: Bearer resource_metadata="<base>/.well-known/
oauth-protected-resource/mcp", scope="<--scopes>"; a token lacking a scope
a tool needs (tools/call of "confirm" also needs "mcp:confirm"): 403 with
error="insufficient_scope" and the scope wanted.  GET
/.well-known/oauth-protected-resource[/mcp] answers {resource,
authorization_servers, scopes_supported, bearer_methods_supported}.

Control endpoints:

  GET    /_log        {"requests": [...]}: each {t, method, path, headers
                      (lower case), body, status, version, error}, logged
                      when it arrives (status null while in flight)
  DELETE /_log        clear it
  POST   /_config     {"versions": [...]}: change the revisions spoken (a
                      server upgraded or downgraded while clients remember
                      the old list)
  GET    /_health     {"ok": true}
"""
import argparse
import base64
import hashlib
import hmac
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATELESS = "2026-07-28"
LEGACY = ("2025-11-25", "2025-06-18", "2025-03-26")
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPS = "io.modelcontextprotocol/clientCapabilities"
HEADER_MISMATCH = -32001
UNSUPPORTED_VERSION = -32022

TOOLS = [
    {"name": "echo", "description": "Echo the text back.",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}},
                     "required": ["text"]}},
    {"name": "add", "description": "Add two numbers.",
     "inputSchema": {"type": "object",
                     "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                     "required": ["a", "b"]}},
    {"name": "slow", "description": "Sleep, then answer.",
     "inputSchema": {"type": "object", "properties": {"ms": {"type": "integer"}}}},
    {"name": "fail", "description": "Always a tool error.",
     "inputSchema": {"type": "object", "properties": {}}},
    {"name": "confirm", "description": "Ask a person to confirm an operation.",
     "inputSchema": {"type": "object", "properties": {"operation": {"type": "string"}},
                     "required": ["operation"]}},
    {"name": "long", "description": "A long call: a task for a client that polls.",
     "inputSchema": {"type": "object", "properties": {"ms": {"type": "integer"}, "poll_ms": {"type": "integer"},
                                                     "fail": {"type": "boolean"}}}},
    {"name": "ask_on_stream", "description": "Ask on the call's event stream (2025 revisions).",
     "inputSchema": {"type": "object", "properties": {}}},
]
CONFIRM_SCHEMA = {
    "type": "object",
    "properties": {
        "confirmed": {"type": "boolean", "title": "Confirmed", "default": False},
        "note": {"type": "string", "title": "Note", "default": "none"},
    },
    "required": ["confirmed"],
}


class RpcError(Exception):
    def __init__(self, status, code, message, data=None):
        super().__init__(message)
        self.status, self.code, self.message, self.data = status, code, message, data


class State:
    def __init__(self, versions, sse, auth, scopes, log_max):
        self.lock = threading.Lock()
        self.versions = list(versions)
        self.sse = sse
        self.auth = auth.rstrip("/") if auth else None
        self.scopes = scopes
        self.log = []
        self.log_max = log_max
        self.secret = os.urandom(16)
        self.tasks = {}

    def legacy(self):
        with self.lock:
            return [v for v in self.versions if v != STATELESS]

    def speaks(self, version):
        with self.lock:
            return version in self.versions

    def supported(self):
        with self.lock:
            return list(self.versions)

    def record(self, entry):
        with self.lock:
            self.log.append(entry)
            del self.log[:-self.log_max]

    def request_state(self, name, arguments):
        msg = json.dumps([name, arguments], sort_keys=True).encode()
        return base64.urlsafe_b64encode(hmac.new(self.secret, msg, hashlib.sha256).digest()).decode()


def text_result(text, structured=None, is_error=False):
    r = {"content": [{"type": "text", "text": text}]}
    if structured is not None:
        r["structuredContent"] = structured
    if is_error:
        r["isError"] = True
    return r


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mcp-stateless-server/1"

    def log_message(self, *args):
        pass

    # ------------------------------------------------------------ plumbing

    @property
    def st(self):
        return self.server.state

    def base(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def send(self, status, body, ctype="application/json", headers=None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # ------------------------------------------------------------ control

    def do_GET(self):
        path = urllib.parse.urlsplit(self.path).path
        if path == "/_health":
            return self.send(200, {"ok": True})
        if path == "/_log":
            with self.st.lock:
                return self.send(200, {"requests": list(self.st.log)})
        if path in ("/.well-known/oauth-protected-resource",
                    "/.well-known/oauth-protected-resource/mcp") and self.st.auth:
            return self.send(200, {
                "resource": self.base() + "/mcp",
                "authorization_servers": [self.st.auth],
                "scopes_supported": self.st.scopes.split() + ["mcp:confirm"],
                "bearer_methods_supported": ["header"],
            })
        if path == "/mcp":
            return self.send(405, {"error": "no standalone stream on this server"},
                             headers={"Allow": "POST"})
        self.send(404, {"error": "not found"})

    def do_DELETE(self):
        path = urllib.parse.urlsplit(self.path).path
        if path == "/_log":
            with self.st.lock:
                self.st.log.clear()
            return self.send(200, {"ok": True})
        if path == "/mcp":
            return self.send(405, {"error": "no session to end"}, headers={"Allow": "POST"})
        self.send(404, {"error": "not found"})

    def do_POST(self):
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/_config":
            try:
                conf = json.loads(self.read_body() or b"{}")
                versions = conf["versions"]
                assert isinstance(versions, list) and versions and all(
                    v == STATELESS or v in LEGACY for v in versions)
            except Exception:
                return self.send(400, {"error": "want {\"versions\": [known revisions]}"})
            with self.st.lock:
                self.st.versions = versions
            return self.send(200, {"versions": versions})
        if url.path != "/mcp":
            return self.send(404, {"error": "not found"})
        sse = self.st.sse or urllib.parse.parse_qs(url.query).get("sse") == ["1"]
        raw = self.read_body()
        entry = {"t": time.time(), "method": None, "path": self.path,
                 "headers": {k.lower(): v for k, v in self.headers.items()},
                 "body": None, "status": None, "version": None, "error": None}
        msg_id = None
        # logged on arrival (status null while in flight), completed below
        self.st.record(entry)
        try:
            try:
                msg = json.loads(raw)
            except ValueError:
                raise RpcError(400, -32700, "the body is not JSON")
            entry["body"] = msg
            if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0" or \
                    not isinstance(msg.get("method"), str):
                raise RpcError(400, -32600, "not a JSON-RPC 2.0 request (batches are refused)")
            msg_id = msg.get("id")
            entry["method"] = msg["method"]
            self.authorize(msg)
            if version_of_legacy_ask(self, msg):
                entry["status"] = 200
                return self.ask_on_stream(msg_id)
            result, version = self.dispatch(msg, entry)
            entry["version"] = version
            if msg_id is None:          # a notification
                entry["status"] = 202
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            reply = {"jsonrpc": "2.0", "id": msg_id, "result": result}
            status = 200
        except RpcError as e:
            entry["error"] = e.message
            if e.status in (401, 403):
                entry["status"] = e.status
                return self.send(e.status, {"error": e.message}, headers=e.data)
            err = {"code": e.code, "message": e.message}
            if e.data is not None:
                err["data"] = e.data
            reply = {"jsonrpc": "2.0", "id": msg_id, "error": err}
            status = e.status
        entry["status"] = status
        if sse and status == 200:
            body = ("id: 0\ndata: \n\n" + "event: message\ndata: " + json.dumps(reply) + "\n\n").encode()
            return self.send(200, body, ctype="text/event-stream")
        self.send(status, reply)

    def ask_on_stream(self, msg_id):
        # an event stream without Content-Length: the request, then silence
        ask = {"jsonrpc": "2.0", "id": "elicit-1", "method": "elicitation/create",
               "params": {"message": "Confirm?", "requestedSchema": CONFIRM_SCHEMA}}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self.wfile.write(("id: 1\ndata: \n\n" + "id: 2\nevent: message\ndata: " + json.dumps(ask)
                              + "\n\n").encode())
            self.wfile.flush()
            time.sleep(20)
        except OSError:
            pass

    # ------------------------------------------------------------ authorization

    def authorize(self, msg):
        if not self.st.auth:
            return
        need = set(self.st.scopes.split())
        if msg.get("method") == "tools/call" and \
                isinstance(msg.get("params"), dict) and msg["params"].get("name") == "confirm":
            need.add("mcp:confirm")
        challenge = (f'Bearer resource_metadata="{self.base()}/.well-known/oauth-protected-resource/mcp"'
                     f', scope="{" ".join(sorted(need))}"')
        h = self.headers.get("Authorization") or ""
        if not h.startswith("Bearer "):
            raise RpcError(401, 0, "a bearer token is needed", {"WWW-Authenticate": challenge})
        form = urllib.parse.urlencode({"token": h[7:].strip()}).encode()
        try:
            with urllib.request.urlopen(self.st.auth + "/introspect", data=form, timeout=10) as r:
                info = json.loads(r.read())
        except (urllib.error.URLError, ValueError) as e:
            raise RpcError(401, 0, f"cannot check the token: {e}", {"WWW-Authenticate": challenge})
        if not info.get("active") or info.get("aud") != self.base() + "/mcp":
            raise RpcError(401, 0, "the token is not valid here",
                           {"WWW-Authenticate": challenge + ', error="invalid_token"'})
        if not need <= set((info.get("scope") or "").split()):
            raise RpcError(403, 0, "the token lacks a scope",
                           {"WWW-Authenticate": challenge + ', error="insufficient_scope"'})

    # ------------------------------------------------------------ protocol

    def dispatch(self, msg, entry):
        method = msg["method"]
        params = msg.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RpcError(400, -32602, "params must be an object")
        if method == "server/discover":
            return self.discover(), None
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        requested = meta.get(META_VERSION)
        if requested is None:
            legacy = self.st.legacy()
            if not legacy:
                asked = params.get("protocolVersion") if method == "initialize" else None
                raise RpcError(400, UNSUPPORTED_VERSION, "Unsupported protocol version",
                               {"supported": self.st.supported(), "requested": asked})
            return self.legacy_dispatch(method, params, legacy), legacy[0]
        if requested != STATELESS or not self.st.speaks(STATELESS):
            raise RpcError(400, UNSUPPORTED_VERSION, "Unsupported protocol version",
                           {"supported": self.st.supported(), "requested": requested})
        if not isinstance(meta.get(META_CAPS), dict):
            raise RpcError(400, -32602, f"_meta.{META_CAPS} must be an object")
        self.check_headers(method, params, requested)
        result = self.stateless_dispatch(method, params, meta[META_CAPS])
        result.setdefault("resultType", "complete")
        return result, STATELESS

    def check_headers(self, method, params, version):
        want = {"MCP-Protocol-Version": version, "Mcp-Method": method}
        if method == "tools/call":
            want["Mcp-Name"] = params.get("name")
        for k, v in want.items():
            got = self.headers.get(k)
            if got != v:
                raise RpcError(400, HEADER_MISMATCH, "Header mismatch",
                               {"header": k, "expected": v, "got": got})

    def discover(self):
        return {
            "supportedVersions": self.st.supported(),
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": "tuvl-test-stateless", "version": "1.0.0"},
            "instructions": "A scripted 2026-07-28 server for tuvl's tests.",
        }

    def legacy_dispatch(self, method, params, legacy):
        if method == "initialize":
            asked = params.get("protocolVersion")
            version = asked if asked in legacy else legacy[0]
            return {"protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "tuvl-test-stateless", "version": "1.0.0"}}
        if method.startswith("notifications/"):
            return {}
        if method == "ping":
            return {}
        return self.tools(method, params, None, legacy=True)

    def stateless_dispatch(self, method, params, caps):
        if method == "initialize":
            raise RpcError(400, -32601, "initialize is not a method of 2026-07-28; use server/discover")
        if method.startswith("notifications/"):
            return {}
        if method in ("tasks/get", "tasks/cancel"):
            return self.task_method(method, params)
        return self.tools(method, params, caps, legacy=False)

    def tools(self, method, params, caps, legacy):
        if method == "tools/list":
            return {"tools": TOOLS}
        if method != "tools/call":
            raise RpcError(200, -32601, f"Method not found: {method}")
        name = params.get("name")
        args = params.get("arguments") or {}
        if not isinstance(args, dict):
            raise RpcError(200, -32602, "arguments must be an object")
        if name == "echo":
            return text_result(str(args.get("text", "")), {"text": args.get("text", "")})
        if name == "add":
            try:
                a, b = args["a"], args["b"]
                s = a + b
            except (KeyError, TypeError):
                raise RpcError(200, -32602, "add wants numbers a and b")
            return text_result(f"The sum of {a} and {b} is {s}", {"sum": s})
        if name == "slow":
            ms = min(int(args.get("ms", 100)), 60000)
            time.sleep(ms / 1000)
            return text_result(f"slept {ms}")
        if name == "fail":
            return text_result("the tool failed", is_error=True)
        if name == "confirm":
            return self.confirm(params, args, legacy)
        if name == "ask_on_stream":
            return text_result("ask_on_stream: only on a 2025 revision", is_error=True)
        if name == "long":
            return self.long(args, caps)
        raise RpcError(200, -32602, f"Unknown tool: {name}")

    def long(self, args, caps):
        ms = min(int(args.get("ms", 1000)), 600000)
        tasks = isinstance(caps, dict) and isinstance(caps.get("extensions"), dict) and \
            "io.modelcontextprotocol/tasks" in caps["extensions"]
        if not tasks:
            time.sleep(ms / 1000)
            return text_result(f"worked {ms}")
        now = time.time()
        task_id = base64.urlsafe_b64encode(os.urandom(12)).decode()
        task = {"taskId": task_id, "status": "working", "statusMessage": "working on it",
                "createdAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "lastUpdatedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "ttlMs": 600000, "pollIntervalMs": int(args.get("poll_ms", 200))}
        with self.st.lock:
            self.st.tasks[task_id] = {"task": task, "until": now + ms / 1000, "ms": ms,
                                      "fail": bool(args.get("fail"))}
        return {"resultType": "task", **task}

    def task_method(self, method, params):
        task_id = params.get("taskId")
        with self.st.lock:
            t = self.st.tasks.get(task_id)
            if t is None:
                raise RpcError(200, -32602, f"no task {task_id}")
            task = dict(t["task"])
            if method == "tasks/cancel":
                if task["status"] == "working":
                    t["task"]["status"] = "cancelled"
                return {}
            if task["status"] == "working" and time.time() >= t["until"]:
                if t["fail"]:
                    t["task"].update(status="failed", error={"code": -32603, "message": "the long work failed"})
                else:
                    t["task"].update(status="completed", result=text_result(f"worked {t['ms']}"))
                task = dict(t["task"])
        task["resultType"] = "complete"
        return task

    def confirm(self, params, args, legacy):
        op = str(args.get("operation", ""))
        if legacy:
            return text_result(f"{op}: no elicitation on this revision", is_error=True)
        state = self.st.request_state("confirm", args)
        responses = params.get("inputResponses")
        if responses is None:
            return {"resultType": "input_required",
                    "inputRequests": {"confirm": {"method": "elicitation/create", "params": {
                        "mode": "form", "message": f"Confirm {op}?",
                        "requestedSchema": CONFIRM_SCHEMA}}},
                    "requestState": state}
        if params.get("requestState") != state:
            raise RpcError(200, -32602, "requestState is not the one issued for this call")
        answer = responses.get("confirm") if isinstance(responses, dict) else None
        if not isinstance(answer, dict) or answer.get("action") not in ("accept", "decline", "cancel"):
            raise RpcError(200, -32602, "inputResponses.confirm must hold an action")
        if answer["action"] != "accept":
            return text_result(f"{op}: {'declined' if answer['action'] == 'decline' else 'cancelled'}")
        content = answer.get("content") or {}
        return text_result(f"{op}: accepted confirmed={json.dumps(content.get('confirmed'))} "
                           f"note={content.get('note')}", {"answer": content})


def version_of_legacy_ask(handler, msg):
    """Is msg a tools/call of ask_on_stream served on a 2025 revision?"""
    params = msg.get("params") if isinstance(msg.get("params"), dict) else {}
    if msg.get("method") != "tools/call" or params.get("name") != "ask_on_stream":
        return False
    meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
    return meta.get(META_VERSION) is None and bool(handler.st.legacy())


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024     # hundreds of calls connect at once


def main():
    ap = argparse.ArgumentParser(description="scripted MCP server of the 2026-07-28 revision")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--versions", default=f"{STATELESS},2025-11-25")
    ap.add_argument("--sse", action="store_true")
    ap.add_argument("--auth", default=None)
    ap.add_argument("--scopes", default="mcp:tools")
    ap.add_argument("--log-max", type=int, default=100000)
    a = ap.parse_args()
    versions = [v.strip() for v in a.versions.split(",") if v.strip()]
    bad = [v for v in versions if v != STATELESS and v not in LEGACY]
    if bad or not versions:
        print(f"mcp_stateless_server: unknown revisions {bad or a.versions}", file=sys.stderr)
        return 2
    srv = Server(("127.0.0.1", a.port), Handler)
    srv.state = State(versions, a.sse, a.auth, a.scopes, a.log_max)
    print(f"MCP 2026-07-28 server on 127.0.0.1:{srv.server_address[1]}", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
