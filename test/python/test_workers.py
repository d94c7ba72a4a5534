"""The launcher and the worker pools: start, stop, replace, resize, report.

Workers are background processes visible in pg_stat_activity with
backend_type 'tuvl worker' and application_name 'tuvl worker N'.  CREATE and
DROP EXTENSION start and stop a database's pool without a server restart.
"""
import concurrent.futures
import os
import re
import signal
import threading
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import (GucSetter, ServerLog, connect, launcher_pid, q, q1, query, reload_conf,
                      report, wait_until, worker_pids, worker_rows)

EXPECTED_NAMES = ["tuvl worker 1", "tuvl worker 2"]


def pool_names(dbname):
    return sorted(r[1] for r in worker_rows(dbname))


def tuvl_database(fresh_databases, name):
    """A new database with the extension, once its two workers run: a
    connection to it (the caller closes it)."""
    name = fresh_databases(name)
    conn = connect(name)
    q(conn, "CREATE EXTENSION tuvl")
    wait_until(lambda: pool_names(name) == EXPECTED_NAMES, 10, message="two workers")
    return conn


def one_step_workflow(conn, name, result):
    """Register workflow name: one Functional step, public.<name>, returning result (SQL)."""
    q(conn, f"CREATE FUNCTION public.{name}(ctx jsonb) RETURNS jsonb LANGUAGE sql "
            f"AS $$ SELECT {result}::jsonb $$")
    q(conn, f"""SELECT tuvl.register_workflow($$
name: {name}
steps:
  - {{ id: s, kind: Functional, function: public.{name} }}
ends:
  - {{ id: done, status: completed }}
$$)""")


def timed_wait(predicate, timeout, message):
    started = time.monotonic()
    wait_until(predicate, timeout, interval=0.02, message=message)
    return time.monotonic() - started


def test_create_and_drop_extension_start_and_stop_the_pool(fresh_databases):
    name = fresh_databases("tuvl_workers_lifecycle")
    conn = connect(name)
    try:
        # The launcher may probe the new database with one worker, which must leave
        # again since the extension is not there.
        wait_until(lambda: not worker_pids(name), 15, interval=0.1,
                   message="no worker in a database without the extension")

        q(conn, "CREATE EXTENSION tuvl")
        took = timed_wait(lambda: pool_names(name) == EXPECTED_NAMES, 2,
                          "two workers after CREATE EXTENSION")
        # Every backend named like a worker is one (no impostor, no leftover probe).
        rows = query(name, "SELECT pid, backend_type, application_name FROM pg_stat_activity "
                           "WHERE datname = current_database() "
                           "AND application_name LIKE 'tuvl worker%%'")
        assert sorted(r[1:] for r in rows) == [("tuvl worker", n) for n in EXPECTED_NAMES], rows
        report(f"CREATE EXTENSION -> 2 workers in {took:.2f} s")

        old = set(worker_pids(name))
        q(conn, "DROP EXTENSION tuvl")
        took_drop = timed_wait(lambda: not worker_pids(name), 2, "the workers to exit after DROP")
        report(f"DROP EXTENSION -> workers gone in {took_drop:.2f} s")
        # They stay gone (nothing restarts them in a database without the extension).
        time.sleep(1.0)
        assert worker_pids(name) == []

        q(conn, "CREATE EXTENSION tuvl")
        took_again = timed_wait(lambda: pool_names(name) == EXPECTED_NAMES, 2,
                                "two workers after CREATE EXTENSION again")
        assert not old & set(worker_pids(name)), "the pool must be new processes"
        report(f"CREATE EXTENSION again -> 2 workers in {took_again:.2f} s")
        # A recreated extension has a working pool: it executes runs.
        one_step_workflow(conn, "after_recreate", """'{"one": 1}'""")
        run_id = q1(conn, "SELECT tuvl.start_run('after_recreate')")
        assert q1(conn, "SELECT tuvl.wait(%s, '5 s')", (run_id,)) == "completed"
    finally:
        conn.close()


