"""Hooks (hook.c) around steps and an Agent's tool calls: metric and notify
hooks.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403


# ---------------------------------------------------------------------------
# Hooks (hook.c): metric hooks around steps and tool calls


def hook(conn, events, metric=None):
    name = new_name("hook")
    q(conn, "SELECT tuvl.register_artifact(%s)", (
        f"name: {name}\ntype: hook\nevents: [{', '.join(events)}]\naction: metric\n"
        + (f"metric: {metric}\n" if metric else ""),))
    return name


def counts(conn, hook_name, metric="tuvl.hook.events"):
    """{(event, step, tool, signal): value} of a hook's counters."""
    rows = q(conn, "SELECT labels, value FROM tuvl.metrics WHERE name = %s AND labels ->> 'hook' = %s",
             (metric, hook_name))
    return {(l["event"], l["step"], l.get("tool"), l.get("signal")): v for l, v in rows}


def steps_workflow(conn, hooks_line, steps):
    name = new_name("wf")
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"name: {name}\n{hooks_line}steps:\n{steps}",))
    return name


def test_a_metric_hook_counts_each_step_before_and_after_it(conn, mode):
    h = hook(conn, ["before_step", "after_step", "on_error"])
    wf = steps_workflow(conn, f"hooks: [artifact://{h}@1]\n",
                        "  - { id: one, kind: Functional, function: ag.record }\n"
                        "  - { id: two, kind: Functional, function: ag.record }\n")
    for _ in range(2):
        res = execute(conn, wf, {"tag": "h"}, mode)
        assert res["status"] == "completed", res
    assert counts(conn, h) == {
        ("before_step", "one", None, None): 2, ("after_step", "one", None, "default"): 2,
        ("before_step", "two", None, None): 2, ("after_step", "two", None, "default"): 2}
    assert q1(conn, "SELECT kind FROM tuvl.metrics WHERE labels ->> 'hook' = %s LIMIT 1", (h,)) == "counter"


def test_a_hook_named_without_a_version_counts_as_each_run_pinned_it(conn):
    # the same backend executes both runs: what it remembers of the hook
    # must follow each run's pin, not the first version it resolved
    h = hook(conn, ["after_step"], metric="pin.first")
    wf = steps_workflow(conn, f"hooks: [artifact://{h}]\n",
                        "  - { id: one, kind: Functional, function: ag.record }\n")
    assert execute(conn, wf, {"tag": "v1"})["status"] == "completed"
    q(conn, "SELECT tuvl.register_artifact(%s)",
      (f"name: {h}\ntype: hook\nevents: [before_step]\naction: metric\nmetric: pin.second\n",))
    assert execute(conn, wf, {"tag": "v2"})["status"] == "completed"
    assert execute(conn, wf, {"tag": "v2"})["status"] == "completed"
    assert counts(conn, h, "pin.first") == {("after_step", "one", None, "default"): 1}
    assert counts(conn, h, "pin.second") == {("before_step", "one", None, None): 2}


def test_on_error_fires_for_a_failing_step_and_hooks_never_change_the_run(conn):
    h = hook(conn, ["before_step", "after_step", "on_error"])
    wf = steps_workflow(conn, "",
                        f"  - {{ id: bad, kind: Functional, function: ag.boom, hooks: [artifact://{h}@1],\n"
                        "      routes: { error: fine } }\n"
                        "  - { id: fine, kind: Functional, function: ag.record }\n")
    res = execute(conn, wf, {"tag": "e"})
    assert res["status"] == "completed", res
    # only the step the hook is attached to; the failure was counted once
    assert counts(conn, h) == {("before_step", "bad", None, None): 1,
                               ("on_error", "bad", None, "error"): 1}
    assert "hook" not in json.dumps(res["context"])


def test_tool_hooks_count_every_tool_call_of_an_agent(conn, mode):
    h = hook(conn, ["before_tool", "after_tool"], metric="support.tool_calls")
    name = make_agent(conn, "openai",
                      [calls(call("record", tag="a"), call("boom", tag="b")), final("done")],
                      ["record", "boom"], step=f"    hooks: [artifact://{h}@1]\n")
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["status"] == "completed", res
    assert counts(conn, h, "support.tool_calls") == {
        ("before_tool", "triage", "record", None): 1, ("after_tool", "triage", "record", "default"): 1,
        ("before_tool", "triage", "boom", None): 1, ("after_tool", "triage", "boom", "error"): 1}
    # a replay checks the recording and counts nothing
    replayed = q1(conn, "SELECT tuvl.replay(tuvl.pin_run(%s))", (res["run_id"],))
    assert replayed["status"] == "completed", replayed
    assert sum(counts(conn, h, "support.tool_calls").values()) == 4


