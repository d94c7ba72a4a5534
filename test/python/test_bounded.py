"""Work proportional to an outside input is bounded and interruptible.

Each test plays the hostile input as an ordinary role (a LOGIN role granted
only tuvl_user) and checks that tuvl stops with a clear step error, in
time and memory bounded by a setting, instead of taking a worker (or the
cluster) down:

- a ModelOp step whose SQL returns millions of rows: its rows are converted
  as they come, with an interrupt check per row; the step stops with
  _last_error_type too_large at tuvl.max_output_size or when the worker has
  grown by tuvl.max_worker_memory, and an abort, its timeout and
  pg_terminate_backend() stop it within about a second (the worker's memory
  is sampled from /proc; a worker past GUARD_MB is killed, failing the test
  rather than the machine);
- a model answer with thousands of tool calls: agent.max_tool_calls (128 by
  default) ends the step before any runs, and with a higher limit the
  transition's work is linear in the calls (500 against 2,000);
- JSON Schemas whose $ref form a cycle, or chain further than the validator
  follows, are refused at registration with the path of the $ref; a
  recursive schema that descends into the value still works; a cyclic
  schema that was stored before (or comes from elsewhere) is a clear
  validation error, never "stack depth limit exceeded";
- token counts of a model's usage that are not counts (a string, a
  fraction, negative, past 2^31 - 1) take the step's error route with
  _last_error_type bad_response, for the three wire formats, with the answer
  journaled in its llm_turn; an MCP server's JSON-RPC error code past an
  integer is shown as it came.
"""
import json
import os
import re
import signal
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, report, wait_until, worker_pids
from httputil import ScriptedMcpServer, _McpHandler
from llmutil import LLM_URL, script

ROLE = "tuvl_bounded_user"
GUARD_MB = 2048                 # a worker past this is killed: the test fails, the machine lives
ROWS = 4_000_000
DOC_ROWS = 3000                 # rows of a 60 kB document each: seconds to convert, none to select


def new_name(prefix="b"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def bnd(db):
    admin = connect("postgres")
    q(admin, f"DROP ROLE IF EXISTS {ROLE}")
    q(admin, f"CREATE ROLE {ROLE} LOGIN IN ROLE tuvl_user")
    conn = connect(db)
    q(conn, f"""
        CREATE SCHEMA bd;
        GRANT USAGE, CREATE ON SCHEMA bd TO {ROLE};
        CREATE TABLE bd.kept (id serial PRIMARY KEY, tag text);
        GRANT ALL ON bd.kept TO {ROLE};
        GRANT ALL ON SEQUENCE bd.kept_id_seq TO {ROLE};
        CREATE FUNCTION bd.note(ctx jsonb) RETURNS jsonb LANGUAGE sql
            AS $$ SELECT jsonb_build_object('note', ctx ->> 'tag') $$;
        GRANT EXECUTE ON FUNCTION bd.note(jsonb) TO {ROLE};
        CREATE TABLE bd.doc AS
            SELECT (SELECT jsonb_object_agg('key' || i, 'value number ' || i)
                    FROM generate_series(1, 2000) i) AS doc;
        GRANT SELECT ON bd.doc TO {ROLE};
    """)
    conn.close()
    yield db
    conn = connect(db)
    q(conn, "SELECT tuvl.abort_run(id, 'test over') FROM tuvl.runs "
            "WHERE status IN ('queued', 'running', 'paused', 'waiting_human', 'waiting_approval')")
    q(conn, f"REASSIGN OWNED BY {ROLE} TO postgres")
    q(conn, f"DROP OWNED BY {ROLE}")
    conn.close()
    q(admin, f"DROP ROLE IF EXISTS {ROLE}")
    admin.close()


@pytest.fixture
def user(bnd, conns):
    """A connection as the ordinary role."""
    return conns(bnd, user=ROLE)


def outcome(conn, run_id):
    status, end, response, error, context = q(
        conn, "SELECT status, end_name, response, error, context FROM tuvl.runs WHERE id = %s",
        (run_id,))[0]
    return {"run_id": run_id, "status": status, "end": end, "response": response,
            "error": error, "context": context}


def run_to_end(conn, workflow, data, timeout):
    run_id = q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (workflow, json.dumps(data)))
    status = q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))
    assert status in ("completed", "failed", "aborted"), \
        f"run {run_id} is still {status} after {timeout} s"
    return outcome(conn, run_id)


