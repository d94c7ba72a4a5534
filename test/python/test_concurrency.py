"""Many runs, two workers: every run completes exactly once with a clean journal.

2,000 runs of a 5-step workflow (four Functional steps and one ModelOp INSERT)
are queued in one transaction and executed by the default pool of two
workers.  The checks are made in SQL over tuvl.runs, tuvl.events and the table
the ModelOp writes, so they cover every run, not a sample.  Further tests
cover failing transitions inside a batch, runs queued concurrently from many
sessions, and the commit-time wake-up of idle workers.
"""
import statistics
import threading
import time

import pytest

from conftest import (connect, expected_agent_ids, expected_event_types, journal_violations, q, q1,
                      report, wait_until, worker_pids)

N_RUNS = 2000
STEPS = ["first", "second", "ins", "third", "last"]

WORKFLOW = """
name: conc_five
steps:
  - id: first
    kind: Functional
    function: conc.where_am_i
  - id: second
    kind: Functional
    function: conc.where_am_i
  - id: ins
    kind: ModelOp
    sql: INSERT INTO conc.sink (k, pid) VALUES ($1, pg_backend_pid()) RETURNING k, pid
    params: ["{{ k }}"]
  - id: third
    kind: Functional
    function: conc.where_am_i
  - id: last
    kind: Functional
    function: conc.finish
    routes: { ok: done }
ends:
  - id: done
    status: completed
    response: "{{ ins_result.0.k }}"
"""

MIXED_WORKFLOW = """
name: conc_mixed
steps:
  - id: write
    kind: ModelOp
    sql: INSERT INTO conc.mixed (k, step) VALUES ($1, 'write') RETURNING k
    params: ["{{ k }}"]
  - id: risky
    kind: Functional
    function: conc.write_then_maybe_fail
    routes: { default: done }
ends:
  - { id: done, status: completed }
"""

TINY_WORKFLOW = """
name: conc_tiny
steps:
  - { id: only, kind: Functional, function: conc.where_am_i, routes: { default: done } }
ends:
  - { id: done, status: completed }
"""

# Runs of the big batch, for queries that must not see other tests' runs.
BIG = "(SELECT id FROM tuvl.runs WHERE workflow = 'conc_five')"


@pytest.fixture(scope="module")
def schema(db):
    conn = connect(db)
    q(conn, "CREATE SCHEMA conc")
    # No unique constraints on purpose: a duplicated write must show up as a row.
    q(conn, "CREATE TABLE conc.sink (k integer NOT NULL, pid integer NOT NULL)")
    q(conn, "CREATE TABLE conc.mixed (k integer NOT NULL, step text NOT NULL)")
    q(conn, """CREATE FUNCTION conc.where_am_i(ctx jsonb) RETURNS jsonb LANGUAGE sql
               AS $$ SELECT jsonb_build_object('pid', pg_backend_pid()) $$""")
    q(conn, """CREATE FUNCTION conc.finish(ctx jsonb) RETURNS jsonb LANGUAGE sql
               AS $$ SELECT jsonb_build_object('pid', pg_backend_pid(), 'signal', 'ok') $$""")
    q(conn, """CREATE FUNCTION conc.write_then_maybe_fail(ctx jsonb) RETURNS jsonb
               LANGUAGE plpgsql AS $$
               BEGIN
                   INSERT INTO conc.mixed (k, step) VALUES ((ctx ->> 'k')::int, 'risky');
                   IF (ctx ->> 'k')::int % 3 = 0 THEN
                       RAISE EXCEPTION 'run with k=% refuses', ctx ->> 'k';
                   END IF;
                   RETURN '{}';
               END $$""")
    for wf in (WORKFLOW, MIXED_WORKFLOW, TINY_WORKFLOW):
        q(conn, "SELECT tuvl.register_workflow(%s)", (wf,))
    conn.close()
    return db


@pytest.fixture(scope="module")
def finished(schema):
    """Queue N_RUNS runs in one transaction and wait until they have all finished."""
    conn = connect(schema)
    workers = worker_pids(schema)
    assert len(workers) == 2, f"expected the default pool of 2 workers, found {workers}"
    started = time.monotonic()
    q(conn, "SELECT count(tuvl.start_run('conc_five', jsonb_build_object('k', g))) "
            "FROM generate_series(1, %s) g", (N_RUNS,))
    wait_until(lambda: q1(conn, f"SELECT count(*) FROM tuvl.runs WHERE id IN {BIG} "
                                "AND finished_at IS NOT NULL") == N_RUNS,
               90, interval=0.2, message=f"{N_RUNS} runs to finish")
    elapsed = time.monotonic() - started
    report(f"{N_RUNS} runs x {len(STEPS)} steps with 2 workers: {elapsed:.2f} s "
          f"({N_RUNS / elapsed:.0f} runs/s, {N_RUNS * len(STEPS) / elapsed:.0f} steps/s)")
    yield conn
    conn.close()


