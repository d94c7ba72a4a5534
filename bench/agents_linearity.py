#!/usr/bin/env python3
"""Is a long conversation's turn as cheap as a short one's?  (issue 43)

An autonomous agent sends the whole conversation with every model request,
so each turn has more to build, journal and checkpoint than the one before:
the question is how much more.  The target: a 50-turn agent's last turns
cost at most 2 x its fifth.

Batches of --agents autonomous agents, each batch with a conversation of T
model turns (T - 1 turns calling the Functional tool `note` of
bench/agents.py, then an answer), for T = 5, 10, 45 and 50, against the
load generator (bench/servers/loadgen.mjs, plain HTTP, 0 ms per turn) on
the default two workers.  For each batch the workers' CPU over the batch
(user + system from /proc, sampled every 20 ms, bench/agents_scale.py's
Sampler), divided by the agents, is C(T).  The cost of a turn around turn t
is the difference of two batches five turns apart:

  early turn  = (C(10) - C(5)) / 5      turns 6 to 10
  late turn   = (C(50) - C(45)) / 5     turns 46 to 50

and the verdict is late / early, median of the rounds (target <= 2), with
a fixed overhead per agent (claim, end) cancelled by the differences.  Each
round runs the four batches, in reverse order every other round.

    python3 bench/agents_linearity.py --db bench [--agents 200] [--rounds 3] [--json OUT]
"""
import argparse
import statistics
import threading
import time

import agents
from agents import ANSWER, setup_tool
from agents_scale import Sampler, clean
from common import Loadgen, connect, log, settle_workers, wait_for_workers, wait_runs_done, write_json

LENGTHS = (5, 10, 45, 50)
WINDOWS = ((6, 10), (46, 50))   # turns read off within the 50-turn batch

WORKFLOW = """\
name: %(name)s
description: one autonomous Agent step, %(turns)d model turns at 0 ms (bench/agents_linearity.py)
steps:
  - id: work
    kind: Agent
    mode: autonomous
    agent:
      model: %(name)s
      steering: "Record a note every turn until told to stop, then answer done."
      tools:
        - ref: note
      max_iterations: %(iterations)d
      max_tool_calls: %(iterations)d
    routes: { default: finish }
  - id: note
    kind: Functional
    description: Record a note about the current turn.
    function: bench_agents.note
ends:
  - { id: finish, status: completed, response: "{{ work_result }}" }
"""


def script(turns):
    """turns - 1 tool-calling turns, then the answer; the prompt grows with
    the conversation as a provider would count it."""
    out = []
    for t in range(turns - 1):
        out.append({"tool_calls": [{"name": "note", "arguments": {"turn": "{{turn}}"}}],
                    "usage": {"prompt_tokens": 100 + 40 * t, "completion_tokens": 10}})
    out.append({"text": ANSWER, "usage": {"prompt_tokens": 100 + 40 * turns, "completion_tokens": 2}})
    return out


def setup(db, lg):
    conn = connect(db)
    cur = conn.cursor()
    setup_tool(cur)
    for t in LENGTHS:
        name = "bench_lin_%d" % t
        lg.call("POST", "/_script", {"name": name, "turns": script(t)})
        cur.execute("SELECT tuvl.register_llm(%s)",
                    ("name: %s\nprovider: openai\nbase_url: %s/lat/0/v1\nmodel: %s\ntimeout: 60s\n"
                     % (name, lg.url, name),))
        source = WORKFLOW % {"name": name, "turns": t, "iterations": t + 2}
        cur.execute("SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1", (name,))
        row = cur.fetchone()
        if row is None or row[0] != source:
            cur.execute("SELECT tuvl.register_workflow(%s)", (source,))
    conn.close()


class Progress(threading.Thread):
    """Every 10 ms: the model requests the load generator answered so far
    and the workers' CPU (through the batch's Sampler, which follows a
    worker that starts afresh), so that the CPU of one stretch of turns can
    be read off within one batch."""

    def __init__(self, lg, sampler, pids):
        super().__init__(daemon=True)
        self.lg, self.sampler, self.pids = lg, sampler, set(pids)
        self.stop = threading.Event()
        self.points = []                 # (requests answered, worker CPU s)

    def run(self):
        while not self.stop.is_set():
            count = self.lg.call("GET", "/_log").get("count", 0)
            self.sampler.sample_cpu(set(self.sampler.cpu_last) | self.pids)
            self.points.append((count, self.sampler.worker_cpu_s()))
            time.sleep(0.01)

    def cpu_at(self, requests):
        """The workers' CPU when the load generator had answered `requests`,
        interpolated between the samples around it; None outside them."""
        pts = self.points
        for (r0, c0), (r1, c1) in zip(pts, pts[1:]):
            if r0 <= requests <= r1:
                return c0 if r1 == r0 else c0 + (c1 - c0) * (requests - r0) / (r1 - r0)
        return None

    def turn_cost_us(self, n, first, last):
        """CPU per turn while the n agents, in step, took turns first..last:
        from the answer to turn first - 1 to the answer to turn last."""
        a, b = self.cpu_at(n * (first - 1)), self.cpu_at(n * last)
        if a is None or b is None:
            return None
        return 1e6 * (b - a) / (n * (last - first + 1))


