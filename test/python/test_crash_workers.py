"""Crash recovery and lease fencing of the workers.

(a) kill -9 of a worker mid-batch: the postmaster restarts every backend; the
    runs the dead workers held are reclaimed at start-up (new server epoch),
    not after tuvl.lease_timeout, and every run still completes exactly once.
(b) SIGTERM of a busy worker: the survivors requeue its runs at once.
(c) SIGSTOP of a worker mid-step: it stops heartbeating, its lease expires,
    the other worker takes the run over and completes it; when the stalled
    worker wakes up the fenced checkpoint stops it, its work is rolled back
    and the run is not touched again.  A worker that is merely busy with a
    step longer than the lease keeps heartbeating and keeps its lease.
"""
import json
import os
import re
import signal
import time

import psycopg2
import pytest

from conftest import (CRASH_PATTERN, GucSetter, ServerLog, connect, expected_agent_ids,
                      expected_event_types, journal_violations, listen_events, listen_notifies, log_timestamp, q,
                      q1, query, report, wait_for_server, wait_until, worker_pids)

N_CRASH_RUNS = 300
CRASH_STEPS = ["slow1", "ins", "slow2", "slow3"]

CRASH_WORKFLOW = """
name: crash_me
steps:
  - id: slow1
    kind: Functional
    function: crash.slow
  - id: ins
    kind: ModelOp
    sql: INSERT INTO crash.sink (k) VALUES ($1) RETURNING k
    params: ["{{ k }}"]
  - id: slow2
    kind: Functional
    function: crash.slow
  - id: slow3
    kind: Functional
    function: crash.slow
    routes: { default: done }
ends:
  - id: done
    status: completed
    response: "{{ ins_result.0.k }}"
"""

STALL_WORKFLOW = """
name: stall_me
steps:
  - id: long
    kind: Functional
    function: crash.insert_then_sleep
    routes: { default: done }
ends:
  - id: done
    status: completed
    response: "{{ long_result }}"
"""


@pytest.fixture(scope="module")
def schema(db):
    conn = connect(db)
    q(conn, "CREATE SCHEMA crash")
    # No unique constraints: a duplicated write must show up as a second row.
    q(conn, "CREATE TABLE crash.sink (k integer NOT NULL)")
    q(conn, "CREATE TABLE crash.stalled (run_key text NOT NULL, pid integer NOT NULL, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())")
    q(conn, """CREATE FUNCTION crash.slow(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               BEGIN PERFORM pg_sleep(0.01); RETURN jsonb_build_object('pid', pg_backend_pid()); END $$""")
    q(conn, """CREATE FUNCTION crash.insert_then_sleep(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
               BEGIN
                   INSERT INTO crash.stalled (run_key, pid) VALUES (ctx ->> 'key', pg_backend_pid());
                   PERFORM pg_sleep((ctx ->> 'sleep')::float8);
                   RETURN jsonb_build_object('pid', pg_backend_pid());
               END $$""")
    q(conn, "SELECT tuvl.register_workflow(%s)", (CRASH_WORKFLOW,))
    q(conn, "SELECT tuvl.register_workflow(%s)", (STALL_WORKFLOW,))
    conn.close()
    return db


def first_log_line(text, pattern):
    for line in text.splitlines():
        if re.search(pattern, line):
            return line
    return None