def test_a_failing_hook_is_logged_and_swallowed(conn, conns, agdb):
    h = hook(conn, ["after_step"])
    wf = steps_workflow(conn, f"hooks: [artifact://{h}@1]\n",
                        "  - { id: one, kind: Functional, function: ag.record }\n")
    # the hook's version is deleted by hand: a process that has not read it
    # yet (a new session) cannot resolve it
    q(conn, "DELETE FROM tuvl.artifacts WHERE name = %s", (h,))
    mark = ServerLog().mark()
    res = execute(conns(agdb), wf, {"tag": "f"})
    assert res["status"] == "completed", res
    assert types_of(conn, res["run_id"])[-1] == "run_completed"
    assert counts(conn, h) == {}
    ServerLog().wait_for(mark, rf"hook artifact://{h}@1 of step \"one\" failed on after_step", 10)


# notify hooks: an APICall step run on the hook's payload, in a run of its own


def notify_hook(conn, events, step="tell"):
    name = new_name("notify")
    q(conn, "SELECT tuvl.register_artifact(%s)", (
        f"name: {name}\ntype: hook\nevents: [{', '.join(events)}]\naction: notify\nstep: {step}\n",))
    return name


def tell_step(token, path="json"):
    """The APICall step notify hooks run: it posts the payload to the test server."""
    return ("  - id: tell\n    kind: APICall\n"
            f"    http: {{ method: POST, url: \"{HTTP_BASE}/{path}?t={token}\", body: {{ event: \"{{{{ event }}}}\", "
            "run: \"{{ run_id }}\", step: \"{{ step }}\", tool: \"{{ tool }}\", signal: \"{{ signal }}\", "
            "error: \"{{ error }}\" } }\n"
            "    output: told\n")


def notified(conn, run_id, count, timeout=20):
    """The runs run_id's notify hooks started, once count of them have finished."""
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = %s AND status IN "
                                "('completed', 'failed')", (run_id,)) >= count, timeout,
               message=f"{count} notification runs of run {run_id} to finish")
    return q(conn, "SELECT id, status, hook, principal, error FROM tuvl.runs WHERE parent_run_id = %s "
                   "ORDER BY id", (run_id,))


def posted(token):
    return [json.loads(r["body"]) for r in requests_with(token)]


def test_a_notify_hook_posts_its_payload_from_a_run_of_its_own(conn, mode):
    token = new_name("n")
    h = notify_hook(conn, ["after_step"])
    wf = steps_workflow(conn, f"hooks: [artifact://{h}@1]\n",
                        "  - { id: one, kind: Functional, function: ag.record, routes: { default: done } }\n"
                        + tell_step(token) + "ends:\n  - { id: done, status: completed }\n")
    res = execute(conn, wf, {"tag": token}, mode)
    assert (res["status"], res["end"]) == ("completed", "done"), res
    ((child, status, hook, principal, error),) = notified(conn, res["run_id"], 1)
    assert (status, error) == ("completed", None)
    assert hook == {"hook": h, "version": 1, "event": "after_step", "step": "tell"}
    assert principal == q1(conn, "SELECT principal FROM tuvl.runs WHERE id = %s", (res["run_id"],))
    assert posted(token) == [{"event": "after_step", "run": res["run_id"], "step": "one", "tool": None,
                              "signal": "default", "error": None}]
    # the run that fired it never sees it: not in its context, not in its journal
    assert "told" not in res["context"]
    assert events_mentioning(conn, res["run_id"], "tell") == 0
    # the notification run executed the one step, fired no hook, and ended
    assert [e[0] for e in events(conn, child)] == [
        "run_queued", "run_started", "agent_started", "tool_call", "tool_result", "agent_completed",
        "signal", "checkpoint", "run_completed"], events(conn, child)
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = %s", (child,)) == 0
    assert journal_violations(conn, [res["run_id"], child]) == []


def test_a_notify_hook_on_error_carries_the_error_and_a_failed_delivery_is_only_its_own(conn):
    token = new_name("n")
    h = notify_hook(conn, ["on_error"])
    wf = steps_workflow(conn, f"hooks: [artifact://{h}@1]\n",
                        "  - { id: one, kind: Functional, function: ag.boom, routes: { error: done } }\n"
                        + tell_step(token, path="status/500")
                        + "ends:\n  - { id: done, status: completed }\n")
    res = execute(conn, wf, {"tag": token}, "worker")
    assert (res["status"], res["end"]) == ("completed", "done"), res
    ((child, status, _, _, error),) = notified(conn, res["run_id"], 1, timeout=60)
    assert status == "failed" and "500" in error, error
    body = posted(token)[0]
    assert (body["event"], body["step"], body["signal"]) == ("on_error", "one", "error")
    assert body["error"].startswith(f"boom: the order {token} is locked"), body


def test_notify_hooks_around_an_agents_tool_calls(conn):
    token = new_name("n")
    h = notify_hook(conn, ["before_tool", "after_tool"])
    name = make_agent(conn, "openai", [calls(call("record", tag=token)), final("Done.")], ["record"],
                      step=f"    hooks: [artifact://{h}@1]\n", steps=tell_step(token))
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done", res
    notified(conn, res["run_id"], 2)
    assert sorted((b["event"], b["tool"], b["signal"]) for b in posted(token)) == [
        ("after_tool", "record", "default"), ("before_tool", "record", None)]


