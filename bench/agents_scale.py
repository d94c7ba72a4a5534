#!/usr/bin/env python3
"""Agents at scale: 10,000 autonomous agents in flight on the workers.

Each run is the autonomous Agent step of bench/agents.py (three model
turns; turns 0 and 1 call the Functional tool `note`, turn 2 answers
"done"), answered by the load generator bench/servers/loadgen.mjs (one
Node process, TUVL_LOADGEN_URL, or started here) instead of the Python
scripted server, which cannot hold 10,000 connections.  Two model configs
point at its /lat/0/ and /lat/1000/ prefixes.

Each round queues --runs runs (default 10,000) in one transaction, first
with the 0 ms model, then with the 1 s model, and measures the wall time
from just before COMMIT until a poll sees none of them queued or running.

  target: wall(1 s) <= 1.2 x 3 s + wall(0 ms)

(three 1 s turns are the least a run can take; the 0 ms batch is the same
work without the waiting).  During the 1 s batch it samples, every 20 ms,
the runs the workers hold and the transfers they have in flight
(tuvl.worker_status()) and each worker's private memory (RssAnon from
/proc): worker memory per agent in flight = the growth of the workers'
RssAnon from before the batch to its peak, divided by the agents in
flight at the batch's peak (target <= 50 kB).  The load generator's own CPU,
event-loop utilization and how late its answers left (GET /_stats) show
that it was not the bottleneck.

--features adds a third batch with the 1 s model in which the features of
this release are on: a regex guardrail on all three gates, a metric hook
on every tool call, and tracing (tuvl.otlp_endpoint, --otlp-url or
TUVL_OTLP_URL) to a live collector; its wall against the plain 1 s batch
(target <= 1.10).  The two 1 s batches alternate in which goes first, and
--extra-pairs adds that many more pairs of them after the rounds: the
machine's noise moves a pair by as much as the features cost, and the
verdict is the median pair's.

The workers' tuvl.runs_per_worker is raised for the run (ALTER SYSTEM,
restored at the end) so that two workers may hold 10,000 runs.

--https serves the model over TLS with a certificate made for the run (the
load generator's --tls-dir, in a temporary directory), trusted through
tuvl.http_ca_file (ALTER SYSTEM, restored at the end); --http2 offers HTTP/2
by ALPN, which the workers multiplex (--h2-max-streams: the streams the
server allows a connection, SETTINGS_MAX_CONCURRENT_STREAMS).  Issue 43's
batch at scale is

    python3 bench/agents_scale.py --runs 50000 --https --http2 --kb-target 30

(bench/run --only scale50k): 50,000 agents in flight on the default two
workers, the same wall-time target, at most 30 kB of worker memory per
agent in flight, no error.  It prints a verdict per round on stdout: the
1 s wall against its limit, the memory per agent, the runs not completed
or wrong, and the load generator's CPU, event-loop utilization and how
late its answers left, with the load average of the machine.
"""
import argparse
import json
import os
import shutil
import tempfile
import threading
import time

import agents
from agents import (SCRIPT, TURN_SCRIPT, ANSWER, TOOL_TURNS, TURNS, GUARDRAIL,
                    cpu_seconds, machine_cpu, memory_kb, workers, setup_tool)
from common import Loadgen, connect, log, settle_workers, wait_for_workers, wait_runs_done, write_json

HOOK = """\
name: bench_count_tools
type: hook
events: [after_tool]
action: metric
metric: tuvl.hook.events
"""


def workflow_source(name, ms, features):
    """bench/agents.py's agent, with the guardrail and the hook when features."""
    return agents.workflow_source(ms, features, name="bench_scale_" + name, model="bench_scale_%dms" % ms,
                                  hooks="hooks: [artifact://bench_count_tools@1]\n" if features else None,
                                  script="bench/agents_scale.py")


# ------------------------------------------------------------ settings

