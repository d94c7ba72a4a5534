#!/usr/bin/env python3
"""Throughput: steps per second of a 5-step Functional workflow, against pgbench -N.

Each round:

  1. empties tuvl.runs and tuvl.events (the database must be a scratch one),
     runs CHECKPOINT and waits for the statistics to settle;
  2. queues N runs of workflow `five` in one transaction
     (SELECT count(tuvl.start_run('five')) FROM generate_series(1, N)),
     commits, and polls every 50 ms until none is queued or running;
  3. reports steps/s = 5 * N / (max(finished_at) - min(started_at)) from
     tuvl.runs, and 5 * N / wall clock (commit returned -> all done seen);
  4. derives the commits the workers used from the pg_stat_database
     xact_commit delta of the database, less the client's own transactions
     (the enqueue and the polls), and the WAL flushes from pg_stat_wal;
  5. runs CHECKPOINT and pgbench -N -c 2 -j 2 -T 30 in a separate database
     initialised once with pgbench -i -s 10, and reports tps (without initial
     connection time) and the ratio steps/s / tps of the round.

Rounds alternate tuvl and pgbench so both see the same background load.
"""
import argparse
import os
import re
import subprocess
import threading
import time
from collections import Counter

from common import connect, log, register_workflow_once, wait_for_workers, write_json

STEPS = 5
WORKFLOW = """\
name: five
description: five trivial Functional steps (throughput benchmark)
steps:
""" + "".join("  - { id: s%d, kind: Functional, function: bench.five_step }\n" % (i + 1)
              for i in range(STEPS))

PGBIN = os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin")
STATS_SETTLE_S = 2.5  # workers flush their statistics at most once a second


def setup(dbname):
    conn = connect(dbname)
    cur = conn.cursor()
    cur.execute("CREATE SCHEMA IF NOT EXISTS bench")
    cur.execute("CREATE OR REPLACE FUNCTION bench.five_step(ctx jsonb) RETURNS jsonb "
                "LANGUAGE sql IMMUTABLE AS $$ SELECT '{\"n\": 1}'::jsonb $$")
    register_workflow_once(cur, "five", WORKFLOW)
    conn.close()


def counters(dbname):
    """Commit count of dbname and the cluster's WAL counters, read from another database."""
    conn = connect("postgres")
    cur = conn.cursor()
    cur.execute("SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s", (dbname,))
    commit, rollback = cur.fetchone()
    cur.execute("SELECT wal_records, wal_bytes, wal_write, wal_sync FROM pg_stat_wal")
    records, wbytes, writes, syncs = cur.fetchone()
    conn.close()
    return {"xact_commit": commit, "xact_rollback": rollback, "wal_records": records,
            "wal_bytes": int(wbytes), "wal_write": writes, "wal_sync": syncs}


class ActivitySampler(threading.Thread):
    """Samples the wait events of the database's tuvl workers (from database postgres)."""

    def __init__(self, dbname, interval):
        super().__init__(daemon=True)
        self.dbname, self.interval = dbname, interval
        self.samples = Counter()
        self.n = 0
        self.stop = threading.Event()

    def run(self):
        conn = connect("postgres")
        cur = conn.cursor()
        while not self.stop.is_set():
            cur.execute("SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'), "
                        "       left(coalesce(query, ''), 40) "
                        "FROM pg_stat_activity WHERE datname = %s AND backend_type = 'tuvl worker' "
                        "AND state = 'active'", (self.dbname,))
            for wait, query in cur.fetchall():
                self.samples["%s | %s" % (wait, query)] += 1
            self.n += 1
            time.sleep(self.interval)
        conn.close()


