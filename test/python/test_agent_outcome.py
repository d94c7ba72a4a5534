"""The Agent's final answer: the outcome contract (enum, fenced JSON,
malformed answers) and the routing of the reserved exits.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403


# ---------------------------------------------------------------------------
# The final answer and outcome.enum


def enum_agent(conn, provider, text, routes=ENUM_ROUTES):
    return make_agent(conn, provider, [calls(call("record", tag="enum")), final(text)], ["record"],
                      agent=ENUM, routes=routes, ends=ENUM_ENDS)


def test_a_fenced_json_answer_routes_by_its_outcome(conn, provider, mode):
    name = enum_agent(conn, provider, '```json\n{"outcome": "escalate", "result": {"why": "vip"}}\n```')
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "escalated"), res
    assert res["response"] == {"escalated": {"why": "vip"}}
    assert res["context"]["decision"] == {"why": "vip"} and "triage_result" not in res["context"]
    assert completed_event(conn, res["run_id"]) == {
        "signal": "escalate", "output_key": "decision", "output": {"why": "vip"}}
    system = conversation(provider, sent(name)[0]["body"])[0]["content"]
    assert system.endswith(
        INSTRUCTION + '\n\nAnswer with a single JSON object and nothing else: '
        '{"outcome": <one of "resolved", "escalate">, "result": <your answer>}. '
        "Do not wrap it in markdown code fences."), system
    assert_clean(conn, res)


@pytest.mark.parametrize("text, written", [
    ('{"result": {"a": 1}, "note": "x"}', {"a": 1}),
    ('```\n[1, 2]\n```', [1, 2]),
    ("Plain words.", "Plain words."),
    ('{"outcome": "whatever"}', {"outcome": "whatever"}),
])
def test_without_an_enum_the_final_answer_is_written_on_the_default_exit(conn, provider, text, written):
    name = make_agent(conn, provider, [final(text)], ["record"])
    res = execute(conn, name, {"topic": "x"})
    assert (res["status"], res["end"]) == ("completed", "done"), res
    assert res["context"]["triage_result"] == written
    assert completed_event(conn, res["run_id"]) == {
        "signal": "default", "output_key": "triage_result", "output": written}


@pytest.mark.parametrize("text, message", [
    ('{"outcome": "maybe", "result": 1}',
     'the model answered outcome "maybe", which is not in outcome.enum'),
    ("I would escalate it.",
     'the model\'s final answer is not a JSON object {"outcome", "result"}: I would escalate it.'),
    ('{"outcome": "resolved", "result": ',
     'the model\'s final answer is not a JSON object {"outcome", "result"}: {"outcome": "resolved", "result":'),
    ('{"result": "resolved"}',
     'the model\'s final answer has no "outcome" string: {"result": "resolved"}'),
])
def test_an_invalid_final_answer_takes_the_error_exit(conn, provider, text, message):
    name = enum_agent(conn, provider, text)
    res = execute(conn, name, {"topic": "x"}, "worker")
    error, kind = error_of(res)
    assert (error, kind) == (message, "invalid_outcome")
    assert "decision" not in res["context"]
    assert len(sent(name)) == 2, "an invalid final answer is not asked again"
    assert completed_event(conn, res["run_id"]) == {"signal": "error", "error": message}


def test_an_unmapped_error_exit_fails_the_run_with_a_warning(conn, provider, mode):
    name = enum_agent(conn, provider, '{"outcome": "maybe"}',
                      routes="{ resolved: solved, escalate: escalated }")
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["status"] == "failed" and res["end"] is None, res
    assert res["error"] == ('warning: step "triage" ended on its "error" exit, which has no route: '
                            'the model answered outcome "maybe", which is not in outcome.enum')
    assert types_of(conn, res["run_id"])[-1] == "run_failed"
    assert res["context"]["_last_error_type"] == "invalid_outcome"
