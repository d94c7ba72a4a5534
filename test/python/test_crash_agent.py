"""kill -9 of a worker in the middle of an autonomous Agent's loop.

A five-turn agent: turns 0..3 each call a ModelOp tool that inserts a row,
turn 4 gives the final answer.  The scripted LLM server holds the answer of
turn 2 (the third request) for three seconds; while it is in flight the
worker holding the run is killed with SIGKILL, so the postmaster restarts
every backend and the run is reclaimed at start-up.  The agent re-enters the
loop from its step_state: the answered turns are served from it (turns 0 and
1 are requested exactly once), only the call in flight is sent again, and
each tool call committed with the record of its result, so the table holds
exactly one row per call.
"""
import collections
import os
import urllib.request
import uuid

import pytest

from conftest import connect, journal_violations, kill_worker, q, q1, wait_run_finished, wait_until
from llmutil import script, sent

LLM_URL = os.environ.get("TUVL_LLM_URL")
LLM_ROOT = LLM_URL[: -len("/v1")] if LLM_URL and LLM_URL.endswith("/v1") else LLM_URL

pytestmark = pytest.mark.skipif(not LLM_URL, reason="TUVL_LLM_URL is not set (run through test/run)")

# Never let an http_proxy variable send the tests' own requests elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def workflow(name):
    return f"""
name: {name}
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: {name}
      steering: Record every step you take.
      tools: [{{ ref: ins }}]
    routes: {{ default: done, error: oops }}
  - id: ins
    kind: ModelOp
    description: Insert a row
    sql: INSERT INTO agcrash.sink (tag) VALUES ($1) RETURNING id
    params: ["{{{{ tag }}}}"]
ends:
  - {{ id: done, status: completed, response: "{{{{ triage_result }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}" }} }}
"""


@pytest.fixture(scope="module")
def crashdb(db):
    conn = connect(db)
    try:
        q(conn, "CREATE SCHEMA agcrash")
        # no unique constraint: a tool that ran twice shows up as a second row
        q(conn, "CREATE TABLE agcrash.sink (id bigserial PRIMARY KEY, tag text NOT NULL)")
    finally:
        conn.close()
    return db


def events(conn, run_id):
    return q(conn, "SELECT type, payload FROM tuvl.events WHERE run_id = %s ORDER BY seq", (run_id,))


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_crash_kill_9_in_turn_3_repeats_only_the_call_in_flight(crashdb, provider, server_log):
    name = f"crash_{uuid.uuid4().hex[:12]}"
    tag = name
    turn = {"tool_calls": [{"name": "ins", "arguments": {"tag": tag + "-{{turn}}"}}]}
    script(name, [turn, turn, dict(turn, latency_ms=3000), turn, {"text": "five turns done"}])
    conn = connect(crashdb)
    try:
        q(conn, "SELECT tuvl.register_llm(%s)", (
            f"name: {name}\nprovider: {provider}\nbase_url: {LLM_URL}\nmodel: {name}\ntimeout: 20s\n",))
        q(conn, "SELECT tuvl.register_workflow(%s)", (workflow(name),))
        run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"topic\": \"crash\"}')", (name,))
        wait_until(lambda: len(sent(name)) == 3 and sent(name)[2]["status"] is None, 15,
                   message="the third request to be in flight")
        holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        assert holder, "a worker holds the run"
        assert q1(conn, "SELECT backend_type FROM pg_stat_activity WHERE pid = %s",
                  (holder,)) == "tuvl worker"
        # turns 0 and 1 and their tools are committed
        assert q1(conn, "SELECT count(*) FROM agcrash.sink WHERE tag LIKE %s", (tag + "-%",)) == 2
    finally:
        conn.close()

    kill_worker(holder, server_log)

    conn = connect(crashdb)
    try:
        wait_run_finished(conn, run_id)
        status, end, response, attempt, step_state = q(
            conn, "SELECT status, end_name, response, attempt, step_state FROM tuvl.runs "
                  "WHERE id = %s", (run_id,))[0]
        assert (status, end, response) == ("completed", "done", "five turns done")
        assert attempt >= 2, "the run was claimed again after the crash"
        assert step_state is None

        reqs = sent(name)
        per_turn = collections.Counter(r["turn"] for r in reqs)
        assert per_turn[0] == 1 and per_turn[1] == 1, "answered turns are never requested again"
        assert per_turn == {0: 1, 1: 1, 2: 2, 3: 1, 4: 1}, per_turn
        third = [r for r in reqs if r["turn"] == 2]
        assert third[0]["status"] is None, "the first third request never got its answer to tuvl"
        assert third[1]["status"] == 200
        assert third[0]["body"] == third[1]["body"], "the conversation was rebuilt exactly"

        # every tool call ran exactly once
        assert q(conn, "SELECT tag FROM agcrash.sink WHERE tag LIKE %s ORDER BY id",
                 (tag + "-%",)) == [(f"{tag}-{i}",) for i in range(4)]

        evs = events(conn, run_id)
        types = [t for t, _ in evs]
        assert types.count("agent_started") == 1
        assert types.count("llm_turn") == 5
        tool_calls = [p for t, p in evs if t == "tool_call"]
        tool_results = [p for t, p in evs if t == "tool_result"]
        assert [p["arguments"]["tag"] for p in tool_calls] == [f"{tag}-{i}" for i in range(4)]
        assert [p["iteration"] for p in tool_results] == [1, 2, 3, 4]
        assert types[-4:] == ["agent_completed", "signal", "checkpoint", "run_completed"]
        assert journal_violations(conn, [run_id]) == []
    finally:
        conn.close()


