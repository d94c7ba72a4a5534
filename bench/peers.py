#!/usr/bin/env python3
"""Peers: tuvl against the systems users would pick instead that keep their
state in PostgreSQL: the job queues pg-boss and graphile-worker, the durable
workflow engine DBOS Transact (TypeScript SDK) and, for agents, LangGraph JS
with its PostgresSaver (all pinned in bench/peers/package.json, run by
bench/peers/bench.mjs on the pinned Node 22 that bench/peers/install.sh
installs), on the same cluster, in the same run, on the same measures (a
peer takes the measures its grid in bench.mjs has: DBOS wakeup and chains,
LangGraph agents only):

  wakeup   one job at a time, latency from just before COMMIT to the moment
           the job's handler (tuvl: the step, agent_started) starts, median
           over --wakeup-jobs (1,000, after 50 warm-up jobs); bench/wakeup.py's
           one_round() for tuvl
  trivial  --trivial-jobs (10,000) no-op jobs queued in one transaction:
           jobs/s from COMMIT returned until a poll (every --poll-ms) sees all
           complete; tuvl: one-step runs of bench/wakeup.py's workflow `wake`
           through bench/throughput.py's tuvl_round()
  chains   --chains (2,000) chains of 5 steps, each step's result {"n": 1}
           recorded durably and the next step enqueued: steps/s from the first
           step's start to the last step's completion (and wall clock), WAL
           bytes and commits per step; tuvl: runs of bench/throughput.py's
           workflow `five` through tuvl_round()
  agents   --agents (1,000) autonomous agents of three model turns (two calls
           of the tool `note`, which writes a row) against the load generator
           (bench/servers/loadgen.mjs, started here) at 0 ms: wall time from
           COMMIT (LangGraph: from handing out the agents) until all are done,
           and CPU per model turn: tuvl's workers; LangGraph's Node processes
           plus the PostgreSQL backends serving them.  tuvl: bench/agents_scale.py's
           batch() of its workflow bench_scale_0ms; LangGraph: createReactAgent
           with ChatOpenAI and PostgresSaver, each agent its own thread_id,
           `c` agents at once per process

First a search: every setting of each peer's grid (bench.mjs --list) on each
measure, with fewer jobs (--search-*) and no counters, then the two best
(--finalists) once more; the finalist with the better mean of its two runs
is kept for the peer and measure.  Then --rounds rounds: in each round, for each measure,
tuvl, pg-boss and graphile-worker take turns (the order reverses every
round), so a noisy moment of the machine hits all of them.  Each peer's
invocation installs the peer afresh in its database (peers_pgboss,
peers_graphile, created when missing); tuvl_round empties tuvl's runs and
their journal (--db must be a scratch database with the extension).

The JSON (--json) has every search result, the settings chosen, and every
round's numbers; bench/report.py prints its Peers section from it, with
tuvl / peer (peer / tuvl for latency: > 1 means tuvl is better) as the median
and the range over rounds.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import agents_scale
import throughput
import wakeup
from agents import TURNS
from common import Loadgen, connect, log, wait_for_workers, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS_DIR = os.path.join(HERE, "peers")
NODE = os.path.join(PEERS_DIR, "node_modules", ".bin", "node")
BENCH_MJS = os.path.join(PEERS_DIR, "bench.mjs")

PEERS = {"pgboss": "pg-boss", "graphile": "graphile-worker", "dbos": "DBOS Transact", "langgraph": "LangGraph JS"}
PEER_DB = {"pgboss": "peers_pgboss", "graphile": "peers_graphile", "dbos": "peers_dbos",
           "langgraph": "peers_langgraph"}
PACKAGES = {"pgboss": "pg-boss", "graphile": "graphile-worker", "dbos": "@dbos-inc/dbos-sdk",
            "langgraph": "@langchain/langgraph"}
MEASURES = ("wakeup", "trivial", "chains", "agents")
LOWER_IS_BETTER = ("wakeup", "agents")
STEPS = throughput.STEPS


def score(measure, res):
    """The number a measure compares: lower is better for wakeup and agents."""
    if measure == "wakeup":
        return res["before_commit_ms"]["median"]
    if measure == "agents":
        return res["wall_s"]
    if measure == "trivial":
        return res["jobs_per_s"]
    return res["steps_per_s"]


def better(measure, a, b):
    return a < b if measure in LOWER_IS_BETTER else a > b


# ---------------------------------------------------------------------------
# tuvl, through the functions of bench/wakeup.py and bench/throughput.py
# ---------------------------------------------------------------------------

def tuvl_measure(args, measure, n):
    if measure == "agents":
        r = agents_scale.batch(args.db, args.lg, "0ms", n)
        r["agents"] = n
        r["turns"] = TURNS * n
        r["cpu_per_turn_ms"] = 1000.0 * r["worker_cpu_s"] / r["turns"]
        return r
    if measure == "wakeup":
        res = wakeup.one_round(args.db, n, args.warmup, 0.0)
        res["jobs"] = n
        return res
    if measure == "trivial":
        r = throughput.tuvl_round(args.db, n, args.poll_ms / 1000.0, 0.0, args.timeout,
                                  workflow="wake", steps_per_run=1)
        r["jobs_per_s"] = r["steps"] / r["wall_s"]
    else:
        r = throughput.tuvl_round(args.db, n, args.poll_ms / 1000.0, 0.0, args.timeout)
    # the peers' names for what tuvl_round reports
    r["steps_per_s_wall"] = r["steps"] / r["wall_s"]
    r["commits_per_step"] = r["worker_commits"] / r["steps"]
    r["wal_bytes_per_step"] = r["delta"]["wal_bytes"] / r["steps"]
    r["ok"] = r["completed"] == r["total"] == n
    return r


# ---------------------------------------------------------------------------
# The peers, through bench/peers/bench.mjs
# ---------------------------------------------------------------------------

def node_version():
    return subprocess.run([NODE, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def package_version(name):
    with open(os.path.join(PEERS_DIR, "node_modules", name, "package.json")) as f:
        return json.load(f)["version"]


def grids():
    out = subprocess.run([NODE, BENCH_MJS, "--list"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def peer_measure(args, peer, measure, setting, n, counters=True):
    """One invocation of bench.mjs; its JSON, or {"error": ...} when it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        # the agents take minutes where the queues take seconds: three times
        # the timeout (a loaded machine took LangGraph over 300 s for 1,000)
        timeout = args.timeout * (3 if measure == "agents" else 1)
        cmd = [NODE, BENCH_MJS, "--peer", peer, "--measure", measure, "--setting", setting,
               "--db", PEER_DB[peer], "--n", str(n), "--warmup", str(args.warmup),
               "--poll-ms", str(args.poll_ms), "--timeout", str(timeout), "--json", tmp.name]
        if not counters:
            cmd.append("--no-counters")
        if measure == "agents":
            cmd += ["--llm-url", args.lg.url + "/lat/0/v1"]
        # bench.mjs logs its own summary line on stderr, which is ours
        try:
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            return {"error": "bench.mjs did not end within %.0f s" % (timeout + 120), "setting": setting}
        sys.stderr.write(p.stderr)
        if p.returncode not in (0, 3):  # 3: ran, but not every job completed (res["ok"] false)
            why = [l for l in p.stderr.splitlines() if "bench.mjs:" in l][:1] or ["exit status %d" % p.returncode]
            return {"error": why[0].split("bench.mjs:", 1)[-1].strip(), "setting": setting}
        with open(tmp.name) as f:
            return json.load(f)


