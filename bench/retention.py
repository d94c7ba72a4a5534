#!/usr/bin/env python3
"""Retention: tuvl.purge() on a journal of millions of events, and what it
does to runs executing meanwhile.

  1. Builds a history of --history-runs finished runs (default 1,000,000)
     with --events-per-run journal events each (default 5: 5,000,000
     events, in blocks of up to 4 as a run's transitions write them),
     finished 40 days ago, by plain INSERTs (a superuser's shortcut: a
     real history would come from runs).
  2. Baseline: for --seconds, keeps the two workers busy with five-step
     runs (queued in batches of 2,000 whenever fewer than 1,000 wait) and
     counts the steps of the runs that finished in the window.
  3. The same, with tuvl.purge('30 days') started at the beginning of the
     window in another session: the purge's wall time and WAL bytes (the
     cluster's WAL during the window less the baseline window's), and the
     steps/s while it ran, against the baseline.
  4. Checks that the history is gone and that no run of the load was lost.
"""
import argparse
import threading
import time

from common import connect, log, register_workflow_once, wait_for_workers, write_json
from throughput import WORKFLOW, setup as setup_five

HIST = """\
name: hist
steps:
  - { id: s, kind: Router, on: a, routes: { a: done } }
ends:
  - { id: done, status: completed }
"""


def build_history(db, runs, per_run, chunk=100_000):
    conn = connect(db)
    cur = conn.cursor()
    register_workflow_once(cur, "hist", HIST)
    t0 = time.time()
    for start in range(0, runs, chunk):
        n = min(chunk, runs - start)
        cur.execute("""
            WITH r AS (
              INSERT INTO tuvl.runs (workflow, workflow_version, status, input, context, principal,
                                     principal_id, attempt, last_seq, created_at, started_at, finished_at,
                                     end_name, response)
              SELECT 'hist', 1, 'completed', '{}', jsonb_build_object('i', g), current_user, current_user::regrole,
                     1, %(per)s, now() - interval '41 days', now() - interval '41 days',
                     now() - interval '40 days' + g * interval '1 ms', 'done', '{"ok": true}'
              FROM generate_series(1, %(n)s) g
              RETURNING id)
            INSERT INTO tuvl.journal (run_id, seq, n, events)
            SELECT r.id, b.first, b.n,
                   tuvl._journal_block(array_fill(now() - interval '40 days', ARRAY[b.n]),
                                       array_fill('checkpoint'::text, ARRAY[b.n]),
                                       array_fill('s'::text, ARRAY[b.n]),
                                       array_fill('Router'::text, ARRAY[b.n]),
                                       array_fill(NULL::int, ARRAY[b.n]),
                                       array_fill(NULL::float8, ARRAY[b.n]),
                                       (SELECT array_agg(jsonb_build_object('step', 's', 'status', 'running', 'n', s))
                                        FROM generate_series(b.first, b.first + b.n - 1) s))
            FROM r, LATERAL (SELECT f AS first, least(4, %(per)s - f + 1) AS n
                             FROM generate_series(1, %(per)s, 4) f) b""", {"n": n, "per": per_run})
        log("history: %d of %d runs" % (start + n, runs))
    cur.execute("VACUUM ANALYZE tuvl.runs")
    cur.execute("VACUUM ANALYZE tuvl.journal")
    cur.execute("CHECKPOINT")
    cur.execute("SELECT pg_size_pretty(pg_total_relation_size('tuvl.journal')), "
                "pg_size_pretty(pg_total_relation_size('tuvl.runs'))")
    sizes = cur.fetchone()
    conn.close()
    return time.time() - t0, sizes


def wal_lsn(cur):
    cur.execute("SELECT pg_current_wal_lsn()")
    return cur.fetchone()[0]


def wal_bytes(cur, a, b):
    cur.execute("SELECT pg_wal_lsn_diff(%s, %s)::bigint", (b, a))
    return cur.fetchone()[0]


