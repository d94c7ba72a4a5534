"""HTTPS and HTTP/2: tuvl's client against a TLS server of the tests' own.

test/servers/h2_server.js (Node's http2 module) serves HTTPS with a
certificate signed by a CA made here with openssl, speaking HTTP/2 and
HTTP/1.1 by ALPN (or HTTP/1.1 only), and counts the TLS connections it
accepts, the sessions resumed and the requests by protocol.  The tests
check that tuvl.http_ca_file is trusted (and nothing unknown is), that
HTTP/2 is used where offered and hundreds of concurrent requests share a
few connections, that tuvl.http2 = off and a server without HTTP/2 give
HTTP/1.1, that a new connection resumes a TLS session, and that a server
allowing few streams per connection still gets every request at once,
and that requests in flight grow a worker's heap by their own state, not
by libcurl's buffers.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import ssl

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, not_under_asan, q, q1, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKFLOW = """
name: %s
steps:
  - id: call
    kind: APICall
    http: { url: "{{ url }}", timeout: 30s }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res.body }}" }
  - { id: oops, status: failed, response: { error: "{{ _last_error }}", type: "{{ _last_error_type }}" } }
"""


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(d):
    """A CA and a certificate for 127.0.0.1 and localhost signed by it, in d."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tuvl test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "key.pem", "-out", "req.csr", cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "req.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "cert.pem", cwd=d)
    for name in os.listdir(d):
        os.chmod(os.path.join(d, name), 0o644)


