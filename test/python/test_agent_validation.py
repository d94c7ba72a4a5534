"""The validation findings of autonomous Agent steps.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403


# ---------------------------------------------------------------------------
# Validation


HUMAN = "  - id: ask\n    kind: Human\n    form: { type: object, properties: { ok: { type: boolean } } }\n"
COMPLETION = ("  - id: helper\n    kind: Agent\n    mode: completion\n"
              "    agent: { model: m, prompt: Help. }\n")
NO_ROUTE = 'the reserved exit "{}" has no route: the run fails if the agent takes it'


def variant(*edits, add=""):
    source = VALID
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new, 1)
    return source.replace("ends:\n", add + "ends:\n")


VALIDATION_CASES = {
    "missing tools": (variant(("      tools: [{ ref: lookup }]\n", "")), [
        ("error", "steps[0].agent",
         "an autonomous agent needs agent.tools: the steps it may call, as [{ref: step_id}]")]),
    "empty tools": (variant(("[{ ref: lookup }]", "[]")), [
        ("error", "steps[0].agent",
         "an autonomous agent needs agent.tools: the steps it may call, as [{ref: step_id}]")]),
    "unknown ref": (variant(("{ ref: lookup }", "{ ref: lookup }, { ref: nope }")), [
        ("error", "steps[0].agent.tools[1].ref", 'tool "nope" is not a step of this workflow')]),
    "ref to itself": (variant(("{ ref: lookup }", "{ ref: triage }")), [
        ("error", "steps[0].agent.tools[0].ref", "an agent cannot call itself as a tool")]),
    "ref to a Human step": (variant(("{ ref: lookup }", "{ ref: ask }"), add=HUMAN), [
        ("error", "steps[0].agent.tools[0].ref",
         'step "ask" is a Human step, which cannot be called as a tool; '
         "tools are Functional, ModelOp, Router, APICall or MCP steps"),
        ("error", "steps[0].agent.tools[0]",
         'tool "ask" has no description; give step "ask" a description, or the tool entry one, '
         "so the model knows what it does")]),
    "ref to an Agent step": (variant(("{ ref: lookup }", "{ ref: helper, description: Helps }"),
                                     add=COMPLETION), [
        ("error", "steps[0].agent.tools[0].ref",
         'step "helper" is an Agent step, which cannot be called as a tool; '
         "tools are Functional, ModelOp, Router, APICall or MCP steps")]),
    "tool without a description": (variant(("    description: Look up\n", "")), [
        ("error", "steps[0].agent.tools[0]",
         'tool "lookup" has no description; give step "lookup" a description, or the tool entry '
         "one, so the model knows what it does")]),
    "description on the entry": (variant(("    description: Look up\n", ""),
                                         ("{ ref: lookup }", "{ ref: lookup, description: Finds }")), []),
    "system and prompt": (variant(("      steering:", "      system: Hi.\n      prompt: Go.\n      steering:")), [
        ("error", "steps[0].agent.system",
         "system is a completion-mode field; an autonomous agent takes its instructions from agent.steering"),
        ("error", "steps[0].agent.prompt",
         "prompt is a completion-mode field; an autonomous agent reads the public context instead")]),
    "no steering": (variant(("      steering: Be careful.\n", "")), [
        ("warning", "steps[0].agent",
         "agent.steering is missing; without it the model knows only the context and the tools")]),
    "max_iterations 0": (variant(("      tools:", "      max_iterations: 0\n      tools:")), [
        ("error", "steps[0].agent.max_iterations", "max_iterations must be a positive integer (at most 2147483647)")]),
    "max_iterations -2": (variant(("      tools:", "      max_iterations: -2\n      tools:")), [
        ("error", "steps[0].agent.max_iterations", "max_iterations must be a positive integer (at most 2147483647)")]),
    "max_iterations 1.5": (variant(("      tools:", "      max_iterations: 1.5\n      tools:")), [
        ("error", "steps[0].agent.max_iterations", "max_iterations must be a positive integer (at most 2147483647)")]),
    "max_iterations text": (variant(("      tools:", "      max_iterations: many\n      tools:")), [
        ("error", "steps[0].agent.max_iterations", "max_iterations must be a positive integer (at most 2147483647)")]),
    "private context_injection": (variant(("    routes:", "    context_injection: [body, _ssn]\n    routes:")), [
        ("error", "steps[0].context_injection[1]",
         '"_ssn" is a private key; private keys are never shown to a model')]),
    "unmapped max_iterations and aborted": (variant((", max_iterations: done, aborted: done", "")), [
        ("warning", "steps[0].routes", NO_ROUTE.format("max_iterations")),
        ("warning", "steps[0].routes", 'the reserved exit "aborted" has no route: '
                                       "an abort stops the run without a routed exit")]),
    "token_budget without its route": (variant(("      tools:", "      token_budget: 500\n      tools:")), [
        ("warning", "steps[0].routes", NO_ROUTE.format("budget_exceeded"))]),
    "enum value without a route": (variant(("[resolved]", "[resolved, escalate]")), [
        ("error", "steps[0].agent.outcome.enum[1]",
         'outcome "escalate" has no route; add routes: { escalate: <step or end> }')]),
    "reserved name in the enum": (variant(("[resolved]", "[resolved, aborted]")), [
        ("error", "steps[0].agent.outcome.enum[1]",
         '"aborted" is a reserved exit and cannot be an outcome; choose another name')]),
}


def test_a_valid_autonomous_agent_has_no_findings_and_registers(conn):
    q(conn, "SELECT tuvl.register_llm(%s)",
      ("name: m\nprovider: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: test\n",))
    assert q(conn, "SELECT * FROM tuvl.validate(%s)", (VALID,)) == []
    source = VALID.replace("name: v", "name: " + new_name("v"))
    assert q1(conn, "SELECT tuvl.register_workflow(%s)", (source,)) is not None


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
def test_validation_findings(conn, case):
    source, expected = VALIDATION_CASES[case]
    # the model the cases name exists (an unregistered one is a warning of its own)
    q(conn, "SELECT tuvl.register_llm(%s)",
      ("name: m\nprovider: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: test\n",))
    found = q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (source,))
    # every finding names where it is in the source
    assert all(re.search(r" \(line \d+, column \d+\)$", m) for _, _, m in found), found
    found = [(sev, path, re.sub(r" \(line \d+, column \d+\)$", "", m)) for sev, path, m in found]
    assert sorted(found) == sorted(expected), found
    registered = source.replace("name: v", "name: " + new_name("v"))
    if any(sev == "error" for sev, _, _ in expected):
        with pytest.raises(psycopg2.Error):
            q(conn, "SELECT tuvl.register_workflow(%s)", (registered,))
    else:
        q(conn, "SELECT tuvl.register_workflow(%s)", (registered,))
