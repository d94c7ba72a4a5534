#!/usr/bin/env python3
"""The load generator's own capacity (bench/servers/loadgen.mjs), with wrk.

Starts the load generator on a free port with bench/agents.py's script
(bench_agents), then for each case runs wrk against it and reads the
server's GET /_stats over a window that leaves out wrk's first seconds
(its connections opening): requests per second, the server's CPU time per
request and per second, how late the answers left, the event loop's delay
and utilization, garbage collections.  The /_stats requests go over a
keep-alive connection opened before wrk starts, so they do not queue behind
wrk's connections at the listen backlog.  Prints one block per case, and
with --json writes everything.

Cases (--cases, default all):

  slow0      GET /slow?ms=0, 64 connections, one wrk thread
  chat0      POST /v1/chat/completions, a turn-0 request (2 messages), 64
             connections
  chat2      the same with a turn-2 request (6 messages, two tool calls and
             their results), 64 connections
  agents10k  10,000 connections, each sending the turn-2 request to
             /lat/1000/v1/chat/completions (answered after 1 s) again as soon
             as its answer is in: about 10,000 requests in flight and 10,000
             answers per second.  The client is bench/servers/loadclient.mjs
             (--client node, the default): it opens the connections over 4 s
             and measures the latency of the answers in the window only.
             With --client wrk, wrk -t2 -c10000 opens them all at once (more
             than the listen backlog: some wait for SYN retransmits, 1 s and
             more) and its latency covers the whole run

wrk (Debian package wrk) and node must be on PATH.  The machine's load
(/proc/loadavg) and how busy its CPUs were during the window (/proc/stat)
are printed with each case: wrk and the server share the machine, and so
does anything else running.

    python3 bench/servers/loadgen_capacity.py [--cases slow0,agents10k] [--json FILE]
"""
import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "loadgen.mjs")
CLIENT = os.path.join(HERE, "loadclient.mjs")

SCRIPT = [  # bench/agents.py's TURN_SCRIPT
    {"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
     "usage": {"prompt_tokens": 100, "completion_tokens": 10}},
    {"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
     "usage": {"prompt_tokens": 120, "completion_tokens": 10}},
    {"text": "done", "usage": {"prompt_tokens": 140, "completion_tokens": 2}},
]
SYSTEM = {"role": "system", "content": "Record two notes, then answer done."}
TOOLS = [{"type": "function", "function": {"name": "note", "description": "Record a note about the current turn.",
                                           "parameters": {"type": "object"}}}]


def exchange(turn):
    call_id = "call_%d_0" % turn
    return [{"role": "assistant", "content": None,
             "tool_calls": [{"id": call_id, "type": "function",
                             "function": {"name": "note", "arguments": json.dumps({"turn": str(turn)})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"noted": turn})}]


TURN0 = {"model": "bench_agents", "messages": [SYSTEM, {"role": "user", "content": '{"k": 17}'}], "tools": TOOLS}
TURN2 = dict(TURN0, messages=TURN0["messages"] + exchange(0) + exchange(1))

# name: (path, wrk arguments, request body or None, warm-up s, window s)
CASES = {
    "slow0": ("/slow?ms=0", ["-t1", "-c64"], None, 2, 10),
    "chat0": ("/v1/chat/completions", ["-t1", "-c64"], TURN0, 2, 10),
    "chat2": ("/v1/chat/completions", ["-t1", "-c64"], TURN2, 2, 10),
    "agents10k": ("/lat/1000/v1/chat/completions", ["-t2", "-c10000", "--timeout", "10s"], TURN2, 8, 20),
}


def lua_for(body, directory):
    """A wrk script that POSTs `body` as JSON."""
    text = json.dumps(body)
    assert "]==]" not in text
    path = os.path.join(directory, "post_%d.lua" % len(text))
    with open(path, "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                "wrk.body = [==[%s]==]\n" % text)
    return path


def machine_busy():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def start_server(node, flags, scripts_file):
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([node, *flags, SERVER, "--port", "0", "--scripts", scripts_file],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        err.seek(0)
        line = err.readline()
        if line.startswith("load generator on ") and line.endswith("\n"):
            return proc, int(line.rsplit(":", 1)[1]), err
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    err.seek(0)
    raise SystemExit("the load generator did not start: " + err.read())


def wrk_summary(out):
    """requests/s and latency percentiles from wrk --latency output."""
    s = {"output": out}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    s["requests_per_s"] = float(m.group(1)) if m else None
    for p in ("50", "75", "90", "99"):
        m = re.search(r"^\s+%s%%\s+([\d.]+)(us|ms|s)\s*$" % p, out, re.M)
        if m:
            s["p%s_ms" % p] = float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)]
    m = re.search(r"Socket errors: (.*)", out)
    s["socket_errors"] = m.group(1) if m else None
    return s


def client_summary(out):
    """loadclient.mjs's JSON line, in wrk_summary's terms."""
    try:
        c = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"output": out, "requests_per_s": None, "socket_errors": "no result"}
    lat = c.get("latency_ms") or {}
    return {"output": out, "requests_per_s": c["per_s"], "p50_ms": lat.get("p50"), "p90_ms": lat.get("p90"),
            "p99_ms": lat.get("p99"), "max_ms": lat.get("max"), "min_ms": lat.get("min"),
            "connections": c["connections"], "statuses": c["statuses"], "client_cpu_s": c["cpu_s"],
            "socket_errors": ("errors %d, closed %d" % (c["errors"], c["closed"]))
            if c["errors"] or c["closed"] else None}


