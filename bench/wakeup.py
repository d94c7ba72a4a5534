#!/usr/bin/env python3
"""Wake-up latency: how long a committed start_run waits before a worker runs it.

One run at a time of a one-step workflow (a Functional step calling a
trivial SQL function).  For each run:

    SELECT tuvl.start_run('wake', '{}')      -- autocommit off
    t0 = time.time(); conn.commit(); t1 = time.time()

then wait for the run's journal to arrive on LISTEN (second connection, on
the channel tuvl.events_channel() names: a superuser's hears every run) and read ts of its agent_started event.  The worker stamps each
journal event with the clock when the event happens (agent_started: just
before the step executes, after the claim transaction committed), and the
client and the server share the machine's clock, so

    latency       = ts(agent_started) - t1   (commit returned)
    latency_pre   = ts(agent_started) - t0   (before commit)

The worker is woken by the committing backend before the commit's reply
reaches the client, so `latency` can be negative; `latency_pre` includes
the commit itself (WAL flush and round trip).  The next run starts as soon
as the previous one's journal arrived (--gap-ms adds a pause).

Prints a summary per round to stderr and writes JSON with --json.
"""
import argparse
import json
import select
import time

from common import connect, log, register_workflow_once, summarize_ms, wait_for_workers, write_json

WORKFLOW = """\
name: wake
description: one trivial Functional step (wake-up latency benchmark)
steps:
  - id: only
    kind: Functional
    function: bench.wake_noop
"""


def setup(dbname):
    conn = connect(dbname)
    cur = conn.cursor()
    cur.execute("CREATE SCHEMA IF NOT EXISTS bench")
    cur.execute("CREATE OR REPLACE FUNCTION bench.wake_noop(ctx jsonb) RETURNS jsonb "
                "LANGUAGE sql IMMUTABLE AS $$ SELECT '{\"ok\": true}'::jsonb $$")
    register_workflow_once(cur, "wake", WORKFLOW)
    conn.close()


class Listener:
    """LISTEN on tuvl.events_channel(); remembers which runs have been seen at which event."""

    def __init__(self, dbname):
        self.conn = connect(dbname)
        self.cur = self.conn.cursor()
        self.cur.execute("SELECT tuvl.events_channel()")
        self.cur.execute('LISTEN "%s"' % self.cur.fetchone()[0])
        self.done = set()

    def wait_for(self, run_id, event_type, timeout=10.0):
        deadline = time.time() + timeout
        key = (run_id, event_type)
        while key not in self.done:
            left = deadline - time.time()
            if left <= 0:
                raise SystemExit("run %d: no %s event within %.0f s" % (run_id, event_type, timeout))
            if select.select([self.conn], [], [], left) == ([], [], []):
                continue
            self.conn.poll()
            while self.conn.notifies:
                n = self.conn.notifies.pop(0)
                p = json.loads(n.payload)
                self.done.add((p["run_id"], p["type"]))
        self.done.discard(key)

    def event_ts(self, run_id, event_type):
        self.cur.execute("SELECT extract(epoch FROM ts)::float8 FROM tuvl.events "
                         "WHERE run_id = %s AND type = %s", (run_id, event_type))
        row = self.cur.fetchone()
        if row is None:
            raise SystemExit("run %d has no %s event" % (run_id, event_type))
        return row[0]


def one_round(dbname, runs, warmup, gap_ms):
    listener = Listener(dbname)
    conn = connect(dbname, autocommit=False)
    cur = conn.cursor()
    after_commit = []
    before_commit = []
    commit_ms = []
    for i in range(warmup + runs):
        cur.execute("SELECT tuvl.start_run('wake', '{}')")
        run_id = cur.fetchone()[0]
        t0 = time.time()
        conn.commit()
        t1 = time.time()
        listener.wait_for(run_id, "run_completed")
        ts = listener.event_ts(run_id, "agent_started")
        listener.done.clear()
        if i >= warmup:
            after_commit.append((ts - t1) * 1000.0)
            before_commit.append((ts - t0) * 1000.0)
            commit_ms.append((t1 - t0) * 1000.0)
        if gap_ms > 0:
            time.sleep(gap_ms / 1000.0)
    conn.close()
    listener.conn.close()
    return {
        "after_commit_ms": summarize_ms(after_commit),
        "before_commit_ms": summarize_ms(before_commit),
        "commit_ms": summarize_ms(commit_ms),
        "negative_after_commit": sum(1 for v in after_commit if v < 0),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="sleep between runs (0: start the next run as soon as one completes)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    setup(args.db)
    wait_for_workers(args.db)
    rounds = []
    for r in range(args.rounds):
        res = one_round(args.db, args.runs, args.warmup, args.gap_ms)
        a, b = res["after_commit_ms"], res["before_commit_ms"]
        log("wake-up round %d: %d runs, after commit median %.3f p95 %.3f p99 %.3f max %.3f ms; "
            "before commit median %.3f ms; commit itself median %.3f ms"
            % (r + 1, a["n"], a["median"], a["p95"], a["p99"], a["max"], b["median"],
               res["commit_ms"]["median"]))
        rounds.append(res)
    best = min(range(len(rounds)), key=lambda i: rounds[i]["after_commit_ms"]["median"])
    write_json(args.json, {"runs": args.runs, "warmup": args.warmup, "gap_ms": args.gap_ms,
                           "rounds": rounds, "best": best})


if __name__ == "__main__":
    main()
