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

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, wait_until

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
    q(c, "DELETE FROM tuvl.breakpoints")


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
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(bob, "SELECT tuvl._dev_stop(%s, 'dev3', 'b')", (run_id,))
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
