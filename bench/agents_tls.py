#!/usr/bin/env python3
"""Agents over HTTPS and HTTP/2, and a model turn against a plain step
(issue 43): what the workers pay for a model turn, by transport.

Three load generators (bench/servers/loadgen.mjs) answer bench/agents.py's
three-turn script at 0 ms:

  http      plain HTTP/1.1, as every other benchmark
  https_h1  TLS with HTTP/1.1 only (--tls-dir)
  https_h2  TLS offering HTTP/2 by ALPN, HTTP/1.1 the fallback
            (--tls-dir --http2)

The certificate is made by the load generator in a temporary directory;
the workers trust its CA through tuvl.http_ca_file when this build has that
GUC (ALTER SYSTEM for the run, reset at the end).  A build without it
cannot verify the certificate: a probe of 3 runs per HTTPS mode finds that
out and the mode is reported as not run, with the runs' error.

Each round (--rounds, default 3; the order alternates) runs, on the default
workers:

  steps     --steps-runs (4,000) runs of bench/throughput.py's workflow
            `five`: the workers' CPU per step (their CPU over the batch,
            from /proc, / 5 x runs)
  <mode>    --agents (2,000) autonomous agents per mode: the workers' CPU
            per model turn (tool calls and checkpoints included: the
            batch's CPU / 3 x agents), and the connections the workers
            opened to the load generator over the batch, which closes the
            idle ones of the batch before (DELETE /_conns) (its GET /_conns:
            connections that carried a model request, by protocol; TLS
            handshakes and resumptions; HTTP/2 streams)

and reports, from the median round: turn / step (target <= 3), https_h2 /
http CPU per turn (target <= 1.3), connections per worker over the batch
(target <= 8 over HTTP/2).  --agents 10000 is the issue's connection count.

    python3 bench/agents_tls.py --db bench [--rounds 3] [--json OUT]
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import agents
from agents import SCRIPT, TURN_SCRIPT, TURNS, setup_tool
from agents_scale import Sampler, clean, set_gucs
from common import Loadgen, connect, log, settle_workers, wait_for_workers, wait_runs_done, write_json
import throughput

MODES = ("http", "https_h1", "https_h2")
LG_ARGS = {"http": [], "https_h1": ["--tls-dir", "{dir}"], "https_h2": ["--tls-dir", "{dir}", "--http2"]}


def has_guc(db, name):
    conn = connect(db)
    cur = conn.cursor()
    cur.execute("SELECT current_setting(%s, true)", (name,))
    v = cur.fetchone()[0]
    conn.close()
    return v is not None


def setup(db, lgs):
    conn = connect(db)
    cur = conn.cursor()
    setup_tool(cur)
    for mode, lg in lgs.items():
        lg.call("POST", "/_script", {"name": SCRIPT, "turns": TURN_SCRIPT})
        cur.execute("SELECT tuvl.register_llm(%s)",
                    ("name: bench_tls_%s\nprovider: openai\nbase_url: %s/lat/0/v1\nmodel: %s\ntimeout: 60s\n"
                     % (mode, lg.url, SCRIPT),))
        source = agents.workflow_source(0, False, name="bench_tls_" + mode, model="bench_tls_" + mode,
                                        script="bench/agents_tls.py")
        cur.execute("SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1",
                    ("bench_tls_" + mode,))
        row = cur.fetchone()
        if row is None or row[0] != source:
            cur.execute("SELECT tuvl.register_workflow(%s)", (source,))
    conn.close()
    throughput.setup(db)


def start_batch(db, workflow, n, args_sql="jsonb_build_object('k', i)", timeout=900):
    """n runs of workflow queued in one transaction, waited for; the
    workers' CPU over the batch and its wall time."""
    pids = settle_workers(db)
    sampler = Sampler(db, pids)
    sampler.start()
    conn = connect(db, autocommit=False)
    cur = conn.cursor()
    cur.execute("SELECT count(tuvl.start_run(%%s, %s)) FROM generate_series(1, %%s) i" % args_sql, (workflow, n))
    t0 = time.time()
    conn.commit()
    conn.autocommit = True
    wait_runs_done(cur, workflow, timeout)
    wall = time.time() - t0
    sampler.sample_cpu(set(sampler.cpu_last) | set(pids))
    sampler.stop.set()
    sampler.join()
    cur.execute("SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status <> 'completed'), "
                "min(error) FROM tuvl.runs WHERE workflow = %s", (workflow,))
    completed, other, an_error = cur.fetchone()
    conn.close()
    return {"runs": n, "wall_s": wall, "worker_cpu_s": sampler.worker_cpu_s(), "completed": completed,
            "not_completed": other, "an_error": an_error, "workers": len(pids)}


