#!/usr/bin/env python3
"""A scripted OAuth 2.1 authorization server for tuvl's MCP tests.

It issues, refuses, expires and refreshes the tokens of the MCP
authorization profile, for test/servers/mcp_stateless_server.py --auth (the
protected MCP server).  Standard library only; approves every authorization
at once (no login page), as a test needs.

    python3 test/servers/oauth_server.py --port N [--ttl SECONDS]

--port 0 picks a free port; the one line on stderr names the port bound:
"OAuth authorization server on 127.0.0.1:PORT".

Endpoints (issuer http://127.0.0.1:PORT):

  GET  /.well-known/oauth-authorization-server   RFC 8414 metadata (also at
       /.well-known/openid-configuration): issuer, authorization_endpoint,
       token_endpoint, registration_endpoint, introspection_endpoint,
       scopes_supported, response_types_supported ["code"],
       grant_types_supported, token_endpoint_auth_methods_supported
       (client_secret_basic, client_secret_post, none),
       code_challenge_methods_supported ["S256"],
       client_id_metadata_document_supported true,
       authorization_response_iss_parameter_supported true
  POST /register    RFC 7591 dynamic registration: {redirect_uris,
       token_endpoint_auth_method (default client_secret_basic),
       grant_types, client_name} -> 201 {client_id, client_secret (unless
       the method is none), ...}
  GET  /authorize   response_type=code, client_id (registered, or an https
       URL: a client-ID metadata document, taken on trust here), redirect_uri
       (registered ones only, for registered clients), code_challenge with
       code_challenge_method=S256 (required), state, scope, resource.
       Approves at once: 302 to redirect_uri?code=...&state=...&iss=<issuer>,
       or with error=access_denied while /_config has "deny": true.  A bad
       client or redirect URI is a 400 page, never a redirect
  POST /token       application/x-www-form-urlencoded; client authentication
       as the client registered (HTTP Basic, or client_id and client_secret
       in the form, or client_id alone for "none"):
         grant_type=authorization_code: code, redirect_uri, code_verifier
           (PKCE S256), resource (must equal the authorization's)
         grant_type=refresh_token: refresh_token (rotated: the old one dies),
           optional scope (a subset), resource
         grant_type=client_credentials: scope, resource (confidential clients)
       -> {access_token, token_type "Bearer", expires_in, scope,
       refresh_token (not for client_credentials)}.  Errors are RFC 6749
       JSON: invalid_request, invalid_client (401), invalid_grant,
       unsupported_grant_type, invalid_scope
  POST /introspect  token=... -> {active, scope, aud (the resource),
       client_id, exp}: the protected MCP server's check

Tokens live --ttl seconds (default 3600).

Control endpoints:

  POST   /_config   {"ttl": s, "deny": bool, "clients": {id: {secret,
                    redirect_uris, method}}} (pre-registered clients)
  POST   /_expire   every access token expires now (refresh tokens stay)
  POST   /_revoke   every token, access and refresh, dies
  GET    /_log      {"requests": [{t, method, path, headers, form, status,
                    error}]}; DELETE /_log clears it
  GET    /_health   {"ok": true}
"""
import argparse
import base64
import hashlib
import json
import secrets
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCOPES = ["mcp:tools", "mcp:confirm", "offline_access"]


class OAuthError(Exception):
    def __init__(self, error, description, status=400):
        super().__init__(description)
        self.error, self.description, self.status = error, description, status


