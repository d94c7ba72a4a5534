"""Scheduled workflows: trigger.schedule through pg_cron.

pg_cron lives in one database, cron.database_name ("postgres" in the test
cluster, see test/lib.sh), so these tests install pg_cron and tuvl there and
remove both at the end.  Covered: registering a scheduled workflow creates
the pg_cron job "tuvl_<workflow>" owned by the registering role; a version
without a schedule removes it; tuvl.start_scheduled() starts one run per
slot however often it is called; pg_cron really fires it (the one test that
waits for the next minute); only the workflow's owner and tuvl_operator
members may start its slots; a database without pg_cron gets a notice with
the command to run in the cron database; validation of schedules.
"""
import re
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, wait_until

CRON_DB = "postgres"
OUTSIDER = "tuvl_sched_outsider"


def new_name(prefix="s"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def cron():
    """A connection to the cron database with pg_cron and tuvl installed."""
    conn = connect(CRON_DB)
    had_tuvl = q1(conn, "SELECT count(*) FROM pg_extension WHERE extname = 'tuvl'") == 1
    had_cron = q1(conn, "SELECT count(*) FROM pg_extension WHERE extname = 'pg_cron'") == 1
    q(conn, "CREATE EXTENSION IF NOT EXISTS pg_cron")
    q(conn, "CREATE EXTENSION IF NOT EXISTS tuvl")
    q(conn, f"DROP ROLE IF EXISTS {OUTSIDER}")
    q(conn, f"CREATE ROLE {OUTSIDER} LOGIN IN ROLE tuvl_user")
    q(conn, f"GRANT CREATE ON SCHEMA public TO {OUTSIDER}")
    try:
        yield conn
    finally:
        q(conn, "SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname LIKE 'tuvl_s_%'")
        if not had_tuvl:
            q(conn, "DROP EXTENSION tuvl CASCADE")
        if not had_cron:
            q(conn, "DROP EXTENSION pg_cron")
        q(conn, f"REVOKE CREATE ON SCHEMA public FROM {OUTSIDER}")
        q(conn, f"DROP OWNED BY {OUTSIDER}")
        q(conn, f"DROP ROLE {OUTSIDER}")
        conn.close()


def scheduled(name, schedule="* * * * *"):
    return f"""
name: {name}
trigger: {{ schedule: "{schedule}" }}
steps:
  - {{ id: r, kind: Router, on: "{{{{ _scheduled_at }}}}", routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "{{{{ _scheduled_at }}}}" }}
"""


def notices(conn, since):
    return [n.strip() for n in conn.notices[since:]]


def test_a_schedule_becomes_a_pg_cron_job_and_a_version_without_one_removes_it(cron):
    name = new_name()
    mark = len(cron.notices)
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "*/5 * * * *"),))
    assert f'NOTICE:  workflow "{name}" is scheduled as pg_cron job "tuvl_{name}" (*/5 * * * *)' \
        in notices(cron, mark)
    assert q(cron, "SELECT schedule, command, username, database FROM cron.job WHERE jobname = %s",
             (f"tuvl_{name}",)) == [("*/5 * * * *", f"SELECT tuvl.start_scheduled('{name}')",
                                     "postgres", CRON_DB)]
    # a new version moves the job to its schedule
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "0 3 * * *"),))
    assert q(cron, "SELECT schedule FROM cron.job WHERE jobname = %s", (f"tuvl_{name}",)) == \
        [("0 3 * * *",)]
    # and one without a schedule removes it
    plain = scheduled(name).replace('trigger: { schedule: "* * * * *" }\n', "")
    assert "trigger" not in plain
    q(cron, "SELECT tuvl.register_workflow(%s)", (plain,))
    assert q1(cron, "SELECT count(*) FROM cron.job WHERE jobname = %s", (f"tuvl_{name}",)) == 0


def test_one_run_per_slot(cron):
    name = new_name()
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "@daily"),))
    first = q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-01-01 00:00+00')", (name,))
    again = q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-01-01 00:00+00')", (name,))
    other = q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-01-02 00:00+00')", (name,))
    assert first is not None and again is None and other not in (None, first)
    assert q(cron, "SELECT slot::text, run_id FROM tuvl.schedule_slots WHERE workflow = %s "
                   "ORDER BY slot", (name,)) == [("2026-01-01 00:00:00+00", first),
                                                  ("2026-01-02 00:00:00+00", other)]
    assert q1(cron, "SELECT input FROM tuvl.runs WHERE id = %s", (first,)) == \
        {"_scheduled_at": "2026-01-01T00:00:00+00:00"}
    wait_until(lambda: q1(cron, "SELECT status FROM tuvl.runs WHERE id = %s", (other,)) == "completed",
               10, message="the scheduled run to complete")
    # two sessions racing for the same slot start it once
    a, b = connect(CRON_DB, autocommit=False), connect(CRON_DB, autocommit=False)
    try:
        got_a = q1(a, "SELECT tuvl.start_scheduled(%s, '2026-01-03 00:00+00')", (name,))
        q(b, "SET statement_timeout = '300ms'")
        # b waits for a's claim of the slot
        with pytest.raises(psycopg2.extensions.QueryCanceledError):
            q(b, "SELECT tuvl.start_scheduled(%s, '2026-01-03 00:00+00')", (name,))
        b.rollback()
        a.commit()
        got_b = q1(b, "SELECT tuvl.start_scheduled(%s, '2026-01-03 00:00+00')", (name,))
        b.commit()
        assert got_a is not None and got_b is None
    finally:
        a.close()
        b.close()


