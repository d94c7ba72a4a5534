"""The tools an Agent is offered: tool specs by precedence, MCP tools and
whole MCP servers, thinking blocks and reasoning items sent back.

The helpers and fixtures are agentutil.py's; it says how these tests work.
"""
from agentutil import *  # noqa: F401,F403


# ---------------------------------------------------------------------------
# The tools offered


SPEC_STEPS = (
    "  - id: desc_both\n    kind: Functional\n    description: From the step\n"
    "    function: ag.note\n"
    "  - id: desc_entry\n    kind: Functional\n    function: ag.note\n"
    "  - id: explicit\n    kind: Functional\n    description: Explicit parameters\n"
    "    function: ag.note\n"
    "  - id: api\n    kind: APICall\n    description: Call the API\n"
    f"    http:\n      method: POST\n      url: \"{HTTP_BASE}/json?order={{{{ order_id }}}}&h={{{{ _hidden }}}}\"\n"
    "      headers: { X-Key: \"{{ secrets.agent_api_token }}\", X-Name: \"{{ customer.name }}\" }\n"
    "      body: { note: \"{{ note }} for {{ order_id }}\", who: \"{{ customer.id }}\" }\n"
    "  - id: mop\n    kind: ModelOp\n    description: Run SQL\n    sql: SELECT 1 AS one\n"
)
EXPLICIT = {"type": "object", "properties": {"q": {"type": "integer", "description": "the query"}},
            "required": ["q"]}


def test_tool_specs_take_descriptions_and_parameters_by_precedence(conn, provider):
    name = make_agent(conn, provider, [final("ok")], [
        ("desc_both", "{ ref: desc_both, description: From the entry }"),
        ("desc_entry", "{ ref: desc_entry, description: Only the entry }"),
        ("explicit", "{ ref: explicit, parameters: " + json.dumps(EXPLICIT) + " }"),
        ("api", "{ ref: api }"), ("mop", "{ ref: mop }"), "record"], steps=SPEC_STEPS)
    res = execute(conn, name, {"topic": "x"})
    assert res["end"] == "done", res
    body = sent(name)[0]["body"]
    tools = offered(provider, body)
    empty = {"type": "object", "properties": {}}
    assert tools == {
        "desc_both": ("From the step", empty),
        "desc_entry": ("Only the entry", empty),
        "explicit": ("Explicit parameters", EXPLICIT),
        "api": ("Call the API", {"type": "object", "properties": {
            "order_id": {"type": "string"}, "customer": {"type": "string"},
            "note": {"type": "string"}}}),
        "mop": ("Run SQL", {"type": "object", "properties": {
            "payload": {"type": "object", "description": "A free-form payload."}}}),
        "record": ("Record a tag", empty),
    }
    names = ([t["function"]["name"] for t in body["tools"]] if provider == "openai"
             else [t["name"] for t in body["tools"]])
    assert names == ["desc_both", "desc_entry", "explicit", "api", "mop", "record"], \
        "in the order of agent.tools"


@pytest.mark.skipif(not MCP_URL, reason="TUVL_MCP_URL is not set")
def test_an_mcp_tool_is_offered_with_its_listed_input_schema_and_called(conn, provider):
    mcp = ("  - id: echo\n    kind: MCP\n    description: Echo a message\n"
           f"    mcp: {{ url: \"{MCP_URL}\", tool: echo, arguments: {{ message: \"{{{{ message }}}}\", "
           "extra: \"{{ topic }}\" } }\n")
    turns = [calls(call("echo", message="hello agent")), final("echoed")]
    q(conn, "DELETE FROM tuvl.mcp_tools")
    before = make_agent(conn, provider, turns, ["echo"], steps=mcp)
    res = execute(conn, before, {"topic": "x"})
    assert (res["end"], res["response"]) == ("done", "echoed"), res
    reqs = sent(before)
    # not listed yet: the keys of mcp.arguments
    assert offered(provider, reqs[0]["body"])["echo"] == ("Echo a message", {
        "type": "object", "properties": {"message": {"type": "string"}, "extra": {"type": "string"}}})
    ((_, answer),) = tool_answers(provider, reqs[1]["body"])
    assert answer["echo_result"]["text"] == "Echo: hello agent", answer
    # the MCP-level request/response pairs are journaled between the agent's tool_call and tool_result
    evs = [(e[0], "call_id" in e[3]) for e in events(conn, res["run_id"])
           if e[0] in ("tool_call", "tool_result")]
    assert evs[0] == ("tool_call", True) and evs[-1] == ("tool_result", True)
    assert ("tool_call", False) in evs[1:-1]

    q(conn, "SELECT tuvl.mcp_list_tools(%s)", (MCP_URL,))
    schema = q1(conn, "SELECT input_schema FROM tuvl.mcp_tools WHERE url = %s AND name = 'echo'",
                (MCP_URL,))
    assert schema["properties"]["message"]["type"] == "string"
    after = make_agent(conn, provider, turns, ["echo"], steps=mcp)
    assert execute(conn, after, {"topic": "x"})["end"] == "done"
    assert offered(provider, sent(after)[0]["body"])["echo"] == ("Echo a message", schema)


