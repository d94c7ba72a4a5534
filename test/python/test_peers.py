"""tuvl against servers other people wrote, from npm, pinned in test/lib.sh.

- openai-mock-api: an OpenAI-compatible server, scripted by
  test/servers/openai_mock.yaml; it checks the API key, answers tool calls
  with finish_reason "stop" and no content, and refuses a conversation it
  was not given with 400.
- @modelcontextprotocol/server-memory, a stdio MCP server, behind
  supergateway's stateful stdio-to-streamable-HTTP bridge, which starts one
  child process per session and stops it when the session is ended with
  DELETE.  (The reference server-everything is tested in test_mcp.py.)

Under test/run these servers are always there: a missing one fails the run
(conftest.py turns a skip into a failure when TUVL_REQUIRE_PEERS is set).
"""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import TMPDIR, connect, q, q1, wait_until
from httputil import execute, pids_listening_on, port_open, unique, wait_port

MCP2_URL = os.environ.get("TUVL_MCP2_URL")
MCP2_PORT = int(os.environ.get("TUVL_MCP2_PORT") or 0)
MOCK_URL = os.environ.get("TUVL_OPENAI_MOCK_URL")

pytestmark = pytest.mark.skipif(not MCP2_URL or not MOCK_URL,
                                reason="TUVL_MCP2_URL and TUVL_OPENAI_MOCK_URL are not set (run through test/run)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_BIN = os.path.join(ROOT, "test", "servers", "peers", "node_modules", ".bin")

SETUP = """
CREATE SCHEMA peers;
CREATE FUNCTION peers.forecast(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    SELECT jsonb_build_object('city', ctx ->> 'city', 'sky', 'sunny') $$;
GRANT USAGE ON SCHEMA peers TO PUBLIC;
"""

AGENT = """
name: {name}
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: {model}
      steering: Answer questions about the weather.
      tools: [{{ ref: forecast }}]
    routes: {{ default: done, error: oops }}
  - id: forecast
    kind: Functional
    description: The forecast for a city
    function: peers.forecast
ends:
  - {{ id: done, status: completed, response: "{{{{ triage_result }}}}" }}
  - {{ id: oops, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""

MEMORY = """
name: memory
steps:
  - id: remember
    kind: MCP
    mcp:
      url: "%(url)s"
      tool: create_entities
      arguments: { entities: [{ name: "{{ who }}", entityType: person, observations: ["{{ fact }}"] }] }
    output: created
  - id: recall
    kind: MCP
    mcp: { url: "%(url)s", tool: search_nodes, arguments: { query: "{{ who }}" } }
    output: found
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ found }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}" } }
""" % {"url": MCP2_URL}

SEARCH = """
name: memory_search
steps:
  - id: recall
    kind: MCP
    mcp: { url: "{{ url }}", tool: search_nodes, arguments: { query: "{{ who }}" } }
    output: found
    routes: { default: done, error: oops }
ends:
  - { id: done, status: completed, response: "{{ found }}" }
  - { id: oops, status: completed, response: { error: "{{ _last_error }}" } }
"""


@pytest.fixture(scope="module")
def wf(db):
    conn = connect(db)
    q(conn, SETUP)
    q(conn, "SELECT tuvl.register_workflow(%s)", (MEMORY,))
    q(conn, "SELECT tuvl.register_workflow(%s)", (SEARCH,))
    q(conn, "SELECT tuvl.set_secret('peer_key', 'peer-test-key')")
    q(conn, "SELECT tuvl.set_secret('peer_wrong_key', 'not-the-key')")
    conn.close()
    return db


@pytest.fixture
def conn(wf, conns):
    return conns(wf)


@pytest.fixture(params=["sync", "worker"])
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def bridge_restarts():
    """Bridges this module started in place of test/lib.sh's (stopped at the end)."""
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def agent(conn, secret):
    name = unique("peer")
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: openai\nbase_url: {MOCK_URL}\nmodel: gpt-4o-mini\n"
        f"api_key_secret: {secret}\ntimeout: 10s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (AGENT.format(name=name, model=name),))
    return name


def agent_events(conn, run_id):
    return [(t, p) for t, p in q(conn, "SELECT type, payload FROM tuvl.events WHERE run_id = %s ORDER BY seq",
                                 (run_id,)) if t in ("tool_call", "tool_result", "llm_turn")]


# ---------------------------------------------------------------------------
# openai-mock-api