BUSY_WORKFLOW = """
name: busy
steps:
  - { id: a, kind: Functional, function: public.nap }
  - { id: b, kind: Functional, function: public.nap }
ends:
  - { id: done, status: completed }
"""


def start_busy_runs(conn, name, n=400):
    """Install the extension and leave runs executing in both workers."""
    q(conn, "CREATE EXTENSION tuvl")
    wait_until(lambda: pool_names(name) == EXPECTED_NAMES, 3, message="the pool")
    q(conn, """CREATE OR REPLACE FUNCTION public.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql
               AS $$ BEGIN PERFORM pg_sleep(0.02); RETURN '{}'; END $$""")
    q(conn, "SELECT tuvl.register_workflow(%s)", (BUSY_WORKFLOW,))
    q(conn, "SELECT count(tuvl.start_run('busy')) FROM generate_series(1, %s)", (n,))
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE status = 'completed'") > 0,
               10, message="the first completed runs")
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE status = 'running'") > 0


def test_drop_extension_while_runs_execute_stops_the_pool_cleanly(fresh_databases, server_log):
    name = fresh_databases("tuvl_workers_busy_drop")
    conn = connect(name)
    try:
        start_busy_runs(conn, name)
        mark = server_log.mark()
        q(conn, "SET statement_timeout = '10s'")
        started = time.monotonic()
        deadlocks = 0
        while True:
            try:
                q(conn, "DROP EXTENSION tuvl")
                break
            except psycopg2.errors.DeadlockDetected:
                # see test_drop_extension_while_runs_execute_does_not_deadlock
                deadlocks += 1
                assert deadlocks < 5
        dropped = time.monotonic() - started
        gone = timed_wait(lambda: not worker_pids(name), 2, "the workers to exit after DROP")
        report(f"DROP EXTENSION with runs in flight took {dropped:.2f} s ({deadlocks} deadlocks); "
              f"workers gone {gone:.2f} s later")
        assert dropped < 10
        time.sleep(0.5)
        log = server_log.since(mark)
        assert not re.search(r"terminated by signal|reinitializing|PANIC", log), log
        assert worker_pids(name) == []
        # The extension comes back empty and working.
        q(conn, "CREATE EXTENSION tuvl")
        wait_until(lambda: pool_names(name) == EXPECTED_NAMES, 3, message="the pool again")
        assert q1(conn, "SELECT count(*) FROM tuvl.runs") == 0
        q(conn, "SELECT tuvl.register_workflow(%s)", (BUSY_WORKFLOW,))
        run_id = q1(conn, "SELECT tuvl.start_run('busy')")
        assert q1(conn, "SELECT tuvl.wait(%s, '5 s')", (run_id,)) == "completed"
    finally:
        conn.close()


LONG_WORKFLOW = "name: long_busy\nsteps:\n" + "".join(
    f"  - {{ id: s{i}, kind: Functional, function: public.nap }}\n" for i in range(10)) + \
    "ends:\n  - { id: done, status: completed }\n"