def steps_batch(db, n):
    conn = connect(db)
    conn.cursor().execute("DELETE FROM tuvl.runs WHERE workflow = 'five'")
    conn.close()
    r = start_batch(db, "five", n)
    r["steps"] = throughput.STEPS * n
    r["cpu_per_step_us"] = 1e6 * r["worker_cpu_s"] / r["steps"]
    conn = connect(db)
    conn.cursor().execute("DELETE FROM tuvl.runs WHERE workflow = 'five'")
    conn.close()
    return r


def agents_batch(db, lg, mode, n):
    workflow = "bench_tls_" + mode
    conn = connect(db)
    clean(conn.cursor(), workflow)
    conn.close()
    # every batch starts without the workers' connections of the last one
    # (DELETE /_conns closes the idle ones, as a server's idle timeout would)
    lg.call("DELETE", "/_conns")
    time.sleep(0.5)
    lg.call("DELETE", "/_stats")
    lg.call("DELETE", "/_log")
    r = start_batch(db, workflow, n)
    c = lg.call("GET", "/_conns?list=1")
    seen = lg.call("GET", "/_log?model=" + SCRIPT)
    conn = connect(db)
    clean(conn.cursor(), workflow)
    conn.close()
    used = [x for x in c.get("connections", []) if x["requests"] > 0]
    by_protocol = {}
    for x in used:
        by_protocol[x["protocol"]] = by_protocol.get(x["protocol"], 0) + 1
    r.update({
        "mode": mode, "turns": TURNS * n,
        "cpu_per_turn_us": 1e6 * r["worker_cpu_s"] / (TURNS * n),
        "model_requests": seen.get("script", {}).get("count"),
        # connections that carried a model request, opened during the batch
        "connections": len(used), "connections_by_protocol": by_protocol,
        "connections_per_worker": len(used) / float(max(1, r["workers"])),
        "peak_open_connections": c["peak"],
        "tls": c["tls"], "h2": c["h2"], "requests_by_protocol": c["requests_by_protocol"],
        "ok": r["completed"] == n and seen.get("script", {}).get("by_status") == {"200": TURNS * n},
    })
    return r


