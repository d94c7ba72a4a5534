#!/usr/bin/env python3
"""Autonomous Agent step: 1,000 concurrent three-turn agent runs.

Each run is one autonomous Agent step (workflow bench_agent_<ms>ms) whose
model is the project's scripted LLM server (test/servers/llm_server.py,
TUVL_LLM_URL).  The script has three turns: turns 0 and 1 each ask for one
call of the Functional tool `note` (bench_agents.note, which inserts a row
into bench_agents.tool_calls), turn 2 answers "done" without a tool call.
Two model configs point at the same server, one through its /lat/0/ prefix
and one through /lat/100/, so every model turn takes 0 ms or 100 ms at the
server.  Default worker count (tuvl.workers_per_database).

  1. Warm-up: --warmup runs (default 50) of each workflow; then the
     resident memory of every tuvl worker of the database (pids from
     tuvl.worker_status(); VmRSS, RssAnon, RssShmem, VmHWM from
     /proc/<pid>/status).
  2. Each round queues --runs runs (default 1,000) in one transaction,
     SELECT count(tuvl.start_run(...)) FROM generate_series(1, N), first of
     the 0 ms workflow, then of the 100 ms one, and measures the wall time
     from just before the COMMIT until a poll (every 20 ms) sees no run of
     the batch queued or running.  Meanwhile it samples
     sum(transfers_in_flight) of tuvl.worker_status() every 5 ms.  After
     the batch it reads the scripted server's peak_concurrent (the log is
     cleared before each batch), the model-turn latency the workers
     journaled (latency_ms of the llm_turn events: from the request's start
     until the worker collected the answer), the CPU time of the workers,
     of the scripted server (its pid found through its listening socket)
     and of the whole machine, the WAL and journal volume, and the scans of
     tuvl.runs (pg_stat_all_tables and pg_stat_all_indexes deltas, read
     1.5 s after the batch so that the workers have flushed them).
     A third batch runs the 0 ms workflow again with a regex guardrail
     (bench_no_card_numbers) on its input, tools and output gates
     (bench_agent_0ms_guarded): the workers' CPU time against the
     unguarded batch is the gates' cost per turn (target: at most 1.10).
  3. Checks: every run completed at end `finish` with response "done"; the
     tool ran exactly twice per run, in turns 0 and 1 (rows of
     bench_agents.tool_calls); the server saw 3 requests per run, all
     answered 200.
  4. The workers' resident memory again after each round.

Reported: the wall times, their ratio wall(100 ms) / max(300 ms, wall(0 ms))
(target <= 2; one run needs 300 ms for its three 100 ms turns), the peak
requests in flight at the server and in the workers, and each worker's
VmRSS growth from after the warm-up to after the last round (target <= 10
MB per worker).

The scripted server is one Python process (a thread per connection, one
GIL); its CPU time per batch shows how much of the machine it takes.
Clearing its log (DELETE /_log) also resets its fault counters: do not
point this script at a server that tests are using at the same time.  The
batches' runs and journal are deleted after each batch; bench_agents.* and
the two workflows and model configs stay.
"""
import argparse
import json
import os
import re
import threading
import time
import urllib.request

from common import connect, log, settle_workers, summarize_ms, wait_for_workers, write_json

TOOL_TURNS = 2
TURNS = TOOL_TURNS + 1
SCRIPT = "bench_agents"
STATS_SETTLE_S = 1.5
ANSWER = "done"

WORKFLOW = """\
name: %(name)s
description: one autonomous Agent step, three model turns at %(ms)d ms, two tool calls (%(script)s)
%(hooks)ssteps:
  - id: work
    kind: Agent
    mode: autonomous
    agent:
      model: %(model)s
      steering: "Record two notes, then answer done."
      tools:
        - ref: note
      max_iterations: 8
%(guard)s    routes: { default: finish%(guard_route)s }
  - id: note
    kind: Functional
    description: Record a note about the current turn.
    function: bench_agents.note
ends:
  - { id: finish, status: completed, response: "{{ work_result }}" }
"""