def test_an_agent_calls_a_tool_and_answers_through_openai_mock_api(conn, mode):
    """The mock answers the first turn with a tool call (finish_reason "stop",
    no content key), the agent runs the tool with the model's arguments and
    sends the result back under the provider's call id, and the second turn's
    text is the step's result."""
    name = agent(conn, "peer_key")
    res = execute(conn, name, {"topic": "peer-weather"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert res["response"] == "Oslo will be sunny.", res
    evs = agent_events(conn, res["run_id"])
    turns = [p for t, p in evs if t == "llm_turn"]
    assert len(turns) == 2, turns
    calls = [p for t, p in evs if t == "tool_call" and "call_id" in p]
    assert [(c["tool"], c["call_id"]) for c in calls] == [("forecast", "call_peer_1")], calls
    results = [p for t, p in evs if t == "tool_result" and "call_id" in p]
    assert "sunny" in json.dumps(results[0]) and "Oslo" in json.dumps(results[0]), results


def test_a_wrong_api_key_is_a_clear_model_error(conn):
    name = agent(conn, "peer_wrong_key")
    res = execute(conn, name, {"topic": "peer-weather"})
    assert res["end"] == "oops", res
    assert "401" in res["response"]["error"] and "Invalid API key provided" in res["response"]["error"], res
    assert "not-the-key" not in json.dumps(res) and "peer-test-key" not in json.dumps(res)


def test_a_conversation_the_server_cannot_answer_is_a_clear_model_error(conn):
    """openai-mock-api answers a conversation it has no flow for with 400."""
    name = agent(conn, "peer_key")
    res = execute(conn, name, {"topic": "nothing scripted"})
    assert res["end"] == "oops", res
    assert "400" in res["response"]["error"], res


def test_an_answer_without_tool_calls_ends_at_once(conn, mode):
    name = agent(conn, "peer_key")
    res = execute(conn, name, {"topic": "peer-hello"}, mode)
    assert (res["end"], res["response"]) == ("done", "hello from openai-mock-api"), res


# ---------------------------------------------------------------------------
# server-memory behind supergateway


def bridge_pid():
    pids = pids_listening_on(MCP2_PORT)
    assert pids, f"nothing listens on the bridge's port {MCP2_PORT}"
    return min(pids)


def bridge_children():
    """The bridge's child processes: one per open session."""
    parent = str(bridge_pid())
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == parent:
                    n += 1
        except OSError:
            continue
    return n


def test_list_tools_of_the_memory_server(conn):
    tools = {t["name"]: t for t in q1(conn, "SELECT tuvl.mcp_list_tools(%s)", (MCP2_URL,))}
    for name in ("create_entities", "search_nodes", "read_graph"):
        assert name in tools, sorted(tools)
    assert tools["search_nodes"]["inputSchema"]["required"] == ["query"]


def test_steps_write_and_read_the_memory_server(conn, mode):
    who = unique("ada")
    res = execute(conn, "memory", {"who": who, "fact": "wrote the first program"}, mode)
    assert res["status"] == "completed" and res["end"] == "done", res
    assert who in json.dumps(res["response"]) and "wrote the first program" in json.dumps(res["response"]), res


def test_concurrent_calls_on_the_bridges_shared_sessions_are_all_answered(conn):
    who = unique("grace")
    assert execute(conn, "memory", {"who": who, "fact": "found a bug"}, "worker")["end"] == "done"
    with conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("SELECT array_agg(tuvl.start_run('memory_search', jsonb_build_object('url', %s::text, "
                    "'who', %s::text))) FROM generate_series(1, 16)", (MCP2_URL, who))
        ids = cur.fetchone()[0]
        cur.execute("COMMIT")
    for run_id in ids:
        assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    rows = q(conn, "SELECT end_name, response FROM tuvl.runs WHERE id = ANY(%s)", (ids,))
    assert all(end == "done" and "found a bug" in json.dumps(resp) for end, resp in rows), rows


def test_a_session_ended_with_delete_frees_the_bridges_child_process(wf):
    """A backend that ran an MCP step keeps its session (the bridge keeps a
    child process for it) until it exits, and then ends it with DELETE: the
    bridge stops the child."""
    url = MCP2_URL + "?who=" + unique("b")
    before = bridge_children()
    c = connect(wf)
    try:
        res = execute(c, "memory_search", {"url": url, "who": "nobody"})
        assert res["end"] == "done", res
        assert bridge_children() == before + 1
    finally:
        c.close()
    wait_until(lambda: bridge_children() == before, 10, message="the bridge to stop the session's child")


def test_a_lost_bridge_session_is_recovered(conn, bridge_restarts):
    """The bridge restarts and forgets every session: a worker's next call on
    its cached session is refused, and the step initializes again and
    repeats the call."""
    url = MCP2_URL + "?lost=" + unique("l")
    assert execute(conn, "memory_search", {"url": url, "who": "x"}, "worker")["end"] == "done"
    assert execute(conn, "memory_search", {"url": url, "who": "x"}, "worker")["end"] == "done"
    pids = pids_listening_on(MCP2_PORT)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pids_listening_on(MCP2_PORT) and not port_open(MCP2_PORT), 10,
               message="the bridge to stop")
    log = open(os.path.join(TMPDIR, "mcp2.log"), "ab")
    try:
        proc = subprocess.Popen([os.path.join(PEER_BIN, "supergateway"), "--stdio",
                                 os.path.join(PEER_BIN, "mcp-server-memory"), "--outputTransport",
                                 "streamableHttp", "--stateful", "--port", str(MCP2_PORT), "--logLevel", "none"],
                                env=dict(os.environ, MEMORY_FILE_PATH=os.path.join(TMPDIR, "memory.jsonl")),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()
    bridge_restarts.append(proc)
    wait_port(MCP2_PORT, 30)
    time.sleep(0.5)
    res = execute(conn, "memory_search", {"url": url, "who": "x"}, "worker")
    assert res["end"] == "done", res
    evs = [r[0] for r in q(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s "
                                 "AND type IN ('tool_call', 'tool_result') ORDER BY seq", (res["run_id"],))]
    rpcs = [(c["request"].get("rpc"), r["result"].get("status")) for c, r in zip(evs[0::2], evs[1::2])]
    methods = [m for m, _ in rpcs]
    # the same worker may hold the session (refused, then a new handshake), or
    # the other worker may open its first one
    assert methods in (["tools/call", "initialize", "notifications/initialized", "tools/call"],
                       ["initialize", "notifications/initialized", "tools/call"]), rpcs
    if len(methods) == 4:
        assert rpcs[0][1] in (400, 404), rpcs
