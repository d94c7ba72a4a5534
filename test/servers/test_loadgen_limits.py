"""Self-test of the load generator's rate limits (bench/servers/loadgen.mjs
--limit-rpm, --limit-tpm, POST /_limits), which bench/flow_control.py
relies on: per API key, requests and tokens over a sliding window, 429 with
a sane Retry-After beyond them, as OpenAI answers.

    python3 -m pytest -q test/servers/test_loadgen_limits.py
"""
import http.client
import json
import threading
import time

import pytest

from test_loadgen import CHAT, call, start_server, stop_server

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def server(request):
    srv = start_server(*getattr(request, "param", ()))
    yield srv
    errors = stop_server(srv)
    assert not errors, "the server wrote to stderr:\n" + "\n".join(errors)


def chat(srv, key=None, body=None, header="Authorization"):
    headers = {}
    if key is not None:
        headers[header] = ("Bearer " + key) if header == "Authorization" else key
    return call(srv.base, "POST", CHAT, body or BODY, headers=headers)


def limits(srv):
    status, _, body = call(srv.base, "GET", "/_limits")
    assert status == 200
    return body


def burst(srv, n, key, threads=8):
    """n model requests from `threads` keep-alive connections at once: a
    list of (status, headers, body, time.monotonic() of the answer)."""
    out, lock = [], threading.Lock()
    body = json.dumps(BODY)
    share = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    go = threading.Event()

    def worker(count):
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        go.wait()
        for _ in range(count):
            c.request("POST", CHAT, body, {"Content-Type": "application/json", "Authorization": "Bearer " + key})
            r = c.getresponse()
            data = json.loads(r.read())
            with lock:
                out.append((r.status, r.headers, data, time.monotonic()))
        c.close()

    ts = [threading.Thread(target=worker, args=(k,)) for k in share]
    for t in ts:
        t.start()
    go.set()
    for t in ts:
        t.join()
    return out