def test_a_replay_and_a_rolled_back_run_start_no_notification(conn):
    token = new_name("n")
    h = notify_hook(conn, ["after_step"])
    wf = steps_workflow(conn, f"hooks: [artifact://{h}@1]\n",
                        "  - { id: one, kind: Functional, function: ag.record, routes: { default: done } }\n"
                        + tell_step(token) + "ends:\n  - { id: done, status: completed }\n")
    res = execute(conn, wf, {"tag": token})
    notified(conn, res["run_id"], 1)
    before = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE hook IS NOT NULL")
    replayed = q1(conn, "SELECT tuvl.replay(tuvl.pin_run(%s))", (res["run_id"],))
    assert replayed["status"] == "completed", replayed
    conn.autocommit = False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tuvl.run(%s, %s::jsonb)", (wf, json.dumps({"tag": token})))
        conn.rollback()
    finally:
        conn.autocommit = True
    time.sleep(1)
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE hook IS NOT NULL") == before
    assert len(posted(token)) == 1


def test_the_step_a_notify_hook_runs_counts_as_reached(conn):
    h = notify_hook(conn, ["after_step"])
    src = (f"name: v\nhooks: [artifact://{h}@1]\nsteps:\n"
           "  - { id: one, kind: Functional, function: ag.record, routes: { default: done } }\n"
           + tell_step("x") + "  - { id: stray, kind: Functional, function: ag.record }\n"
           "ends:\n  - { id: done, status: completed }\n")
    warned = [r[1] for r in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,))
              if "never reached" in r[2]]
    assert warned == ["steps[2]"], warned


def test_a_notify_hook_must_name_an_apicall_step_of_the_workflow(conn):
    missing, wrong = notify_hook(conn, ["after_step"], step="nope"), notify_hook(conn, ["after_step"], step="one")
    src = (f"name: v\nhooks: [artifact://{missing}@1, artifact://{wrong}@1]\nsteps:\n"
           "  - { id: one, kind: Functional, function: ag.record }\n")
    rows = {(r[1], r[2].rsplit(" (line", 1)[0]) for r in
            q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,)) if r[0] == "error"}
    assert rows == {
        ("hooks[0]", f'notify hook "{missing}" runs step "nope", which is not a step of this workflow; '
                     "add an APICall step with that id"),
        ("hooks[1]", f'notify hook "{wrong}" runs step "one", a Functional step; a notify hook runs an '
                     "APICall step"),
    }, rows


def test_hooks_are_checked_when_the_workflow_is_registered(conn):
    notify = new_name("hook")
    q(conn, "SELECT tuvl.register_artifact(%s)", (
        f"name: {notify}\ntype: hook\nevents: [after_step]\naction: notify\nstep: tell\n",))
    guard = guardrail(conn, "{ check: max_length, max: 10 }")
    src = (f"name: v\nhooks: [artifact://{notify}@1, artifact://{guard}@1, not_a_ref]\nsteps:\n"
           "  - { id: a, kind: Functional, function: ag.record }\n")
    rows = {(r[1], r[2].rsplit(" (line", 1)[0]) for r in
            q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,)) if r[0] == "error"}
    assert rows == {
        ("hooks[0]", f'notify hook "{notify}" runs step "tell", which is not a step of this workflow; '
                     "add an APICall step with that id"),
        ("hooks[1]", f"artifact://{guard}@1 is a guardrail artifact, but this field takes a hook artifact"),
        ("hooks[2]", "hooks must list only artifact:// references to a hook artifact"),
    }, rows



def test_a_role_sees_the_counts_of_its_own_runs_and_an_operator_all(conn, agdb, conns):
    h = hook(conn, ["after_step"])
    wf = steps_workflow(conn, f"hooks: [artifact://{h}@1]\n",
                        "  - { id: one, kind: Functional, function: ag.record }\n")
    assert execute(conn, wf, {"tag": "v"})["status"] == "completed"
    reader, operator = new_name("reader"), new_name("op")
    admin = connect("postgres")
    try:
        q(admin, f"CREATE ROLE {reader} LOGIN IN ROLE tuvl_user")
        q(admin, f"CREATE ROLE {operator} LOGIN IN ROLE tuvl_operator")
        assert q(conns(agdb, user=reader), "SELECT value FROM tuvl.metrics "
                                           "WHERE labels ->> 'hook' = %s", (h,)) == []
        assert q(conns(agdb, user=operator), "SELECT value FROM tuvl.metrics "
                                             "WHERE labels ->> 'hook' = %s", (h,)) == [(1.0,)]
        with pytest.raises(psycopg2.Error):
            q(conns(agdb, user=reader), "UPDATE tuvl.metrics SET value = 0")
    finally:
        for role in (reader, operator):
            q(admin, f"DROP ROLE IF EXISTS {role}")
        admin.close()