def batch(db, lg, turns, n, timeout=900, windows=()):
    """n agents of `turns` turns queued in one transaction: the workers' CPU
    per agent, and whether every agent made every turn."""
    workflow = "bench_lin_%d" % turns
    conn = connect(db)
    clean(conn.cursor(), workflow)
    conn.close()
    lg.call("DELETE", "/_log")
    pids = settle_workers(db)
    sampler = Sampler(db, pids)
    sampler.start()
    progress = Progress(lg, sampler, pids) if windows else None
    if progress:
        progress.start()
    conn = connect(db, autocommit=False)
    cur = conn.cursor()
    cur.execute("SELECT count(tuvl.start_run(%s, jsonb_build_object('k', i))) FROM generate_series(1, %s) i",
                (workflow, n))
    conn.commit()
    conn.autocommit = True
    wait_runs_done(cur, workflow, timeout)
    if progress:
        progress.stop.set()
        progress.join()
    sampler.sample_cpu(set(sampler.cpu_last) | set(pids))
    sampler.stop.set()
    sampler.join()
    cur.execute("SELECT count(*) FILTER (WHERE status = 'completed'), min(error) FROM tuvl.runs WHERE workflow = %s",
                (workflow,))
    completed, an_error = cur.fetchone()
    conn.close()
    seen = lg.call("GET", "/_log?model=" + workflow)
    requests = seen.get("script", {}).get("count")
    return {"turns": turns, "agents": n, "worker_cpu_s": sampler.worker_cpu_s(),
            "turn_us": {"%d-%d" % w: progress.turn_cost_us(n, *w) for w in windows} if progress else {},
            "cpu_per_agent_us": 1e6 * sampler.worker_cpu_s() / n,
            "model_requests": requests, "an_error": an_error,
            "ok": completed == n and requests == turns * n}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="bench")
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    lg = Loadgen()
    out = {"config": vars(args), "rounds": []}
    try:
        setup(args.db, lg)
        wait_for_workers(args.db)
        batch(args.db, lg, LENGTHS[0], 20)     # warm the workers' caches
        for r in range(args.rounds):
            order = list(LENGTHS) if r % 2 == 0 else list(reversed(LENGTHS))
            rnd = {}
            for t in order:
                res = batch(args.db, lg, t, args.agents, windows=WINDOWS if t == 50 else ())
                rnd[t] = res
                log("agents_linearity round %d: %d turns, %.0f us of worker CPU per agent%s"
                    % (r + 1, t, res["cpu_per_agent_us"],
                       "" if res["ok"] else " NOT ALL COMPLETED (%s)" % res["an_error"]))
            early = (rnd[10]["cpu_per_agent_us"] - rnd[5]["cpu_per_agent_us"]) / 5
            late = (rnd[50]["cpu_per_agent_us"] - rnd[45]["cpu_per_agent_us"]) / 5
            w_early, w_late = (rnd[50]["turn_us"].get("%d-%d" % w) for w in WINDOWS)
            out["rounds"].append({"batches": {str(t): rnd[t] for t in LENGTHS},
                                  "early_turn_us": early, "late_turn_us": late,
                                  "late_per_early": late / early if early > 0 else None,
                                  "within_early_us": w_early, "within_late_us": w_late,
                                  "within_late_per_early": w_late / w_early if w_early and w_late else None,
                                  "ok": all(rnd[t]["ok"] for t in LENGTHS)})
            log("agents_linearity round %d: a turn around the 8th %.0f us, around the 48th %.0f us: %.2f x"
                % (r + 1, early, late, late / early if early > 0 else float("nan")))
            if w_early and w_late:
                log("agents_linearity round %d: within the 50-turn batch, turns 6-10 %.0f us, turns 46-50 %.0f us: %.2f x"
                    % (r + 1, w_early, w_late, w_late / w_early))
            write_json(args.json, out)
        ratios = [x["late_per_early"] for x in out["rounds"] if x["late_per_early"] is not None]
        within = [x for x in out["rounds"] if x["within_late_per_early"] is not None]
        out["summary_within"] = {
            "early_turn_us": statistics.median(x["within_early_us"] for x in within),
            "late_turn_us": statistics.median(x["within_late_us"] for x in within),
            "late_per_early": statistics.median(x["within_late_per_early"] for x in within),
            "range": [min(x["within_late_per_early"] for x in within),
                      max(x["within_late_per_early"] for x in within)],
        } if within else None
        out["summary"] = {
            "early_turn_us": statistics.median(x["early_turn_us"] for x in out["rounds"]),
            "late_turn_us": statistics.median(x["late_turn_us"] for x in out["rounds"]),
            "late_per_early": statistics.median(ratios) if ratios else None,
            "range": [min(ratios), max(ratios)] if ratios else None,
            "ok": all(x["ok"] for x in out["rounds"]),
        }
        write_json(args.json, out)
        s = out["summary"]
        print("agents_linearity: a turn around the 8th %.0f us, around the 48th %.0f us of worker CPU: "
              "%.2f x (target <= 2; rounds %.2f - %.2f)%s"
              % (s["early_turn_us"], s["late_turn_us"], s["late_per_early"] or float("nan"),
                 (s["range"] or [float("nan")] * 2)[0], (s["range"] or [float("nan")] * 2)[1],
                 "" if s["ok"] else ", NOT ALL COMPLETED"))
        w = out["summary_within"]
        if w:
            print("agents_linearity: within the 50-turn batch, turns 6-10 %.0f us, turns 46-50 %.0f us of worker CPU: "
                  "%.2f x (target <= 2; rounds %.2f - %.2f)"
                  % (w["early_turn_us"], w["late_turn_us"], w["late_per_early"], w["range"][0], w["range"][1]))
    finally:
        lg.stop()


if __name__ == "__main__":
    main()