def findings(conn, source):
    """tuvl.validate(source) as (severity, path, message), without the
    "(line l, column c)" that ends a message."""
    return [(sev, path, re.sub(r" \(line \d+, column \d+\)$", "", msg))
            for sev, path, msg in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)",
                                    (source,))]


def events(conn, run_id, event_type):
    return [r[0] for r in q(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = %s "
                                  "ORDER BY seq", (run_id, event_type))]


# ---------------------------------------------------------------------------
# Memory and CPU of the workers, from /proc


def proc_status_kb(pid, field="RssAnon"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


def cpu_seconds(pids):
    """CPU time of the processes so far (schedstat: nanoseconds on a CPU)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            continue
    return total / 1e9


class WorkerMemory:
    """Samples the private memory of a database's workers every 20 ms; a
    worker past GUARD_MB is killed (the test then fails on `killed`)."""

    def __init__(self, db):
        self.pids = worker_pids(db)
        self.base = {pid: proc_status_kb(pid) for pid in self.pids}
        self.peak = dict(self.base)
        self.killed = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self):
        while not self.stop.is_set():
            for pid in self.pids:
                kb = proc_status_kb(pid)
                self.peak[pid] = max(self.peak[pid], kb)
                if kb > GUARD_MB * 1024 and pid not in self.killed:
                    self.killed.append(pid)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def growth_mb(self):
        return max((self.peak[p] - self.base[p]) / 1024 for p in self.pids)


# ---------------------------------------------------------------------------
# 1. A ModelOp step's rows


SERIES = "SELECT g, 'row number ' || g AS label FROM generate_series(1, $1::int) g"
# every row refers to the same stored (TOASTed) document: the statement
# sends its rows at once, converting each takes milliseconds
DOCS = "SELECT g, d.doc FROM generate_series(1, $1::int) g, bd.doc d"


def rows_workflow(conn, sql=SERIES, timeout=None):
    """A ModelOp step `rows` running sql with $1 = the input's n; its error
    route ends the run with the error and its type."""
    name = new_name("rows")
    timeout_line = f"    timeout: {timeout}\n" if timeout else ""
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - id: rows
    kind: ModelOp
    sql: {sql}
    params: ["{{{{ n }}}}"]
{timeout_line}    routes: {{ error: handled }}
ends:
  - {{ id: handled, status: completed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
""",))
    return name


@pytest.fixture
def big_outputs(set_gucs):
    """Outputs up to 1000MB and workers up to 2GB: a step converting
    DOC_ROWS rows of 60 kB then runs for seconds, long enough to be stopped
    while it converts (its statement is done in milliseconds: before 0.3.0,
    the conversion came after it and could not be interrupted)."""
    set_gucs({"tuvl.max_output_size": ("1000MB", "1000MB"),
              "tuvl.max_worker_memory": ("2GB", "2GB")})


def start_rows(conn, name):
    """Start a run converting DOC_ROWS documents; return it while it
    converts them: half a second after the claim, its query is long done
    and the conversion (seconds) far from done.  Later, a fast machine could
    be writing the converted output already, which takes seconds too at
    these sizes but is no conversion: the conversion is what must stop."""
    run_id = q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (name, json.dumps({"n": DOC_ROWS})))
    wait_until(lambda: q1(conn, "SELECT status = 'running' AND lease_owner IS NOT NULL "
                                "FROM tuvl.runs WHERE id = %s", (run_id,)), 10, interval=0.01,
               message="the run to be claimed")
    time.sleep(0.5)
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "running"
    return run_id


def test_millions_of_rows_stop_at_max_output_size_in_bounded_memory(bnd, user):
    name = rows_workflow(user)
    with WorkerMemory(bnd) as mem:
        started = time.monotonic()
        res = run_to_end(user, name, {"n": ROWS}, 120)
        took = time.monotonic() - started
    assert not mem.killed, f"a worker grew past {GUARD_MB} MB and was killed"
    assert res["status"] == "completed" and res["end"] == "handled", res
    assert res["response"]["type"] == "too_large", res
    assert "pass tuvl.max_output_size (16 MB) at row" in res["response"]["error"], res
    report(f"ModelOp of {ROWS:,} rows, default limits: too_large after {took:.2f} s, "
           f"worker private memory grew {mem.growth_mb():.0f} MB")
    assert took < 20, took
    assert mem.growth_mb() < 200, mem.growth_mb()