def test_every_run_completes_at_its_end_with_the_rendered_response(finished):
    rows = q(finished, f"SELECT status, end_name, count(*) FROM tuvl.runs WHERE id IN {BIG} "
                       "GROUP BY 1, 2")
    assert rows == [("completed", "done", N_RUNS)]
    wrong = q(finished, f"""SELECT id, input, response, error FROM tuvl.runs WHERE id IN {BIG}
                             AND (response IS DISTINCT FROM input -> 'k' OR error IS NOT NULL
                                  OR current_step IS NOT NULL OR lease_owner IS NOT NULL)
                            LIMIT 5""")
    assert wrong == []


def test_every_journal_is_gapless_one_to_n(finished):
    assert journal_violations(finished) == []
    assert q1(finished, f"SELECT count(DISTINCT run_id) FROM tuvl.events WHERE run_id IN {BIG}") \
        == N_RUNS


def test_every_journal_has_the_expected_event_order(finished):
    types = expected_event_types(STEPS)
    agents = [a or "-" for a in expected_agent_ids(STEPS)]
    rows = q(finished, f"""
        SELECT run_id, array_agg(type ORDER BY seq), array_agg(agent_id ORDER BY seq)
          FROM tuvl.events WHERE run_id IN {BIG} GROUP BY run_id
        HAVING array_agg(type ORDER BY seq) <> %s::text[]
            OR array_agg(coalesce(agent_id, '-') ORDER BY seq) <> %s::text[]
         LIMIT 3""", (types, agents))
    assert rows == [], f"runs with an unexpected journal (expected {types})"
    # The signals are the ones the steps produced.
    signals = q(finished, f"""SELECT agent_id, payload ->> 'signal', count(*) FROM tuvl.events
                              WHERE run_id IN {BIG} AND type = 'signal' GROUP BY 1, 2""")
    assert sorted(signals) == sorted([(s, "ok" if s == "last" else "default", N_RUNS)
                                      for s in STEPS])


def test_modelop_insert_happened_exactly_once_per_run(finished):
    count, distinct, lo, hi = q(finished, "SELECT count(*), count(DISTINCT k), min(k), max(k) "
                                          "FROM conc.sink")[0]
    assert (count, distinct, lo, hi) == (N_RUNS, N_RUNS, 1, N_RUNS)
    # And the row each run's checkpoint records is the row in the table.
    mismatched = q1(finished, f"""SELECT count(*) FROM tuvl.runs r
                                   JOIN conc.sink s ON s.k = (r.input ->> 'k')::int
                                  WHERE r.id IN {BIG}
                                    AND (r.context -> 'ins_result' -> 0 ->> 'pid')::int <> s.pid""")
    assert mismatched == 0


def test_each_run_was_advanced_by_one_claim_of_one_worker(finished):
    # Nothing crashed: every run was claimed exactly once.
    assert q(finished, f"SELECT attempt, count(*) FROM tuvl.runs WHERE id IN {BIG} GROUP BY 1") \
        == [(1, N_RUNS)]
    assert q1(finished, f"""SELECT count(*) FROM tuvl.events WHERE run_id IN {BIG}
                             AND type = 'run_started' AND (payload ->> 'attempt')::int = 1""") \
        == N_RUNS
    # Every step of a run ran in the same backend: one worker advanced it.
    split = q(finished, f"""
        SELECT run_id, array_agg(DISTINCT pid) FROM (
            SELECT run_id, coalesce((payload -> 'output' ->> 'pid')::int,
                                    (payload -> 'output' -> 0 ->> 'pid')::int) AS pid
              FROM tuvl.events WHERE run_id IN {BIG} AND type = 'agent_completed') s
         GROUP BY run_id HAVING count(DISTINCT pid) <> 1 OR count(pid) <> {len(STEPS)} LIMIT 5""")
    assert split == []
    # Both workers of the pool took part, and nothing else executed steps.
    pids = {r[0] for r in q(finished, "SELECT DISTINCT pid FROM conc.sink")}
    assert len(pids) == 2, f"expected both workers to execute runs, saw pids {pids}"
    assert pids <= set(worker_pids(finished.info.dbname))


