"""MCP elicitation answered by a person: the run waits as a Human step does.

A 2026-07-28 server that needs input in the middle of a call answers it with
resultType "input_required".  With mcp.elicitation: ask (the default) the
run parks as waiting_human, its question (the server's message and
requestedSchema) in tuvl.people_queue; tuvl.submit() accepts with the
content (checked against the schema), tuvl.reject() declines or cancels,
elicitation_timeout cancels for nobody, and the step retries the same
tools/call with inputResponses.  The worker holds nothing while the person
decides: a worker killed meanwhile loses nothing, and a pinned run replays
without a request.

The server is the scripted 2026-07-28 server of test/servers
(mcp_stateless_server.py), whose tool "confirm" asks {confirmed: boolean,
note: string} with the message "Confirm <operation>?".
"""
import json
import time

import psycopg2
import pytest

from conftest import connect, kill_worker, q, q1, wait_run_finished, wait_until, worker_pids
from httputil import payloads
from test_mcp_revisions import Stateless

ASK = """
name: {name}
steps:
  - id: tool
    kind: MCP
    mcp:
      url: "{{{{ url }}}}"
      tool: confirm
      arguments: {{ operation: "{{{{ op }}}}" }}
{extra}
    output: res
    routes: {{ default: done, error: oops }}
ends:
  - {{ id: done, status: completed, response: "{{{{ res }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""

CONFIRM_SCHEMA = {
    "type": "object",
    "properties": {
        "confirmed": {"type": "boolean", "title": "Confirmed", "default": False},
        "note": {"type": "string", "title": "Note", "default": "none"},
    },
    "required": ["confirmed"],
}


@pytest.fixture
def server():
    srv = Stateless()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def wf(db):
    conn = connect(db)
    # the default is ask; mcp_ask_explicit says so
    q(conn, "SELECT tuvl.register_workflow(%s)", (ASK.format(name="mcp_ask", extra=""),))
    q(conn, "SELECT tuvl.register_workflow(%s)",
      (ASK.format(name="mcp_ask_explicit", extra="      elicitation: ask"),))
    q(conn, "SELECT tuvl.register_workflow(%s)",
      (ASK.format(name="mcp_ask_timeout", extra="      elicitation_timeout: 1s"),))
    conn.close()
    return db


def start(conn, server, op, workflow="mcp_ask"):
    return q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)",
              (workflow, json.dumps({"url": server.url, "op": op})))


def wait_status(conn, run_id, status, timeout=30):
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == status,
               timeout, interval=0.05, message=f"run {run_id} to be {status}",
               ignore=(psycopg2.OperationalError,))


def finish(conn, run_id, timeout=30):
    # tuvl.wait() returns when a run parks for a person: poll for its end
    wait_until(lambda: q1(conn, "SELECT finished_at IS NOT NULL FROM tuvl.runs WHERE id = %s", (run_id,)),
               timeout, interval=0.05, message=f"run {run_id} to end")
    end, response = q(conn, "SELECT end_name, response FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert end == "done", response
    return response


def calls(server):
    return [e for e in server.log() if e["method"] == "tools/call"]


def test_a_question_parks_the_run_until_a_person_submits(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, "deploy")
    wait_status(c, run_id, "waiting_human")
    # what people see: the server's question, with the schema submit() checks
    row = q(c, "SELECT step, answer_with, awaiting, deadline FROM tuvl.people_queue WHERE run_id = %s",
            (run_id,))
    assert len(row) == 1, row
    step, answer_with, awaiting, deadline = row[0]
    assert step == "tool" and answer_with == "tuvl.submit()" and deadline is None
    assert awaiting["kind"] == "mcp_elicitation" and awaiting["mode"] == "form"
    assert awaiting["message"] == "Confirm deploy?" and awaiting["form"] == CONFIRM_SCHEMA
    assert awaiting["server"] == server.url and awaiting["tool"] == "confirm"
    assert awaiting["request"] == "confirm"
    # the waiting run holds no worker, no lease, no transaction
    assert q1(c, "SELECT lease_owner IS NULL FROM tuvl.runs WHERE id = %s", (run_id,))
    assert q1(c, "SELECT count(*) FROM pg_stat_activity WHERE backend_type LIKE 'tuvl%%' "
                 "AND state LIKE 'idle in transaction%%'") == 0
    assert len(calls(server)) == 1

    q(c, "SELECT tuvl.submit(%s, %s::jsonb)", (run_id, json.dumps({"confirmed": True, "note": "go"})))
    assert finish(c, run_id)["text"] == "deploy: accepted confirmed=true note=go"
    first, retry = [e["body"]["params"] for e in calls(server)]
    assert first["_meta"]["io.modelcontextprotocol/clientCapabilities"]["elicitation"] == {"form": {}}
    assert retry["inputResponses"] == {"confirm": {"action": "accept",
                                                   "content": {"confirmed": True, "note": "go"}}}
    assert retry["requestState"] and retry["arguments"] == {"operation": "deploy"}
    # journaled: the question, the person's answer, the retry with it
    decision = payloads(c, run_id, "decision")
    assert decision == [{"action": "submit", "data": {"confirmed": True, "note": "go"},
                         "by": "postgres", "request": "confirm", "tool": "confirm"}], decision
    retried = payloads(c, run_id, "tool_call")[-1]["request"]
    assert retried["input_responses"]["confirm"]["action"] == "accept"


def test_the_sync_path_parks_too_and_workers_go_on(wf, conns, server):
    """tuvl.run() returns the parked run; the answer hands it to the workers."""
    c = conns(wf)
    res = q1(c, "SELECT tuvl.run('mcp_ask_explicit', %s::jsonb)",
             (json.dumps({"url": server.url, "op": "sync"}),))
    assert res["status"] == "waiting_human", res
    q(c, "SELECT tuvl.submit(%s, '{\"confirmed\": false}')", (res["run_id"],))
    assert finish(c, res["run_id"])["text"] == "sync: accepted confirmed=false note=None"


@pytest.mark.parametrize("action", ["decline", "cancel"])
def test_a_person_declines_or_cancels_with_reject(wf, conns, server, action):
    c = conns(wf)
    run_id = start(c, server, "drop")
    wait_status(c, run_id, "waiting_human")
    if action == "decline":
        q(c, "SELECT tuvl.reject(%s)", (run_id,))      # decline is the default
    else:
        q(c, "SELECT tuvl.reject(%s, 'cancel')", (run_id,))
    assert finish(c, run_id)["text"] == f"drop: {dict(decline='declined', cancel='cancelled')[action]}"
    retry = calls(server)[1]["body"]["params"]
    assert retry["inputResponses"] == {"confirm": {"action": action}}
    assert payloads(c, run_id, "decision")[0]["action"] == action


def test_bad_answers_are_refused_and_the_run_keeps_waiting(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, "resize")
    wait_status(c, run_id, "waiting_human")
    bad = [
        ({"confirmed": "yes"}, "does not match its schema"),
        ({"note": "no confirmed"}, "does not match its schema"),
        ([True], "must be a JSON object"),
    ]
    for data, message in bad:
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            q(c, "SELECT tuvl.submit(%s, %s::jsonb)", (run_id, json.dumps(data)))
        assert message in str(e.value), str(e.value)
        assert 'the MCP server\'s question at step "tool"' in str(e.value)
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(c, "SELECT tuvl.reject(%s, 'maybe')", (run_id,))
    assert "action must be decline or cancel" in str(e.value)
    assert q1(c, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "waiting_human"
    assert len(calls(server)) == 1
    q(c, "SELECT tuvl.submit(%s, '{\"confirmed\": true}')", (run_id,))
    assert finish(c, run_id)["text"] == "resize: accepted confirmed=true note=None"


def test_reject_answers_only_a_server_question(wf, conns):
    c = conns(wf)
    q(c, "SELECT tuvl.register_workflow(%s)", ("""
