"""The autonomous Agent's loop: tool choice and the sequential order of the
calls of one turn; the answers the model gets for a tool that raises, a call
whose arguments are not JSON and a tool that does not exist (the loop goes
on); the time limit of a tool (tuvl.agent_tool_timeout); the token budget,
which also bounds the final-answer turn; max_iterations.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403
from conftest import not_under_asan


# ---------------------------------------------------------------------------
# Tool choice and order


def test_tools_run_in_the_order_called_and_the_conversation_is_replayed(conn, provider, mode):
    tag = new_name("t")
    name = make_agent(conn, provider, [
        calls(call("record", tag=f"{tag}-1"), call("insert", tag=f"{tag}-2"),
              text="Recording two tags.", usage={"prompt_tokens": 10, "completion_tokens": 5}),
        calls(call("record", tag=f"{tag}-3"), usage={"prompt_tokens": 20, "completion_tokens": 5}),
        final("all recorded", usage={"prompt_tokens": 30, "completion_tokens": 5}),
    ], ["record", "insert", "boom"])
    res = execute(conn, name, {"topic": "refund", "order": 7}, mode)
    assert (res["status"], res["end"], res["response"]) == ("completed", "done", "all recorded"), res
    assert res["context"]["triage_result"] == "all recorded"
    # the tools the model chose ran, in the order it called them; boom never ran
    assert calls_rows(conn, tag) == [("record", f"{tag}-1"), ("insert", f"{tag}-2"),
                                     ("record", f"{tag}-3")]
    assert "record_result" not in res["context"] and "insert_result" not in res["context"]

    # the journal: one llm_turn per model call, tool_call/tool_result pairs in order
    assert types_of(conn, res["run_id"]) == [
        "run_queued", "run_started", "agent_started",
        "llm_turn", "tool_call", "tool_result", "tool_call", "tool_result",
        "llm_turn", "tool_call", "tool_result",
        "llm_turn", "agent_completed", "signal", "checkpoint", "run_completed"]
    tools = agent_tool_events(conn, res["run_id"])
    ids = ["call_0_0", "call_0_1", "call_1_0"] if provider != "anthropic" else \
        ["toolu_0_0", "toolu_0_1", "toolu_1_0"]
    assert [(t, p["iteration"], p["call_id"], p["tool"]) for t, p in tools] == [
        ("tool_call", 1, ids[0], "record"), ("tool_result", 1, ids[0], "record"),
        ("tool_call", 1, ids[1], "insert"), ("tool_result", 1, ids[1], "insert"),
        ("tool_call", 2, ids[2], "record"), ("tool_result", 2, ids[2], "record")]
    assert tools[0][1]["arguments"] == {"tag": f"{tag}-1"}
    first_id = q1(conn, "SELECT id FROM ag.calls WHERE tag = %s", (f"{tag}-1",))
    assert tools[1][1]["signal"] == "default"
    assert tools[1][1]["result"] == {"record_result": {"id": first_id, "tag": f"{tag}-1"}}
    assert completed_event(conn, res["run_id"]) == {
        "signal": "default", "output_key": "triage_result", "output": "all recorded"}
    assert sum(e[3]["tokens"]["total"] for e in events(conn, res["run_id"], "llm_turn")) == 75

    # what the model was sent: the whole conversation again at every turn
    reqs = sent(name)
    assert [r["turn"] for r in reqs] == [0, 1, 2] and all(r["status"] == 200 for r in reqs)
    opening = [{"role": "system", "content": f"Persistent operating context (always follow it):\n"
                                             f"{STEERING}\n\n{INSTRUCTION}"},
               {"role": "user", "content": '{"order": 7, "topic": "refund"}'}]
    assert conversation(provider, reqs[0]["body"]) == opening
    second = conversation(provider, reqs[1]["body"])
    assert second[:2] == opening
    assert second[2]["role"] == "assistant" and second[2]["content"] == "Recording two tags."
    assert [(c["id"], c["name"], c["arguments"]) for c in second[2]["tool_calls"]] == [
        (ids[0], "record", {"tag": f"{tag}-1"}), (ids[1], "insert", {"tag": f"{tag}-2"})]
    second_id = q1(conn, "SELECT id FROM ag.calls WHERE tag = %s", (f"{tag}-2",))
    assert tool_answers(provider, reqs[1]["body"]) == [
        (ids[0], {"record_result": {"id": first_id, "tag": f"{tag}-1"}}),
        (ids[1], {"insert_result": [{"id": second_id}]})]
    third = conversation(provider, reqs[2]["body"])
    assert third[:len(second)] == second, "earlier turns are replayed verbatim"
    assert [m["role"] for m in third[len(second):]] == ["assistant", "tool"]
    assert [m["tool_call_id"] for m in third if m["role"] == "tool"] == ids
    for r in reqs:
        assert set(offered(provider, r["body"])) == {"record", "insert", "boom"}
    assert_clean(conn, res)


# ---------------------------------------------------------------------------
# Answers that are errors: the loop goes on


def test_a_raising_tool_is_answered_with_its_error_and_the_loop_goes_on(conn, provider, mode):
    tag = new_name("t")
    name = make_agent(conn, provider, [calls(call("boom", tag=f"{tag}-1")),
                                       calls(call("record", tag=f"{tag}-2")),
                                       final("recovered")],
                      ["record", "boom"])
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"], res["response"]) == ("completed", "done", "recovered"), res
    # the failed tool's writes were rolled back; the next tool ran
    assert calls_rows(conn, tag) == [("record", f"{tag}-2")]
    message = f"boom: the order {tag}-1 is locked"
    reqs = sent(name)
    assert len(reqs) == 3
    ((call_id, answer),) = tool_answers(provider, reqs[1]["body"])
    assert answer == {"error": message}
    tool_msgs = [m for m in conversation(provider, reqs[1]["body"]) if m["role"] == "tool"]
    if provider == "anthropic":
        assert tool_msgs[0].get("is_error") is True
    tools = agent_tool_events(conn, res["run_id"])
    assert tools[1] == ("tool_result", {"iteration": 1, "call_id": call_id, "tool": "boom",
                                        "signal": "error", "error": message})
    assert [t for t, _ in tools] == ["tool_call", "tool_result"] * 2
    assert "_last_error" not in res["context"]
    assert_clean(conn, res)


@pytest.mark.parametrize("raw, journaled", [("not json", "not json"), ("[1, 2]", [1, 2])])
def test_arguments_that_are_not_a_json_object_are_answered_as_an_error(conn, mode, raw, journaled):
    # Anthropic cannot carry arguments that are not an object: OpenAI only
    tag = new_name("t")
    name = make_agent(conn, "openai", [
        calls({"name": "record", "arguments_raw": raw}, call("record", tag=tag)),
        final("done")], ["record"])
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["end"], res["response"]) == ("done", "done"), res
    assert calls_rows(conn, tag) == [("record", tag)], "only the well-formed call ran"
    assert q1(conn, "SELECT count(*) FROM ag.calls WHERE tool = 'record' AND tag IS NULL") == 0
    reqs = sent(name)
    assert len(reqs) == 2
    answers = tool_answers("openai", reqs[1]["body"])
    assert answers[0] == ("call_0_0", {
        "error": f"the arguments of this call are not a JSON object: {raw}"})
    assert answers[1][0] == "call_0_1" and answers[1][1]["record_result"]["tag"] == tag
    # the call as the model made it is in the conversation again
    assert reqs[1]["body"]["messages"][2]["tool_calls"][0]["function"]["arguments"] == raw
    tools = agent_tool_events(conn, res["run_id"])
    assert tools[0][1]["arguments"] == journaled
    assert tools[1][1]["signal"] == "error"
    assert_clean(conn, res)


def test_an_http_tool_failing_within_its_own_timeout_is_an_answer_not_an_exit(conn, provider):
    tag = new_name("t")
    api = ("  - id: slow_api\n    kind: APICall\n    description: A slow service\n"
           f"    http: {{ url: \"{HTTP_BASE}/slow?ms=3000&token={tag}\", timeout: 300ms }}\n")
    name = make_agent(conn, provider, [calls(call("slow_api")), final("gave up on it")],
                      ["slow_api"], steps=api)
    res = execute(conn, name, {"topic": "x"})
    assert (res["end"], res["response"]) == ("done", "gave up on it"), res
    ((_, answer),) = tool_answers(provider, sent(name)[1]["body"])
    assert set(answer) == {"error"} and "timed out" in answer["error"].lower(), answer
    assert len(http_requests(tag)) == 1
    assert "_last_error_type" not in res["context"]


def test_an_unknown_tool_is_answered_as_an_error(conn, provider, mode):
    tag = new_name("t")
    # sleepy is a step of the workflow, but not one of the agent's tools
    name = make_agent(conn, provider, [calls(call("delete_everything", really=True),
                                             call("sleepy", tag=tag, secs=0)),
                                       final("fine")], ["record", "boom"],
                      steps=TOOL_STEPS["sleepy"])
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["end"], res["response"]) == ("done", "fine"), res
    reqs = sent(name)
    assert len(reqs) == 2
    assert [a for _, a in tool_answers(provider, reqs[1]["body"])] == [
        {"error": 'there is no tool named "delete_everything"; the tools are: record, boom'},
        {"error": 'there is no tool named "sleepy"; the tools are: record, boom'}]
    assert calls_rows(conn, tag) == [], "a step that is not a tool never runs"
    tools = agent_tool_events(conn, res["run_id"])
    assert [t for t, _ in tools] == ["tool_call", "tool_result"] * 2
    assert tools[1][1]["signal"] == "error" and tools[1][1]["tool"] == "delete_everything"
    assert_clean(conn, res)


def test_a_tool_signal_other_than_default_is_shown_to_the_model(conn, provider):
    tag = new_name("t")
    router = ("  - id: classify\n    kind: Router\n    description: Classify a tier\n"
              "    on: \"{{ tier }}\"\n    routes: { vip: oops, default: oops }\n")
    name = make_agent(conn, provider, [calls(call("found", tag=tag), call("classify", tier="vip"),
                                             call("classify", tier="")),
                                       final("ok")], ["found", "classify"], steps=router)
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done", res
    # the step's output key, then the signal; the steps' routes are ignored
    assert [a for _, a in tool_answers(provider, sent(name)[1]["body"])] == [
        {"lookup": {"order": tag}, "signal": "found"}, {"signal": "vip"}, {"signal": ""}]
    results = [p for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
    assert [p["signal"] for p in results] == ["found", "vip", ""]


# ---------------------------------------------------------------------------
# The time limit of a tool (tuvl.agent_tool_timeout)


SLOW_API = ("  - id: slow_api\n    kind: APICall\n    description: A slow service\n"
            "    http: {{ url: \"{base}/slow?ms=5000&token={token}\" }}\n")


@pytest.mark.parametrize("kind", ["functional", "apicall"])
def test_a_tool_past_agent_tool_timeout_ends_the_step_on_the_error_exit(conn, set_gucs, kind):
    set_gucs({"tuvl.agent_tool_timeout": ("1", "1s")})
    for mode in ("worker", "sync"):
        tag = new_name("t")
        if kind == "functional":
            tool, steps = "sleepy", ""
            turns = [calls(call("sleepy", tag=tag, secs=5), call("record", tag=f"{tag}-after")),
                     final("never")]
        else:
            tool, steps = "slow_api", SLOW_API.format(base=HTTP_BASE, token=tag)
            turns = [calls(call("slow_api"), call("record", tag=f"{tag}-after")), final("never")]
        name = make_agent(conn, "openai", turns, [tool, "record"], steps=steps)
        began = time.monotonic()
        res = execute(conn, name, {"topic": "x"}, mode)
        elapsed = time.monotonic() - began
        error, kind_ = error_of(res)
        assert error == f'tool "{tool}" did not finish within tuvl.agent_tool_timeout (1 s)', error
        assert kind_ == "tool_timeout"
        assert elapsed < 4, f"{mode}: the run took {elapsed:.1f} s"
        # the step stopped: no later tool, no further model call
        assert calls_rows(conn, tag) == [], "the cancelled tool's writes and the next tool never happened"
        assert len(sent(name)) == 1
        if kind == "apicall":
            assert len(http_requests(tag)) == 1, "the slow request was sent once"
        done = completed_event(conn, res["run_id"])
        assert done["signal"] == "error" and done["error"] == error
        results = [p for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
        assert [(p["tool"], p["signal"], p["error"]) for p in results] == [(tool, "error", error)]
        assert res["context"]["_last_error_type"] == "tool_timeout"
        assert_clean(conn, res)


# ---------------------------------------------------------------------------
# Budget and iterations


def test_runs_waiting_at_a_step_found_slow_once_go_back_into_batches(conn):
    # one run's tool call outlives half a batch's budget (tuvl.max_batch_time,
    # 50 ms): the agent step is marked slow, and the runs ready at it are
    # marked to run alone.  The next of them that turns out fast unmarks the
    # step, and the others go back into batches with it; left to run alone,
    # they went one model round trip (300 ms) after another, each waiting for
    # the one before to get its answer
    name = make_agent(conn, "openai", [calls(call("nap"), latency_ms=300), final("rested", latency_ms=300)],
                      ["nap"])
    w = connect(conn.info.dbname, autocommit=False)
    try:
        ids = [start(w, name, {"nap": 0.2 if i == 0 else 0}) for i in range(40)]
        w.commit()
    finally:
        w.close()
    started = time.monotonic()
    for run_id in ids:
        assert q1(conn, "SELECT tuvl.wait(%s, '60 s')", (run_id,)) == "completed", run_id
    took = time.monotonic() - started
    naps = q(conn, "SELECT (payload -> 'result' -> 'nap_result' ->> 'napped')::float8 FROM tuvl.events "
                   "WHERE run_id = ANY (%s) AND type = 'tool_result' AND payload ? 'call_id'", (ids,))
    report(f"40 agents of two 300 ms turns, one tool call of 200 ms among them: all done in {took:.2f} s")
    assert sorted(n for n, in naps) == [0] * 39 + [0.2], naps
    # two turns and the nap: about 1 s; one round trip after another: 12 s and more
    assert took < 4.0, took


@not_under_asan
def test_a_worker_left_fragmented_by_thousands_of_agents_starts_afresh(conn, agdb, server_log):
    # thousands of agents held at once leave a worker's heap in pieces: as
    # many free chunks, which every later allocation of a block walks.  Idle
    # again, the worker exits and the launcher starts a fresh one; nothing
    # is lost, and the new workers execute runs
    name = make_agent(conn, "openai", [calls(call("nap"), latency_ms=1000), final("rested", latency_ms=1000)],
                      ["nap"])
    mark = server_log.mark()
    w = connect(agdb, autocommit=False)
    try:
        ids = [r[0] for r in q(w, "SELECT tuvl.start_run(%s, '{\"nap\": 0}') FROM generate_series(1, 4000)",
                               (name,))]
        w.commit()
    finally:
        w.close()
    started = time.monotonic()
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) AND finished_at IS NULL",
                          (ids,)) == 0, 120, interval=0.2, message="4,000 agents to finish")
    took = time.monotonic() - started
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) AND status = 'completed'",
              (ids,)) == 4000
    server_log.wait_for(mark, r"exits to start afresh: its heap is fragmented", 10)
    log = server_log.since(mark)
    exited = {int(p) for p in re.findall(r"\[(\d+)\] LOG:  tuvl worker \d+ exits to start afresh", log)}
    chunks = re.findall(r"DETAIL:  (\d+) free chunks", log)
    wait_until(lambda: len(worker_pids(agdb)) == 2 and not exited & set(worker_pids(agdb)), 10,
               message="fresh workers in place of the fragmented ones")
    report(f"4,000 agents held at once, done in {took:.1f} s; {len(exited)} worker(s) started afresh "
           f"({', '.join(chunks)} free chunks)")
    again = [start(conn, name, {"nap": 0}) for _ in range(20)]
    for run_id in again:
        assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed", run_id


def test_budget_exceeded_after_a_turn_makes_no_further_request(conn, provider, mode):
    tag = new_name("t")
    name = make_agent(conn, provider, [
        calls(call("record", tag=tag), usage={"prompt_tokens": 80, "completion_tokens": 30}),
        final("never")], ["record"], agent="      token_budget: 100\n",
        routes="{ default: done, error: oops, budget_exceeded: over }",
        ends='  - { id: over, status: completed, response: { error: "{{ _last_error }}", '
             'type: "{{ _last_error_type }}" } }\n')
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "over"), res
    message = "the agent used 110 tokens, reaching its token_budget of 100"
    assert res["response"] == {"error": message, "type": "budget_exceeded"}
    assert len(sent(name)) == 1, "the final-answer turn is bounded by the budget too"
    assert calls_rows(conn, tag) == [("record", tag)], "the tool of the first turn ran"
    assert completed_event(conn, res["run_id"]) == {"signal": "budget_exceeded", "error": message}
    assert [e[3] for e in events(conn, res["run_id"], "signal")] == [{"signal": "budget_exceeded"}]
    assert_clean(conn, res)


def test_budget_exceeded_without_a_route_fails_the_run(conn, provider):
    name = make_agent(conn, provider, [calls(call("record", tag="x"),
                                             usage={"prompt_tokens": 100, "completion_tokens": 0}),
                                       final("never")],
                      ["record"], agent="      token_budget: 100\n")
    res = execute(conn, name, {"topic": "x"}, "worker")
    assert res["status"] == "failed" and res["end"] is None, res
    assert res["error"] == (
        'step "triage" ended on the reserved exit "budget_exceeded", which has no route: '
        "the agent used 100 tokens, reaching its token_budget of 100 "
        "(map budget_exceeded in the step's routes to handle it)")
    assert types_of(conn, res["run_id"])[-1] == "run_failed"
    assert len(sent(name)) == 1


def test_max_iterations_routed_to_a_fallback_step(conn, provider, mode):
    tag = new_name("t")
    # the last turn repeats: the model never stops calling tools
    name = make_agent(conn, provider, [calls(call("note_on", tag=tag))],
                      [("note_on", "{ ref: note_on, writes_context: true }")],
                      agent="      max_iterations: 2\n",
                      routes="{ default: done, error: oops, max_iterations: fallback }",
                      steps="  - id: fallback\n    kind: Functional\n    function: ag.fallback\n"
                            "    routes: { default: gave_up }\n",
                      ends='  - { id: gave_up, status: completed, response: "{{ fallback_result }}" }\n')
    res = execute(conn, name, {"topic": "x"}, mode)
    message = "the agent reached max_iterations (2) without a final answer"
    assert (res["status"], res["end"]) == ("completed", "gave_up"), res
    assert res["response"] == {"type": "max_iterations", "error": message}
    assert res["context"]["_last_error_type"] == "max_iterations"
    assert res["context"]["_last_error"] == message
    # writes_context applies on every exit
    assert res["context"]["note_on_result"] == {"note": tag}
    reqs = sent(name)
    assert [r["turn"] for r in reqs] == [0, 1]
    assert len(tool_answers(provider, reqs[1]["body"])) == 1
    assert [p["iteration"] for t, p in agent_tool_events(conn, res["run_id"])] == [1, 1, 2, 2]
    assert completed_event(conn, res["run_id"]) == {"signal": "max_iterations", "error": message}
    assert_clean(conn, res)


def test_a_200_turn_agent_through_tuvl_run_keeps_its_memory_flat(conn):
    """tuvl.run() gives every transition a memory context of its own: a
    200-turn agent in one call holds what its step_state needs, not what
    every turn allocated.  Its tool reports the backend's memory contexts
    (pg_backend_memory_contexts) each turn, from inside the same backend."""
    name = make_agent(conn, "openai", [calls(call("mem"))], ["mem"],
                      agent="      max_iterations: 200\n",
                      routes="{ default: done, error: oops, max_iterations: gave_up }",
                      ends="  - { id: gave_up, status: completed }\n")
    res = execute(conn, name, {"topic": "x"}, "sync", timeout=120)
    assert res["status"] == "completed", res
    assert len(sent(name)) == 200
    used = [json.loads(p["result"]) if isinstance(p["result"], str) else p["result"]
            for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
    assert len(used) == 200, used[:3]
    used = [u["mem_result"]["bytes"] for u in used]
    early, late = max(used[20:40]), max(used[180:200])
    report(f"200-turn agent through tuvl.run(): memory contexts {used[0] / 1e6:.1f} MB at turn 1, "
           f"{early / 1e6:.1f} MB at turns 21-40, {late / 1e6:.1f} MB at turns 181-200")
    # each transition rebuilds the conversation from the records, so the last
    # turns need a little more (measured: 4 MB at turn 30, 14 MB at turn 200);
    # keeping every transition's memory until tuvl.run() returned took 1.7 GB
    assert late - early < 32 * 1024 * 1024, (early, late)
    assert_clean(conn, res)


def test_a_50_turn_agent_journals_each_request_as_what_is_new(conn, provider):
    """Each model request carries the whole conversation, but the journal
    keeps only the first whole: every later llm_turn holds what changed
    (request_delta), so its size stays flat over 50 turns, and
    tuvl.llm_request() and tuvl.pin_run() rebuild every request exactly as
    the server received it."""
    tag = new_name("t")
    name = make_agent(conn, provider, [calls(call("record", tag=tag))], ["record", "insert"],
                      agent="      max_iterations: 50\n",
                      routes="{ default: done, error: oops, max_iterations: gave_up }",
                      ends="  - { id: gave_up, status: completed }\n")
    res = execute(conn, name, {"topic": "x"}, "worker", timeout=120)
    assert res["status"] == "completed", res
    reqs = sent(name)
    assert len(reqs) == 50
    turns = q(conn, "SELECT seq, payload, length(payload::text), tuvl.llm_request(run_id, seq) "
                    "FROM tuvl.events WHERE run_id = %s AND type = 'llm_turn' ORDER BY seq",
              (res["run_id"],))
    assert len(turns) == 50
    assert "request" in turns[0][1] and "request_delta" not in turns[0][1]
    assert all("request" not in p and "request_delta" in p for _, p, _, _ in turns[1:])
    # the tools and settings are sent every turn and journaled once
    assert all(set(p["request_delta"]) == {"append"} for _, p, _, _ in turns[1:]), turns[1][1]
    for (seq, _, _, rebuilt), r in zip(turns, reqs):
        assert rebuilt == r["body"], f"llm_turn {seq} rebuilt differs from what the server received"
    sizes = [n for _, _, n, _ in turns]
    report(f"50-turn {provider} agent: llm_turn payloads {sizes[0]} bytes (turn 1), "
           f"{sizes[1]}..{max(sizes[1:])} bytes (turns 2-50); the last request is "
           f"{len(json.dumps(reqs[-1]['body']))} bytes")
    # flat: a late turn costs what an early one did (the tool's result ids grow by a digit)
    assert max(sizes[40:]) < 1.2 * min(sizes[1:10]), sizes
    whole = sum(len(json.dumps(r["body"])) for r in reqs)
    assert sum(sizes) < whole / 4, ("journaled", sum(sizes), "requests whole", whole)
    fixture = q1(conn, "SELECT tuvl.pin_run(%s)", (res["run_id"],))
    pinned = [e["request"] for e in fixture["effects"] if e["type"] == "llm"]
    assert pinned == [r["body"] for r in reqs]
    # not an llm_turn, or no such event: NULL
    assert q1(conn, "SELECT tuvl.llm_request(%s, 1)", (res["run_id"],)) is None
    assert q1(conn, "SELECT tuvl.llm_request(%s, 100000)", (res["run_id"],)) is None
    # another role reads the journal through its own visibility: nothing
    q(conn, "DO $$ BEGIN CREATE ROLE ag_outsider IN ROLE tuvl_user; "
            "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    last = turns[-1][0]
    try:
        q(conn, "SET ROLE ag_outsider")
        assert q1(conn, "SELECT tuvl.llm_request(%s, %s)", (res["run_id"], last)) is None
    finally:
        q(conn, "RESET ROLE")


def test_max_iterations_without_a_route_fails_the_run(conn, provider, mode):
    name = make_agent(conn, provider, [calls(call("record", tag="x"))], ["record"],
                      agent="      max_iterations: 1\n")
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["status"] == "failed" and res["end"] is None, res
    assert res["error"] == (
        'step "triage" ended on the reserved exit "max_iterations", which has no route: '
        "the agent reached max_iterations (1) without a final answer "
        "(map max_iterations in the step's routes to handle it)")
    assert len(sent(name)) == 1
    assert types_of(conn, res["run_id"])[-3:] == ["signal", "checkpoint", "run_failed"]
    assert res["context"]["_last_error_type"] == "max_iterations"


@pytest.mark.parametrize("fault, kind", [("500", "llm_error"), ("timeout", "timeout")])
def test_a_model_that_fails_takes_the_error_exit_after_the_retries(conn, provider, fault, kind):
    tag = new_name("t")
    failing = {"latency_ms": 3000} if fault == "timeout" else {"fault": "500", "message": "overloaded"}
    name = make_agent(conn, provider, [calls(call("record", tag=tag)), dict(failing, text="never")],
                      ["record"], timeout="1s",
                      agent="      retry: { on: [timeout, error], attempts: 2, backoff: 100ms }\n")
    res = execute(conn, name, {"topic": "x"}, "worker")
    error, kind_ = error_of(res)
    assert kind_ == kind, error
    assert error.endswith("(gave up after 2 attempts)"), error
    if fault == "500":
        assert error.startswith("the model answered HTTP 500: overloaded"), error
    assert [r["turn"] for r in sent(name)] == [0, 1, 1], "the second turn was tried twice"
    assert calls_rows(conn, tag) == [("record", tag)]
    assert len(events(conn, res["run_id"], "llm_turn")) == 3
    assert completed_event(conn, res["run_id"])["signal"] == "error"


def test_max_iterations_defaults_to_8(conn):
    name = make_agent(conn, "openai", [calls(call("note_off", tag="loop"))], ["note_off"],
                      routes="{ default: done, error: oops, max_iterations: oops }")
    res = execute(conn, name, {"topic": "x"}, "worker")
    assert error_of(res) == ("the agent reached max_iterations (8) without a final answer",
                             "max_iterations")
    assert [r["turn"] for r in sent(name)] == list(range(8))


def test_a_final_answer_on_the_last_iteration_is_accepted(conn, provider):
    name = make_agent(conn, provider, [calls(call("note_off", tag="x")), final("just in time")],
                      ["note_off"], agent="      max_iterations: 2\n")
    res = execute(conn, name, {"topic": "x"})
    assert (res["end"], res["response"]) == ("done", "just in time"), res