def test_crash_kill_9_of_a_worker_resumes_every_run_at_once_and_exactly_once(schema, server_log):
    db = schema
    lease_ms = int(query(db, "SELECT setting FROM pg_settings WHERE name = 'tuvl.lease_timeout'")[0][0])
    assert lease_ms == 30000, "this test measures recovery against the default 30 s lease"

    conn = connect(db)
    ids = [r[0] for r in q(conn, "SELECT tuvl.start_run('crash_me', jsonb_build_object('k', g)) "
                                 "FROM generate_series(1, %s) g ORDER BY g", (N_CRASH_RUNS,))]
    # Kill while the batch is well under way: some runs done, many in flight.
    wait_until(lambda: q1(conn, "SELECT count(*) FROM crash.sink WHERE k <= %s",
                          (N_CRASH_RUNS,)) >= N_CRASH_RUNS // 6, 30,
               interval=0.01, message="the first ModelOp writes")
    in_flight = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                         "AND status = 'running'", (ids,))
    done_before = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                           "AND status = 'completed'", (ids,))
    conn.close()
    assert in_flight > 0 and done_before < N_CRASH_RUNS, "the kill must hit runs in flight"

    victim = worker_pids(db)[0]
    mark = server_log.mark()
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)

    # The postmaster notices, terminates every backend and reinitialises.
    server_log.wait_for(mark, r"all server processes terminated; reinitializing", 30)
    wait_for_server()
    ready = first_log_line(server_log.since(mark), r"database system is ready to accept connections")
    conn = connect(db)
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                "AND finished_at IS NULL", (ids,)) == 0,
               25, interval=0.1, message="every run to finish after the crash")
    all_done_after = time.time() - killed_at

    since = log_timestamp(ready) if ready else killed_at
    # The first step executed after the restart, and the first one of a run that a dead
    # worker held at the crash (claimed again: attempt > 1).
    first_any, first_reclaimed = q(conn, """
        SELECT extract(epoch FROM min(e.ts)),
               extract(epoch FROM min(e.ts) FILTER (WHERE r.attempt > 1))
          FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id
         WHERE e.type = 'agent_started' AND e.ts > to_timestamp(%s)""", (since,))[0]
    assert first_any is not None and first_reclaimed is not None
    resume_after = float(first_any) - killed_at
    reclaimed_after = float(first_reclaimed) - killed_at
    ready_after = (log_timestamp(ready) - killed_at) if ready else float("nan")
    reclaimed = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND attempt > 1", (ids,))
    report(f"kill -9 with {in_flight} runs in flight ({done_before} done): server ready after "
          f"{ready_after:.2f} s, first step resumed after {resume_after:.2f} s (first step of a "
          f"reclaimed run after {reclaimed_after:.2f} s), all {N_CRASH_RUNS} runs done "
          f"{all_done_after:.2f} s after the kill; {reclaimed} runs reclaimed")

    assert reclaimed > 0, "runs held at the crash must have been claimed again"
    assert resume_after < 10, f"runs resumed {resume_after:.1f} s after the kill"
    assert reclaimed_after < 10, f"runs held at the crash resumed {reclaimed_after:.1f} s after it"
    assert all_done_after < lease_ms / 1000 * 0.8, \
        "runs held by the dead workers waited for their lease to expire"

    assert q(conn, "SELECT status, count(*) FROM tuvl.runs WHERE id = ANY(%s) GROUP BY 1",
             (ids,)) == [("completed", N_CRASH_RUNS)]
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                    "AND response IS DISTINCT FROM input -> 'k'", (ids,)) == 0
    # Exactly-once database writes: one row per run, none lost, none twice.
    assert q(conn, "SELECT count(*), count(DISTINCT k), min(k), max(k) FROM crash.sink "
                   "WHERE k <= %s", (N_CRASH_RUNS,)) == [(N_CRASH_RUNS, N_CRASH_RUNS, 1, N_CRASH_RUNS)]
    # Journals: gapless, and the same clean history whether or not the run crashed.
    assert journal_violations(conn, ids) == []
    types = expected_event_types(CRASH_STEPS)
    agents = [a or "-" for a in expected_agent_ids(CRASH_STEPS)]
    assert q(conn, """SELECT run_id FROM tuvl.events WHERE run_id = ANY(%s) GROUP BY run_id
                      HAVING array_agg(type ORDER BY seq) <> %s::text[]
                          OR array_agg(coalesce(agent_id, '-') ORDER BY seq) <> %s::text[]
                      LIMIT 5""", (ids, types, agents)) == []
    # The workers are back to their full pool.
    wait_until(lambda: len(worker_pids(db)) == 2, 10, message="two workers after the restart")
    conn.close()


