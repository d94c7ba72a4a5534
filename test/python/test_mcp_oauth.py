"""OAuth 2.1 for MCP servers: mcp.auth, tuvl.mcp_connect(), mcp_connect_finish().

The servers are test/servers/oauth_server.py (an authorization server that
issues, refuses, expires and refreshes tokens) and
test/servers/mcp_stateless_server.py --auth (an MCP server that wants its
tokens, checked by introspection), started here for each test on free
ports.  The person of the authorization-code grant is played by urllib:
the authorization server approves at once and redirects to the redirect
URI with the code, which goes to tuvl.mcp_connect_finish().
"""
import json
import os
import urllib.error
import urllib.parse
import urllib.request

import psycopg2
import pytest

from conftest import connect, q, q1
from httputil import execute, payloads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sys  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "test", "servers"))
import peer  # noqa: E402

AS_SCRIPT = os.path.join(ROOT, "test", "servers", "oauth_server.py")
MCP_SCRIPT = os.path.join(ROOT, "test", "servers", "mcp_stateless_server.py")
REDIRECT = "http://127.0.0.1:9/oauth/callback"
ALICE, BOB = "oauth_alice", "oauth_bob"

CC = """
name: {name}
steps:
  - id: call
    kind: MCP
    mcp:
      url: "{{{{ url }}}}"
      tool: echo
      arguments: {{ text: "{{{{ text }}}}" }}
      auth: {{ oauth: {auth} }}
    output: res
    routes: {{ default: done, error: oops }}
ends:
  - {{ id: done, status: completed, response: "{{{{ res.text }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""


class Servers:
    def __init__(self):
        self.auth = peer.start(AS_SCRIPT, "OAuth authorization server on ")
        self.mcp = peer.start(MCP_SCRIPT, "MCP 2026-07-28 server on ", "--auth", self.auth.base,
                              "--scopes", "mcp:tools")
        self.url = self.mcp.base + "/mcp"

    def post(self, path, body, base=None):
        req = urllib.request.Request((base or self.auth.base) + path, data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"{}")

    def as_log(self):
        with urllib.request.urlopen(self.auth.base + "/_log", timeout=10) as r:
            return json.loads(r.read())["requests"]

    def tokens_seen(self):
        """The bearer tokens the MCP server was sent."""
        with urllib.request.urlopen(self.mcp.base + "/_log", timeout=10) as r:
            reqs = json.loads(r.read())["requests"]
        return {h["headers"]["authorization"][7:] for h in reqs
                if h.get("headers", {}).get("authorization", "").startswith("Bearer ")}

    def close(self):
        peer.stop(self.mcp)
        peer.stop(self.auth)


@pytest.fixture
def servers():
    s = Servers()
    yield s
    s.close()


@pytest.fixture(scope="module")
def roles(db):
    admin = connect("postgres")
    for r in (ALICE, BOB):
        q(admin, f"DROP ROLE IF EXISTS {r}")
        q(admin, f"CREATE ROLE {r} LOGIN IN ROLE tuvl_user")
    admin.close()
    return db


def register(conn, name, auth):
    q(conn, "SELECT tuvl.register_workflow(%s)", (CC.format(name=name, auth=auth),))


def cc_auth(client="cc-client", secret="cc_secret"):
    return f"{{ grant: client_credentials, client_id: {client}, client_secret_secret: {secret} }}"


def setup_cc(conn, servers, secret_value="s3cret-cc", name="cc_ok"):
    servers.post("/_config", {"clients": {"cc-client": {"secret": "s3cret-cc", "redirect_uris": [],
                                                        "method": "client_secret_basic"}}})
    q(conn, "SELECT tuvl.set_secret('cc_secret', %s)", (secret_value,))
    register(conn, name, cc_auth())


def journal_text(conn, run_id):
    return json.dumps([p for p in q(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s", (run_id,))])


@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_client_credentials_token_is_issued_used_and_never_journaled(roles, servers, conns, server_log, mode):
    c = conns(roles)
    mark = server_log.mark()
    setup_cc(c, servers)
    res = execute(c, "cc_ok", {"url": servers.url, "text": "hello"}, mode)
    assert res["end"] == "done", res
    assert res["response"] == "hello"
    tok = [r for r in servers.as_log() if r["path"] == "/token"]
    assert len(tok) == 1 and tok[0]["status"] == 200
    assert tok[0]["form"]["grant_type"] == "client_credentials"
    assert tok[0]["form"]["resource"] == servers.url
    assert tok[0]["form"]["scope"] == "mcp:tools"
    assert tok[0]["headers"]["authorization"].startswith("Basic ")
    # the journal shows the grant's requests, with the token redacted
    rpcs = [p["request"]["rpc"] for p in payloads(c, res["run_id"], "tool_call")]
    assert rpcs[:4] == ["oauth_probe", "oauth_prm", "oauth_as", "oauth_token"], rpcs
    results = [p["result"] for p in payloads(c, res["run_id"], "tool_result")]
    assert results[3]["body"]["access_token"] == "[redacted]"
    tokens = servers.tokens_seen()
    assert tokens
    text = journal_text(c, res["run_id"])
    for t in tokens:
        assert t not in text
        assert t not in server_log.since(mark)
        assert q1(c, "SELECT count(*) FROM tuvl.runs WHERE context::text LIKE %s", (f"%{t}%",)) == 0
    assert "s3cret-cc" not in text
    # the next run uses the stored token: no grant at all
    res = execute(c, "cc_ok", {"url": servers.url, "text": "again"}, mode)
    assert res["response"] == "again"
    assert len([r for r in servers.as_log() if r["path"] == "/token"]) == 1
    rpcs = [p["request"]["rpc"] for p in payloads(c, res["run_id"], "tool_call")]
    assert not [r for r in rpcs if r.startswith("oauth_")], rpcs


def test_a_refused_client_fails_the_step_with_the_servers_error(roles, servers, conns):
    c = conns(roles)
    setup_cc(c, servers, secret_value="wrong", name="cc_refused")
    res = execute(c, "cc_refused", {"url": servers.url, "text": "x"})
    assert res["end"] == "oops", res
    assert "token endpoint answered HTTP 401: invalid_client" in res["response"]["error"], res
    assert q1(c, "SELECT count(*) FROM tuvl.mcp_oauth_tokens WHERE url = %s", (servers.url,)) == 0


def test_an_expired_client_credentials_token_is_replaced(roles, servers, conns):
    c = conns(roles)
    setup_cc(c, servers, name="cc_expire")
    assert execute(c, "cc_expire", {"url": servers.url, "text": "one"})["response"] == "one"
    servers.post("/_expire", {})
    res = execute(c, "cc_expire", {"url": servers.url, "text": "two"})
    assert res["response"] == "two", res
    tok = [r for r in servers.as_log() if r["path"] == "/token"]
    assert len(tok) == 2
    assert len(servers.tokens_seen()) == 2


def test_a_token_endpoint_outside_the_allow_list_is_never_sent_the_secret(roles, servers, conns):
    c = conns(roles)
    setup_cc(c, servers, name="cc_hostile")
    servers.post("/_config", {"metadata": {"token_endpoint": "http://evil.example.com:9/token"}})
    res = execute(c, "cc_hostile", {"url": servers.url, "text": "x"})
    assert res["end"] == "oops", res
    assert "HTTP request to http://evil.example.com:9/token is not allowed" in res["response"]["error"]
    assert not [r for r in servers.as_log() if r["path"] == "/token"]
    # tuvl.mcp_connect() refuses it too
    q(c, "SET tuvl.oauth_redirect_uri = %s", (REDIRECT,))
    with pytest.raises(psycopg2.Error) as e:
        q(c, "SELECT tuvl.mcp_connect(%s)", (servers.url,))
    assert "evil.example.com" in str(e.value) and "not allowed" in str(e.value)


@pytest.mark.parametrize("raw, message", [
    ("not json at all", "is not a JSON object"),
    ('["an", "array"]', "is not a JSON object"),
    ('{"issuer": "x", "pad": "' + "x" * 70000 + '"}', "larger than"),
], ids=["not-json", "array", "oversized"])
def test_malformed_or_oversized_metadata_is_refused(roles, servers, conns, raw, message):
    c = conns(roles)
    setup_cc(c, servers, name="cc_malformed")
    servers.post("/_config", {"metadata_raw": raw})
    res = execute(c, "cc_malformed", {"url": servers.url, "text": "x"})
    assert res["end"] == "oops", res
    assert message in res["response"]["error"], res
    q(c, "SET tuvl.oauth_redirect_uri = %s", (REDIRECT,))
    with pytest.raises(psycopg2.Error) as e:
        q(c, "SELECT tuvl.mcp_connect(%s)", (servers.url,))
    assert message in str(e.value)


def connect_as(conn, url, auth=None):
    """Play the person: open the authorization URL, hand the redirect back."""
    q(conn, "SET tuvl.oauth_redirect_uri = %s", (REDIRECT,))
    authz = q1(conn, "SELECT tuvl.mcp_connect(%s, %s)", (url, json.dumps(auth) if auth else None))

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None
    opener = urllib.request.build_opener(NoRedirect)
    try:
        opener.open(authz, timeout=10)
        raise AssertionError("the authorization endpoint did not redirect")
    except urllib.error.HTTPError as e:
        assert e.code == 302, e.code
        location = e.headers["Location"]
    assert location.startswith(REDIRECT)
    return authz, q1(conn, "SELECT tuvl.mcp_connect_finish(%s)", (location,))


AC = "{ grant: authorization_code }"


def test_authorization_code_grant_for_a_role_and_not_for_another(roles, servers, conns, server_log):
    alice = conns(roles, user=ALICE)
    bob = conns(roles, user=BOB)
    admin = conns(roles)
    register(alice, "ac_alice", AC)
    register(bob, "ac_bob", AC)
    mark = server_log.mark()
    res = execute(alice, "ac_alice", {"url": servers.url, "text": "x"})
    assert res["end"] == "oops" and "tuvl.mcp_connect()" in res["response"]["error"], res
    authz, url = connect_as(alice, servers.url)
    assert url == servers.url
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(authz).query))
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert query["resource"] == servers.url
    assert set(query["scope"].split()) == {"mcp:tools", "offline_access"}
    reg = [r for r in servers.as_log() if r["path"] == "/register"]
    assert len(reg) == 1, "a client was registered dynamically"
    tok = [r for r in servers.as_log() if r["path"] == "/token"]
    assert tok[-1]["form"]["grant_type"] == "authorization_code"
    assert tok[-1]["form"]["resource"] == servers.url
    # alice's runs use her token, in both paths
    for mode in ("sync", "worker"):
        res = execute(alice, "ac_alice", {"url": servers.url, "text": f"hi {mode}"}, mode)
        assert res["response"] == f"hi {mode}", res
    # bob holds no grant: his run fails, naming mcp_connect; his runs never send alice's token
    seen = servers.tokens_seen()
    res = execute(bob, "ac_bob", {"url": servers.url, "text": "x"})
    assert res["end"] == "oops" and "tuvl.mcp_connect()" in res["response"]["error"], res
    assert servers.tokens_seen() == seen
    # bob cannot read the token nor finish alice's grant
    with pytest.raises(psycopg2.Error):
        q(bob, "SELECT * FROM tuvl.mcp_oauth_tokens")
    with pytest.raises(psycopg2.Error):
        q(bob, "SELECT value FROM tuvl.secrets")
    # granted by an admin, bob's runs share alice's token
    secret = q1(admin, "SELECT secret FROM tuvl.mcp_oauth_tokens WHERE url = %s AND role = %s::regrole",
                (servers.url, ALICE))
    q(admin, "SELECT tuvl.grant_secret(%s, %s)", (secret, BOB))
    res = execute(bob, "ac_bob", {"url": servers.url, "text": "shared"})
    assert res["response"] == "shared", res
    for t in servers.tokens_seen():
        assert t not in server_log.since(mark)
        assert q1(admin, "SELECT count(*) FROM tuvl.events WHERE payload::text LIKE %s", (f"%{t}%",)) == 0


def test_a_callback_with_an_unknown_state_or_another_roles_state_is_refused(roles, servers, conns):
    alice = conns(roles, user=ALICE)
    bob = conns(roles, user=BOB)
    q(alice, "SET tuvl.oauth_redirect_uri = %s", (REDIRECT,))
    authz = q1(alice, "SELECT tuvl.mcp_connect(%s)", (servers.url,))
    state = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(authz).query))["state"]
    for who, cb in ((alice, REDIRECT + "?code=x&state=nope"), (bob, f"{REDIRECT}?code=x&state={state}")):
        with pytest.raises(psycopg2.Error) as e:
            q(who, "SELECT tuvl.mcp_connect_finish(%s)", (cb,))
        assert "no OAuth grant" in str(e.value)
    # a refusal by the person: the server's error, not a token
    with pytest.raises(psycopg2.Error) as e:
        q(alice, "SELECT tuvl.mcp_connect_finish(%s)", (f"{REDIRECT}?error=access_denied&state={state}",))
    assert "refused: access_denied" in str(e.value)


def test_a_token_about_to_expire_is_refreshed(roles, servers, conns):
    alice = conns(roles, user=ALICE)
    register(alice, "ac_refresh", AC)
    servers.post("/_config", {"ttl": 20})       # within the minute tuvl refreshes ahead
    connect_as(alice, servers.url)
    for i in range(2):
        res = execute(alice, "ac_refresh", {"url": servers.url, "text": f"r{i}"})
        assert res["response"] == f"r{i}", res
        rpcs = [p["request"]["rpc"] for p in payloads(alice, res["run_id"], "tool_call")]
        assert rpcs[0] == "oauth_token", rpcs
        result = payloads(alice, res["run_id"], "tool_result")[0]["result"]
        assert result["body"]["access_token"] == "[redacted]"
        assert result["body"]["refresh_token"] == "[redacted]"
    refreshes = [r for r in servers.as_log() if r["path"] == "/token" and
                 r["form"]["grant_type"] == "refresh_token"]
    # the refresh token rotates: the second refresh used the new one
    assert len(refreshes) == 2 and all(r["status"] == 200 for r in refreshes)


def test_a_revoked_token_fails_the_step_naming_mcp_connect(roles, servers, conns):
    alice = conns(roles, user=ALICE)
    register(alice, "ac_revoked", AC)
    connect_as(alice, servers.url)
    assert execute(alice, "ac_revoked", {"url": servers.url, "text": "ok"})["response"] == "ok"
    servers.post("/_revoke", {})
    res = execute(alice, "ac_revoked", {"url": servers.url, "text": "x"})
    assert res["end"] == "oops", res
    assert "refused the OAuth token (HTTP 401" in res["response"]["error"]
    assert "tuvl.mcp_connect()" in res["response"]["error"]


@pytest.mark.parametrize("auth, message", [
    ("{ oauth: { grant: password } }", "steps[0].mcp.auth.oauth.grant: grant must be client_credentials"),
    ("{ oauth: { grant: client_credentials } }", "needs client_id and client_secret_secret"),
    ("{ oauth: { grant: authorization_code, scope: x } }", 'unknown key "scope"'),
    ("{ oauth: { grant: authorization_code, scopes: \"a b\" } }", "scopes must be a list"),
    ("{ basic: x }", 'unknown key "basic"'),
])
def test_mcp_auth_is_checked_with_its_path(roles, conns, auth, message):
    c = conns(roles)
    with pytest.raises(psycopg2.Error) as e:
        q(c, "SELECT tuvl.register_workflow(%s)", (CC.format(name="bad_auth", auth="x").replace(
            "auth: { oauth: x }", f"auth: {auth}"),))
    assert message in str(e.value), str(e.value)