def test_pg_cron_starts_the_runs(cron):
    name = new_name()
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name),))
    # pg_cron fires at the start of the next minute (it has minute granularity)
    wait_until(lambda: q1(cron, "SELECT count(*) FROM tuvl.schedule_slots WHERE workflow = %s",
                          (name,)) >= 1, 75, interval=0.5, message="pg_cron to start a run")
    slot, run_id = q(cron, "SELECT slot, run_id FROM tuvl.schedule_slots WHERE workflow = %s "
                           "ORDER BY slot LIMIT 1", (name,))[0]
    assert slot.second == 0 and slot.microsecond == 0
    wait_until(lambda: q1(cron, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "completed",
               10, message="the scheduled run to complete")
    row = q(cron, "SELECT principal, response FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert row[0] == "postgres"
    assert row[1] == slot.isoformat()
    assert q1(cron, "SELECT d.status FROM cron.job_run_details d JOIN cron.job j USING (jobid) "
                    "WHERE j.jobname = %s ORDER BY d.runid LIMIT 1", (f"tuvl_{name}",)) == "succeeded"


def test_only_the_owner_and_operators_start_slots(cron):
    name = new_name()
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "@hourly"),))
    outsider = connect(CRON_DB, user=OUTSIDER)
    try:
        with pytest.raises(psycopg2.errors.InsufficientPrivilege) as exc:
            q(outsider, "SELECT tuvl.start_scheduled(%s, '2026-02-01 00:00+00')", (name,))
        assert "permission denied to start the scheduled runs of workflow" in str(exc.value)
        assert q1(cron, "SELECT count(*) FROM tuvl.schedule_slots WHERE workflow = %s", (name,)) == 0
        q(cron, f"GRANT tuvl_operator TO {OUTSIDER}")
        run_id = q1(outsider, "SELECT tuvl.start_scheduled(%s, '2026-02-01 00:00+00')", (name,))
        assert q1(cron, "SELECT principal FROM tuvl.runs WHERE id = %s", (run_id,)) == OUTSIDER
    finally:
        q(cron, f"REVOKE tuvl_operator FROM {OUTSIDER}")
        outsider.close()


def test_a_role_without_pg_cron_rights_registers_with_a_warning(cron):
    name = new_name()
    outsider = connect(CRON_DB, user=OUTSIDER)
    try:
        mark = len(outsider.notices)
        assert q1(outsider, "SELECT tuvl.register_workflow(%s)", (scheduled(name),)) == 1
        said = " ".join(notices(outsider, mark))
        assert f'could not schedule the pg_cron job of workflow "{name}"' in said
        assert "GRANT USAGE ON SCHEMA cron" in said
        assert q1(cron, "SELECT count(*) FROM cron.job WHERE jobname = %s", (f"tuvl_{name}",)) == 0
    finally:
        outsider.close()


def test_a_database_without_pg_cron_is_told_what_to_run(db):
    conn = connect(db)
    try:
        name = new_name()
        mark = len(conn.notices)
        q(conn, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "*/10 * * * *"),))
        said = " ".join(notices(conn, mark))
        assert f'workflow "{name}" has a schedule, but pg_cron is not installed in this database' in said
        assert (f"SELECT cron.schedule_in_database('tuvl_{name}', '*/10 * * * *', "
                f"$$SELECT tuvl.start_scheduled('{name}')$$, '{db}');") in said
    finally:
        conn.close()


@pytest.mark.parametrize("schedule,ok", [
    ("* * * * *", True), ("*/5 1-3 * JAN,FEB MON-FRI", True), ("@daily", True), ("@hourly", True),
    ("every minute", False), ("* * * *", False), ("* * * * * *", False), ("5 seconds", False),
    ("* * * * ;", False)])
def test_schedules_are_validated(db, schedule, ok):
    conn = connect(db)
    try:
        rows = q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)",
                 (scheduled("v", schedule),))
    finally:
        conn.close()
    errors = [r for r in rows if r[0] == "error"]
    if ok:
        assert errors == [], rows
    else:
        assert len(errors) == 1 and errors[0][1] == "trigger.schedule", rows
        assert "schedule must be a cron expression of five fields" in errors[0][2], rows


