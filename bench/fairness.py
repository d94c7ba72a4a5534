#!/usr/bin/env python3
"""Fairness and memory: one role's load does not slow another role's runs.

Latency of trivial runs (one ModelOp step) of the role bench_quiet, started
one at a time, measured on the server (created_at -> finished_at):

  * idle: nothing else runs;
  * loaded: the role bench_noisy has 20 runs whose step sleeps (pg_sleep,
    --slow-seconds each) and --backlog trivial runs queued (100,000 by
    default), queued just before.

The report gives p50/p99 of both and their ratio (target <= 2 at p99).  The
slow runs and the backlog must all complete.

Then memory: --responses runs (60) whose APICall step fetches a 10 MB body
from the HTTP test server (TUVL_HTTP_PORT), and the peak private memory
(RssAnon, sampled every 20 ms) of each worker over its value before, with
tuvl.max_worker_memory at its default.
"""
import argparse
import json
import os
import threading
import time

from common import connect, log, percentile, register_workflow_once, wait_for_workers, write_json

QUIET, NOISY = "bench_quiet", "bench_noisy"


def setup(db):
    conn = connect(db)
    cur = conn.cursor()
    for role in (QUIET, NOISY):
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
        if cur.fetchone() is None:
            cur.execute(f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    cur.execute("CREATE SCHEMA IF NOT EXISTS bench")
    cur.execute("GRANT USAGE ON SCHEMA bench TO PUBLIC")
    cur.execute("""CREATE OR REPLACE FUNCTION bench.fair_nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql
                   AS $$ BEGIN PERFORM pg_sleep((ctx ->> 'secs')::float8); RETURN '{}'; END $$""")
    register_workflow_once(cur, "fair_trivial", """\
name: fair_trivial
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS one" }
""")
    register_workflow_once(cur, "fair_slow", """\
name: fair_slow
steps:
  - { id: nap, kind: Functional, function: bench.fair_nap }
""")
    port = os.environ.get("TUVL_HTTP_PORT")
    register_workflow_once(cur, "fair_big", f"""\
name: fair_big
steps:
  - id: get
    kind: APICall
    http: {{ url: "http://127.0.0.1:{port}/big?bytes=10000000&t={{{{ t }}}}", timeout: 60s }}
""")
    conn.close()


def quiet_latencies(db, n):
    conn = connect(db)
    cur = conn.cursor()
    cur.execute(f"SET ROLE {QUIET}")
    ids = []
    for _ in range(n):
        cur.execute("SELECT tuvl.start_run('fair_trivial')")
        run_id = cur.fetchone()[0]
        cur.execute("SELECT tuvl.wait(%s, '30 s')", (run_id,))
        assert cur.fetchone()[0] == "completed"
        ids.append(run_id)
    cur.execute("RESET ROLE")
    cur.execute("SELECT extract(epoch FROM finished_at - created_at) * 1000, "
                "       extract(epoch FROM started_at - created_at) * 1000 FROM tuvl.runs "
                "WHERE id = ANY (%s)", (ids,))
    rows = cur.fetchall()
    lat = sorted(float(r[0]) for r in rows)
    claim = sorted(float(r[1]) for r in rows)
    conn.close()
    return {"n": len(lat), "p50": percentile(lat, 50), "p99": percentile(lat, 99), "max": lat[-1],
            "claim_p50": percentile(claim, 50), "claim_p99": percentile(claim, 99)}


def unfinished(db, role):
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("SELECT count(*) FROM tuvl.runs WHERE finished_at IS NULL AND principal_id = %s::regrole",
                (role,))
    n = cur.fetchone()[0]
    conn.close()
    return n


def rss_anon_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_phase(db, n):
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'tuvl worker'", (db,))
    pids = [r[0] for r in cur.fetchall()]
    cur.execute("SHOW tuvl.max_worker_memory")
    limit = cur.fetchone()[0]
    base = {p: rss_anon_kb(p) for p in pids}
    peak = dict(base)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for p in pids:
                peak[p] = max(peak[p], rss_anon_kb(p))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    started = time.time()
    ids = []
    for i in range(n):
        cur.execute("SELECT tuvl.start_run('fair_big', %s)", (json.dumps({"t": f"{started}-{i}"}),))
        ids.append(cur.fetchone()[0])
    for run_id in ids:
        cur.execute("SELECT tuvl.wait(%s, '300 s')", (run_id,))
        assert cur.fetchone()[0] == "completed", run_id
    wall = time.time() - started
    stop.set()
    t.join()
    conn.close()
    return {"responses": n, "bytes_each": 10_000_000, "limit": limit, "wall_s": wall,
            "growth_mb": {str(p): (peak[p] - base[p]) / 1024.0 for p in pids}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--runs", type=int, default=300, help="quiet runs per phase")
    ap.add_argument("--backlog", type=int, default=100000)
    ap.add_argument("--slow", type=int, default=20)
    ap.add_argument("--slow-seconds", type=float, default=3.0)
    ap.add_argument("--responses", type=int, default=60)
    ap.add_argument("--json")
    args = ap.parse_args()

    setup(args.db)
    wait_for_workers(args.db)
    log("fairness: idle phase, %d quiet runs" % args.runs)
    idle = quiet_latencies(args.db, args.runs)

    noisy = connect(args.db)
    cur = noisy.cursor()
    cur.execute(f"SET ROLE {NOISY}")
    cur.execute("SELECT count(tuvl.start_run('fair_slow', jsonb_build_object('secs', %s))) "
                "FROM generate_series(1, %s)", (args.slow_seconds, args.slow))
    t0 = time.time()
    cur.execute("SELECT count(tuvl.start_run('fair_trivial')) FROM generate_series(1, %s)", (args.backlog,))
    queued_s = time.time() - t0
    log("fairness: %d slow and %d queued runs of %s (queued in %.1f s); loaded phase"
        % (args.slow, args.backlog, NOISY, queued_s))
    loaded = quiet_latencies(args.db, args.runs)
    left = unfinished(args.db, NOISY)
    log("fairness: %d of the noisy runs still unfinished when the quiet runs were done; draining" % left)
    deadline = time.time() + 600
    while unfinished(args.db, NOISY) > 0 and time.time() < deadline:
        time.sleep(0.5)
    drained = unfinished(args.db, NOISY) == 0
    noisy.close()

    log("memory: %d runs fetching 10 MB each" % args.responses)
    memory = memory_phase(args.db, args.responses)

    result = {"idle": idle, "loaded": loaded, "noisy_unfinished_after_quiet": left,
              "backlog": args.backlog, "slow": args.slow, "slow_seconds": args.slow_seconds,
              "drained": drained, "ratio_p99": loaded["p99"] / idle["p99"],
              "ratio_p50": loaded["p50"] / idle["p50"], "memory": memory}
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0 if drained else 1


if __name__ == "__main__":
    raise SystemExit(main())
