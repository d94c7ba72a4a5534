"""MCP tasks: a long tool call becomes a task tuvl polls, the run asleep in between.

A 2026-07-28 server that offers the tasks extension
(io.modelcontextprotocol/tasks, which tuvl declares in each call's
clientCapabilities) may answer tools/call with resultType "task" and a
taskId.  The step then polls tasks/get at the task's pollIntervalMs, the run
sleeping between polls (no lease, no worker, no transaction), until the task
completes (its result is the step's output), fails or is cancelled.  The
taskId is in the step's records, so a worker killed meanwhile loses nothing,
and a pinned run replays without a request.

The server is the scripted 2026-07-28 server of test/servers, whose tool
"long" {ms, poll_ms, fail} becomes a task for a client declaring the
extension.
"""
import json

import psycopg2
import pytest

from conftest import connect, kill_worker, q, q1, register_workflows, wait_run_finished, wait_until, worker_pids
from httputil import payloads
from test_mcp_revisions import Stateless

WORKFLOW = """
name: mcp_task
steps:
  - id: work
    kind: MCP
    mcp: { url: "{{ url }}", tool: long, arguments: "{{ args }}" }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}", type: "{{ _last_error_type }}" } }
"""


@pytest.fixture
def server():
    srv = Stateless()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def wf(db):
    return register_workflows(db, WORKFLOW)


def start(conn, server, args):
    return q1(conn, "SELECT tuvl.start_run('mcp_task', %s::jsonb)",
              (json.dumps({"url": server.url, "args": args}),))


def finish(conn, run_id, timeout=40):
    wait_until(lambda: q1(conn, "SELECT finished_at IS NOT NULL FROM tuvl.runs WHERE id = %s", (run_id,)),
               timeout, interval=0.05, message=f"run {run_id} to end", ignore=(psycopg2.OperationalError,))
    end, response = q(conn, "SELECT end_name, response FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    return end, response


def methods(server):
    return [e["method"] for e in server.log()]


def test_a_long_call_becomes_a_task_polled_to_completion(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, {"ms": 4000, "poll_ms": 1500})
    # between polls the run sleeps: no lease, no worker
    wait_until(lambda: q1(c, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "sleeping", 20,
               message="the run to sleep between polls")
    row = q(c, "SELECT lease_owner, step_state -> 'awaiting' FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert row[0] is None and row[1]["kind"] == "mcp_task" and row[1]["tool"] == "long", row
    end, response = finish(c, run_id)
    assert end == "done" and response["text"] == "worked 4000", response
    got = methods(server)
    assert got.count("tools/call") == 1 and got.count("tasks/get") >= 2, got
    call = [e for e in server.log() if e["method"] == "tools/call"][0]
    caps = call["body"]["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"]
    assert caps["extensions"] == {"io.modelcontextprotocol/tasks": {}}
    polls = [e for e in server.log() if e["method"] == "tasks/get"]
    task_id = polls[0]["body"]["params"]["taskId"]
    assert all(e["body"]["params"]["taskId"] == task_id for e in polls)
    assert all(e["headers"]["mcp-method"] == "tasks/get" and "mcp-name" not in e["headers"] for e in polls)
    # polls honour the interval (1.5 s), give or take the timer's second
    times = [e["t"] for e in polls]
    assert all(b - a >= 1.2 for a, b in zip(times, times[1:])), times
    # journaled: each poll is an effect with the task's id
    gets = [p["request"] for p in payloads(c, run_id, "tool_call") if p["request"].get("rpc") == "tasks/get"]
    assert len(gets) == len(polls) and gets[0]["task"] == task_id


def test_a_failed_task_fails_the_step(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, {"ms": 300, "poll_ms": 100, "fail": True})
    end, response = finish(c, run_id)
    assert end == "oops" and response["type"] == "mcp_error", response
    assert 'MCP tool "long" failed: its task' in response["error"], response
    assert "the long work failed" in response["error"]


def test_a_worker_killed_while_the_task_works_resumes_polling(wf, conns, server, server_log):
    c = conns(wf)
    run_id = start(c, server, {"ms": 6000, "poll_ms": 1000})
    wait_until(lambda: "tasks/get" in methods(server), 20, message="the first poll")
    kill_worker(worker_pids(wf)[0], server_log)
    c2 = connect(wf)
    try:
        wait_run_finished(c2, run_id, timeout=60)
        end, response = finish(c2, run_id)
        assert end == "done" and response["text"] == "worked 6000", response
    finally:
        c2.close()
    # one task: the call was not sent again, the same task polled on
    got = methods(server)
    assert got.count("tools/call") == 1, got
    assert len({e["body"]["params"]["taskId"] for e in server.log() if e["method"] == "tasks/get"}) == 1


def test_a_polled_task_replays_with_zero_requests(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, {"ms": 1500, "poll_ms": 500})
    end, response = finish(c, run_id)
    assert end == "done"
    fixture = q1(c, "SELECT tuvl.pin_run(%s)", (run_id,))
    assert [e["type"] for e in fixture["effects"]].count("http") >= 3, fixture["effects"]
    server.clear()
    out = q1(conns(wf), "SELECT tuvl.replay(%s::jsonb)", (json.dumps(fixture),))
    assert out["response"]["text"] == "worked 1500", out
    assert out["effects_served"] == len(fixture["effects"])
    assert server.log() == [], "the replay sent a request"
