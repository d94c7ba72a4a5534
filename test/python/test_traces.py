"""Traces (src/telemetry/trace.c): spans of runs, steps, agent turns, tool calls and
requests, exported over OTLP/HTTP to tuvl.otlp_endpoint.

The receiver (test/servers/otlp_receiver.js, started by test/run) reads every
export into the message types generated from OpenTelemetry's own protobuf
definitions (@opentelemetry/otlp-transformer from npm) and refuses what does
not fit them; the tests read back what it accepted.  The HTTP test server
and the scripted LLM server log the traceparent of every request.
"""
import json
import os
import time
import urllib.request

import pytest

from conftest import ServerLog, q, q1, wait_until
from httputil import HTTP_BASE, requests_with
from llmutil import sent
from agentutil import (FUNCTIONS, TOOL_STEPS, call, calls, execute, final, make_agent,  # noqa: F401
                        new_name, agdb, conn, mode)

OTLP_URL = os.environ.get("TUVL_OTLP_URL")
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def receiver(method, path):
    assert OTLP_URL, "TUVL_OTLP_URL is not set: test/run starts the OTLP receiver"
    req = urllib.request.Request(OTLP_URL + path, method=method, data=b"" if method == "POST" else None)
    with OPENER.open(req, timeout=10) as resp:
        return json.loads(resp.read().decode())


@pytest.fixture
def tracing(set_gucs):
    receiver("DELETE", "/spans")
    receiver("POST", "/_mode?status=0")
    set_gucs({"tuvl.otlp_endpoint": (f"{OTLP_URL}/v1/traces", f"{OTLP_URL}/v1/traces")})
    yield
    receiver("POST", "/_mode?status=0")


def spans_of(run_id, count, timeout=10):
    """The accepted spans of run run_id, once there are at least count."""
    def got():
        return [s for s in receiver("GET", "/spans")["spans"] if s["attributes"].get("tuvl.run.id") == run_id]
    wait_until(lambda: len(got()) >= count, timeout, message=f"{count} spans of run {run_id}")
    assert receiver("GET", "/spans")["rejected"] == []
    return got()


def by_name(spans, name):
    return [s for s in spans if s["name"] == name]


def apicall_agent(conn, token):
    """An agent that calls a record tool, then an APICall step to the test server."""
    return make_agent(conn, "openai", [calls(call("record", tag=token)), final("Done.")], ["record"],
                      routes="{ default: notify, error: oops }",
                      steps=("  - id: notify\n    kind: APICall\n"
                             f"    http: {{ url: \"{HTTP_BASE}/json?t={token}\" }}\n"
                             "    routes: { default: done }\n"))


def test_a_run_is_one_trace_of_nested_spans(conn, tracing, mode):
    token = new_name("tr")
    name = apicall_agent(conn, token)
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "done"), res
    spans = spans_of(res["run_id"], 8)
    assert len({s["traceId"] for s in spans}) == 1, "one trace"
    ids = {s["spanId"]: s for s in spans}
    assert len(ids) == len(spans), "span ids are unique"
    (run,) = by_name(spans, f"run {name}")
    assert run["parentSpanId"] is None and run["attributes"]["tuvl.run.status"] == "completed"
    steps = {s["attributes"]["tuvl.step.id"]: s for s in spans if s["name"].startswith("step ")}
    assert set(steps) == {"triage", "notify"}
    assert all(s["parentSpanId"] == run["spanId"] for s in steps.values())
    assert steps["triage"]["attributes"]["tuvl.agent.step_id"] == "triage"
    iterations = sorted(by_name(spans, "agent.iteration"), key=lambda s: s["attributes"]["tuvl.agent.iteration"])
    assert [s["attributes"]["tuvl.agent.iteration"] for s in iterations] == [1, 2]
    assert all(s["parentSpanId"] == steps["triage"]["spanId"] for s in iterations)
    assert [s["attributes"]["tuvl.agent.tool_calls"] for s in iterations] == [1, 0]
    assert iterations[1]["attributes"]["tuvl.agent.tokens_used"] > 0
    (tool,) = by_name(spans, "agent.tool_call")
    assert tool["parentSpanId"] == iterations[0]["spanId"]
    assert (tool["attributes"]["tuvl.agent.tool"], tool["attributes"]["tuvl.agent.tool_signal"]) == \
        ("record", "default")
    # the model calls: gen_ai conventions, children of the agent step
    chats = by_name(spans, f"chat {name}")
    assert len(chats) == 2 and all(c["kind"] == 3 and c["parentSpanId"] == steps["triage"]["spanId"]
                                   for c in chats)
    assert chats[0]["attributes"]["gen_ai.request.model"] == name
    assert chats[0]["attributes"]["gen_ai.usage.input_tokens"] > 0
    # the APICall: http conventions, and its traceparent named its span
    (get,) = by_name(spans, "GET")
    assert get["parentSpanId"] == steps["notify"]["spanId"] and get["kind"] == 3
    assert get["attributes"]["http.response.status_code"] == 200
    assert get["attributes"]["url.full"].startswith(f"{HTTP_BASE}/json")
    (request,) = requests_with(token)
    assert request["headers"]["traceparent"] == f"00-{run['traceId']}-{get['spanId']}-01"
    model_parents = {r["headers"]["traceparent"] for r in sent(name)}
    assert model_parents == {f"00-{run['traceId']}-{c['spanId']}-01" for c in chats}
    # every span lies within the run's
    assert all(int(run["start"]) <= int(s["start"]) <= int(s["end"]) <= int(run["end"]) for s in spans
               if s is not run), [(s["name"], s["start"], s["end"]) for s in spans]