def test_drop_extension_while_runs_execute_does_not_deadlock(fresh_databases, server_log):
    """DROP EXTENSION locks tuvl.runs before tuvl.events; a worker's transition must not
    hold the journal while it queues for tuvl.runs (it used to: 'deadlock detected').
    Deterministic form of the race: a session holding a lock on tuvl.runs makes DROP
    wait there (as a worker's long batch would) while the workers start transitions."""
    name = fresh_databases("tuvl_workers_deadlock")
    conn = connect(name)
    holder = connect(name, autocommit=False)
    try:
        q(conn, "CREATE EXTENSION tuvl")
        wait_until(lambda: pool_names(name) == EXPECTED_NAMES, 3, message="the pool")
        q(conn, """CREATE FUNCTION public.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql
                   AS $$ BEGIN PERFORM pg_sleep(0.005); RETURN '{}'; END $$""")
        q(conn, "SELECT tuvl.register_workflow(%s)", (LONG_WORKFLOW,))
        q(conn, "SELECT count(tuvl.start_run('long_busy')) FROM generate_series(1, 300)")
        wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE status = 'running'") >= 128,
                   5, message="both workers holding runs")
        q(holder, "LOCK TABLE tuvl.runs IN ACCESS SHARE MODE")
        mark = server_log.mark()
        q(conn, "SET statement_timeout = '15s'")
        outcome = {}

        def drop():
            try:
                q(conn, "DROP EXTENSION tuvl")
                outcome["ok"] = True
            except psycopg2.Error as exc:
                outcome["error"] = exc

        t = threading.Thread(target=drop)
        t.start()
        time.sleep(1.5)
        holder.commit()
        t.join(20)
        deadlocks = [l for l in server_log.since(mark).splitlines() if "deadlock detected" in l]
        assert "error" not in outcome, f"DROP EXTENSION failed: {outcome['error']}"
        assert outcome.get("ok")
        assert deadlocks == [], deadlocks
        wait_until(lambda: not worker_pids(name), 2, message="the workers to exit")
    finally:
        holder.close()
        conn.close()


def test_create_extension_in_a_long_transaction_still_starts_the_pool(fresh_databases):
    slow = fresh_databases("tuvl_workers_slow_create")
    other = fresh_databases("tuvl_workers_other")
    wait_until(lambda: not worker_pids(slow), 15, interval=0.1,
               message="no worker in a database without the extension")
    conn = connect(slow, autocommit=False)
    try:
        q(conn, "CREATE EXTENSION tuvl")  # not committed yet
        # Anything that makes the launcher look at the databases meanwhile, e.g. a
        # CREATE EXTENSION elsewhere, probes this one and finds no extension yet.
        oc = connect(other)
        q(oc, "CREATE EXTENSION tuvl")
        oc.close()
        wait_until(lambda: len(worker_pids(other)) == 2, 3, message="the other database's pool")
        time.sleep(1.0)
        conn.commit()
        took = timed_wait(lambda: pool_names(slow) == EXPECTED_NAMES, 3,
                          "two workers once the CREATE EXTENSION committed")
        report(f"CREATE EXTENSION committed after a probe -> workers in {took:.2f} s")
    finally:
        conn.close()


def test_sigterm_stops_a_worker_at_once_and_the_launcher_replaces_it(db):
    before = worker_rows(db)
    assert [r[1] for r in before] and sorted(r[1] for r in before) == EXPECTED_NAMES
    victim, victim_name = before[0][0], before[0][1]
    survivor = before[1][0]
    os.kill(victim, signal.SIGTERM)
    took = timed_wait(lambda: victim not in worker_pids(db), 1, "the worker to exit on SIGTERM")
    replaced = timed_wait(lambda: pool_names(db) == EXPECTED_NAMES and victim not in worker_pids(db),
                          3, "the launcher to start a replacement")
    after = {r[0]: r[1] for r in worker_rows(db)}
    assert survivor in after, "the other worker must not be touched"
    new = [p for p in after if p != survivor]
    assert len(new) == 1 and after[new[0]] == victim_name, after
    report(f"SIGTERM: worker gone in {took:.2f} s, replaced {replaced:.2f} s later")
    # The replacement executes runs.
    conn = connect(db)
    try:
        q(conn, "CREATE FUNCTION public.noop(ctx jsonb) RETURNS jsonb LANGUAGE sql "
                "AS $$ SELECT '{}'::jsonb $$")
        q(conn, """SELECT tuvl.register_workflow($$
name: after_sigterm
steps:
  - { id: s, kind: Functional, function: public.noop }
ends:
  - { id: done, status: completed }
$$)""")
        ids = [r[0] for r in q(conn, "SELECT tuvl.start_run('after_sigterm') "
                                     "FROM generate_series(1, 20)")]
        assert q1(conn, "SELECT tuvl.wait(%s, '5 s')", (ids[-1],)) == "completed"
        wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                                    "AND status = 'completed'", (ids,)) == 20, 5,
                   message="every run to complete")
    finally:
        conn.close()


