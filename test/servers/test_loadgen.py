"""Self-test of the benchmarks' load generator (bench/servers/loadgen.mjs).

    python3 -m pytest -q test/servers/test_loadgen.py

Starts the server with node as a subprocess on a free port (with a scripts
file) and talks to it with urllib and http.client, as tuvl's workers do:
scripted turns and tool-call ids as llm_server.py gives them, the /lat/<ms>/
prefix, /slow, the /_log counters, /_stats and the 400 on bad input.
"""
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = os.path.join(ROOT, "bench", "servers", "loadgen.mjs")
NODE = shutil.which("node") or "/usr/bin/node"
CHAT = "/v1/chat/completions"

# The script bench/agents.py registers: two tool turns, then "done".
AGENT_SCRIPT = [
    {"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
     "usage": {"prompt_tokens": 100, "completion_tokens": 10}},
    {"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
     "usage": {"prompt_tokens": 120, "completion_tokens": 10}},
    {"text": "done", "usage": {"prompt_tokens": 140, "completion_tokens": 2}},
]


# ---------------------------------------------------------------- fixtures and helpers

class Running:
    def __init__(self, proc, port, errfile):
        self.proc, self.port, self.errfile = proc, port, errfile
        self.base = f"http://127.0.0.1:{port}"


def start_server(*args):
    errfile = tempfile.NamedTemporaryFile(prefix="loadgen.", suffix=".err", delete=False)
    proc = subprocess.Popen([NODE, SERVER, "--port", "0", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errfile)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with open(errfile.name) as f:
            line = f.readline()
        if line.startswith("load generator on 127.0.0.1:") and line.endswith("\n"):
            return Running(proc, int(line.rsplit(":", 1)[1]), errfile)
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    stop_server(Running(proc, 0, errfile))
    with open(errfile.name) as f:
        raise RuntimeError("the load generator did not start: " + f.read())


def stop_server(srv):
    srv.proc.terminate()
    try:
        srv.proc.wait(5)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait(5)
    srv.errfile.close()
    with open(srv.errfile.name) as f:
        errors = f.read().splitlines()[1:]
    os.unlink(srv.errfile.name)
    return errors


@pytest.fixture(scope="module")
def server():
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"bench_agents": AGENT_SCRIPT, "wrapped": {"turns": [{"text": "w{{turn}}"}]}}, f)
    try:
        srv = start_server("--scripts", f.name)
    finally:
        os.unlink(f.name)
    yield srv
    errors = stop_server(srv)
    assert not errors, "the server wrote to stderr:\n" + "\n".join(errors)


def call(base, method, path, body=None, headers=None, timeout=10, raw=None):
    """(status, headers, parsed JSON body or the raw bytes when not JSON) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, hdrs, out = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        status, hdrs, out = e.code, e.headers, e.read()
    try:
        return status, hdrs, json.loads(out) if out else None
    except ValueError:
        return status, hdrs, out


def register(server, name, turns):
    status, _, body = call(server.base, "POST", "/_script", {"name": name, "turns": turns})
    assert status == 200, body
    return body


def ask(server, model, messages, path=CHAT, **kw):
    return call(server.base, "POST", path, {"model": model, "messages": list(messages)}, **kw)


def user(text):
    return {"role": "user", "content": text}


def tool_exchange(call_id, name, args, result):
    """An assistant's tool call and its result, as tuvl sends them back."""
    return [{"role": "assistant", "content": None,
             "tool_calls": [{"id": call_id, "type": "function",
                             "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def stats(server):
    status, _, body = call(server.base, "GET", "/_stats")
    assert status == 200
    return body


def get_log(server, query=""):
    status, _, body = call(server.base, "GET", "/_log" + query)
    assert status == 200
    return body


def check_error(body, etype="invalid_request_error"):
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["type"] == etype
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


# ---------------------------------------------------------------- model answers

def test_agent_script_turns_from_the_scripts_file(server):
    """bench/agents.py's script: turns chosen by the number of assistant messages."""
    status, hdrs, body = ask(server, "bench_agents", [user('{"k": 1}')])
    assert status == 200
    assert hdrs["Content-Type"] == "application/json"
    assert hdrs["x-request-id"].startswith("req_")
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["model"] == "bench_agents"
    assert body["choices"] == [{
        "index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "call_0_0", "type": "function",
                                    "function": {"name": "note",
                                                 "arguments": json.dumps({"turn": "0"})}}]}}]
    assert body["usage"] == {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}

    history = [user('{"k": 1}')] + tool_exchange("call_0_0", "note", {"turn": "0"}, '{"noted": 0}')
    status, _, body = ask(server, "bench_agents", history)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [("call_1_0", '{"turn": "1"}')]
    assert body["usage"]["prompt_tokens"] == 120

    history += tool_exchange("call_1_0", "note", {"turn": "1"}, '{"noted": 1}')
    status, _, body = ask(server, "scripted/bench_agents", history)
    assert status == 200
    assert body["model"] == "scripted/bench_agents"
    assert body["choices"] == [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "done"}}]
    assert body["usage"] == {"prompt_tokens": 140, "completion_tokens": 2, "total_tokens": 142}

    # Past the last turn, the last turn repeats.
    history += [{"role": "assistant", "content": "done"}, user("again"),
                {"role": "assistant", "content": "done"}, user("and again")]
    status, _, body = ask(server, "bench_agents", history)
    assert body["choices"][0]["message"]["content"] == "done"
    # A script file entry may wrap its turns in {"turns": [...]}.
    assert ask(server, "wrapped", [user("x")])[2]["choices"][0]["message"]["content"] == "w0"


