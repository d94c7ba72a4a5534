"""Metrics (src/telemetry/metrics.c): tuvl.metrics and tuvl.metrics_prometheus().

Runs with known outcomes, then the counters they must have left: steps by
signal, step durations, agent turns, tool calls, tokens by model, aborts,
budget stops and supervisor verdicts; gauges of runs and the queue; who
sees which series; and the Prometheus text read back by a parser someone
else wrote (python3-prometheus-client from Debian).
"""
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import connect, q, q1
from llmutil import LLM_URL
from agentutil import (FUNCTIONS, agent_workflow, call, calls, execute, final, make_agent,  # noqa: F401
                        new_name, agdb, conn, mode)


def series(conn, name, **labels):
    """{labels (as a frozenset of items): value} of a metric, filtered by labels."""
    rows = q(conn, "SELECT labels, value FROM tuvl.metrics WHERE name = %s AND labels @> %s::jsonb",
             (name, json.dumps(labels)))
    return {frozenset(l.items()): v for l, v in rows}


def value(conn, name, **labels):
    return sum(series(conn, name, **labels).values())


def steps_workflow(conn, steps):
    name = new_name("m")
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"name: {name}\nsteps:\n{steps}",))
    return name


TWO = ("  - { id: one, kind: Functional, function: ag.record }\n"
       "  - { id: two, kind: Functional, function: ag.record }\n")


def test_steps_and_their_durations_are_counted_once_per_step(conn, mode):
    wf = steps_workflow(conn, TWO)
    for _ in range(3):
        assert execute(conn, wf, {"tag": "m"}, mode)["status"] == "completed"
    for step in ("one", "two"):
        assert value(conn, "tuvl.steps", workflow=wf, step=step, kind="Functional", signal="default") == 3
        assert value(conn, "tuvl.step.duration_ms.count", workflow=wf, step=step) == 3
        assert value(conn, "tuvl.step.duration_ms.sum", workflow=wf, step=step) > 0
        buckets = {dict(k)["le"]: v for k, v in series(conn, "tuvl.step.duration_ms", workflow=wf,
                                                       step=step).items()}
        assert buckets["+Inf"] == 3
        bounds = sorted((float(le), v) for le, v in buckets.items() if le != "+Inf")
        assert [v for _, v in bounds] == sorted(v for _, v in bounds), "buckets are cumulative"
    assert q1(conn, "SELECT kind FROM tuvl.metrics WHERE name = 'tuvl.step.duration_ms' LIMIT 1") == \
        "histogram_bucket"


def test_a_failed_step_counts_its_signal_and_a_rolled_back_run_counts_nothing(conn):
    wf = steps_workflow(conn, "  - { id: bad, kind: Functional, function: ag.boom, routes: { error: ok } }\n"
                              "  - { id: ok, kind: Functional, function: ag.record }\n")
    execute(conn, wf, {"tag": "f"})
    assert value(conn, "tuvl.steps", workflow=wf, step="bad", signal="error") == 1
    conn.autocommit = False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tuvl.run(%s, '{\"tag\": \"r\"}')", (wf,))
        conn.rollback()
    finally:
        conn.autocommit = True
    assert value(conn, "tuvl.steps", workflow=wf, step="bad") == 1
    assert value(conn, "tuvl.steps", workflow=wf, step="ok") == 1


def test_agent_turns_tool_calls_and_tokens_by_model(conn, mode):
    name = make_agent(conn, "openai", [
        calls(call("record", tag="t1"), usage={"prompt_tokens": 100, "completion_tokens": 10}),
        calls(call("record", tag="t2"), call("boom", tag="t3"),
              usage={"prompt_tokens": 200, "completion_tokens": 20}),
        final("Done.", usage={"prompt_tokens": 300, "completion_tokens": 30})], ["record", "boom"])
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["end"] == "done", res
    assert value(conn, "tuvl.agent.iterations", workflow=name, step="triage", model=name) == 3
    assert value(conn, "tuvl.agent.tool_calls", workflow=name, tool="record", signal="default") == 2
    assert value(conn, "tuvl.agent.tool_calls", workflow=name, tool="boom", signal="error") == 1
    assert value(conn, "tuvl.llm.tokens", workflow=name, model=name, type="prompt") == 600
    assert value(conn, "tuvl.llm.tokens", workflow=name, model=name, type="completion") == 60
    assert value(conn, "tuvl.steps", workflow=name, step="triage", kind="Agent", signal="default") == 1


