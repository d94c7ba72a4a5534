"""JIT compilation in a worker: never for tuvl's own statements, as configured for a step's SQL.

A worker's internal statements are a few index probes, but a plan costed
from missing or stale statistics, or made with sequential scans disabled
(SpiExecIndexed), can pass jit_above_cost; LLVM would then compile it at
every execution, for 10 to 40 ms, while every other run the worker holds
waits.  So a worker runs tuvl's own statements with jit off, and a step's
SQL with the jit setting the session would have (security.c).

With jit_above_cost = 0 every plan qualifies, and jit_dump_bitcode writes
each module a process compiles into the data directory as <pid>.<n>.bc,
which pg_ls_dir() lists: a worker's pid there means it compiled something.
The runs are an ordinary tuvl_user role's.
"""
import re

import pytest

from conftest import ASAN_NO_JIT_REASON, UNDER_ASAN, connect, q, q1, wait_until, worker_pids

ROLE = "tuvl_jit_user"

STEP = """
name: jit_step
steps:
  - { id: count, kind: Functional, function: public.jit_count, routes: { default: done } }
ends:
  - { id: done, status: completed }
"""

ROUTERS = """
name: jit_routers
steps:
  - { id: a, kind: Router, on: go, routes: { go: b } }
  - { id: b, kind: Router, on: go, routes: { go: done } }
ends:
  - { id: done, status: completed, response: routed }
"""

# every plan qualifies; no inlining or optimization (cheaper compiles)
JIT_EVERYTHING = {"jit": ("on", "on"), "jit_above_cost": ("0", "0"), "jit_inline_above_cost": ("-1", "-1"),
                  "jit_optimize_above_cost": ("-1", "-1"), "jit_dump_bitcode": ("on", "on")}


@pytest.fixture(scope="module")
def user_db(db):
    admin = connect(db)
    q(admin, f"DROP ROLE IF EXISTS {ROLE}")
    q(admin, f"CREATE ROLE {ROLE} LOGIN IN ROLE tuvl_user")
    q(admin, """CREATE FUNCTION public.jit_count(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
                BEGIN
                    RETURN jsonb_build_object('n', (SELECT count(*) FROM generate_series(1, 100) g
                                                     WHERE g % 3 = 0));
                END $$""")
    user = connect(db, user=ROLE)
    q(user, "SELECT tuvl.register_workflow(%s)", (STEP,))
    q(user, "SELECT tuvl.register_workflow(%s)", (ROUTERS,))
    user.close()
    yield db
    q(admin, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE principal_id::text = %s)",
      (ROLE,))
    q(admin, "DELETE FROM tuvl.runs WHERE principal_id::text = %s", (ROLE,))
    q(admin, "DELETE FROM tuvl.workflows WHERE owner::text = %s", (ROLE,))
    q(admin, "DROP FUNCTION public.jit_count(jsonb)")
    admin.close()
    admin = connect("postgres")
    q(admin, f"DROP ROLE IF EXISTS {ROLE}")
    admin.close()


def compiled_by(pids):
    """The bitcode files in the data directory written by the processes pids."""
    conn = connect("postgres")
    try:
        files = [r[0] for r in q(conn, "SELECT f FROM pg_catalog.pg_ls_dir('.') f WHERE f LIKE '%.bc'")]
    finally:
        conn.close()
    return sorted(f for f in files
                  if re.match(r"^\d+\.", f) and int(f.split(".")[0]) in pids)


def run_all(conn, workflow, n):
    ids = [q1(conn, "SELECT tuvl.start_run(%s)", (workflow,)) for _ in range(n)]
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) AND status = 'completed'",
                          (ids,)) == n, 30, message=f"{n} runs of {workflow} to complete")


# test/run asan's PostgreSQL is built without LLVM: nothing to compile there
@pytest.mark.skipif(UNDER_ASAN, reason=ASAN_NO_JIT_REASON)
def test_workers_compile_a_steps_sql_but_never_their_own_statements(user_db, set_gucs):
    admin = connect("postgres")
    assert q1(admin, "SELECT pg_catalog.pg_jit_available()"), "this server cannot JIT-compile (llvmjit missing)"
    admin.close()
    pids = set(worker_pids(user_db))
    set_gucs(JIT_EVERYTHING)
    user = connect(user_db, user=ROLE)

    # a step's SQL keeps the setting: the workers (once they reloaded) compile it
    user_ids = [q1(user, "SELECT tuvl.start_run('jit_step')")]

    def compiled_a_step():
        if not compiled_by(pids):
            user_ids.append(q1(user, "SELECT tuvl.start_run('jit_step')"))
            return False
        return True

    wait_until(compiled_a_step, 20, interval=0.5, message="a worker to JIT-compile a Functional step's SQL")
    wait_until(lambda: q1(user, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) AND status <> 'completed'",
                          (user_ids,)) == 0, 30, message="the Functional runs to complete")
    before = compiled_by(pids)

    # runs that execute no user SQL: claims, checkpoints, the journal, the
    # workers' maintenance; all tuvl's own statements, none compiled
    run_all(user, "jit_routers", 20)
    after = compiled_by(pids)
    assert after == before, ("a worker JIT-compiled its own statements: %s" % sorted(set(after) - set(before)))
    user.close()
