#!/usr/bin/env python3
"""Flow control against a provider's rate limits (issue 41).

The load generator (bench/servers/loadgen.mjs) plays a provider that allows
one API key --rpm requests (600) and --tpm tokens (150,000) over any 60 s
window and answers 429 with Retry-After (and retry-after-ms) beyond them
(POST /_limits; test/servers/test_loadgen_limits.py tests that).  Two model
configs point at it with their own keys (an Authorization header):

  bench_flow_a  key flow-a, the limited one
  bench_flow_b  key flow-b, not limited: "a second model"

and bench/agents.py's three-turn agent uses them (agent.retry attempts
--attempts, 10 by default, so that runs outlast a storm of 429s).

Cases, each on an idle system:

  idle       --second (20) agents of model B alone: their time from
             start_run to finish, the baseline
  no_limits  --agents (1,000) agents of model A started at once, and after
             --second-after s (10) the --second agents of model B; model A's
             config has no `limits:`
  limits     the same with `limits: {rpm, tpm}` on model A's config, when
             this build accepts the key (0.3.0, issue 41); otherwise reported
             as not run, with register_llm's error

For each case: the share of model A's requests answered 429 (target <= 1 %),
the rate of model A's admitted requests against the allowed rate, from the
first admitted request to the last (target >= 95 %), the runs completed and
failed, the wall time, and model B's p99 time from start_run to finish
against the idle baseline (target <= 2).  At the defaults the batch takes at
least 5 minutes (3,000 requests at 600 a minute); --agents 10000 is the
issue's batch (50 minutes).

Time scaled: --window S makes the window over which the provider and tuvl
count S seconds instead of 60, for both (the load generator's window_ms and
tuvl.model_limits_window, set with ALTER SYSTEM for the run and restored
after it), with --rpm and --tpm still the requests and tokens allowed per
window.  Everything else keeps its shape, 60 / S times faster: --window 6
runs the issue's 10,000 agents (30,000 requests at 600 a window) in 5
minutes a case instead of 50.  The output says so.

The workers' tuvl.runs_per_worker is raised for the run (as
bench/agents_scale.py does) so that the workers hold every agent at once:
otherwise model B's runs would queue behind model A's for a worker.

    python3 bench/flow_control.py --db bench [--agents 1000] [--window 60] [--json OUT]
    python3 bench/flow_control.py --db bench --agents 10000 --window 6
"""
import argparse
import time

import psycopg2

import agents
from agents import SCRIPT, TURN_SCRIPT, setup_tool
from agents_scale import clean, set_gucs
from common import (Loadgen, connect, log, percentile, settle_workers, wait_for_workers, wait_runs_done,
                    write_json)

KEYS = {"a": "flow-a", "b": "flow-b"}


def llm_source(name, url, key, limits=None):
    src = ("name: %s\nprovider: openai\nbase_url: %s/v1\nmodel: %s\ntimeout: 60s\n"
           "headers: { Authorization: \"Bearer %s\" }\n" % (name, url, SCRIPT, key))
    if limits:
        src += "limits: { rpm: %d, tpm: %d }\n" % (limits["rpm"], limits["tpm"])
    return src


def workflow_source(model, attempts):
    src = agents.workflow_source(0, False, name="bench_flow_" + model, model="bench_flow_" + model,
                                 script="bench/flow_control.py")
    return src.replace("      max_iterations: 8\n",
                       "      max_iterations: 8\n      retry: { on: [timeout, error], attempts: %d, backoff: 1s }\n"
                       % attempts)


def register(cur, model_a_limits, lg, attempts):
    """Model configs and workflows; the error of register_llm with limits
    (None: accepted)."""
    error = None
    cur.execute("SELECT tuvl.register_llm(%s)", (llm_source("bench_flow_b", lg.url, KEYS["b"]),))
    try:
        cur.execute("SELECT tuvl.register_llm(%s)", (llm_source("bench_flow_a", lg.url, KEYS["a"], model_a_limits),))
    except psycopg2.Error as e:
        error = (e.pgerror or str(e)).strip().splitlines()[0]
        cur.execute("SELECT tuvl.register_llm(%s)", (llm_source("bench_flow_a", lg.url, KEYS["a"]),))
    for m in ("a", "b"):
        source = workflow_source(m, attempts)
        cur.execute("SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1",
                    ("bench_flow_" + m,))
        row = cur.fetchone()
        if row is None or row[0] != source:
            cur.execute("SELECT tuvl.register_workflow(%s)", (source,))
    return error


def start(cur, model, n, first_k):
    cur.execute("SELECT array_agg(tuvl.start_run(%s, jsonb_build_object('k', i))) "
                "FROM generate_series(%s, %s) i", ("bench_flow_" + model, first_k, first_k + n - 1))
    return cur.fetchone()[0]