def test_a_failed_step_is_an_error_span(conn, tracing):
    name = new_name("trf")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - {{ id: bad, kind: Functional, function: ag.boom }}\n",))
    res = execute(conn, name, {"tag": "x"})
    assert res["status"] == "failed"
    spans = spans_of(res["run_id"], 2)
    (step,) = by_name(spans, "step bad")
    assert step["status"]["code"] == 2 and "boom" in step["status"]["message"]
    (run,) = by_name(spans, f"run {name}")
    assert run["status"]["code"] == 2


def test_a_rolled_back_run_leaves_no_span(conn, tracing):
    name = new_name("trr")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - {{ id: a, kind: Functional, function: ag.record }}\n",))
    conn.autocommit = False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tuvl.run(%s, '{\"tag\": \"r\"}') ->> 'run_id'", (name,))
            run_id = int(cur.fetchone()[0])
        conn.rollback()
    finally:
        conn.autocommit = True
    done = execute(conn, name, {"tag": "ok"})
    spans_of(done["run_id"], 2)
    assert [s for s in receiver("GET", "/spans")["spans"] if s["attributes"].get("tuvl.run.id") == run_id] == []


@pytest.mark.parametrize("trouble", ["status=500", "hang=1"])
def test_a_failing_or_silent_collector_never_slows_a_run(conn, tracing, trouble):
    receiver("POST", f"/_mode?{trouble}")
    log = ServerLog()
    mark = log.mark()
    name = new_name("trs")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n" + "".join(f"  - {{ id: s{i}, kind: Functional, function: ag.record }}\n"
                                            for i in range(5)),))
    started = time.monotonic()
    for _ in range(5):
        assert execute(conn, name, {"tag": "c"}, "worker")["status"] == "completed"
    assert time.monotonic() - started < 5, "the runs did not wait for the collector"
    if trouble == "status=500":
        log.wait_for(mark, r"tuvl could not export spans to .*: HTTP status 500", 10)
    receiver("POST", "/_mode?status=0")
    receiver("DELETE", "/spans")
    # once the collector is back, new runs are exported again
    res = execute(conn, name, {"tag": "back"})
    spans_of(res["run_id"], 6, timeout=15)


def test_without_an_endpoint_no_request_carries_traceparent(conn):
    token = new_name("tn")
    name = apicall_agent(conn, token)
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done"
    assert "traceparent" not in requests_with(token)[0]["headers"]
    assert all("traceparent" not in r["headers"] for r in sent(name))


def test_crash_of_a_worker_leaves_spans_that_still_belong_to_the_run(conn, tracing, server_log, agdb):
    """kill -9 of the worker while step two sleeps: the postmaster restarts
    every process (the span buffer with them), the run is reclaimed, and the
    spans made after the crash have the ids and parents they would have had:
    one trace, every step a child of the run's span."""
    from conftest import connect, kill_worker, wait_run_finished
    name = new_name("trc")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - {{ id: one, kind: Functional, function: ag.record }}\n"
        "  - { id: two, kind: Functional, function: ag.sleepy }\n"
        "  - { id: three, kind: Functional, function: ag.record }\n",))
    run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"crash\", \"secs\": 3}')", (name,))
    spans_of(run_id, 1)  # step one is exported before the crash
    wait_until(lambda: q(conn, "SELECT current_step, lease_owner IS NOT NULL FROM tuvl.runs WHERE id = %s",
                         (run_id,)) == [("two", True)], 10, message="step two to be sleeping")
    time.sleep(0.3)
    holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
    kill_worker(holder, server_log)
    after = connect(agdb)
    try:
        wait_run_finished(after, run_id)
        assert q1(after, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "completed"
    finally:
        after.close()
    spans = spans_of(run_id, 4, timeout=20)
    (run,) = by_name(spans, f"run {name}")
    assert len({s["traceId"] for s in spans}) == 1
    steps = {s["name"] for s in spans if s["parentSpanId"] == run["spanId"]}
    assert {"step one", "step two", "step three"} <= steps, [(s["name"], s["parentSpanId"]) for s in spans]
