"""HTTP effects: the APICall step against the scriptable test server.

Every behaviour is checked through both surfaces that perform effects: the
synchronous tuvl.run() (the request is made inside the calling backend) and
the background workers (tuvl.start_run + tuvl.wait, the request is one of
many on a worker's libcurl multi handle).  What the server received is read
back from its request log (GET /_log); what tuvl kept is read from
tuvl.events and tuvl.runs.  The module ends with the load and crash tests:
hundreds of requests in flight at once, and kill -9 of a worker while a
hundred requests are in flight (only requests without a journaled result
are sent again, with the same Idempotency-Key).
"""
import json
import os
import signal
import time
import urllib.parse

import psycopg2
import psycopg2.errors
import pytest

from conftest import (SERVER_LOG, connect, journal_violations, q, q1, register_workflows, wait_for_server,
                      wait_until, worker_pids)
from httputil import (HTTP_BASE, HTTP_PORT, clear_server_log, closed_port, event_gap, execute,
                      payloads, query_of, recording_server, requests_with, http_log,
                      unique)

try:
    from conftest import report
except ImportError:  # an older conftest
    def report(message):
        print("\n" + message.strip())

pytestmark = pytest.mark.skipif(not HTTP_PORT, reason="TUVL_HTTP_PORT is not set (run through test/run)")

OUTSIDER = "tuvl_http_outsider"


def api_workflow(name, http):
    """One APICall step `call` (output `res`) with the http block given as a YAML flow
    mapping; end `done` answers the output, end `oops` the error and its type."""
    return """
name: %s
steps:
  - id: call
    kind: APICall
    http: %s
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}", type: "{{ _last_error_type }}" } }
""" % (name, http)


WORKFLOWS = [
    api_workflow("http_plain", '{ url: "{{ url }}", idempotency: auto }'),
    api_workflow("http_retry5xx", '{ url: "{{ url }}", idempotency: auto, '
                                  'retry: { on: [5xx], attempts: 3, backoff: 100ms } }'),
    api_workflow("http_retry_any", '{ url: "{{ url }}", idempotency: auto, retry: '
                                   '{ on: [timeout, error, 429, 5xx], attempts: 3, backoff: 100ms } }'),
    api_workflow("http_retry_error", '{ url: "{{ url }}", idempotency: auto, '
                                     'retry: { on: [error], attempts: 3, backoff: 100ms } }'),
    api_workflow("http_timeout", '{ url: "{{ url }}", timeout: 1s }'),
    api_workflow("http_slow", '{ url: "%s/slow", query: { ms: "{{ ms }}", k: "{{ k }}" }, '
                              'idempotency: auto, timeout: 30s }' % HTTP_BASE),
    api_workflow("http_secret_query", '{ url: "%s/json", query: { t: "{{ t }}", '
                                      'key: "{{ secrets.query_key }}" } }' % HTTP_BASE),
    api_workflow("http_header", '{ url: "%s/json?t={{ t }}", headers: { X-Note: "{{ note }}" } }'
                 % HTTP_BASE),
    """
name: http_secret
steps:
  - id: pay
    kind: APICall
    http:
      url: "%(base)s/json"
      query: { t: "{{ t }}", key: "{{ secrets.payment_api }}" }
      headers: { Authorization: "Bearer {{ secrets.payment_api }}", X-Tok: "{{ t }}" }
      body: { token: "{{ secrets.payment_api }}", t: "{{ t }}" }
      idempotency: auto
    output: paid
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ paid }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}" } }
""" % {"base": HTTP_BASE},
    """
name: http_templates
steps:
  - id: get
    kind: APICall
    http:
      url: "%(base)s/json?fixed=1&t={{ t }}"
      query: { a: "{{ a }}", n: "{{ n }}", sp: "two words & more", gone: null }
      headers: { X-Order: "order-{{ n }}", X-Tok: "{{ t }}" }
  - id: post
    kind: APICall
    http:
      url: "%(base)s/json?t={{ t }}&s=post"
      body: { order: "{{ n }}", note: "n={{ n }}", items: "{{ items }}", nested: { a: "{{ a }}" } }
  - id: put
    kind: APICall
    http:
      method: put
      url: "%(base)s/json?t={{ t }}&s=put"
      body: "hello {{ a }}"
  - id: form
    kind: APICall
    http:
      method: PATCH
      url: "%(base)s/json?t={{ t }}&s=form"
      headers: { Content-Type: application/x-www-form-urlencoded }
      body: "a={{ a }}"
    routes: { default: done }
ends:
  - id: done
    status: completed
    response: { get: "{{ get_result.body }}", post: "{{ post_result.body }}",
                put: "{{ put_result.body }}", form: "{{ form_result.body }}" }
""" % {"base": HTTP_BASE},
    """
name: http_reuse
steps:
  - id: patch
    kind: APICall
    http:
      method: PATCH
      url: "%(base)s/json?t={{ t }}&s=patch"
      headers: { Content-Type: application/x-www-form-urlencoded, X-Only-Patch: "{{ t }}" }
      body: "secretless=1"
      timeout: 7s
  - id: get
    kind: APICall
    http:
      url: "%(base)s/json?t={{ t }}&s=get"
  - id: head
    kind: APICall
    http:
      method: HEAD
      url: "%(base)s/json?t={{ t }}&s=head"
    routes: { default: done }
ends:
  - id: done
    status: completed
""" % {"base": HTTP_BASE},
]


