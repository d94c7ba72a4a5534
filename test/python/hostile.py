"""A hostile HTTP server for the hardening suites: it answers with raw bytes.

Python's http.server cannot send what a malicious server sends (header
bytes that are not UTF-8, bodies that are not what they claim), so this one
writes each response byte for byte.  A script maps a path (its part before
any query string) to a response; every request is recorded, so a test can
count how many times tuvl sent it (a crash loop would send it again and
again).  A response is either bytes (sent as they are) or a callable
(method, path, headers, body) -> bytes, for servers that must answer
according to the request (an MCP handshake, say).
"""
import json
import socket
import threading
import time


def response(status=200, body=b"", ctype="application/json", headers=()):
    """The raw bytes of one HTTP/1.1 response; header values may be bytes."""
    if isinstance(body, str):
        body = body.encode()
    lines = [b"HTTP/1.1 %d X" % status]
    if ctype is not None:
        lines.append(b"Content-Type: " + ctype.encode())
    lines.append(b"Content-Length: %d" % len(body))
    for name, value in headers:
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def deep_json(depth=100_000):
    """A JSON text nested deeper than any stack allows."""
    return b"[" * depth + b"]" * depth


class HostileServer:
    """Serves scripted raw responses on 127.0.0.1:<free port> from a daemon thread."""

    def __init__(self, script=None, default=None):
        self.script = dict(script or {})
        self.default = default if default is not None else response(404, b'{"error": "no script"}')
        self.requests = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    def count(self, path=None):
        with self.lock:
            return sum(1 for r in self.requests if path is None or r["path"].split("?")[0] == path)

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, f):
        line = f.readline()
        if not line:
            return None
        method, path, _ = line.decode("latin-1").split(" ", 2)
        headers = {}
        while True:
            h = f.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            name, _, value = h.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        n = int(headers.get("content-length") or 0)
        body = f.read(n) if n else b""
        return method, path, headers, body

    def _serve(self, conn):
        f = conn.makefile("rb")
        try:
            while True:
                req = self._read_request(f)
                if req is None:
                    return
                method, path, headers, body = req
                with self.lock:
                    self.requests.append({"method": method, "path": path, "headers": headers,
                                          "body": body, "t": time.time()})
                what = self.script.get(path.split("?")[0], self.default)
                data = what(method, path, headers, body) if callable(what) else what
                conn.sendall(data)
        except OSError:
            return
        finally:
            f.close()
            conn.close()

    def close(self):
        self.closed = True
        self.sock.close()


def mcp_script(tool_answer):
    """An MCP server (streamable HTTP, 2025-11-25) whose tools/call answers
    with tool_answer(request id) -> raw response bytes."""
    def answer(method, path, headers, body):
        msg = json.loads(body or b"{}")
        rid = msg.get("id")
        if msg.get("method") == "initialize":
            result = {"protocolVersion": "2025-11-25", "capabilities": {"tools": {}},
                      "serverInfo": {"name": "hostile", "version": "1"}}
            return response(200, json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}),
                            headers=[("Mcp-Session-Id", "s1")])
        if method == "DELETE" or msg.get("method", "").startswith("notifications/"):
            return response(202, b"", ctype=None)
        if msg.get("method") == "tools/call":
            return tool_answer(rid)
        return response(200, json.dumps({"jsonrpc": "2.0", "id": rid, "result": {"tools": []}}))
    return answer
