"""Self-test of the load generator's HTTPS and HTTP/2 (bench/servers/loadgen.mjs
--tls-dir, --http2) and of its connection counters (GET /_conns), which
bench/agents_tls.py relies on.

    python3 -m pytest -q test/servers/test_loadgen_tls.py

curl (with HTTP/2) checks what a client sees: the certificate verifies
against the CA the load generator made, HTTP/2 is negotiated by ALPN,
HTTP/1.1 is the fallback.  Python's ssl checks TLS session resumption.
"""
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile

import pytest

from test_loadgen import AGENT_SCRIPT, CHAT, NODE, call, start_server, stop_server

CURL = shutil.which("curl")
pytestmark = [
    pytest.mark.skipif(CURL is None, reason="curl is not installed"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]


def curl(*args):
    """(exit status, stdout) of curl with args."""
    p = subprocess.run([CURL, "-s", "--max-time", "20", *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout


@pytest.fixture(scope="module")
def tls_dir():
    d = tempfile.mkdtemp(prefix="loadgen-tls.")
    yield d
    shutil.rmtree(d)


@pytest.fixture(scope="module")
def h2(tls_dir):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"bench_agents": AGENT_SCRIPT}, f)
    try:
        srv = start_server("--tls-dir", tls_dir, "--http2", "--scripts", f.name)
    finally:
        os.unlink(f.name)
    srv.https = "https://127.0.0.1:%d" % srv.port
    srv.ca = os.path.join(tls_dir, "ca.pem")
    yield srv
    errors = stop_server(srv)
    assert not errors, "the server wrote to stderr:\n" + "\n".join(errors)


def conns(srv, extra=""):
    code, out = curl("--cacert", srv.ca, srv.https + "/_conns" + extra)
    assert code == 0
    return json.loads(out)


def reset(srv):
    assert curl("--cacert", srv.ca, "-X", "DELETE", srv.https + "/_stats")[0] == 0


def test_certificate_made_and_verified(h2, tls_dir):
    assert sorted(f for f in os.listdir(tls_dir)) == ["ca-key.pem", "ca.pem", "cert.pem", "key.pem"]
    for host in ("127.0.0.1", "localhost"):
        code, out = curl("--cacert", h2.ca, "https://%s:%d/_health" % (host, h2.port))
        assert (code, json.loads(out)) == (0, {"ok": True}), host
    # not trusted without the CA: curl's "peer certificate cannot be authenticated"
    assert curl(h2.https + "/_health")[0] == 60
    # Python's ssl verifies it too, with the host name checked
    ctx = ssl.create_default_context(cafile=h2.ca)
    c = http.client.HTTPSConnection("localhost", h2.port, context=ctx, timeout=10)
    c.request("GET", "/_health")
    assert json.loads(c.getresponse().read()) == {"ok": True}
    c.close()
    out = subprocess.run(["openssl", "x509", "-in", os.path.join(tls_dir, "cert.pem"), "-noout", "-text"],
                         capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in out and "DNS:localhost" in out and "CA:FALSE" in out


def test_certificate_reused(tls_dir, h2):
    before = {n: open(os.path.join(tls_dir, n), "rb").read() for n in ("ca.pem", "cert.pem", "key.pem")}
    srv = start_server("--tls-dir", tls_dir)
    try:
        code, out = curl("--cacert", h2.ca, "https://127.0.0.1:%d/_health" % srv.port, "-w", " %{http_version}")
        # without --http2 the server offers only http/1.1
        assert (code, out) == (0, '{"ok":true} 1.1')
    finally:
        assert stop_server(srv) == []
    assert {n: open(os.path.join(tls_dir, n), "rb").read() for n in before} == before


def test_http2_negotiated_and_http11_fallback(h2):
    reset(h2)
    body = json.dumps({"model": "bench_agents", "messages": [{"role": "user", "content": "go"}]})
    code, out = curl("--http2", "--cacert", h2.ca, "-H", "content-type: application/json",
                     "-H", "Authorization: Bearer k", "-d", body, h2.https + CHAT, "-w", "\n%{http_version}")
    answer, version = out.rsplit("\n", 1)
    assert code == 0 and version == "2"
    answer = json.loads(answer)
    assert answer["choices"][0]["message"]["tool_calls"][0]["id"] == "call_0_0"
    assert answer["usage"]["prompt_tokens"] == 100
    code, out = curl("--http1.1", "--cacert", h2.ca, h2.https + "/slow?ms=0", "-w", "\n%{http_version}")
    assert (code, out) == (0, '{"slept_ms":0}\n1.1')
    c = conns(h2)
    # the two above (and the /_conns request itself, over HTTP/2)
    assert c["by_protocol"] == {"h2+tls": 2, "http/1.1+tls": 1}
    assert c["requests_by_protocol"] == {"h2+tls": 1, "http/1.1+tls": 1}
    assert c["tls"]["handshakes"] == 3 and c["h2"]["sessions"] == 2
    assert c["scheme"] == "https" and c["http2"] is True and c["h2_max_streams"] == 128


def test_streams_multiplexed_on_few_connections(h2):
    reset(h2)
    urls = [h2.https + "/slow?ms=300"] * 40
    code, out = curl("--http2", "--parallel", "--parallel-max", "40", "--cacert", h2.ca,
                     "-w", "%{http_version}\n", *urls)
    assert code == 0
    assert out.count('{"slept_ms":300}') == 40 and out.count("2\n") == 40
    c = conns(h2, "?list=1")
    h2_conns = [r for r in c["connections"] if r["protocol"] == "h2+tls"]
    # curl waits for its first connection to learn that it multiplexes
    assert 2 <= len(h2_conns) <= 3, h2_conns          # curl's, then /_conns'
    assert c["h2"]["streams"] == 41 and c["h2"]["peak_concurrent_streams"] > 1
    assert max(r["streams"] for r in h2_conns) >= 39
    assert all(r["port"] > 0 and r["address"] == "127.0.0.1" and r["opened_s"] >= 0 for r in c["connections"])
    _, _, stats = call_https(h2, "/_stats")
    assert stats["connections"]["h2"]["streams"] == 41   # (http.client: HTTP/1.1)


def call_https(srv, path):
    ctx = ssl.create_default_context(cafile=srv.ca)
    c = http.client.HTTPSConnection("127.0.0.1", srv.port, context=ctx, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    out = (r.status, r.headers, json.loads(r.read()))
    c.close()
    return out


def test_tls_session_resumed(h2):
    reset(h2)
    ctx = ssl.create_default_context(cafile=h2.ca)
    session = None
    for _ in range(2):
        raw = socket.create_connection(("127.0.0.1", h2.port), timeout=10)
        s = ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session)
        s.sendall(b"GET /slow?ms=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        assert b'{"slept_ms":0}' in data
        session = s.session             # (TLS 1.3: the ticket came after the handshake)
        s.close()
    c = conns(h2, "?list=1")
    assert c["tls"]["handshakes"] == 3 and c["tls"]["resumed"] == 1
    assert [r["tls_resumed"] for r in c["connections"][:2]] == [False, True]


def test_h2c_with_prior_knowledge(tmp_path):
    srv = start_server("--http2")
    try:
        base = "http://127.0.0.1:%d" % srv.port
        assert curl("--http2-prior-knowledge", base + "/_health", "-w", " %{http_version}") == (0, '{"ok":true} 2')
        assert curl(base + "/_health", "-w", " %{http_version}") == (0, '{"ok":true} 1.1')
        status, _, c = call(base, "GET", "/_conns")
        assert c["by_protocol"] == {"h2c": 1, "http/1.1": 2} and c["scheme"] == "http"
    finally:
        assert stop_server(srv) == []


def test_stats_file_written_on_exit(tmp_path):
    out = tmp_path / "stats.json"
    srv = start_server("--stats-file", str(out), "--limit-rpm", "1")
    base = "http://127.0.0.1:%d" % srv.port
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert [call(base, "POST", CHAT, body)[0] for _ in range(2)] == [200, 429]
    assert stop_server(srv) == []
    data = json.loads(out.read_text())
    assert data["stats"]["rate_limited"] == {"requests": 1, "tokens": 0}
    assert data["connections"]["by_protocol"] == {"http/1.1": 2}
    assert data["limits"]["keys"]["(none)"]["admitted"] == 1


# An HTTP/2 client whose session stays open until the server ends it.
H2_CLIENT = """
const s = require("node:http2").connect(process.argv[1]);
s.on("goaway", () => console.log("goaway"));
s.on("close", () => process.exit(0));
const r = s.request({":path": "/_health"});
r.on("data", () => {});
r.on("end", () => console.log("answered"));
setTimeout(() => process.exit(3), 10000);
"""


def test_idle_connections_closed_on_request():
    srv = start_server("--http2")
    try:
        idle = []
        for _ in range(3):
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
            c.request("GET", "/slow?ms=0")
            assert c.getresponse().read() == b'{"slept_ms":0}'
            idle.append(c)
        # one connection with a request in flight is left alone
        busy = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        busy.request("GET", "/slow?ms=3000")
        # and an HTTP/2 session with none in flight gets a GOAWAY (a Node
        # client that keeps its session open)
        base = "http://127.0.0.1:%d" % srv.port
        h2 = subprocess.Popen([NODE, "-e", H2_CLIENT, base], stdout=subprocess.PIPE, text=True)
        assert h2.stdout.readline() == "answered\n"
        status, _, body = call(base, "DELETE", "/_conns")
        assert status == 200 and body == {"ok": True, "closed": 4}, body
        assert h2.stdout.readline() == "goaway\n"
        assert h2.wait(10) == 0
        assert busy.getresponse().read() == b'{"slept_ms":3000}'
        for c in idle:                   # the server closed them: EOF
            assert c.sock.recv(10) == b""
            c.close()
        busy.close()
        _, _, c = call(base, "GET", "/_conns")
        assert c["open"] == 1            # the connection of this request
    finally:
        assert stop_server(srv) == []