@pytest.mark.skipif(not MCP_URL, reason="TUVL_MCP_URL is not set")
def test_an_agent_may_name_a_whole_mcp_server_and_gets_its_listed_tools(conn, provider):
    """{mcp: url, allow: [...]} offers the tools tuvl.mcp_list_tools() listed for
    the server (those allowed, prefixed), with their descriptions and input
    schemas; a call passes the model's arguments to the server as they are."""
    q(conn, "SELECT tuvl.mcp_list_tools(%s)", (MCP_URL,))
    listed = {r[0]: (r[1], r[2]) for r in q(conn, "SELECT name, description, input_schema FROM tuvl.mcp_tools "
                                                   "WHERE url = %s", (MCP_URL,))}
    entry = ("srv", f'{{ mcp: "{MCP_URL}", allow: [echo, get-sum], prefix: ev_ }}')
    turns = [calls(call("ev_get-sum", a=2, b=40), call("ev_echo", message="hi")), final("sum told")]
    name = make_agent(conn, provider, turns, [entry, "record"])
    res = execute(conn, name)
    assert (res["end"], res["response"]) == ("done", "sum told"), res
    reqs = sent(name)
    tools = offered(provider, reqs[0]["body"])
    assert list(tools) == ["ev_echo", "ev_get-sum", "record"], list(tools)
    assert tools["ev_echo"] == (listed["echo"][0], listed["echo"][1])
    answers = dict(tool_answers(provider, reqs[1]["body"]))
    assert any("42" in json.dumps(a) for a in answers.values()), answers
    assert any("Echo: hi" in json.dumps(a) for a in answers.values()), answers
    results = [p for t, p in agent_tool_events(conn, res["run_id"]) if t == "tool_result"]
    assert [p["tool"] for p in results] == ["ev_get-sum", "ev_echo"], results


@pytest.mark.skipif(not MCP_URL, reason="TUVL_MCP_URL is not set")
def test_arguments_that_do_not_match_the_servers_input_schema_are_answered_with_the_error(conn, provider):
    """The model's arguments are checked against the listed inputSchema before
    the call: a missing required property or a wrong type never reaches the
    server, and the model is told what is wrong; it can then call again."""
    q(conn, "SELECT tuvl.mcp_list_tools(%s)", (MCP_URL,))
    entry = ("srv", f'{{ mcp: "{MCP_URL}", allow: [get-sum] }}')
    turns = [calls(call("get-sum", a=2)), calls(call("get-sum", a="two", b=1)),
             calls(call("get-sum", a=2, b=3)), final("five")]
    name = make_agent(conn, provider, turns, [entry])
    res = execute(conn, name)
    assert (res["end"], res["response"]) == ("done", "five"), res
    reqs = sent(name)
    (_, first) = tool_answers(provider, reqs[1]["body"])[-1]
    assert first == {"error": "the arguments do not match the tool's input schema: $: missing required property \"b\""}, first
    (_, second) = tool_answers(provider, reqs[2]["body"])[-1]
    assert "do not match the tool's input schema" in json.dumps(second) and "$.a" in json.dumps(second), second
    (_, third) = tool_answers(provider, reqs[3]["body"])[-1]
    assert "5" in json.dumps(third), third
    # only the valid call reached the server
    mcp_calls = [e for e in events(conn, res["run_id"], "tool_call") if "call_id" not in e[3]
                 and (e[3].get("request") or {}).get("rpc") == "tools/call"]
    assert len(mcp_calls) == 1, mcp_calls


def test_anthropic_thinking_blocks_go_back_with_their_tool_calls(conn, mode):
    """With extended thinking, Anthropic requires the assistant message whose
    tool_use blocks the tool results answer to start with the thinking block
    it came with, signature and all; the scripted server refuses the request
    otherwise, as Anthropic does."""
    name = new_name()
    script(name, [calls(call("record", tag="thought"), thinking="The user wants a record; call record."),
                  final("recorded")])
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: anthropic\nbase_url: {LLM_URL}\nmodel: {name}\ntimeout: 10s\n"
        "params: { max_tokens: 4096, thinking: { type: enabled, budget_tokens: 2048 } }\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name, ["record"]),))
    res = execute(conn, name, mode=mode)
    assert (res["end"], res["response"]) == ("done", "recorded"), res
    second = sent(name)[1]["body"]
    (assistant,) = [m for m in second["messages"] if m["role"] == "assistant"]
    first_block = assistant["content"][0]
    assert first_block["type"] == "thinking", assistant
    assert first_block["thinking"] == "The user wants a record; call record."
    assert first_block["signature"].startswith("sig-")
    assert [b["type"] for b in assistant["content"]] == ["thinking", "tool_use"], assistant