@pytest.fixture(scope="module")
def wf(db):
    return register_workflows(db, *WORKFLOWS)


@pytest.fixture(params=["sync", "worker"])
def mode(request):
    return request.param


@pytest.fixture
def conn(wf, conns):
    return conns(wf)


@pytest.fixture(scope="module")
def outsider(wf):
    """A plain role (no superuser, no grants) that can connect to the module's database."""
    admin = connect("postgres")
    q(admin, f"DROP ROLE IF EXISTS {OUTSIDER}")
    q(admin, f"CREATE ROLE {OUTSIDER} LOGIN IN ROLE tuvl_user")
    yield OUTSIDER
    # its runs and workflows reference it by name only; the database goes at module end
    try:
        q(admin, f"DROP OWNED BY {OUTSIDER}")
        q(admin, f"DROP ROLE IF EXISTS {OUTSIDER}")
    except psycopg2.Error:
        pass
    admin.close()


def one(conn, run_id, event_type):
    got = payloads(conn, run_id, event_type)
    assert len(got) == 1, f"{event_type} events of run {run_id}: {got}"
    return got[0]


def error_of(res):
    assert res["status"] == "completed" and res["end"] == "oops", res
    return res["response"]["error"], res["response"]["type"]


# ---------------------------------------------------------------------------
# Success


def test_2xx_json_body_is_parsed_into_the_output_key(conn, mode):
    tok = unique()
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/json?t={tok}"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    out = res["response"]
    assert out["status"] == 200
    assert out["headers"]["content-type"] == "application/json"
    assert int(out["headers"]["content-length"]) > 0
    assert out["body"] == {"ok": True, "method": "GET", "query": {"t": tok}, "body": ""}
    assert q1(conn, "SELECT context -> 'res' FROM tuvl.runs WHERE id = %s", (res["run_id"],)) == out

    sent = requests_with(tok)
    assert len(sent) == 1
    call = one(conn, res["run_id"], "tool_call")
    assert call["request"]["method"] == "GET"
    assert call["request"]["url"] == f"{HTTP_BASE}/json?t={tok}"
    assert sent[0]["headers"]["idempotency-key"] == call["request"]["idempotency_key"]
    assert sent[0]["headers"]["user-agent"].startswith("tuvl/")
    result = one(conn, res["run_id"], "tool_result")["result"]
    assert result["status"] == 200 and result["body"] == out["body"]
    assert journal_violations(conn, [res["run_id"]]) == []