def set_gucs(settings):
    """ALTER SYSTEM each name to its value (None: RESET), reload; returns the old values."""
    conn = connect("postgres")
    cur = conn.cursor()
    old = {}
    for name, value in settings.items():
        cur.execute("SELECT setting FROM pg_file_settings WHERE name = %s AND applied "
                    "ORDER BY seqno DESC LIMIT 1", (name,))
        row = cur.fetchone()
        old[name] = row[0] if row else None
        if value is None:
            cur.execute("ALTER SYSTEM RESET %s" % name)
        else:
            cur.execute("ALTER SYSTEM SET %s = %%s" % name, (str(value),))
    cur.execute("SELECT pg_reload_conf()")
    conn.close()
    time.sleep(0.5)
    return old


def setup(db, lg):
    lg.call("POST", "/_script", {"name": SCRIPT, "turns": TURN_SCRIPT})
    conn = connect(db)
    cur = conn.cursor()
    setup_tool(cur)
    for artifact, source in (("bench_no_card_numbers", GUARDRAIL), ("bench_count_tools", HOOK)):
        cur.execute("SELECT count(*) FROM tuvl.artifacts WHERE name = %s", (artifact,))
        if cur.fetchone()[0] == 0:
            cur.execute("SELECT tuvl.register_artifact(%s)", (source,))
    for ms in (0, 1000):
        cur.execute("SELECT tuvl.register_llm(%s)",
                    ("name: bench_scale_%dms\nprovider: openai\nbase_url: %s/lat/%d/v1\n"
                     "model: %s\ntimeout: 60s\n" % (ms, lg.url, ms, SCRIPT),))
    for name, ms, features in (("0ms", 0, False), ("1s", 1000, False), ("1s_features", 1000, True)):
        source = workflow_source(name, ms, features)
        cur.execute("SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1",
                    ("bench_scale_" + name,))
        row = cur.fetchone()
        if row is None or row[0] != source:
            cur.execute("SELECT tuvl.register_workflow(%s)", (source,))
    conn.close()


# ------------------------------------------------------------ one batch

class Sampler(threading.Thread):
    """Every 20 ms: runs held and transfers in flight per worker, and their
    RssAnon; and each worker process's CPU as last seen, so that a worker
    that exits during the batch (to start afresh, worker.c) is counted to
    its last sample, and one that the launcher started during it whole."""

    def __init__(self, db, pids):
        super().__init__(daemon=True)
        self.conn = connect(db)
        self.pids = pids
        self.stop = threading.Event()
        self.peak_in_flight = 0
        self.peak_held = 0
        self.peak_anon_kb = 0          # the workers' RssAnon, summed
        self.in_flight_at_peak_anon = 0
        self.base_anon_kb = sum((memory_kb(p) or {}).get("RssAnon", 0) for p in pids)
        self.cpu_first = {p: cpu_seconds(p) or 0.0 for p in pids}
        self.cpu_last = dict(self.cpu_first)

    def sample_cpu(self, pids):
        for p in pids:
            c = cpu_seconds(p)
            if c is not None:
                self.cpu_first.setdefault(p, 0.0)   # started during the batch
                self.cpu_last[p] = c

    def worker_cpu_s(self):
        return sum(self.cpu_last[p] - self.cpu_first[p] for p in self.cpu_last)

    def run(self):
        cur = self.conn.cursor()
        while not self.stop.is_set():
            cur.execute("SELECT pid, transfers_in_flight, runs_held FROM tuvl.worker_status() "
                        "WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database())")
            rows = cur.fetchall()
            in_flight = sum(r[1] or 0 for r in rows)
            held = sum(r[2] or 0 for r in rows)
            self.sample_cpu(set(self.cpu_last) | {r[0] for r in rows if r[0]})
            anon = sum((memory_kb(p) or {}).get("RssAnon", 0) for p in self.pids)
            self.peak_in_flight = max(self.peak_in_flight, in_flight)
            self.peak_held = max(self.peak_held, held)
            if anon > self.peak_anon_kb:
                self.peak_anon_kb = anon
                self.in_flight_at_peak_anon = in_flight
            time.sleep(0.02)
        self.conn.close()


def loadavg():
    """The machine's load average over 1, 5 and 15 minutes."""
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def db_counters(db):
    """The database's commits and the cluster's WAL bytes, read from database postgres."""
    conn = connect("postgres")
    cur = conn.cursor()
    cur.execute("SELECT pg_stat_clear_snapshot()")
    cur.execute("SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = %s), "
                "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint", (db,))
    commits, wal = cur.fetchone()
    conn.close()
    return commits, wal


