#!/usr/bin/env python3
"""HTTP effects: how many one-request runs the workers finish per second.

Each run is a one-APICall workflow (POST, Idempotency-Key, a JSON body)
against the load generator bench/servers/loadgen.mjs (TUVL_LOADGEN_URL,
or one started here): its /slow endpoint answering at once (0 ms) and
after 200 ms.  The Python test server of test/run answers about 1,500
requests a second and would be the bottleneck; the load generator's own
CPU and event-loop utilization are reported to show that it is not.

Each round queues --runs runs (default 10,000) in one transaction, first
against the 0 ms endpoint, then against the 200 ms one, and measures the
wall time from COMMIT until every run has finished.  A warm-up of
--warmup runs (default 2,000) at 0 ms goes first and is not counted: it
compiles the load generator's hot paths (its first requests cost it two
to three times as much CPU as the later ones) and opens the workers'
connections to it, so that every counted round measures the same steady
state.

  effects/s at 0 ms = runs / wall            target >= 5,000 with 2 workers
  ratio = wall(200 ms) / max(200 ms, wall(0 ms))   (target <= 2)

It also reports the peak transfers in flight in the workers
(tuvl.worker_status()) and at the server, and checks that the server
answered every run's Idempotency-Key exactly once.
"""
import argparse
import json
import os
import threading
import time

from common import Loadgen, connect, log, register_workflow_once, wait_for_workers, wait_runs_done, write_json

WORKFLOW = """
name: bench_http_%(name)s
steps:
  - id: call
    kind: APICall
    http:
      method: POST
      url: "%(url)s/slow?ms=%(ms)d&k={{ k }}"
      body: { k: "{{ k }}" }
      idempotency: auto
      timeout: 30s
ends: []
"""


class Sampler(threading.Thread):
    """Polls tuvl.worker_status() for the transfers in flight in all workers."""

    def __init__(self, db):
        super().__init__(daemon=True)
        self.conn = connect(db)
        self.stop = threading.Event()
        self.peak = 0

    def run(self):
        cur = self.conn.cursor()
        while not self.stop.is_set():
            cur.execute("SELECT coalesce(sum(transfers_in_flight), 0) FROM tuvl.worker_status() "
                        "WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database())")
            self.peak = max(self.peak, int(cur.fetchone()[0]))
            time.sleep(0.005)
        self.conn.close()


def clean(cur, workflow):
    cur.execute("DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE workflow = %s)",
                (workflow,))
    cur.execute("DELETE FROM tuvl.runs WHERE workflow = %s", (workflow,))
    cur.execute("VACUUM tuvl.runs, tuvl.journal")


def one(db, lg, ms, n):
    name = "%dms" % ms
    workflow = "bench_http_" + name
    conn = connect(db)
    cur = conn.cursor()
    register_workflow_once(cur, workflow, WORKFLOW % {"name": name, "url": lg.url, "ms": ms})
    clean(cur, workflow)
    lg.call("DELETE", "/_log")
    lg.call("DELETE", "/_stats")
    sampler = Sampler(db)
    sampler.start()
    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run(%s, jsonb_build_object('k', i))) "
                "FROM generate_series(1, %s) i", (workflow, n))
    conn.commit()
    t0 = time.time()
    conn.autocommit = True
    wait_runs_done(cur, workflow, poll_s=0.01)
    wall = time.time() - t0
    stats = lg.call("GET", "/_stats")
    seen = lg.call("GET", "/_log")
    sampler.stop.set()
    sampler.join()
    cur.execute("SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status = 'failed'), "
                "extract(epoch FROM max(finished_at) - min(started_at)) "
                "FROM tuvl.runs WHERE workflow = %s", (workflow,))
    completed, failed, span = cur.fetchone()
    clean(cur, workflow)
    conn.close()
    keys = seen.get("idempotency_keys", {})
    return {"server_ms": ms, "runs": n, "completed": completed, "failed": failed,
            "wall_s": wall, "span_s": float(span or 0), "effects_per_s": n / wall,
            "peak_in_flight": seen["peak"], "peak_in_flight_workers": sampler.peak,
            "requests": seen["count"], "keys_distinct": keys.get("distinct"), "keys_repeated": keys.get("repeated"),
            "loadgen": {"cpu_s": stats["cpu_since_reset"]["total_s"], "cpus": stats["cpu_since_reset"]["cpus"],
                        "event_loop_utilization": stats["event_loop"]["utilization"],
                        "us_per_request": stats["cpu_since_reset"]["us_per_request"],
                        "peak_connections": stats["connections"]["peak"]},
            "ok": completed == n and seen["count"] == n and keys.get("distinct") == n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2000,
                    help="runs at 0 ms before the counted rounds (0: none)")
    ap.add_argument("--loadgen", default=os.environ.get("TUVL_LOADGEN_URL"),
                    help="the load generator's URL (default: start one)")
    ap.add_argument("--json")
    args = ap.parse_args()
    lg = Loadgen(args.loadgen)
    try:
        workers = wait_for_workers(args.db)
        warmup = None
        if args.warmup > 0:
            warmup = one(args.db, lg, 0, args.warmup)
            log("warm-up (not counted): %d runs against a 0 ms server in %.2f s: %.0f effects/s "
                "(load generator %.0f us a request)"
                % (args.warmup, warmup["wall_s"], warmup["effects_per_s"], warmup["loadgen"]["us_per_request"]))
        rounds = []
        for r in range(args.rounds):
            fast = one(args.db, lg, 0, args.runs)
            slow = one(args.db, lg, 200, args.runs)
            ratio = slow["wall_s"] / max(0.2, fast["wall_s"])
            log("round %d: %d runs against a 0 ms server in %.2f s: %.0f effects/s (load generator %.2f CPUs, "
                "event loop %.0f%% busy); 200 ms server %.2f s (peak in flight %d at the server, %d in the "
                "workers), ratio %.2f; every key answered once: %s"
                % (r + 1, args.runs, fast["wall_s"], fast["effects_per_s"], fast["loadgen"]["cpus"],
                   100 * fast["loadgen"]["event_loop_utilization"], slow["wall_s"], slow["peak_in_flight"],
                   slow["peak_in_flight_workers"], ratio, fast["ok"] and slow["ok"]))
            rounds.append({"fast": fast, "slow": slow, "ratio": ratio})
    finally:
        lg.stop()
    best = max(range(len(rounds)), key=lambda i: rounds[i]["fast"]["effects_per_s"])
    result = {"runs": args.runs, "workers": workers, "warmup": warmup, "rounds": rounds, "best": rounds[best],
              "ok": all(r["fast"]["ok"] and r["slow"]["ok"] for r in rounds)}
    write_json(args.json, result)
    print(json.dumps({"effects_per_s": round(rounds[best]["fast"]["effects_per_s"]),
                      "wall_200ms_s": round(rounds[best]["slow"]["wall_s"], 3),
                      "ratio": round(rounds[best]["ratio"], 2), "ok": result["ok"]}))
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