# The guarded variant: a regex guardrail on all three gates (a card number
# check every user message, tool result and final answer passes).
GUARDRAIL = """\
name: bench_no_card_numbers
type: guardrail
checks:
  - { check: regex_deny, pattern: '\\y[0-9]{16}\\y' }
"""
GUARD = ("      guardrails:\n"
         "        input: [artifact://bench_no_card_numbers@1]\n"
         "        tools: [artifact://bench_no_card_numbers@1]\n"
         "        output: [artifact://bench_no_card_numbers@1]\n")


def workflow_source(ms, guarded, name=None, model=None, hooks=None, script="bench/agents.py"):
    """The agent's workflow: name and model default to this script's, and
    hooks is a top-level hooks line."""
    return WORKFLOW % {"ms": ms, "script": script,
                       "name": name or "bench_agent_%dms%s" % (ms, "_guarded" if guarded else ""),
                       "model": model or "bench_agents_%dms" % ms, "hooks": hooks or "",
                       "guard": GUARD if guarded else "",
                       "guard_route": ", guardrail_violation: finish" if guarded else ""}


TURN_SCRIPT = [
    {"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
     "usage": {"prompt_tokens": 100, "completion_tokens": 10}},
    {"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
     "usage": {"prompt_tokens": 120, "completion_tokens": 10}},
    {"text": ANSWER, "usage": {"prompt_tokens": 140, "completion_tokens": 2}},
]


# ------------------------------------------------------------ scripted server

