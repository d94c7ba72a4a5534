"""Self-test of the scripted 2026-07-28 MCP server and OAuth authorization
server (test/servers/mcp_stateless_server.py, test/servers/oauth_server.py).

    python3 -m pytest -q test/servers/test_mcp_stateless_server.py

Starts the servers as subprocesses on free ports and talks to them with
urllib, as an MCP client of either revision and an OAuth client would.
"""
import base64
import hashlib
import json
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request

import pytest

from peer import start, stop

HERE = os.path.dirname(os.path.abspath(__file__))
MCP = os.path.join(HERE, "mcp_stateless_server.py")
OAUTH = os.path.join(HERE, "oauth_server.py")
V26 = "2026-07-28"
V25 = "2025-11-25"
CALLBACK = "http://127.0.0.1:9/callback"


def start_mcp(*args):
    return start(MCP, "MCP 2026-07-28 server on 127.0.0.1:", *args)


def start_oauth(*args):
    return start(OAUTH, "OAuth authorization server on 127.0.0.1:", *args)


@pytest.fixture
def mcp():
    srv = start_mcp()
    yield srv
    assert not stop(srv)


@pytest.fixture
def oauth():
    srv = start_oauth()
    yield srv
    assert not stop(srv)


def http(method, url, body=None, headers=None, form=None):
    """(status, headers, parsed body) without raising on 4xx/5xx."""
    data = None
    h = dict(headers or {})
    if form is not None:
        data = urllib.parse.urlencode(form).encode()
        h.setdefault("Content-Type", "application/x-www-form-urlencoded")
    elif body is not None:
        data = json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=data, headers=h, method=method)

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req, timeout=20) as r:
            status, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, e.headers, e.read()
    ctype = hdrs.get("Content-Type") or ""
    if ctype.startswith("text/event-stream"):
        events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        return status, hdrs, json.loads(events[-1])
    return status, hdrs, (json.loads(raw) if raw else None)


def meta(version=V26, caps=None):
    return {"io.modelcontextprotocol/protocolVersion": version,
            "io.modelcontextprotocol/clientCapabilities": caps if caps is not None else {"elicitation": {}}}


def call26(srv, method, params=None, headers=None, token=None, url=None, rid=1):
    params = dict(params or {})
    params.setdefault("_meta", meta())
    h = {"Accept": "application/json, text/event-stream",
         "MCP-Protocol-Version": params["_meta"].get("io.modelcontextprotocol/protocolVersion") or "",
         "Mcp-Method": method}
    if method == "tools/call":
        h["Mcp-Name"] = params.get("name", "")
    if token:
        h["Authorization"] = "Bearer " + token
    h.update(headers or {})
    return http("POST", url or srv.base + "/mcp",
                {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}, h)


# ---------------------------------------------------------------- the stateless revision

def test_discover_without_meta(mcp):
    status, hdrs, r = http("POST", mcp.base + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "server/discover"})
    assert status == 200
    assert r["result"]["supportedVersions"] == [V26, V25]
    assert "tools" in r["result"]["capabilities"]
    assert "Mcp-Session-Id" not in hdrs


def test_call_with_meta_and_headers(mcp):
    status, hdrs, r = call26(mcp, "tools/call", {"name": "add", "arguments": {"a": 2, "b": 40}})
    assert status == 200, r
    assert r["result"]["resultType"] == "complete"
    assert r["result"]["content"][0]["text"] == "The sum of 2 and 40 is 42"
    assert "Mcp-Session-Id" not in hdrs
    status, _, r = call26(mcp, "tools/list")
    assert [t["name"] for t in r["result"]["tools"]] == ["echo", "add", "slow", "fail", "confirm",
                                                       "long", "ask_on_stream"]
    log = http("GET", mcp.base + "/_log")[2]["requests"]
    assert [e["version"] for e in log] == [V26, V26]


@pytest.mark.parametrize("header,value", [("Mcp-Method", "tools/list"), ("Mcp-Name", "echo"),
                                          ("MCP-Protocol-Version", V25)])
def test_header_mismatch_is_400(mcp, header, value):
    status, _, r = call26(mcp, "tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}},
                          headers={header: value})
    assert status == 400
    assert r["error"]["code"] == -32001
    assert r["error"]["data"]["header"].lower() == header.lower()


def test_unsupported_version_is_400_32022(mcp):
    status, _, r = call26(mcp, "tools/list", {"_meta": meta("2027-01-01")})
    assert status == 400
    assert r["error"]["code"] == -32022
    assert r["error"]["data"] == {"supported": [V26, V25], "requested": "2027-01-01"}


def test_meta_needs_capabilities(mcp):
    m = meta()
    del m["io.modelcontextprotocol/clientCapabilities"]
    status, _, r = call26(mcp, "tools/list", {"_meta": m})
    assert status == 400 and r["error"]["code"] == -32602


