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

CPU per call: the user + system CPU time the database's tuvl workers spent
during a round (from /proc/<pid>/stat, so the benchmark must run on the
database's host), divided by the calls, for the 0 ms tool.

--stateless: the same against the stateless revision 2026-07-28, the
scripted server test/servers/mcp_stateless_server.py (started here on a
free port; its echo and slow tools), where each call is one request
without a session; compare its CPU per call with the session-based run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
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
STATELESS_TOOLS = {
    0: ("echo", '{ text: "call {{ k }}" }', "call "),
    200: ("slow", "{ ms: 200 }", "slept 200"),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_cpu_s(cur):
    """CPU seconds (user + system) the database's tuvl workers used so far."""
    cur.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                "AND datname = current_database()")
    total = 0
    for (pid,) in cur.fetchall():
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])     # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def start_stateless():
    err = tempfile.NamedTemporaryFile(prefix="bench-mcp26.", suffix=".err", delete=False)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "test", "servers", "mcp_stateless_server.py"),
                             "--port", "0", "--log-max", "1"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 15
    while time.time() < deadline:
        with open(err.name) as f:
            line = f.readline()
        if line.endswith("\n") and ":" in line:
            return proc, "http://127.0.0.1:%d/mcp" % int(line.rsplit(":", 1)[1])
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("the scripted 2026-07-28 server did not start")


def one(db, url, ms, n, tools=TOOLS, tag=""):
    name = "%dms%s" % (ms, tag)
    tool, args, expect = tools[ms]
    workflow = "bench_mcp_calls_" + name
    conn = connect(db)
    cur = conn.cursor()
    register_workflow_once(cur, workflow, WORKFLOW % {"name": name, "url": url, "tool": tool, "args": args})
    conn.autocommit = False
    cpu0 = worker_cpu_s(cur)
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
    cpu = worker_cpu_s(cur) - cpu0
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
            "wall_s": wall, "span_s": span, "wrong": wrong, "worker_cpu_s": cpu,
            "cpu_ms_per_call": 1000.0 * cpu / n}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--stateless", action="store_true",
                    help="against the scripted 2026-07-28 server instead of the reference one")
    args = ap.parse_args()
    server = None
    tools, tag = TOOLS, ""
    if args.stateless:
        server, url = start_stateless()
        tools, tag = STATELESS_TOOLS, "_stateless"
    else:
        url = os.environ.get("TUVL_MCP_URL")
        if not url:
            raise SystemExit("TUVL_MCP_URL is not set: bench/run starts the reference MCP server")
    try:
        rounds = run_rounds(args, url, tools, tag)
    finally:
        if server:
            server.terminate()
            server.wait(10)
    best = min(rounds, key=lambda x: x["slow"]["wall_s"] - x["fast"]["wall_s"])
    write_json(args.json, {"runs": args.runs, "revision": "2026-07-28" if args.stateless else "2025-11-25",
                           "rounds": rounds, "best": best})
    print(json.dumps({"wall_0ms_s": round(best["fast"]["wall_s"], 3),
                      "wall_200ms_s": round(best["slow"]["wall_s"], 3),
                      "limit_s": round(best["limit_s"], 3), "all_answered": best["all_answered"],
                      "cpu_ms_per_call": round(min(r["fast"]["cpu_ms_per_call"] for r in rounds), 3)}))


def run_rounds(args, url, tools, tag):
    wait_for_workers(args.db)
    one(args.db, url, 0, 20, tools, tag)  # warm-up: each worker opens its session (or learns the revision)
    rounds = []
    for r in range(args.rounds):
        fast = one(args.db, url, 0, args.runs, tools, tag)
        slow = one(args.db, url, 200, args.runs, tools, tag)
        limit = 2 * 0.2 + fast["wall_s"]
        ok = fast["answered"] == fast["runs"] and slow["answered"] == slow["runs"]
        log("round %d: %d MCP calls%s, 0 ms tool %.3f s (%.3f ms worker CPU per call), 200 ms tool %.3f s "
            "(limit %.3f s), answered %d + %d%s"
            % (r + 1, args.runs, " (2026-07-28)" if tag else "", fast["wall_s"], fast["cpu_ms_per_call"],
               slow["wall_s"], limit, fast["answered"], slow["answered"],
               "" if ok else "; wrong: %s" % (fast["wrong"] + slow["wrong"])))
        rounds.append({"fast": fast, "slow": slow, "limit_s": limit, "all_answered": ok,
                       "met": ok and slow["wall_s"] <= limit})
    return rounds


if __name__ == "__main__":
    main()