def clean(cur, workflow):
    cur.execute("DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE workflow = %s)",
                (workflow,))
    cur.execute("DELETE FROM tuvl.runs WHERE workflow = %s", (workflow,))
    cur.execute("TRUNCATE bench_agents.tool_calls")
    cur.execute("VACUUM tuvl.runs, tuvl.journal")


def batch(db, lg, name, n, timeout=600):
    workflow = "bench_scale_" + name
    conn = connect(db)
    cur = conn.cursor()
    clean(cur, workflow)
    settle_workers(db)
    pids = [pid for _, pid in workers(cur)]
    lg.call("DELETE", "/_log")
    lg.call("DELETE", "/_stats")
    busy0, total0 = machine_cpu()
    load0 = loadavg()
    commits0, wal0 = db_counters(db)
    sampler = Sampler(db, pids)
    sampler.start()
    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run(%s, jsonb_build_object('k', i))) "
                "FROM generate_series(1, %s) i", (workflow, n))
    t0 = time.time()
    conn.commit()
    conn.autocommit = True
    wait_runs_done(cur, workflow, timeout)
    wall = time.time() - t0
    busy1, total1 = machine_cpu()
    sampler.sample_cpu(set(sampler.cpu_last) | set(pids))
    worker_cpu = sampler.worker_cpu_s()
    time.sleep(1.5)             # the workers flush their statistics at most once a second
    commits1, wal1 = db_counters(db)
    stats = lg.call("GET", "/_stats")
    seen = lg.call("GET", "/_log?model=" + SCRIPT)
    lgconns = lg.call("GET", "/_conns")
    sampler.stop.set()
    sampler.join()

    cur.execute("""
        SELECT count(*) FILTER (WHERE status = 'completed' AND end_name = 'finish'
                                  AND response = to_jsonb(%s::text)),
               count(*) FILTER (WHERE status <> 'completed'),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)),
               max(extract(epoch FROM finished_at - started_at)),
               min(error) FILTER (WHERE error IS NOT NULL),
               extract(epoch FROM max(started_at))::float8 - %s,
               extract(epoch FROM percentile_disc(0.5) WITHIN GROUP (ORDER BY started_at))::float8 - %s
        FROM tuvl.runs WHERE workflow = %s""", (ANSWER, t0, t0, workflow))
    expected, not_completed, run_median, run_max, an_error, last_start, median_start = cur.fetchone()
    cur.execute("""
        SELECT count(*) FILTER (WHERE c = 2 AND turns = '{0,1}'), coalesce(sum(c), 0)
        FROM (SELECT k, count(*) c, array_agg(turn ORDER BY turn) turns
              FROM bench_agents.tool_calls GROUP BY k) t""")
    tool_ok, tool_rows = cur.fetchone()
    clean(cur, workflow)
    conn.close()

    script = seen.get("script", {})
    checks = {
        "runs_completed_with_response": expected == n,
        "tool_ran_twice_per_run": tool_ok == n and tool_rows == TOOL_TURNS * n,
        "server_requests": script.get("count") == TURNS * n and script.get("by_status") == {"200": TURNS * n},
    }
    return {
        "workflow": workflow, "runs": n, "wall_s": wall,
        "run_duration_median_s": float(run_median) if run_median is not None else None,
        "run_duration_max_s": float(run_max) if run_max is not None else None,
        # when the workers took the runs, from the commit that queued them:
        # the last one, and half of them
        "last_start_s": last_start, "median_start_s": median_start,
        "not_completed": not_completed, "not_as_expected": n - expected, "an_error": an_error,
        "load": loadavg(), "load_before": load0,
        "peak_in_flight_workers": sampler.peak_in_flight,
        "peak_runs_held": sampler.peak_held,
        "worker_anon_before_kb": sampler.base_anon_kb,
        "worker_anon_peak_kb": sampler.peak_anon_kb,
        "in_flight_at_peak_anon": sampler.in_flight_at_peak_anon,
        # the workers' private memory at its peak over what it was before
        # the batch, per agent in flight at the batch's peak
        "worker_kb_per_agent_at_peak": (sampler.peak_anon_kb - sampler.base_anon_kb) / float(max(1, sampler.peak_in_flight))
        if sampler.peak_in_flight >= 1000 else None,
        "worker_cpu_s": worker_cpu,
        "commits": commits1 - commits0,
        "wal_bytes_per_run": (wal1 - wal0) / float(n),
        "machine_cpu_busy": (busy1 - busy0) / float(max(1, total1 - total0)),
        "loadgen": {
            "cpu_s": stats["cpu_since_reset"]["total_s"],
            "cpus": stats["cpu_since_reset"]["cpus"],
            "us_per_request": stats["cpu_since_reset"]["us_per_request"],
            "event_loop_utilization": stats["event_loop"]["utilization"],
            "late_ms": stats["late_ms"],
            "peak_in_flight": stats["peak_in_flight"],
            "peak_connections": stats["connections"]["peak"],
            "accepted": stats["connections"]["accepted"],
            "listen_overflows": stats.get("listen_overflows"),
            "requests": script.get("count"), "by_turn": script.get("by_turn"),
            "by_status": script.get("by_status"),
            "server_errors": stats["requests"]["errors"], "client_errors": stats["requests"]["client_errors"],
            "rss_mb": stats["memory"]["rss_mb"],
            "gc_ms": stats["gc"]["minor_ms"] + stats["gc"]["major_ms"],
            "tls": lgconns.get("tls"), "h2": lgconns.get("h2"), "by_protocol": lgconns.get("by_protocol"),
        },
        "checks": checks, "ok": all(checks.values()),
    }