def test_a_schedule_with_required_input_warns(db):
    conn = connect(db)
    try:
        source = scheduled("v", "@daily").replace(
            'trigger: { schedule: "@daily" }',
            'trigger: { schedule: "@daily", input: { type: object, required: [x] } }')
        rows = q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (source,))
    finally:
        conn.close()
    assert [(r[0], r[1]) for r in rows] == [("warning", "trigger.schedule")], rows
    assert re.sub(r" \(line .*\)$", "", rows[0][2]) == (
        'scheduled runs start with the input {"_scheduled_at": <slot>}, which trigger.input '
        'refuses (it requires keys); each scheduled start will fail')


def test_missed_slots_are_skipped_unless_catch_up_starts_the_last_n(cron):
    """pg_cron never fires a slot it missed.  Without catch_up a missed slot
    stays missed; with catch_up: 2, start_scheduled() also starts the last
    two slots since the last one it started, oldest first, each once."""
    name = new_name()
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "*/5 * * * *"),))
    q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-03-01 10:00+00')", (name,))
    q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-03-01 10:30+00')", (name,))
    assert [r[0].isoformat() for r in q(cron, "SELECT slot FROM tuvl.schedule_slots WHERE workflow = %s "
                                              "ORDER BY slot", (name,))] == \
        ["2026-03-01T10:00:00+00:00", "2026-03-01T10:30:00+00:00"]

    name = new_name()
    q(cron, "SELECT tuvl.register_workflow(%s)", (scheduled(name, "*/5 * * * *").replace(
        'trigger: { schedule: "*/5 * * * *" }', 'trigger: { schedule: "*/5 * * * *", catch_up: 2 }'),))
    assert q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-03-01 10:00+00')", (name,)) is not None
    last = q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-03-01 10:30+00')", (name,))
    rows = q(cron, "SELECT s.slot, s.run_id, r.input ->> '_scheduled_at' FROM tuvl.schedule_slots s "
                   "JOIN tuvl.runs r ON r.id = s.run_id WHERE s.workflow = %s ORDER BY s.slot", (name,))
    assert [r[0].strftime("%H:%M") for r in rows] == ["10:00", "10:20", "10:25", "10:30"]
    assert rows[-1][1] == last, "start_scheduled returns the run of the slot asked for"
    assert all(r[2] is not None for r in rows)
    assert rows[1][1] < rows[2][1] < rows[3][1], "the missed slots start first, oldest first"
    # each slot once: calling again starts nothing
    assert q1(cron, "SELECT tuvl.start_scheduled(%s, '2026-03-01 10:30+00')", (name,)) is None
    assert q1(cron, "SELECT count(*) FROM tuvl.schedule_slots WHERE workflow = %s", (name,)) == 4
    for run_id in [r[1] for r in rows]:
        assert q1(cron, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"


def test_the_schedule_is_read_as_pg_cron_reads_it(cron):
    def slots(schedule, after, before, n=10):
        return [t.strftime("%Y-%m-%d %H:%M %a") for t in
                q1(cron, "SELECT tuvl._missed_slots(%s, %s, %s, %s)", (schedule, after, before, n))]
    assert slots("0 3 * * 1-5", "2026-11-26 00:00+00", "2026-12-01 00:00+00") == [
        "2026-11-26 03:00 Thu", "2026-11-27 03:00 Fri", "2026-11-30 03:00 Mon"]
    # both day fields restricted: either matches (the 13th, or a Friday)
    assert slots("0 0 13 * 5", "2026-11-01 00:00+00", "2026-12-01 00:00+00") == [
        "2026-11-06 00:00 Fri", "2026-11-13 00:00 Fri", "2026-11-20 00:00 Fri", "2026-11-27 00:00 Fri"]
    assert slots("@monthly", "2026-09-15 00:00+00", "2026-12-01 00:00+00") == [
        "2026-10-01 00:00 Thu", "2026-11-01 00:00 Sun"]
    assert slots("0 9 * jan,jul sun", "2026-07-10 00:00+00", "2026-08-01 00:00+00", 2) == [
        "2026-07-19 09:00 Sun", "2026-07-26 09:00 Sun"]
    assert slots("5/20 * * * *", "2026-01-01 00:00+00", "2026-01-01 01:00+00") == [
        "2026-01-01 00:05 Thu", "2026-01-01 00:25 Thu", "2026-01-01 00:45 Thu"]
    assert slots("not a schedule", "2026-01-01 00:00+00", "2026-01-02 00:00+00") == []


@pytest.mark.parametrize("trigger,message", [
    ('{ catch_up: 2 }', "catch_up needs a schedule"),
    ('{ schedule: "@daily", catch_up: -1 }', "catch_up must be how many missed slots to start late"),
    ('{ schedule: "@daily", catch_up: lots }', "catch_up must be how many missed slots to start late"),
    ('{ schedule: "@daily", catch_up: 5000 }', "catch_up must be how many missed slots to start late"),
])
def test_catch_up_is_checked(cron, trigger, message):
    src = scheduled("v", "@daily").replace('trigger: { schedule: "@daily" }', f"trigger: {trigger}")
    rows = [(r[1], r[2]) for r in q(cron, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,))
            if r[0] == "error"]
    assert [p for p, _ in rows] == ["trigger.catch_up"] and message in rows[0][1], rows