def test_no_stream_no_session(mcp):
    assert http("GET", mcp.base + "/mcp")[0] == 405
    assert http("DELETE", mcp.base + "/mcp")[0] == 405
    status, _, r = call26(mcp, "initialize", {"protocolVersion": V26, "capabilities": {}})
    assert status == 400


def test_input_required_round_trip(mcp):
    params = {"name": "confirm", "arguments": {"operation": "deploy"}}
    _, _, r = call26(mcp, "tools/call", params)
    res = r["result"]
    assert res["resultType"] == "input_required"
    ask = res["inputRequests"]["confirm"]
    assert ask["method"] == "elicitation/create"
    assert ask["params"]["requestedSchema"]["properties"]["note"]["default"] == "none"
    retry = dict(params, requestState=res["requestState"],
                 inputResponses={"confirm": {"action": "accept", "content": {"confirmed": True, "note": "go"}}})
    _, _, r = call26(mcp, "tools/call", retry)
    assert r["result"]["resultType"] == "complete"
    assert r["result"]["content"][0]["text"] == "deploy: accepted confirmed=true note=go"
    retry["inputResponses"] = {"confirm": {"action": "decline"}}
    _, _, r = call26(mcp, "tools/call", retry)
    assert r["result"]["content"][0]["text"] == "deploy: declined"
    # a requestState of other arguments is refused
    _, _, r = call26(mcp, "tools/call", dict(retry, arguments={"operation": "drop"}))
    assert r["error"]["code"] == -32602


def test_sse_responses():
    srv = start_mcp("--sse")
    try:
        status, hdrs, r = call26(srv, "tools/call", {"name": "echo", "arguments": {"text": "hi"}})
        assert status == 200 and hdrs["Content-Type"].startswith("text/event-stream")
        assert r["result"]["content"][0]["text"] == "hi"
    finally:
        assert not stop(srv)


# ---------------------------------------------------------------- the 2025 revisions