def describe(b):
    lg = b["loadgen"]
    return ("%s: %d runs in %.2f s (%d not completed), started by %.2f s (half by %.2f s), "
            "run median %.2f s max %.2f s; peak %d runs held, "
            "%d requests in flight (server: %d, %d connections); worker CPU %.1f s, %d commits, "
            "%.0f bytes of WAL per run, machine %.0f%% busy; "
            "workers' RssAnon %.0f -> %.0f MB, %s kB per agent in flight; "
            "load generator %.2f CPU s (%.2f CPUs, %.0f%% event loop), answers late p99 %s ms; "
            "%s; load average %s"
            % (b["workflow"], b["runs"], b["wall_s"], b["not_completed"], b["last_start_s"] or 0,
               b["median_start_s"] or 0, b["run_duration_median_s"] or 0,
               b["run_duration_max_s"] or 0, b["peak_runs_held"], b["peak_in_flight_workers"],
               lg["peak_in_flight"], lg["peak_connections"], b["worker_cpu_s"], b["commits"],
               b["wal_bytes_per_run"], 100 * b["machine_cpu_busy"],
               b["worker_anon_before_kb"] / 1024.0, b["worker_anon_peak_kb"] / 1024.0,
               "%.1f" % b["worker_kb_per_agent_at_peak"] if b["worker_kb_per_agent_at_peak"] is not None else "n/a",
               lg["cpu_s"], lg["cpus"], 100 * lg["event_loop_utilization"],
               (lg["late_ms"] or {}).get("p99"), transport(lg), " ".join("%.2f" % x for x in b["load"])))


def transport(lg):
    """The connections that the load generator saw, by protocol."""
    h2 = lg.get("h2") or {}
    tls = lg.get("tls") or {}
    return ("connections %s, TLS handshakes %d (resumed %d), h2 streams %d (peak %d at once on a connection)"
            % (json.dumps(lg.get("by_protocol") or {}, sort_keys=True), tls.get("handshakes", 0),
               tls.get("resumed", 0), h2.get("streams", 0), h2.get("peak_concurrent_streams", 0)))