def test_config_reload_does_not_crash_the_server(db):
    """pg_reload_conf() used to crash the launcher (SIGSEGV: its list of databases was
    freed with the transaction that built it) and so reinitialise the whole cluster."""
    log = ServerLog()
    mark = log.mark()
    launcher_before = launcher_pid()
    pids_before = worker_pids(db)
    crashed = reload_conf()
    time.sleep(0.5)
    text = log.since(mark)
    assert not crashed, "server log after pg_reload_conf():\n" + "\n".join(
        l for l in text.splitlines() if re.search(r"signal|terminat|reinitial", l))
    assert launcher_pid() == launcher_before
    assert worker_pids(db) == pids_before


def test_workers_per_database_grows_and_shrinks_the_pool_on_reload(db):
    gucs = GucSetter()
    try:
        before = set(worker_pids(db))
        assert len(before) == 2
        gucs({"tuvl.workers_per_database": ("3", "3")})
        took = timed_wait(lambda: len(worker_pids(db)) == 3, 5, "the pool to grow to 3")
        grown = set(worker_pids(db))
        assert before <= grown, "growing the pool must keep the running workers"
        assert pool_names(db) == ["tuvl worker 1", "tuvl worker 2", "tuvl worker 3"]

        gucs({"tuvl.workers_per_database": ("1", "1")})
        took2 = timed_wait(lambda: len(worker_pids(db)) == 1, 5, "the pool to shrink to 1")
        # Stay at the new size: the launcher must not start the stopped ones again.
        time.sleep(1.0)
        left = set(worker_pids(db))
        assert len(left) == 1 and left <= grown, "shrinking must stop workers, not replace them"

        # No pool at all: runs wait in the queue until workers come back.
        gucs({"tuvl.workers_per_database": ("0", "0")})
        took3 = timed_wait(lambda: not worker_pids(db), 5, "the pool to shrink to 0")
        conn = connect(db)
        try:
            q(conn, """CREATE OR REPLACE FUNCTION public.tick(ctx jsonb) RETURNS jsonb
                       LANGUAGE sql AS $$ SELECT '{}'::jsonb $$""")
            q(conn, """SELECT tuvl.register_workflow($$
name: while_no_pool
steps:
  - { id: s, kind: Functional, function: public.tick }
ends:
  - { id: done, status: completed }
$$)""")
            run_id = q1(conn, "SELECT tuvl.start_run('while_no_pool')")
            assert q1(conn, "SELECT tuvl.wait(%s, '1 s')", (run_id,)) == "queued"
            gucs.reset()
            took4 = timed_wait(lambda: len(worker_pids(db)) == 2, 5, "the default pool again")
            assert q1(conn, "SELECT tuvl.wait(%s, '5 s')", (run_id,)) == "completed"
        finally:
            conn.close()
        report(f"pool 2 -> 3 in {took:.2f} s, 3 -> 1 in {took2:.2f} s, 1 -> 0 in {took3:.2f} s, "
              f"0 -> 2 in {took4:.2f} s")
    finally:
        gucs.reset()
        wait_until(lambda: len(worker_pids(db)) == 2, 10, message="the default pool of 2 again",
                   ignore=(psycopg2.OperationalError,))


