#!/usr/bin/env python3
"""The cost of this release's features: throughput of 10,000 five-step runs
with tracing (tuvl.otlp_endpoint) and a metric hook on every step off and
on, in alternating rounds on the same cluster.  (Metrics are always on; the
guardrails apply to agents: bench/agents_scale.py --features.)

With tracing on, every run sends six spans (the run and its five steps) to the
OTLP receiver test/run starts (TUVL_OTLP_URL), told only to count them (a
collector runs on another machine; here it would take the workers' CPUs);
the report gives steps/s for both, the ratio on / off of each pair of rounds
(the mode that goes first alternates), and the spans the receiver counted (spans it could not take in time are
dropped by tuvl, never waited for).

The machine is shared and its speed drifts: two rounds of the same mode
differ by a tenth or more.  Rounds are therefore short (no settling pauses:
the CPU comes from /proc, the rate from the runs' own timestamps) and many
(8 pairs by default), the verdict is the median pair's, and the report also
gives how much two neighbouring rounds of the same mode differ (the second
round of a pair and the first of the next), the noise the ratio is read
against.
"""
import argparse
import json
import os
import time
import urllib.request

import throughput
from common import connect, log, register_workflow_once, write_json

# the features-on workflow: `five` with a metric hook on each of its steps
HOOK = """\
name: bench_count_steps
type: hook
events: [after_step]
action: metric
metric: tuvl.hook.events
"""
HOOKED = throughput.WORKFLOW.replace("name: five\n", "name: five_hooked\nhooks: [artifact://bench_count_steps@1]\n")


def setup(db):
    throughput.setup(db)
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("SELECT count(*) FROM tuvl.artifacts WHERE name = 'bench_count_steps'")
    if cur.fetchone()[0] == 0:
        cur.execute("SELECT tuvl.register_artifact(%s)", (HOOK,))
    register_workflow_once(cur, "five_hooked", HOOKED)
    conn.close()


def hook_events(db):
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("SELECT coalesce(sum(value), 0) FROM tuvl.metrics WHERE name = 'tuvl.hook.events'")
    n = float(cur.fetchone()[0])
    conn.close()
    return n

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def receiver(method, path):
    req = urllib.request.Request(os.environ["TUVL_OTLP_URL"] + path, method=method)
    with OPENER.open(req, timeout=30) as resp:
        return json.loads(resp.read().decode())


CLK_TCK = os.sysconf("SC_CLK_TCK")


def tuvl_cpu(dbname):
    """CPU seconds used so far by the database's workers and by the launcher."""
    conn = connect("postgres")
    cur = conn.cursor()
    cur.execute("SELECT pid, backend_type FROM pg_stat_activity "
                "WHERE (backend_type = 'tuvl worker' AND datname = %s) OR backend_type = 'tuvl launcher'",
                (dbname,))
    cpu = {"workers": 0.0, "launcher": 0.0, "receiver": 0.0}
    for pid, kind in cur.fetchall():
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used = (int(fields[11]) + int(fields[12])) / CLK_TCK
        cpu["workers" if kind == "tuvl worker" else "launcher"] += used
    conn.close()
    # the OTLP receiver test/run started (node otlp_receiver.js)
    for pid in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if b"otlp_receiver.js" not in f.read():
                    continue
            with open("/proc/%s/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu["receiver"] += (int(fields[11]) + int(fields[12])) / CLK_TCK
        except (OSError, ValueError):
            continue
    return cpu


def one_round(db, runs, workflow):
    """runs five-step runs of workflow on a truncated journal: steps/s over
    the server's span (first start to last finish) and the CPU per step.
    No statistics are read, so no settling pause is needed between rounds:
    rounds are short and the two modes run close together in time."""
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("TRUNCATE tuvl.journal, tuvl.runs")
    cur.execute("CHECKPOINT")
    cpu0 = tuvl_cpu(db)
    hooks0 = hook_events(db)
    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run(%s)) FROM generate_series(1, %s)", (workflow, runs))
    conn.commit()
    conn.autocommit = True
    deadline = time.time() + 300
    while True:
        cur.execute("SELECT EXISTS (SELECT 1 FROM tuvl.runs WHERE status = 'queued') "
                    "OR EXISTS (SELECT 1 FROM tuvl.runs WHERE status = 'running')")
        if not cur.fetchone()[0]:
            break
        if time.time() > deadline:
            raise SystemExit("runs of %s still unfinished after 300 s" % workflow)
        time.sleep(0.02)
    cpu1 = tuvl_cpu(db)
    cur.execute("SELECT count(*) FILTER (WHERE status = 'completed'), "
                "extract(epoch FROM max(finished_at) - min(started_at))::float8 FROM tuvl.runs")
    completed, span = cur.fetchone()
    conn.close()
    if completed != runs:
        raise SystemExit("%d of %d runs of %s completed" % (completed, runs, workflow))
    steps = throughput.STEPS * runs
    res = {"runs": runs, "steps": steps, "server_span_s": span, "steps_per_s": steps / span,
           "hook_events": hook_events(db) - hooks0}
    for k in cpu0:
        res["cpu_us_per_step_" + k] = (cpu1[k] - cpu0[k]) * 1e6 / steps
    return res