def create_peer_databases(peers):
    conn = connect("postgres")
    cur = conn.cursor()
    for p in peers:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (PEER_DB[p],))
        if cur.fetchone() is None:
            cur.execute("CREATE DATABASE %s" % PEER_DB[p])
    conn.close()


def search(args, peers, grid):
    """Every setting of each peer's grid on each measure, with fewer jobs and
    no counters; then the --finalists best of them once more.  The winner is
    the finalist with the better mean of its two runs (one run is easily
    spoilt by a noisy moment of a shared machine)."""
    n = {"wakeup": args.search_wakeup_jobs, "trivial": args.search_trivial_jobs, "chains": args.search_chains,
         "agents": args.search_agents}
    found, best = {}, {}

    def attempt(peer, measure, setting):
        res = peer_measure(args, peer, measure, setting, n[measure], counters=False)
        if "error" in res or not res.get("ok", True):
            return {"error": res.get("error", "not every job completed"), "result": res}
        return {"score": score(measure, res), "result": res}

    for peer in peers:
        found[peer], best[peer] = {}, {}
        for measure in args.measures:
            if measure not in grid[peer]:
                continue
            if args.no_search:
                found[peer][measure] = []
                best[peer][measure] = grid[peer][measure][0]["name"]
                continue
            tried = [dict(setting=s["name"], n=n[measure], runs=[attempt(peer, measure, s["name"])])
                     for s in grid[peer][measure]]
            ok = [e for e in tried if "score" in e["runs"][0]]
            if not ok:
                raise SystemExit("%s %s: no setting worked: %s" % (PEERS[peer], measure, tried))
            sign = 1 if measure in LOWER_IS_BETTER else -1  # sort best first
            ok.sort(key=lambda e: sign * e["runs"][0]["score"])
            finalists = ok[:args.finalists] if len(ok) > 1 else ok
            for e in finalists:
                if len(finalists) > 1:
                    e["runs"].append(attempt(peer, measure, e["setting"]))
                scores = [r["score"] for r in e["runs"] if "score" in r]
                e["score"] = sum(scores) / len(scores)
                e["finalist"] = True
            for e in tried:
                e.setdefault("score", e["runs"][0].get("score"))
            win = finalists[0]
            for e in finalists[1:]:
                if better(measure, e["score"], win["score"]):
                    win = e
            found[peer][measure] = tried
            best[peer][measure] = win["setting"]
            log("%s %s: best setting %s (%.3f, mean of its runs)" % (PEERS[peer], measure, win["setting"], win["score"]))
    return found, best