def test_runs_per_worker_bounds_the_runs_a_worker_holds(db, set_gucs):
    set_gucs({"tuvl.runs_per_worker": ("5", "5")})
    conn = connect(db)
    try:
        q(conn, """CREATE OR REPLACE FUNCTION public.short_nap(ctx jsonb) RETURNS jsonb
                   LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.05); RETURN '{}'; END $$""")
        q(conn, """SELECT tuvl.register_workflow($$
name: bounded
steps:
  - { id: a, kind: Functional, function: public.short_nap }
  - { id: b, kind: Functional, function: public.short_nap }
ends:
  - { id: done, status: completed }
$$)""")
        ids = [r[0] for r in q(conn, "SELECT tuvl.start_run('bounded') FROM generate_series(1, 40)")]
        per_owner_max, total_max = 0, 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            rows = q(conn, "SELECT lease_owner, count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                           "AND status = 'running' GROUP BY 1", (ids,))
            per_owner_max = max([per_owner_max] + [r[1] for r in rows])
            total_max = max(total_max, sum(r[1] for r in rows))
            if q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                        "AND finished_at IS NULL", (ids,)) == 0:
                break
            time.sleep(0.03)
        report(f"runs_per_worker = 5: at most {per_owner_max} runs per worker, "
              f"{total_max} in all")
        assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) "
                        "AND status = 'completed'", (ids,)) == 40
        assert per_owner_max == 5, "a worker must hold up to, and never more than, 5 runs"
        assert total_max > 5, "both workers must have held runs"
    finally:
        conn.close()


def queue_and_finish(conn, workflow, n):
    """n runs of workflow queued in one transaction, waited for until the last completed."""
    conn.autocommit = False
    last = q(conn, "SELECT max(tuvl.start_run(%s)) FROM generate_series(1, %s)", (workflow, n))[0][0]
    conn.commit()
    conn.autocommit = True
    assert q1(conn, "SELECT tuvl.wait(%s, '60 s')", (last,)) == "completed"


def test_claims_find_runs_by_index_after_the_queue_grew(fresh_databases):
    """The plans of the claim and of the maintenance's UPDATEs by id are made
    once per worker, at its first claim and maintenance, here while tuvl.runs
    holds a run or two; 2,000 runs queued after must still be claimed and
    maintained through the indexes, not by a sequential scan of the table per
    statement (a generic plan made on a near-empty table is one, and stays one
    until the next ANALYZE).  It also reports how many entries of the queue's
    index the claims read: each run's about once when the two workers' claims
    do not overlap (bench/fairness.py measures what that is worth)."""
    conn = tuvl_database(fresh_databases, "tuvl_claim_plan")
    try:
        # so that this test's own lookups by id do not count
        q(conn, "SET enable_seqscan = off")
        one_step_workflow(conn, "claim_plan", "'{}'")
        # one run for each worker's first claim, on a table of one or two rows
        for _ in range(2):
            first = q1(conn, "SELECT tuvl.start_run('claim_plan')")
            assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (first,)) == "completed"

        def scans():
            return q(conn, "SELECT coalesce(seq_tup_read, 0), n_tup_upd, "
                           "       (SELECT idx_tup_read FROM pg_stat_all_indexes "
                           "         WHERE indexrelid = 'tuvl.runs_queued_fair_idx'::regclass) "
                           "FROM pg_stat_all_tables WHERE relid = 'tuvl.runs'::regclass")[0]

        # the workers' statistics reach the server at their commits, at most once a second
        time.sleep(1.1)
        read0, upd0, queue0 = scans()
        n = 2000
        queue_and_finish(conn, "claim_plan", n)
        # every run is claimed once and checkpointed once at least: wait until the
        # workers reported all those updates (and so the claims before them)
        time.sleep(1.1)
        wait_until(lambda: scans()[1] - upd0 >= 2 * n, 30, interval=0.2,
                   message="the workers' statistics")
        read, _, queue = scans()
        read -= read0
        queue -= queue0
        claims = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE status = 'completed'")
        report(f"{n} runs queued after the claims' plans were made: {read} rows read by "
               f"sequential scans of tuvl.runs, {queue} entries of the queue's index read")
        assert claims == n + 2
        # a sequential scan per claim (120 runs at most each) reads about n * n / 120 rows
        assert read < n, f"claims scanned tuvl.runs sequentially ({read} rows read)"
    finally:
        conn.close()


