"""Dev mode (issue 38): breakpoints and step mode, kept in the database.

tuvl.set_breakpoint(workflow, step) stops the setter's runs of the
workflow before they enter the step (a member of tuvl_operator: all runs),
paused, the paused event saying by: breakpoint; tuvl.step_run(run_id)
executes the step the run stopped before and stops it again before the
next (by: step); tuvl.resume_run() lets it go on; tuvl.clear_breakpoint()
removes it.  Roles: dev_alice and dev_bob (tuvl_user), dev_carol
(tuvl_operator).  The workflow is three steps of 0.1 s (dev.slow).
"""
import json
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, kill_worker, q, q1, wait_until, worker_pids

ALICE, BOB, CAROL = "dev_alice", "dev_bob", "dev_carol"

SCHEMA = """
CREATE SCHEMA dev;
GRANT USAGE ON SCHEMA dev TO PUBLIC;
CREATE FUNCTION dev.slow(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT pg_sleep(0.1); SELECT '{}'::jsonb $$;
"""

WF = """
name: dev3
steps:
  - { id: a, kind: Functional, function: dev.slow }
  - { id: b, kind: Functional, function: dev.slow }
  - { id: c, kind: Functional, function: dev.slow, routes: { default: done } }
ends:
  - { id: done, status: completed, response: { ok: true } }
"""


@pytest.fixture(scope="module")
def devdb(db):
    admin = connect("postgres")
    try:
        for role in (ALICE, BOB, CAROL):
            q(admin, f"DROP ROLE IF EXISTS {role}")
            q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
        q(admin, f"GRANT tuvl_operator TO {CAROL}")
    finally:
        admin.close()
    conn = connect(db)
    try:
        q(conn, SCHEMA)
        q(conn, "SELECT tuvl.register_workflow(%s)", (WF,))
    finally:
        conn.close()
    yield db
    conn = connect(db)
    admin = connect("postgres")
    try:
        for role in (ALICE, BOB, CAROL):
            q(conn, f"DROP OWNED BY {role}")
            q(admin, f"DROP ROLE IF EXISTS {role}")
    finally:
        conn.close()
        admin.close()


@pytest.fixture
def as_role(devdb, conns):
    return lambda role: conns(devdb, user=role)


@pytest.fixture
def su(devdb, conns):
    c = conns(devdb)
    yield c
    clear_all(c)


def clear_all(c):
    """Remove every breakpoint through tuvl.clear_breakpoint, as its role:
    only tuvl writes the table (and counts it for dev mode's gate)."""
    for workflow, step, role in q(c, "SELECT workflow, step, role::text FROM tuvl.breakpoints"):
        q(c, f"SET ROLE {role}")
        try:
            q(c, "SELECT tuvl.clear_breakpoint(%s, %s)", (workflow, step))
        finally:
            q(c, "RESET ROLE")


def start(conn):
    return q1(conn, "SELECT tuvl.start_run('dev3', '{}')")


def status(conn, run_id):
    return q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,))


def wait_status(su, run_id, want, timeout=20):
    wait_until(lambda: status(su, run_id) == want, timeout, message=f"run {run_id} {want}")