def probe(db, lg, mode):
    """3 runs: None when they completed, else the runs' error."""
    workflow = "bench_tls_" + mode
    r = start_batch(db, workflow, 3, timeout=120)
    conn = connect(db)
    clean(conn.cursor(), workflow)
    conn.close()
    return None if r["completed"] == 3 else (r["an_error"] or "%d of 3 runs did not complete" % r["not_completed"])


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agents", type=int, default=2000)
    ap.add_argument("--steps-runs", type=int, default=4000)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]

    tls_dir = tempfile.mkdtemp(prefix="bench-tls.")
    lgs = {}
    old_gucs = None
    out = {"config": vars(args), "rounds": [], "not_run": {}}
    try:
        for mode in modes:     # (https_h1 first makes the certificate, https_h2 reuses it)
            lgs[mode] = Loadgen(args=[a.format(dir=tls_dir) for a in LG_ARGS[mode]])
        ca = os.path.join(tls_dir, "ca.pem")
        # the server runs as another user (postgres): the CA, not the key,
        # must be readable by it
        os.chmod(tls_dir, 0o755)
        if os.path.exists(ca):
            os.chmod(ca, 0o644)
        out["http_ca_file_guc"] = has_guc(args.db, "tuvl.http_ca_file")
        out["http2_guc"] = has_guc(args.db, "tuvl.http2")
        if out["http_ca_file_guc"]:
            old_gucs = set_gucs({"tuvl.http_ca_file": ca})
        else:
            log("agents_tls: this build has no CA-file setting (http_ca_file): the workers cannot trust the bench CA")
        setup(args.db, lgs)
        wait_for_workers(args.db)
        for mode in [m for m in modes if m != "http"]:
            why = probe(args.db, lgs[mode], mode)
            if why:
                log("agents_tls: %s not run: %s" % (mode, why))
                out["not_run"][mode] = why
        run_modes = [m for m in modes if m not in out["not_run"]]
        for r in range(args.rounds):
            order = ["steps"] + run_modes
            if r % 2:
                order = order[::-1]
            rnd = {"order": order}
            for what in order:
                if what == "steps":
                    res = steps_batch(args.db, args.steps_runs)
                    log("agents_tls round %d steps: %.1f us CPU per step (%d runs, %.1f s)"
                        % (r + 1, res["cpu_per_step_us"], res["runs"], res["wall_s"]))
                else:
                    res = agents_batch(args.db, lgs[what], what, args.agents)
                    log("agents_tls round %d %s: %.1f us CPU per turn, %d connections (%.1f per worker) %s, "
                        "TLS handshakes %d (resumed %d), h2 streams %d, %.1f s%s"
                        % (r + 1, what, res["cpu_per_turn_us"], res["connections"], res["connections_per_worker"],
                           res["connections_by_protocol"], res["tls"]["handshakes"], res["tls"]["resumed"],
                           res["h2"]["streams"], res["wall_s"], "" if res["ok"] else " NOT ALL COMPLETED"))
                rnd[what] = res
            step = rnd["steps"]["cpu_per_step_us"]
            for m in run_modes:
                rnd[m]["turn_per_step"] = rnd[m]["cpu_per_turn_us"] / step
            out["rounds"].append(rnd)
            write_json(args.json, out)
        summary = {}
        for m in run_modes:
            summary[m] = {
                "cpu_per_turn_us": med([x[m]["cpu_per_turn_us"] for x in out["rounds"]]),
                "turn_per_step": med([x[m]["turn_per_step"] for x in out["rounds"]]),
                "turn_per_step_range": [min(x[m]["turn_per_step"] for x in out["rounds"]),
                                        max(x[m]["turn_per_step"] for x in out["rounds"])],
                "connections_per_worker": med([x[m]["connections_per_worker"] for x in out["rounds"]]),
                "ok": all(x[m]["ok"] for x in out["rounds"]),
            }
            if m != "http" and "http" in run_modes:
                summary[m]["cpu_vs_http"] = med([x[m]["cpu_per_turn_us"] / x["http"]["cpu_per_turn_us"]
                                                 for x in out["rounds"]])
        summary["cpu_per_step_us"] = med([x["steps"]["cpu_per_step_us"] for x in out["rounds"]])
        out["summary"] = summary
        write_json(args.json, out)
        print("agents_tls: CPU per step %.1f us (median of %d rounds)" % (summary["cpu_per_step_us"], args.rounds))
        for m in run_modes:
            s = summary[m]
            print("agents_tls: %-8s %.1f us CPU per turn = %.2f x a step (target <= 3; rounds %.2f - %.2f)%s, "
                  "%.1f connections per worker%s%s"
                  % (m, s["cpu_per_turn_us"], s["turn_per_step"], s["turn_per_step_range"][0],
                     s["turn_per_step_range"][1],
                     ", %.2f x http (target <= 1.3 for https_h2)" % s["cpu_vs_http"] if "cpu_vs_http" in s else "",
                     s["connections_per_worker"], " (target <= 8)" if m == "https_h2" else "",
                     "" if s["ok"] else ", NOT ALL COMPLETED"))
        for m, why in out["not_run"].items():
            print("agents_tls: %-8s not run: %s" % (m, why))
    finally:
        if old_gucs is not None:
            set_gucs(old_gucs)
        for lg in lgs.values():
            lg.stop()
        shutil.rmtree(tls_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
