#!/usr/bin/env python3
"""Print the Markdown results block of bench/run from the JSON the benchmarks wrote.

usage: report.py DIR   (DIR holds wakeup.json, throughput.json, isolation.json, http.json,
                       agents.json, console.json, env.json, and peers.json with bench/run --peers)
"""
import json
import os
import sys


def load(d, name):
    path = os.path.join(d, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ms4(s):
    return "%.3f / %.3f / %.3f / %.3f ms" % (s["median"], s["p95"], s["p99"], s["max"])


def num(x, fmt="{:,.0f}"):
    return "n/a" if x is None else fmt.format(x)


def f1(x):
    return "n/a" if x is None else "%.1f" % x


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return None if n == 0 else xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0


def mb(kb):
    return "n/a" if kb is None else "%.1f" % (kb / 1024.0)


PEER_NAMES = {"tuvl": "tuvl", "pgboss": "pg-boss", "graphile": "graphile-worker", "dbos": "DBOS Transact",
              "langgraph": "LangGraph JS"}


def span(xs, fmt):
    """median (min - max) of the rounds' values; fmt is a format string or a function"""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    f = fmt if callable(fmt) else (lambda x: fmt % x)
    return "%s (%s - %s)" % (f(median(xs)), f(min(xs)), f(max(xs)))


def peers_section(peers, p):
    """The Peers section: bench/peers.py's JSON, tuvl against pg-boss, graphile-worker, DBOS and LangGraph."""
    cfg = peers["config"]
    rounds = peers["rounds"]
    names = cfg["peers"]
    systems = ["tuvl"] + names
    n = cfg["n"]
    p("### Peers: tuvl against %s on the same cluster" % ", ".join(PEER_NAMES[x] for x in names))
    p("")
    p("%s on Node %s; %d round%s; in each round every measure ran tuvl and each peer in turn (the order "
      "reversed every round); each peer with %s. "
      "tuvl / peer > 1 means tuvl is better (wake-up, agents' wall and CPU: peer / tuvl)."
      % (", ".join("%s %s" % (PEER_NAMES[x], cfg["versions"][x]) for x in names)
         + (" with %s" % cfg["checkpointer"] if cfg.get("checkpointer") else ""), cfg["node"], len(rounds),
         "" if len(rounds) == 1 else "s",
         "its best setting from a search over its grid (%s wake-up jobs, %s trivial jobs, %s chains, %s agents)" % (
             num(cfg["search_n"]["wakeup"]), num(cfg["search_n"]["trivial"]), num(cfg["search_n"]["chains"]),
             num(cfg["search_n"].get("agents", 0)))
         if cfg.get("searched") else "the first setting of its grid (no search)"))
    p("")
    measures = [
        ("wakeup", "wake-up latency from before commit, median of %s jobs (ms)" % num(n["wakeup"]),
         lambda r: r["before_commit_ms"]["median"], "%.3f", "ratio_"),
        ("trivial", "trivial jobs, %s in one transaction: jobs/s, commit -> all complete" % num(n["trivial"]),
         lambda r: r["jobs_per_s"], num, "ratio_"),
        ("chains", "%s chains x %d steps, each step's result recorded: steps/s, first step's start -> last completion"
         % (num(n["chains"]), cfg["steps_per_chain"]), lambda r: r["steps_per_s"], num, "ratio_"),
        ("chains", "the same chains: steps/s, commit -> all complete (wall)",
         lambda r: r["steps_per_s_wall"], num, "ratio_wall_"),
        ("agents", "%s three-turn agents, 0 ms model (load generator): wall s" % num(n.get("agents", 0)),
         lambda r: r["wall_s"], "%.2f", "ratio_"),
        ("agents", "the same agents: CPU per model turn, ms (tuvl: workers; peer: its processes and their backends)",
         lambda r: r["cpu_per_turn_ms"], "%.3f", "ratio_cpu_"),
    ]
    measured_by = cfg.get("measured_by") or {m: systems for m in cfg["measures"]}
    p("| measure | system (setting) | median (range) over rounds | tuvl / peer, median (range) | WAL bytes / step | commits / step |")
    p("|---|---|---|---|---|---|")
    for m, label, value, fmt, rkey in measures:
        if m not in cfg["measures"]:
            continue
        for system in measured_by[m]:
            res = [r[m][system] for r in rounds if "error" not in r[m][system]]
            setting = "" if system == "tuvl" else " `%s`" % peers["best"][system][m]
            cost = ["", ""]
            if m in ("trivial", "chains") and rkey == "ratio_":
                cost = [span([x.get("wal_bytes_per_step") for x in res], num),
                        span([x.get("commits_per_step") for x in res], "%.3f")]
            failed = len(rounds) - len(res)
            p("| %s | %s%s | %s%s | %s | %s | %s |"
              % (label if system == "tuvl" else "", PEER_NAMES[system], setting,
                 span([value(x) for x in res], fmt), " (%d failed)" % failed if failed else "",
                 "" if system == "tuvl" else span([r[m].get(rkey + system) for r in rounds], "%.2f"),
                 cost[0], cost[1]))
    p("")
    p("Peers, every round:")
    p("")
    p("| round (first) | measure | %s | %s |"
      % (" | ".join(PEER_NAMES[x] for x in systems), " | ".join("tuvl / " + PEER_NAMES[x] for x in names)))
    p("|---|---|%s%s" % ("---|" * len(systems), "---|" * len(names)))

    def cell(m, res):
        if "error" in res:
            return "failed: %s" % res["error"]
        if m == "wakeup":
            return ms4(res["before_commit_ms"])
        if m == "trivial":
            return "%s jobs/s" % num(res["jobs_per_s"])
        if m == "agents":
            return "%.2f s, %.3f ms CPU/turn" % (res["wall_s"], res["cpu_per_turn_ms"])
        return "%s steps/s (wall %s)" % (num(res["steps_per_s"]), num(res["steps_per_s_wall"]))

    for i, r in enumerate(rounds):
        for m in cfg["measures"]:
            ratios = []
            for x in names:
                v = r[m].get("ratio_" + x)
                w = r[m].get("ratio_wall_" + x)
                c = r[m].get("ratio_cpu_" + x)
                ratios.append("" if x not in r[m] else "n/a" if v is None else "%.2f%s%s" % (
                    v, " (wall %.2f)" % w if w is not None else "", " (CPU %.2f)" % c if c is not None else ""))
            p("| %d (%s) | %s | %s | %s |" % (i + 1, PEER_NAMES[r["order"][0]], m,
                                             " | ".join(cell(m, r[m][x]) if x in r[m] else "" for x in systems),
                                             " | ".join(ratios)))
    p("")
    if not cfg.get("searched"):
        return
    p("Settings tried (search runs: median ms for wake-up, jobs/s or steps/s otherwise; the %d best ran twice, "
      "and the winner, in bold, has the better mean):" % cfg.get("finalists", 1))
    p("")
    for x in names:
        for m in cfg["measures"]:
            if m not in peers["search"][x]:
                continue
            cells = []
            for e in peers["search"][x][m]:
                runs = ["failed" if r.get("score") is None else
                        "%.3f" % r["score"] if m == "wakeup" else "%.2f s" % r["score"] if m == "agents"
                        else num(r["score"]) for r in e["runs"]]
                text = "`%s` %s" % (e["setting"], " / ".join(runs))
                cells.append("**%s**" % text if e["setting"] == peers["best"][x][m] else text)
            p("- %s, %s: %s" % (PEER_NAMES[x], m, "; ".join(cells)))
    p("")


def insight_rows(ins, p):
    """The HTTP front door (bench/insight.mjs): its rows of the summary table."""
    lat = ins.get("latency")
    if lat:
        h, d = lat["http"], lat["direct"]
        o = lat["overhead_p50_ms"]
        p("| insight: a start over HTTP (POST /api/workflows/{name}/runs, 202) against `tuvl.start_run()` on a direct connection, one at a time, %s each: p50 HTTP / direct (p99 HTTP / direct) | %.3f / %.3f ms (%.3f / %.3f) | |"
          % (num(h["n"]), h["median"], d["median"], h["p99"], d["p99"]))
        p("| insight: p50 overhead of the HTTP start | %.3f ms | <= 1 ms: **%s** |" % (o, "met" if o <= 1.0 else "missed"))
    thr = ins.get("throughput")
    if thr:
        ratios = [r["ratio"] for r in thr]
        p("| insight: starts/s with %d clients at once, HTTP / direct, each round; ratio median (range) | %s; %.2f (%.2f - %.2f) | ratio >= 0.5: **%s** |"
          % (ins["config"]["clients"], ", ".join("%s / %s" % (num(r["http"]["per_s"]), num(r["direct"]["per_s"])) for r in thr),
             median(ratios), min(ratios), max(ratios), "met" if median(ratios) >= 0.5 else "missed"))
    st = ins.get("streams")
    if st:
        dm = st["delivery_ms"]
        p("| insight: %s SSE clients on one server, each following a run; a form submitted at %d/s: delivery after the commit's NOTIFY, p50 / p99 / max over %s live events | %s / %s / %s ms | p99 <= 50 ms: **%s** |"
          % (num(st["streams"]), st["rate"], num(dm.get("n")), f1(dm.get("median")), f1(dm.get("p99")), f1(dm.get("max")),
             "met" if dm.get("p99") is not None and dm["p99"] <= 50 else "missed"))
        p("| insight: every stream got its run's every event once, in order, and ended with the run | %s (%d of %d streams ended; opened in %.1f s) | all |"
          % ("**PASS**" if st["ok"] else "**FAIL**", st["ended"], st["streams"], st["open_s"]))


def tls_section(tls, p):
    """bench/agents_tls.py: a model turn against a step, by transport."""
    cfg = tls["config"]
    p("Agents over HTTPS and HTTP/2 (bench/agents_tls.py): %s three-turn agents at 0 ms per transport against "
      "%s five-step runs, %d rounds alternating; the workers' CPU from /proc:" % (
          num(cfg["agents"]), num(cfg["steps_runs"]), len(tls["rounds"])))
    p("")
    p("| transport | CPU per turn, median (range) | turn / step (target <= 3) | / plain HTTP (target <= 1.3) "
      "| connections per worker over the batch (target <= 8 over HTTP/2) | TLS handshakes (resumed) |")
    p("|---|---|---|---|---|---|")
    summary = tls.get("summary", {})
    for m in ("http", "https_h1", "https_h2"):
        if m in tls.get("not_run", {}):
            p("| %s | not run: %s | | | | |" % (m, tls["not_run"][m].replace("|", "/")))
            continue
        rs = [r[m] for r in tls["rounds"] if m in r]
        if not rs:
            continue
        s = summary.get(m, {})
        p("| %s | %s µs | %s | %s | %s | %s |" % (
            m, span([r["cpu_per_turn_us"] for r in rs], "%.0f"), span([r["turn_per_step"] for r in rs], "%.2f"),
            "%.2f" % s["cpu_vs_http"] if s.get("cpu_vs_http") else "",
            span([r["connections_per_worker"] for r in rs], "%.1f"),
            " / ".join("%d (%d)" % (r["tls"]["handshakes"], r["tls"]["resumed"]) for r in rs)))
    p("")
    p("A step: %s µs of worker CPU (median of the rounds)." % f1(summary.get("cpu_per_step_us")))
    p("")


def linearity_section(lin, p):
    """bench/agents_linearity.py: a long conversation's turn against a short one's."""
    cfg = lin["config"]
    s = lin.get("summary") or {}
    within = [r for r in lin["rounds"] if r.get("within_late_per_early") is not None]
    p("Long conversations (bench/agents_linearity.py): batches of %s autonomous agents of 5, 10, 45 and 50 turns "
      "at 0 ms, %d rounds; a turn's worker CPU read off within the 50-turn batch (the agents take their turns "
      "in step: the CPU between the answers to turns 5 and 10, and 45 and 50, of all of them), and from the "
      "difference of batches five turns apart, which the machine's noise from batch to batch can swamp:" % (
          num(cfg["agents"]), len(lin["rounds"])))
    p("")
    p("| measured | turns 6-10, each | turns 46-50, each | late / early (target <= 2) | all agents completed |")
    p("|---|---|---|---|---|")
    if within:
        p("| within the 50-turn batch | %s µs | %s µs | %s | %s |" % (
            span([r["within_early_us"] for r in within], "%.0f"),
            span([r["within_late_us"] for r in within], "%.0f"),
            span([r["within_late_per_early"] for r in within], "%.2f"),
            "yes" if s.get("ok") else "**no**"))
    p("| batches of 10 - 5 and 50 - 45 turns | %s µs | %s µs | %s | %s |" % (
        span([r["early_turn_us"] for r in lin["rounds"]], "%.0f"),
        span([r["late_turn_us"] for r in lin["rounds"]], "%.0f"),
        span([r["late_per_early"] for r in lin["rounds"] if r["late_per_early"] is not None], "%.2f"),
        "yes" if s.get("ok") else "**no**"))
    p("")


def flow_section(flow, p):
    """bench/flow_control.py: a provider's rate limits (over a window of
    60 s, or a shorter one that scales time: flow["scaling"] says)."""
    cfg = flow["config"]
    window = cfg.get("window", 60)
    per = "a minute" if window == 60 else "a %g s window" % window
    p("Flow control (bench/flow_control.py): %s three-turn agents on one key limited to %s requests and %s tokens "
      "%s (429 with Retry-After beyond), %d agents of a second model on another key %g s in%s:" % (
          num(cfg["agents"]), num(cfg["rpm"]), num(cfg["tpm"]), per, cfg["second"], cfg["second_after"],
          "; " + flow["scaling"] if window != 60 and flow.get("scaling") else ""))
    p("")
    p("| case | wall | completed / failed | requests | 429s (target <= 1 %%) | admitted %s / allowed "
      "(target >= 95 %%) | second model p99 / idle (target <= 2) |" % per)
    p("|---|---|---|---|---|---|---|")
    idle = flow.get("idle") or {}
    for case in ("no_limits", "limits"):
        if case in flow.get("not_run", {}):
            p("| %s | not run: %s | | | | | |" % (case, flow["not_run"][case].replace("|", "/")))
            continue
        r = flow.get("cases", {}).get(case)
        if not r:
            continue
        b = r["second_model"]
        ratio = b["p99_ms"] / idle["p99_ms"] if b.get("p99_ms") and idle.get("p99_ms") else None
        admitted = r.get("admitted_per_window", r.get("admitted_per_min"))
        allowed = r.get("allowed_per_window", r.get("allowed_per_min"))
        p("| %s | %.0f s | %d / %d | %s | %s (%.1f %%) | %s / %s (%s%s) | %s ms / %s ms (%s) |" % (
            case, r["wall_s"], r["completed"], r["failed"], num(r["requests"]), num(r["rejected_429"]),
            100 * r["share_429"], "%.0f" % admitted if admitted else "n/a",
            num(allowed), "%.0f %%" % (100 * r["rate_vs_allowed"]) if r.get("rate_vs_allowed") else "n/a",
            "; median window %.0f %%" % (100 * r["median_vs_allowed"]) if r.get("median_vs_allowed") else "",
            num(b.get("p99_ms")), num(idle.get("p99_ms")), "%.2f" % ratio if ratio else "n/a"))
    p("")


def main():
    d = sys.argv[1]
    env = load(d, "env.json") or {}
    wake = load(d, "wakeup.json")
    thr = load(d, "throughput.json")
    iso = load(d, "isolation.json")
    http = load(d, "http.json")
    agents = load(d, "agents.json")
    scale = load(d, "agents_scale.json")
    scale50k = load(d, "agents_scale50k.json")
    fair = load(d, "fairness.json")
    tracing = load(d, "tracing.json")
    mcp = load(d, "mcp.json")
    mcp26 = load(d, "mcp_stateless.json")
    ret = load(d, "retention.json")
    peers = load(d, "peers.json")
    tls = load(d, "agents_tls.json")
    lin = load(d, "agents_linearity.json")
    flow = load(d, "flow.json")
    wal = load(d, "wal.json")
    insight = load(d, "insight.json")
    console = load(d, "console.json")
    out = []
    p = out.append

    p("## tuvl benchmark results")
    p("")
    p("- date: %s" % env.get("date", "?"))
    p("- machine: %s CPUs (%s), %s; load average (1/5/15 min) %s before, %s after"
      % (env.get("nproc", "?"), env.get("cpu", "?"), env.get("kernel", "?"),
         env.get("load_before", "?"), env.get("load_after", "?")))
    p("- server: %s; tuvl %s at %s; fsync on, default GUCs (%s workers per database)"
      % (env.get("pg", "?"), env.get("tuvl", "?"), env.get("commit", "?"), env.get("workers", "?")))
    p("- command: `%s`; each benchmark ran %s times, the better round is in the summary"
      % (env.get("command", "bench/run"), env.get("rounds", "?")))
    p("")
    p("| benchmark | result | target |")
    p("|---|---|---|")
    if wake:
        b = wake["rounds"][wake["best"]]
        a = b["after_commit_ms"]
        p("| wake-up latency, agent_started after commit returned (median / p95 / p99 / max, %d runs) | %s | median <= 1 ms: **%s** |"
          % (a["n"], ms4(a), "met" if a["median"] <= 1.0 else "missed"))
        bc = b["before_commit_ms"]
        p("| wake-up latency, agent_started after the client called commit | %s | median <= 1 ms: **%s** |"
          % (ms4(bc), "met" if bc["median"] <= 1.0 else "missed"))
        p("| commit round trip of start_run (median / p95 / p99 / max) | %s | |" % ms4(b["commit_ms"]))
    if thr:
        r = thr["rounds"][thr["best"]]
        t = r["tuvl"]
        p("| throughput, %s runs x %d Functional steps: steps/s (server span / wall clock) | %s / %s | |"
          % (num(t["runs"]), thr["steps_per_run"], num(t["steps_per_s"]), num(t["steps_per_s_wall"])))
        if "pgbench" in r:
            p("| `%s` (same round), tps without connection time | %s | |" % (r["pgbench"]["command"], num(r["pgbench"]["tps"])))
            p("| ratio steps/s / pgbench tps | %.2f (wall %.2f) | >= 1.0: **%s** |"
              % (r["ratio"], r["ratio_wall"], "met" if r["ratio"] >= 1.0 else "missed"))
        p("| steps per commit (%s worker commits; %s WAL flushes) | %s (%s steps per WAL flush) | |"
          % (num(t["worker_commits"]), num(t["delta"]["wal_sync"]), num(t["steps_per_commit"], "{:.1f}"),
             num(t["steps_per_wal_sync"], "{:.1f}")))
        p("| WAL per step | %s bytes, %.1f records | |"
          % (num(t["delta"]["wal_bytes"] / t["steps"]), t["delta"]["wal_records"] / t["steps"]))
    if iso:
        bs = iso["by_status"]
        p("| batch isolation: %s runs, every 10th fails, no error route | %s: %s completed, %s failed, %d/%d checks passed | exactly 100 failed, 900 completed, journals gapless |"
          % (num(iso["runs"]), "**PASS**" if iso["ok"] else "**FAIL**", bs.get("completed", 0), bs.get("failed", 0),
             sum(1 for c in iso["checks"] if c["ok"]), len(iso["checks"])))
    if http:
        rs = http["rounds"]
        b = http["best"]
        eps = [r["fast"]["effects_per_s"] for r in rs]
        lgc = b["fast"]["loadgen"]
        w = http.get("warmup")
        warm = ("; after a warm-up of %s runs, not counted (%s effects/s)" % (num(w["runs"]), num(w["effects_per_s"]))
                if w else "")
        p("| HTTP effects: %s one-request runs against the load generator at 0 ms, 2 workers: effects/s, median (range) of %d rounds%s; the generator's CPU (event loop busy) | %s (%s - %s); %.2f CPUs (%.0f%%) | >= 5,000: **%s** |"
          % (num(http["runs"]), len(rs), warm, num(median(eps)), num(min(eps)), num(max(eps)), lgc["cpus"],
             100 * lgc["event_loop_utilization"], "met" if median(eps) >= 5000 else "missed"))
        tps = [r["pgbench"]["tps"] for r in (thr or {}).get("rounds", []) if "pgbench" in r]
        if tps:
            # the machine's moment: the same build makes twice the effects on a quiet one
            p("| HTTP effects per second / `pgbench -N` tps of this run (%s, median of %d rounds): the machine's moment, for comparing runs | %.2f | |"
              % (num(median(tps)), len(tps), median(eps) / median(tps)))
        p("| HTTP effects: the same against a 200 ms server: wall, peak transfers in flight in the workers / at the server, ratio 200 ms wall / max(200 ms, 0 ms wall) | %.2f s, %d / %d, %.2f | ratio <= 2: **%s** |"
          % (b["slow"]["wall_s"], b["slow"]["peak_in_flight_workers"], b["slow"]["peak_in_flight"], b["ratio"],
             "met" if b["ratio"] <= 2 else "missed"))
        p("| HTTP effects: every run completed, every Idempotency-Key answered once | %s | all |"
          % ("**PASS**" if http.get("ok") else "**FAIL**"))
    for scale, what in ((scale, "agents at scale"), (scale50k, "agents at scale over HTTPS/HTTP/2")):
        if not (scale and scale.get("rounds")):
            continue
        rs = scale["rounds"]
        cells = ["%.2f s / %.2f s (limit %.2f s)" % (r["slow"]["wall_s"], r["fast"]["wall_s"], r["limit_s"]) for r in rs]
        met = sum(1 for r in rs if r["met"])
        # the verdict is the median round's: its 1 s wall as a share of its limit
        share = median([r["slow"]["wall_s"] / r["limit_s"] for r in rs])
        p(("| " + what + ": %s autonomous agents x 3 turns on %d workers, wall with a 1 s / 0 ms model, each round | %s | 1 s wall <= "
           + scale.get("limit", "1.2 x 3 s + wall(0 ms)") + ", median round: **%s** (%.2f of its limit; %d of %d rounds met) |")
          % (num(scale["runs"]), scale["workers"], "; ".join(cells), "met" if share <= 1.0 else "missed", share,
             met, len(rs)))
        if all(r["slow"].get("last_start_s") is not None for r in rs):
            p("| " + what + ", 1 s model: the last run claimed (its started_at), and half of them, after the commit that queued them, each round | %s | |"
              % ", ".join("%.2f s (half: %.2f s)" % (r["slow"]["last_start_s"], r["slow"]["median_start_s"]) for r in rs))
        s0 = rs[0]["slow"]
        p("| " + what + ", 1 s model: peak runs held / requests in flight in the workers / at the load generator (connections) | %s / %s / %s (%s) | |"
          % (num(s0["peak_runs_held"]), num(s0["peak_in_flight_workers"]), num(s0["loadgen"]["peak_in_flight"]),
             num(s0["loadgen"]["peak_connections"])))
        per = [r["slow"]["worker_kb_per_agent_at_peak"] for r in rs if r["slow"].get("worker_kb_per_agent_at_peak")]
        p("| " + what + ": the workers' private memory growth at its peak / agents in flight then | %s kB per agent | <= %g kB: **%s** |"
          % (", ".join("%.1f" % v for v in per) or "n/a", scale.get("kb_target", 50),
             "met" if per and max(per) <= scale.get("kb_target", 50) else "missed"))
        p("| " + what + ", 1 s model: the load generator's CPU, event loop busy, answers late p99 | %.2f CPU s (%.2f CPUs), %.0f%%, %s ms | not the bottleneck |"
          % (s0["loadgen"]["cpu_s"], s0["loadgen"]["cpus"], 100 * s0["loadgen"]["event_loop_utilization"],
             (s0["loadgen"]["late_ms"] or {}).get("p99")))
        feats = scale.get("feature_pairs") or [r for r in rs if r.get("features")]
        if feats:
            ratios = [r["features_ratio"] for r in feats]
            p("| " + what + ", features on (guardrail on every gate, a hook, tracing%s): wall / the plain 1 s batch, each pair (which went first; worker CPU on / off) | %s | median <= 1.10: **%s** (%.3f) |"
              % ("" if all(r.get("features_traced") for r in feats) else " (no collector: off)",
                 ", ".join("%.3f (%s; %s)" % (r["features_ratio"], r.get("order", ["plain"])[0],
                                              "%.3f" % r["features_cpu_ratio"] if r.get("features_cpu_ratio") else "n/a")
                           for r in feats),
                 "met" if median(ratios) <= 1.10 else "missed", median(ratios)))
        bad = [b for r in rs + (scale.get("feature_pairs") or []) for b in (r.get("fast"), r["slow"], r.get("features"))
               if b and not b["ok"]]
        p("| " + what + ": every run completed with the expected answer, the tool ran twice per run, 3 requests per run answered 200 | %s | all |"
          % ("**PASS**" if not bad else "**FAIL** in %d batches" % len(bad)))
    if agents and agents.get("best"):
        b = agents["best"]
        n = num(agents["runs"])
        others = [r for r in agents["rounds"] if r is not b]
        p("| autonomous agents: %s runs x 3 model turns (2 Functional tool calls), wall time with a 0 ms / 100 ms model | %.3f s / %.3f s%s | |"
          % (n, b["fast"]["wall_s"], b["slow"]["wall_s"],
             "".join(" (other round: %.3f s / %.3f s)" % (r["fast"]["wall_s"], r["slow"]["wall_s"]) for r in others)))
        p("| autonomous agents: ratio 100 ms wall / max(300 ms, 0 ms wall) | %.2f%s | <= 2: **%s** |"
          % (b["ratio"], "".join(" (other round: %.2f)" % r["ratio"] for r in others),
             "met" if b["ratio"] <= 2 else "missed"))
        if b.get("guarded"):
            costs = [r["guard_cost"] for r in agents["rounds"] if r.get("guarded")]
            p("| autonomous agents, 0 ms model, a regex guardrail on the input, tools and output gates: worker CPU guarded / unguarded (wall) | %s | <= 1.10: **%s** |"
              % ("; ".join("%.3f (%.3f s / %.3f s)" % (r["guard_cost"], r["guarded"]["wall_s"], r["fast"]["wall_s"])
                           for r in agents["rounds"] if r.get("guarded")),
                 "met" if costs and min(costs) <= 1.10 else "missed"))
        p("| autonomous agents, 100 ms model: peak requests at the scripted server / transfers in flight in the workers | %d / %d | |"
          % (b["slow"]["peak_concurrent_server"], b["slow"].get("peak_in_flight_workers") or 0))
        growth = agents["rss_growth"]
        cells = []
        worst = 0
        unmeasured = 0
        for w in sorted(growth):
            g = growth[w]
            fresh = (" (started afresh, pid %s -> %s: pid %s measured from %s to %s)"
                     % (g.get("pid_before"), g.get("pid_after"), g.get("pid"), g.get("since"), g.get("until"))
                     if g.get("restarted") else "")
            if g.get("measured") is False or "RssAnon_growth_kb" not in g:
                unmeasured += 1
                cells.append("worker %s started afresh every round (pid %s -> %s): not measured"
                             % (w, g.get("pid_before"), g.get("pid_after")))
                continue
            # the worker's own memory; VmRSS also counts shared_buffers pages first touched
            worst = max(worst, g["RssAnon_growth_kb"])
            cells.append("worker %s: %s -> %s MB (%+.1f; anon %+.1f, shared memory %+.1f)%s"
                         % (w, mb(g["VmRSS_before_kb"]), mb(g["VmRSS_after_kb"]), g["VmRSS_growth_kb"] / 1024.0,
                            g["RssAnon_growth_kb"] / 1024.0, g["RssShmem_growth_kb"] / 1024.0, fresh))
        p("| autonomous agents: worker VmRSS after a %d-run warm-up -> after the last round | %s | private (anon) growth <= 10 MB per worker: **%s** |"
          % (agents["warmup"][0]["runs"] if agents.get("warmup") else 0, "; ".join(cells),
             "not measured" if unmeasured or not cells else "met" if worst <= 10 * 1024 else "missed"))
        every = [ph for r in agents["rounds"] for ph in (r["fast"], r["slow"], r.get("guarded")) if ph] + agents.get("warmup", [])
        bad = [ph for ph in every if not ph["ok"]]
        p("| autonomous agents: every run completed with the expected answer, the tool ran exactly twice per run, 3 requests per run answered 200 | %s (%d phases, %s runs) | all |"
          % ("**PASS**" if not bad else "**FAIL** in %d phases" % len(bad), len(every),
             num(sum(ph["runs"] for ph in every))))
    if mcp and mcp.get("rounds"):
        cells = ["%.3f s / %.3f s (limit %.3f s; answered %d + %d)"
                 % (r["fast"]["wall_s"], r["slow"]["wall_s"], r["limit_s"], r["fast"]["answered"],
                    r["slow"]["answered"]) for r in mcp["rounds"]]
        met = sum(1 for r in mcp["rounds"] if r["met"])
        p("| MCP calls: %s runs at once, one tools/call each on the workers' shared sessions (reference server-everything): wall time with a 0 ms / 200 ms tool, each round | %s | every call answered and 200 ms wall <= 2 x 200 ms + the 0 ms wall: **%s** (%d of %d rounds) |"
          % (num(mcp["runs"]), "; ".join(cells), "met" if met == len(mcp["rounds"]) else "missed",
             met, len(mcp["rounds"])))
    if mcp26 and mcp26.get("rounds"):
        cells = ["%.3f s / %.3f s (limit %.3f s; answered %d + %d; %.3f ms worker CPU per call)"
                 % (r["fast"]["wall_s"], r["slow"]["wall_s"], r["limit_s"], r["fast"]["answered"],
                    r["slow"]["answered"], r["fast"].get("cpu_ms_per_call", float("nan")))
                 for r in mcp26["rounds"]]
        met = sum(1 for r in mcp26["rounds"] if r["met"])
        base = ""
        if mcp and mcp.get("rounds") and all("cpu_ms_per_call" in r["fast"] for r in mcp["rounds"]):
            base = " (session-based: %s ms)" % " / ".join("%.3f" % r["fast"]["cpu_ms_per_call"]
                                                        for r in mcp["rounds"])
        p("| MCP calls on the stateless revision 2026-07-28: %s runs at once, one tools/call each without a session (scripted server): wall time with a 0 ms / 200 ms tool, each round%s | %s | every call answered and 200 ms wall <= 2 x 200 ms + the 0 ms wall: **%s** (%d of %d rounds) |"
          % (num(mcp26["runs"]), base, "; ".join(cells), "met" if met == len(mcp26["rounds"]) else "missed",
             met, len(mcp26["rounds"])))
    if tracing and tracing.get("rounds"):
        ratios = [r["ratio_on_off"] for r in tracing["rounds"]]
        cpu = [r["on"]["cpu_us_per_step_workers"] / r["off"]["cpu_us_per_step_workers"]
               for r in tracing["rounds"] if r["off"].get("cpu_us_per_step_workers")]
        m = median(ratios)
        p("| features on / off (tracing to the OTLP receiver and a metric hook on every step), %s five-step runs a round: throughput ratio, median (range) of %d pairs; worker CPU per step on / off, median | %.3f (%.3f - %.3f); %s | throughput >= 0.90: **%s** |"
          % (num(tracing["runs"]), len(ratios), m, min(ratios), max(ratios),
             "%.3f" % median(cpu) if cpu else "n/a", "met" if m >= 0.90 else "missed"))
        same = tracing.get("same_mode_ratios")
        if same:
            p("| the same, the machine's noise: two neighbouring rounds of the same mode, the second's rate / the first's, median (range) of %d | %.3f (%.3f - %.3f) | |"
              % (len(same), median(same), min(same), max(same)))
    if fair:
        i, l = fair["idle"], fair["loaded"]
        p("| fairness: trivial runs of one role, server latency p50 / p99 (claim wait p50 / p99), idle | %.2f / %.2f ms (%.2f / %.2f) | |"
          % (i["p50"], i["p99"], i["claim_p50"], i["claim_p99"]))
        p("| fairness: the same while another role has %d steps sleeping %.0f s and %s runs queued | %.2f / %.2f ms (%.2f / %.2f); %s of its runs left when done | |"
          % (fair["slow"], fair["slow_seconds"], num(fair["backlog"]), l["p50"], l["p99"],
             l["claim_p50"], l["claim_p99"], num(fair["noisy_unfinished_after_quiet"])))
        p("| fairness: ratio loaded / idle at p50 / p99 | %.1f / %.1f | <= 2 at p99: **%s** |"
          % (fair["ratio_p50"], fair["ratio_p99"], "met" if fair["ratio_p99"] <= 2 else "missed"))
        m = fair.get("memory")
        if m and m.get("responses"):
            g = m["growth_mb"]
            p("| memory: %d runs fetching 10 MB each, tuvl.max_worker_memory = %s: peak private memory growth per worker | %s MB (%.1f s) | bounded: limit + one result's working copies |"
              % (m["responses"], m["limit"], ", ".join("%.0f" % v for v in g.values()), m["wall_s"]))
    if ret:
        p("| retention: tuvl.purge() of %s runs and %s events: time, WAL (bytes per event) | %.1f s, %.0f MB (%.0f) | |"
          % (num(ret["history_runs"]), num(ret["history_events"]), ret["purge_s"],
             ret["purge_wal_bytes"] / 1e6, ret["purge_wal_bytes_per_event"]))
        p("| retention: five-step runs while it purges, steps/s and ratio to the same load without it | %.0f / %.0f (%.2f); %d lost | nothing lost: **%s** |"
          % (ret["during_purge_steps_per_s"], ret["baseline_steps_per_s"], ret["ratio"],
             ret["load_runs_not_completed"], "met" if ret["load_runs_not_completed"] == 0 and ret["history_left"] == 0 else "missed"))
    if insight:
        insight_rows(insight, p)
    if console:
        reqs = console["requests"]
        name95, worst95 = max(((k, r["server"]["p95_ms"]) for k, r in reqs.items()), key=lambda x: x[1])
        p("| console: the runs page with %s runs, list (first and a deep page) and counts for every filter, %d kinds of request: worst server p95 (%s); worst of all | %.1f ms; %.1f ms | p95 <= 300 ms: **%s** |"
          % (num(console["runs"]), len(reqs), name95, worst95, max(r["server"]["max_ms"] for r in reqs.values()),
             "met" if worst95 <= 300 else "missed"))
        a = console.get("agent") or {}
        if a.get("rounds"):
            p("| console: a run page with a %d-turn agent in chromium, until every turn is shown, %d rounds: p50 / max | %.0f / %.0f ms | every round <= 1 s: **%s** |"
              % (a["llm_turns"], a["rounds"], a["p50_ms"], a["max_ms"], "met" if a["max_ms"] <= 1000 else "missed"))
    p("")

    if wal:
        p("Where a step's WAL goes (`bench/wal.py`: %s five-step runs, their queueing included, read back with pg_waldump): %.0f bytes and %.2f records per step, %.0f bytes of them full-page images."
          % (num(wal["runs"]), wal["bytes_per_step"], wal["records_per_step"], wal["fpi_bytes_per_step"]))
        p("")
        p("| relation | record | bytes per step | records per step |")
        p("|---|---|---|---|")
        for r in wal["rows"][:14]:
            p("| %s | %s | %.1f | %.2f |" % (r["relation"], r["record"], r["bytes_per_step"], r["records_per_step"]))
        rest = wal["bytes_per_step"] - sum(r["bytes_per_step"] for r in wal["rows"][:14])
        p("| everything else | | %.1f | |" % rest)
        p("")

    if wake or thr:
        p("All rounds:")
        p("")
        p("| round | wake median | p95 | p99 | max | steps/s | steps/s wall | pgbench tps | ratio | steps/commit |")
        p("|---|---|---|---|---|---|---|---|---|---|")
        n = max(len(wake["rounds"]) if wake else 0, len(thr["rounds"]) if thr else 0)
        for i in range(n):
            cells = [str(i + 1)]
            if wake and i < len(wake["rounds"]):
                a = wake["rounds"][i]["after_commit_ms"]
                cells += ["%.3f" % a["median"], "%.3f" % a["p95"], "%.3f" % a["p99"], "%.3f" % a["max"]]
            else:
                cells += [""] * 4
            if thr and i < len(thr["rounds"]):
                r = thr["rounds"][i]
                t = r["tuvl"]
                cells += [num(t["steps_per_s"]), num(t["steps_per_s_wall"]),
                          num(r["pgbench"]["tps"]) if "pgbench" in r else "",
                          "%.2f" % r["ratio"] if "ratio" in r else "",
                          num(t["steps_per_commit"], "{:.1f}")]
            else:
                cells += [""] * 5
            p("| " + " | ".join(cells) + " |")
        p("")
    if agents and agents.get("rounds"):
        p("Autonomous agents, all rounds (model turn: latency_ms of the llm_turn events, from the request's start to the worker's collecting the answer):")
        p("")
        p("| round | model | wall | peak at server | peak in workers | model turn median / p95 | worker CPU | server CPU | machine busy | seq scans of tuvl.runs (tuples read) | runs_leased_idx entries read | journal per run |")
        p("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(agents["rounds"]):
            for ph in (r["fast"], r["slow"]):
                t = ph.get("llm_turn_ms") or {}
                leased = (ph.get("runs_indexes") or {}).get("runs_leased_idx", {}).get("tuples_read")
                p("| %d | %d ms | %.3f s | %d | %s | %s / %s ms | %.2f s | %s | %.0f%% | %s (%s) | %s | %s kB |"
                  % (i + 1, ph["server_ms"], ph["wall_s"], ph["peak_concurrent_server"],
                     num(ph.get("peak_in_flight_workers")), num(t.get("median")), num(t.get("p95")),
                     ph["worker_cpu_s"], "%.2f s" % ph["server_cpu_s"] if ph.get("server_cpu_s") is not None else "n/a",
                     100 * ph.get("machine_cpu_busy", 0), num(ph.get("runs_seq_scans")),
                     num(ph.get("runs_seq_tup_read")), num(leased),
                     num(ph.get("journal_payload_bytes_per_run", 0) / 1024.0, "{:.1f}")))
        p("")
        p("Worker memory (MB; VmRSS = anon + shared memory + file):")
        p("")
        p("| worker | when | VmRSS | RssAnon | RssShmem | VmHWM |")
        p("|---|---|---|---|---|---|")
        points = [("after warm-up", agents["rss_before"])] + \
                 [("after round %d" % (i + 1), r["rss_after"]) for i, r in enumerate(agents["rounds"])]
        for w in sorted(agents["rss_before"]):
            for label, snap in points:
                m = snap.get(w, {})
                p("| %s (pid %s) | %s | %s | %s | %s | %s |"
                  % (w, m.get("pid", "?"), label, mb(m.get("VmRSS")), mb(m.get("RssAnon")),
                     mb(m.get("RssShmem")), mb(m.get("VmHWM"))))
        p("")
    if tracing and tracing.get("rounds"):
        p("Tracing (tuvl.otlp_endpoint to the OTLP receiver of test/run) off and on, %s five-step runs per round:"
          % num(tracing["runs"]))
        p("")
        p("| round (first mode) | steps/s off | steps/s on | on / off | worker CPU per step off / on (µs) | launcher / receiver CPU per step on (µs) | spans accepted (6 per run) |")
        p("|---|---|---|---|---|---|---|")
        for i, r in enumerate(tracing["rounds"]):
            p("| %d (%s) | %s | %s | %.3f | %s / %s | %s | %s |"
              % (i + 1, "off" if i % 2 == 0 else "on", num(r["off"]["steps_per_s"]), num(r["on"]["steps_per_s"]),
                 r["ratio_on_off"], f1(r["off"].get("cpu_us_per_step_workers")),
                 f1(r["on"].get("cpu_us_per_step_workers")),
                 "%s / %s" % (f1(r["on"].get("cpu_us_per_step_launcher")), f1(r["on"].get("cpu_us_per_step_receiver"))),
                 num(r["on"].get("spans_accepted"))))
        p("")
    if tls and tls.get("rounds"):
        tls_section(tls, p)
    if lin and lin.get("rounds"):
        linearity_section(lin, p)
    if flow and (flow.get("cases") or flow.get("not_run")):
        flow_section(flow, p)
    if peers and peers.get("rounds"):
        peers_section(peers, p)
    if iso:
        p("Batch isolation checks:")
        p("")
        for c in iso["checks"]:
            p("- %s %s: %s" % ("PASS" if c["ok"] else "FAIL", c["check"], c["detail"]))
        p("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