def test_aborts_budget_stops_and_supervisor_verdicts_are_counted(conn):
    rec = calls(call("record", tag="s"))
    aborted = make_agent(conn, "openai", [rec, rec, final("never")], ["record"],
                         routes="{ default: done, error: oops, aborted: oops }")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        q1(conn, "SELECT source FROM tuvl.workflows WHERE name = %s", (aborted,)).replace(
            "steps:\n", "supervisor:\n  rules:\n    - { rule: repeated_tool_call, count: 2, action: abort }\n"
                        "steps:\n", 1),))
    assert execute(conn, aborted, {"topic": "x"})["response"]["type"] == "aborted"
    assert value(conn, "tuvl.agent.aborts", workflow=aborted, step="triage") == 1
    assert value(conn, "tuvl.supervisor.verdicts", workflow=aborted, source="rule",
                 rule="repeated_tool_call", action="abort") == 1
    budget = make_agent(conn, "openai", [dict(rec, usage={"prompt_tokens": 900, "completion_tokens": 0}),
                                         final("never")], ["record"],
                        agent="      token_budget: 500\n",
                        routes="{ default: done, error: oops, budget_exceeded: oops }")
    assert execute(conn, budget, {"topic": "x"})["response"]["type"] == "budget_exceeded"
    assert value(conn, "tuvl.agent.budget_exceeded", workflow=budget) == 1


def test_a_replay_counts_nothing(conn):
    wf = steps_workflow(conn, TWO)
    run_id = execute(conn, wf, {"tag": "p"})["run_id"]
    q(conn, "SELECT tuvl.replay(tuvl.pin_run(%s))", (run_id,))
    assert value(conn, "tuvl.steps", workflow=wf, step="one") == 1


def test_gauges_of_runs_and_the_queue(conn):
    wf = steps_workflow(conn, TWO)
    conn.autocommit = False
    try:
        with conn.cursor() as cur:
            # queued in this transaction: invisible to the workers until it commits
            for _ in range(3):
                cur.execute("SELECT tuvl.start_run(%s, '{\"tag\": \"g\"}')", (wf,))
            cur.execute("SELECT pg_sleep(0.2)")
            cur.execute("SELECT name, value FROM tuvl.metrics WHERE name LIKE 'tuvl.queue.%%' "
                        "OR (name = 'tuvl.runs' AND labels ->> 'status' = 'queued')")
            got = dict(cur.fetchall())
        conn.rollback()
    finally:
        conn.autocommit = True
    assert got["tuvl.runs"] >= 3 and got["tuvl.queue.depth"] >= 3, got
    assert got["tuvl.queue.oldest_age_seconds"] >= 0.2, got


def test_a_role_sees_the_series_of_its_own_runs_and_an_operator_all(conn, agdb, conns):
    wf = steps_workflow(conn, TWO)
    assert execute(conn, wf, {"tag": "v"})["status"] == "completed"
    reader, operator = new_name("reader"), new_name("op")
    admin = connect("postgres")
    try:
        q(admin, f"CREATE ROLE {reader} LOGIN IN ROLE tuvl_user")
        q(admin, f"CREATE ROLE {operator} LOGIN IN ROLE tuvl_operator")
        assert value(conn, "tuvl.steps", workflow=wf) == 2
        assert value(conns(agdb, user=reader), "tuvl.steps", workflow=wf) == 0
        assert value(conns(agdb, user=operator), "tuvl.steps", workflow=wf) == 2
        assert wf not in q1(conns(agdb, user=reader), "SELECT tuvl.metrics_prometheus()")
        assert wf in q1(conns(agdb, user=operator), "SELECT tuvl.metrics_prometheus()")
    finally:
        for role in (reader, operator):
            q(admin, f"DROP ROLE IF EXISTS {role}")
        admin.close()