class H2Server:
    def __init__(self, d, *extra):
        self.ca = os.path.join(d, "ca.pem")
        self.proc = subprocess.Popen(
            ["node", os.path.join(ROOT, "servers", "h2_server.js"), "--port", "0",
             "--cert", os.path.join(d, "cert.pem"), "--key", os.path.join(d, "key.pem"), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.port = int(line.split()[1])
        self.base = "https://127.0.0.1:%d" % self.port
        self.ctx = ssl.create_default_context(cafile=self.ca)

    def call(self, path, method="GET"):
        req = urllib.request.Request(self.base + path, method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, context=self.ctx, timeout=10) as r:
            return json.loads(r.read())

    def stats(self):
        return self.call("/_stats")

    def reset(self):
        self.call("/_reset", "POST")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def tls(db):
    assert shutil.which("node"), "node is missing (test/run installs nodejs)"
    assert shutil.which("openssl"), "openssl is missing"
    d = tempfile.mkdtemp(prefix="tuvl-tls.")
    os.chmod(d, 0o755)
    make_certificates(d)
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (WORKFLOW % "https_call",))
    conn.close()
    servers = [H2Server(d)]
    try:
        servers.append(H2Server(d, "--h1-only"))
        servers.append(H2Server(d, "--max-streams", "100"))
        yield {"dir": d, "ca": servers[0].ca, "h2": servers[0], "h1": servers[1], "h2_few": servers[2]}
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def c(db):
    conn = connect(db)
    yield conn
    conn.close()


@pytest.fixture
def ca_trusted(tls, set_gucs):
    set_gucs({"tuvl.http_ca_file": (tls["ca"], tls["ca"])})


def run_call(conn, url, mode="worker"):
    if mode == "sync":
        run_id = q1(conn, "SELECT (tuvl.run('https_call', jsonb_build_object('url', %s::text)) ->> 'run_id')::bigint",
                    (url,))
    else:
        run_id = q1(conn, "SELECT tuvl.start_run('https_call', jsonb_build_object('url', %s::text))", (url,))
        assert q1(conn, "SELECT tuvl.wait(%s, '60 s')", (run_id,)) in ("completed", "failed")
    status, response = q(conn, "SELECT status, response FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    return status, response


def test_a_server_whose_ca_is_unknown_is_refused(tls, c):
    status, response = run_call(c, tls["h2"].base + "/echo")
    assert status == "failed", response
    assert "certificate" in response["error"].lower(), response
    assert tls["h2"].stats()["requests"] == {"h2": 0, "http/1.1": 0}


def test_a_ca_file_is_trusted_and_http2_is_used(tls, ca_trusted, c):
    for mode in ("worker", "sync"):
        if mode == "sync":
            q(c, "SET tuvl.http_ca_file = %s", (tls["ca"],))
        status, response = run_call(c, tls["h2"].base + "/echo", mode)
        assert status == "completed", response
        assert response["proto"] == "h2", response


def test_a_relative_or_missing_ca_file(tls, c):
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(c, "SET tuvl.http_ca_file = 'ca.pem'")
    assert "absolute path" in e.value.diag.message_detail
    q(c, "SET tuvl.http_ca_file = '/nonexistent/tuvl-ca.pem'")
    status, response = run_call(c, tls["h2"].base + "/echo", "sync")
    assert status == "failed", response
    assert "/nonexistent/tuvl-ca.pem" in response["error"], response


def start_calls_and_wait(c, url, n):
    """n runs of https_call to url, started in one statement and waited for; their ids."""
    ids = [r[0] for r in q(c, "SELECT tuvl.start_run('https_call', jsonb_build_object('url', %s::text)) "
                              "FROM generate_series(1, %s)", (url, n))]
    wait_until(lambda: q1(c, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND status IN "
                             "('completed', 'failed')", (ids,)) == n, 120, message="the runs to end")
    return ids


def test_hundreds_of_requests_in_flight_share_a_few_connections(tls, ca_trusted, c):
    server = tls["h2"]
    server.reset()
    n = 400
    ids = start_calls_and_wait(c, server.base + "/echo?ms=300", n)
    rows = q(c, "SELECT status, response ->> 'proto' FROM tuvl.runs WHERE id = ANY(%s)", (ids,))
    assert all(r == ("completed", "h2") for r in rows), [r for r in rows if r != ("completed", "h2")][:3]
    stats = server.stats()
    workers = q1(c, "SELECT count(*) FROM tuvl.workers WHERE database = current_database()")
    assert stats["requests"]["h2"] == n, stats
    # a handful per worker: the first handshake, a few more when the streams fill
    assert stats["connections"] <= 4 * max(workers, 1), (stats, workers)


def test_http2_off_and_servers_without_it_get_http11(tls, ca_trusted, c, set_gucs):
    status, response = run_call(c, tls["h1"].base + "/echo")
    assert (status, response["proto"]) == ("completed", "http/1.1"), response
    set_gucs({"tuvl.http2": ("off", "off")})
    status, response = run_call(c, tls["h2"].base + "/echo")
    assert (status, response["proto"]) == ("completed", "http/1.1"), response


def test_a_new_connection_resumes_the_tls_session(tls, c):
    server = tls["h1"]
    server.reset()
    q(c, "SET tuvl.http_ca_file = %s", (tls["ca"],))
    seen = []
    for _ in range(5):
        status, response = run_call(c, server.base + "/close", "sync")
        assert status == "completed", response
        seen.append((response["connection"], response["resumed"]))
    assert len({c for c, _ in seen}) == 5, seen  # the server closed each one
    # TLS 1.3 tickets are used once: a resumed connection that closes at once
    # may leave none behind, so at least every other one resumes
    assert not seen[0][1] and sum(1 for _, r in seen if r) >= 2, seen


def test_a_server_without_http2_gets_the_connections_it_needs(tls, ca_trusted, c):
    # HTTPS requests start on multiplexing shards (four connections to a
    # host); the first HTTP/1.1 answer lifts that bound for the rest
    server = tls["h1"]
    server.reset()
    n = 200
    started = time.monotonic()
    ids = [r[0] for r in q(c, "SELECT tuvl.start_run('https_call', jsonb_build_object('url', %s::text)) "
                              "FROM generate_series(1, %s)", (server.base + "/echo?ms=1000", n))]
    wait_until(lambda: q1(c, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND status IN "
                             "('completed', 'failed')", (ids,)) == n, 120, message="the runs to end")
    wall = time.monotonic() - started
    assert q1(c, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND status = 'completed' "
                 "AND response ->> 'proto' = 'http/1.1'", (ids,)) == n
    stats = server.stats()
    # held to four connections per worker, 200 one-second answers take 25 s
    assert stats["connections"] > 16, stats
    assert wall < 15, wall


def test_a_server_allowing_few_streams_gets_more_connections(tls, ca_trusted, c):
    # 100 streams a connection (nghttp2's default, and Google's): a worker's
    # multiplexing shard (four connections to a host) carries 400 requests,
    # and libcurl queues the rest until a stream is free, four seconds later
    # here (long enough for a loaded machine's workers to claim them all);
    # a shard whose requests waited with none of them started gives
    # them to shards of their own
    server = tls["h2_few"]
    server.reset()
    # (tuvl.workers lists every database's: this one's alone hold its runs)
    workers = q1(c, "SELECT count(*) FROM tuvl.workers WHERE database = current_database()")
    held = int(q1(c, "SHOW tuvl.runs_per_worker"))
    assert held >= 500, held
    n = 1200
    ids = start_calls_and_wait(c, server.base + "/echo?ms=4000", n)
    rows = q(c, "SELECT status, response ->> 'proto', response FROM tuvl.runs WHERE id = ANY(%s)", (ids,))
    assert all(r[:2] == ("completed", "h2") for r in rows), [r for r in rows if r[:2] != ("completed", "h2")][:3]
    stats = server.stats()
    # held to 400 streams a worker, at most 800 would be in flight at once
    # (one worker: 400), where the workers hold 1,024
    assert stats["peak_in_flight"] > 400 * workers + 50, (stats, workers)
    # a few connections per 400 requests, not one per request
    assert stats["connections"] <= n // 8, stats


POST_WORKFLOW = """
name: https_post
steps:
  - id: call
    kind: APICall
    http: { method: POST, url: "{{ url }}", body: { messages: "{{ text }}" }, timeout: 30s }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: { proto: "{{ res.body.proto }}" } }
  - { id: oops, status: failed, response: { error: "{{ _last_error }}" } }
"""


def mapped_kb(pid):
    """The sizes of pid's heap (glibc's main arena: the [heap] mappings) and
    of its other private anonymous mappings, kB."""
    heap = anon = 0
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[:1].isupper():
                if line.startswith("Size:") and kind is not None:
                    kb = int(line.split()[1])
                    heap, anon = (heap + kb, anon) if kind == "heap" else (heap, anon + kb)
                continue
            fields = line.split()
            if len(fields) == 5 and fields[4] == "0" and fields[1].startswith("rw"):
                kind = "anon"
            elif len(fields) > 5 and fields[5] == "[heap]":
                kind = "heap"
            else:
                kind = None
    return heap, anon


@not_under_asan
def test_requests_in_flight_keep_libcurls_buffers_out_of_the_heap(tls, ca_trusted, c):
    # libcurl mallocs a send buffer (64 kB by default, 16 kB asked) for
    # every HTTP/2 request with a body, held until its answer, and a receive
    # buffer per handle: a worker asks for small ones and maps them apart
    # from its heap (http.c), so its heap grows by the requests' own state,
    # not by buffers they barely touch
    server = tls["h2"]
    q(c, "SELECT tuvl.register_workflow(%s)", (POST_WORKFLOW,))
    # fresh workers, their heaps not grown by earlier tests
    mine = ("SELECT pid FROM tuvl.worker_status() WHERE pid IS NOT NULL AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())")
    old = {r[0] for r in q(c, mine)}
    assert old, "no worker for this database"
    for pid in old:
        q(c, "SELECT pg_terminate_backend(%s)", (pid,))
    workers = wait_until(lambda: (lambda now: now if len(now) == len(old) and not now & old else None)(
        {r[0] for r in q(c, mine)}), 30, message="new workers")
    text = "x" * 600

    def start(n, ms):
        return [r[0] for r in q(c, "SELECT tuvl.start_run('https_post', jsonb_build_object('url', %s::text, "
                                   "'text', %s::text)) FROM generate_series(1, %s)",
                                (server.base + "/echo?ms=%d" % ms, text, n))]

    def wait_ended(ids):
        wait_until(lambda: q1(c, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND status IN "
                                 "('completed', 'failed')", (ids,)) == len(ids), 120, message="the runs to end")
        assert q1(c, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND status = 'completed' "
                     "AND response ->> 'proto' = 'h2'", (ids,)) == len(ids)

    # a first batch: TLS, its CA store and the connections set up in each worker
    wait_ended(start(100, 200))
    before = {pid: mapped_kb(pid) for pid in workers}
    n = 600
    ids = start(n, 5000)
    in_flight = wait_until(lambda: (lambda v: v if v and v >= n else None)(
        q1(c, "SELECT sum(transfers_in_flight) FROM tuvl.worker_status() WHERE pid = ANY(%s)", (list(workers),))),
        30, interval=0.05, message="%d requests in flight" % n)
    during = {pid: mapped_kb(pid) for pid in workers}
    grown = sum(during[pid][0] - before[pid][0] for pid in workers)
    wait_ended(ids)
    per_request = grown / in_flight
    # measured: 76 kB with libcurl's 64 kB send buffer, 37 kB with 16 kB,
    # 18 kB with both buffers mapped apart (what is left: the run's and the
    # request's state, libcurl's handle)
    assert per_request < 28, "the workers' heaps grew %d kB for %d requests in flight: %.1f kB each" % (
        grown, in_flight, per_request)
    # the buffers' mappings are kept for the next requests, and given back
    # once the worker is idle
    mapped = sum(during[pid][1] - before[pid][1] for pid in workers)
    assert mapped > in_flight * 16, (mapped, in_flight)
    wait_until(lambda: sum(mapped_kb(pid)[1] - before[pid][1] for pid in workers) < in_flight * 4, 10,
               message="the idle workers to unmap libcurl's buffers")