def set_endpoint(value):
    conn = connect("postgres")
    cur = conn.cursor()
    cur.execute("ALTER SYSTEM SET tuvl.otlp_endpoint = %s", (value,))
    cur.execute("SELECT pg_reload_conf()")
    conn.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        c = connect("postgres")
        cur = c.cursor()
        cur.execute("SELECT current_setting('tuvl.otlp_endpoint')")
        shown = cur.fetchone()[0]
        c.close()
        if shown == value:
            time.sleep(0.5)  # the workers and the launcher reload within it
            return
        time.sleep(0.1)
    raise SystemExit("tuvl.otlp_endpoint did not change to %r" % value)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.environ.get("TUVL_OTLP_URL"):
        raise SystemExit("TUVL_OTLP_URL is not set: bench/run starts the OTLP receiver")
    setup(args.db)
    endpoint = os.environ["TUVL_OTLP_URL"] + "/v1/traces"
    # a collector runs elsewhere: here it only counts, to take little of the CPUs
    receiver("POST", "/_mode?count_only=1")
    rounds = []
    try:
        # one round of each mode first, not counted: what ran before (the
        # garbage a benchmark left to autovacuum, a cold cache) slowed the
        # first pair by a third in a bench/run
        for mode in ("off", "on"):
            set_endpoint(endpoint if mode == "on" else "")
            one_round(args.db, args.runs, "five_hooked" if mode == "on" else "five")
        receiver("DELETE", "/spans")
        for r in range(args.rounds):
            pair = {}
            # ABBA: the mode that goes first alternates, so whatever drifts
            # within a pair (the journal's growth, a checkpoint) hits both
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                set_endpoint(endpoint if mode == "on" else "")
                receiver("DELETE", "/spans")
                res = one_round(args.db, args.runs, "five_hooked" if mode == "on" else "five")
                if mode == "on":
                    time.sleep(0.5)  # the launcher's last batch (every 200 ms)
                    got = receiver("GET", "/spans")
                    res["spans_accepted"] = got["counted"]
                    receiver("DELETE", "/spans")
                pair[mode] = res
                log("features %s, round %d: %.0f steps/s, CPU per step: workers %.1f µs, launcher %.1f µs, "
                    "receiver %.1f µs; %d hook events, %s spans"
                    % (mode, r + 1, res["steps_per_s"], res["cpu_us_per_step_workers"],
                       res["cpu_us_per_step_launcher"], res["cpu_us_per_step_receiver"], res["hook_events"],
                       res.get("spans_accepted", 0)))
            pair["ratio_on_off"] = pair["on"]["steps_per_s"] / pair["off"]["steps_per_s"]
            rounds.append(pair)
    finally:
        set_endpoint("")
        receiver("POST", "/_mode?status=0")
    # the noise of the machine: where two rounds of the same mode follow
    # each other (the second of a pair and the first of the next), how much
    # the second's rate differs from the first's
    same = []
    for i, (a, b) in enumerate(zip(rounds, rounds[1:])):
        mode = "on" if i % 2 == 0 else "off"
        same.append(b[mode]["steps_per_s"] / a[mode]["steps_per_s"])
    out = {"runs": args.runs, "rounds": rounds, "same_mode_ratios": same,
           "ratios": [p["ratio_on_off"] for p in rounds]}
    print(json.dumps({"ratios": out["ratios"]}))
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
