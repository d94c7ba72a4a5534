"""Errors that say what to do (issue 44).

A missing secret reads as missing to those who may know (superusers,
tuvl_admin) and as before to anyone else; an empty secret is refused;
misspelt step kinds, keys, routes, workflows, model configs and guardrail
checks get "did you mean"; templates naming keys trigger.input does not
have are warnings of tuvl.validate; an out-of-range cron field is an error
naming the field; a failed step keeps its error's detail and hint in the
journal and in tuvl.runs.error; tuvl.schedules shows a pg_cron job's last
run, failures included.
"""
import json
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, wait_until

USER = "tuvl_e44_user"
NOBODY = "tuvl_e44_nobody"


def new_name(prefix="e"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def roles(db):
    admin = connect("postgres")
    for role in (USER, NOBODY):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    q(admin, f"CREATE ROLE {USER} LOGIN IN ROLE tuvl_user")
    q(admin, f"CREATE ROLE {NOBODY} LOGIN")
    yield db
    conn = connect(db)
    for role in (USER, NOBODY):
        q(conn, f"DROP OWNED BY {role}")
    conn.close()
    for role in (USER, NOBODY):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


def error_of(conn, sql, params=None):
    with pytest.raises(psycopg2.Error) as e:
        q(conn, sql, params)
    return e.value


def secret_workflow(name, secret):
    return f"""
name: {name}
steps:
  - id: call
    kind: APICall
    http: {{ url: "http://127.0.0.1:9/x", headers: {{ X-Key: "{{{{ secrets.{secret} }}}}" }} }}
"""


def test_a_missing_secret_says_so_to_a_superuser_and_names_set_secret(db):
    conn = connect(db)
    name = new_name()
    q(conn, "SELECT tuvl.register_workflow(%s)", (secret_workflow(name, "nope_e44"),))
    out = q1(conn, "SELECT tuvl.run(%s)", (name,))
    error = q1(conn, "SELECT error FROM tuvl.runs WHERE id = %s", (out["run_id"],))
    assert 'secret "nope_e44" does not exist' in error, error
    assert "tuvl.set_secret('nope_e44'" in error, error
    assert "not available" not in error


def test_a_missing_secret_still_reads_as_unavailable_to_an_ordinary_role(roles):
    conn = connect(roles, user=USER)
    name = new_name()
    q(conn, "SELECT tuvl.register_workflow(%s)", (secret_workflow(name, "nope_e44"),))
    out = q1(conn, "SELECT tuvl.run(%s)", (name,))
    error = q1(conn, "SELECT error FROM tuvl.runs WHERE id = %s", (out["run_id"],))
    assert 'secret "nope_e44" is not available to role' in error, error
    assert "does not exist" not in error.splitlines()[0]


def test_an_empty_secret_is_refused(db):
    conn = connect(db)
    e = error_of(conn, "SELECT tuvl.set_secret('e44_empty', '')")
    assert e.pgcode == "22023"
    assert 'secret "e44_empty" must not be empty' in e.pgerror
    assert e.diag.message_hint and "tuvl.revoke_secret()" in e.diag.message_hint
    assert q1(conn, "SELECT count(*) FROM tuvl.secrets WHERE name = 'e44_empty'") == 0
    q(conn, "SELECT tuvl.set_secret('e44_full', 'v')")


def register_model(conn, name):
    """An LLM config of that name (its server is never asked)."""
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: m\n",))


def findings(conn, source):
    return q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (source,))