def verdict(r, round_, kb_target, limit_both):
    """One round's verdict, one line: the 1 s wall against its limit, the
    memory per agent in flight, errors, and the load generator's load."""
    fast, slow, limit = round_["fast"], round_["slow"], round_["limit_s"]
    lg = slow["loadgen"]
    kb = slow["worker_kb_per_agent_at_peak"]
    errors = (fast["not_as_expected"] + slow["not_as_expected"]
              + sum(1 for b in (fast, slow) for c in b["checks"].values() if not c))
    late = lg["late_ms"] or {}
    form = "1.2 x (3 s + the 0 ms wall %.2f s)" if limit_both else "1.2 x 3 s + the 0 ms wall %.2f s"
    return (("agents_scale round %d: %s agents, 1 s model: wall %.2f s against " + form +
            " = %.2f s: %s (%.2f of it); peak %s agents in flight, worker memory %s kB per agent in flight "
            "(target <= %g): %s; errors: %s; load generator %.2f CPU s = %.2f CPUs, event loop %.0f%% busy, "
            "answers late p50 %s / p99 %s / max %s ms; load average %s (before the 0 ms batch %s)")
            % (r + 1, "{:,}".format(slow["runs"]), slow["wall_s"], fast["wall_s"], limit,
               "met" if slow["wall_s"] <= limit else "MISSED", slow["wall_s"] / limit, "{:,}".format(slow["peak_in_flight_workers"]),
               "%.1f" % kb if kb is not None else "n/a", kb_target,
               "met" if kb is not None and kb <= kb_target else "MISSED",
               "none" if errors == 0 else "%d runs not completed as expected, checks %s, an error: %s"
               % (fast["not_as_expected"] + slow["not_as_expected"],
                  json.dumps({k: v for b in (fast, slow) for k, v in b["checks"].items() if not v}),
                  slow["an_error"] or fast["an_error"]),
               lg["cpu_s"], lg["cpus"], 100 * lg["event_loop_utilization"], late.get("p50"), late.get("p99"),
               late.get("max"), " ".join("%.2f" % x for x in slow["load"]),
               " ".join("%.2f" % x for x in fast["load_before"])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--loadgen", default=os.environ.get("TUVL_LOADGEN_URL"),
                    help="the load generator's URL (default: start one)")
    ap.add_argument("--features", action="store_true",
                    help="also a batch with a guardrail on every gate, a hook and tracing on")
    ap.add_argument("--otlp-url", default=os.environ.get("TUVL_OTLP_URL"),
                    help="the OTLP/HTTP collector for --features (default TUVL_OTLP_URL)")
    ap.add_argument("--extra-pairs", type=int, default=2,
                    help="with --features: this many more pairs of a plain 1 s batch and one with the "
                         "features on, after the rounds (default 2)")
    ap.add_argument("--https", action="store_true",
                    help="serve the model over TLS (a certificate made for the run, trusted through "
                         "tuvl.http_ca_file)")
    ap.add_argument("--http2", action="store_true", help="with --https: offer HTTP/2 by ALPN")
    ap.add_argument("--h2-max-streams", type=int, default=None,
                    help="with --http2: the streams the load generator allows a connection "
                         "(its default: 128)")
    ap.add_argument("--limit-both", action="store_true",
                    help="the limit of the 1 s wall is 1.2 x (3 s + the 0 ms wall), issue 43's at 50,000 "
                         "agents, rather than 1.2 x 3 s + the 0 ms wall")
    ap.add_argument("--kb-target", type=float, default=50.0,
                    help="worker memory per agent in flight at most, kB (default 50; issue 43: 30)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.http2 and not args.https and not args.loadgen:
        ap.error("--http2 needs --https (the workers offer HTTP/2 over TLS only)")

    tls_dir = None
    lg_args = []
    if args.https and not args.loadgen:
        tls_dir = tempfile.mkdtemp(prefix="bench-scale-tls.")
        lg_args = ["--tls-dir", tls_dir] + (["--http2"] if args.http2 else [])
        if args.h2_max_streams:
            lg_args += ["--h2-max-streams", str(args.h2_max_streams)]
    lg = Loadgen(args.loadgen, args=lg_args)
    nworkers = wait_for_workers(args.db)
    settings = {"tuvl.runs_per_worker": -(-args.runs // nworkers) + 100}
    if tls_dir is not None:
        # the server runs as another user (postgres): the CA, not the key,
        # must be readable by it
        os.chmod(tls_dir, 0o755)
        os.chmod(lg.ca, 0o644)
        settings["tuvl.http_ca_file"] = lg.ca
    old = set_gucs(settings)
    result = {"runs": args.runs, "workers": nworkers, "rounds": [],
              "transport": {"url": lg.url, "https": lg.url.startswith("https:"), "http2": args.http2,
                            "h2_max_streams": args.h2_max_streams},
              "limit": "1.2 x (3 s + wall(0 ms))" if args.limit_both else "1.2 x 3 s + wall(0 ms)",
              "kb_target": args.kb_target}
    ok = True
    try:
        setup(args.db, lg)
        warm = batch(args.db, lg, "0ms", 100)
        if not warm["ok"]:
            log("warm-up failed: %s (%s)" % (json.dumps(warm["checks"]), warm["an_error"]))
        def plain_and_features(r, order, fast=None):
            """The plain 1 s batch and the one with the features on, in order."""
            one = {"order": order}
            for which in order:
                if which == "plain":
                    slow = batch(args.db, lg, "1s", args.runs)
                    log("round %d, %s" % (r + 1, describe(slow)))
                    one["slow"] = slow
                    if fast is not None:
                        limit = 1.2 * (3.0 + fast["wall_s"]) if args.limit_both else 1.2 * 3.0 + fast["wall_s"]
                        one.update({"limit_s": limit, "met": slow["wall_s"] <= limit})
                        log("round %d: wall %.2f s with the 1 s model, limit %s = %.2f s: %s"
                            % (r + 1, slow["wall_s"],
                               ("1.2 x (3 s + %.2f s)" if args.limit_both else "1.2 x 3 s + %.2f s") % fast["wall_s"],
                               limit, "met" if one["met"] else "MISSED"))
                    continue
                tracing = None
                if args.otlp_url:
                    # a collector runs elsewhere: here the receiver only counts
                    Loadgen(args.otlp_url).call("POST", "/_mode?count_only=1")
                    tracing = set_gucs({"tuvl.otlp_endpoint": args.otlp_url.rstrip("/") + "/v1/traces"})
                try:
                    feat = batch(args.db, lg, "1s_features", args.runs)
                finally:
                    if tracing is not None:
                        set_gucs({"tuvl.otlp_endpoint": tracing["tuvl.otlp_endpoint"]})
                one["features"] = feat
                one["features_traced"] = tracing is not None
                log("round %d, features on (guardrail on every gate, a hook%s): %s"
                    % (r + 1, ", tracing" if tracing is not None else ", no collector: tracing off",
                       describe(feat)))
            if "features" in one:
                one["features_ratio"] = one["features"]["wall_s"] / one["slow"]["wall_s"]
                one["features_cpu_ratio"] = one["features"]["worker_cpu_s"] / one["slow"]["worker_cpu_s"]
                log("round %d: features on / plain (%s first): wall %.3f, worker CPU %.3f"
                    % (r + 1, order[0], one["features_ratio"], one["features_cpu_ratio"]))
            return one

        def check(r, batches):
            ok = True
            for b in batches:
                if not b["ok"]:
                    log("round %d, %s: checks failed: %s (an error: %s)"
                        % (r + 1, b["workflow"], json.dumps(b["checks"]), b["an_error"]))
                    ok = False
            return ok

        # the plain 1 s batch and the one with the features on alternate in
        # which goes first, so that a drift within a round (the machine's,
        # the tables') does not always fall on the same one
        orders = (["plain", "features"], ["features", "plain"])
        for r in range(args.rounds):
            fast = batch(args.db, lg, "0ms", args.runs)
            log("round %d, %s" % (r + 1, describe(fast)))
            round_ = plain_and_features(r, orders[r % 2] if args.features else ["plain"], fast)
            round_["fast"] = fast
            ok = check(r, [fast, round_["slow"]] + ([round_["features"]] if args.features else [])) and ok
            result["rounds"].append(round_)
            print(verdict(r, round_, args.kb_target, args.limit_both), flush=True)
            write_json(args.json, result)
        # more pairs for the features' ratio, which the machine's noise moves
        # by as much as the features cost: its verdict is the median pair's
        result["feature_pairs"] = [r for r in result["rounds"] if "features" in r]
        for r in range(args.rounds, args.rounds + (args.extra_pairs if args.features else 0)):
            pair = plain_and_features(r, orders[r % 2])
            ok = check(r, [pair["slow"], pair["features"]]) and ok
            result["feature_pairs"].append(pair)
    finally:
        set_gucs(old)
        lg.stop()
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)
    result["ok"] = ok
    write_json(args.json, result)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
