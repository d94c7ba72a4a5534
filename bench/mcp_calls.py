#!/usr/bin/env python3
"""MCP calls in flight: 500 runs of a one-MCP-step workflow, all at once.

Against the reference MCP server test/run starts
(@modelcontextprotocol/server-everything, TUVL_MCP_URL): first its `echo`
tool (answers at once), then `trigger-long-running-operation` with a
duration of 200 ms, with the default worker count.  Each worker shares one
session among its runs, so hundreds of requests are in flight on a session
at once: each must get its own answer (request ids never repeat).

Reports the wall time from the commit that queued the runs until the last
one ended, checks that every run completed with the tool's answer, and
gives the target: the 200 ms wall time <= 2 x 200 ms + the 0 ms wall time.
"""
import argparse
import json
import os
import time

from common import connect, log, register_workflow_once, wait_for_workers, write_json

WORKFLOW = """
name: bench_mcp_calls_%(name)s
steps:
  - id: call
    kind: MCP
    mcp:
      url: "%(url)s"
      tool: %(tool)s
      arguments: %(args)s
      timeout: 60s
    output: res
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "{{ res.text }}" }
"""

TOOLS = {
    0: ("echo", '{ message: "call {{ k }}" }', "Echo: call "),
    200: ("trigger-long-running-operation", "{ duration: 0.2, steps: 1 }", "Long running operation completed"),
}


def one(db, url, ms, n):
    name = "%dms" % ms
    tool, args, expect = TOOLS[ms]
    workflow = "bench_mcp_calls_" + name
    conn = connect(db)
    cur = conn.cursor()
    register_workflow_once(cur, workflow, WORKFLOW % {"name": name, "url": url, "tool": tool, "args": args})
    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run(%s, jsonb_build_object('k', i))) "
                "FROM generate_series(1, %s) i", (workflow, n))
    conn.commit()
    t0 = time.time()
    conn.autocommit = True
    while True:
        cur.execute("SELECT count(*) FILTER (WHERE status NOT IN ('completed', 'failed')) "
                    "FROM tuvl.runs WHERE workflow = %s", (workflow,))
        if cur.fetchone()[0] == 0:
            break
        if time.time() - t0 > 120:
            raise SystemExit("%s: runs still unfinished after 120 s" % workflow)
        time.sleep(0.005)
    wall = time.time() - t0
    cur.execute("SELECT count(*) FILTER (WHERE status = 'completed' AND response::text LIKE %s), count(*), "
                "  extract(epoch FROM max(finished_at) - min(started_at))::float8 "
                "FROM tuvl.runs WHERE workflow = %s", ("%" + expect + "%", workflow))
    answered, total, span = cur.fetchone()
    cur.execute("SELECT left(coalesce(error, response::text), 200) FROM tuvl.runs WHERE workflow = %s "
                "AND NOT (status = 'completed' AND response::text LIKE %s) LIMIT 3",
                (workflow, "%" + expect + "%"))
    wrong = [r[0] for r in cur.fetchall()]
    cur.execute("DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE workflow = %s)",
                (workflow,))
    cur.execute("DELETE FROM tuvl.runs WHERE workflow = %s", (workflow,))
    conn.close()
    return {"tool_ms": ms, "tool": tool, "runs": n, "answered": answered, "total": total,
            "wall_s": wall, "span_s": span, "wrong": wrong}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    url = os.environ.get("TUVL_MCP_URL")
    if not url:
        raise SystemExit("TUVL_MCP_URL is not set: bench/run starts the reference MCP server")
    wait_for_workers(args.db)
    one(args.db, url, 0, 20)  # warm-up: each worker opens its session
    rounds = []
    for r in range(args.rounds):
        fast = one(args.db, url, 0, args.runs)
        slow = one(args.db, url, 200, args.runs)
        limit = 2 * 0.2 + fast["wall_s"]
        ok = fast["answered"] == fast["runs"] and slow["answered"] == slow["runs"]
        log("round %d: %d MCP calls, 0 ms tool %.3f s, 200 ms tool %.3f s (limit %.3f s), answered %d + %d%s"
            % (r + 1, args.runs, fast["wall_s"], slow["wall_s"], limit, fast["answered"], slow["answered"],
               "" if ok else "; wrong: %s" % (fast["wrong"] + slow["wrong"])))
        rounds.append({"fast": fast, "slow": slow, "limit_s": limit, "all_answered": ok,
                       "met": ok and slow["wall_s"] <= limit})
    best = min(rounds, key=lambda x: x["slow"]["wall_s"] - x["fast"]["wall_s"])
    write_json(args.json, {"runs": args.runs, "rounds": rounds, "best": best})
    print(json.dumps({"wall_0ms_s": round(best["fast"]["wall_s"], 3),
                      "wall_200ms_s": round(best["slow"]["wall_s"], 3),
                      "limit_s": round(best["limit_s"], 3), "all_answered": best["all_answered"]}))


if __name__ == "__main__":
    main()
