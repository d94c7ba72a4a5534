#!/usr/bin/env python3
"""Partitions: throughput and CPU per step with 1, 2 and 4 tuvl partitions.

The partitions are databases of one server (tuvl.partition 0..N-1, each
with its own workers), as behind tuvl_router; on one machine they share its
cores, so total throughput cannot grow with N.  What this measures is what
does not depend on the machine: the CPU the workers of each partition spend
per step, and that their sum per step stays flat as N grows, so that N
servers (each with its own cores) would each do what one does
(docs/scaling.md).

Each round, for N partitions: queue R/N five-step runs in each partition
(one transaction each, all partitions at once), wait until every run is
completed, and report steps/s = 5R / (max(finished_at) - min(started_at))
and each partition's worker CPU (utime + stime of its workers from /proc)
per step.  Needs PGHOST/PGPORT/PGUSER of a scratch cluster with tuvl
preloaded (bench/run or test/lib.sh's tuvl_start); run as the cluster's
owner or root (to read the workers' /proc).

    bench/partitions.py [--runs 4000] [--partitions 1,2,4] [--rounds 3]

docs/scaling.md's numbers: a cluster of test/lib.sh's tuvl_start with
TUVL_EXTRA_CONF="tuvl.workers_per_database = 1" (one worker per partition),
--runs 4000 --rounds 3.
"""
import argparse
import json
import os
import statistics
import threading
import time

import psycopg2

WORKFLOW = """
name: pfive
steps:
  - {id: a, kind: ModelOp, sql: "SELECT 1 AS x"}
  - {id: b, kind: ModelOp, sql: "SELECT 2 AS x"}
  - {id: c, kind: ModelOp, sql: "SELECT 3 AS x"}
  - {id: d, kind: ModelOp, sql: "SELECT 4 AS x"}
  - {id: e, kind: ModelOp, sql: "SELECT 5 AS x"}
ends:
  - {id: done, status: completed}
"""
TICK = os.sysconf("SC_CLK_TCK")


def connect(dbname):
    c = psycopg2.connect(dbname=dbname)
    c.autocommit = True
    return c


def q(c, sql, params=None):
    with c.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else None


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def setup(n):
    admin = connect("postgres")
    names = [f"tuvl_bench_p{i}" for i in range(n)]
    for i, d in enumerate(names):
        q(admin, f"DROP DATABASE IF EXISTS {d} WITH (FORCE)")
        q(admin, f"CREATE DATABASE {d}")
        q(admin, f"ALTER DATABASE {d} SET tuvl.partition = {i}")
        c = connect(d)
        q(c, "CREATE EXTENSION tuvl")
        q(c, "SELECT tuvl.register_workflow(%s)", (WORKFLOW,))
        c.close()
    # every partition's workers are up
    deadline = time.monotonic() + 60
    while True:
        c = connect(names[0])
        rows = q(c, "SELECT d.datname, w.pid FROM tuvl.worker_status() w "
                    "JOIN pg_database d ON d.oid = w.database")
        c.close()
        got = {d: [p for (dn, p) in rows if dn == d] for d in names}
        if all(got[d] for d in names):
            break
        assert time.monotonic() < deadline, f"workers missing: {got}"
        time.sleep(0.2)
    admin.close()
    return names, got


def drop(names):
    admin = connect("postgres")
    for d in names:
        q(admin, f"DROP DATABASE IF EXISTS {d} WITH (FORCE)")
    admin.close()


def round_(names, workers, runs):
    per = runs // len(names)
    conns = {d: connect(d) for d in names}
    for c in conns.values():
        q(c, "TRUNCATE tuvl.runs CASCADE")
    cpu0 = {d: sum(cpu_seconds(p) for p in workers[d]) for d in names}

    def enqueue(d):
        q(conns[d], "SELECT count(tuvl.start_run('pfive')) FROM generate_series(1, %s)", (per,))
    threads = [threading.Thread(target=enqueue, args=(d,)) for d in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while any(q1 for q1 in (q(conns[d], "SELECT count(*) FROM tuvl.runs WHERE status <> 'completed'")[0][0]
                            for d in names)):
        time.sleep(0.05)
    cpu1 = {d: sum(cpu_seconds(p) for p in workers[d]) for d in names}
    spans = [q(conns[d], "SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)) "
                         "FROM tuvl.runs")[0] for d in names]
    wall = float(max(s[1] for s in spans)) - float(min(s[0] for s in spans))
    steps = 5 * per * len(names)
    for c in conns.values():
        c.close()
    cpu_us = {d: (cpu1[d] - cpu0[d]) * 1e6 / (5 * per) for d in names}
    return {
        "partitions": len(names), "runs": per * len(names), "steps_per_s": round(steps / wall),
        "cpu_us_per_step_each": [round(cpu_us[d], 1) for d in names],
        "cpu_us_per_step_total": round(sum((cpu1[d] - cpu0[d]) for d in names) * 1e6 / steps, 1),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=4000)
    ap.add_argument("--partitions", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.partitions.split(",")]:
        names, workers = setup(n)
        try:
            rounds = [round_(names, workers, args.runs) for _ in range(args.rounds)]
        finally:
            drop(names)
        best = {
            "partitions": n, "runs": rounds[0]["runs"],
            "steps_per_s_median": statistics.median(r["steps_per_s"] for r in rounds),
            "cpu_us_per_step_total_median": statistics.median(r["cpu_us_per_step_total"] for r in rounds),
            "rounds": rounds,
        }
        print("partitions: " + json.dumps(best), flush=True)
        results.append(best)
    return results


if __name__ == "__main__":
    main()