name: mcp_ask_human
steps:
  - id: form
    kind: Human
    form: { type: object }
    routes: { default: done }
ends:
  - { id: done }
""",))
    run_id = q1(c, "SELECT tuvl.start_run('mcp_ask_human', '{}')")
    wait_status(c, run_id, "waiting_human")
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as e:
        q(c, "SELECT tuvl.reject(%s)", (run_id,))
    assert 'its Human step "form" waits for data' in str(e.value)
    q(c, "SELECT tuvl.submit(%s, '{}')", (run_id,))


def test_a_hostile_role_cannot_answer_another_roles_question(wf, conns, server):
    admin = conns(wf)
    roles = ("mcpask_owner", "mcpask_other")
    for r in roles:
        q(admin, f"DROP ROLE IF EXISTS {r}")
        q(admin, f"CREATE ROLE {r} LOGIN")
        q(admin, f"GRANT tuvl_user TO {r}")
    try:
        owner, other = conns(wf, user=roles[0]), conns(wf, user=roles[1])
        run_id = start(owner, server, "transfer")
        wait_status(admin, run_id, "waiting_human")
        # the other role sees no question, and cannot answer, decline or cancel it
        assert q(other, "SELECT run_id FROM tuvl.people_queue") == []
        for sql in ("SELECT tuvl.submit(%s, '{\"confirmed\": true}')", "SELECT tuvl.reject(%s)",
                    "SELECT tuvl.reject(%s, 'cancel')"):
            with pytest.raises(psycopg2.errors.UndefinedObject) as e:
                q(other, sql, (run_id,))
            assert f"run {run_id} does not exist" in str(e.value)
        assert q1(admin, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "waiting_human"
        assert len(calls(server)) == 1
        # its own role answers it
        assert [r[0] for r in q(owner, "SELECT run_id FROM tuvl.people_queue")] == [run_id]
        q(owner, "SELECT tuvl.submit(%s, '{\"confirmed\": true, \"note\": \"mine\"}')", (run_id,))
        assert finish(owner, run_id)["text"] == "transfer: accepted confirmed=true note=mine"
    finally:
        for r in roles:
            q(admin, f"DROP OWNED BY {r}")
            q(admin, f"DROP ROLE {r}")


def test_nobody_answering_within_the_timeout_cancels(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, "reboot", "mcp_ask_timeout")
    wait_status(c, run_id, "waiting_human")
    assert q1(c, "SELECT deadline IS NOT NULL FROM tuvl.people_queue WHERE run_id = %s", (run_id,))
    assert finish(c, run_id, timeout=30)["text"] == "reboot: cancelled"
    assert calls(server)[1]["body"]["params"]["inputResponses"] == {"confirm": {"action": "cancel"}}
    decision = payloads(c, run_id, "decision")
    assert [(d["action"], d["by"]) for d in decision] == [("cancel", "tuvl")], decision
    assert "elicitation_timeout of 1 s" in decision[0]["reason"]
    resumed = payloads(c, run_id, "resumed")
    assert any("elicitation_timeout" in r.get("reason", "") for r in resumed), resumed
    # the timeout no longer applies once answered: a late answer is refused
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
        q(c, "SELECT tuvl.submit(%s, '{\"confirmed\": true}')", (run_id,))


def test_kill_9_of_the_worker_while_the_person_decides(wf, conns, server, server_log):
    c = conns(wf)
    run_id = start(c, server, "migrate")
    wait_status(c, run_id, "waiting_human")
    # the worker that asked holds nothing now: kill -9 one (the server restarts)
    kill_worker(worker_pids(wf)[0], server_log)
    c2 = connect(wf)
    try:
        wait_until(lambda: len(worker_pids(wf)) > 0, 30, message="the workers to come back")
        assert q1(c2, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "waiting_human"
        q(c2, "SELECT tuvl.submit(%s, '{\"confirmed\": true, \"note\": \"after the crash\"}')", (run_id,))
        wait_run_finished(c2, run_id)
        assert finish(c2, run_id)["text"] == "migrate: accepted confirmed=true note=after the crash"
    finally:
        c2.close()
    # the question was asked once and the answer sent once
    assert len(calls(server)) == 2


@pytest.mark.parametrize("answer", ["submit", "reject"])
def test_an_answered_question_replays_with_zero_requests(wf, conns, server, answer):
    c = conns(wf)
    run_id = start(c, server, "ship")
    wait_status(c, run_id, "waiting_human")
    if answer == "submit":
        q(c, "SELECT tuvl.submit(%s, '{\"confirmed\": true, \"note\": \"ok\"}')", (run_id,))
        want = "ship: accepted confirmed=true note=ok"
    else:
        q(c, "SELECT tuvl.reject(%s, 'cancel')", (run_id,))
        want = "ship: cancelled"
    assert finish(c, run_id)["text"] == want
    fixture = q1(c, "SELECT tuvl.pin_run(%s)", (run_id,))
    assert [e["type"] for e in fixture["effects"]] == ["http", "http", "human", "http"], fixture["effects"]
    server.clear()
    out = q1(conns(wf), "SELECT tuvl.replay(%s::jsonb)", (json.dumps(fixture),))
    assert out["response"]["text"] == want, out
    assert out["effects_served"] == len(fixture["effects"])
    assert server.log() == [], "the replay sent a request"


def test_a_timed_out_question_replays_with_zero_requests(wf, conns, server):
    c = conns(wf)
    run_id = start(c, server, "sleep", "mcp_ask_timeout")
    assert finish(c, run_id)["text"] == "sleep: cancelled"
    fixture = q1(c, "SELECT tuvl.pin_run(%s)", (run_id,))
    server.clear()
    out = q1(conns(wf), "SELECT tuvl.replay(%s::jsonb)", (json.dumps(fixture),))
    assert out["response"]["text"] == "sleep: cancelled", out
    assert server.log() == []


def test_elicitation_and_its_timeout_are_validated_with_their_paths(wf, conns):
    c = conns(wf)
    bad = ASK.format(name="mcp_ask_bad", extra="      elicitation: maybe\n      elicitation_timeout: soon")
    found = q(c, "SELECT path, message FROM tuvl.validate(%s)", (bad,))
    paths = {p: m for p, m in found}
    assert paths.keys() == {"steps[0].mcp.elicitation", "steps[0].mcp.elicitation_timeout"}, found
    assert paths["steps[0].mcp.elicitation"].startswith(
        "elicitation must be ask (the run waits for a person's answer, tuvl.submit() or tuvl.reject()), "
        "accept_defaults (answer the server's questions with the defaults of its schema) or decline")
    assert paths["steps[0].mcp.elicitation_timeout"].startswith(
        '"elicitation_timeout" must be a duration such as 500ms')


def test_a_question_on_a_2025_stream_fails_the_call_clearly(wf, conns):
    """A 2025-11-25 server asks on the call's open event stream and waits
    there: that stream cannot outlive a run waiting for a person, so the
    call fails at once (not after the timeout) and says what to use."""
    srv = Stateless("--versions", "2025-11-25")
    try:
        c = conns(wf)
        q(c, "SELECT tuvl.register_workflow(%s)", ("""
name: mcp_ask_2025
steps:
  - id: tool
    kind: MCP
    mcp: { url: "{{ url }}", tool: ask_on_stream, timeout: 15s }
    output: res
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ res }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}", type: "{{ _last_error_type }}" } }
""",))
        t0 = time.monotonic()
        res = q1(c, "SELECT tuvl.run('mcp_ask_2025', %s::jsonb)", (json.dumps({"url": srv.url}),))
        assert time.monotonic() - t0 < 10, "the call waited for the stream"
        assert res["end"] == "oops" and res["response"]["type"] == "mcp_error", res
        err = res["response"]["error"]
        assert "the server asked for input (elicitation/create) on the call's event stream of a " \
               "2025-11-25 session" in err, err
        done = q1(c, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'agent_completed'",
                  (res["run_id"],))
        assert done["sqlstate"] == "0A000" and "2026-07-28" in done["hint"], done
        # a compliant server is never asked: no elicitation capability on 2025
        init = [e for e in srv.log() if e["method"] == "initialize"][0]
        assert init["body"]["params"]["capabilities"] == {}
    finally:
        srv.stop()