def test_claims_take_the_queue_in_its_index_order_after_an_analyze(fresh_databases):
    """The claim's plan made from statistics of a table of finished runs
    (an ANALYZE replans it) must still read the queue in the order of its
    own index, runs_queued_fair_idx, and stop at its LIMIT: through
    runs_status_idx, whose leading column the claim names too, it reads
    every queued run of the role and sorts them for every claim, so that a
    batch of n runs costs n * n / (runs per claim) index entries."""
    conn = tuvl_database(fresh_databases, "tuvl_claim_order")
    try:
        one_step_workflow(conn, "claim_order", "'{}'")
        n = 3000
        queue_and_finish(conn, "claim_order", n)
        # statistics of a table of finished runs, none queued; the workers'
        # cached plans are made again at their next claim
        q(conn, "ANALYZE tuvl.runs")
        first = q1(conn, "SELECT tuvl.start_run('claim_order')")
        assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (first,)) == "completed"

        def reads():
            return q(conn, "SELECT i.indexrelid::regclass::text, i.idx_tup_read FROM pg_stat_all_indexes i "
                           "WHERE i.indexrelid IN ('tuvl.runs_status_idx'::regclass, "
                           "                       'tuvl.runs_queued_fair_idx'::regclass)")

        time.sleep(1.1)
        before = dict(reads())
        queue_and_finish(conn, "claim_order", n)
        time.sleep(1.1)
        after = {}
        for _ in range(30):
            after = dict(reads())
            if after["tuvl.runs_queued_fair_idx"] - before["tuvl.runs_queued_fair_idx"] >= n:
                break
            time.sleep(0.2)
        status = after["tuvl.runs_status_idx"] - before["tuvl.runs_status_idx"]
        queue = after["tuvl.runs_queued_fair_idx"] - before["tuvl.runs_queued_fair_idx"]
        report(f"{n} runs claimed after an ANALYZE: {queue} entries of runs_queued_fair_idx read, "
               f"{status} of runs_status_idx")
        assert queue >= n, "the claims did not read the queue's index"
        assert status < n, f"the claims read the queue through runs_status_idx ({status} entries)"
    finally:
        conn.close()


def test_idle_maintenance_reads_no_runs_of_a_table_purged_then_refilled(fresh_databases):
    """Each worker's maintenance runs once a second: it wakes the due
    sleeping runs, Human steps and approvals past their timeout, aborts
    agents paused too long and requeues the runs of dead holders.  Each of
    those statements finds its rows through a partial index; with nothing
    due each is a probe.  Planned once and kept, a plan made while tuvl.runs
    was empty (a fresh database, or runs purged and vacuumed, as here)
    read the whole table each second until the next ANALYZE: 50,000 runs
    cost a fifth of a busy worker's CPU.  After the table grew to n ended
    runs, idle workers must read almost nothing of it."""
    conn = tuvl_database(fresh_databases, "tuvl_maintenance_plan")
    try:
        # so that this test's own lookups by id do not count
        q(conn, "SET enable_seqscan = off")
        # no ANALYZE comes to the rescue while the test runs
        q(conn, "ALTER TABLE tuvl.runs SET (autovacuum_enabled = off)")
        # the statistics of a purged table: no rows on no pages
        q(conn, "VACUUM tuvl.runs")
        assert q1(conn, "SELECT reltuples FROM pg_class WHERE oid = 'tuvl.runs'::regclass") == 0
        one_step_workflow(conn, "maintenance_plan", "'{}'")
        # each worker's maintenance runs (and plans) on the empty table
        time.sleep(2.2)
        n = 3000
        queue_and_finish(conn, "maintenance_plan", n)

        def reads():
            return q1(conn, "SELECT t.seq_tup_read + (SELECT sum(i.idx_tup_read) FROM pg_stat_all_indexes i "
                            "                          WHERE i.relid = t.relid) "
                            "FROM pg_stat_all_tables t WHERE t.relid = 'tuvl.runs'::regclass")

        # the workers' statistics reach the server at their commits, at most
        # once a second; the first maintenance after the batch may read the
        # index entries of the runs it held once
        time.sleep(2.2)
        before = reads()
        time.sleep(3.0)
        read = reads() - before
        report(f"two idle workers over 3 s with {n} ended runs, plans made on an empty table: "
               f"{read} rows and index entries of tuvl.runs read")
        assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE status = 'completed'") == n
        # a scan of the table per statement and second reads n rows each time
        assert read < n, f"the idle workers' maintenance read tuvl.runs whole ({read} rows and entries in 3 s)"
    finally:
        conn.close()


