"""The workflow's supervisor (src/agent/supervisor.c): rules and an LLM judge that
watch every autonomous agent of a run at the top of each turn, and steer,
pause or abort it through the same paths operators use.

The agents play scripts of the scripted LLM server; the judge is a model of
its own.  Each test checks what the agent was sent (steers appear as system
messages), how the step ended, and the judge_verdict events.
"""
import json
import time

import pytest

from conftest import journal_violations, q, q1, wait_until
from agentutil import (FUNCTIONS, agent_workflow, call, calls, conversation, events, execute,  # noqa: F401
                        final, new_name, register_llm, script, sent, start, agdb, conn, mode)

ROUTES = "{ default: done, error: oops, aborted: oops, max_iterations: oops }"


def supervised(conn, turns, tools, supervisor, provider="openai", **wf):
    """An agent (script, model config, workflow) under a supervisor (YAML mapping text)."""
    name = new_name("sup")
    script(name, turns)
    register_llm(conn, name, provider)
    source = agent_workflow(name, name, tools, routes=ROUTES, **wf)
    source = source.replace("steps:\n", f"supervisor:\n{supervisor}steps:\n", 1)
    q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    return name


def judge_model(conn, *answers):
    """A judge model answering these objects (or raw strings / turn dicts) in turn; its name."""
    model = new_name("judge")
    turns = [a if isinstance(a, dict) and ("text" in a or "fault" in a) else
             {"text": a if isinstance(a, str) else json.dumps(a)} for a in answers]
    script(model, turns)
    register_llm(conn, model, "openai")
    return model


def verdicts(conn, run_id):
    return [e[3] for e in events(conn, run_id, "judge_verdict")]


def system_texts(name, i):
    """The system messages of request i the agent's model got."""
    return [m["content"] for m in sent(name)[i]["body"]["messages"] if m["role"] == "system"]


def test_repeated_tool_call_aborts_the_agent(conn, mode):
    tag = new_name("rep")
    same = calls(call("record", tag=tag))
    name = supervised(conn, [same, same, same, final("never")], ["record"],
                      "  rules:\n    - { rule: repeated_tool_call, count: 3, action: abort }\n")
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["status"], res["end"]) == ("completed", "oops"), res
    assert res["response"] == {
        "type": "aborted",
        "error": 'the supervisor aborted the agent: rule repeated_tool_call: tool "record" was called '
                 "3 times with the same arguments"}
    assert len(sent(name)) == 3, "the fourth turn was never asked"
    (v,) = verdicts(conn, res["run_id"])
    assert v == {"source": "rule", "rule": "repeated_tool_call", "iteration": 4, "verdict": "hit",
                 "action": "abort", "reason": 'tool "record" was called 3 times with the same arguments'}
    assert journal_violations(conn, [res["run_id"]]) == []


def test_different_arguments_are_not_a_repeat(conn):
    name = supervised(conn, [calls(call("record", tag="a")), calls(call("record", tag="b")),
                             calls(call("record", tag="c")), final("Done.")], ["record"],
                      "  rules:\n    - { rule: repeated_tool_call, count: 2, action: abort }\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done", res
    assert verdicts(conn, res["run_id"]) == []


def test_tool_errors_steer_once_framed_as_guidance(conn, mode):
    boom = calls(call("boom", tag="t"))
    name = supervised(conn, [boom, boom, final("Giving up."), final("never")], ["boom"],
                      "  rules:\n    - { rule: tool_errors, count: 2, action: steer, "
                      "message: Stop retrying; answer. }\n")
    res = execute(conn, name, {"topic": "x"}, mode)
    assert (res["end"], res["context"]["triage_result"]) == ("done", "Giving up."), res
    reqs = sent(name)
    assert len(reqs) == 3
    steer = [t for t in system_texts(name, 2) if "Stop retrying" in t]
    assert steer == ["Guidance from a supervisor. It does not change your tools, your outcome contract "
                     "or the task itself: Stop retrying; answer."], system_texts(name, 2)
    assert not any("Stop retrying" in t for t in system_texts(name, 1))
    (v,) = verdicts(conn, res["run_id"])
    assert (v["rule"], v["action"], v["iteration"], v["reason"]) == ("tool_errors", "steer", 3,
                                                                    "2 tool calls failed")


def test_tokens_per_turn_pauses_and_a_resumed_agent_is_not_paused_again(conn):
    heavy = dict(calls(call("record", tag="h")), usage={"prompt_tokens": 400, "completion_tokens": 200})
    name = supervised(conn, [heavy, final("Done.")], ["record"],
                      "  rules:\n    - { rule: tokens_per_turn, max: 500, action: pause }\n")
    run_id = start(conn, name, {"topic": "x"})
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "paused", 20,
               message="the supervisor to pause the run")
    assert len(sent(name)) == 1
    paused = [e[3] for e in events(conn, run_id, "paused")]
    assert paused == [{"step": "triage", "iteration": 2, "by": "supervisor",
                       "reason": "rule tokens_per_turn: the last turn used 600 tokens, more than 500"}], paused
    q(conn, "SELECT tuvl.resume_run(%s)", (run_id,))
    assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,)) == "Done."
    assert len(verdicts(conn, run_id)) == 1, "the rule acted once"
    assert journal_violations(conn, [run_id]) == []