def test_did_you_mean_a_step_kind_a_key_and_a_route(roles):
    conn = connect(roles, user=USER)
    name = new_name()
    source = f"""
name: {name}
steps:
  - {{ id: load, kind: ModelOP, sql: "SELECT 1", routes: {{ default: chek }} }}
  - {{ id: check, kind: Router, on: "{{{{ load_result }}}}", routez: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
"""
    rows = findings(conn, source)
    messages = [m for _, _, m in rows]
    assert any('unknown step kind "ModelOP"; did you mean "ModelOp"?' in m for m in messages), rows
    assert any('route target "chek" is neither a step nor an end of this workflow; did you mean "check"?'
               in m for m in messages), rows
    assert any('unknown key "routez"; did you mean "routes"?' in m for m in messages), rows
    e = error_of(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    assert e.diag.message_hint.startswith('Did you mean "ModelOp"?'), e.diag.message_hint
    # nothing close: no suggestion
    rows = findings(conn, source.replace("ModelOP", "Zzzzzzz"))
    assert any('unknown step kind "Zzzzzzz"; use one of' in m for _, _, m in rows), rows
    assert not any("did you mean" in m for _, _, m in rows if "Zzzzzzz" in m)


def test_did_you_mean_a_workflow_and_a_model_config(roles):
    conn = connect(roles, user=USER)
    name = new_name("refund")
    q(conn, "SELECT tuvl.register_workflow(%s)",
      (f"name: {name}\nsteps:\n  - {{ id: r, kind: Router, on: x, routes: {{ default: done }} }}\n"
       "ends:\n  - { id: done, status: completed }\n",))
    e = error_of(conn, "SELECT tuvl.start_run(%s)", (name[:-1],))
    assert e.pgcode == "42704"
    assert e.diag.message_hint == f'Did you mean "{name}"?'
    e = error_of(conn, "SELECT tuvl.start_run('zzzzzzzzzzzzzzzzzzzzzz')")
    assert e.diag.message_hint == "Register it first with tuvl.register_workflow()."
    llm = new_name("model")
    register_model(conn, llm)
    source = f"""
name: {new_name()}
steps:
  - id: a
    kind: Agent
    mode: completion
    agent: {{ model: {llm}x, prompt: hi }}
"""
    rows = findings(conn, source)
    assert any(f'did you mean "{llm}"?' in m for _, _, m in rows), rows
    e = error_of(conn, "SELECT tuvl.register_llm(%s)",
                 (f"name: {new_name()}\nprovider: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: m\n"
                  "timout: 5s\n",))
    assert e.diag.message_hint == 'Did you mean "timeout"?'


def test_a_workflow_suggestion_names_only_what_the_caller_can_read(roles):
    # a role that may not read tuvl.workflows (no tuvl_user) is told nothing of its names
    admin = connect(roles)
    name = new_name("secretflow")
    q(admin, "SELECT tuvl.register_workflow(%s)",
      (f"name: {name}\nsteps:\n  - {{ id: r, kind: Router, on: x, routes: {{ default: done }} }}\n"
       "ends:\n  - { id: done, status: completed }\n",))
    q(admin, f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA tuvl TO {NOBODY}")
    try:
        conn = connect(roles, user=NOBODY)
        e = error_of(conn, "SELECT tuvl.start_run(%s)", (name[:-1],))
        assert name not in (e.diag.message_hint or ""), e.diag.message_hint
    finally:
        q(admin, f"REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA tuvl FROM {NOBODY}")


def test_did_you_mean_a_guardrail_check_key(roles):
    conn = connect(roles, user=USER)
    e = error_of(conn, "SELECT tuvl.register_artifact(%s)",
                 (f"name: {new_name()}\ntype: guardrail\nchecks:\n  - {{ chek: max_length, max: 10 }}\n",))
    assert e.diag.message_hint == 'Did you mean "check" instead of "chek"?', e.diag.message_hint
    e = error_of(conn, "SELECT tuvl.register_artifact(%s)",
                 (f"name: {new_name()}\ntype: guardrail\nchecks:\n  - {{ check: max_lenght, max: 10 }}\n",))
    assert e.diag.message_hint == 'Did you mean "max_length"?', e.diag.message_hint


def test_templates_reading_keys_the_input_has_not_are_warnings(roles):
    conn = connect(roles, user=USER)
    name = new_name()
    source = f"""
name: {name}
trigger:
  input: {{ type: object, properties: {{ order_id: {{ type: integer }} }} }}
steps:
  - {{ id: load, kind: ModelOp, sql: "SELECT $1::int AS id", params: ["{{{{ ordr_id }}}}"] }}
  - {{ id: route, kind: Router, on: "{{{{ load_result.0.id }}}} {{{{ order_id }}}} {{{{ _last_error }}}}",
      routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "{{{{ nowhere.x }}}}" }}
"""
    rows = findings(conn, source)
    assert any(r[:2] == ("warning", "steps[0]") and r[2].startswith(
        'template "{{ ordr_id }}" reads key "ordr_id", which is not a property of trigger.input and '
        'no step writes, so the step would fail with template_error; did you mean "order_id"?')
        for r in rows), rows
    assert any(p == "ends[0]" and '"nowhere"' in m for s, p, m in rows if s == "warning"), rows
    # keys of the input, step outputs and private keys are not reported
    assert len([r for r in rows if r[0] == "warning"]) == 2, rows
    # a warning does not stop registration
    q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    # without properties in the input schema nothing is reported
    plain = source.replace("trigger:\n  input: { type: object, properties: { order_id: { type: integer } } }\n", "")
    assert [r for r in findings(conn, plain) if r[0] == "warning"] == []


@pytest.mark.parametrize("schedule,field", [
    ("61 * * * *", 'the minute field "61" is out of range: 61 is not between 0 and 59'),
    ("0 24 * * *", 'the hour field "24" is out of range'),
    ("0 0 32 * *", 'the day of month field "32" is out of range'),
    ("0 0 * 13 *", 'the month field "13" is out of range'),
    ("0 0 * * 8", 'the day of week field "8" is out of range'),
    ("0 0 * * mon-zz", 'the day of week field "mon-zz" is not a number or name'),
    ("0 0 * *", "it has 4 fields, not five; schedule must be a cron expression of five fields"),
])
def test_an_out_of_range_cron_field_is_an_error_naming_the_field(roles, schedule, field):
    conn = connect(roles, user=USER)
    source = f"""
name: {new_name()}
trigger: {{ schedule: "{schedule}" }}
steps:
  - {{ id: r, kind: Router, on: x, routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
"""
    rows = findings(conn, source)
    assert any(s == "error" and p == "trigger.schedule" and m.startswith(field) for s, p, m in rows), rows
    e = error_of(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    assert field in e.diag.message_detail


def test_a_valid_schedule_still_validates(roles):
    conn = connect(roles, user=USER)
    for schedule in ("*/5 * * * *", "0 3 * * mon-fri", "15,45 8-18/2 1 jan-jun 7", "@hourly"):
        source = f"""
name: {new_name()}
trigger: {{ schedule: "{schedule}" }}
steps:
  - {{ id: r, kind: Router, on: x, routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
"""
        assert [r for r in findings(conn, source) if r[0] == "error"] == [], schedule


def test_a_failed_step_keeps_the_detail_and_hint_of_its_error(roles):
    conn = connect(roles, user=USER)
    name = new_name()
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - {{ id: call, kind: APICall, http: {{ url: "http://192.0.2.1:9/x" }} }}
""",))
    out = q1(conn, "SELECT tuvl.run(%s)", (name,))
    run_id = out["run_id"]
    payload = q1(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'agent_completed'",
                 (run_id,))
    assert payload["error"] == "HTTP request to http://192.0.2.1:9/x is not allowed", payload
    assert payload["detail"] == 'host "192.0.2.1" port 9 is not in tuvl.http_allowed_hosts.', payload
    assert payload["hint"].startswith("A superuser can add the host to tuvl.http_allowed_hosts"), payload
    error = q1(conn, "SELECT error FROM tuvl.runs WHERE id = %s", (run_id,))
    assert error.splitlines() == [
        'step "call" failed: HTTP request to http://192.0.2.1:9/x is not allowed',
        'DETAIL:  host "192.0.2.1" port 9 is not in tuvl.http_allowed_hosts.',
        "HINT:  " + payload["hint"]], error


CRON_DB = "postgres"


@pytest.fixture(scope="module")
def cron():
    """The cron database with pg_cron and tuvl (as test_schedule.py)."""
    conn = connect(CRON_DB)
    had_tuvl = q1(conn, "SELECT count(*) FROM pg_extension WHERE extname = 'tuvl'") == 1
    had_cron = q1(conn, "SELECT count(*) FROM pg_extension WHERE extname = 'pg_cron'") == 1
    q(conn, "CREATE EXTENSION IF NOT EXISTS pg_cron")
    q(conn, "CREATE EXTENSION IF NOT EXISTS tuvl")
    try:
        yield conn
    finally:
        q(conn, "SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname LIKE 'tuvl_e44_%'")
        if not had_tuvl:
            q(conn, "DROP EXTENSION tuvl CASCADE")
        if not had_cron:
            q(conn, "DROP EXTENSION pg_cron")
        conn.close()


def test_schedules_show_a_failing_pg_cron_job(cron):
    """pg_cron really fires the job; its start fails (the input it requires is
    missing) and tuvl.schedules says so."""
    name = new_name("e44_s")
    q(cron, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
trigger:
  input: {{ type: object, required: [order_id] }}
  schedule: "* * * * *"
steps:
  - {{ id: r, kind: Router, on: x, routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
""",))
    row = q(cron, "SELECT schedule, jobid IS NOT NULL, active, last_status FROM tuvl.schedules "
                  "WHERE workflow = %s", (name,))
    assert row == [("* * * * *", True, True, None)], row
    status = wait_until(lambda: q1(cron, "SELECT last_status FROM tuvl.schedules WHERE workflow = %s "
                                         "AND last_status IN ('failed', 'succeeded')", (name,)),
                        75, interval=1, message="pg_cron to run the job")
    assert status == "failed"
    message, failures = q(cron, "SELECT last_message, failures_24h FROM tuvl.schedules "
                                "WHERE workflow = %s", (name,))[0]
    assert "order_id" in message and failures >= 1, message


def test_schedules_work_without_pg_cron(roles):
    conn = connect(roles, user=USER)
    name = new_name()
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
trigger: {{ schedule: "@daily" }}
steps:
  - {{ id: r, kind: Router, on: x, routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
""",))
    assert q(conn, "SELECT schedule, jobid, last_status FROM tuvl.schedules WHERE workflow = %s",
             (name,)) == [("@daily", None, None)]


def test_permission_denied_for_a_tuvl_function_names_the_role_to_grant(roles):
    conn = connect(roles, user=NOBODY)
    e = error_of(conn, "SELECT tuvl.start_run('anything')")
    assert e.pgcode == "42501"
    assert e.diag.message_primary == "permission denied for function start_run"
    assert e.diag.message_hint == (
        "tuvl.start_run() is for members of tuvl_user: a superuser, or a role with ADMIN OPTION on "
        f"tuvl_user, runs GRANT tuvl_user TO {NOBODY}.")
    # in FROM too, and for the functions of tuvl_admin
    e = error_of(conn, "SELECT * FROM tuvl.timeline(1)")
    assert "GRANT tuvl_user TO" in (e.diag.message_hint or ""), e.diag.message_hint
    user = connect(roles, user=USER)
    e = error_of(user, "SELECT tuvl.set_secret('x', 'y')")
    assert e.diag.message_hint.startswith("tuvl.set_secret() is for members of tuvl_admin:"), \
        e.diag.message_hint
    # another schema's function keeps PostgreSQL's error as it is
    admin = connect(roles)
    q(admin, "CREATE SCHEMA IF NOT EXISTS e44; CREATE OR REPLACE FUNCTION e44.private_f() "
             "RETURNS int LANGUAGE sql AS 'SELECT 1'; REVOKE ALL ON FUNCTION e44.private_f() FROM PUBLIC; "
             f"GRANT USAGE ON SCHEMA e44 TO {NOBODY}")
    e = error_of(conn, "SELECT e44.private_f()")
    assert e.pgcode == "42501" and e.diag.message_hint is None


def test_findings_made_while_validation_reads_the_catalog_outlive_the_read(roles):
    """Validation reads the catalog through SPI, whose memory SPI_finish
    frees: a finding about what it read must be made (or copied) outside
    it.  A guardrail's two llm_judge checks name models that do not exist
    (the second check's read reuses the memory of the first's), and a
    workflow asks for an HTTP path another workflow serves; each finding
    must name what it found, intact."""
    conn = connect(roles, user=USER)
    missing = [new_name("gone_model"), new_name("gone_model")]
    for m in missing:
        register_model(conn, m)
    guard = new_name("guard")
    q(conn, "SELECT tuvl.register_artifact(%s)",
      (f"name: {guard}\ntype: guardrail\nchecks:\n"
       + "".join(f"  - {{ check: llm_judge, model: {m}, prompt: 'Polite?' }}\n" for m in missing),))
    # the judges' configs are gone since (removed by hand: tuvl has no drop)
    admin = connect(roles)
    q(admin, "DELETE FROM tuvl.llms WHERE name = ANY(%s)", (missing,))
    q(admin, "DELETE FROM tuvl.llm_versions WHERE name = ANY(%s)", (missing,))
    admin.close()
    llm = new_name("model")
    register_model(conn, llm)
    source = f"""
name: {new_name()}
steps:
  - id: a
    kind: Agent
    mode: completion
    agent:
      model: {llm}
      prompt: hi
      guardrails:
        output: [artifact://{guard}@1, artifact://{guard}@1]
"""
    rows = findings(conn, source)
    for i, m in enumerate(missing):
        assert any(f'check {i + 1} (llm_judge) of guardrail artifact://{guard}@1 asks model "{m}", '
                   "which does not exist" in msg for _, _, msg in rows), rows
    path = "/" + new_name("hook")
    served = new_name("served")
    def served_at(name):
        return (f"name: {name}\ntrigger:\n  http: {{ path: {path} }}\n"
                "steps:\n  - { id: r, kind: Router, on: x, routes: { default: done } }\n"
                "ends:\n  - { id: done, status: completed }\n")

    q(conn, "SELECT tuvl.register_workflow(%s)", (served_at(served),))
    rows = findings(conn, served_at(new_name()))
    assert any(f'path {path} is served by workflow "{served}" already' in msg for _, _, msg in rows), rows