def test_legacy_initialize_is_stateless(mcp):
    status, hdrs, r = http("POST", mcp.base + "/mcp", {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": V26, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    assert status == 200 and r["result"]["protocolVersion"] == V25
    assert "Mcp-Session-Id" not in hdrs
    _, _, r = http("POST", mcp.base + "/mcp", {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                               "params": {"name": "confirm", "arguments": {"operation": "x"}}})
    assert r["result"]["isError"] is True
    assert "resultType" not in r["result"]


def test_only_stateless_refuses_legacy():
    srv = start_mcp("--versions", V26)
    try:
        status, _, r = http("POST", srv.base + "/mcp", {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": V25, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        assert status == 400
        assert r["error"]["data"] == {"supported": [V26], "requested": V25}
    finally:
        assert not stop(srv)


def test_downgrade_at_runtime(mcp):
    assert http("POST", mcp.base + "/_config", {"versions": [V25]})[0] == 200
    status, _, r = call26(mcp, "tools/list")
    assert status == 400 and r["error"]["code"] == -32022
    assert r["error"]["data"]["supported"] == [V25]
    _, _, r = http("POST", mcp.base + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "server/discover"})
    assert r["result"]["supportedVersions"] == [V25]


# ---------------------------------------------------------------- OAuth

def pkce():
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    return verifier, challenge


def authorize(oauth, client_id, resource, scope="mcp:tools"):
    verifier, challenge = pkce()
    q = urllib.parse.urlencode({"response_type": "code", "client_id": client_id, "redirect_uri": CALLBACK,
                                "code_challenge": challenge, "code_challenge_method": "S256",
                                "state": "s1", "scope": scope, "resource": resource})
    status, hdrs, _ = http("GET", oauth.base + "/authorize?" + q)
    assert status == 302
    back = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(hdrs["Location"]).query))
    assert back["state"] == "s1" and back["iss"] == oauth.base
    return back, verifier


@pytest.fixture
def protected(oauth):
    srv = start_mcp("--auth", oauth.base)
    yield srv
    assert not stop(srv)


def test_metadata_discovery(oauth, protected):
    status, hdrs, r = call26(protected, "tools/list")
    assert status == 401
    challenge = hdrs["WWW-Authenticate"]
    assert 'resource_metadata="%s/.well-known/oauth-protected-resource/mcp"' % protected.base in challenge
    assert 'scope="mcp:tools"' in challenge
    _, _, prm = http("GET", protected.base + "/.well-known/oauth-protected-resource/mcp")
    assert prm["resource"] == protected.base + "/mcp" and prm["authorization_servers"] == [oauth.base]
    _, _, asm = http("GET", oauth.base + "/.well-known/oauth-authorization-server")
    assert asm["issuer"] == oauth.base and asm["code_challenge_methods_supported"] == ["S256"]


def test_authorization_code_refresh_and_step_up(oauth, protected):
    resource = protected.base + "/mcp"
    status, _, reg = http("POST", oauth.base + "/register", {"redirect_uris": [CALLBACK],
                                                             "token_endpoint_auth_method": "client_secret_post"})
    assert status == 201 and reg["client_secret"]
    back, verifier = authorize(oauth, reg["client_id"], resource)
    form = {"grant_type": "authorization_code", "code": back["code"], "redirect_uri": CALLBACK,
            "code_verifier": verifier, "resource": resource, "client_id": reg["client_id"],
            "client_secret": reg["client_secret"]}
    status, _, tok = http("POST", oauth.base + "/token", form=form)
    assert status == 200, tok
    assert tok["token_type"] == "Bearer" and tok["refresh_token"]
    status, _, r = call26(protected, "tools/call", {"name": "echo", "arguments": {"text": "in"}},
                          token=tok["access_token"])
    assert status == 200 and r["result"]["content"][0]["text"] == "in"
    # the code is single use
    assert http("POST", oauth.base + "/token", form=form)[2]["error"] == "invalid_grant"
    # step-up: confirm needs mcp:confirm
    status, hdrs, _ = call26(protected, "tools/call", {"name": "confirm", "arguments": {"operation": "o"}},
                             token=tok["access_token"])
    assert status == 403 and 'error="insufficient_scope"' in hdrs["WWW-Authenticate"]
    assert 'scope="mcp:confirm mcp:tools"' in hdrs["WWW-Authenticate"]
    # expiry, then refresh (rotated)
    http("POST", oauth.base + "/_expire")
    assert call26(protected, "tools/list", token=tok["access_token"])[0] == 401
    rform = {"grant_type": "refresh_token", "refresh_token": tok["refresh_token"], "resource": resource,
             "client_id": reg["client_id"], "client_secret": reg["client_secret"]}
    status, _, tok2 = http("POST", oauth.base + "/token", form=rform)
    assert status == 200 and tok2["access_token"] != tok["access_token"]
    assert call26(protected, "tools/list", token=tok2["access_token"])[0] == 200
    assert http("POST", oauth.base + "/token", form=rform)[2]["error"] == "invalid_grant"
    # the wrong client authentication method is refused
    bad = dict(rform, refresh_token=tok2["refresh_token"])
    del bad["client_secret"]
    status, _, r = http("POST", oauth.base + "/token", form=bad,
                        headers={"Authorization": "Basic " + base64.b64encode(
                            f"{reg['client_id']}:{reg['client_secret']}".encode()).decode()})
    assert status == 401 and r["error"] == "invalid_client"


def test_token_for_another_resource_is_refused(oauth, protected):
    back, verifier = authorize(oauth, "https://client.example/metadata.json", "http://127.0.0.1:1/mcp")
    status, _, tok = http("POST", oauth.base + "/token", form={
        "grant_type": "authorization_code", "code": back["code"], "redirect_uri": CALLBACK,
        "code_verifier": verifier, "resource": "http://127.0.0.1:1/mcp",
        "client_id": "https://client.example/metadata.json"})
    assert status == 200
    assert call26(protected, "tools/list", token=tok["access_token"])[0] == 401


def test_pkce_and_refusal(oauth):
    http("POST", oauth.base + "/_config", {"clients": {"pre": {"secret": "s", "redirect_uris": [CALLBACK]}}})
    back, _ = authorize(oauth, "pre", "r")
    status, _, r = http("POST", oauth.base + "/token", form={
        "grant_type": "authorization_code", "code": back["code"], "redirect_uri": CALLBACK,
        "code_verifier": "wrong", "resource": "r"},
        headers={"Authorization": "Basic " + base64.b64encode(b"pre:s").decode()})
    assert status == 400 and r["error"] == "invalid_grant"
    http("POST", oauth.base + "/_config", {"deny": True})
    back, _ = authorize(oauth, "pre", "r")
    assert back["error"] == "access_denied"


def test_client_credentials(oauth):
    http("POST", oauth.base + "/_config", {"clients": {"svc": {"secret": "s3", "redirect_uris": []}}})
    basic = {"Authorization": "Basic " + base64.b64encode(b"svc:s3").decode()}
    status, _, tok = http("POST", oauth.base + "/token", headers=basic,
                          form={"grant_type": "client_credentials", "scope": "mcp:tools", "resource": "r"})
    assert status == 200 and "refresh_token" not in tok
    _, _, info = http("POST", oauth.base + "/introspect", form={"token": tok["access_token"]})
    assert info["active"] and info["aud"] == "r" and info["client_id"] == "svc"
    http("POST", oauth.base + "/_revoke")
    assert http("POST", oauth.base + "/introspect", form={"token": tok["access_token"]})[2] == {"active": False}
    basic["Authorization"] = "Basic " + base64.b64encode(b"svc:wrong").decode()
    status, _, r = http("POST", oauth.base + "/token", headers=basic,
                        form={"grant_type": "client_credentials", "scope": "mcp:tools"})
    assert status == 401 and r["error"] == "invalid_client"