def test_script_registered_at_run_time(server):
    register(server, "rt", [
        {"tool_calls": [{"name": "lookup", "arguments": {"id": 7, "q": "{{last_user}}", "é": [1, True]}},
                        {"name": "raw", "arguments_raw": "not json"}]},
        {"text": "the tool said: {{last_user}} (turn {{turn}})", "finish": "length",
         "usage": {"prompt_tokens": 5, "completion_tokens": 6}, "cached_tokens": 3, "reasoning_tokens": 2},
        {"tool_calls": [{"name": "x"}], "no_ids": True, "finish_reason": "tool_use"},
    ])
    status, _, body = ask(server, "rt", [user("order 7")])
    assert status == 200
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function",
         "function": {"name": "lookup", "arguments": json.dumps({"id": 7, "q": "order 7", "é": [1, True]})}},
        {"id": "call_0_1", "type": "function", "function": {"name": "raw", "arguments": "not json"}}]}
    # no usage in the script: about a token per four characters
    assert body["usage"]["prompt_tokens"] > 1 and body["usage"]["completion_tokens"] > 1

    history = [user("order 7")] + tool_exchange("call_0_0", "lookup", {"id": 7}, "paid, 40 EUR")
    status, _, body = ask(server, "rt", history)
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "the tool said: paid, 40 EUR (turn 1)"}}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 3},
                             "completion_tokens_details": {"reasoning_tokens": 2}}

    history += [{"role": "assistant", "content": "x"}, user("y")]
    status, _, body = ask(server, "rt", history)
    assert body["choices"][0]["finish_reason"] == "tool_use"
    assert body["choices"][0]["message"]["tool_calls"] == [
        {"type": "function", "function": {"name": "x", "arguments": "{}"}}]

    # Listing, reading, replacing and removing scripts.
    assert call(server.base, "GET", "/_script")[2]["scripts"]["rt"] == 3
    assert len(call(server.base, "GET", "/_script/rt")[2]["turns"]) == 3
    register(server, "rt", [{"text": "replaced"}])
    assert ask(server, "rt", [user("a")])[2]["choices"][0]["message"]["content"] == "replaced"
    assert call(server.base, "DELETE", "/_script/rt")[0] == 200
    assert call(server.base, "DELETE", "/_script/rt")[0] == 404
    assert call(server.base, "GET", "/_script/rt")[0] == 404


def test_echo_for_a_model_without_script(server):
    status, _, body = ask(server, "gpt-4o-mini", [user("first"), {"role": "assistant", "content": "a"},
                                                 user("  many   words\n\nhere ")])
    assert status == 200
    assert body["choices"][0]["message"]["content"] == "Summary: many words here"


def test_bad_scripts_are_refused(server):
    for turns in ([], [{"txt": "typo"}], [{"times": 1, "fault": "500"}], [{"thinking": "x"}],
                  [{"fault": "hang"}], [{"tool_calls": [{"arguments": {}}]}],
                  [{"usage": {"prompt_tokens": -1}}], [{"finish": "maybe"}]):
        status, _, body = call(server.base, "POST", "/_script", {"name": "bad", "turns": turns})
        assert status == 400 and body["ok"] is False and body["error"], turns
    assert call(server.base, "POST", "/_script", raw=b"{nope")[0] == 400
    assert call(server.base, "POST", "/_script", {"turns": [{"text": "x"}]})[0] == 400


