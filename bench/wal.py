#!/usr/bin/env python3
"""Where a step's WAL goes: one round of five-step runs, read back with pg_waldump.

It empties tuvl.runs and tuvl.journal, runs CHECKPOINT, queues --runs
runs of the throughput workflow `five` (bench/throughput.py), waits until
they are done, and hands the WAL between the LSN before the queueing and
the LSN after the last run to pg_waldump.  Every record is charged to the
relation its first block belongs to (tuvl.runs, tuvl.journal, their
indexes and TOAST tables) and to its type (INSERT, HOT_UPDATE, ...), and
the report gives bytes and records per step for each, the queueing
(start_run) included.  Needs the cluster's data directory (TUVL_PGDATA,
which test/lib.sh's tuvl_start exports) and pg_waldump (PGBIN).
"""
import argparse
import collections
import os
import re
import subprocess
import time

import throughput
from common import connect, log, wait_for_workers, wait_runs_done, write_json

PGBIN = os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin")


def relation_names(cur):
    """{relfilenode: name} of tuvl's tables, indexes and TOAST tables."""
    cur.execute("""
        SELECT pg_relation_filenode(c.oid)::text, c.relname FROM pg_class c
        WHERE c.relnamespace = 'tuvl'::regnamespace AND c.relkind IN ('r', 'i')
        UNION ALL
        SELECT pg_relation_filenode(t.reltoastrelid)::text, c.relname || ' (TOAST)' FROM pg_class c
        JOIN pg_class t ON t.oid = c.oid
        WHERE c.relnamespace = 'tuvl'::regnamespace AND c.relkind = 'r' AND c.reltoastrelid <> 0""")
    return dict(cur.fetchall())


def breakdown(datadir, start, end, names):
    out = subprocess.run([os.path.join(PGBIN, "pg_waldump"), "-p", os.path.join(datadir, "pg_wal"),
                          "-s", start, "-e", end], capture_output=True, text=True).stdout
    size = collections.Counter()
    count = collections.Counter()
    fpi = 0
    for line in out.splitlines():
        m = re.search(r"rmgr: (\S+)\s+len \(rec/tot\):\s+(\d+)/\s*(\d+).*desc: (\S+)", line)
        if not m:
            continue
        rel = re.search(r"rel \d+/\d+/(\d+)", line)
        what = names.get(rel.group(1), "other relation") if rel else "-"
        key = (what, m.group(1) + "/" + m.group(4))
        size[key] += int(m.group(3))
        count[key] += 1
        fpi += int(m.group(3)) - int(m.group(2))
    return size, count, fpi


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=10000)
    ap.add_argument("--json")
    args = ap.parse_args()
    datadir = os.environ.get("TUVL_PGDATA")
    if not datadir:
        raise SystemExit("TUVL_PGDATA is not set: bench/run (test/lib.sh's tuvl_start) sets it")
    throughput.setup(args.db)
    wait_for_workers(args.db)
    # a warm-up round, so that the round measured finds the plans made
    throughput.tuvl_round(args.db, 1000, 0.02, 0.0, 120.0)
    conn = connect(args.db)
    cur = conn.cursor()
    cur.execute("TRUNCATE tuvl.journal, tuvl.runs")
    cur.execute("CHECKPOINT")
    time.sleep(1.0)
    cur.execute("SELECT pg_current_wal_lsn()")
    start = cur.fetchone()[0]
    cur.execute("SELECT count(tuvl.start_run('five')) FROM generate_series(1, %s)", (args.runs,))
    wait_runs_done(cur)
    cur.execute("SELECT pg_current_wal_lsn()")
    end = cur.fetchone()[0]
    names = relation_names(cur)
    conn.close()
    steps = throughput.STEPS * args.runs
    size, count, fpi = breakdown(datadir, start, end, names)
    total = sum(size.values())
    rows = [{"relation": k[0], "record": k[1], "bytes_per_step": v / steps,
             "records_per_step": count[k] / steps} for k, v in size.most_common()]
    by_rel = collections.Counter()
    for k, v in size.items():
        by_rel[k[0]] += v
    log("WAL per step: %.0f bytes, %.2f records (full-page images %.0f bytes)"
        % (total / steps, sum(count.values()) / steps, fpi / steps))
    for r in rows[:12]:
        log("  %-28s %-22s %7.1f bytes %5.2f records" % (r["relation"], r["record"], r["bytes_per_step"],
                                                          r["records_per_step"]))
    write_json(args.json, {"runs": args.runs, "steps": steps, "bytes_per_step": total / steps,
                           "records_per_step": sum(count.values()) / steps, "fpi_bytes_per_step": fpi / steps,
                           "by_relation": {k: v / steps for k, v in by_rel.most_common()}, "rows": rows})


if __name__ == "__main__":
    main()