def test_checkpoints_find_their_run_by_its_id_whatever_the_plan_saw(fresh_databases):
    """The checkpoint's fenced UPDATE (WHERE id = $1 AND attempt = $2 AND
    status = $3) is planned once per worker, here at its first transition,
    while tuvl.runs holds a run or two.  On so small a table an index that
    has the status and the id but not as its first two columns (0.3.0's
    runs_status_idx, before it held ended runs only) costs the same as the
    primary key, and through it every checkpoint reads the entries of every
    run of its status: n runs in flight cost n * n entries.  The
    checkpoints must take their runs by the primary key, and read no other
    index of tuvl.runs but the queue's and the leases' (the claims and the
    lease renewals) more than once a run."""
    conn = tuvl_database(fresh_databases, "tuvl_fence_plan")
    try:
        q(conn, "CREATE FUNCTION public.fence_step(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{}'::jsonb $$")
        q(conn, """SELECT tuvl.register_workflow($$
name: fence_plan
steps:
  - { id: a, kind: Functional, function: public.fence_step }
  - { id: b, kind: Functional, function: public.fence_step }
  - { id: c, kind: Functional, function: public.fence_step }
ends:
  - { id: done, status: completed }
$$)""")
        # each worker's first transitions, on a table of one or two rows
        for _ in range(4):
            first = q1(conn, "SELECT tuvl.start_run('fence_plan')")
            assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (first,)) == "completed"

        def reads():
            return dict(q(conn, "SELECT i.indexrelid::regclass::text, i.idx_tup_read FROM pg_stat_all_indexes i "
                                "WHERE i.relid = 'tuvl.runs'::regclass"))

        time.sleep(2.5)  # the workers flush their statistics at most once a second
        before = reads()
        n = 2000
        queue_and_finish(conn, "fence_plan", n)
        time.sleep(2.5)
        read = {k: v - before[k] for k, v in reads().items()}
        others = {k: v for k, v in read.items()
                  if k not in ("tuvl.runs_pkey", "tuvl.runs_queued_fair_idx", "tuvl.runs_leased_idx") and v}
        report(f"{n} three-step runs after plans made on an empty table: {read['tuvl.runs_pkey']} entries of "
               f"runs_pkey read, of the other indexes {others or 'none'}")
        assert read["tuvl.runs_pkey"] >= 3 * n, "the checkpoints did not find their runs by the primary key"
        assert sum(others.values()) < n, f"the checkpoints read other indexes: {others}"
    finally:
        conn.close()