def test_the_prometheus_text_is_read_back_by_prometheus_client(conn):
    wf = steps_workflow(conn, TWO)
    for _ in range(2):
        execute(conn, wf, {"tag": "p"})
    text = q1(conn, "SELECT tuvl.metrics_prometheus()")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["tuvl_steps"].type == "counter"
    assert families["tuvl_runs"].type == "gauge"
    hist = families["tuvl_step_duration_ms"]
    assert hist.type == "histogram"
    mine = [s for s in hist.samples if s.labels.get("workflow") == wf and s.labels.get("step") == "one"]
    by_name = {}
    for s in mine:
        by_name.setdefault(s.name, []).append(s)
    assert [s.value for s in by_name["tuvl_step_duration_ms_count"]] == [2.0]
    assert {s.labels["le"] for s in by_name["tuvl_step_duration_ms_bucket"]} >= {"1", "1000", "+Inf"}
    steps = [s for s in families["tuvl_steps"].samples if s.labels.get("workflow") == wf]
    assert sorted((s.labels["step"], s.labels["signal"], s.value) for s in steps) == [
        ("one", "default", 2.0), ("two", "default", 2.0)]
    # every value the view shows is in the text
    assert len([s for f in families.values() for s in f.samples]) == q1(conn, "SELECT count(*) FROM tuvl.metrics")


def test_label_values_are_escaped_in_the_prometheus_text(conn):
    name = new_name("esc")
    odd = 'we"ird\\model\nx'
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: {json.dumps(odd)}\n",))
    source = agent_workflow(name, name, ["record"])
    q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    assert execute(conn, name, {"topic": "x"})["status"] == "completed"
    text = q1(conn, "SELECT tuvl.metrics_prometheus()")
    (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "tuvl_agent_iterations_total" and s.labels.get("workflow") == name]
    assert sample.labels["model"] == odd and sample.value == 1.0


def test_long_label_values_are_clipped_on_a_character_boundary(conn):
    name = new_name("clip")
    model = "\u00e9" * 40 + "m" * 40   # 80 bytes of two-byte characters, then 40 of one
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: {json.dumps(model)}\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name, ["record"]),))
    assert execute(conn, name, {"topic": "x"})["status"] == "completed"
    (labels,) = q1(conn, "SELECT array_agg(DISTINCT labels ->> 'model') FROM tuvl.metrics "
                         "WHERE name = 'tuvl.agent.iterations' AND labels ->> 'workflow' = %s", (name,))
    # at most 63 bytes, and never half of a character
    assert labels == "\u00e9" * 31


# structured logs: tuvl.log_agent_events


def agent_events_logged(server_log, mark, run_id):
    lines = [l.split("tuvl agent event ", 1)[1] for l in server_log.since(mark).splitlines()
             if "tuvl agent event " in l]
    return [e for e in map(json.loads, lines) if e["run_id"] == run_id]


def test_log_agent_events_writes_one_json_line_per_turn_tool_call_and_exit(conn, server_log):
    name = make_agent(conn, "openai", [calls(call("record", tag="l1")), calls(call("record", tag="l2")),
                                       final("never")], ["record"],
                      agent="      max_iterations: 2\n",
                      routes="{ default: done, error: oops, max_iterations: oops }")
    mark = server_log.mark()
    q(conn, "SET tuvl.log_agent_events = on")
    try:
        res = execute(conn, name, {"topic": "x"})
    finally:
        q(conn, "RESET tuvl.log_agent_events")
    assert res["response"]["type"] == "max_iterations", res
    got = agent_events_logged(server_log, mark, res["run_id"])
    assert [(e["event"], e["iteration"]) for e in got] == [
        ("agent.turn", 1), ("agent.tool_call", 1), ("agent.turn", 2), ("agent.tool_call", 2),
        ("agent.max_iterations", 2)], got
    assert {e["step_id"] for e in got} == {"triage"} and {e["workflow"] for e in got} == {name}
    trace_ids = {e["trace_id"] for e in got}
    assert len(trace_ids) == 1 and len(trace_ids.pop()) == 32
    assert got[1]["tool"] == "record" and got[1]["signal"] == "default"
    assert got[-1]["error"].startswith("the agent reached max_iterations (2)")
    # off (the default): nothing
    mark = server_log.mark()
    res = execute(conn, name, {"topic": "x"})
    assert agent_events_logged(server_log, mark, res["run_id"]) == []