def test_2xx_text_body_is_a_string(conn, mode):
    tok = unique()
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/text?t={tok}"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["response"]["status"] == 200
    assert res["response"]["body"] == "plain text answer"
    assert res["response"]["headers"]["content-type"] == "text/plain"
    assert len(requests_with(tok)) == 1


def test_redirect_within_the_allow_list_is_followed(conn, mode):
    tok = unique()
    target = urllib.parse.quote(f"/json?t={tok}", safe="")
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/redirect?to={target}"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["response"]["body"]["query"] == {"t": tok}
    assert [r["path"] for r in requests_with(tok)] == [f"/redirect?to={target}", f"/json?t={tok}"]


# ---------------------------------------------------------------------------
# Failures and retries


def test_4xx_takes_the_error_route_and_is_never_retried(conn, mode):
    tok = unique()
    res = execute(conn, "http_retry_any", {"url": f"{HTTP_BASE}/status/404?t={tok}"}, mode)
    error, kind = error_of(res)
    assert "returned HTTP 404" in error and f"/status/404?t={tok}" in error
    assert kind == "http_4xx"
    assert len(requests_with(tok)) == 1, "a 4xx must not be retried"
    assert len(payloads(conn, res["run_id"], "tool_call")) == 1
    assert one(conn, res["run_id"], "tool_result")["result"]["status"] == 404