def run_case(name, args, lua_dir, scripts_file):
    path, wrk_args, body, warm, window = CASES[name]
    use_node = name == "agents10k" and args.client == "node"
    proc, port, err = start_server(args.node, args.node_flags.split(), scripts_file)
    try:
        ctl = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def control(method, p):
            ctl.request(method, p)
            r = ctl.getresponse()
            return json.loads(r.read())

        control("GET", "/_health")
        url = "http://127.0.0.1:%d%s" % (port, path)
        if use_node:
            body_file = os.path.join(lua_dir, "body.json")
            with open(body_file, "w") as f:
                json.dump(body, f)
            cmd = [args.node, CLIENT, "--url", url, "--body", body_file, "--connections", "10000",
                   "--ramp-s", "4", "--warmup-s", str(warm), "--window-s", str(window)]
        else:
            cmd = [args.wrk, *wrk_args, "--latency", "-d%ds" % (warm + window + 4)]
            if body is not None:
                cmd += ["-s", lua_for(body, lua_dir)]
            cmd.append(url)
        load0 = loadavg()
        w = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(warm)
        control("DELETE", "/_stats")
        busy0 = machine_busy()
        time.sleep(window)
        st = control("GET", "/_stats")
        busy1 = machine_busy()
        out = w.communicate()[0]
        load1 = loadavg()
    finally:
        proc.terminate()
        proc.wait(10)
    err.seek(0)
    errors = err.read().splitlines()[1:]
    return {"case": name, "command": " ".join(cmd), "node_flags": args.node_flags, "load_before": load0, "load_after": load1,
            "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
            "client": client_summary(out) if use_node else wrk_summary(out), "server": st,
            "server_stderr": errors}


def describe(r):
    s, w = r["server"], r["client"]
    c, q, el, late = s["cpu_since_reset"], s["requests"], s["event_loop"], s["late_ms"]
    lines = [
        "== %s%s: %s" % (r["case"], " (server: node %s)" % r["node_flags"] if r["node_flags"] else "", r["command"]),
        "   load %s -> %s, machine CPUs busy %.0f%% in the window"
        % (" ".join("%.2f" % x for x in r["load_before"]), " ".join("%.2f" % x for x in r["load_after"]),
           100 * r["machine_busy"]),
        "   client: %.0f requests/s, latency p50 %s p90 %s p99 %s%s ms%s%s"
        % (w["requests_per_s"] or 0, w.get("p50_ms"), w.get("p90_ms"), w.get("p99_ms"),
           " max %s" % w["max_ms"] if "max_ms" in w else "",
           "; %d connections, client CPU %.2f s" % (w["connections"], w["client_cpu_s"]) if "connections" in w else "",
           ", socket errors: " + w["socket_errors"] if w["socket_errors"] else ""),
        "   server, %.1f s window: %d answers (%.0f/s), CPU %.2f s (user %.2f, system %.2f) = %.2f CPUs, "
        "%.1f us per answer; in flight %d (peak %d), connections %d (peak %d)"
        % (s["since_reset_s"], q["answered"], q["per_s"], c["total_s"], c["user_s"], c["system_s"], c["cpus"],
           c["us_per_request"] or 0, s["in_flight"], s["peak_in_flight"], s["connections"]["open"],
           s["connections"]["peak"]),
        "   answers late by p50 %.3f p90 %.3f p99 %.3f max %.3f ms; event loop utilization %.2f, delay p50 %.2f "
        "p99 %.2f max %.2f ms; GC minor %d (%d ms) major %d (%d ms); RSS %.0f MB; statuses %s; listen overflows %s"
        % (late["p50"], late["p90"], late["p99"], late["max"], el["utilization"], el["delay_ms"]["p50"],
           el["delay_ms"]["p99"], el["delay_ms"]["max"], s["gc"]["minor"], s["gc"]["minor_ms"], s["gc"]["major"],
           s["gc"]["major_ms"], s["memory"]["rss_mb"], q["by_status"], s["listen_overflows"]),
    ]
    if r["server_stderr"]:
        lines.append("   server stderr: %s" % r["server_stderr"])
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--node", default="node")
    ap.add_argument("--node-flags", default="", help="node options for the server, e.g. --single-threaded-gc")
    ap.add_argument("--wrk", default="wrk")
    ap.add_argument("--client", choices=("node", "wrk"), default="node",
                    help="the client of case agents10k (default node: bench/servers/loadclient.mjs)")
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between cases (default 3)")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit("unknown cases: %s" % ", ".join(unknown))
    results = []
    with tempfile.TemporaryDirectory() as d:
        scripts_file = os.path.join(d, "scripts.json")
        with open(scripts_file, "w") as f:
            json.dump({"bench_agents": SCRIPT}, f)
        for i, name in enumerate(names):
            if i:
                time.sleep(args.pause)
            r = run_case(name, args, d, scripts_file)
            print(describe(r), flush=True)
            results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    sys.exit(0)


if __name__ == "__main__":
    main()
