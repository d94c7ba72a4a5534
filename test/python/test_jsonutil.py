"""Objects tuvl writes in jsonb's format are PostgreSQL's own jsonb (issue 43).

src/support/jsonutil.c's JsonObjBuilder writes an object's bytes directly
(keys ordered as jsonb orders them, a key added twice keeps its last value,
JEntries with an end offset every JB_OFFSET_STRIDE = 32, numerics and
containers 4-byte aligned) instead of going through pushJsonbValue.  A
mistake there would not show in the JSON text alone: a key out of order is
not found by ->, a wrong length or padding reads the wrong bytes.  So these
tests take objects the builder wrote from what a server sent (an HTTP
response's headers: keys chosen by the server, more than 32 of them, one
repeated, long values; the result around them with numbers and the body's
nested containers) and check that each is what PostgreSQL builds from the
same JSON: equal as jsonb, the same text, the same size in bytes, and every
key found by -> and ?.  The run belongs to an ordinary role (tuvl_user
only), as a run fed by a hostile server would.
"""
import json

import pytest

from conftest import connect, q, q1
from hostile import HostileServer, response

ROLE = "jsonutil_user"
MODES = ["worker", "sync"]

APICALL = """
name: jsonutil_api
steps:
  - id: call
    kind: APICall
    http: { url: "{{ url }}", retry: { attempts: 1 } }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}" } }
"""

# Header names of every length from 2 to 42, sent in no order of jsonb's,
# one name sent twice (the object keeps the last value) and one in another
# case; values from empty to several kB, some UTF-8.
NAME = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGH"
HEADERS = [("X-" + NAME[:(i * 17) % 41], "v%d" % i * (i % 5)) for i in range(41)]
HEADERS += [("X-Dup", "first"), ("X-Long", "\u00e9t\u00e9 " * 1000 + "end"), ("X-Empty", ""),
            ("X-Dup", "last"), ("x-abc", "lower case, the last of a repeated name")]

BODY = {"n": 1.5, "big": 123456789012345678901234567890, "neg": -7, "zero": 0,
        "nested": {"a": [1, {"b": None, "c": [True, False, "s"]}], "e": {}},
        "empty": {}, "arr": [], "long": "x" * 3000, "t": True,
        **{"k%02d" % i: i * 1.25 for i in range(40)}}

# Every object o, at any depth (strict: arrays are not unwrapped), of the
# jsonb values a query returns, each a copy of the stored bytes, and c, the
# jsonb PostgreSQL builds from o's text.  Both come out of a set-returning
# function, so pg_column_size treats them alike (a short varlena header
# below 127 bytes).
OBJECTS = """
    SELECT o, c FROM ({source}) AS src(v),
           pg_catalog.jsonb_path_query(src.v, 'strict $.**') AS o,
           pg_catalog.jsonb_path_query((o::text)::jsonb, '$') AS c
     WHERE pg_catalog.jsonb_typeof(o) = 'object'
"""

def expected_headers():
    """What the journal must hold: names lower-cased, the last value of a name."""
    out = {"content-type": "application/json", "content-length": str(len(json.dumps(BODY).encode()))}
    for name, value in HEADERS:
        out[name.lower()] = value
    return out


@pytest.fixture(scope="module")
def role(db):
    admin = connect("postgres")
    q(admin, f"DROP ROLE IF EXISTS {ROLE}")
    q(admin, f"CREATE ROLE {ROLE} LOGIN IN ROLE tuvl_user")
    yield ROLE
    try:
        c = connect(db)
        q(c, f"DROP OWNED BY {ROLE}")
        c.close()
    except Exception:
        pass
    q(admin, f"DROP ROLE IF EXISTS {ROLE}")
    admin.close()


@pytest.fixture(scope="module")
def server():
    s = HostileServer({"/h": response(200, json.dumps(BODY).encode(), headers=HEADERS)})
    yield s
    s.close()