def test_millions_of_rows_stop_at_max_worker_memory(bnd, user, set_gucs):
    set_gucs({"tuvl.max_output_size": ("1000MB", "1000MB"),
              "tuvl.max_worker_memory": ("64MB", "64MB")})
    name = rows_workflow(user)
    with WorkerMemory(bnd) as mem:
        res = run_to_end(user, name, {"n": ROWS}, 120)
    assert not mem.killed, f"a worker grew past {GUARD_MB} MB and was killed"
    assert res["response"]["type"] == "too_large", res
    assert "took more than tuvl.max_worker_memory (64 MB) at row" in res["response"]["error"], res
    report(f"ModelOp of {ROWS:,} rows, tuvl.max_worker_memory = 64MB: worker private memory "
           f"grew {mem.growth_mb():.0f} MB")
    assert mem.growth_mb() < 200, mem.growth_mb()


def test_an_abort_stops_a_step_converting_a_million_rows(bnd, user, big_outputs):
    name = rows_workflow(user, DOCS)
    with WorkerMemory(bnd) as mem:
        run_id = start_rows(user, name)
        started = time.monotonic()
        q(user, "SELECT tuvl.abort_run(%s, 'too many rows')", (run_id,))
        status = q1(user, "SELECT tuvl.wait(%s, '30 s')", (run_id,))
        took = time.monotonic() - started
    assert not mem.killed, f"a worker grew past {GUARD_MB} MB and was killed"
    assert status == "aborted", outcome(user, run_id)
    report(f"abort of a ModelOp converting {DOC_ROWS:,} rows of 60 kB: run aborted {took:.3f} s after abort_run()")
    assert took < 1.5, took


def test_the_steps_timeout_stops_a_step_converting_a_million_rows(bnd, user, big_outputs):
    # twice the rows: their conversion takes three times the timeout or more
    name = rows_workflow(user, DOCS, timeout="1s")
    with WorkerMemory(bnd) as mem:
        started = time.monotonic()
        res = run_to_end(user, name, {"n": 2 * DOC_ROWS}, 60)
        took = time.monotonic() - started
    assert not mem.killed, f"a worker grew past {GUARD_MB} MB and was killed"
    assert res["response"]["type"] == "timeout", res
    assert res["response"]["error"] == "the step's timeout of 1 s passed", res
    report(f"timeout: 1s on a ModelOp of {2 * DOC_ROWS:,} rows of 60 kB: routed after {took:.2f} s")
    # the deadline, a claim and a commit; more on a machine others load
    assert took < 3, took