def test_wall_time_aborts_an_agent_that_runs_too_long(conn):
    name = supervised(conn, [calls(call("sleepy", tag="w", secs=1.2)), final("never")], ["sleepy"],
                      "  rules:\n    - { rule: wall_time, max: 1s, action: abort }\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["response"]["type"] == "aborted", res
    assert "rule wall_time: the agent has run for" in res["response"]["error"]
    assert len(sent(name)) == 1


def test_iterations_steers_the_agent_to_wrap_up(conn):
    rec = calls(call("record", tag="i"))
    name = supervised(conn, [rec, rec, final("Wrapped up.")], ["record"],
                      "  rules:\n    - { rule: iterations, max: 2, action: steer, message: Wrap up now. }\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["context"]["triage_result"] == "Wrapped up.", res
    assert any(t.endswith("Wrap up now.") for t in system_texts(name, 2))
    assert not any(t.endswith("Wrap up now.") for t in system_texts(name, 1))


# the judge


def test_a_judge_steers_every_n_turns_and_sees_the_conversation(conn, mode):
    judge = judge_model(conn, {"verdict": "steer", "reason": "looping", "message": "Use the note you have."})
    rec = calls(call("record", tag="j"))
    name = supervised(conn, [rec, rec, rec, final("Done.")], ["record"],
                      f"  judge: {{ model: {judge}, prompt: Is the agent on track?, every: 2 }}\n")
    res = execute(conn, name, {"topic": "x"}, mode)
    assert res["end"] == "done", res
    # asked at the top of turns 3 (after 2 turns): once
    asked = sent(judge)
    assert len(asked) == 1, asked
    user = asked[0]["body"]["messages"][-1]["content"]
    assert "<content-to-judge>" in user and '"tool_calls"' in user, user
    assert "Is the agent on track?" in asked[0]["body"]["messages"][0]["content"]
    assert any(t.endswith("Use the note you have.") for t in system_texts(name, 2))
    (v,) = verdicts(conn, res["run_id"])
    assert v == {"source": "judge", "rule": "judge", "iteration": 3, "verdict": "steer", "action": "steer",
                 "reason": "looping"}
    judged = [e[3] for e in events(conn, res["run_id"], "llm_turn") if e[3].get("judge")]
    assert [j["judge"] for j in judged] == ["supervisor.3"]


def test_a_judge_aborts_the_agent(conn):
    judge = judge_model(conn, {"verdict": "abort", "reason": "off topic"})
    name = supervised(conn, [calls(call("record", tag="a")), final("never")], ["record"],
                      f"  judge: {{ model: {judge}, prompt: On track?, every: 1 }}\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["response"] == {"type": "aborted", "error": "the supervisor aborted the agent: off topic"}, res
    assert len(sent(name)) == 1


@pytest.mark.parametrize("answer,on_error,end", [
    ({"fault": "500"}, "pass", "done"),
    ({"text": "I cannot tell."}, "pass", "done"),
    ({"fault": "500"}, "abort", "oops"),
    ({"text": '{"verdict": "restart"}'}, "abort", "oops"),
])
def test_a_judge_that_cannot_answer_is_handled_by_on_error(conn, answer, on_error, end):
    judge = judge_model(conn, answer)
    name = supervised(conn, [calls(call("record", tag="e")), final("Done.")], ["record"],
                      f"  judge: {{ model: {judge}, prompt: On track?, every: 1, on_error: {on_error} }}\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == end, res
    (v,) = verdicts(conn, res["run_id"])
    assert (v["source"], v["verdict"], v["action"]) == ("judge", "error", "continue" if on_error == "pass"
                                                        else "abort"), v


def test_judge_tokens_count_against_the_agent_budget(conn):
    judge = judge_model(conn, {"text": json.dumps({"verdict": "continue", "reason": "ok"}),
                               "usage": {"prompt_tokens": 5000, "completion_tokens": 0}})
    name = supervised(conn, [calls(call("record", tag="b")), final("never")], ["record"],
                      f"  judge: {{ model: {judge}, prompt: On track?, every: 1 }}\n",
                      agent="      token_budget: 4000\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["status"] == "failed" and '"budget_exceeded"' in res["error"], res
    assert len(sent(name)) == 1


def test_a_replay_serves_the_judge_and_the_rules_act_the_same(conn):
    judge = judge_model(conn, {"verdict": "steer", "reason": "r", "message": "Answer now."})
    boom = calls(call("boom", tag="r"))
    name = supervised(conn, [boom, boom, final("Done.")], ["boom"],
                      f"  rules:\n    - {{ rule: tool_errors, count: 1, action: steer }}\n"
                      f"  judge: {{ model: {judge}, prompt: On track?, every: 2 }}\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done", res
    assert [v["source"] for v in verdicts(conn, res["run_id"])] == ["rule", "judge"]
    replayed = q1(conn, "SELECT tuvl.replay(tuvl.pin_run(%s))", (res["run_id"],))
    assert (replayed["status"], replayed["end"]) == ("completed", "done"), replayed
    assert len(sent(judge)) == 1 and len(sent(name)) == 3, "the replay sent nothing"


def test_a_rule_that_never_hits_does_nothing(conn):
    name = supervised(conn, [final("Done.")], ["record"],
                      "  rules:\n    - { rule: tool_errors, count: 5, action: abort }\n")
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done" and verdicts(conn, res["run_id"]) == []


# validation


@pytest.mark.parametrize("block,path,message", [
    ("  rules: []\n", "supervisor.rules", "rules must be a non-empty list of rules"),
    ("  rules:\n    - { rule: loops, count: 3, action: abort }\n", "supervisor.rules[0].rule",
     'rule must be one of repeated_tool_call, tool_errors, tokens_per_turn, wall_time, iterations, not "loops"'),
    ("  rules:\n    - { rule: tool_errors, count: 3, action: warn }\n", "supervisor.rules[0].action",
     'action must be steer, pause or abort, not "warn"'),
    ("  rules:\n    - { rule: tool_errors, max: 3, action: abort }\n", "supervisor.rules[0].max",
     "rule tool_errors takes count, not max"),
    ("  rules:\n    - { rule: wall_time, max: soon, action: abort }\n", "supervisor.rules[0].max",
     '"max" must be a duration such as 500ms, 10s, 5m or 2d (at most 24 days)'),
    ("  rules:\n    - { rule: iterations, action: abort }\n", "supervisor.rules[0]", "rule iterations needs max"),
    ("  rules:\n    - { rule: iterations, max: 2, action: abort, message: hi }\n", "supervisor.rules[0].message",
     "message is the text of a steer action: a string, with action: steer"),
    ("  rules:\n    - { rule: iterations, max: 0, action: abort }\n", "supervisor.rules[0].max",
     "max must be a positive integer (at most 2147483647)"),
    ("  judge: { model: m, every: 2 }\n", "supervisor.judge",
     'the supervisor\'s judge is missing required key "prompt"'),
    ("  judge: { model: m, prompt: p, on_error: retry }\n", "supervisor.judge.on_error",
     "on_error must be pass (go on when the judge cannot answer) or abort"),
    ("  judge: { model: m, prompt: p, cadence: 2 }\n", "supervisor.judge.cadence", 'unknown key "cadence"'),
    ("  watch: all\n", "supervisor.watch", 'unknown key "watch"'),
])
def test_a_malformed_supervisor_is_an_error_with_its_path(conn, block, path, message):
    source = agent_workflow("v_sup", "m", ["record"], routes=ROUTES).replace(
        "steps:\n", f"supervisor:\n{block}steps:\n", 1)
    found = [(r[1], r[2]) for r in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (source,))
             if r[0] == "error"]
    assert any(p == path and m.startswith(message) for p, m in found), found