def run(conn, mode, url):
    if mode == "sync":
        return q1(conn, "SELECT tuvl.run('jsonutil_api', %s::jsonb)", (json.dumps({"url": url}),))["run_id"]
    run_id = q1(conn, "SELECT tuvl.start_run('jsonutil_api', %s::jsonb)", (json.dumps({"url": url}),))
    q1(conn, "SELECT tuvl.wait(%s, interval '30 seconds')", (run_id,))
    return run_id


def assert_canonical(conn, source, params):
    """Every object in the jsonb values the query source returns, as stored, is
    what PostgreSQL builds from its text; returns (text, keys) of each."""
    rows = q(conn, f"""
        SELECT o::text,
               o OPERATOR(pg_catalog.=) c,
               o::text = c::text,
               pg_catalog.pg_column_size(o) = pg_catalog.pg_column_size(c),
               (SELECT pg_catalog.count(*) FROM pg_catalog.jsonb_object_keys(o)),
               (SELECT pg_catalog.bool_and(o -> k IS NOT NULL AND o ? k
                                           AND (o -> k) OPERATOR(pg_catalog.=) (c -> k))
                  FROM pg_catalog.jsonb_object_keys(o) AS k)
          FROM ({OBJECTS.format(source=source)}) AS s""", params)
    assert rows
    for text, equal, same_text, same_size, _keys, found in rows:
        assert equal and same_text and same_size, text[:500]
        assert found is None or found, text[:500]
    return [(r[0], r[4]) for r in rows]


@pytest.mark.parametrize("mode", MODES)
def test_an_http_result_with_many_repeated_keys_is_postgres_jsonb(db, role, server, mode):
    admin = connect(db)
    q(admin, "SELECT tuvl.register_workflow(%s)", (APICALL,))
    conn = connect(db, user=role)
    try:
        run_id = run(conn, mode, server.base + "/h")
        status, end = q(conn, "SELECT status, end_name FROM tuvl.runs WHERE id = %s", (run_id,))[0]
        assert (status, end) == ("completed", "done")
        # the payload as stored, compared in SQL (never through Python's json)
        result = "(SELECT payload -> 'result' FROM tuvl.events WHERE run_id = %s AND type = 'tool_result')"
        headers = expected_headers()
        assert len(headers) > 32
        row = q(conn, f"""
            SELECT r -> 'headers' OPERATOR(pg_catalog.=) %s::jsonb,
                   (r -> 'headers')::text = (%s::jsonb)::text,
                   pg_catalog.pg_column_size(r -> 'headers') = pg_catalog.pg_column_size(%s::jsonb),
                   r -> 'headers' ->> 'x-dup', r -> 'headers' ->> 'x-abc',
                   r -> 'body' OPERATOR(pg_catalog.=) %s::jsonb,
                   r ->> 'status',
                   r OPERATOR(pg_catalog.=) pg_catalog.jsonb_build_object(
                       'status', r -> 'status', 'headers', %s::jsonb, 'body', %s::jsonb,
                       'latency_ms', r -> 'latency_ms'),
                   pg_catalog.pg_column_size(r) = pg_catalog.pg_column_size(pg_catalog.jsonb_build_object(
                       'latency_ms', r -> 'latency_ms', 'body', %s::jsonb, 'headers', %s::jsonb,
                       'status', r -> 'status'))
              FROM {result} AS x(r)""",
                (json.dumps(headers),) * 3 + (json.dumps(BODY), json.dumps(headers), json.dumps(BODY),
                                              json.dumps(BODY), json.dumps(headers), run_id))[0]
        assert row == (True, True, True, "last", "lower case, the last of a repeated name",
                       True, "200", True, True), row
        # every object of every event of the run, at any depth, and the run's response
        objects = assert_canonical(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s", (run_id,))
        assert max(keys for _text, keys in objects) > 32
        objects = assert_canonical(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,))
        assert max(keys for _text, keys in objects) > 32
    finally:
        conn.close()
        admin.close()