def test_pg_terminate_backend_stops_a_worker_converting_a_million_rows(bnd, user, big_outputs,
                                                                       conns):
    admin = conns(bnd)
    name = rows_workflow(user, DOCS)
    with WorkerMemory(bnd) as mem:
        run_id = start_rows(user, name)
        pid = q1(admin, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        started = time.monotonic()
        assert q1(admin, "SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 10, interval=0.01,
                   message=f"worker {pid} to exit")
        took = time.monotonic() - started
    assert not mem.killed, f"a worker grew past {GUARD_MB} MB and was killed"
    report(f"pg_terminate_backend() of a worker converting {DOC_ROWS:,} rows of 60 kB: gone after {took:.3f} s")
    assert took < 1.5, took
    # a new worker takes the run over: the abort stops that one too
    q(admin, "SELECT tuvl.abort_run(%s, 'enough')", (run_id,))
    assert q1(admin, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "aborted"


def test_modelop_output_is_the_rows_as_row_to_json_makes_them(user):
    """The array is built in jsonb's own format: it equals what json_agg of
    row_to_json gives, past the 32 elements after which jsonb stores offsets."""
    name = new_name("shape")
    sql = ("SELECT g, CASE WHEN g % 3 = 0 THEN NULL ELSE repeat('é\"\\', g % 5) END AS s, "
           "g::numeric / 7 AS n, ARRAY[g, g + 1] AS a, jsonb_build_object('k', g, 'z', ARRAY['x']) AS j, "
           "g % 2 = 0 AS b, '{\"dup\": 1, \"dup\": 2}'::json AS js FROM generate_series(1, $1::int) g")
    q(user, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - id: rows
    kind: ModelOp
    sql: {json.dumps(sql)}
    params: ["{{{{ n }}}}"]
    output: out
  - id: none
    kind: ModelOp
    sql: INSERT INTO bd.kept (tag) SELECT 'x' WHERE false
    output: inserted_nothing
  - id: returning
    kind: ModelOp
    sql: INSERT INTO bd.kept (tag) VALUES ($1) RETURNING tag
    params: ["{{{{ n }}}}"]
    output: inserted
""",))
    for n in (0, 1, 33, 100):
        res = q1(user, "SELECT tuvl.run(%s, %s::jsonb)", (name, json.dumps({"n": n})))
        assert res["status"] == "completed", res
        ctx = q1(user, "SELECT context FROM tuvl.runs WHERE id = %s", (res["run_id"],))
        rows = sql.replace("$1::int", str(n)).replace("%", "%%")
        same = q1(user, "SELECT r.context -> 'out' = e.x AND pg_column_size(r.context -> 'out') = "
                        "pg_column_size(e.x) FROM tuvl.runs r, (SELECT coalesce(json_agg(row_to_json(t)), "
                        f"'[]')::jsonb AS x FROM ({rows}) t) e WHERE r.id = %s", (res["run_id"],))
        assert same, (n, ctx["out"][:3])
        assert ctx["inserted_nothing"] == []
        assert ctx["inserted"] == [{"tag": str(n)}]
    # the stored context reads back element by element
    assert q1(user, "SELECT context -> 'out' -> 99 ->> 'g' FROM tuvl.runs WHERE id = %s",
              (res["run_id"],)) == "100"


# ---------------------------------------------------------------------------
# 2. A model answer with many tool calls


def agent_with_calls(conn, ncalls, extra=""):
    """A model answering ncalls calls of tool note, then "done"."""
    name = new_name("calls")
    script(name, [{"tool_calls": [{"name": "note", "arguments": {"tag": f"t{i}"}}
                                  for i in range(ncalls)]},
                  {"text": "done"}])
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: openai\nbase_url: {LLM_URL}\nmodel: {name}\ntimeout: 120s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: {name}
      steering: Take notes.
      tools: [ {{ ref: note }} ]
{extra}    routes: {{ default: done, error: oops }}
  - {{ id: note, kind: Functional, function: bd.note, description: Take a note }}
ends:
  - {{ id: done, status: completed, response: {{ answer: "{{{{ triage_result }}}}" }} }}
  - {{ id: oops, status: completed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
""",))
    return name


def test_an_answer_with_more_tool_calls_than_max_tool_calls_ends_the_step_at_once(bnd, user):
    name = agent_with_calls(user, 2000)
    started = time.monotonic()
    res = run_to_end(user, name, {}, 60)
    took = time.monotonic() - started
    assert res["end"] == "oops", res
    assert res["response"]["type"] == "max_tool_calls", res
    assert res["response"]["error"] == ("the model asked for 2000 tool calls in one answer, more than "
                                        "agent.max_tool_calls (128); none of them ran"), res
    # the answer is journaled, and no call ran
    assert len(events(user, res["run_id"], "llm_turn")) == 1
    assert events(user, res["run_id"], "tool_call") == []
    report(f"a model answer with 2,000 tool calls, max_tool_calls at its default: step failed "
           f"after {took:.2f} s")
    assert took < 10, took


def test_max_tool_calls_counts_the_calls_of_one_answer(user):
    name = agent_with_calls(user, 3, extra="      max_tool_calls: 3\n")
    res = run_to_end(user, name, {}, 60)
    assert res["end"] == "done", res
    assert len(events(user, res["run_id"], "tool_result")) == 3
    name = agent_with_calls(user, 4, extra="      max_tool_calls: 3\n")
    res = run_to_end(user, name, {}, 60)
    assert res["response"]["type"] == "max_tool_calls", res
    assert "more than agent.max_tool_calls (3)" in res["response"]["error"]


def test_a_transition_with_thousands_of_tool_calls_takes_linear_time(bnd, user):
    """The transition that takes the answer journals it (llm_turn), runs every
    call and journals its result: the span from the one to the last of the
    others, on the worker's clock, is its work.  Linear: the last 500 of
    2,000 calls take about as long as the first 500 (with a cost per call
    growing with the calls before it, 7 times as long), and 4 times the
    calls take about 4 times as long (quadratic: 16).  Also reported: the
    CPU time of the database's workers over the whole run, and its wall
    time."""
    took = {}
    for n in (500, 2000):
        name = agent_with_calls(user, n, extra="      max_tool_calls: 2000\n")
        for _ in range(3):      # the least of three runs
            pids = worker_pids(bnd)
            cpu0 = cpu_seconds(pids)
            started = time.monotonic()
            res = run_to_end(user, name, {}, 120)
            wall = time.monotonic() - started
            cpu = cpu_seconds(pids) - cpu0
            assert res["end"] == "done", res
            assert len(events(user, res["run_id"], "tool_result")) == n
            span = q1(user, "SELECT extract(epoch FROM max(ts) FILTER (WHERE type = 'tool_result') - "
                            "min(ts) FILTER (WHERE type = 'llm_turn'))::float8 FROM tuvl.events "
                            "WHERE run_id = %s", (res["run_id"],))
            best = took.get(n, (span, cpu, wall))
            took[n] = (min(best[0], span), min(best[1], cpu), min(best[2], wall))
    # within the 2,000 calls: the last 500 take as long as the first 500 (quadratic: 7 times)
    quarters = q(user, "SELECT extract(epoch FROM max(ts) - min(ts))::float8 FROM "
                       "(SELECT ts, (row_number() OVER (ORDER BY seq) - 1) / 500 AS quarter FROM tuvl.events "
                       " WHERE run_id = %s AND type = 'tool_result') e GROUP BY quarter ORDER BY quarter",
                 (res["run_id"],))
    ratio = took[2000][0] / max(took[500][0], 0.001)
    late = quarters[-1][0] / max(quarters[0][0], 0.001)
    report("a model answer with 500 / 2,000 tool calls (max_tool_calls: 2000): its transition "
           f"{took[500][0]:.3f} / {took[2000][0]:.3f} s (ratio {ratio:.1f}; the last 500 calls took "
           f"{late:.1f} times as long as the first 500); the run's worker CPU "
           f"{took[500][1]:.2f} / {took[2000][1]:.2f} s, wall {took[500][2]:.2f} / {took[2000][2]:.2f} s")
    # The ratios are reported, not asserted (timings belong to bench/; on a
    # loaded machine one quarter can wait for the CPU): calls that reuse
    # memory malloc still holds from an earlier run skip their page faults,
    # which here cost more than the calls themselves.  What is asserted is
    # what quadratic work could not do: 2,000 calls took minutes.
    assert took[2000][0] < 10, took


@pytest.mark.parametrize("value", ["0", "-1", "1.5", '"many"', "3000000000"])
def test_max_tool_calls_must_be_a_positive_integer(user, value):
    source = (f"name: {new_name('v')}\nsteps:\n  - id: a\n    kind: Agent\n    mode: autonomous\n"
              f"    agent:\n      model: m\n      steering: s\n      tools: [ {{ ref: t }} ]\n"
              f"      max_tool_calls: {value}\n"
              "  - { id: t, kind: Functional, function: bd.note, description: d }\n")
    rows = findings(user, source)
    assert ("error", "steps[0].agent.max_tool_calls",
            "max_tool_calls must be a positive integer (at most 2147483647)") in rows, rows


def test_max_tool_calls_is_a_known_agent_key(user):
    source = (f"name: {new_name('v')}\nsteps:\n  - id: a\n    kind: Agent\n    mode: autonomous\n"
              f"    agent:\n      model: m\n      steering: s\n      tools: [ {{ ref: t }} ]\n"
              f"      max_tool_calls: 500\n"
              "  - { id: t, kind: Functional, function: bd.note, description: d }\n")
    rows = findings(user, source)
    assert not [r for r in rows if "max_tool_calls" in r[1] + r[2]], rows


# ---------------------------------------------------------------------------
# 3. $ref cycles and deep schemas


def input_workflow(name, schema):
    return (f"name: {name}\ntrigger:\n  input: {json.dumps(schema)}\nsteps:\n"
            "  - { id: one, kind: ModelOp, sql: SELECT 1 AS one }\n")


CYCLES = {
    "self": ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
             'trigger.input["$defs"].a["$ref"]',
             "$ref cycle: #/$defs/a -> #/$defs/a applies the same schemas to one value forever; "
             "recurse through properties or items instead"),
    "through_defs": ({"type": "object", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                  "b": {"type": "object", "$ref": "#/definitions/c"}},
                      "definitions": {"c": {"$ref": "#/$defs/a"}}},
                     'trigger.input.definitions.c["$ref"]',
                     "$ref cycle: #/$defs/a -> #/$defs/b -> #/definitions/c -> #/$defs/a applies the "
                     "same schemas to one value forever; recurse through properties or items instead"),
    "through_anyOf": ({"properties": {"x": {"$ref": "#/$defs/a"}},
                       "$defs": {"a": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/a"}]}}},
                      'trigger.input["$defs"].a.anyOf[1]["$ref"]',
                      "$ref cycle: #/$defs/a -> #/$defs/a applies the same schemas to one value forever; "
                      "recurse through properties or items instead"),
}


@pytest.mark.parametrize("case", sorted(CYCLES))
def test_a_ref_cycle_is_refused_at_registration_with_its_path(user, case):
    schema, path, message = CYCLES[case]
    source = input_workflow(new_name("cyc"), schema)
    with pytest.raises(psycopg2.errors.InvalidObjectDefinition) as e:
        q(user, "SELECT tuvl.register_workflow(%s)", (source,))
    assert f"{path}: {message}" in str(e.value), str(e.value)
    assert findings(user, source) == [("error", path, message)]


def test_a_ref_cycle_in_a_human_form_is_refused(user):
    source = (f"name: {new_name('form')}\nsteps:\n  - id: ask\n    kind: Human\n"
              f"    form: {json.dumps({'$ref': '#/$defs/f', '$defs': {'f': {'$ref': '#/$defs/f'}}})}\n")
    rows = findings(user, source)
    assert [r for r in rows if r[1] == 'steps[0].form["$defs"].f["$ref"]'
            and r[2].startswith("$ref cycle: #/$defs/f -> #/$defs/f")], rows


def test_a_ref_cycle_in_a_guardrail_schema_is_refused(user):
    schema = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    with pytest.raises(psycopg2.Error) as e:
        q(user, "SELECT tuvl.register_artifact(%s)", (
            f"name: {new_name('g')}\ntype: guardrail\nchecks:\n"
            f"  - {{ check: json_schema, schema: {json.dumps(schema)} }}\n",))
    assert '$ref cycle: #/$defs/a -> #/$defs/b -> #/$defs/a' in str(e.value), str(e.value)


def test_a_ref_that_does_not_resolve_is_refused(user):
    for ref in ("#/$defs/missing", "#", "other.json#/$defs/a", "#/$defs/a/properties/x"):
        schema = {"$defs": {"a": {"properties": {"x": {"type": "string"}}}},
                  "properties": {"y": {"$ref": ref}}}
        rows = findings(user, input_workflow(new_name("ref"), schema))
        assert [r for r in rows if r[1] == 'trigger.input.properties.y["$ref"]'
                and "$ref must name a schema of this document" in r[2]], (ref, rows)


def test_a_recursive_schema_that_descends_into_the_value_still_works(user):
    name = new_name("tree")
    tree = {"$ref": "#/$defs/node",
            "$defs": {"node": {"type": "object", "required": ["v"],
                               "properties": {"v": {"type": "integer"},
                                              "children": {"type": "array",
                                                           "items": {"$ref": "#/$defs/node"}}}}}}
    q(user, "SELECT tuvl.register_workflow(%s)", (input_workflow(name, tree),))
    deep = {"v": 0}
    for i in range(1, 50):
        deep = {"v": i, "children": [deep, {"v": -i}]}
    run_id = q1(user, "SELECT tuvl.start_run(%s, %s::jsonb)", (name, json.dumps(deep)))
    assert q1(user, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(user, "SELECT tuvl.start_run(%s, %s::jsonb)",
          (name, json.dumps({"v": 1, "children": [{"v": 2, "children": [{"v": "three"}]}]})))
    assert "At $.children[0].children[0].v: expected integer, got string" in str(e.value)


def test_a_chain_of_refs_longer_than_the_validator_follows_is_refused(user):
    def chain(n):
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
        defs[f"d{n - 1}"] = {"type": "object"}
        return {"$ref": "#/$defs/d0", "$defs": defs}

    # 100 $ref in a row (the root's and 99 more) are fine, 101 are not
    q(user, "SELECT tuvl.register_workflow(%s)", (input_workflow(new_name("ch"), chain(100)),))
    started = time.monotonic()
    rows = findings(user, input_workflow(new_name("ch"), chain(20000)))
    took = time.monotonic() - started
    assert rows == [("error", 'trigger.input["$defs"].d99["$ref"]',
                     "more than 100 $ref in a row apply to one value, from #/$defs/d0")], rows
    rows = findings(user, input_workflow(new_name("ch"), chain(101)))
    assert len(rows) == 1 and rows[0][2].startswith("more than 100 $ref in a row"), rows
    assert took < 5, took


def test_a_schema_nested_100000_levels_deep_is_a_clear_error(user):
    text = '{"items": ' * 100000 + '{"type": "string"}' + "}" * 100000
    source = f"name: deep\ntrigger:\n  input: {text}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: SELECT 1 }}\n"
    with pytest.raises(psycopg2.errors.ProgramLimitExceeded) as e:
        q(user, "SELECT tuvl.register_workflow(%s)", (source,))
    assert "nested too deeply" in str(e.value) or "tuvl.max_source_size" in str(e.value), str(e.value)
    text = '{"items": ' * 10000 + '{"type": "string"}' + "}" * 10000
    source = f"name: deep\ntrigger:\n  input: {text}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: SELECT 1 }}\n"
    rows = findings(user, source)
    assert len(rows) == 1 and rows[0][2].startswith("workflow YAML is nested too deeply"), rows


def test_a_cyclic_schema_stored_before_is_a_clear_error_at_start_and_submit(bnd, user, conns):
    """A schema registered before cycles were refused (here: written into the
    stored definition by hand) gives a validation error naming the cycle, not
    a stack overflow; a Human step waiting on such a form says so at submit."""
    admin = conns(bnd)
    name = new_name("old")
    q(user, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
trigger:
  input: {{ type: object }}
steps:
  - id: ask
    kind: Human
    form: {{ type: object }}
""",))
    cyclic = {"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]},
                                             "b": {"$ref": "#/$defs/a"}}}
    run_id = q1(user, "SELECT tuvl.start_run(%s, '{}')", (name,))
    assert q1(user, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "waiting_human"
    q(admin, "UPDATE tuvl.workflows SET definition = jsonb_set(jsonb_set(definition, "
             "'{trigger,input}', %s::jsonb), '{steps,0,form}', %s::jsonb) WHERE name = %s",
      (json.dumps(cyclic), json.dumps(cyclic), name))
    fresh = conns(bnd, user=ROLE)
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(fresh, "SELECT tuvl.start_run(%s, '{}')", (name,))
    assert "more than 100 $ref in a row apply to this value; the schema's $ref form a cycle" \
        in str(e.value), str(e.value)
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(fresh, "SELECT tuvl.submit(%s, '{}')", (run_id,))
    assert "the schema's $ref form a cycle" in str(e.value), str(e.value)
    q(admin, "SELECT tuvl.abort_run(%s)", (run_id,))


# ---------------------------------------------------------------------------
# 4. Numbers in responses


class _ModelHandler(BaseHTTPRequestHandler):
    """A model that answers "hello" with the usage its name asks for."""
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    usages = {}

    def log_message(self, fmt, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        usage = self.usages.get(body.get("model"), {})
        if self.path.endswith("/messages"):
            out = {"id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
                   "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
                   "usage": usage}
        elif self.path.endswith("/responses"):
            out = {"id": "resp_1", "object": "response", "status": "completed",
                   "output": [{"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": "hello"}]}],
                   "usage": usage}
        else:
            out = {"id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model"),
                   "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "hello"}}],
                   "usage": usage}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def model_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ModelHandler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


SHAPES = {
    "openai": ("prompt_tokens", {"completion_tokens": 3}),
    "anthropic": ("input_tokens", {"output_tokens": 3}),
    "openai_responses": ("input_tokens", {"output_tokens": 3}),
}
BAD = {"huge": 1e30, "negative": -5, "text": "lots", "int32_plus_one": 2 ** 31, "fraction": 1.5}


def usage_agent(conn, url, provider, usage, autonomous=False):
    name = new_name("u")
    _ModelHandler.usages[name] = usage
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: {provider}\nbase_url: {url}\nmodel: {name}\ntimeout: 10s\n",))
    if autonomous:
        agent = ("    mode: autonomous\n    agent:\n"
                 f"      model: {name}\n      steering: Say hello.\n      tools: [ {{ ref: note }} ]\n")
        extra = "  - { id: note, kind: Functional, function: bd.note, description: Take a note }\n"
    else:
        agent = f"    mode: completion\n    agent:\n      model: {name}\n      prompt: Say hello.\n"
        extra = ""
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - id: ask
    kind: Agent
{agent}    routes: {{ default: done, error: oops }}
{extra}ends:
  - {{ id: done, status: completed, response: {{ answer: "{{{{ ask_result }}}}" }} }}
  - {{ id: oops, status: completed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
""",))
    return name


@pytest.mark.parametrize("provider", sorted(SHAPES))
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_usage_count_that_is_not_a_count_takes_the_error_route(user, model_server, provider, bad):
    key, rest = SHAPES[provider]
    name = usage_agent(user, model_server, provider, dict(rest, **{key: BAD[bad]}))
    res = run_to_end(user, name, {}, 60)
    assert res["status"] == "completed" and res["end"] == "oops", res
    assert res["response"]["type"] == "bad_response", res
    shown = {"huge": "1000000000000000000000000000000", "negative": "-5", "text": '"lots"',
             "int32_plus_one": "2147483648", "fraction": "1.5"}[bad]
    assert res["response"]["error"] == (
        f"the model's response is malformed: usage.{key} is {shown}, not a token count "
        "(a whole number from 0 to 2147483647)"), res
    # the answer is journaled as it came
    turns = events(user, res["run_id"], "llm_turn")
    assert len(turns) == 1, turns
    assert turns[0]["response"]["usage"][key] == BAD[bad] or bad == "huge", turns[0]
    assert turns[0]["error"] == res["response"]["error"]


def test_usage_counts_that_add_up_past_an_integer_take_the_error_route(user, model_server):
    name = usage_agent(user, model_server, "anthropic",
                       {"input_tokens": 2 ** 31 - 1, "output_tokens": 2 ** 31 - 1})
    res = run_to_end(user, name, {}, 60)
    assert res["response"]["type"] == "bad_response", res
    assert "usage.input_tokens and usage.output_tokens add up to 4294967294" in res["response"]["error"]


@pytest.mark.parametrize("usage", [{"prompt_tokens": 7, "completion_tokens": 3},
                                   {"prompt_tokens": None, "completion_tokens": 3,
                                    "prompt_tokens_details": None},
                                   {"prompt_tokens": 7.0, "completion_tokens": 3}])
def test_usage_counts_that_are_counts_are_taken(user, model_server, usage):
    name = usage_agent(user, model_server, "openai", usage)
    res = run_to_end(user, name, {}, 60)
    assert res["end"] == "done" and res["response"]["answer"] == "hello", res
    total = (usage["prompt_tokens"] or 0) + usage["completion_tokens"]
    assert events(user, res["run_id"], "llm_turn")[0]["tokens"]["total"] == total


def test_a_bad_usage_count_in_an_autonomous_agent_takes_the_error_route(user, model_server):
    name = usage_agent(user, model_server, "openai", {"prompt_tokens": 1e30, "completion_tokens": 1},
                       autonomous=True)
    res = run_to_end(user, name, {}, 60)
    assert res["end"] == "oops" and res["response"]["type"] == "bad_response", res


class _HugeCodeHandler(_McpHandler):
    """The scripted MCP server, whose tool "hugecode" fails with a JSON-RPC
    error code no integer holds."""

    _body = None

    def read_body(self):
        # one handler serves the requests of a keep-alive connection: read each once
        if self._body is None:
            self._body = super().read_body()
        return self._body

    def do_POST(self):
        self._body = None
        msg = json.loads(self.read_body())
        if msg.get("method") == "tools/call" and msg["params"]["name"] == "hugecode":
            return self.send(200, json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                                              "error": {"code": 1e30, "message": "scripted failure"}}))
        return super().do_POST()


class _HugeCodeServer(ScriptedMcpServer):
    def __init__(self):
        self.sessions = set()
        self.counter = 0
        super(ScriptedMcpServer, self).__init__(_HugeCodeHandler)


def test_an_mcp_error_code_past_an_integer_is_shown_as_it_came(user):
    srv = _HugeCodeServer()
    try:
        name = new_name("mcp")
        q(user, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - id: call
    kind: MCP
    mcp: {{ url: "{srv.url}", tool: hugecode, arguments: {{}} }}
    routes: {{ error: oops }}
ends:
  - {{ id: oops, status: completed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
""",))
        res = run_to_end(user, name, {}, 60)
    finally:
        srv.close()
    assert res["response"] == {"type": "mcp_error", "error": "MCP tools/call failed: scripted failure"}, res