def test_crash_kill_9_while_a_judge_weighs_a_tool_result_asks_it_again_and_runs_the_tool_once(crashdb,
                                                                                      server_log):
    """An llm_judge on the tools gate: the worker dies while the judge's call
    is in flight.  The tool's row and its record committed before the call
    went out, so the reclaimed run asks the judge again and never reruns it."""
    name = f"crashj_{uuid.uuid4().hex[:12]}"
    judge_model = name + "_judge"
    script(name, [{"tool_calls": [{"name": "ins", "arguments": {"tag": name}}]},
                  {"text": "judged and done"}])
    script(judge_model, [{"text": '{"verdict": "pass", "reason": "fine"}', "latency_ms": 3000}])
    conn = connect(crashdb)
    try:
        for model in (name, judge_model):
            q(conn, "SELECT tuvl.register_llm(%s)", (
                f"name: {model}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: {model}\ntimeout: 20s\n",))
        q(conn, "SELECT tuvl.register_artifact(%s)", (
            f"name: {name}\ntype: guardrail\nchecks:\n"
            f"  - {{ check: llm_judge, model: {judge_model}, prompt: Is it safe? }}\n",))
        q(conn, "SELECT tuvl.register_workflow(%s)", (workflow(name).replace(
            "      tools: [{ ref: ins }]\n",
            f"      tools: [{{ ref: ins }}]\n      guardrails: {{ tools: [artifact://{name}] }}\n"),))
        run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"topic\": \"crash\"}')", (name,))
        wait_until(lambda: len(sent(judge_model)) == 1 and sent(judge_model)[0]["status"] is None, 15,
                   message="the judge's call to be in flight")
        holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        assert q1(conn, "SELECT count(*) FROM agcrash.sink WHERE tag = %s", (name,)) == 1
    finally:
        conn.close()

    kill_worker(holder, server_log)

    conn = connect(crashdb)
    try:
        wait_run_finished(conn, run_id)
        assert q(conn, "SELECT status, response FROM tuvl.runs WHERE id = %s", (run_id,)) == [
            ("completed", "judged and done")]
        assert q1(conn, "SELECT count(*) FROM agcrash.sink WHERE tag = %s", (name,)) == 1
        judged = sent(judge_model)
        assert len(judged) == 2 and judged[1]["status"] == 200
        assert judged[0]["body"] == judged[1]["body"], "the judge was asked the same again"
        assert len(sent(name)) == 2
        types = [t for t, _ in events(conn, run_id)]
        assert types.count("judge_verdict") == 1 and types.count("llm_turn") == 3
        assert journal_violations(conn, [run_id]) == []
    finally:
        conn.close()
