"""Guardrails of the Agent (guardrail.c, agent_outcome.c): the input, tools
and output gates, pii_mask, and llm_judge checks.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403


# ---------------------------------------------------------------------------
# Guardrails (guardrail.c, agent_shared.c)

CARD = "4111111111111111"
BLOCKED = ('  - { id: blocked, status: completed, response: { error: "{{ _last_error }}", '
           'type: "{{ _last_error_type }}" } }\n')
GUARDED_ROUTES = "{ default: done, error: oops, guardrail_violation: blocked }"


def guarded_agent(conn, turns, tools, gates, provider="openai", agent="", **wf):
    """An agent whose gates ({gate: [guardrail names]}) are attached, routed to blocked."""
    lines = "".join(f"        {g}: [{', '.join(f'artifact://{n}@1' for n in names)}]\n"
                    for g, names in gates.items())
    return make_agent(conn, provider, turns, tools,
                      agent="      guardrails:\n" + lines + agent, routes=GUARDED_ROUTES,
                      ends=BLOCKED, **wf)


def test_a_tool_result_a_guardrail_denies_never_reaches_the_model_or_the_journal(conn, mode):
    guard = guardrail(conn, "{ check: regex_deny, pattern: '\\y[0-9]{16}\\y' }")
    name = guarded_agent(conn, [calls(call("card")), final("never")], ["card"],
                         {"tools": [guard]})
    res = execute(conn, name, {"topic": "billing"}, mode)
    assert (res["status"], res["end"]) == ("completed", "blocked"), res
    error, kind = res["response"]["error"], res["response"]["type"]
    assert kind == "guardrail_violation"
    assert error == (f'guardrail "{guard}" (version 1) stopped the tool\'s result at the tools '
                     "gate: check 1 (regex_deny): the content matches \\y[0-9]{16}\\y"), error
    # the model was asked once and never saw the number
    reqs = sent(name)
    assert len(reqs) == 1
    assert CARD not in json.dumps(reqs[0]["body"])
    # the journal records the stop, not the result
    assert events_mentioning(conn, res["run_id"], CARD) == 0
    (result,) = [p for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
    assert (result["tool"], result["signal"], result["error"]) == ("card", "error", error)
    assert "result" not in result
    assert completed_event(conn, res["run_id"]) == {"signal": "guardrail_violation", "error": error}
    assert "triage_result" not in res["context"]
    assert_clean(conn, res)
    # a replay stops at the same check, from the recording alone
    replayed = q1(conn, "SELECT tuvl.replay(tuvl.pin_run(%s))", (res["run_id"],))
    assert (replayed["status"], replayed["end"]) == ("completed", "blocked"), replayed
    assert replayed["response"]["error"] == error
    assert len(sent(name)) == 1, "the replay sent nothing"


def test_the_input_gate_stops_the_agent_before_anything_is_sent(conn, mode):
    guard = guardrail(conn, "{ check: regex_deny, pattern: '[0-9]{16}' }")
    name = guarded_agent(conn, [final("never")], ["record"], {"input": [guard]})
    res = execute(conn, name, {"topic": f"refund card {CARD}"}, mode)
    assert res["end"] == "blocked", res
    assert res["response"]["type"] == "guardrail_violation"
    assert "stopped the model's input at the input gate: check 1 (regex_deny)" in \
        res["response"]["error"]
    assert sent(name) == [], "nothing was sent to the model"
    assert types_of(conn, res["run_id"]).count("llm_turn") == 0


@pytest.mark.parametrize("check,answer,why", [
    ("{ check: regex_deny, pattern: 'password' }", "Your password is hunter2.",
     "check 1 (regex_deny): the content matches password"),
    ("{ check: regex_allow, pattern: '^[A-Za-z .,]*$' }", "Call <script>alert(1)</script>.",
     "check 1 (regex_allow): the content does not match ^[A-Za-z .,]*$"),
    ("{ check: max_length, max: 10 }", "This answer is far too long.",
     "check 1 (max_length): the content has 28 characters, more than 10"),
    ("{ check: json_schema, schema: { type: object, required: [reply] } }", '{"answer": 1}',
     'check 1 (json_schema): the content does not match the schema: $: missing required '
     'property "reply"'),
    ("{ check: json_schema, schema: { type: object } }", "plain words",
     "check 1 (json_schema): the content is not JSON"),
    ("{ check: json_schema, schema: { type: object, properties: { reply: { type: string, "
     "pattern: '^[^0-9]*$' } } } }", '{"reply": "call 555"}',
     'check 1 (json_schema): the content does not match the schema: $.reply: string "call 555" '
     'does not match pattern "^[^0-9]*$"'),
])
def test_each_check_stops_a_final_answer_at_the_output_gate(conn, check, answer, why):
    guard = guardrail(conn, check)
    name = guarded_agent(conn, [final(answer)], ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "blocked", res
    assert res["response"] == {
        "type": "guardrail_violation",
        "error": f'guardrail "{guard}" (version 1) stopped the final answer at the output gate: {why}'}
    assert "triage_result" not in res["context"], "nothing is written"
    assert len(sent(name)) == 1


def test_a_stopped_result_of_a_tool_that_writes_the_context_writes_nothing(conn):
    guard = guardrail(conn, "{ check: regex_deny, pattern: 'secret' }")
    name = guarded_agent(conn, [calls(call("note_on", tag="the secret")), final("never")],
                         [("note_on", "{ ref: note_on, writes_context: true }")], {"tools": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "blocked", res
    assert "note_on_result" not in res["context"]
    # the model's own words (its llm_turn and tool_call) name it; the stopped result does not
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND type = 'tool_result' "
                    "AND payload::text LIKE '%%the secret%%'", (res["run_id"],)) == 0
    (result,) = [p for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
    assert "wrote_context" not in result and "result" not in result


def test_content_that_passes_every_check_of_every_gate_goes_through(conn, mode):
    strict = guardrail(conn, "{ check: regex_deny, pattern: '\\y[0-9]{16}\\y' }",
                       "{ check: max_length, max: 4000 }")
    shape = guardrail(conn, "{ check: json_schema, schema: { type: object, required: [reply] } }")
    name = guarded_agent(conn, [calls(call("record", tag="t1")), final('{"reply": "Done."}')],
                         ["record"], {"input": [strict], "tools": [strict],
                                      "output": [strict, shape]})
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "done"), res
    assert res["context"]["triage_result"] == {"reply": "Done."}
    assert len(sent(name)) == 2


def test_the_second_check_of_a_guardrail_is_named_when_it_fails(conn):
    guard = guardrail(conn, "{ check: max_length, max: 100 }", "{ check: regex_deny, pattern: 'x' }")
    name = guarded_agent(conn, [final("xyz")], ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "t"})
    assert "check 2 (regex_deny)" in res["response"]["error"], res


def test_a_violation_without_a_route_fails_the_run(conn):
    guard = guardrail(conn, "{ check: regex_deny, pattern: 'x' }")
    name = make_agent(conn, "openai", [final("xyz")], ["record"],
                      agent=f"      guardrails: {{ output: [artifact://{guard}@1] }}\n")
    res = execute(conn, name, {"topic": "t"})
    assert res["status"] == "failed", res
    assert res["error"].startswith('step "triage" ended on the reserved exit "guardrail_violation", '
                                   f'which has no route: guardrail "{guard}"'), res["error"]


# pii_mask: a transform that never fails


def request_text(name):
    return json.dumps([r["body"] for r in sent(name)])


def test_pii_mask_on_the_tools_gate_masks_what_the_model_and_the_journal_see(conn, mode):
    guard = guardrail(conn, "{ check: pii_mask, fields: [customer], patterns: [card] }")
    name = guarded_agent(conn, [calls(call("card")), final("Done.")], ["card"], {"tools": [guard]})
    res = execute(conn, name, {"topic": "billing"}, mode)
    assert (res["status"], res["end"]) == ("completed", "done"), res
    reqs = request_text(name)
    assert CARD not in reqs and "Ada" not in reqs
    assert '[card]' in reqs and '[masked]' in reqs
    assert events_mentioning(conn, res["run_id"], CARD) == 0
    (result,) = [p for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
    assert result["result"] == {"card_result": {"customer": "[masked]", "card": "[card]"}}


def test_pii_mask_leaves_values_it_does_not_mask_as_they_are(conn):
    guard = guardrail(conn, "{ check: pii_mask, patterns: [card] }")
    name = guarded_agent(conn, [final('{"id": 1, "amount": 42.5, "ok": true, "card": 4111111111111111}')],
                         ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert res["context"]["triage_result"] == {"id": 1, "amount": 42.5, "ok": True, "card": "[card]"}


def test_pii_mask_on_the_input_gate_masks_the_user_message(conn):
    guard = guardrail(conn, "{ check: pii_mask, patterns: [email, phone] }")
    name = guarded_agent(conn, [final("Done.")], ["record"], {"input": [guard]})
    res = execute(conn, name, {"topic": "mail ada@example.com or call +44 20 7946 0958"})
    assert res["end"] == "done", res
    reqs = request_text(name)
    assert "ada@example.com" not in reqs and "7946" not in reqs
    assert "mail [email] or call [phone]" in reqs


def test_pii_mask_on_the_output_gate_masks_what_is_written_and_journaled(conn, mode):
    guard = guardrail(conn, "{ check: pii_mask, patterns: [email, card, iban, phone] }",
                      "{ check: regex_deny, pattern: '[0-9]{12}' }")
    answer = ("Write to ada@example.com; card 4111 1111 1111 1111; IBAN GB82 WEST 1234 5698 7654 32; "
              "call (555) 123-4567. Order 1234567812345678 stays.")
    name = guarded_agent(conn, [final(answer)], ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"}, mode)
    # masked first, so the deny check after it sees no long number but the order
    assert res["end"] == "blocked", res
    assert "check 2 (regex_deny)" in res["response"]["error"]
    name = guarded_agent(conn, [final(answer.replace(" Order 1234567812345678 stays.", ""))],
                         ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["end"] == "done", res
    assert res["context"]["triage_result"] == (
        "Write to [email]; card [card]; IBAN [iban]; call [phone].")
    for secret in ("ada@example.com", "4111 1111", "GB82", "123-4567"):
        assert events_mentioning(conn, res["run_id"], secret) == 0, secret


def test_pii_mask_leaves_numbers_that_fail_the_luhn_check(conn):
    guard = guardrail(conn, "{ check: pii_mask, patterns: [card] }")
    name = guarded_agent(conn, [final("Order 1234567812345678, card 4111111111111111.")],
                         ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert res["context"]["triage_result"] == "Order 1234567812345678, card [card]."


# llm_judge: a model asked for a verdict, as a durable effect (judge.c)


def judge(conn, verdict=None, reason="judged", fault=None, on_error=None, text=None, usage=None):
    """A judge model (script and config) and a guardrail with one llm_judge check; its name."""
    model = new_name("judge")
    turn = {"text": text if text is not None else json.dumps({"verdict": verdict, "reason": reason})}
    if fault:
        turn["fault"] = fault
    if usage:
        turn["usage"] = usage
    script(model, [turn])
    register_llm(conn, model, "openai", timeout="5s")
    extra = f", on_judge_error: {on_error}" if on_error else ""
    return guardrail(conn, f"{{ check: llm_judge, model: {model}, prompt: 'Is it polite?'{extra} }}"), model


def verdicts(conn, run_id):
    return [e[3] for e in events(conn, run_id, "judge_verdict")]


def judged_content(model):
    """The content inside the block of each request the judge model got."""
    out = []
    for r in sent(model):
        user = r["body"]["messages"][-1]["content"]
        out.append(user.split("<content-to-judge>\n", 1)[1].rsplit("\n</content-to-judge>", 1)[0])
    return out


def test_a_judge_that_says_violation_stops_the_final_answer(conn, mode):
    guard, model = judge(conn, "violation", "it insults the customer")
    name = guarded_agent(conn, [final("You fool.")], ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "blocked"), res
    assert res["response"] == {
        "type": "guardrail_violation",
        "error": f'guardrail "{guard}" (version 1) stopped the final answer at the output gate: '
                 "check 1 (llm_judge): the judge's verdict is violation: it insults the customer"}
    assert "triage_result" not in res["context"]
    assert judged_content(model) == ["You fool."]
    (v,) = verdicts(conn, res["run_id"])
    assert v == {"source": "guardrail", "rule": "llm_judge", "guardrail": guard, "version": 1,
                 "check": 1, "gate": "output", "verdict": "violation", "action": "violation",
                 "reason": "it insults the customer"}
    # the judge's call is an llm_turn like the agent's, with its tokens
    turns = [(e[3].get("judge"), e[3]["model"]) for e in events(conn, res["run_id"], "llm_turn")]
    assert turns == [(None, name), ("output.0:%s:1" % guard, model)], turns
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND type = 'llm_turn' "
                    "AND tokens > 0", (res["run_id"],)) == 2
    assert_clean(conn, res)


def test_judges_that_pass_let_content_through_every_gate_once_each(conn, mode):
    guard, model = judge(conn, "pass")
    tag = new_name("judged")
    name = guarded_agent(conn, [calls(call("record", tag=tag)), final("Done.")], ["record"],
                         {"input": [guard], "tools": [guard], "output": [guard]})
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "done"), res
    assert res["context"]["triage_result"] == "Done."
    # one call per content judged: the input, the tool's result, the answer
    contents = judged_content(model)
    assert len(contents) == 3, contents
    assert contents[0] == '{"topic": "x"}' and tag in contents[1] and contents[2] == "Done."
    assert [v["gate"] for v in verdicts(conn, res["run_id"])] == ["input", "tools", "output"]
    assert {v["action"] for v in verdicts(conn, res["run_id"])} == {"pass"}
    # the SQL tool ran once although the step waited for a verdict after it
    assert calls_rows(conn, tag) == [("record", tag)]
    assert len(sent(name)) == 2
    assert_clean(conn, res)


def test_a_judge_stopping_a_tool_result_ends_the_agent_before_the_model_sees_it(conn):
    guard, model = judge(conn, "violation", "internal data")
    tag = new_name("stopped")
    name = guarded_agent(conn, [calls(call("record", tag=tag)), final("never")], ["record"],
                         {"tools": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "blocked", res
    assert "stopped the tool's result at the tools gate: check 1 (llm_judge)" in res["response"]["error"]
    assert len(sent(name)) == 1, "the model never got the result"
    assert calls_rows(conn, tag) == [("record", tag)]


def test_a_judge_never_sees_what_a_mask_before_it_hid(conn):
    mask = guardrail(conn, "{ check: pii_mask, fields: [customer], patterns: [card] }")
    guard, model = judge(conn, "pass")
    name = guarded_agent(conn, [calls(call("card")), final("Done.")], ["card"],
                         {"tools": [guard, mask]})
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done", res
    (content,) = judged_content(model)
    assert CARD not in content and "Ada" not in content and "[card]" in content


@pytest.mark.parametrize("fault,text", [("500", None), (None, "I think it is fine."),
                                        (None, '{"verdict": "maybe"}')])
def test_a_judge_that_cannot_answer_lets_content_through_by_default(conn, fault, text):
    guard, model = judge(conn, fault=fault, text=text)
    name = guarded_agent(conn, [final("Fine.")], ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert (res["end"], res["context"]["triage_result"]) == ("done", "Fine."), res
    (v,) = verdicts(conn, res["run_id"])
    assert (v["verdict"], v["action"]) == ("error", "pass"), v
    assert v["reason"].startswith("the judge model did not answer" if fault
                                  else "the judge model's answer is not"), v
    assert len(sent(model)) == 1, "a judge's call is not retried"


def test_a_judge_outage_stops_content_with_on_judge_error_violation(conn, mode):
    guard, model = judge(conn, fault="503", on_error="violation")
    name = guarded_agent(conn, [final("Fine.")], ["record"], {"input": [guard]})
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["end"] == "blocked", res
    error = res["response"]["error"]
    assert "stopped the model's input at the input gate: check 1 (llm_judge): the judge model did not " \
        "answer" in error and error.endswith(", and on_judge_error is violation"), error
    assert sent(name) == [], "the agent's model was never asked"
    (v,) = verdicts(conn, res["run_id"])
    assert (v["verdict"], v["action"]) == ("error", "violation")


def test_judges_guard_a_completion_agent_input_and_output(conn):
    guard, model = judge(conn, "pass")
    name = new_name("cj")
    script(name, [final("Sure.")])
    register_llm(conn, name, "openai")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - id: helper\n    kind: Agent\n    mode: completion\n"
        f"    agent:\n      model: {name}\n      prompt: 'Help with {{{{ topic }}}}.'\n"
        f"      guardrails: {{ input: [artifact://{guard}@1], output: [artifact://{guard}@1] }}\n"
        "    routes: { default: done }\n"
        "ends:\n  - { id: done, status: completed, response: '{{ helper_result }}' }\n"
        "  - { id: stopped, status: completed, response: '{{ _last_error_type }}' }\n",))
    res = execute(conn, name, {"topic": "tea"})
    assert (res["status"], res["response"]) == ("completed", "Sure."), res
    assert judged_content(model) == ["Help with tea.", "Sure."]
    assert [v["gate"] for v in verdicts(conn, res["run_id"])] == ["input", "output"]
    # the judge stops a completion agent as well
    bad, _ = judge(conn, "violation", "no")
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        q1(conn, "SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1",
           (name,)).replace(f"output: [artifact://{guard}@1]", f"output: [artifact://{bad}@1]")
        .replace("routes: { default: done }", "routes: { default: done, guardrail_violation: stopped }"),))
    res = execute(conn, name, {"topic": "tea"})
    assert (res["end"], res["response"]) == ("stopped", "guardrail_violation"), res
    assert "helper_result" not in res["context"]


def test_judge_tokens_count_against_the_agent_budget(conn):
    guard, model = judge(conn, "pass", usage={"prompt_tokens": 900, "completion_tokens": 100})
    name = guarded_agent(conn, [final("never")], ["record"], {"input": [guard]},
                         agent="      token_budget: 500\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["status"] == "failed" and '"budget_exceeded"' in res["error"], res
    assert "the agent used 1000 tokens, reaching its token_budget of 500" in res["error"], res
    assert sent(name) == [], "the judge used the budget up before the first turn"


def test_a_replay_serves_the_judge_from_the_recording(conn):
    guard, model = judge(conn, "violation", "rude")
    name = guarded_agent(conn, [final("You fool.")], ["record"], {"output": [guard]})
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "blocked", res
    replayed = q1(conn, "SELECT tuvl.replay(tuvl.pin_run(%s))", (res["run_id"],))
    assert (replayed["status"], replayed["end"]) == ("completed", "blocked"), replayed
    assert replayed["response"] == res["response"]
    assert len(sent(model)) == 1 and len(sent(name)) == 1, "the replay sent nothing"


def test_a_judge_model_that_is_not_registered_is_refused(conn):
    """A guardrail names its judge model when it is registered: a name not
    registered yet could be registered by another role, which would then
    receive every answer the gate judges (test_hostile_roles.py)."""
    with pytest.raises(psycopg2.errors.UndefinedObject) as e:
        guardrail(conn, "{ check: llm_judge, model: no_such_judge, prompt: Fine? }")
    assert 'check 1 names model config "no_such_judge", which does not exist' in str(e.value)


@pytest.mark.parametrize("check,message", [
    ("{ check: llm_judge, model: j }", "check llm_judge needs prompt"),
    ("{ check: llm_judge, prompt: x, temperature: 0 }", 'unknown key "temperature" of check llm_judge'),
    ("{ check: llm_judge, prompt: x, on_judge_error: ignore }",
     'on_judge_error must be pass or violation, not "ignore"'),
    ("{ check: llm_judge, prompt: [x] }", "prompt of check llm_judge must be a string"),
    ("{ check: llm_judge, prompt: 'artifact://p' }",
     "prompt artifact://p of check llm_judge must name a version"),
])
def test_a_malformed_llm_judge_check_is_refused_at_registration(conn, check, message):
    with pytest.raises(psycopg2.Error) as e:
        guardrail(conn, check)
    assert message in str(e.value), str(e.value)