def test_sigterm_of_a_busy_worker_hands_its_runs_to_the_others_at_once(schema, server_log):
    """A worker stopped cleanly mid-batch leaves runs 'running' under its lease; the
    surviving worker's maintenance sees that the holder's process is gone and requeues
    them without waiting for the lease to expire."""
    db = schema
    conn = connect(db)
    assert int(q1(conn, "SELECT setting FROM pg_settings WHERE name = 'tuvl.lease_timeout'")) == 30000
    base, n = 10000, 200
    ids = [r[0] for r in q(conn, "SELECT tuvl.start_run('crash_me', jsonb_build_object('k', g)) "
                                 "FROM generate_series(%s, %s) g", (base + 1, base + n))]
    wait_until(lambda: q1(conn, "SELECT count(*) FROM crash.sink WHERE k > %s", (base,)) >= n // 8,
               30, interval=0.01, message="the first writes")
    victim = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = ANY(%s) AND status = 'running' "
                      "GROUP BY 1 ORDER BY count(*) DESC LIMIT 1", (ids,))
    assert victim in worker_pids(db)
    held = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE lease_owner = %s AND status = 'running'",
              (victim,))
    mark = server_log.mark()
    stopped_at = time.time()
    os.kill(victim, signal.SIGTERM)
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                "AND finished_at IS NULL", (ids,)) == 0,
               20, interval=0.1, message="every run to finish after the SIGTERM")
    took = time.time() - stopped_at
    reclaimed = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND attempt > 1", (ids,))
    report(f"SIGTERM of worker {victim} holding {held} runs: all {n} runs done {took:.2f} s later; "
          f"{reclaimed} reclaimed")
    assert reclaimed > 0
    assert took < 15, "the dead holder's runs waited for their lease"
    # A clean stop is no crash: the postmaster did not reinitialise.
    assert not re.search(CRASH_PATTERN, server_log.since(mark))
    assert q(conn, "SELECT status, count(*) FROM tuvl.runs WHERE id = ANY(%s) GROUP BY 1", (ids,)) \
        == [("completed", n)]
    assert q(conn, "SELECT count(*), count(DISTINCT k) FROM crash.sink WHERE k > %s", (base,)) == \
        [(n, n)]
    assert journal_violations(conn, ids) == []
    types = expected_event_types(CRASH_STEPS)
    assert q(conn, """SELECT run_id FROM tuvl.events WHERE run_id = ANY(%s) GROUP BY run_id
                      HAVING array_agg(type ORDER BY seq) <> %s::text[] LIMIT 5""",
             (ids, types)) == []
    wait_until(lambda: len(worker_pids(db)) == 2, 5, message="the replacement worker")
    conn.close()


@pytest.fixture(scope="module")
def stall(schema):
    """SIGSTOP the worker executing a 4 s step under a 2 s lease; SIGCONT it once the
    other worker has completed the run.  Returns what happened, for the tests below."""
    db = schema
    log = ServerLog()
    gucs = GucSetter()
    try:
        # a batch long enough for the 4 s step: the worker is stopped inside
        # a batch, not after the budget sent the step to run alone (which,
        # on a loaded machine, could happen between the check and the stop)
        gucs({"tuvl.lease_timeout": ("2s", "2s"), "tuvl.heartbeat_interval": ("500ms", "500ms"),
              "tuvl.max_batch_time": ("10s", "10s")})
        wait_until(lambda: len(worker_pids(db)) == 2, 10, message="two workers",
                   ignore=(psycopg2.OperationalError,))
        conn = connect(db)
        listener = connect(db)
        listen_events(listener)
        mark = log.mark()
        run_id = q1(conn, "SELECT tuvl.start_run('stall_me', %s)", ('{"key": "stall", "sleep": 4}',))

        def holder_in_step():
            status, owner = q(conn, "SELECT status, lease_owner FROM tuvl.runs WHERE id = %s",
                              (run_id,))[0]
            if status != "running" or owner is None:
                return None
            rows = query("postgres", "SELECT state, query, wait_event FROM pg_stat_activity "
                                     "WHERE pid = %s", (owner,))
            if rows and rows[0][0] == "active" and rows[0][1].startswith("tuvl advancing") \
                    and rows[0][2] == "PgSleep":
                return owner
            return None

        stalled = wait_until(holder_in_step, 10, interval=0.02,
                             message="a worker sleeping inside the step")
        others = [p for p in worker_pids(db) if p != stalled]
        os.kill(stalled, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            status = wait_until(
                lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s "
                                 "AND status NOT IN ('queued', 'running')", (run_id,)),
                20, interval=0.1, message="the other worker to take the run over and finish it")
            took = time.monotonic() - stopped_at
        finally:
            os.kill(stalled, signal.SIGCONT)
        report(f"SIGSTOPped worker {stalled}: run {run_id} {status} by the other worker "
              f"{took:.2f} s after the stop (lease 2 s, step 4 s)")
        # The stalled worker wakes up inside its step, finishes it and tries to write:
        # wait until it has said something about the run, then a little longer.
        log.wait_for(mark, rf"\[{stalled}\].*\brun {run_id}\b", 15)
        time.sleep(1.0)
        stall_log = log.since(mark)
        heard = [json.loads(n.payload) for n in listen_notifies(listener, 0.5, lambda got: False,
                                                                 complete=True)]
        listener.close()

        # Under the same short lease, a worker that is merely busy keeps its lease for
        # as long as its step takes: it heartbeats while executing.
        long_mark = log.mark()
        long_id = q1(conn, "SELECT tuvl.start_run('stall_me', %s)", ('{"key": "long", "sleep": 3.5}',))
        long_status = q1(conn, "SELECT tuvl.wait(%s, '15 s')", (long_id,))
        yield {
            "conn": conn, "run_id": run_id, "status": status, "stalled": stalled,
            "others": others, "log": stall_log, "db": db,
            "heard": [(p["seq"], p["type"]) for p in heard if p["run_id"] == run_id],
            "long_id": long_id, "long_status": long_status, "long_log": log.since(long_mark),
        }
        conn.close()
    finally:
        try:
            os.kill(stalled, signal.SIGCONT)
        except (NameError, ProcessLookupError):
            pass
        gucs.reset()


