#!/usr/bin/env python3
"""A scriptable HTTP server for tuvl's tests and benchmarks (127.0.0.1 only).

Every request is logged (method, path, headers, body) and can be read back
with GET /_log (DELETE /_log clears it).  Endpoints:

  /json                 200, a JSON echo of the request
  /text                 200, text/plain
  /status/<code>        that status, JSON body {"status": code}
  /flaky/<key>?fail=N&code=500
                        fails N times with `code` (per key), then 200
  /ratelimit/<key>?times=N&retry_after=S
                        429 with Retry-After: S for the first N calls, then 200
  /slow?ms=N            answers after N milliseconds
  /big?bytes=N          N bytes of text
  /malformed            Content-Type: application/json with a broken body
  /redirect?to=URL      302 to URL
  /loop                 302 to itself, forever
  /hang                 never answers (until the client gives up)
"""
import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

LOG = []
LOG_LOCK = threading.Lock()
COUNTERS = {}
STATS = {"in_flight": 0, "peak": 0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):
        pass

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n).decode("utf-8", "replace") if n else ""

    def _send(self, code, body, ctype="application/json", headers=None):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _count(self, key):
        with LOG_LOCK:
            COUNTERS[key] = COUNTERS.get(key, 0) + 1
            return COUNTERS[key]

    def handle_any(self):
        url = urlparse(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self._body()
        if url.path == "/_log":
            with LOG_LOCK:
                if self.command == "DELETE":
                    LOG.clear()
                    COUNTERS.clear()
                    STATS["peak"] = STATS["in_flight"]
                    return self._send(200, "{}")
                return self._send(200, json.dumps({"requests": LOG, "peak": STATS["peak"]}))
        entry = {"method": self.command, "path": self.path,
                 "headers": {k.lower(): v for k, v in self.headers.items()},
                 "body": body, "t": time.time()}
        with LOG_LOCK:
            LOG.append(entry)
            STATS["in_flight"] += 1
            STATS["peak"] = max(STATS["peak"], STATS["in_flight"])
        try:
            self.route(url, q, body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout test): nothing to answer
        finally:
            with LOG_LOCK:
                STATS["in_flight"] -= 1

    def route(self, url, q, body):
        p = url.path
        if p == "/json":
            return self._send(200, json.dumps({"ok": True, "method": self.command,
                                               "query": q, "body": body}))
        if p == "/text":
            return self._send(200, "plain text answer", "text/plain")
        if p.startswith("/status/"):
            code = int(p.split("/")[2])
            return self._send(code, json.dumps({"status": code}))
        if p.startswith("/flaky/"):
            n = self._count(p)
            if n <= int(q.get("fail", 1)):
                return self._send(int(q.get("code", 500)), json.dumps({"attempt": n, "ok": False}))
            return self._send(200, json.dumps({"attempt": n, "ok": True}))
        if p.startswith("/ratelimit/"):
            n = self._count(p)
            if n <= int(q.get("times", 1)):
                return self._send(429, json.dumps({"error": "slow down"}),
                                  headers={"Retry-After": q.get("retry_after", "1")})
            return self._send(200, json.dumps({"attempt": n, "ok": True}))
        if p == "/slow":
            time.sleep(int(q.get("ms", 1000)) / 1000.0)
            return self._send(200, json.dumps({"slept_ms": int(q.get("ms", 1000))}))
        if p == "/big":
            return self._send(200, "x" * int(q.get("bytes", 1000)), "text/plain")
        if p == "/malformed":
            return self._send(200, '{"truncated": [1, 2', "application/json")
        if p == "/redirect":
            return self._send(int(q.get("code", 302)), "", headers={"Location": q["to"]})
        if p == "/loop":
            return self._send(302, "", headers={"Location": "/loop"})
        if p == "/hang":
            time.sleep(3600)
            return None
        return self._send(404, json.dumps({"error": "no such endpoint"}))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = handle_any


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        # clients that time out or crash on purpose close their sockets
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    srv = Server(("127.0.0.1", args.port), Handler)
    print(f"http test server on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