def times(cur, ids):
    cur.execute("SELECT extract(epoch FROM finished_at - created_at)::float8, status FROM tuvl.runs "
                "WHERE id = ANY(%s)", (ids,))
    rows = cur.fetchall()
    done = sorted(1000 * t for t, s in rows if s == "completed")
    return {"runs": len(ids), "completed": len(done),
            "p50_ms": percentile(done, 50) if done else None, "p99_ms": percentile(done, 99) if done else None,
            "max_ms": done[-1] if done else None}


def idle_case(db, lg, args):
    conn = connect(db)
    cur = conn.cursor()
    for m in ("a", "b"):
        clean(cur, "bench_flow_" + m)
    settle_workers(db)
    ids = start(cur, "b", args.second, 1000000)
    wait_runs_done(cur, "bench_flow_b", 300)
    out = times(cur, ids)
    clean(cur, "bench_flow_b")
    conn.close()
    return out


def load_case(db, lg, args, name):
    conn = connect(db)
    cur = conn.cursor()
    for m in ("a", "b"):
        clean(cur, "bench_flow_" + m)
    settle_workers(db)
    lg.call("DELETE", "/_limits")
    lg.call("POST", "/_limits", {"window_ms": int(args.window * 1000),
                                 "keys": {KEYS["a"]: {"rpm": args.rpm, "tpm": args.tpm}}})
    lg.call("DELETE", "/_stats")
    t0 = time.time()
    start(cur, "a", args.agents, 1)
    time.sleep(args.second_after)
    b_ids = start(cur, "b", args.second, 1000000)
    last = time.time()
    while True:
        cur.execute("SELECT count(*) FILTER (WHERE status IN ('queued', 'running')), "
                    "count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status = 'failed') "
                    "FROM tuvl.runs WHERE workflow = 'bench_flow_a'")
        left, completed, failed = cur.fetchone()
        if left == 0:
            break
        if time.time() - last > 30:
            last = time.time()
            k = lg.call("GET", "/_limits")["keys"].get(KEYS["a"], {})
            log("flow_control %s: %d left, %d completed, %d failed; key A %s admitted, %s 429s"
                % (name, left, completed, failed, k.get("admitted"), (k.get("rejected") or {}).get("total")))
        if time.time() - t0 > args.timeout:
            raise SystemExit("flow_control %s: runs unfinished after %d s" % (name, args.timeout))
        time.sleep(0.5)
    wall = time.time() - t0
    wait_runs_done(cur, "bench_flow_b", 300)
    lim = lg.call("GET", "/_limits?series=1")
    a = lim["keys"].get(KEYS["a"], {})
    cur.execute("SELECT min(error) FROM tuvl.runs WHERE workflow = 'bench_flow_a' AND status <> 'completed'")
    an_error = cur.fetchone()[0]
    b = times(cur, b_ids)
    for m in ("a", "b"):
        clean(cur, "bench_flow_" + m)
    conn.close()
    admitted, rejected = a.get("admitted", 0), (a.get("rejected") or {}).get("total", 0)
    per_second = a.get("per_second") or []
    sustained = sustained_per_window(per_second, int(round(args.window)))
    median = median_window(per_second, int(round(args.window)))
    return {
        "agents": args.agents, "wall_s": wall, "completed": completed, "failed": failed, "an_error": an_error,
        "requests": admitted + rejected, "admitted": admitted, "rejected_429": rejected,
        "share_429": rejected / float(max(1, admitted + rejected)),
        "rejected_by": a.get("rejected"),
        # admitted requests in a window (60 s, or --window), the mean over
        # every window that lies between the first admitted request and the last
        "admitted_per_window": sustained,
        "allowed_per_window": args.rpm,
        "window_s": args.window,
        "rate_vs_allowed": sustained / args.rpm if sustained is not None else None,
        # the median window: the steady state, without the first window's
        # ramp and the last ones' drain (the batch's last agents take their
        # turns one after the other, fewer than the rate allows)
        "median_window": median,
        "median_vs_allowed": median / args.rpm if median is not None else None,
        "per_second": per_second,
        "peak_window": a.get("peak_window"),
        "second_model": b,
    }


def sustained_per_window(per_second, window=60):
    """The mean number of admissions in a window of `window` seconds, over
    every such window from the first second with an admission to the last
    (None when they are less than a window apart): a sender that keeps the
    provider saturated scores the limit."""
    active = [i for i, c in enumerate(per_second) if c]
    if not active or active[-1] - active[0] + 1 < window:
        return None
    first, last = active[0], active[-1]
    sums = [sum(per_second[i:i + window]) for i in range(first, last - window + 2)]
    return sum(sums) / float(len(sums))


def window_name(window_s):
    return "minute" if window_s == 60 else "%g s window" % window_s