def test_sigstopped_worker_loses_the_run_which_completes_exactly_once(stall):
    conn, run_id = stall["conn"], stall["run_id"]
    assert stall["status"] == "completed"
    status, attempt, error, response = q(
        conn, "SELECT status, attempt, error, response FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    # Still completed after the stalled worker woke up, on the second claim.
    assert (status, error) == ("completed", None)
    assert attempt == 2, "the run must have completed on its second claim"
    # Exactly one row: the stalled attempt's insert rolled back with its transition.
    rows = q(conn, "SELECT pid FROM crash.stalled WHERE run_key = 'stall'")
    assert len(rows) == 1, f"rows written by the step: {rows}"
    assert rows[0][0] != stall["stalled"] and rows[0][0] in stall["others"]
    assert response == {"pid": rows[0][0]}
    # One clean journal, written by the second claim only.
    assert journal_violations(conn, [run_id]) == []
    events = q(conn, "SELECT type FROM tuvl.events WHERE run_id = %s ORDER BY seq", (run_id,))
    assert [e[0] for e in events] == expected_event_types(["long"])
    assert q1(conn, "SELECT (payload ->> 'attempt')::int FROM tuvl.events "
                    "WHERE run_id = %s AND type = 'run_started'", (run_id,)) == 2
    # Listeners heard the committed journal only, once: nothing of the stalled attempt.
    assert stall["heard"] == [(i + 1, t) for i, t in enumerate(expected_event_types(["long"]))]
    # The stalled worker survived its lost lease and is still in the pool.
    assert stall["stalled"] in worker_pids(stall["db"])


def test_stalled_worker_reports_the_lost_lease_in_the_server_log(stall):
    """The fenced checkpoint comes before the journal write, so the stalled worker finds
    its lease lost (it used to fail on the journal's primary key instead)."""
    run_id = stall["run_id"]
    mine = [l for l in stall["log"].splitlines() if f"[{stall['stalled']}]" in l]
    assert any(re.search(rf"lease on run {run_id} was lost|lost the lease on run {run_id}\b", l)
               for l in mine), "server log lines of the stalled worker:\n" + "\n".join(mine)


def test_a_step_longer_than_the_lease_keeps_it_while_its_worker_is_alive(stall):
    conn, run_id = stall["conn"], stall["long_id"]
    assert stall["long_status"] == "completed"
    assert q1(conn, "SELECT attempt FROM tuvl.runs WHERE id = %s", (run_id,)) == 1, \
        "a 3.5 s step under a 2 s lease must not be taken over"
    assert q1(conn, "SELECT count(*) FROM crash.stalled WHERE run_key = 'long'") == 1
    assert journal_violations(conn, [run_id]) == []
    assert not re.search(rf"\brun {run_id}\b", stall["long_log"]), stall["long_log"]
