"""A clean restart (pg_ctl restart -m fast) while runs execute.

Fast shutdown terminates the workers mid-batch; their runs are left
'running' under leases of the old server incarnation.  After the restart the
new workers must reclaim them at once (the lease epoch changed), not after
tuvl.lease_timeout, and every run completes exactly once.
"""
import time

from conftest import (SERVER_LOG, connect, expected_event_types, journal_violations, pg_ctl, q, q1,
                      report, wait_for_server, wait_until, worker_pids)

N_RUNS = 200
STEPS = ["nap1", "write", "nap2"]

WORKFLOW = """
name: restart_me
steps:
  - { id: nap1, kind: Functional, function: rr.nap }
  - id: write
    kind: ModelOp
    sql: INSERT INTO rr.sink (k) VALUES ($1) RETURNING k
    params: ["{{ k }}"]
  - { id: nap2, kind: Functional, function: rr.nap, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ write_result.0.k }}" }
"""


def test_crash_fast_restart_mid_batch_resumes_every_run_at_once(db):
    conn = connect(db)
    q(conn, "CREATE SCHEMA rr")
    q(conn, "CREATE TABLE rr.sink (k integer NOT NULL)")  # no unique key: duplicates would show
    q(conn, """CREATE FUNCTION rr.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               BEGIN PERFORM pg_sleep(0.01); RETURN '{}'; END $$""")
    q(conn, "SELECT tuvl.register_workflow(%s)", (WORKFLOW,))
    lease_ms = int(q1(conn, "SELECT setting FROM pg_settings WHERE name = 'tuvl.lease_timeout'"))
    q(conn, "SELECT count(tuvl.start_run('restart_me', jsonb_build_object('k', g))) "
            "FROM generate_series(1, %s) g", (N_RUNS,))
    wait_until(lambda: q1(conn, "SELECT count(*) FROM rr.sink") >= N_RUNS // 8, 30, interval=0.01,
               message="the first writes")
    conn.close()

    started = time.time()
    pg_ctl("-l", SERVER_LOG, "-m", "fast", "-w", "-t", "60", "restart")
    wait_for_server()
    up = time.time()

    conn = connect(db)
    in_flight = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE status = 'running'")
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE finished_at IS NULL") == 0,
               25, interval=0.1, message="every run to finish after the restart")
    done = time.time()
    first = float(q1(conn, "SELECT extract(epoch FROM min(ts)) FROM tuvl.events "
                           "WHERE type = 'agent_started' AND ts > to_timestamp(%s)", (up,)))
    reclaimed = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE attempt > 1")
    report(f"restart took {up - started:.2f} s; {in_flight} runs were left running; first step "
          f"{first - up:.2f} s after the server was up; all done {done - up:.2f} s after it; "
          f"{reclaimed} runs reclaimed")

    assert reclaimed > 0, "the restart must have interrupted runs"
    assert first - up < 5
    assert done - up < lease_ms / 1000 * 0.8, "interrupted runs waited for their lease to expire"
    assert q(conn, "SELECT status, count(*) FROM tuvl.runs GROUP BY 1") == [("completed", N_RUNS)]
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE response IS DISTINCT FROM input -> 'k'") == 0
    assert q(conn, "SELECT count(*), count(DISTINCT k) FROM rr.sink") == [(N_RUNS, N_RUNS)]
    assert journal_violations(conn) == []
    assert q(conn, """SELECT run_id FROM tuvl.events GROUP BY run_id
                      HAVING array_agg(type ORDER BY seq) <> %s::text[] LIMIT 5""",
             (expected_event_types(STEPS),)) == []
    wait_until(lambda: len(worker_pids(db)) == 2, 5, message="the pool after the restart")
    conn.close()