def load_window(db, seconds, during=None):
    """Keep the workers busy with five-step runs for `seconds` (or while
    `during` is alive); returns (steps/s of the runs finished in the window,
    window seconds, WAL bytes of the window)."""
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("SELECT coalesce(max(id), 0) FROM tuvl.runs")
    first_id = cur.fetchone()[0]
    lsn0 = wal_lsn(cur)
    t0 = time.time()
    cur.execute("SELECT now()")
    w0 = cur.fetchone()[0]
    while True:
        alive = during.is_alive() if during else False
        if not alive and time.time() - t0 >= seconds:
            break
        cur.execute("SELECT count(*) FROM tuvl.runs WHERE status = 'queued' AND held_by IS NULL AND id > %s", (first_id,))
        if cur.fetchone()[0] < 1000:
            cur.execute("SELECT count(tuvl.start_run('five')) FROM generate_series(1, 2000)")
        time.sleep(0.05)
    cur.execute("SELECT now()")
    w1 = cur.fetchone()[0]
    window = time.time() - t0
    lsn1 = wal_lsn(cur)
    cur.execute("SELECT count(*) FROM tuvl.runs WHERE id > %s AND workflow = 'five' "
                "AND finished_at BETWEEN %s AND %s", (first_id, w0, w1))
    done = cur.fetchone()[0]
    wal = wal_bytes(cur, lsn0, lsn1)
    # let the rest finish: nothing may be lost
    deadline = time.time() + 120
    while time.time() < deadline:
        cur.execute("SELECT count(*) FROM tuvl.runs WHERE id > %s AND finished_at IS NULL", (first_id,))
        if cur.fetchone()[0] == 0:
            break
        time.sleep(0.2)
    cur.execute("SELECT count(*) FILTER (WHERE status <> 'completed') FROM tuvl.runs WHERE id > %s", (first_id,))
    bad = cur.fetchone()[0]
    conn.close()
    return 5 * done / window, window, wal, bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--history-runs", type=int, default=1_000_000)
    ap.add_argument("--events-per-run", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=15.0, help="the baseline window")
    ap.add_argument("--json")
    args = ap.parse_args()

    setup_five(args.db)
    wait_for_workers(args.db)
    built, sizes = build_history(args.db, args.history_runs, args.events_per_run)
    log("history of %d runs and %d events built in %.0f s (events %s, runs %s)"
        % (args.history_runs, args.history_runs * args.events_per_run, built, sizes[0], sizes[1]))

    base_sps, base_window, base_wal, base_bad = load_window(args.db, args.seconds)
    log("baseline: %.0f steps/s over %.1f s, WAL %.1f MB" % (base_sps, base_window, base_wal / 1e6))

    result = {}

    def purge():
        c = connect(args.db)
        cu = c.cursor()
        t = time.time()
        cu.execute("SELECT tuvl.purge('30 days')")
        result["purged"] = cu.fetchone()[0]
        result["purge_s"] = time.time() - t
        c.close()

    th = threading.Thread(target=purge)
    th.start()
    sps, window, wal, bad = load_window(args.db, 0.0, during=th)
    th.join()
    # the load's own WAL over the window, from the baseline's rate
    load_wal = base_wal / base_window * window
    purge_wal = max(wal - load_wal, 0)
    conn = connect(args.db)
    cur = conn.cursor()
    cur.execute("SELECT count(*) FROM tuvl.runs WHERE workflow = 'hist'")
    left = cur.fetchone()[0]
    cur.execute("SELECT coalesce(sum(j.n), 0) FROM tuvl.journal j WHERE NOT EXISTS (SELECT 1 FROM tuvl.runs r WHERE r.id = j.run_id)")
    orphans = cur.fetchone()[0]
    conn.close()
    out = {
        "history_runs": args.history_runs,
        "history_events": args.history_runs * args.events_per_run,
        "history_build_s": built,
        "events_size": sizes[0],
        "runs_size": sizes[1],
        "purged": result.get("purged"),
        "purge_s": result.get("purge_s"),
        "purge_wal_bytes": purge_wal,
        "purge_wal_bytes_per_event": purge_wal / max(args.history_runs * args.events_per_run, 1),
        "baseline_steps_per_s": base_sps,
        "during_purge_steps_per_s": sps,
        "ratio": sps / base_sps if base_sps else float("nan"),
        "history_left": left,
        "orphan_events": orphans,
        "load_runs_not_completed": base_bad + bad,
    }
    log("purge: %s runs in %.1f s, about %.0f MB of WAL (%.0f bytes per event); load %.0f steps/s during it, "
        "%.2f of the baseline; %d history runs left, %d orphan events, %d load runs not completed"
        % (out["purged"], out["purge_s"], purge_wal / 1e6, out["purge_wal_bytes_per_event"], sps, out["ratio"],
           left, orphans, out["load_runs_not_completed"]))
    if args.json:
        write_json(args.json, out)
    ok = left == 0 and orphans == 0 and out["load_runs_not_completed"] == 0
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