def test_a_failing_transition_rolls_back_alone_inside_a_batch(finished, schema):
    """Runs advance many per transaction; one step's error must undo only that step."""
    conn = connect(schema)
    n = 300
    q(conn, "SELECT count(tuvl.start_run('conc_mixed', jsonb_build_object('k', g))) "
            "FROM generate_series(1, %s) g", (n,))
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = 'conc_mixed' "
                                "AND finished_at IS NOT NULL") == n, 30, interval=0.1,
               message="the mixed runs to finish")
    by_status = dict(q(conn, "SELECT status, count(*) FROM tuvl.runs "
                             "WHERE workflow = 'conc_mixed' GROUP BY 1"))
    assert by_status == {"completed": n - n // 3, "failed": n // 3}
    wrong = q(conn, """SELECT id, status, input FROM tuvl.runs WHERE workflow = 'conc_mixed'
                       AND (status = 'failed') <> ((input ->> 'k')::int % 3 = 0) LIMIT 5""")
    assert wrong == []
    # Every run's first step committed; the failing step's own write did not.
    assert q1(conn, "SELECT count(*) FROM conc.mixed WHERE step = 'write'") == n
    assert q(conn, "SELECT count(*), count(DISTINCT k) FROM conc.mixed WHERE step = 'risky'") == \
        [(n - n // 3, n - n // 3)]
    assert q1(conn, "SELECT count(*) FROM conc.mixed WHERE step = 'risky' AND k % 3 = 0") == 0
    # The failure itself is journaled and committed.
    ids = [r[0] for r in q(conn, "SELECT id FROM tuvl.runs WHERE workflow = 'conc_mixed'")]
    assert journal_violations(conn, ids) == []
    assert q1(conn, """SELECT count(*) FROM tuvl.runs r WHERE workflow = 'conc_mixed'
                        AND status = 'failed' AND error LIKE 'step "risky" failed: run with k=% refuses'
                        AND (SELECT type FROM tuvl.events e WHERE e.run_id = r.id
                              ORDER BY seq DESC LIMIT 1) = 'run_failed'""") == n // 3
    conn.close()


def test_runs_queued_concurrently_from_many_sessions_all_complete_once(finished, schema):
    threads, per_thread = 8, 40
    errors = []
    ids = []
    lock = threading.Lock()

    def producer(t):
        try:
            c = connect(schema)
            mine = [q1(c, "SELECT tuvl.start_run('conc_tiny', jsonb_build_object('t', %s, 'i', %s))",
                       (t, i)) for i in range(per_thread)]
            c.close()
            with lock:
                ids.extend(mine)
        except Exception as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=producer, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors
    assert len(ids) == len(set(ids)) == threads * per_thread
    conn = connect(schema)
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                "AND status = 'completed'", (ids,)) == len(ids), 20, interval=0.1,
               message="every concurrently queued run to complete")
    assert q(conn, "SELECT attempt, count(*) FROM tuvl.runs WHERE id = ANY(%s) GROUP BY 1",
             (ids,)) == [(1, len(ids))]
    assert journal_violations(conn, ids) == []
    assert q1(conn, """SELECT count(*) FROM tuvl.events WHERE run_id = ANY(%s)
                        AND type = 'run_completed'""", (ids,)) == len(ids)
    conn.close()


def test_idle_workers_wake_at_commit_not_at_their_next_poll(finished, schema):
    """start_run wakes the workers when its transaction commits; the fallback timer
    of an idle worker is 1 s, so a median pickup of well under 100 ms shows the push."""
    conn = connect(schema)
    ids = []
    for _ in range(15):
        ids.append(q1(conn, "SELECT tuvl.start_run('conc_tiny')"))
        time.sleep(0.07)
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                "AND status = 'completed'", (ids,)) == len(ids), 10,
               message="the runs to complete")
    delays = [float(r[0]) for r in q(conn, """
        SELECT extract(epoch FROM s.ts - qd.ts)
          FROM tuvl.events qd JOIN tuvl.events s ON s.run_id = qd.run_id AND s.type = 'run_started'
         WHERE qd.type = 'run_queued' AND qd.run_id = ANY(%s)""", (ids,))]
    assert len(delays) == len(ids)
    median = statistics.median(delays)
    report(f"start_run -> run_started: median {median * 1000:.1f} ms, max {max(delays) * 1000:.1f} ms")
    assert median < 0.1, f"median pickup {median:.3f} s: workers are polling, not woken"
    assert max(delays) < 0.6
    conn.close()
