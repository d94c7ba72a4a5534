"""Every key tuvl accepts has its value's type checked, at every place.

0.2.0 accepted `token_budget: lots` (a known key, its value never checked
where it was written): a key that tuvl accepts must do something, and a
value it cannot use must be an error naming its path.  This module takes
one workflow that uses every key of the format, valid as it is, and puts
a value of each wrong type at every key in turn: each substitution must
make tuvl.validate() report an error.  The workflow is written as JSON,
which is YAML too.
"""
import copy
import json

import pytest

from conftest import connect, q

LLM_URL = "http://127.0.0.1:9/v1"

# One workflow using every key: steps of every kind, both agent modes.
FULL = {
    "name": "vt_full",
    "description": "every key",
    "trigger": {"input": {"type": "object", "properties": {"n": {"type": "integer"}}},
                "sync_timeout": "5s", "schedule": "*/5 * * * *", "catch_up": 2},
    "start": "load",
    "concurrency": {"key": "{{ n }}", "limit": 2},
    "hooks": ["artifact://vt_hook@1"],
    "supervisor": {
        "rules": [{"rule": "repeated_tool_call", "count": 3, "action": "abort"},
                  {"rule": "tool_errors", "count": 2, "action": "steer", "message": "stop"},
                  {"rule": "tokens_per_turn", "max": 4000, "action": "pause"},
                  {"rule": "wall_time", "max": "10m", "action": "abort"}],
        "judge": {"model": "vt_model", "prompt": "Judge it.", "every": 2, "on_error": "pass"}},
    "steps": [
        {"id": "load", "kind": "ModelOp", "description": "load", "sql": "SELECT $1::int AS n",
         "params": ["{{ n }}"], "output": "rows", "timeout": "5s", "hooks": ["artifact://vt_hook@1"],
         "routes": {"default": "score", "error": "failed"}},
        {"id": "score", "kind": "Functional", "function": "pg_catalog.to_jsonb",
         "routes": {"default": "route"}, "compensate": "undo"},
        {"id": "undo", "kind": "ModelOp", "sql": "SELECT 1 AS one"},
        {"id": "route", "kind": "Router", "on": "{{ n }}", "routes": {"1": "call", "default": "call"}},
        {"id": "call", "kind": "APICall",
         "http": {"method": "POST", "url": "http://127.0.0.1:9/x", "headers": {"X-A": "b"},
                  "query": {"q": "{{ n }}"}, "body": {"n": "{{ n }}"}, "timeout": "5s",
                  "idempotency": "auto", "retry": {"on": ["timeout", "5xx"], "attempts": 3, "backoff": "1s"}},
         "routes": {"default": "tool"}},
        {"id": "tool", "kind": "MCP",
         "mcp": {"url": "http://127.0.0.1:9/mcp", "tool": "echo", "arguments": {"m": "x"},
                 "timeout": "5s", "headers": {"X-A": "b"}},
         "routes": {"default": "ask"}},
        {"id": "ask", "kind": "Agent", "mode": "completion",
         "agent": {"model": "vt_model", "system": "Be brief.", "prompt": "Hi {{ n }}",
                   "retry": {"on": ["timeout"], "attempts": 2, "backoff": "1s"},
                   "outcome": {"enum": ["yes", "no"], "write": "answer"},
                   "guardrails": {"input": ["artifact://vt_guard@1"], "output": ["artifact://vt_guard@1"]}},
         "routes": {"yes": "triage", "no": "triage", "guardrail_violation": "failed"}},
        {"id": "triage", "kind": "Agent", "mode": "autonomous", "context_injection": ["n"],
         "agent": {"model": "vt_model", "steering": "Be careful.", "skills": ["Count."],
                   "tools": [{"ref": "lookup", "description": "look", "writes_context": True,
                              "parameters": {"type": "object"}, "approval": True,
                              "approval_timeout": "30m"},
                             {"mcp": "http://127.0.0.1:9/mcp", "allow": ["echo"], "prefix": "x_",
                              "headers": {"X-A": "b"}, "approval": True, "approval_timeout": "1h"}],
                   "outcome": {"enum": ["resolved"]}, "max_iterations": 5, "token_budget": 1000,
                   "guardrails": {"tools": ["artifact://vt_guard@1"]}},
         "routes": {"resolved": "ask_person", "max_iterations": "failed", "budget_exceeded": "failed",
                    "aborted": "failed", "error": "failed"}},
        {"id": "lookup", "kind": "ModelOp", "description": "look up", "sql": "SELECT 2 AS two"},
        {"id": "ask_person", "kind": "Human", "timeout": "2d",
         "form": {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}},
         "routes": {"default": "nap", "timeout": "failed"}},
        {"id": "nap", "kind": "Sleep", "for": "10s", "routes": {"default": "children"}},
        {"id": "children", "kind": "Workflow", "workflow": "vt_child", "input": {"n": "{{ item }}"},
         "for_each": "{{ rows }}", "max_parallel": 2, "version": 1, "routes": {"default": "done"}},
    ],
    "ends": [{"id": "done", "status": "completed", "response": {"n": "{{ n }}"}, "description": "ok"},
             {"id": "failed", "status": "failed", "rollback": True}],
}