def test_5xx_is_retried_with_one_idempotency_key_until_it_succeeds(conn, mode):
    key = unique("flaky")
    res = execute(conn, "http_retry5xx", {"url": f"{HTTP_BASE}/flaky/{key}?fail=2"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["response"]["body"] == {"attempt": 3, "ok": True}

    sent = requests_with(key)
    assert len(sent) == 3
    keys = {r["headers"].get("idempotency-key") for r in sent}
    assert len(keys) == 1 and None not in keys, keys
    # backoff 100ms, doubling: the retries were not sent back to back
    assert sent[1]["t"] - sent[0]["t"] >= 0.09 and sent[2]["t"] - sent[1]["t"] >= 0.18

    calls = payloads(conn, res["run_id"], "tool_call")
    results = payloads(conn, res["run_id"], "tool_result")
    assert [c["position"] for c in calls] == [0, 1, 2]
    assert [r["position"] for r in results] == [0, 1, 2]
    assert {c["request"]["idempotency_key"] for c in calls} == keys
    assert [r["result"]["status"] for r in results] == [500, 500, 200]
    assert "delay_ms" not in calls[0] and all(c["delay_ms"] >= 100 for c in calls[1:])
    assert journal_violations(conn, [res["run_id"]]) == []


def test_idempotency_keys_of_different_requests_differ_across_databases(fresh_databases):
    tok = unique()
    for i in (1, 2):
        name = fresh_databases(f"tuvl_http_idem{i}")
        c = connect(name)
        try:
            q(c, "CREATE EXTENSION tuvl")
            q(c, "SELECT tuvl.register_workflow(%s)", (api_workflow(
                "refund", '{ url: "%s/json?t=%s", body: { order: "{{ order }}" }, idempotency: auto }'
                % (HTTP_BASE, tok)),))
            res = execute(c, "refund", {"order": i}, "sync")
            assert res["end"] == "done", res
        finally:
            c.close()
    sent = requests_with(tok)
    assert [json.loads(r["body"])["order"] for r in sent] == [1, 2]
    keys = [r["headers"]["idempotency-key"] for r in sent]
    assert keys[0] != keys[1], f"two different refunds were both sent with Idempotency-Key {keys[0]}"


def test_5xx_gives_up_after_the_configured_attempts(conn, mode):
    key = unique("flaky")
    res = execute(conn, "http_retry5xx", {"url": f"{HTTP_BASE}/flaky/{key}?fail=5"}, mode)
    error, kind = error_of(res)
    assert "returned HTTP 500" in error and kind == "http_5xx"
    assert len(requests_with(key)) == 3
    assert len(payloads(conn, res["run_id"], "tool_call")) == 3
    assert len(payloads(conn, res["run_id"], "tool_result")) == 3
    done = one(conn, res["run_id"], "agent_completed")
    assert done["signal"] == "error" and "3 attempts" in done.get("detail", ""), done


def test_429_waits_for_retry_after(conn, mode):
    key = unique("rl")
    res = execute(conn, "http_retry_any",
                  {"url": f"{HTTP_BASE}/ratelimit/{key}?times=1&retry_after=1"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["response"]["body"] == {"attempt": 2, "ok": True}
    sent = requests_with(key)
    assert len(sent) == 2
    gap = sent[1]["t"] - sent[0]["t"]
    assert gap >= 0.95, f"the retry came {gap:.3f} s after a 429 with Retry-After: 1"
    assert gap < 3, f"the retry came {gap:.3f} s after a 429 with Retry-After: 1"
    assert sent[0]["headers"]["idempotency-key"] == sent[1]["headers"]["idempotency-key"]
    assert payloads(conn, res["run_id"], "tool_call")[1]["delay_ms"] == 1000


def test_response_slower_than_the_timeout_fails_after_the_timeout(conn, mode):
    tok = unique()
    res = execute(conn, "http_timeout", {"url": f"{HTTP_BASE}/slow?ms=3000&t={tok}"}, mode)
    error, kind = error_of(res)
    assert "timed out" in error and kind == "timeout"
    took = event_gap(conn, res["run_id"], "agent_started", "agent_completed")
    assert 0.9 <= took < 2.5, f"a step with timeout 1s against a 3 s response took {took:.2f} s"
    result = one(conn, res["run_id"], "tool_result")["result"]
    assert result["error_kind"] == "timeout" and result["status"] is None
    assert len(requests_with(tok)) == 1


@pytest.mark.parametrize("workflow,attempts", [("http_plain", 1), ("http_retry5xx", 1),
                                               ("http_retry_error", 3)])
def test_connection_refused_is_an_error_retried_only_on_error(conn, mode, workflow, attempts):
    url = f"http://127.0.0.1:{closed_port()}/json"
    res = execute(conn, workflow, {"url": url}, mode)
    error, kind = error_of(res)
    assert error.startswith(f"GET {url} failed: ") and kind == "http_error", error
    results = payloads(conn, res["run_id"], "tool_result")
    assert len(payloads(conn, res["run_id"], "tool_call")) == attempts
    assert [r["result"]["error_kind"] for r in results] == ["error"] * attempts
    assert all(r["result"]["status"] is None for r in results)


def test_body_over_the_size_cap_fails(conn, mode, set_gucs):
    if mode == "sync":
        # PGC_SUSET: a superuser may set it for the session
        q(conn, "SET tuvl.http_max_response_size = '1MB'")
    else:
        set_gucs({"tuvl.http_max_response_size": ("1MB", "1MB")})
        time.sleep(0.3)  # the workers reload at the top of their next round
    tok = unique()
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/big?bytes=2000000&t={tok}"}, mode)
    error, kind = error_of(res)
    assert "tuvl.http_max_response_size" in error, error
    assert one(conn, res["run_id"], "tool_result")["result"]["error_kind"] == "too_large"
    # just under the cap is fine
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/big?bytes=1000000&t={tok}"}, mode)
    assert res["end"] == "done" and len(res["response"]["body"]) == 1000000, res["end"]


def test_max_response_size_is_superuser_only(wf, outsider, conns):
    c = conns(wf, user=outsider)
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(c, "SET tuvl.http_max_response_size = '100MB'")


def test_malformed_json_fails(conn, mode):
    tok = unique()
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/malformed?t={tok}"}, mode)
    error, kind = error_of(res)
    assert "not valid JSON" in error, error
    result = one(conn, res["run_id"], "tool_result")["result"]
    assert result["status"] == 200 and result["body_error"] == "response body is not valid JSON"


def test_redirect_loop_fails(conn, mode):
    max_redirects = int(q1(conn, "SHOW tuvl.http_max_redirects"))
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/loop"}, mode)
    error, kind = error_of(res)
    assert "too many redirects" in error, error
    key = one(conn, res["run_id"], "tool_call")["request"]["idempotency_key"]
    loops = [r for r in http_log()["requests"] if r["headers"].get("idempotency-key") == key]
    assert [r["path"] for r in loops] == ["/loop"] * (1 + max_redirects)


@pytest.fixture
def elsewhere():
    """A recording server on 127.0.0.2, which tuvl.http_allowed_hosts does not list."""
    srv = recording_server("127.0.0.2")
    yield srv
    srv.close()


def test_redirect_outside_the_allow_list_is_refused(conn, mode, elsewhere):
    target = f"{elsewhere.base}/json"
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/redirect?to={target}"}, mode)
    error, kind = error_of(res)
    assert "redirect refused" in error and "tuvl.http_allowed_hosts" in error, error
    assert elsewhere.requests == []
    res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/redirect?to=file:///etc/passwd"}, mode)
    error, kind = error_of(res)
    assert "redirect refused" in error and "file" in error, error


def test_host_outside_the_allow_list_is_refused(conn, mode, elsewhere):
    tok = unique()
    res = execute(conn, "http_plain", {"url": f"{elsewhere.base}/json?t={tok}"}, mode)
    error, kind = error_of(res)
    assert "is not allowed" in error, error
    done = one(conn, res["run_id"], "agent_completed")
    assert "tuvl.http_allowed_hosts" in done["detail"] and "127.0.0.2" in done["detail"], done
    assert elsewhere.requests == [] and requests_with(tok) == []
    assert payloads(conn, res["run_id"], "tool_call") == []
    res = execute(conn, "http_plain", {"url": f"ftp://127.0.0.1:{HTTP_PORT}/json?t={tok}"}, mode)
    error, kind = error_of(res)
    assert "not allowed" in error and "ftp" in error, error
    assert requests_with(tok) == []


# ---------------------------------------------------------------------------
# Templates


def test_method_query_headers_and_body_arrive_as_rendered(conn, mode):
    tok = unique()
    data = {"t": tok, "a": "x y/ü", "n": 42, "items": [1, "two", {"three": 3}]}
    res = execute(conn, "http_templates", data, mode)
    assert res["status"] == "completed", res
    sent = {query_of(r).get("s", "get"): r for r in requests_with(tok)}
    assert sorted(sent) == ["form", "get", "post", "put"], [r["path"] for r in requests_with(tok)]

    get = sent["get"]
    assert get["method"] == "GET" and get["body"] == ""
    assert query_of(get) == {"fixed": "1", "t": tok, "a": "x y/ü", "n": "42", "sp": "two words & more"}
    assert get["path"].startswith(f"/json?fixed=1&t={tok}&a=")
    assert get["headers"]["x-order"] == "order-42" and get["headers"]["x-tok"] == tok
    assert "content-type" not in get["headers"]

    post = sent["post"]
    assert post["method"] == "POST"
    assert post["headers"]["content-type"] == "application/json"
    assert json.loads(post["body"]) == {"order": 42, "note": "n=42", "items": [1, "two", {"three": 3}],
                                        "nested": {"a": "x y/ü"}}

    put = sent["put"]
    assert put["method"] == "PUT" and put["body"] == "hello x y/ü"
    assert put["headers"]["content-type"] == "text/plain; charset=utf-8"

    form = sent["form"]
    assert form["method"] == "PATCH" and form["body"] == "a=x y/ü"
    assert form["headers"]["content-type"] == "application/x-www-form-urlencoded"

    # and the server's echo of each came back into the context
    out = res["response"]
    assert out["get"]["query"]["a"] == "x y/ü" and out["post"]["method"] == "POST"
    assert out["put"]["body"] == "hello x y/ü" and out["form"]["method"] == "PATCH"


def test_a_request_carries_nothing_of_the_one_before_it(conn, mode):
    # libcurl handles are reused, the last freed first: each GET and HEAD
    # below goes out on the handle of the PATCH before it
    tok = unique()
    for i in range(5):
        res = execute(conn, "http_reuse", {"t": "%s-%d" % (tok, i)}, mode)
        assert res["status"] == "completed", res
    sent = requests_with(tok)
    assert sorted(query_of(r)["s"] for r in sent) == ["get"] * 5 + ["head"] * 5 + ["patch"] * 5, sent
    for r in sent:
        s = query_of(r)["s"]
        assert r["method"] == s.upper(), r
        if s == "patch":
            assert r["body"] == "secretless=1" and r["headers"]["x-only-patch"] == query_of(r)["t"], r
            continue
        assert r["body"] == "", r
        assert "x-only-patch" not in r["headers"] and "content-type" not in r["headers"], r
        assert "content-length" not in r["headers"] or r["headers"]["content-length"] == "0", r


def test_a_header_value_cannot_inject_headers(conn, mode):
    tok = unique()
    res = execute(conn, "http_header", {"t": tok, "note": "harmless\r\nX-Injected: yes"}, mode)
    sent = requests_with(tok)
    # Either the step refuses the value, or the server sees one header with it.
    assert res["end"] == "oops" or (len(sent) == 1 and "x-injected" not in sent[0]["headers"]), \
        (res, sent)


# ---------------------------------------------------------------------------
# Secrets


def places_holding(conn, text):
    """Where text occurs in what tuvl stores: events, runs, workflows."""
    found = []
    for table in ("tuvl.events", "tuvl.runs", "tuvl.workflows"):
        n = q1(conn, f"SELECT count(*) FROM {table} t WHERE strpos(t::text, %s) > 0", (text,))
        if n:
            found.append(f"{table} ({n} rows)")
    return found


def server_log_text():
    with open(SERVER_LOG, encoding="utf-8", errors="replace") as f:
        return f.read()


def test_secrets_are_sent_but_never_stored(conn, mode):
    secret = "sk-live-" + unique("")
    q(conn, "SELECT tuvl.set_secret('payment_api', %s)", (secret,))
    tok = unique()
    res = execute(conn, "http_secret", {"t": tok}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res

    sent = requests_with(tok)
    assert len(sent) == 1
    assert sent[0]["headers"]["authorization"] == f"Bearer {secret}"
    assert json.loads(sent[0]["body"]) == {"token": secret, "t": tok}
    assert query_of(sent[0]) == {"t": tok, "key": secret}

    # the server echoed the body and the query: tuvl kept them redacted
    body = res["response"]["body"]
    assert json.loads(body["body"])["token"] != secret and "[redacted]" in body["body"]
    assert body["query"]["key"] == "[redacted]"
    assert secret not in json.dumps(res)
    assert places_holding(conn, secret) == []
    assert secret not in server_log_text()


def test_secrets_are_readable_and_settable_only_by_admins(wf, outsider, conns):
    admin = conns(wf)
    secret = "sk-live-" + unique("")
    q(admin, "SELECT tuvl.set_secret('payment_api', %s)", (secret,))
    c = conns(wf, user=outsider)
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(c, "SELECT * FROM tuvl.secrets")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(c, "SELECT value FROM tuvl.secrets WHERE name = 'payment_api'")
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(c, "SELECT tuvl.set_secret('payment_api', 'overwritten-by-outsider')")
    with pytest.raises(psycopg2.Error, match="secrets are not available"):
        q(c, """SELECT tuvl.render('"{{ secrets.payment_api }}"'::jsonb)""")
    assert q1(admin, "SELECT value FROM tuvl.secrets WHERE name = 'payment_api'") == secret


def test_a_secret_in_a_query_parameter_is_not_stored_percent_encoded(conn, mode):
    secret = "sk-live-" + unique("") + "/a+b="      # base64-like keys have / + =
    q(conn, "SELECT tuvl.set_secret('query_key', %s)", (secret,))
    tok = unique()
    res = execute(conn, "http_secret_query", {"t": tok}, mode)
    assert res["end"] == "done", res
    assert query_of(requests_with(tok)[0])["key"] == secret
    encoded = urllib.parse.quote(secret, safe="")
    assert places_holding(conn, secret) == []
    assert places_holding(conn, encoded) == []


def test_a_refused_url_does_not_reveal_a_secret(wf, outsider, conns, mode):
    admin = conns(wf)
    secret = "sk-live-" + unique("")
    q(admin, "SELECT tuvl.set_secret('payment_api', %s)", (secret,))
    q(admin, "SELECT tuvl.grant_secret('payment_api', %s)", (outsider,))
    c = conns(wf, user=outsider)
    name = "peek_" + mode
    q(c, "SELECT tuvl.register_workflow(%s)", (api_workflow(
        name, '{ url: "http://127.0.0.2:9/?k={{ secrets.payment_api }}" }'),))
    res = execute(c, name, {}, mode)
    error, kind = error_of(res)
    assert "tuvl.http_allowed_hosts" in error or "not allowed" in error, error
    assert secret not in json.dumps(res), "the outsider read the secret from its own run"
    assert places_holding(admin, secret) == []


# ---------------------------------------------------------------------------
# The synchronous path can be cancelled mid-request


def test_cancelling_a_synchronous_run_mid_request_leaves_the_session_usable(conn):
    tok = unique()
    q(conn, "SET statement_timeout = '300ms'")
    started = time.monotonic()
    with pytest.raises(psycopg2.errors.QueryCanceled):
        q(conn, "SELECT tuvl.run('http_plain', %s::jsonb)",
          (json.dumps({"url": f"{HTTP_BASE}/slow?ms=2000&t={tok}"}),))
    assert time.monotonic() - started < 1.5
    q(conn, "RESET statement_timeout")
    # the engine is in a clean state: further requests work, one after the other and quickly
    for i in range(3):
        res = execute(conn, "http_plain", {"url": f"{HTTP_BASE}/json?t={tok}&i={i}"}, "sync")
        assert res["end"] == "done", res
    assert len(requests_with(tok)) == 4


# ---------------------------------------------------------------------------
# Many in flight; kill -9 with requests in flight


N_MANY = 300


def test_hundreds_of_requests_are_in_flight_at_once(conn):
    runs_per_worker = int(q1(conn, "SHOW tuvl.runs_per_worker"))
    assert runs_per_worker * len(worker_pids(conn.info.dbname)) >= N_MANY
    # Earlier tests leave slow requests behind, which the server still counts as
    # in flight: let them end, and discount any that remain from the peak.
    try:
        wait_until(lambda: clear_server_log() == 0, 5, interval=0.2)
    except AssertionError:
        pass
    others = clear_server_log()
    tok = unique("many")
    started = time.monotonic()
    ids = [r[0] for r in q(conn, "SELECT tuvl.start_run('http_slow', jsonb_build_object('ms', 500, "
                                 "'k', %s || '-' || g)) FROM generate_series(1, %s) g",
                           (tok, N_MANY))]
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                "AND finished_at IS NULL", (ids,)) == 0,
               60, interval=0.1, message=f"{N_MANY} runs of 0.5 s requests to finish")
    took = time.monotonic() - started
    peak = http_log()["peak"] - others
    report(f"{N_MANY} runs of one 500 ms request each: done in {took:.2f} s, "
           f"peak {peak} requests in flight at the server")
    assert q(conn, "SELECT status, end_name, count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                   "GROUP BY 1, 2", (ids,)) == [("completed", "done", N_MANY)]
    assert len(requests_with(tok)) == N_MANY
    assert peak >= N_MANY // 2, f"only {peak} of {N_MANY} requests were in flight at once"
    assert took < 20


N_CRASH = 100


def test_crash_kill_9_sends_again_only_requests_without_a_journaled_result(wf, server_log):
    db = wf
    conn = connect(db)
    tok = unique("crash")
    # Spread answers over 1.5 .. 3 s so that at the kill some results are journaled
    # and most requests are still in flight.
    ids = {}
    for run_id, k in q(conn, "SELECT tuvl.start_run('http_slow', jsonb_build_object("
                             "'ms', 1500 + 15 * g, 'k', %s || '-' || g)), %s || '-' || g "
                             "FROM generate_series(1, %s) g", (tok, tok, N_CRASH)):
        ids[k] = run_id
    id_list = list(ids.values())
    wait_until(lambda: len(requests_with(tok)) >= N_CRASH * 9 // 10, 20, interval=0.05,
               message="most requests to be in flight")
    wait_until(lambda: q1(conn, "SELECT count(DISTINCT run_id) FROM tuvl.events WHERE run_id = ANY(%s) "
                                "AND type = 'tool_result'", (id_list,)) >= 15, 20, interval=0.02,
               message="the first results to be journaled")
    in_flight_before = len(requests_with(tok))
    conn.close()

    victim = worker_pids(db)[0]
    mark = server_log.mark()
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    server_log.wait_for(mark, r"all server processes terminated; reinitializing", 30)
    wait_for_server()
    conn = connect(db)
    try:
        wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                    "AND finished_at IS NULL", (id_list,)) == 0,
                   45, interval=0.1, message="every run to finish after the crash")
        done_after = time.time() - killed_at
        assert q(conn, "SELECT status, end_name, count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                       "GROUP BY 1, 2", (id_list,)) == [("completed", "done", N_CRASH)]
        assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND "
                        "response -> 'body' -> 'slept_ms' IS DISTINCT FROM input -> 'ms'",
                  (id_list,)) == 0
        assert journal_violations(conn, id_list) == []

        # results committed before the kill: every event that survived it and is
        # older than the kill was committed before it
        before = {r[0] for r in q(conn, "SELECT DISTINCT run_id FROM tuvl.events WHERE run_id = ANY(%s) "
                                        "AND type = 'tool_result' AND ts < to_timestamp(%s)",
                                  (id_list, killed_at))}
        keys_of_run = {}
        for run_id, key in q(conn, "SELECT run_id, payload -> 'request' ->> 'idempotency_key' "
                                   "FROM tuvl.events WHERE run_id = ANY(%s) AND type = 'tool_call'",
                             (id_list,)):
            keys_of_run.setdefault(run_id, set()).add(key)
        sent = {}
        for r in requests_with(tok):
            sent.setdefault(query_of(r)["k"], []).append(r["headers"].get("idempotency-key"))

        resent = [k for k in ids if len(sent.get(k, [])) == 2]
        report(f"kill -9 with {in_flight_before} requests sent and {len(before)} results journaled: "
               f"{len(resent)} requests sent again, all {N_CRASH} runs done {done_after:.1f} s "
               f"after the kill")
        assert 0 < len(before) < N_CRASH, \
            "the kill must fall between journaled results and requests in flight"
        for k, run_id in ids.items():
            got = sent.get(k, [])
            assert len(keys_of_run[run_id]) == 1, (k, keys_of_run[run_id])
            if run_id in before:
                assert len(got) == 1, f"{k}: its result was journaled, yet it was sent {len(got)} times"
            else:
                assert 1 <= len(got) <= 2, f"{k} was sent {len(got)} times"
            assert set(got) == keys_of_run[run_id], (k, got, keys_of_run[run_id])
        assert resent, "some requests in flight at the kill must have been sent again"
        want = int(q1(conn, "SHOW tuvl.workers_per_database"))
        wait_until(lambda: len(worker_pids(db)) == want, 10, message="the worker pool after the restart")
    finally:
        conn.close()