def test_a_busy_worker_reports_what_it_does_in_pg_stat_activity(db):
    conn = connect(db)
    try:
        q(conn, """CREATE FUNCTION public.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
                   BEGIN PERFORM pg_sleep(1.5); RETURN '{}'; END $$""")
        q(conn, """SELECT tuvl.register_workflow($$
name: napper
steps:
  - { id: nap, kind: Functional, function: public.nap }
ends:
  - { id: done, status: completed }
$$)""")
        # Idle workers say so (they wake briefly every second for maintenance).
        wait_until(lambda: all(r[2] == "idle" for r in worker_rows(db)), 2,
                   message="every worker idle")
        run_id = q1(conn, "SELECT tuvl.start_run('napper')")

        def busy():
            rows = q(conn, """SELECT pid, application_name, state, query, wait_event
                                FROM pg_stat_activity
                               WHERE backend_type = 'tuvl worker' AND state = 'active'
                                 AND query LIKE 'tuvl advancing%%'
                                 AND wait_event IS NOT DISTINCT FROM 'PgSleep'""")
            return rows[0] if rows else None

        # Active, saying what it advances, and waiting in the step's own pg_sleep.
        pid, app, state, query, wait_event = wait_until(busy, 3, interval=0.02,
                                                        message="an active worker in the step")
        assert pid in worker_pids(db) and app in EXPECTED_NAMES
        assert query == "tuvl advancing 1 runs"
        assert q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,)) == pid
        assert q1(conn, "SELECT tuvl.wait(%s, '5 s')", (run_id,)) == "completed"
        wait_until(lambda: all(r[2] == "idle" for r in worker_rows(db)), 2,
                   message="every worker idle again")
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# Which databases get workers


def test_tuvl_databases_limits_where_workers_run(fresh_databases, set_gucs):
    kept = fresh_databases("tuvl_workers_kept")
    left = fresh_databases("tuvl_workers_left")
    for name in (kept, left):
        query(name, "CREATE EXTENSION tuvl")
    wait_until(lambda: len(worker_pids(kept)) == 2 and len(worker_pids(left)) == 2, 20,
               message="workers in both databases")
    set_gucs({"tuvl.databases": (f"postgres, {kept}", f"postgres, {kept}")})
    wait_until(lambda: len(worker_pids(left)) == 0, 30, message="the workers of the left-out database to stop")
    assert len(worker_pids(kept)) == 2
    # a run started there waits queued until the database is listed again
    query(left, "SELECT tuvl.register_workflow($$\nname: w\nsteps:\n  - { id: s, kind: Router, on: a, routes: { a: done } }\n"
                "ends:\n  - { id: done, status: completed }\n$$)")
    run_id = query(left, "SELECT tuvl.start_run('w')")[0][0]
    time.sleep(1)
    assert query(left, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,))[0][0] == "queued"
    set_gucs({"tuvl.databases": ("", "")})
    wait_until(lambda: len(worker_pids(left)) == 2, 30, message="the workers to come back")
    wait_until(lambda: query(left, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,))[0][0] == "completed",
               20, message="the run to complete")


def test_dropped_databases_free_their_launcher_entries(fresh_databases, set_gucs):
    """The launcher keeps 64 database entries; databases that come and go
    must not use them up."""
    set_gucs({"tuvl.launcher_naptime": ("100ms", "100ms")})
    admin = connect("postgres")
    names = [f"tuvl_workers_gone_{i}" for i in range(70)]
    try:
        for name in names:
            q(admin, f'DROP DATABASE IF EXISTS "{name}"')
            q(admin, f'CREATE DATABASE "{name}"')
        # the launcher has seen them all (each probed by a worker that found no extension)
        time.sleep(3)

        # Each DROP DATABASE waits for a checkpoint of its own; one after the
        # other, the first wrote out what the 70 copies of template1 left
        # dirty and each next one waited a second for its checkpoint (over two
        # minutes in all).  Dropped at once, each discards its own buffers and
        # they share their checkpoints.
        def drop(name):
            conn = connect("postgres")
            try:
                q(conn, f'DROP DATABASE "{name}" WITH (FORCE)')
            finally:
                conn.close()

        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(drop, names))
    finally:
        for name in names:
            q(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    late = fresh_databases("tuvl_workers_late")
    query(late, "CREATE EXTENSION tuvl")
    wait_until(lambda: len(worker_pids(late)) == 2, 30, message="workers in a database created after 70 were dropped")