# Values of any type are meaningful here (templates, JSON Schemas, payloads):
# their own checks are tested elsewhere.
ANY_VALUE = {"response", "body", "input", "arguments", "form", "parameters", "params"}
# A duration is text ("10s") or a number of seconds.
DURATIONS = {"timeout", "sync_timeout", "backoff", "approval_timeout", "for"}
# Mappings whose keys are the user's (routes, headers, query): their values are checked,
# but the path to them is not a key of the format.
USER_KEYS = {"routes", "headers", "query"}


def leaves(node, path=()):
    """(path, value) of every key of the format, depth first."""
    if isinstance(node, dict):
        for k, v in node.items():
            p = path + (k,)
            yield p, v
            if k not in ANY_VALUE:
                yield from leaves(v, p)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from leaves(v, path + (i,))


def wrong_values(value):
    """Values of other types than value's (a string for a number, ...)."""
    if isinstance(value, bool):
        return ["yes", 7, [True], {"a": True}]
    if isinstance(value, (int, float)):
        return ["lots", True, [1], {"a": 1}, -5, 0.5]
    if isinstance(value, str):
        return [123, True, ["x"], {"a": "x"}]
    if isinstance(value, list):
        return ["x", 5, {"a": 1}, True]
    if isinstance(value, dict):
        return ["x", 5, [1], True]
    return []


def put(doc, path, value):
    d = copy.deepcopy(doc)
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d


def fmt(path):
    return ".".join(str(p) for p in path)


@pytest.fixture(scope="module")
def conn(db):
    c = connect(db)
    q(c, "SELECT tuvl.register_llm(%s)", (f"name: vt_model\nprovider: openai\nbase_url: {LLM_URL}\nmodel: m\n",))
    q(c, "SELECT tuvl.register_artifact(%s)", ("name: vt_hook\ntype: hook\nevents: [before_step]\naction: metric\n",))
    q(c, "SELECT tuvl.register_artifact(%s)",
      ("name: vt_guard\ntype: guardrail\nchecks:\n  - { check: max_length, max: 4000 }\n",))
    q(c, "SELECT tuvl.register_workflow(%s)",
      ("name: vt_child\nsteps:\n  - { id: s, kind: ModelOp, sql: \"SELECT 1 AS one\" }\n",))
    yield c
    c.close()


def errors(conn, doc):
    return [(r[1], r[2]) for r in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)",
                                    (json.dumps(doc),)) if r[0] == "error"]


def test_the_full_workflow_is_valid(conn):
    assert errors(conn, FULL) == []


def test_a_value_of_the_wrong_type_is_an_error_at_every_key(conn):
    accepted = []
    tried = 0
    for path, value in leaves(FULL):
        key = path[-1]
        if isinstance(key, int) and len(path) >= 2 and path[-2] in ("steps", "ends"):
            continue        # a whole step or end: the kinds' own checks
        if key in ANY_VALUE and path[-2:-1] != ("trigger",):
            continue
        if isinstance(key, str) and path[-2:-1] and path[-2] in USER_KEYS:
            wrongs = [123, True, ["x"], {"a": 1}] if path[-2] == "routes" else [["x"], {"a": 1}]
        elif key in DURATIONS or (path[-2:-1] == (3,) and key == "max"):
            wrongs = ["soon", True, ["1s"], {"a": "1s"}, -5]
        else:
            wrongs = wrong_values(value)
        for wrong in wrongs:
            tried += 1
            if not errors(conn, put(FULL, path, wrong)):
                accepted.append(f"{fmt(path)} = {json.dumps(wrong)}")
    assert tried > 300
    assert accepted == [], "accepted without an error:\n" + "\n".join(accepted)


@pytest.mark.parametrize("key,value", [("token_budget", "lots"), ("max_iterations", "many"),
                                       ("token_budget", 100), ("max_iterations", 3)])
def test_agent_limits_belong_to_autonomous_agents(conn, key, value):
    """0.2.0: `token_budget: lots` on a completion agent was accepted and did nothing."""
    doc = put(FULL, ("steps", 6, "agent", key), value)
    found = errors(conn, doc)
    assert any(p == f"steps[6].agent.{key}" for p, _ in found), found