def scaling(args):
    """The time scale of the run, for people."""
    if args.window == 60:
        return "real time: %d requests and %d tokens a minute" % (args.rpm, args.tpm)
    return ("time scaled %gx: the provider and tuvl count over a %g s window (tuvl.model_limits_window and "
            "the load generator's window_ms) instead of 60 s, allowing %d requests and %d tokens a window "
            "(= %d and %d a minute)" % (60.0 / args.window, args.window, args.rpm, args.tpm,
                                        round(args.rpm * 60 / args.window), round(args.tpm * 60 / args.window)))


def median_window(per_second, window=60):
    """The median of the same windows' admissions (None as above)."""
    active = [i for i, c in enumerate(per_second) if c]
    if not active or active[-1] - active[0] + 1 < window:
        return None
    first, last = active[0], active[-1]
    sums = sorted(sum(per_second[i:i + window]) for i in range(first, last - window + 2))
    return float(sums[len(sums) // 2])


def describe(name, r, idle):
    b = r["second_model"]
    ratio = b["p99_ms"] / idle["p99_ms"] if b["p99_ms"] and idle["p99_ms"] else None
    r["second_p99_vs_idle"] = ratio
    return ("flow_control: %-9s %d agents in %.0f s (%d completed, %d failed%s); model A: %d requests, "
            "%d answered 429 (%.1f %%, target <= 1 %%), %s admitted a %s = %s of the %d allowed "
            "(target >= 95 %%; median window %s); model B: p99 %.0f ms = %s x idle (target <= 2)"
            % (name, r["agents"], r["wall_s"], r["completed"], r["failed"],
               ": %s" % r["an_error"][:160] if r["an_error"] else "", r["requests"], r["rejected_429"],
               100 * r["share_429"], "%.0f" % r["admitted_per_window"] if r["admitted_per_window"] else "n/a",
               window_name(r["window_s"]),
               "%.0f %%" % (100 * r["rate_vs_allowed"]) if r["rate_vs_allowed"] else "n/a (under a window)",
               r["allowed_per_window"],
               "%.0f = %.0f %%" % (r["median_window"], 100 * r["median_vs_allowed"]) if r.get("median_window") else "n/a",
               b["p99_ms"] or 0, "%.2f" % ratio if ratio else "n/a"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--rpm", type=int, default=600, help="requests allowed per window")
    ap.add_argument("--tpm", type=int, default=150000, help="tokens allowed per window")
    ap.add_argument("--window", type=float, default=60.0,
                    help="seconds: the window of the provider's and tuvl's limits (60; less scales time)")
    ap.add_argument("--second", type=int, default=20, help="agents of the second model")
    ap.add_argument("--second-after", type=float, default=10.0, help="seconds into the batch")
    ap.add_argument("--attempts", type=int, default=10, help="the agents' retry attempts")
    ap.add_argument("--cases", default="no_limits,limits")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--json")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]

    if args.window < 1 or args.window != int(args.window):
        raise SystemExit("--window must be a whole number of seconds, at least 1")
    lg = Loadgen()
    out = {"config": vars(args), "scaling": scaling(args), "cases": {}, "not_run": {}}
    print("flow_control: %s" % scaling(args))
    nworkers = wait_for_workers(args.db)
    old = set_gucs({"tuvl.model_limits_window": "%dms" % int(args.window * 1000),
                    "tuvl.runs_per_worker": -(-(args.agents + args.second) // nworkers) + 100})
    try:
        lg.call("POST", "/_script", {"name": SCRIPT, "turns": TURN_SCRIPT})
        conn = connect(args.db)
        cur = conn.cursor()
        setup_tool(cur)
        limits = {"rpm": args.rpm, "tpm": args.tpm}
        error = register(cur, limits, lg, args.attempts)
        out["limits_accepted"] = error is None
        if error:
            log("flow_control: this build refuses limits: (%s)" % error)
            if "limits" in cases:
                out["not_run"]["limits"] = "register_llm refused `limits:`: " + error
        conn.close()
        idle = idle_case(args.db, lg, args)
        out["idle"] = idle
        print("flow_control: idle      model B alone: %d agents, p99 %.0f ms" % (idle["runs"], idle["p99_ms"] or 0))
        for case in cases:
            if case in out["not_run"]:
                continue
            conn = connect(args.db)
            register(conn.cursor(), limits if case == "limits" else None, lg, args.attempts)
            conn.close()
            r = load_case(args.db, lg, args, case)
            print(describe(case, r, idle))
            out["cases"][case] = r
            write_json(args.json, out)
        for case, why in out["not_run"].items():
            print("flow_control: %-9s not run: %s" % (case, why))
        write_json(args.json, out)
    finally:
        set_gucs(old)
        lg.stop()


if __name__ == "__main__":
    main()