@pytest.mark.parametrize("server", [("--limit-rpm", "600")], indirect=True)
def test_burst_of_700_gets_exactly_100_429s(server):
    t0 = time.monotonic()
    out = burst(server, 700, "k1")
    took = time.monotonic() - t0
    assert took < 30, "the burst took %.1f s: the window would slide under it" % took
    ok = [o for o in out if o[0] == 200]
    limited = [o for o in out if o[0] == 429]
    assert len(ok) == 600 and len(limited) == 100, sorted({o[0] for o in out})
    for status, headers, body, at in limited:
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert body["error"]["type"] == "requests"
        assert "Limit 600, Used 600" in body["error"]["message"]
        # capacity comes back when the first request of the burst leaves the
        # 60 s window: not before the burst began + 60 s, and not later than
        # the request + 60 s
        retry = int(headers["Retry-After"])
        retry_ms = int(headers["retry-after-ms"])
        assert 1 <= retry <= 60 and retry == -(-retry_ms // 1000)
        assert (t0 + 60) - 0.05 <= at + retry_ms / 1000.0 <= at + 60.0 + 0.05
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-limit-requests"] == "600"
    # the admitted ones counted down what remained
    remaining = sorted(int(o[1]["x-ratelimit-remaining-requests"]) for o in ok)
    assert remaining == list(range(600))
    k = limits(server)["keys"]["k1"]
    assert k["admitted"] == 600 and k["rejected"] == {"requests": 100, "tokens": 0, "total": 100}
    assert k["window"]["requests"] == 600 and k["peak_window"]["requests"] == 600
    # another key has a budget of its own; a rejected request took none
    assert chat(server, "k2")[0] == 200
    assert chat(server, "k1")[0] == 429
    _, _, stats = call(server.base, "GET", "/_stats")
    assert stats["rate_limited"] == {"requests": 101, "tokens": 0}
    assert stats["requests"]["by_status"] == {"200": 601, "429": 101}


@pytest.mark.parametrize("server", [("--limit-rpm", "5", "--limit-window-ms", "4000")], indirect=True)
def test_the_window_slides(server):
    # a window of 4 s: a busy machine's pauses do not decide the outcome
    t0 = time.monotonic()
    for _ in range(5):
        status, headers, _ = chat(server, "k")
        assert status == 200
    status, headers, body = chat(server, "k")
    assert status == 429, body
    retry_ms = int(headers["retry-after-ms"])
    assert headers["Retry-After"] == str(-(-retry_ms // 1000))     # whole seconds, rounded up
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert 4000 - elapsed_ms - 50 <= retry_ms <= 4000
    # before the first request leaves the window: still limited
    if (time.monotonic() - t0) * 1000 < 4000 - 500:
        assert chat(server, "k")[0] == 429
    time.sleep(retry_ms / 1000.0 + 0.1)
    # the first requests left the window: capacity again, never more than 5
    # in a window
    t1 = time.monotonic()
    got = [chat(server, "k")[0] for _ in range(6)]
    assert got[0] == 200 and set(got) <= {200, 429} and got.count(200) <= 5
    if time.monotonic() - t1 < 4.0:
        assert 429 in got, got
    time.sleep(4.1)
    assert [chat(server, "k")[0] for _ in range(5)] == [200] * 5


def test_tokens_estimated_then_corrected_by_usage(server):
    # usage reports 200 tokens a request, whatever its length
    status, _, _ = call(server.base, "POST", "/_script", {"name": "big", "turns": [
        {"text": "ok", "usage": {"prompt_tokens": 150, "completion_tokens": 50}}]})
    assert status == 200
    status, _, _ = call(server.base, "POST", "/_limits", {"tpm": 1000})
    assert status == 200
    body = {"model": "big", "messages": [{"role": "user", "content": "x" * 300}]}
    est = len(json.dumps(body)) // 4        # the estimate: the body's length / 4
    assert 60 < est < 200
    got = [chat(server, "t", body) for _ in range(6)]
    # 5 x 200 tokens fill the window (estimated, they would leave room for more)
    assert [g[0] for g in got] == [200] * 5 + [429]
    status, headers, err = got[5]
    assert err["error"]["type"] == "tokens" and "(TPM): Limit 1000, Used 1000, Requested %d" % est \
        in err["error"]["message"]
    assert int(headers["Retry-After"]) == 60
    assert got[4][1]["x-ratelimit-remaining-tokens"] == str(1000 - 4 * 200 - est)
    k = limits(server)["keys"]["t"]
    assert k["tokens"] == 1000 and k["window"]["tokens"] == 1000
    assert k["rejected"]["tokens"] == 1
    # a request larger than the whole budget can never pass
    huge = {"model": "big", "messages": [{"role": "user", "content": "y" * 5000}]}
    status, headers, err = chat(server, "u", huge)
    assert status == 429 and "Request too large" in err["error"]["message"]


def test_limits_per_key_and_headers(server):
    # no limits: every key is counted, none limited, no x-ratelimit headers
    status, headers, _ = chat(server, "a", header="x-api-key")
    assert status == 200 and "x-ratelimit-limit-requests" not in headers
    assert chat(server)[0] == 200
    status, _, body = call(server.base, "POST", "/_limits", {"keys": {"b": {"rpm": 1}, "(none)": {"rpm": 2}}})
    assert status == 200, body
    assert [chat(server, "b", header="api-key")[0] for _ in range(2)] == [200, 429]
    assert [chat(server)[0] for _ in range(2)] == [200, 429]   # one before the limit was set
    assert [chat(server, "a", header="x-api-key")[0] for _ in range(3)] == [200] * 3
    lim = limits(server)
    assert lim["per_key"] == {"b": {"rpm": 1, "tpm": 0}, "": {"rpm": 2, "tpm": 0}}
    assert lim["keys"]["a"]["admitted"] == 4 and lim["keys"]["a"]["limits"] == {"rpm": 0, "tpm": 0}
    assert lim["keys"]["(none)"]["admitted"] == 2 and lim["keys"]["(none)"]["rejected"]["total"] == 1
    # per-second series, and the rates per minute
    status, _, lim = call(server.base, "GET", "/_limits?series=1")
    assert sum(lim["keys"]["a"]["per_second"]) == 4 and lim["keys"]["a"]["per_min"]["requests"] > 0
    # bad configurations are refused
    for bad in ({"rpm": -1}, {"keys": {"x": {"rpm": "a"}}}, {"window_ms": 0}, {"what": 1}, []):
        status, _, body = call(server.base, "POST", "/_limits", bad)
        assert status == 400 and body["ok"] is False, bad
    # DELETE /_limits empties the windows: the key may send again
    assert call(server.base, "DELETE", "/_limits")[0] == 200
    assert chat(server, "b", header="api-key")[0] == 200
    # DELETE /_stats resets the counters, not the windows
    assert call(server.base, "DELETE", "/_stats")[0] == 200
    k = limits(server)["keys"]["b"]
    assert k["admitted"] == 0 and k["window"]["requests"] == 1
    assert chat(server, "b", header="api-key")[0] == 429


@pytest.mark.parametrize("server", [("--limit-rpm", "2", "--limit-tpm", "100000")], indirect=True)
def test_a_scripted_fault_and_a_bad_request_take_budget_as_sent(server):
    # a 400 (no messages) is refused before the limits; a scripted 500
    # counts as a request sent
    call(server.base, "POST", "/_script", {"name": "boom", "turns": [{"fault": "500"}]})
    assert call(server.base, "POST", CHAT, {"model": "m"}, headers={"Authorization": "Bearer f"})[0] == 400
    assert chat(server, "f", {"model": "boom", "messages": [{"role": "user", "content": "x"}]})[0] == 500
    assert chat(server, "f")[0] == 200
    assert chat(server, "f")[0] == 429