def llm_root():
    url = os.environ.get("TUVL_LLM_URL")
    if not url:
        raise SystemExit("TUVL_LLM_URL is not set (test/lib.sh's tuvl_peers sets it)")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def llm(method, path, body=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(llm_root() + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def llm_port():
    m = re.match(r"https?://[^/:]+:(\d+)", llm_root())
    return int(m.group(1)) if m else 80


def pid_listening_on(port):
    """The pid of the process listening on 127.0.0.1:port, or None (needs /proc access)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                        inodes.add(cols[9])
        except OSError:
            pass
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


# ------------------------------------------------------------ /proc

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """user + system CPU time of a process, or None: the scheduler's count in
    nanoseconds (/proc/PID/schedstat), else /proc/PID/stat's clock ticks
    (10 ms each, too coarse for a batch of 100 agents: 0.15 CPU s)."""
    try:
        with open("/proc/%d/schedstat" % pid) as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, TypeError, ValueError, IndexError):
        pass
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, TypeError):
        return None


def machine_cpu():
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def memory_kb(pid):
    """{VmRSS, RssAnon, RssFile, RssShmem, VmHWM} in kB of a process, or None."""
    out = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[key] = int(value.split()[0])
    except OSError:
        return None
    return out


def workers(cur):
    cur.execute("SELECT worker, pid FROM tuvl.worker_status() "
                "WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "ORDER BY worker")
    return cur.fetchall()


def worker_memory(cur):
    return {str(w): dict(pid=pid, **(memory_kb(pid) or {})) for w, pid in workers(cur)}


# ------------------------------------------------------------ setup

def setup_tool(cur):
    """The tool `note` (bench_agents.note) and the table it writes."""
    cur.execute("CREATE SCHEMA IF NOT EXISTS bench_agents")
    cur.execute("CREATE TABLE IF NOT EXISTS bench_agents.tool_calls ("
                "k integer NOT NULL, turn integer, at timestamptz NOT NULL DEFAULT clock_timestamp())")
    # PL/pgSQL: its INSERT is planned once per session; a LANGUAGE sql
    # function with an INSERT is planned again at every call
    cur.execute("""
        CREATE OR REPLACE FUNCTION bench_agents.note(ctx jsonb) RETURNS jsonb
        LANGUAGE plpgsql AS $$
        DECLARE t int;
        BEGIN
            INSERT INTO bench_agents.tool_calls (k, turn)
            VALUES ((ctx->>'k')::int, (ctx->>'turn')::int)
            RETURNING turn INTO t;
            RETURN jsonb_build_object('noted', t);
        END $$""")
    # Make the tool callable by whichever role the workers run it as.
    cur.execute("GRANT USAGE ON SCHEMA bench_agents TO PUBLIC")
    cur.execute("GRANT INSERT ON bench_agents.tool_calls TO PUBLIC")


def setup(db, root):
    conn = connect(db)
    cur = conn.cursor()
    setup_tool(cur)
    llm("POST", "/_script", {"name": SCRIPT, "turns": TURN_SCRIPT})
    cur.execute("SELECT count(*) FROM tuvl.artifacts WHERE name = 'bench_no_card_numbers'")
    if cur.fetchone()[0] == 0:
        cur.execute("SELECT tuvl.register_artifact(%s)", (GUARDRAIL,))
    for ms, guarded in ((0, False), (100, False), (0, True)):
        cur.execute("SELECT tuvl.register_llm(%s)",
                    ("name: bench_agents_%dms\nprovider: openai\nbase_url: %s/lat/%d/v1\n"
                     "model: %s\ntimeout: 60s\n" % (ms, root, ms, SCRIPT),))
        name = "bench_agent_%dms%s" % (ms, "_guarded" if guarded else "")
        source = workflow_source(ms, guarded)
        cur.execute("SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1",
                    (name,))
        row = cur.fetchone()
        if row is None or row[0] != source:
            cur.execute("SELECT tuvl.register_workflow(%s)", (source,))
    conn.close()


# ------------------------------------------------------------ one phase

class Sampler(threading.Thread):
    """Polls tuvl.worker_status() for the transfers in flight in the database's workers."""

    def __init__(self, db):
        super().__init__(daemon=True)
        self.conn = connect(db)
        self.stop = threading.Event()
        self.peak = 0
        self.peak_by_worker = {}
        self.peak_runs_held = {}

    def run(self):
        cur = self.conn.cursor()
        while not self.stop.is_set():
            cur.execute("SELECT worker, transfers_in_flight, runs_held FROM tuvl.worker_status() "
                        "WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database())")
            rows = cur.fetchall()
            self.peak = max(self.peak, sum(r[1] for r in rows))
            for w, transfers, held in rows:
                w = str(w)
                self.peak_by_worker[w] = max(self.peak_by_worker.get(w, 0), transfers)
                self.peak_runs_held[w] = max(self.peak_runs_held.get(w, 0), held)
            time.sleep(0.005)
        self.conn.close()


def runs_scans(cur):
    """Scans of tuvl.runs as the statistics show them now: (seq_scan, seq_tup_read, idx_scan,
    {index: [idx_scan, idx_tup_read]})."""
    cur.execute("SELECT pg_stat_clear_snapshot()")
    cur.execute("SELECT seq_scan, seq_tup_read, coalesce(idx_scan, 0) FROM pg_stat_all_tables "
                "WHERE relid = 'tuvl.runs'::regclass")
    seq, tup, idx = cur.fetchone()
    cur.execute("SELECT indexrelname, idx_scan, idx_tup_read FROM pg_stat_all_indexes "
                "WHERE relid = 'tuvl.runs'::regclass")
    return seq, tup, idx, {name: [scans, read] for name, scans, read in cur.fetchall()}


def clean(cur, workflow):
    cur.execute("DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE workflow = %s)",
                (workflow,))
    cur.execute("DELETE FROM tuvl.runs WHERE workflow = %s", (workflow,))
    cur.execute("TRUNCATE bench_agents.tool_calls")


def phase(db, ms, n, server_pid, sample=True, timeout=600, guarded=False):
    workflow = "bench_agent_%dms%s" % (ms, "_guarded" if guarded else "")
    conn = connect(db)
    cur = conn.cursor()
    clean(cur, workflow)
    llm("DELETE", "/_log")
    pids = [pid for _, pid in workers(cur)]
    time.sleep(STATS_SETTLE_S)
    scans0 = runs_scans(cur)
    cur.execute("SELECT pg_current_wal_lsn()")
    lsn0 = cur.fetchone()[0]
    cpu0 = {pid: cpu_seconds(pid) for pid in pids}
    srv0 = cpu_seconds(server_pid) if server_pid else None
    busy0, total0 = machine_cpu()
    sampler = Sampler(db) if sample else None
    if sampler:
        sampler.start()
    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run(%s, jsonb_build_object('k', i))) "
                "FROM generate_series(1, %s) i", (workflow, n))
    t0 = time.time()
    conn.commit()
    conn.autocommit = True
    deadline = t0 + timeout
    polls = 0
    while True:
        polls += 1
        # by the runs in flight, not every run of the workflow (common.wait_runs_done)
        cur.execute("SELECT EXISTS (SELECT 1 FROM tuvl.runs WHERE status = 'queued' "
                    "                 AND workflow OPERATOR(pg_catalog.||) '' = %s) "
                    "OR EXISTS (SELECT 1 FROM tuvl.runs WHERE status = ANY ('{running,compensating}') "
                    "                 AND workflow OPERATOR(pg_catalog.||) '' = %s)",
                    (workflow, workflow))
        if not cur.fetchone()[0]:
            break
        if time.time() > deadline:
            raise SystemExit("%s: runs still unfinished after %d s" % (workflow, timeout))
        time.sleep(0.02)
    wall = time.time() - t0
    srv1 = cpu_seconds(server_pid) if server_pid else None
    busy1, total1 = machine_cpu()
    cpu1 = {pid: cpu_seconds(pid) for pid in pids}
    if sampler:
        sampler.stop.set()
        sampler.join()
    cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn0,))
    wal_bytes = float(cur.fetchone()[0])
    time.sleep(STATS_SETTLE_S)  # the workers flush their table statistics at most once a second
    scans1 = runs_scans(cur)

    # What the server saw: only the peak and this script's requests.
    peak = llm("GET", "/_log?model=-none-")["peak_concurrent"]
    reqs = llm("GET", "/_log?model=" + SCRIPT)["requests"]
    statuses = {}
    for r in reqs:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    by_turn = {}
    for r in reqs:
        by_turn[str(r.get("turn"))] = by_turn.get(str(r.get("turn")), 0) + 1

    cur.execute("""
        SELECT count(*) FILTER (WHERE status = 'completed'),
               count(*) FILTER (WHERE status = 'completed' AND end_name = 'finish'
                                  AND response = to_jsonb(%s::text)),
               count(*) FILTER (WHERE status <> 'completed'),
               extract(epoch FROM max(finished_at) - min(created_at)),
               extract(epoch FROM max(finished_at) - min(started_at)),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)),
               max(extract(epoch FROM finished_at - started_at)),
               min(error) FILTER (WHERE error IS NOT NULL)
        FROM tuvl.runs WHERE workflow = %s""", (ANSWER, workflow))
    completed, expected, not_completed, span, span_started, run_median, run_max, an_error = cur.fetchone()
    cur.execute("""
        SELECT count(*) FILTER (WHERE c = 2 AND turns = '{0,1}'), count(*), coalesce(sum(c), 0)
        FROM (SELECT k, count(*) c, array_agg(turn ORDER BY turn) turns
              FROM bench_agents.tool_calls GROUP BY k) t""")
    tool_ok, tool_runs, tool_rows = cur.fetchone()
    cur.execute("""
        SELECT e.latency_ms FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id
        WHERE r.workflow = %s AND e.type = 'llm_turn' AND e.latency_ms IS NOT NULL""", (workflow,))
    turn_ms = [float(x) for (x,) in cur.fetchall()]
    cur.execute("""
        SELECT e.type, count(*) FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id
        WHERE r.workflow = %s GROUP BY 1 ORDER BY 1""", (workflow,))
    event_counts = dict(cur.fetchall())
    cur.execute("""
        SELECT coalesce(sum(pg_column_size(e.payload)), 0) FROM tuvl.events e
        JOIN tuvl.runs r ON r.id = e.run_id WHERE r.workflow = %s""", (workflow,))
    journal_bytes = int(cur.fetchone()[0])
    clean(cur, workflow)
    conn.close()

    checks = {
        "runs_completed_with_response": expected == n,
        "tool_ran_twice_per_run": tool_ok == n and tool_runs == n and tool_rows == TOOL_TURNS * n,
        "server_requests": len(reqs) == TURNS * n and statuses == {"200": TURNS * n},
    }
    return {
        "server_ms": ms, "guarded": guarded, "runs": n, "wall_s": wall,
        "span_created_s": float(span) if span is not None else None,
        "span_started_s": float(span_started) if span_started is not None else None,
        "run_duration_median_s": float(run_median) if run_median is not None else None,
        "run_duration_max_s": float(run_max) if run_max is not None else None,
        "completed": completed, "completed_as_expected": expected, "not_completed": not_completed,
        "an_error": an_error,
        "tool_rows": int(tool_rows), "runs_with_tool_twice": tool_ok,
        "requests": len(reqs), "requests_by_status": statuses, "requests_by_turn": by_turn,
        "peak_concurrent_server": peak,
        "peak_in_flight_workers": sampler.peak if sampler else None,
        "peak_in_flight_by_worker": sampler.peak_by_worker if sampler else None,
        "peak_runs_held_by_worker": sampler.peak_runs_held if sampler else None,
        "llm_turn_ms": summarize_ms(turn_ms) if turn_ms else None,
        "events": event_counts,
        "journal_payload_bytes_per_run": journal_bytes / float(n),
        "wal_bytes_per_run": wal_bytes / n,
        "polls": polls,
        "runs_seq_scans": scans1[0] - scans0[0],
        "runs_seq_tup_read": scans1[1] - scans0[1],
        "runs_idx_scans": scans1[2] - scans0[2],
        "runs_indexes": {name: {"scans": v[0] - scans0[3].get(name, [0, 0])[0],
                                "tuples_read": v[1] - scans0[3].get(name, [0, 0])[1]}
                         for name, v in scans1[3].items()},
        "worker_cpu_s": sum((cpu1[p] or 0) - (cpu0[p] or 0) for p in pids),
        "server_cpu_s": (srv1 - srv0) if srv0 is not None and srv1 is not None else None,
        "machine_cpu_busy": (busy1 - busy0) / float(max(1, total1 - total0)),
        "checks": checks, "ok": all(checks.values()),
    }