def test_bad_requests_get_400(server):
    cases = [b"not json", b"[1, 2]", b'{"model": "bench_agents"}',
             b'{"model": "bench_agents", "messages": []}',
             b'{"model": "bench_agents", "messages": "hi"}',
             b'{"messages": [{"role": "user", "content": "hi"}]}',
             b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}']
    for raw in cases:
        status, hdrs, body = call(server.base, "POST", CHAT, raw=raw)
        assert status == 400, raw
        assert hdrs["Content-Type"] == "application/json"
        check_error(body)
    status, _, body = call(server.base, "GET", CHAT)
    assert status == 405
    check_error(body)
    status, _, body = call(server.base, "POST", "/v1/messages", {"model": "m", "messages": [user("x")]})
    assert status == 404 and "Chat Completions" in body["error"]["message"]
    assert call(server.base, "POST", "/v2/nothing", {})[0] == 404
    assert call(server.base, "GET", "/_health")[2] == {"ok": True}


def test_scripted_faults(server):
    register(server, "faulty", [{"fault": 429, "retry_after": 2, "message": "slow down"},
                                {"fault": "529"}, {"fault": "malformed"}, {"fault": "empty"}])
    history = [user("x")]
    status, hdrs, body = ask(server, "faulty", history)
    assert status == 429 and hdrs["Retry-After"] == "2"
    check_error(body, "requests")
    assert body["error"]["message"] == "slow down"
    history += [{"role": "assistant", "content": "a"}, user("y")]
    status, _, body = ask(server, "faulty", history)
    assert status == 503
    check_error(body, "server_error")
    history += [{"role": "assistant", "content": "a"}, user("y")]
    status, _, body = ask(server, "faulty", history)
    assert status == 200 and isinstance(body, bytes)  # not JSON
    history += [{"role": "assistant", "content": "a"}, user("y")]
    status, _, body = ask(server, "faulty", history)
    assert status == 200 and body["choices"] == []


# ---------------------------------------------------------------- latency

def test_latency_prefix_query_and_turn(server):
    register(server, "lat", [{"text": "quick"}, {"text": "slow", "latency_ms": 250}])
    t0 = time.monotonic()
    status, _, body = ask(server, "lat", [user("x")], path="/lat/300" + CHAT)
    took = time.monotonic() - t0
    assert status == 200 and body["choices"][0]["message"]["content"] == "quick"
    assert 0.3 <= took < 1.5
    t0 = time.monotonic()
    assert ask(server, "lat", [user("x")], path="/lat/0/v1/chat/completions")[0] == 200
    assert time.monotonic() - t0 < 0.25
    assert ask(server, "lat", [user("x")], path="/chat/completions")[0] == 200
    t0 = time.monotonic()
    assert ask(server, "lat", [user("x")], path=CHAT + "?latency_ms=200")[0] == 200
    assert 0.2 <= time.monotonic() - t0 < 1.2
    # A turn's own latency_ms wins over the prefix.
    t0 = time.monotonic()
    body = ask(server, "lat", [user("x"), {"role": "assistant", "content": "quick"}, user("y")],
               path="/lat/5000" + CHAT)[2]
    assert body["choices"][0]["message"]["content"] == "slow"
    assert 0.25 <= time.monotonic() - t0 < 1.5


