#!/usr/bin/env python3
"""Print the Markdown results block of bench/run from the JSON the benchmarks wrote.

usage: report.py DIR   (DIR holds wakeup.json, throughput.json, isolation.json, env.json)
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


def main():
    d = sys.argv[1]
    env = load(d, "env.json") or {}
    wake = load(d, "wakeup.json")
    thr = load(d, "throughput.json")
    iso = load(d, "isolation.json")
    http = load(d, "http.json")
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
        b = http["best"]
        p("| HTTP effects: 1,000 one-request runs, peak transfers in flight (200 ms server): in the workers (tuvl.worker_status) / seen by the server | %d / %d | >= 500: **%s** |"
          % (b["slow"].get("peak_in_flight_workers", 0), b["slow"]["peak_in_flight"],
             "met" if max(b["slow"].get("peak_in_flight_workers", 0), b["slow"]["peak_in_flight"]) >= 500 else "missed"))
        p("| HTTP effects: wall time with a 0 ms / 200 ms server | %.3f s / %.3f s | |"
          % (b["fast"]["wall_s"], b["slow"]["wall_s"]))
        p("| HTTP effects: ratio 200 ms wall / max(200 ms, 0 ms wall) | %.2f | <= 2: **%s** |"
          % (b["ratio"], "met" if b["ratio"] <= 2 else "missed"))
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
    if iso:
        p("Batch isolation checks:")
        p("")
        for c in iso["checks"]:
            p("- %s %s: %s" % ("PASS" if c["ok"] else "FAIL", c["check"], c["detail"]))
        p("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
