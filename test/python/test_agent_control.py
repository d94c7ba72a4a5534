"""Operators and the Agent: the abort checkpoint at the top of a turn and
between two tool calls, and the progress notifications.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403


# ---------------------------------------------------------------------------
# Aborts


def set_abort(db, run_id, abort):
    """What an operator does: as a superuser, from another session, put an
    abort directive in tuvl.runs.control."""
    admin = connect(db)
    try:
        q(admin, "UPDATE tuvl.runs SET control = jsonb_build_object('abort', %s::jsonb) "
                 "WHERE id = %s", (json.dumps(abort), run_id))
    finally:
        admin.close()


def wait_first_answer(name):
    wait_until(lambda: any(r["status"] == 200 for r in sent(name)), 10,
               message="the first model answer")


def test_an_abort_between_two_tool_calls_stops_before_the_second(conn, agdb, provider):
    tag = new_name("t")
    name = make_agent(conn, provider, [
        calls(call("sleepy", tag=f"{tag}-1", secs=1.5), call("record", tag=f"{tag}-2")),
        final("never")], ["sleepy", "record"])
    run_id = start(conn, name, {"topic": "x"})
    wait_first_answer(name)
    time.sleep(0.3)  # the first tool is sleeping now
    set_abort(agdb, run_id, {"reason": "wrong customer", "by": "ops"})
    assert q1(conn, "SELECT tuvl.wait(%s, '15 s')", (run_id,)) == "aborted"
    res = outcome(conn, run_id)
    assert res["status"] == "aborted" and res["end"] is None, res
    reason = res["context"]["_last_error"]
    assert "wrong customer" in reason, reason
    assert res["error"] == 'warning: step "triage" was aborted and has no route for "aborted": ' + reason
    assert res["context"]["_last_error_type"] == "aborted"
    # the call in progress finished; the next one never started
    assert calls_rows(conn, tag) == [("sleepy", f"{tag}-1")]
    assert [(t, p["tool"]) for t, p in agent_tool_events(conn, run_id)] == [
        ("tool_call", "sleepy"), ("tool_result", "sleepy")]
    assert len(sent(name)) == 1
    assert types_of(conn, run_id)[-4:] == ["agent_completed", "signal", "checkpoint", "run_aborted"]
    assert completed_event(conn, run_id) == {"signal": "aborted", "error": reason}
    assert_clean(conn, res)


def test_an_abort_at_the_top_of_a_turn_takes_the_aborted_route(conn, agdb, provider):
    tag = new_name("t")
    name = make_agent(conn, provider, [calls(call("sleepy", tag=tag, secs=1.5)), final("never")],
                      ["sleepy"], routes="{ default: done, error: oops, aborted: stopped }",
                      ends='  - { id: stopped, status: completed, response: { error: "{{ _last_error }}", '
                           'type: "{{ _last_error_type }}" } }\n')
    run_id = start(conn, name, {"topic": "x"})
    wait_first_answer(name)
    time.sleep(0.3)
    set_abort(agdb, run_id, "budget cut")  # the form written by hand
    assert q1(conn, "SELECT tuvl.wait(%s, '15 s')", (run_id,)) == "completed"
    res = outcome(conn, run_id)
    assert res["end"] == "stopped", res
    assert res["response"]["type"] == "aborted"
    assert "budget cut" in res["response"]["error"], res["response"]
    assert calls_rows(conn, tag) == [("sleepy", tag)]
    assert len(sent(name)) == 1, "no model call after the abort"
    assert types_of(conn, run_id)[-1] == "run_completed"


# ---------------------------------------------------------------------------
# Progress notifications


PROGRESS_KEYS = {
    "iteration": {"run_id", "seq", "type", "agent_id", "event", "iteration", "tool_calls", "tokens_used"},
    "tool_call": {"run_id", "seq", "type", "agent_id", "event", "iteration", "tool", "signal"},
    "outcome": {"run_id", "seq", "type", "agent_id", "event", "iteration", "signal"},
}


def notifications(listener, run_id, timeout=15):
    """Parsed journal notifications of run_id until its run_* event."""
    got = []
    deadline = time.monotonic() + timeout
    while not any(p["type"].startswith("run_") and p["type"] not in ("run_queued", "run_started")
                  for p in got):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no run end among {got}"
        if select.select([listener], [], [], min(remaining, 0.5)) == ([], [], []):
            continue
        listener.poll()
        while listener.notifies:
            n = listener.notifies.pop(0)
            assert re.match(r"^tuvl_[0-9a-f]{32}$", n.channel), n.channel
            p = json.loads(n.payload)
            if p["run_id"] == run_id:
                got.append(p)
    return got


def test_progress_is_notified_with_loop_metadata_only(conn, conns, agdb, provider, mode):
    secret_ctx = "CTX-" + uuid.uuid4().hex
    secret_arg = "ARG-" + uuid.uuid4().hex
    name = make_agent(conn, provider, [
        calls(call("record", tag=secret_arg), call("boom", tag=secret_arg),
              usage={"prompt_tokens": 10, "completion_tokens": 5}),
        final('{"outcome": "resolved", "result": "' + secret_arg + '"}',
              usage={"prompt_tokens": 20, "completion_tokens": 0})],
        ["record", "boom"], agent=ENUM, routes=ENUM_ROUTES, ends=ENUM_ENDS)
    listener = conns(agdb)
    listen_events(listener)
    if mode == "sync":
        # tuvl.run() in another session: its notifications arrive at its commit
        results = {}
        runner = threading.Thread(target=lambda: results.update(
            execute(conns(agdb), name, {"topic": secret_ctx}, "sync")))
        runner.start()
        runner.join(30)
        assert results, "tuvl.run() did not return"
        run_id = results["run_id"]
    else:
        run_id = start(conn, name, {"topic": secret_ctx})
    got = notifications(listener, run_id)
    progress = [p for p in got if p["type"] == "agent_progress"]
    assert [{k: v for k, v in p.items() if k not in ("run_id", "seq", "type")} for p in progress] == [
        {"agent_id": "triage", "event": "iteration", "iteration": 1, "tool_calls": 2, "tokens_used": 15},
        {"agent_id": "triage", "event": "tool_call", "iteration": 1, "tool": "record", "signal": "default"},
        {"agent_id": "triage", "event": "tool_call", "iteration": 1, "tool": "boom", "signal": "error"},
        {"agent_id": "triage", "event": "iteration", "iteration": 2, "tool_calls": 0, "tokens_used": 35},
        {"agent_id": "triage", "event": "outcome", "iteration": 2, "signal": "resolved"}]
    for p in progress:
        assert set(p) == PROGRESS_KEYS[p["event"]], p
    # seq is that of the newest stored event before it; none of them is stored
    by_seq = dict(q(conn, "SELECT seq, type FROM tuvl.events WHERE run_id = %s", (run_id,)))
    assert [by_seq[p["seq"]] for p in progress] == [
        "llm_turn", "tool_result", "tool_result", "llm_turn", "llm_turn"]
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND type = 'agent_progress'",
              (run_id,)) == 0
    # the stored events were announced too, in order, each once
    stored = [p["seq"] for p in got if p["type"] != "agent_progress"]
    assert stored == sorted(by_seq)
    text = json.dumps(got)
    assert secret_ctx not in text and secret_arg not in text and "boom:" not in text
    assert outcome(conn, run_id)["end"] == "solved"