def ratio(measure, tuvl, peer):
    """tuvl / peer for rates, peer / tuvl for latency, time and CPU: > 1 means tuvl is better."""
    if tuvl is None or peer is None:
        return None
    return peer / tuvl if measure in LOWER_IS_BETTER else tuvl / peer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench", help="scratch database with the extension (tuvl.runs emptied!)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peers", default="pgboss,graphile,dbos,langgraph",
                    help="comma-separated: pgboss, graphile, dbos, langgraph")
    ap.add_argument("--measures", default=",".join(MEASURES), help="comma-separated: " + ", ".join(MEASURES))
    ap.add_argument("--wakeup-jobs", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--trivial-jobs", type=int, default=10000)
    ap.add_argument("--chains", type=int, default=2000)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--search-wakeup-jobs", type=int, default=200)
    ap.add_argument("--search-trivial-jobs", type=int, default=3000)
    ap.add_argument("--search-chains", type=int, default=400)
    ap.add_argument("--search-agents", type=int, default=300)
    ap.add_argument("--finalists", type=int, default=2,
                    help="how many of the search's best settings run a second time")
    ap.add_argument("--no-search", action="store_true",
                    help="skip the search: the first setting of each grid (bench.mjs --list)")
    ap.add_argument("--poll-ms", type=float, default=10.0,
                    help="how often trivial and chains poll for completion (tuvl and peers alike)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one measurement may take")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    args.measures = [m for m in args.measures.split(",") if m]
    for p in peers:
        if p not in PEERS:
            ap.error("unknown peer %s" % p)
    for m in args.measures:
        if m not in MEASURES:
            ap.error("unknown measure %s" % m)
    if not os.access(NODE, os.X_OK):
        raise SystemExit("%s is missing: run bench/peers/install.sh" % NODE)
    # the measures no chosen peer takes are left out
    grid = grids()
    args.measures = [m for m in args.measures if any(m in grid[p] for p in peers)]

    t_start = time.time()
    wakeup.setup(args.db)
    throughput.setup(args.db)
    args.lg = None
    if "agents" in args.measures and any("agents" in grid[p] for p in peers):
        args.lg = Loadgen(os.environ.get("TUVL_LOADGEN_URL"))
        agents_scale.setup(args.db, args.lg)
    wait_for_workers(args.db)
    create_peer_databases(peers)
    out = {
        "config": {"db": args.db, "rounds": args.rounds, "warmup": args.warmup, "poll_ms": args.poll_ms,
                   "n": {"wakeup": args.wakeup_jobs, "trivial": args.trivial_jobs, "chains": args.chains,
                         "agents": args.agents},
                   "search_n": {"wakeup": args.search_wakeup_jobs, "trivial": args.search_trivial_jobs,
                                "chains": args.search_chains, "agents": args.search_agents},
                   "turns_per_agent": TURNS,
                   "steps_per_chain": STEPS, "node": node_version(),
                   "versions": {p: package_version(PACKAGES[p]) for p in peers},
                   "checkpointer": ("@langchain/langgraph-checkpoint-postgres " +
                                    package_version("@langchain/langgraph-checkpoint-postgres"))
                   if "langgraph" in peers else None,
                   "measured_by": {m: ["tuvl"] + [p for p in peers if m in grid[p]] for m in args.measures},
                   "peers": peers, "measures": args.measures, "searched": not args.no_search,
                   "finalists": args.finalists},
        "grids": {p: grid[p] for p in peers},
    }

    log("peers: search over each peer's settings (%s)" % ("first setting only" if args.no_search else "every setting"))
    out["search"], out["best"] = search(args, peers, grid)
    out["search_s"] = time.time() - t_start

    n = {"wakeup": args.wakeup_jobs, "trivial": args.trivial_jobs, "chains": args.chains, "agents": args.agents}
    systems = ["tuvl"] + peers
    out["rounds"] = []
    failed = False
    for r in range(args.rounds):
        # the order reverses every round: tuvl first, then last, ...
        order = systems if r % 2 == 0 else systems[::-1]
        rnd = {"order": order}
        for measure in args.measures:
            m = {}
            for system in order:
                if system != "tuvl" and measure not in grid[system]:
                    continue
                if system == "tuvl":
                    res = tuvl_measure(args, measure, n[measure])
                    log("tuvl %s round %d: %s %.3f" % (measure, r + 1, {"wakeup": "median ms", "agents": "wall s"}
                                                       .get(measure, "rate"), score(measure, res)))
                else:
                    res = peer_measure(args, system, measure, out["best"][system][measure], n[measure])
                if "error" in res or not res.get("ok", True):
                    failed = True
                    res.setdefault("error", "not every job completed")
                    m[system] = res
                    continue
                res["score"] = score(measure, res)
                m[system] = res
            here = [p for p in peers if p in m]
            for p in here:
                m["ratio_" + p] = ratio(measure, m["tuvl"].get("score"), m[p].get("score"))
                if measure == "agents":
                    m["ratio_cpu_" + p] = ratio(measure, m["tuvl"].get("cpu_per_turn_ms"), m[p].get("cpu_per_turn_ms"))
                if measure == "chains":
                    m["ratio_wall_" + p] = ratio(measure, m["tuvl"].get("steps_per_s_wall"),
                                                 m[p].get("steps_per_s_wall"))
            log("round %d %s: %s" % (r + 1, measure, ", ".join(
                "tuvl / %s %.2f%s" % (PEERS[p], m["ratio_" + p],
                                      " (CPU per turn %.2f)" % m["ratio_cpu_" + p] if m.get("ratio_cpu_" + p) else "")
                if m["ratio_" + p] else "%s failed" % PEERS[p]
                for p in here)))
            rnd[measure] = m
        out["rounds"].append(rnd)
        write_json(args.json, out)  # what there is so far, should a later round fail
    out["total_s"] = time.time() - t_start
    write_json(args.json, out)
    if args.lg is not None:
        args.lg.stop()
    log("peers: %.0f s (search %.0f s)" % (out["total_s"], out["search_s"]))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