def tuvl_round(dbname, runs, poll_s, sample_s, timeout_s, workflow="five", steps_per_run=STEPS):
    """One round of `runs` runs of `workflow` (five, or any workflow of
    steps_per_run steps that setup() or another script registered)."""
    conn = connect(dbname)
    conn.cursor().execute("TRUNCATE tuvl.journal, tuvl.runs")
    conn.cursor().execute("CHECKPOINT")
    conn.close()
    time.sleep(STATS_SETTLE_S)
    before = counters(dbname)

    sampler = None
    if sample_s > 0:
        sampler = ActivitySampler(dbname, sample_s)
        sampler.start()

    conn = connect(dbname, autocommit=False)
    cur = conn.cursor()
    t_enqueue = time.time()
    cur.execute("SELECT count(tuvl.start_run(%s)) FROM generate_series(1, %s)", (workflow, runs))
    assert cur.fetchone()[0] == runs
    t0 = time.time()
    conn.commit()
    t1 = time.time()
    conn.close()
    client_tx = 1

    # Poll, cheaply (through the partial indexes), until no run is left.
    # Not tuvl.wait(): it runs as one long statement whose snapshot holds
    # back the xmin horizon, so nothing could be pruned while it waits.
    poll = connect(dbname)
    pcur = poll.cursor()
    while True:
        pcur.execute("SELECT EXISTS (SELECT 1 FROM tuvl.runs WHERE status = 'queued') "
                     "OR EXISTS (SELECT 1 FROM tuvl.runs WHERE status = 'running')")
        client_tx += 1
        if not pcur.fetchone()[0]:
            break
        if time.time() - t1 > timeout_s:
            pcur.execute("SELECT status, count(*) FROM tuvl.runs GROUP BY 1 ORDER BY 1")
            raise SystemExit("runs still unfinished after %.0f s: %s" % (timeout_s, pcur.fetchall()))
        time.sleep(poll_s)
    t_done = time.time()
    poll.close()
    if sampler:
        sampler.stop.set()
        sampler.join()

    time.sleep(STATS_SETTLE_S)
    after = counters(dbname)

    conn = connect(dbname)
    cur = conn.cursor()
    cur.execute("SELECT count(*) FILTER (WHERE status = 'completed'), count(*), "
                "  extract(epoch FROM max(finished_at) - min(started_at))::float8, "
                "  extract(epoch FROM max(finished_at))::float8, "
                "  extract(epoch FROM min(started_at))::float8 "
                "FROM tuvl.runs WHERE workflow = %s", (workflow,))
    completed, total, span, last_finish, first_start = cur.fetchone()
    conn.close()

    steps = steps_per_run * runs
    delta = {k: after[k] - before[k] for k in after}
    worker_commits = delta["xact_commit"] - client_tx
    res = {
        "runs": runs,
        "steps": steps,
        "completed": completed,
        "total": total,
        "enqueue_s": t0 - t_enqueue,
        "commit_s": t1 - t0,
        "server_span_s": span,
        "steps_per_s": steps / span,
        "wall_s": t_done - t1,
        "steps_per_s_wall": steps / (t_done - t1),
        "first_claim_after_commit_ms": (first_start - t1) * 1000.0,
        "last_finish_after_commit_s": last_finish - t1,
        "delta": delta,
        "client_transactions": client_tx,
        "worker_commits": worker_commits,
        "steps_per_commit": steps / worker_commits if worker_commits > 0 else None,
        "steps_per_wal_sync": steps / delta["wal_sync"] if delta["wal_sync"] > 0 else None,
    }
    if sampler:
        res["wait_samples"] = {"polls": sampler.n, "by_wait_and_query": dict(sampler.samples.most_common(20))}
    return res


def pgbench_init(dbname, scale):
    conn = connect("postgres")
    cur = conn.cursor()
    cur.execute("DROP DATABASE IF EXISTS %s" % dbname)
    cur.execute("CREATE DATABASE %s" % dbname)
    conn.close()
    subprocess.run([os.path.join(PGBIN, "pgbench"), "-i", "-q", "-s", str(scale), dbname],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def pgbench_round(dbname, seconds, clients):
    conn = connect(dbname)
    conn.cursor().execute("CHECKPOINT")
    conn.close()
    cmd = [os.path.join(PGBIN, "pgbench"), "-N", "-c", str(clients), "-j", str(clients),
           "-T", str(seconds), dbname]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    if not m:
        raise SystemExit("could not read tps from pgbench output:\n" + out)
    lat = re.search(r"latency average = ([0-9.]+) ms", out)
    return {"command": " ".join(["pgbench"] + cmd[1:]), "tps": float(m.group(1)),
            "latency_avg_ms": float(lat.group(1)) if lat else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench", help="scratch database with the extension (emptied!)")
    ap.add_argument("--pgbench-db", default="bench_pgbench")
    ap.add_argument("--runs", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pgbench-seconds", type=int, default=30)
    ap.add_argument("--pgbench-clients", type=int, default=2)
    ap.add_argument("--pgbench-scale", type=int, default=10)
    ap.add_argument("--no-pgbench", action="store_true")
    ap.add_argument("--poll-ms", type=float, default=50.0)
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="give up when the runs of a round are not done after this many seconds")
    ap.add_argument("--sample-ms", type=float, default=0.0,
                    help="sample the workers' wait events this often (0: off)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    setup(args.db)
    wait_for_workers(args.db)
    if not args.no_pgbench:
        log("pgbench -i -s %d %s" % (args.pgbench_scale, args.pgbench_db))
        pgbench_init(args.pgbench_db, args.pgbench_scale)
        log("pgbench -i done")

    rounds = []
    for r in range(args.rounds):
        t = tuvl_round(args.db, args.runs, args.poll_ms / 1000.0, args.sample_ms / 1000.0, args.timeout)
        log("throughput round %d: %d/%d completed, %.0f steps/s (server span %.2f s), "
            "%.0f steps/s wall (%.2f s), %d worker commits, %.1f steps/commit, %.1f steps/WAL flush"
            % (r + 1, t["completed"], t["total"], t["steps_per_s"], t["server_span_s"],
               t["steps_per_s_wall"], t["wall_s"], t["worker_commits"], t["steps_per_commit"] or 0,
               t["steps_per_wal_sync"] or 0))
        round_ = {"tuvl": t}
        if not args.no_pgbench:
            p = pgbench_round(args.pgbench_db, args.pgbench_seconds, args.pgbench_clients)
            round_["pgbench"] = p
            round_["ratio"] = t["steps_per_s"] / p["tps"]
            round_["ratio_wall"] = t["steps_per_s_wall"] / p["tps"]
            log("pgbench round %d: %.0f tps; ratio steps/s / tps = %.2f (wall %.2f)"
                % (r + 1, p["tps"], round_["ratio"], round_["ratio_wall"]))
        rounds.append(round_)
    best = max(range(len(rounds)), key=lambda i: rounds[i]["tuvl"]["steps_per_s"])
    write_json(args.json, {"steps_per_run": STEPS, "rounds": rounds, "best": best})


if __name__ == "__main__":
    main()