def test_delayed_answers_do_not_block_one_another(server):
    """50 connections at once, each answered 400 ms later: all in about 400 ms."""
    call(server.base, "DELETE", "/_log")
    call(server.base, "DELETE", "/_stats")
    n, results = 50, []
    body = json.dumps({"model": "bench_agents", "messages": [user("x")]})

    def one():
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        t = time.monotonic()
        conn.request("POST", "/lat/400" + CHAT, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        results.append((resp.status, time.monotonic() - t))
        conn.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 < 1.6
    assert len(results) == n and all(s == 200 and 0.4 <= d < 1.5 for s, d in results), results
    log = get_log(server, "?model=bench_agents")
    assert log["peak"] == log["peak_concurrent"] >= 40
    assert log["script"] == {"count": n, "by_status": {"200": n}, "by_turn": {"0": n}}
    st = stats(server)
    assert st["peak_in_flight"] >= 40 and st["connections"]["peak"] >= 40
    assert st["in_flight"] == 0
    assert st["late_ms"]["count"] == n and st["late_ms"]["p50"] < 300


def test_a_client_that_goes_away_is_not_in_flight(server):
    call(server.base, "DELETE", "/_stats")
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"GET /slow?ms=5000 HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.monotonic() + 3
    while stats(server)["in_flight"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.close()
    while stats(server)["in_flight"] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    st = stats(server)
    assert st["in_flight"] == 0 and st["requests"]["disconnected"] == 1


# ---------------------------------------------------------------- /slow and /_log

def test_slow_and_idempotency_keys(server):
    assert call(server.base, "DELETE", "/_log")[2] == {"ok": True}
    t0 = time.monotonic()
    status, hdrs, body = call(server.base, "GET", "/slow?ms=0")
    assert (status, body) == (200, {"slept_ms": 0})
    assert time.monotonic() - t0 < 0.25
    t0 = time.monotonic()
    status, _, body = call(server.base, "POST", "/slow?ms=200&k=1", {"k": "1"},
                           headers={"Idempotency-Key": "key-1"})
    assert (status, body) == (200, {"slept_ms": 200})
    assert 0.2 <= time.monotonic() - t0 < 1.2
    for key in ("key-2", "key-3", "key-3"):
        assert call(server.base, "POST", "/slow?ms=0", {}, headers={"Idempotency-Key": key})[0] == 200
    assert call(server.base, "GET", "/slow?ms=soon")[0] == 400

    log = get_log(server, "?keys=1")
    assert log["idempotency_keys"] == {"distinct": 3, "requests": 4, "repeated": 1, "max_per_key": 2}
    assert log["key_counts"] == {"key-1": 1, "key-2": 1, "key-3": 2}
    assert log["no_key"] == 2
    assert log["count"] == 6 and log["by_kind"] == {"slow": 6}
    assert log["by_status"] == {"200": 5, "400": 1}
    assert log["peak"] >= 1 and log["in_flight"] == 0
    assert "requests" not in log  # no request is kept without --log-max

    call(server.base, "DELETE", "/_log")
    log = get_log(server)
    assert log["count"] == 0 and log["idempotency_keys"]["distinct"] == 0 and log["peak"] == 0


def test_log_max_keeps_the_newest_requests():
    srv = start_server("--log-max", "2")
    try:
        for ms in (0, 1, 2):
            call(srv.base, "GET", f"/slow?ms={ms}", headers={"Idempotency-Key": f"k{ms}"})
        ask(srv, "anything", [user("x")])
        rows = get_log(srv)["requests"]
        assert [(r["kind"], r["key"]) for r in rows] == [("slow", "k2"), ("chat", None)]
        assert rows[0]["status"] == 200 and rows[0]["delay_ms"] == 2 and rows[0]["method"] == "GET"
        assert rows[1]["script"] == "echo" and rows[1]["turn"] == 0 and rows[1]["model"] == "anything"
        assert [r["kind"] for r in get_log(srv, "?model=echo")["requests"]] == ["chat"]
    finally:
        assert stop_server(srv) == []


# ---------------------------------------------------------------- /_stats

def test_stats_and_keep_alive(server):
    assert call(server.base, "DELETE", "/_stats")[2] == {"ok": True}
    st = stats(server)
    assert st["requests"]["answered"] == 0 and st["requests"]["by_kind"]["chat"] == 0
    # One keep-alive connection, five requests: one connection accepted.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    body = json.dumps({"model": "bench_agents", "messages": [user("x")]})
    for i in range(5):
        path = "/slow?ms=0" if i % 2 else CHAT
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Connection", "keep-alive").lower() == "keep-alive"
        resp.read()
    conn.close()
    st = stats(server)
    assert st["requests"]["answered"] == 5 and st["requests"]["received"] == 5
    assert st["requests"]["by_kind"]["chat"] == 3 and st["requests"]["by_kind"]["slow"] == 2
    assert st["requests"]["by_status"] == {"200": 5}
    assert st["connections"]["accepted"] <= 3  # this one, and the urllib requests for /_stats
    for key in ("user_s", "system_s", "total_s"):
        assert st["cpu"][key] >= 0 and st["cpu_since_reset"][key] >= 0
    assert st["cpu"]["total_s"] >= st["cpu_since_reset"]["total_s"] > 0
    assert st["cpu_since_reset"]["us_per_request"] > 0
    assert 0 <= st["event_loop"]["utilization"] <= 1
    assert {"p50", "p99", "max"} <= set(st["event_loop"]["delay_ms"])
    assert st["late_ms"]["count"] == 5
    assert st["in_flight"] == 0 and st["peak_in_flight"] >= 1
    assert set(st["gc"]) == {"minor", "minor_ms", "major", "major_ms"}
    assert st["connections"]["accept_errors"] == 0
    assert st["listen_overflows"] is None or st["listen_overflows"] >= 0
    assert st["memory"]["rss_mb"] > 0
    assert st["limits"]["backlog_asked"] >= 16384
    assert st["pid"] == server.proc.pid


# ---------------------------------------------------------------- HTTP/1.1 on raw sockets

def exchange(server, data, pieces=1, until_close=True, timeout=5):
    """Send `data` (in `pieces` writes) on a new connection; what came back
    until the server closed it (or, without until_close, after 0.5 s)."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        s.sendall(data[i:i + step])
        if pieces > 1:
            time.sleep(0.002)
    out = b""
    s.settimeout(timeout if until_close else 0.5)
    try:
        while True:
            got = s.recv(65536)
            if not got:
                break
            out += got
    except socket.timeout:
        assert not until_close, "the server did not close the connection"
    s.close()
    return out


def responses(raw, bodiless=()):
    """[(status, headers, body)] of the HTTP responses in raw; the answers
    numbered in `bodiless` (to HEAD) have no body."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
        n = 0 if len(out) in bodiless else int(headers.get("content-length", 0))
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        raw = rest[n:]
    return out


def test_http_pipelining_chunked_expect_and_close(server):
    chat = json.dumps({"model": "bench_agents", "messages": [user("x")]}).encode()
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (10, chat[:10], len(chat) - 10, chat[10:])
    data = (b"GET /slow?ms=300 HTTP/1.1\r\nHost: x\r\n\r\n"          # answered last, but first
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked +
            b"POST /lat/0/v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"  # no 100 here
            b"Content-Length: %d\r\n\r\n%s" % (len(chat), chat) +
            b"HEAD /slow?ms=0 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /_health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            b"GET /_health HTTP/1.1\r\nHost: x\r\n\r\n")               # after the close: not read
    t0 = time.monotonic()
    got = responses(exchange(server, data, pieces=37), bodiless=(3,))
    assert time.monotonic() - t0 >= 0.3
    assert [s for s, _, _ in got] == [200, 200, 200, 200, 200]
    assert json.loads(got[0][2]) == {"slept_ms": 300}
    for _, _, body in got[1:3]:
        assert json.loads(body)["choices"][0]["message"]["tool_calls"][0]["id"] == "call_0_0"
    assert got[3][1]["content-length"] == str(len(b'{"slept_ms":0}')) and got[3][2] == b""
    assert got[4][1]["connection"] == "close" and json.loads(got[4][2]) == {"ok": True}
    assert all(h["content-type"] == "application/json" and "date" in h for _, h, _ in got)

    # Expect: 100-continue alone: the 100 comes before the body is sent.
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
              b"Content-Length: %d\r\n\r\n" % len(chat))
    assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(chat)
    out = b""
    while b"usage" not in out:
        out += s.recv(65536)
    s.close()
    assert responses(out)[0][0] == 200


def test_http_versions_and_bad_requests(server):
    # HTTP/1.0: closed after the answer, unless it asks for keep-alive
    got = responses(exchange(server, b"GET /slow?ms=0 HTTP/1.0\r\n\r\n"))
    assert [s for s, _, _ in got] == [200]
    got = responses(exchange(server, b"GET /slow?ms=0 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2,
                             until_close=False))
    assert [s for s, _, _ in got] == [200, 200]
    # malformed: an answer, then the connection closes
    for data, status in ((b"NONSENSE\r\n\r\n", 400),
                         (b"GET / HTTP/2.0\r\n\r\n", 400),
                         (b"POST /slow HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400),
                         (b"POST /slow HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
                         (b"POST /slow HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
                         (b"GET / HTTP/1.1\r\nX: " + b"y" * 70000 + b"\r\n\r\n", 431)):
        got = responses(exchange(server, data))
        assert [s for s, _, _ in got] == [status], data[:40]
        check_error(json.loads(got[0][2]))