class State:
    def __init__(self, ttl):
        self.lock = threading.Lock()
        self.ttl = ttl
        self.deny = False
        self.clients = {}       # id -> {secret, redirect_uris, method}
        self.codes = {}         # code -> {client_id, redirect_uri, challenge, scope, resource}
        self.access = {}        # token -> {client_id, scope, resource, exp}
        self.refresh = {}       # token -> {client_id, scope, resource}
        self.log = []


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "oauth-test-server/1"

    def log_message(self, *args):
        pass

    @property
    def st(self):
        return self.server.state

    def issuer(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def send(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def redirect(self, location):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def record(self, status, form=None, error=None):
        with self.st.lock:
            self.st.log.append({"t": time.time(), "method": self.command, "path": self.path,
                                "headers": {k.lower(): v for k, v in self.headers.items()},
                                "form": form, "status": status, "error": error})

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def metadata(self):
        i = self.issuer()
        return {
            "issuer": i,
            "authorization_endpoint": i + "/authorize",
            "token_endpoint": i + "/token",
            "registration_endpoint": i + "/register",
            "introspection_endpoint": i + "/introspect",
            "scopes_supported": SCOPES,
            "response_types_supported": ["code"],
            "grant_types_supported": ["authorization_code", "refresh_token", "client_credentials"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post", "none"],
            "code_challenge_methods_supported": ["S256"],
            "client_id_metadata_document_supported": True,
            "authorization_response_iss_parameter_supported": True,
        }

    # ------------------------------------------------------------ GET

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        if url.path in ("/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):
            self.record(200)
            return self.send(200, self.metadata())
        if url.path == "/_health":
            return self.send(200, {"ok": True})
        if url.path == "/_log":
            with self.st.lock:
                return self.send(200, {"requests": list(self.st.log)})
        if url.path == "/authorize":
            return self.authorize(q)
        self.send(404, {"error": "not found"})

    def authorize(self, q):
        client_id = q.get("client_id", "")
        with self.st.lock:
            client = self.st.clients.get(client_id)
            deny = self.st.deny
        redirect_uri = q.get("redirect_uri", "")
        if client is None and not client_id.startswith("https://"):
            self.record(400, q, "unknown client")
            return self.send(400, {"error": "invalid_request", "error_description": "unknown client_id"})
        if client is not None and redirect_uri not in client["redirect_uris"]:
            self.record(400, q, "unregistered redirect_uri")
            return self.send(400, {"error": "invalid_request",
                                   "error_description": "redirect_uri is not registered"})
        if not redirect_uri.startswith(("http://", "https://")):
            self.record(400, q, "bad redirect_uri")
            return self.send(400, {"error": "invalid_request", "error_description": "bad redirect_uri"})

        def back(**params):
            params["iss"] = self.issuer()
            if "state" in q:
                params["state"] = q["state"]
            sep = "&" if "?" in redirect_uri else "?"
            self.redirect(redirect_uri + sep + urllib.parse.urlencode(params))

        if q.get("response_type") != "code":
            self.record(302, q, "unsupported_response_type")
            return back(error="unsupported_response_type")
        if q.get("code_challenge_method") != "S256" or not q.get("code_challenge"):
            self.record(302, q, "PKCE S256 is required")
            return back(error="invalid_request", error_description="PKCE with S256 is required")
        scope = q.get("scope", "")
        if not set(scope.split()) <= set(SCOPES):
            self.record(302, q, "invalid_scope")
            return back(error="invalid_scope")
        if deny:
            self.record(302, q, "access_denied")
            return back(error="access_denied", error_description="the person refused")
        code = secrets.token_urlsafe(24)
        with self.st.lock:
            self.st.codes[code] = {"client_id": client_id, "redirect_uri": redirect_uri,
                                   "challenge": q["code_challenge"], "scope": scope,
                                   "resource": q.get("resource")}
        self.record(302, q)
        back(code=code)

    # ------------------------------------------------------------ POST

    def do_POST(self):
        path = urllib.parse.urlsplit(self.path).path
        raw = self.body()
        if path == "/_config":
            conf = json.loads(raw or b"{}")
            with self.st.lock:
                if "ttl" in conf:
                    self.st.ttl = int(conf["ttl"])
                if "deny" in conf:
                    self.st.deny = bool(conf["deny"])
                for cid, c in (conf.get("clients") or {}).items():
                    self.st.clients[cid] = {"secret": c.get("secret"),
                                            "redirect_uris": c.get("redirect_uris", []),
                                            "method": c.get("method", "client_secret_basic")}
            return self.send(200, {"ok": True})
        if path == "/_expire":
            with self.st.lock:
                for t in self.st.access.values():
                    t["exp"] = 0
            return self.send(200, {"ok": True})
        if path == "/_revoke":
            with self.st.lock:
                self.st.access.clear()
                self.st.refresh.clear()
            return self.send(200, {"ok": True})
        if path == "/register":
            return self.register(raw)
        form = dict(urllib.parse.parse_qsl(raw.decode("utf-8", "replace")))
        if path == "/introspect":
            return self.introspect(form)
        if path == "/token":
            shown = {k: ("***" if k in ("client_secret", "code_verifier") else v) for k, v in form.items()}
            try:
                answer = self.token(form)
            except OAuthError as e:
                self.record(e.status, shown, e.error)
                return self.send(e.status, {"error": e.error, "error_description": e.description},
                                 {"WWW-Authenticate": "Basic"} if e.status == 401 else None)
            self.record(200, shown)
            return self.send(200, answer)
        self.send(404, {"error": "not found"})

    def register(self, raw):
        try:
            req = json.loads(raw or b"{}")
            uris = req.get("redirect_uris", [])
            assert isinstance(uris, list) and all(isinstance(u, str) for u in uris)
        except Exception:
            self.record(400, None, "invalid_client_metadata")
            return self.send(400, {"error": "invalid_client_metadata"})
        method = req.get("token_endpoint_auth_method", "client_secret_basic")
        if method not in ("client_secret_basic", "client_secret_post", "none"):
            self.record(400, req, "invalid_client_metadata")
            return self.send(400, {"error": "invalid_client_metadata",
                                   "error_description": f"unsupported auth method {method}"})
        cid = "c-" + secrets.token_hex(8)
        secret = None if method == "none" else secrets.token_urlsafe(24)
        with self.st.lock:
            self.st.clients[cid] = {"secret": secret, "redirect_uris": uris, "method": method}
        out = dict(req, client_id=cid, token_endpoint_auth_method=method,
                   client_id_issued_at=int(time.time()))
        if secret:
            out["client_secret"] = secret
            out["client_secret_expires_at"] = 0
        self.record(201, req)
        self.send(201, out)

    def client_of(self, form):
        """The authenticated client's id, by the method it registered."""
        basic = self.headers.get("Authorization") or ""
        if basic.startswith("Basic "):
            try:
                cid, _, secret = base64.b64decode(basic[6:]).decode().partition(":")
                cid, secret = urllib.parse.unquote(cid), urllib.parse.unquote(secret)
            except Exception:
                raise OAuthError("invalid_client", "bad Basic credentials", 401)
            how = "client_secret_basic"
        elif "client_secret" in form:
            cid, secret, how = form.get("client_id", ""), form["client_secret"], "client_secret_post"
        else:
            cid, secret, how = form.get("client_id", ""), None, "none"
        with self.st.lock:
            client = self.st.clients.get(cid)
        if client is None:
            if how == "none" and cid.startswith("https://"):
                return cid, "none"          # a client-ID metadata document
            raise OAuthError("invalid_client", "unknown client", 401)
        if client["method"] != how:
            raise OAuthError("invalid_client", f"the client authenticates with {client['method']}, not {how}",
                             401)
        if how != "none" and secret != client["secret"]:
            raise OAuthError("invalid_client", "wrong client secret", 401)
        return cid, how

    def issue(self, cid, scope, resource, refresh=True):
        access = secrets.token_urlsafe(32)
        with self.st.lock:
            ttl = self.st.ttl
            self.st.access[access] = {"client_id": cid, "scope": scope, "resource": resource,
                                      "exp": time.time() + ttl}
            out = {"access_token": access, "token_type": "Bearer", "expires_in": ttl, "scope": scope}
            if refresh:
                r = secrets.token_urlsafe(32)
                self.st.refresh[r] = {"client_id": cid, "scope": scope, "resource": resource}
                out["refresh_token"] = r
        return out

    def token(self, form):
        grant = form.get("grant_type")
        if grant not in ("authorization_code", "refresh_token", "client_credentials"):
            raise OAuthError("unsupported_grant_type", f"grant_type {grant!r}")
        cid, how = self.client_of(form)
        if grant == "authorization_code":
            with self.st.lock:
                code = self.st.codes.pop(form.get("code", ""), None)
            if code is None or code["client_id"] != cid:
                raise OAuthError("invalid_grant", "unknown or used code")
            if form.get("redirect_uri") != code["redirect_uri"]:
                raise OAuthError("invalid_grant", "redirect_uri differs from the authorization's")
            verifier = form.get("code_verifier", "")
            challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
            if challenge != code["challenge"]:
                raise OAuthError("invalid_grant", "PKCE verification failed")
            if form.get("resource") != code["resource"]:
                raise OAuthError("invalid_grant", "resource differs from the authorization's")
            return self.issue(cid, code["scope"], code["resource"])
        if grant == "refresh_token":
            with self.st.lock:
                old = self.st.refresh.pop(form.get("refresh_token", ""), None)
            if old is None or old["client_id"] != cid:
                raise OAuthError("invalid_grant", "unknown, used or revoked refresh token")
            scope = form.get("scope", old["scope"])
            if not set(scope.split()) <= set(old["scope"].split()):
                raise OAuthError("invalid_scope", "more scope than granted")
            resource = form.get("resource", old["resource"])
            if resource != old["resource"]:
                raise OAuthError("invalid_grant", "resource differs from the grant's")
            return self.issue(cid, scope, resource)
        if how == "none":
            raise OAuthError("unauthorized_client", "client_credentials needs a confidential client")
        scope = form.get("scope", "")
        if not set(scope.split()) <= set(SCOPES):
            raise OAuthError("invalid_scope", f"unknown scope in {scope!r}")
        return self.issue(cid, scope, form.get("resource"), refresh=False)

    def introspect(self, form):
        with self.st.lock:
            t = self.st.access.get(form.get("token", ""))
            t = dict(t) if t else None
        if t is None or t["exp"] <= time.time():
            return self.send(200, {"active": False})
        self.send(200, {"active": True, "scope": t["scope"], "aud": t["resource"],
                        "client_id": t["client_id"], "exp": int(t["exp"]), "token_type": "Bearer"})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024     # hundreds of calls connect at once


def main():
    ap = argparse.ArgumentParser(description="scripted OAuth 2.1 authorization server")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttl", type=int, default=3600)
    a = ap.parse_args()
    srv = Server(("127.0.0.1", a.port), Handler)
    srv.state = State(a.ttl)
    print(f"OAuth authorization server on 127.0.0.1:{srv.server_address[1]}", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