def test_responses_reasoning_items_go_back_before_their_function_calls(conn, mode):
    """The Responses API gives reasoning items with a function call; the next
    request must carry them, unchanged, before that call (the scripted server
    refuses it otherwise, as the API does for reasoning models)."""
    name = new_name()
    script(name, [calls(call("record", tag="r1"), text="Recording.", thinking="Record first, then answer."),
                  final("recorded")])
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: openai_responses\nbase_url: {LLM_URL}\nmodel: {name}\ntimeout: 10s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (agent_workflow(name, name, ["record"]),))
    res = execute(conn, name, mode=mode)
    assert (res["end"], res["response"]) == ("done", "recorded"), res
    second = sent(name)[1]["body"]["input"]
    kinds = [i.get("type", "message") for i in second]
    assert kinds == ["message", "reasoning", "message", "function_call", "function_call_output"], kinds
    reasoning = second[1]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Record first, then answer."}]
    assert reasoning["encrypted_content"].startswith("sig-")


def test_mcp_server_tool_entries_are_checked(conn):
    def errors(entry):
        src = VALID.replace("tools: [{ ref: lookup }]", f"tools: [{{ ref: lookup }}, {entry}]")
        return [(r[1], r[2]) for r in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,))
                if r[0] == "error"]
    assert errors('{ mcp: "http://127.0.0.1:1/mcp", allow: [echo], prefix: x_, approval: true }') == []
    path = "steps[0].agent.tools[1]"
    assert [p for p, _ in errors('{ mcp: "{{ url }}" }')] == [path + ".mcp"]
    assert [p for p, _ in errors('{ mcp: "http://x/mcp", allow: [] }')] == [path + ".allow"]
    assert [p for p, _ in errors('{ mcp: "http://x/mcp", prefix: "a.b" }')] == [path + ".prefix"]
    assert [p for p, _ in errors('{ mcp: "http://x/mcp", headers: [a] }')] == [path + ".headers"]
    assert [p for p, _ in errors('{ mcp: "http://x/mcp", writes_context: true }')] == [path + ".writes_context"]


def test_an_mcp_server_entry_with_no_listed_tools_fails_clearly(conn, provider):
    url = "http://127.0.0.1:9/never-listed"
    name = make_agent(conn, provider, [final("x")], [("srv", f'{{ mcp: "{url}" }}')])
    res = execute(conn, name)
    assert res["end"] == "oops", res
    assert res["response"]["error"] == (f'agent.tools[0] of step "triage" offers no tool: no tools of {url} are known'), res


@pytest.mark.skipif(not MCP_URL, reason="TUVL_MCP_URL is not set")
@pytest.mark.parametrize("pattern, answer", [
    ("^(web|" + "k" * 113000 + ")$", "is 113008 bytes long; the limit is 8192"),
    ("([0-9]", "the tool's input schema cannot be applied: invalid regular expression: "
               "parentheses () not balanced"),
], ids=["too-long", "does-not-compile"])
def test_a_servers_pattern_tuvl_cannot_compile_answers_the_call_with_the_error(conn, provider, pattern, answer):
    """A server's inputSchema is not checked when it is listed: a pattern too
    long to compile safely (the regex engine reserves memory growing with the
    square of a long one) or one that does not compile answers the model's
    call with the error, and the server is never called; the run goes on."""
    q(conn, "SELECT tuvl.mcp_list_tools(%s)", (MCP_URL,))
    schema = {"type": "object", "required": ["a", "b"],
              "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                             "tag": {"type": "string", "pattern": pattern}}}
    q(conn, "UPDATE tuvl.mcp_tools SET input_schema = %s WHERE url = %s AND name = 'get-sum'",
      (json.dumps(schema), MCP_URL))
    entry = ("srv", f'{{ mcp: "{MCP_URL}", allow: [get-sum] }}')
    turns = [calls(call("get-sum", a=2, b=3, tag="web")), final("could not")]
    name = make_agent(conn, provider, turns, [entry])
    res = execute(conn, name)
    assert (res["end"], res["response"]) == ("done", "could not"), res
    (_, first) = tool_answers(provider, sent(name)[1]["body"])[-1]
    assert answer in json.dumps(first), first
    mcp_calls = [e for e in events(conn, res["run_id"], "tool_call") if "call_id" not in e[3]
                 and (e[3].get("request") or {}).get("rpc") == "tools/call"]
    assert mcp_calls == [], mcp_calls