def describe(p):
    t = p["llm_turn_ms"]
    return ("%d ms: %d runs in %.3f s (%d as expected, tool rows %d), peak %d at the server / %d in "
            "the workers, model turn median %.1f ms p95 %.1f ms; seq scans of tuvl.runs %d reading %d tuples "
            "(index entries read: %s; %d polls); "
            "CPU: workers %.2f s, server %s, machine %.0f%% busy"
            % (p["server_ms"], p["runs"], p["wall_s"], p["completed_as_expected"], p["tool_rows"],
               p["peak_concurrent_server"], p["peak_in_flight_workers"] or 0,
               t["median"] if t else -1, t["p95"] if t else -1, p["runs_seq_scans"], p["runs_seq_tup_read"],
               ", ".join("%s %d" % (k, v["tuples_read"]) for k, v in sorted(p["runs_indexes"].items())),
               p["polls"],
               p["worker_cpu_s"],
               "%.2f s" % p["server_cpu_s"] if p["server_cpu_s"] is not None else "n/a",
               100 * p["machine_cpu_busy"]))


def rss_growth(samples):
    """Each worker's memory growth between samples (after the warm-up, after
    each round) of one process: the one it is at the end, from its first
    sample, or, when that process has only the last sample, the longest run
    of samples of an earlier one.  A worker exits to start afresh when
    thousands of runs left its heap fragmented (worker.c); its growth is
    not measured when no process of it was sampled twice."""
    names = ["the warm-up"] + ["round %d" % i for i in range(1, len(samples))]
    out = {}
    for w in samples[-1]:
        stretches = []          # [first, last] sample indexes of one pid
        for i, s in enumerate(samples):
            pid = s.get(w, {}).get("pid")
            if stretches and samples[stretches[-1][0]].get(w, {}).get("pid") == pid:
                stretches[-1][1] = i
            else:
                stretches.append([i, i])
        first, last = stretches[-1]
        if first == last:
            first, last = max(stretches, key=lambda st: st[1] - st[0])
        a, b = samples[last][w], samples[first][w]
        out[w] = {"pid": a.get("pid"), "restarted": len(stretches) > 1,
                  "pid_before": samples[0].get(w, {}).get("pid"), "pid_after": samples[-1][w].get("pid"),
                  "since": names[first], "until": names[last], "measured": last > first}
        if not out[w]["measured"]:
            continue
        for key in ("VmRSS", "RssAnon", "RssShmem", "RssFile", "VmHWM"):
            if key in a and key in b:
                out[w][key + "_before_kb"] = b[key]
                out[w][key + "_after_kb"] = a[key]
                out[w][key + "_growth_kb"] = a[key] - b[key]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50, help="warm-up runs of each workflow (default 50)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    root = llm_root()
    wait_for_workers(args.db)
    setup(args.db, root)
    server_pid = pid_listening_on(llm_port())
    if server_pid is None:
        log("the scripted LLM server's pid was not found (no access to /proc/<pid>/fd?): no server CPU time")

    conn = connect(args.db)
    cur = conn.cursor()
    warm = [phase(args.db, ms, args.warmup, server_pid, sample=False, guarded=g)
            for ms, g in ((0, False), (100, False), (0, True))]
    for w in warm:
        if not w["ok"]:
            log("warm-up failed: %s" % json.dumps(w["checks"]))
    settle_workers(args.db)
    rss_before = worker_memory(cur)
    log("RSS after warm-up: %s" % ", ".join("worker %s (pid %d): %.1f MB (anon %.1f, shmem %.1f)"
                                           % (w, m["pid"], m.get("VmRSS", 0) / 1024.0, m.get("RssAnon", 0) / 1024.0,
                                              m.get("RssShmem", 0) / 1024.0) for w, m in rss_before.items()))
    rounds = []
    ok = all(w["ok"] for w in warm)
    for r in range(args.rounds):
        fast = phase(args.db, 0, args.runs, server_pid)
        log("round %d, %s" % (r + 1, describe(fast)))
        slow = phase(args.db, 100, args.runs, server_pid)
        log("round %d, %s" % (r + 1, describe(slow)))
        guarded = phase(args.db, 0, args.runs, server_pid, guarded=True)
        log("round %d, guarded %s" % (r + 1, describe(guarded)))
        # the cost of the gates: worker CPU per model turn, against the same runs unguarded
        guard_cost = guarded["worker_cpu_s"] / max(1e-9, fast["worker_cpu_s"])
        log("round %d: guardrails on all three gates: worker CPU %.2f s vs %.2f s (x%.3f), wall %.3f s vs %.3f s"
            % (r + 1, guarded["worker_cpu_s"], fast["worker_cpu_s"], guard_cost,
               guarded["wall_s"], fast["wall_s"]))
        ratio = slow["wall_s"] / max(0.3, fast["wall_s"])
        settle_workers(args.db)
        rss = worker_memory(cur)
        log("round %d: ratio %.2f; RSS %s" % (r + 1, ratio, ", ".join(
            "worker %s: %.1f MB" % (w, m.get("VmRSS", 0) / 1024.0) for w, m in rss.items())))
        for p in (fast, slow, guarded):
            if not p["ok"]:
                log("round %d, %d ms: checks failed: %s (an error: %s)"
                    % (r + 1, p["server_ms"], json.dumps(p["checks"]), p["an_error"]))
                ok = False
        rounds.append({"fast": fast, "slow": slow, "guarded": guarded, "guard_cost": guard_cost,
                       "ratio": ratio, "rss_after": rss})
    conn.close()

    rss_after = rounds[-1]["rss_after"] if rounds else rss_before
    growth = rss_growth([rss_before] + [r["rss_after"] for r in rounds])
    max_growth = max((g.get("VmRSS_growth_kb", 0) for g in growth.values()), default=0)
    best = min(rounds, key=lambda x: x["ratio"]) if rounds else None
    result = {"runs": args.runs, "warmup": warm, "rss_before": rss_before, "rss_after": rss_after,
              "rss_growth": growth, "max_rss_growth_kb": max_growth, "rounds": rounds,
              "best": best, "ok": ok}
    write_json(args.json, result)
    if best:
        print(json.dumps({"wall_0ms_s": round(best["fast"]["wall_s"], 3),
                          "wall_100ms_s": round(best["slow"]["wall_s"], 3),
                          "ratio": round(best["ratio"], 2),
                          "peak_concurrent_server": best["slow"]["peak_concurrent_server"],
                          "peak_in_flight_workers": best["slow"]["peak_in_flight_workers"],
                          "max_rss_growth_mb": round(max_growth / 1024.0, 1),
                          "ok": ok}))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
