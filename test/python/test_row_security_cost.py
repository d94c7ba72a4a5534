"""Row security of tuvl.runs checks its role-wide conditions once a query.

The policy's conditions that do not depend on the row (is the caller an
operator? does its token allow runs:read?) are scalar subqueries, which
PostgreSQL evaluates once per query (an InitPlan), not once per row: the
console's counts by status read 50,000 runs, and calling pg_has_role()
and tuvl._has_scope() for each was most of their time.
"""
import psycopg2
import pytest

from conftest import connect, q, q1, wait_until

ALICE, BOB = "rsc_alice", "rsc_bob"
RUNS = 300

WF = """
name: rsc_one
steps:
  - { id: a, kind: Functional, function: rsc.one, routes: { default: done } }
ends:
  - { id: done, status: completed }
"""


@pytest.fixture(scope="module")
def rscdb(db):
    admin = connect("postgres")
    try:
        for role in (ALICE, BOB):
            q(admin, f"DROP ROLE IF EXISTS {role}")
            q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
            # the test counts calls of tuvl._has_scope() (a C function)
            q(admin, f"ALTER ROLE {role} SET track_functions = 'all'")
    finally:
        admin.close()
    conn = connect(db)
    try:
        q(conn, "CREATE SCHEMA rsc; GRANT USAGE ON SCHEMA rsc TO PUBLIC")
        q(conn, "CREATE FUNCTION rsc.one(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{}'::jsonb $$")
        q(conn, "SELECT tuvl.register_workflow(%s)", (WF,))
    finally:
        conn.close()
    alice = connect(db, user=ALICE)
    try:
        q(alice, "SELECT count(tuvl.start_run('rsc_one', '{}')) FROM generate_series(1, %s)", (RUNS,))
        wait_until(lambda: q1(alice, "SELECT count(*) FROM tuvl.runs WHERE status = 'completed'") == RUNS,
                   60, interval=0.2)
    finally:
        alice.close()
    yield db
    conn = connect(db)
    admin = connect("postgres")
    try:
        for role in (ALICE, BOB):
            q(conn, f"DROP OWNED BY {role}")
            q(admin, f"DROP ROLE IF EXISTS {role}")
    finally:
        conn.close()
        admin.close()


def scope_checks(conn, sql):
    """Calls of tuvl._has_scope() while sql runs, and its rows."""
    conn.autocommit = False
    try:
        rows = q(conn, sql)
        calls = q1(conn, "SELECT coalesce(pg_stat_get_xact_function_calls('tuvl._has_scope(text)'::regprocedure), 0)")
        return calls, rows
    finally:
        conn.rollback()
        conn.autocommit = True


def test_counts_by_status_check_the_policy_once_not_per_run(rscdb):
    alice = connect(rscdb, user=ALICE)
    bob = connect(rscdb, user=BOB)
    try:
        calls, rows = scope_checks(alice, "SELECT status, count(*) FROM tuvl.runs GROUP BY status")
        assert rows == [("completed", RUNS)]
        assert calls < 5, f"tuvl._has_scope() called {calls} times for {RUNS} runs"
        # the journal's policy reaches runs' through EXISTS: once a query there too
        calls, rows = scope_checks(alice, "SELECT count(*) FROM tuvl.events")
        assert rows[0][0] >= RUNS
        assert calls < 5, f"tuvl._has_scope() called {calls} times reading the journal"
        # and the rule is the same: bob sees none of them
        assert q1(bob, "SELECT count(*) FROM tuvl.runs") == 0
        assert q1(bob, "SELECT count(*) FROM tuvl.events") == 0
    finally:
        alice.close()
        bob.close()


def test_a_token_without_runs_read_still_sees_no_run(rscdb):
    alice = connect(rscdb, user=ALICE)
    try:
        token = q1(alice, "SELECT tuvl.create_token(%s, '{runs:start}')", (ALICE,))
        alice.autocommit = False
        q(alice, "SELECT tuvl.authenticate(%s)", (token,))
        assert q1(alice, "SELECT count(*) FROM tuvl.runs") == 0
        alice.rollback()
    finally:
        alice.close()


def plan_nodes(plan):
    yield plan
    for p in plan.get("Plans", []):
        yield from plan_nodes(p)


def test_one_runs_journal_probes_that_run_not_every_run(rscdb):
    """A generic plan of one run's journal, before the journal has statistics.

    The journal's policy reaches runs' through EXISTS; a hashed SubPlan of
    it would read every run the role may see for each query (what the
    Insight server's event streams did on fresh tables: 64 ms a read at
    33,000 runs), where one index probe of the run's row is enough.
    """
    su = connect(rscdb)
    alice = connect(rscdb, user=ALICE)
    try:
        # a journal never analyzed (as on a fresh database)
        q(su, "DELETE FROM pg_catalog.pg_statistic WHERE starelid = 'tuvl.journal'::regclass")
        q(su, "UPDATE pg_catalog.pg_class SET reltuples = -1 WHERE oid = 'tuvl.journal'::regclass")
        run_id = q1(alice, "SELECT max(id) FROM tuvl.runs")
        q(alice, "SET plan_cache_mode = force_generic_plan")
        q(alice, "PREPARE one_journal(bigint) AS SELECT seq, type FROM tuvl.events WHERE run_id = $1")
        plan = q1(alice, "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE one_journal(%s)", (run_id,))[0]["Plan"]
        runs_read = [(n["Node Type"], n["Actual Rows"] * n["Actual Loops"]) for n in plan_nodes(plan)
                     if n.get("Relation Name") == "runs"]
        assert runs_read, plan
        assert all(rows <= 20 for _, rows in runs_read), f"the policy read {runs_read} rows of tuvl.runs"
        assert q1(alice, "SELECT count(*) FROM tuvl.events WHERE run_id = %s", (run_id,)) > 0
    finally:
        alice.close()
        su.close()