def paused_events(su, run_id):
    rows = q(su, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'paused' ORDER BY seq", (run_id,))
    return [r[0] for r in rows]


def entered(su, run_id):
    rows = q(su, "SELECT agent_id FROM tuvl.events WHERE run_id = %s AND type = 'agent_started' ORDER BY seq", (run_id,))
    return [r[0] for r in rows]


def test_a_breakpoint_pauses_the_run_before_its_step_and_step_mode_advances_it(su, as_role):
    alice = as_role(ALICE)
    q(alice, "SELECT tuvl.set_breakpoint('dev3', 'b')")
    run_id = start(alice)
    wait_status(su, run_id, "paused")
    assert q1(su, "SELECT current_step FROM tuvl.runs WHERE id = %s", (run_id,)) == "b"
    assert paused_events(su, run_id) == [{"step": "b", "by": "breakpoint"}]
    assert entered(su, run_id) == ["a"], "paused before b was entered"

    q(alice, "SELECT tuvl.step_run(%s)", (run_id,))
    wait_until(lambda: len(paused_events(su, run_id)) == 2 and status(su, run_id) == "paused", 20)
    assert paused_events(su, run_id)[1] == {"step": "c", "by": "step"}
    assert entered(su, run_id) == ["a", "b"]

    q(alice, "SELECT tuvl.step_run(%s)", (run_id,))
    wait_status(su, run_id, "completed")
    assert entered(su, run_id) == ["a", "b", "c"]
    assert len(paused_events(su, run_id)) == 2


def test_resume_goes_past_the_breakpoint_and_clear_removes_it(su, as_role):
    alice = as_role(ALICE)
    q(alice, "SELECT tuvl.set_breakpoint('dev3', 'c')")
    run_id = start(alice)
    wait_status(su, run_id, "paused")
    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    wait_status(su, run_id, "completed")
    q(alice, "SELECT tuvl.clear_breakpoint('dev3', 'c')")
    run2 = start(alice)
    wait_status(su, run2, "completed")
    assert paused_events(su, run2) == []


def test_a_breakpoint_holds_only_for_the_runs_of_its_role_and_an_operators_for_all(su, as_role):
    alice, bob, carol = as_role(ALICE), as_role(BOB), as_role(CAROL)
    q(bob, "SELECT tuvl.set_breakpoint('dev3', 'b')")
    run_id = start(alice)
    wait_status(su, run_id, "completed")
    # bob neither sees alice's breakpoints nor she his
    assert q(alice, "SELECT step FROM tuvl.breakpoints") == []
    q(bob, "SELECT tuvl.clear_breakpoint('dev3', 'b')")
    q(carol, "SELECT tuvl.set_breakpoint('dev3', 'a')")
    run2 = start(alice)
    wait_status(su, run2, "paused")
    assert paused_events(su, run2) == [{"step": "a", "by": "breakpoint"}]
    q(carol, "SELECT tuvl.resume_run(%s)", (run2,))
    wait_status(su, run2, "completed")


def test_another_role_can_neither_step_a_run_nor_write_its_dev_state(su, as_role):
    alice, bob = as_role(ALICE), as_role(BOB)
    q(alice, "SELECT tuvl.set_breakpoint('dev3', 'b')")
    run_id = start(alice)
    wait_status(su, run_id, "paused")
    with pytest.raises(psycopg2.Error) as e:
        q(bob, "SELECT tuvl.step_run(%s)", (run_id,))
    assert e.value.pgcode in ("42704", "42501"), e.value.pgcode
    bob.rollback() if not bob.autocommit else None
    with pytest.raises(psycopg2.Error) as e:
        q(bob, "INSERT INTO tuvl.dev_runs (run_id, step_mode) VALUES (%s, true)", (run_id,))
    assert e.value.pgcode == "42501", e.value.pgcode
    with pytest.raises(psycopg2.Error) as e:
        q(bob, "INSERT INTO tuvl.breakpoints (workflow, step, role) VALUES ('dev3', 'c', %s::regrole)", (ALICE,))
    assert e.value.pgcode == "42501", e.value.pgcode
    assert status(su, run_id) == "paused"
    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    wait_status(su, run_id, "completed")


def test_bad_input_and_a_run_that_is_not_paused(su, as_role):
    alice = as_role(ALICE)
    with pytest.raises(psycopg2.errors.UndefinedObject) as e:
        q(alice, "SELECT tuvl.set_breakpoint('dev3', 'nope')")
    assert 'has no step "nope"' in str(e.value)
    with pytest.raises(psycopg2.errors.UndefinedObject):
        q(alice, "SELECT tuvl.set_breakpoint('no_such_workflow', 'a')")
    run_id = start(alice)
    wait_status(su, run_id, "completed")
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as e:
        q(alice, "SELECT tuvl.step_run(%s)", (run_id,))
    assert "its status is completed" in str(e.value)


def test_a_token_without_runs_control_cannot_set_a_breakpoint(su, as_role):
    alice = as_role(ALICE)
    token = q1(alice, "SELECT tuvl.create_token('dev_alice', '{runs:read}')")
    alice.autocommit = False
    try:
        q(alice, "SELECT tuvl.authenticate(%s)", (token,))
        with pytest.raises(psycopg2.Error) as e:
            q(alice, "SELECT tuvl.set_breakpoint('dev3', 'b')")
        assert e.value.pgcode == "42501", e.value.pgcode
    finally:
        alice.rollback()
        alice.autocommit = True
    assert json.dumps(q(su, "SELECT * FROM tuvl.breakpoints")) == "[]"


LOCK_STATEMENTS = (
    "LOCK TABLE tuvl.{t} IN EXCLUSIVE MODE NOWAIT",
    "LOCK TABLE tuvl.{t} IN ACCESS EXCLUSIVE MODE NOWAIT",
    "SELECT 1 FROM tuvl.{t} FOR UPDATE NOWAIT",
    "SELECT 1 FROM tuvl.{t} FOR KEY SHARE NOWAIT",
)


def test_an_ordinary_role_can_neither_write_nor_lock_the_dev_mode_tables(su, as_role):
    """Written through tuvl's functions only: a role that may write a table
    may LOCK it, and the workers, which read both at step entries while
    dev mode is on, would wait behind the lock (issue 36's attack)."""
    alice, bob = as_role(ALICE), as_role(BOB)
    q(alice, "SELECT tuvl.set_breakpoint('dev3', 'b')")
    run_id = start(alice)
    wait_status(su, run_id, "paused")
    for conn in (alice, bob):
        conn.autocommit = False
        try:
            for table in ("breakpoints", "dev_runs"):
                for stmt in LOCK_STATEMENTS:
                    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
                        q(conn, stmt.format(t=table))
                    conn.rollback()
            # not even rows of her own
            for stmt in ("INSERT INTO tuvl.breakpoints (workflow, step, role) VALUES ('dev3', 'c', current_user::regrole)",
                         "DELETE FROM tuvl.breakpoints",
                         "UPDATE tuvl.breakpoints SET step = 'c'",
                         f"INSERT INTO tuvl.dev_runs (run_id, step_mode) VALUES ({run_id}, true)",
                         "UPDATE tuvl.dev_runs SET step_mode = true",
                         "DELETE FROM tuvl.dev_runs",
                         "TRUNCATE tuvl.breakpoints, tuvl.dev_runs"):
                with pytest.raises(psycopg2.errors.InsufficientPrivilege):
                    q(conn, stmt)
                conn.rollback()
        finally:
            conn.rollback()
            conn.autocommit = True
    # reads: her own rows; bob sees neither her breakpoint nor her run's dev state
    assert q(alice, "SELECT step FROM tuvl.breakpoints") == [("b",)]
    assert q(bob, "SELECT step FROM tuvl.breakpoints") == []
    assert q(bob, "SELECT run_id FROM tuvl.dev_runs") == []
    # bob can neither step her run nor clear her breakpoint
    with pytest.raises(psycopg2.errors.UndefinedObject):
        q(bob, "SELECT tuvl.step_run(%s)", (run_id,))
    q(bob, "SELECT tuvl.clear_breakpoint('dev3', 'b')")
    assert q1(su, "SELECT count(*) FROM tuvl.breakpoints WHERE role = %s::regrole", (ALICE,)) == 1
    assert status(su, run_id) == "paused"
    q(alice, "SELECT tuvl.clear_breakpoint('dev3', 'b')")
    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    wait_status(su, run_id, "completed")


def dev_table_scans(conn):
    """Scans of tuvl.breakpoints and tuvl.dev_runs, by every backend (the
    cumulative statistics, flushed by each process at most once a second)."""
    q(conn, "SELECT pg_stat_clear_snapshot()")
    return q1(conn, """
        SELECT sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::int FROM pg_stat_all_tables
         WHERE relid IN ('tuvl.breakpoints'::regclass, 'tuvl.dev_runs'::regclass)""")


def settled_scans(conn):
    """The scans once they stop changing (the last flushes are in)."""
    last = dev_table_scans(conn)
    while True:
        time.sleep(1.2)
        now = dev_table_scans(conn)
        if now == last:
            return now
        last = now


def run_some(alice, su, n=3):
    for _ in range(n):
        wait_status(su, start(alice), "completed")
        time.sleep(1.1)     # the worker's statistics flush with its next transaction


def test_runs_without_dev_mode_do_not_ask_its_tables(su, as_role, conns, devdb):
    """Dev mode's gate: while the database has no breakpoint and no run in
    step mode, a run entering a step reads neither table."""
    alice = as_role(ALICE)
    watcher = conns(devdb)
    assert q1(su, "SELECT count(*) FROM tuvl.breakpoints") == 0
    run_some(alice, su, 2)      # the workers flush what earlier tests left pending
    before = settled_scans(watcher)
    run_some(alice, su)
    # 3 runs of 3 steps: asking at each step entry would be 18 scans or more
    # (a worker may still flush a scan of an earlier test's teardown)
    assert settled_scans(watcher) - before < 3, "runs without dev mode read its tables"
    # and with a breakpoint (another role's: not even one that stops these runs) they do
    bob = as_role(BOB)
    q(bob, "SELECT tuvl.set_breakpoint('dev3', 'b')")
    before = settled_scans(watcher)
    run_some(alice, su)
    assert settled_scans(watcher) - before >= 9
    q(bob, "SELECT tuvl.clear_breakpoint('dev3', 'b')")
    run_some(alice, su, 1)
    before = settled_scans(watcher)
    run_some(alice, su)
    assert settled_scans(watcher) - before < 3, "the gate closed again once the breakpoint went"


def test_a_run_that_ends_in_step_mode_leaves_no_dev_state(su, as_role):
    alice = as_role(ALICE)
    q(alice, "SELECT tuvl.set_breakpoint('dev3', 'c')")
    run_id = start(alice)
    wait_status(su, run_id, "paused")
    q(alice, "SELECT tuvl.clear_breakpoint('dev3', 'c')")
    q(alice, "SELECT tuvl.step_run(%s)", (run_id,))
    assert q1(su, "SELECT step_mode FROM tuvl.dev_runs WHERE run_id = %s", (run_id,)) is True
    wait_status(su, run_id, "completed")
    assert q(su, "SELECT * FROM tuvl.dev_runs WHERE run_id = %s", (run_id,)) == []


def test_a_breakpoint_holds_after_a_crash_restart_and_the_gate_is_counted_again(devdb, server_log):
    """Shared memory starts empty after a crash: a worker counts the
    breakpoints again before any run can slip past one."""
    alice = connect(devdb, user=ALICE)
    q(alice, "SELECT tuvl.set_breakpoint('dev3', 'b')")
    alice.close()
    kill_worker(worker_pids(devdb)[0], server_log)
    wait_until(lambda: len(worker_pids(devdb)) > 0, 30, ignore=(psycopg2.OperationalError,))
    alice = connect(devdb, user=ALICE)
    su2 = connect(devdb)
    try:
        run_id = start(alice)
        wait_status(su2, run_id, "paused")
        assert paused_events(su2, run_id) == [{"step": "b", "by": "breakpoint"}]
        q(alice, "SELECT tuvl.clear_breakpoint('dev3', 'b')")
        q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
        wait_status(su2, run_id, "completed")
        # counted, not left open: without breakpoints runs read the tables no more
        run_some(alice, su2, 1)
        before = settled_scans(su2)
        run_some(alice, su2)
        assert settled_scans(su2) - before < 3
    finally:
        clear_all(su2)
        alice.close()
        su2.close()
