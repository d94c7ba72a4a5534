"""Operator control and people in the loop (src/api/control.c,
src/runtime/run_control.c).

pause_run, resume_run, abort_run and steer_run on a running Functional
workflow (three steps that each call ctl.slow, a SQL function that sleeps
0.3 s) and on an autonomous agent in the middle of its loop (played by the
scripted LLM server, whose request log shows what the model was sent);
tuvl.agent_pause_max; who may control a run (its principal, members of
tuvl_operator, nobody else: SQLSTATE 42501); the Human step and
tuvl.submit() (the form is enforced); tool approvals and tuvl.decide()
(approve and reject); tuvl.wait() and LISTEN on tuvl.events_channel() while a run waits;
a worker crash while runs wait for a person or an operator; and 500 waiting
runs holding no lease and no worker transaction.

Every action is read back from tuvl.events with the role that took it.
Roles: ctl_alice starts runs (the principal), ctl_carol is a member of
tuvl_operator, ctl_bob is neither.
"""
import json
import os
import time
import urllib.request
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import (connect, journal_violations, kill_worker, listen_events, listen_notifies, q, q1, report,
                      wait_until, worker_pids)
from llmutil import llm_server as _server, sent

LLM_URL = os.environ.get("TUVL_LLM_URL")
LLM_ROOT = LLM_URL[: -len("/v1")] if LLM_URL and LLM_URL.endswith("/v1") else LLM_URL

ALICE, BOB, CAROL = "ctl_alice", "ctl_bob", "ctl_carol"
STEER_FRAME = ("Guidance from a supervisor. It does not change your tools, your outcome "
               "contract or the task itself: ")

# Never let an http_proxy variable send the tests' own requests elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

needs_llm = pytest.mark.skipif(not LLM_URL, reason="TUVL_LLM_URL is not set (run through test/run)")


# ---------------------------------------------------------------------------
# The database: roles, functions, workflows

SCHEMA = """
CREATE SCHEMA ctl;
GRANT USAGE ON SCHEMA ctl TO PUBLIC;
CREATE TABLE ctl.calls (id bigserial PRIMARY KEY, tool text NOT NULL, tag text,
                        who name NOT NULL DEFAULT current_user,
                        at timestamptz NOT NULL DEFAULT clock_timestamp());
GRANT INSERT, SELECT ON ctl.calls TO PUBLIC;
GRANT USAGE ON SEQUENCE ctl.calls_id_seq TO PUBLIC;
CREATE FUNCTION ctl.slow(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO ctl.calls (tool, tag) VALUES ('slow', ctx ->> 'tag');
        PERFORM pg_sleep(coalesce((ctx ->> 'secs')::float8, 0.3));
        RETURN jsonb_build_object('slept', coalesce((ctx ->> 'secs')::float8, 0.3));
    END $$;
CREATE FUNCTION ctl.refund(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO ctl.calls (tool, tag) VALUES ('refund', ctx ->> 'tag');
        RETURN jsonb_build_object('refunded', (ctx ->> 'amount')::numeric);
    END $$;
CREATE FUNCTION ctl.tick(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    SELECT pg_sleep(0.01); SELECT '{}'::jsonb $$;
"""

SLOW = """
name: slow3
steps:
  - { id: a, kind: Functional, function: ctl.slow, output: a }
  - { id: b, kind: Functional, function: ctl.slow, output: b }
  - { id: c, kind: Functional, function: ctl.slow, output: c, routes: { default: done } }
ends:
  - { id: done, status: completed, response: { a: "{{ a.slept }}", c: "{{ c.slept }}" } }
"""

EXPENSE = """
name: expense
trigger:
  input: { type: object, required: [amount], properties: { amount: { type: number } } }
steps:
  - id: review
    kind: Human
    description: A manager approves or rejects the expense
    form:
      type: object
      required: [approved]
      properties:
        approved: { type: boolean }
        comment: { type: string, maxLength: 200 }
    output: review
  - id: route
    kind: Router
    on: "{{ review.approved }}"
    routes: { "true": paid, default: refused }
ends:
  - { id: paid, status: completed, response: { paid: "{{ amount }}", comment: "{{ review.comment }}" } }
  - { id: refused, status: completed, response: { paid: 0 } }
"""

# 30 steps of 10 ms: a run that is always between two short steps.
TICKER = "name: ticker\nsteps:\n" + "".join(
    f"  - {{ id: t{i}, kind: Functional, function: ctl.tick }}\n" for i in range(30))


@pytest.fixture(scope="module")
def ctldb(db):
    admin = connect("postgres")
    try:
        for role in (ALICE, BOB, CAROL):
            q(admin, f"DROP ROLE IF EXISTS {role}")
            q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
        q(admin, f"GRANT tuvl_operator TO {CAROL}")
    finally:
        admin.close()
    conn = connect(db)
    try:
        q(conn, SCHEMA)
        for source in (SLOW, EXPENSE, TICKER):
            q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    finally:
        conn.close()
    yield db
    conn = connect(db)
    admin = connect("postgres")
    try:
        for role in (ALICE, BOB, CAROL):
            q(conn, f"DROP OWNED BY {role}")
            q(admin, f"DROP ROLE IF EXISTS {role}")
    finally:
        conn.close()
        admin.close()


@pytest.fixture
def conn(ctldb, conns):
    """A superuser connection to the module's database."""
    return conns(ctldb)


@pytest.fixture
def as_role(ctldb, conns):
    """as_role(name): a connection of that role to the module's database."""
    return lambda role: conns(ctldb, user=role)


# ---------------------------------------------------------------------------
# Runs and the journal


def start(conn, workflow, data=None):
    return q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (workflow, json.dumps(data or {})))


def wait(conn, run_id, timeout=15):
    """tuvl.wait(); returns (status, seconds it took)."""
    t0 = time.monotonic()
    status = q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))
    return status, time.monotonic() - t0


def run_row(conn, run_id):
    cols = ("status", "current_step", "end_name", "response", "error", "context", "control",
            "step_state", "lease_owner", "lease_expires_at", "attempt", "finished_at")
    row = q(conn, f"SELECT {', '.join(cols)} FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    return dict(zip(cols, row))


def events(conn, run_id, *types):
    """[(seq, type, agent_id, payload)] of a run in seq order, only `types` when given."""
    rows = q(conn, "SELECT seq, type, agent_id, payload FROM tuvl.events WHERE run_id = %s "
                   "ORDER BY seq", (run_id,))
    return [r for r in rows if not types or r[1] in types]


def types_of(conn, run_id):
    return [e[1] for e in events(conn, run_id)]


def wait_running(conn, run_id):
    """Until a worker holds the run (its first step is executing)."""
    wait_until(lambda: q1(conn, "SELECT status = 'running' AND lease_owner IS NOT NULL "
                                "FROM tuvl.runs WHERE id = %s", (run_id,)),
               10, interval=0.01, message=f"run {run_id} to be claimed")


def calls_in_flight(conn, tag):
    """Is a step of the run sleeping in ctl.slow right now (seen from pg_stat_activity)?"""
    return q1(conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                    "AND wait_event = 'PgSleep'") > 0


def calls(conn, tag):
    return [r[0] for r in q(conn, "SELECT tool FROM ctl.calls WHERE tag = %s ORDER BY id", (tag,))]


def sqlstate_of(excinfo):
    return excinfo.value.pgcode


def new_tag():
    return uuid.uuid4().hex[:10]


# ---------------------------------------------------------------------------
# The scripted LLM server and the agent workflow


def tool_call(name, **arguments):
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def agent(conn, turns, provider="openai", routes="{ default: done }", approval="approval: true"):
    """A script, a model config and a workflow `triage` of the same fresh name.

    The agent may call `slow` (ctl.slow) freely and `refund` (ctl.refund)
    only with a person's approval."""
    name = "c_" + uuid.uuid4().hex[:12]
    got = _server("POST", "/_script", {"name": name, "turns": turns})
    assert got["ok"], got
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: {name}\nprovider: {provider}\nbase_url: {LLM_URL}\nmodel: {name}\ntimeout: 10s\n",))
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: {name}
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: {name}
      tools:
        - {{ ref: slow }}
        - {{ ref: refund, {approval} }}
      max_iterations: 6
    routes: {routes}
  - id: slow
    kind: Functional
    description: Work for secs seconds
    function: ctl.slow
  - id: refund
    kind: Functional
    description: Refund an order
    function: ctl.refund
ends:
  - {{ id: done, status: completed, response: "{{{{ triage_result }}}}" }}
  - {{ id: stopped, status: completed, response: {{ stopped: "{{{{ _last_error }}}}" }} }}
""",))
    return name


def system_texts(provider, body):
    """The system messages of a request (Anthropic: its one system prompt)."""
    if provider == "openai":
        return [m["content"] for m in body["messages"] if m["role"] == "system"]
    return [body.get("system", "")]


def tool_answers(provider, body):
    """The tool results of a request, parsed, in order."""
    if provider == "openai":
        return [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]
    return [json.loads(b["content"]) for m in body["messages"] if m["role"] == "user"
            and isinstance(m["content"], list) for b in m["content"] if b["type"] == "tool_result"]


def wait_requests(name, n):
    wait_until(lambda: len([r for r in sent(name) if r["status"] == 200]) >= n, 10,
               message=f"{n} answered model requests")


# ---------------------------------------------------------------------------
# A running Functional workflow


def test_pause_and_resume_between_steps_of_a_functional_run(conn, as_role):
    alice, carol = as_role(ALICE), as_role(CAROL)
    tag = new_tag()
    run_id = start(alice, "slow3", {"tag": tag})
    wait_running(conn, run_id)
    q(carol, "SELECT tuvl.pause_run(%s)", (run_id,))
    # a directive for the worker holding the run, applied at the next step boundary
    assert q1(conn, "SELECT control FROM tuvl.runs WHERE id = %s", (run_id,)) == \
        {"pause": {"by": CAROL}}
    status, took = wait(alice, run_id)
    assert status == "paused" and took < 3, (status, took)

    row = run_row(conn, run_id)
    assert (row["status"], row["current_step"], row["control"]) == ("paused", "b", None)
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    # the step in progress finished; the next one did not start
    assert calls(conn, tag) == ["slow"]
    assert events(conn, run_id)[-1][1:] == ("paused", "b", {"step": "b", "by": CAROL})
    seq = q1(conn, "SELECT last_seq FROM tuvl.runs WHERE id = %s", (run_id,))
    time.sleep(0.7)
    assert q1(conn, "SELECT (status, last_seq)::text FROM tuvl.runs WHERE id = %s",
              (run_id,)) == f"(paused,{seq})", "a paused run does nothing"
    # pausing again is a no-op with a notice
    q(alice, "SELECT tuvl.pause_run(%s)", (run_id,))
    assert any(f"run {run_id} is already paused" in n for n in alice.notices)

    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    assert wait(alice, run_id)[0] == "completed"
    row = run_row(conn, run_id)
    assert row["response"] == {"a": 0.3, "c": 0.3} and row["control"] is None
    assert calls(conn, tag) == ["slow"] * 3
    assert [e[1:] for e in events(conn, run_id, "paused", "resumed")] == [
        ("paused", "b", {"step": "b", "by": CAROL}), ("resumed", "b", {"by": ALICE})]
    # resumed from its checkpoint: each step started exactly once
    assert [e[2] for e in events(conn, run_id, "agent_started")] == ["a", "b", "c"]
    assert journal_violations(conn, [run_id]) == []


def start_executing(conn, role, secs):
    """A slow3 run of role whose steps take secs each, once its first step
    is executing; returns its id and tag."""
    tag = new_tag()
    run_id = start(role, "slow3", {"tag": tag, "secs": secs})
    wait_until(lambda: calls_in_flight(conn, tag), 10, interval=0.01,
               message="the first step to be executing")
    return run_id, tag


def test_a_directive_nobody_takes_is_cleared_when_the_run_ends(conn, as_role):
    """A steer for a run without agents stays in control while the run goes
    on, and the run's end clears it (a statement of its own: the checkpoint
    that ends a run assigns control only when it changes the directives)."""
    alice, carol = as_role(ALICE), as_role(CAROL)
    run_id, _ = start_executing(conn, alice, 0.3)
    q(carol, "SELECT tuvl.steer_run(%s, 'be brief')", (run_id,))
    steer = run_row(conn, run_id)["control"]["steer"]
    assert [m["message"] for m in steer.values()] == ["be brief"]
    assert wait(alice, run_id)[0] == "completed"
    row = run_row(conn, run_id)
    assert row["control"] is None and row["response"] == {"a": 0.3, "c": 0.3}
    assert journal_violations(conn, [run_id]) == []


def test_abort_interrupts_the_step_in_progress(conn, as_role):
    alice, carol = as_role(ALICE), as_role(CAROL)
    run_id, tag = start_executing(conn, alice, 30)
    q(carol, "SELECT tuvl.abort_run(%s, 'wrong customer')", (run_id,))
    status, took = wait(alice, run_id)
    # a step of 30 s is cancelled at once, not awaited
    assert status == "aborted" and took < 2, (status, took)
    row = run_row(conn, run_id)
    assert row["error"] == f"aborted by {CAROL}: wrong customer"
    assert row["finished_at"] is not None and row["lease_owner"] is None and row["control"] is None
    # what the interrupted step did is rolled back with it
    assert calls(conn, tag) == []
    assert types_of(conn, run_id)[-1] == "run_aborted"
    assert events(conn, run_id)[-1][3] == {"step": "a", "reason": "wrong customer", "by": CAROL,
                                           "status": "aborted"}
    # an ended run cannot be controlled any more
    for sql in ("SELECT tuvl.abort_run(%s)", "SELECT tuvl.pause_run(%s)",
                "SELECT tuvl.resume_run(%s)", "SELECT tuvl.steer_run(%s, 'late')"):
        with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as e:
            q(alice, sql, (run_id,))
        assert "its status is aborted" in str(e.value)
    assert journal_violations(conn, [run_id]) == []


@pytest.mark.parametrize("directive,event", [("pause", "paused"), ("abort", "run_aborted")])
def test_a_failure_after_the_fenced_update_at_a_boundary_keeps_checkpoint_and_journal_together(
        conn, as_role, directive, event):
    """The journal write of a boundary stop (pause, abort) fails after the
    fenced UPDATE of tuvl.runs: the UPDATE rolls back with it, so the run
    never shows a checkpoint whose events are missing.  The failure is
    injected by a trigger on tuvl.journal that refuses a block holding the
    boundary's event; the worker then fails the run, journaling run_failed
    in order."""
    alice, carol = as_role(ALICE), as_role(CAROL)
    tag = new_tag()
    q(conn, f"""
        CREATE FUNCTION ctl.refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF EXISTS (SELECT 1 FROM tuvl._journal_events(NEW.seq, NEW.events) e
                           WHERE e.type = '{event}') THEN
                    RAISE EXCEPTION 'injected: the journal refuses {event}';
                END IF;
                RETURN NEW;
            END $$;
        CREATE TRIGGER refuse_{event} BEFORE INSERT ON tuvl.journal FOR EACH ROW
            EXECUTE FUNCTION ctl.refuse_event();
    """)
    try:
        run_id = start(alice, "slow3", {"tag": tag, "secs": 0.5})
        wait_until(lambda: calls_in_flight(conn, tag), 10, interval=0.01,
                   message="the first step to be executing")
        q(carol, f"SELECT tuvl.{directive}_run(%s)", (run_id,))
        status, _ = wait(alice, run_id)
        assert status == "failed", status
        row = run_row(conn, run_id)
        assert f"injected: the journal refuses {event}" in row["error"], row["error"]
        types = types_of(conn, run_id)
        assert event not in types and types[-1] == "run_failed", types
        # no checkpoint of the stop: never paused, never aborted
        assert "paused" not in [e[3].get("status") for e in events(conn, run_id, "checkpoint")]
        assert journal_violations(conn, [run_id]) == []
    finally:
        q(conn, f"DROP TRIGGER refuse_{event} ON tuvl.journal; DROP FUNCTION ctl.refuse_event()")


def test_abort_of_a_paused_run_ends_it_at_once(conn, as_role):
    alice = as_role(ALICE)
    run_id = start(alice, "slow3", {"tag": new_tag()})
    wait_running(conn, run_id)
    q(alice, "SELECT tuvl.pause_run(%s)", (run_id,))
    assert wait(alice, run_id)[0] == "paused"
    q(alice, "SELECT tuvl.abort_run(%s)", (run_id,))
    # nobody held the run: abort_run() itself ended it and journaled that
    row = run_row(conn, run_id)
    assert (row["status"], row["error"]) == ("aborted", f"aborted by {ALICE}")
    assert events(conn, run_id)[-2:][0][1] == "paused"
    assert events(conn, run_id)[-1][1:] == ("run_aborted", None, {
        "step": "b", "by": ALICE, "reason": None, "status": "aborted"})


def test_resume_before_the_pause_took_effect_withdraws_it(conn, as_role):
    alice = as_role(ALICE)
    run_id = start(alice, "slow3", {"tag": new_tag(), "secs": 0.5})
    wait_running(conn, run_id)
    q(alice, "SELECT tuvl.pause_run(%s)", (run_id,))
    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    assert any("had not paused yet; its pause request was withdrawn" in n for n in alice.notices)
    assert q1(conn, "SELECT control FROM tuvl.runs WHERE id = %s", (run_id,)) is None
    assert wait(alice, run_id)[0] == "completed"
    assert events(conn, run_id, "paused", "resumed") == []


def test_a_queued_run_is_paused_at_once_and_resumed_from_the_start(conn, as_role):
    alice = as_role(ALICE)
    alice.autocommit = False
    run_id = start(alice, "slow3", {"tag": new_tag(), "secs": 0})
    q(alice, "SELECT tuvl.pause_run(%s)", (run_id,))  # before any worker could see it
    alice.commit()
    alice.autocommit = True
    row = run_row(conn, run_id)
    assert (row["status"], row["current_step"], row["attempt"]) == ("paused", None, 0)
    assert types_of(conn, run_id) == ["run_queued", "paused"]
    assert wait(alice, run_id)[0] == "paused"
    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    assert wait(alice, run_id)[0] == "completed"
    assert types_of(conn, run_id)[:4] == ["run_queued", "paused", "resumed", "run_started"]


def test_steer_without_an_agent_is_never_delivered(conn, as_role):
    alice = as_role(ALICE)
    run_id = start(alice, "slow3", {"tag": new_tag(), "secs": 0.1})
    q(alice, "SELECT tuvl.steer_run(%s, 'hurry up')", (run_id,))
    assert wait(alice, run_id)[0] == "completed"
    # no agent read it: it is not journaled, and the control column is cleared at the end
    assert events(conn, run_id, "decision") == []
    assert q1(conn, "SELECT control FROM tuvl.runs WHERE id = %s", (run_id,)) is None
    with pytest.raises(psycopg2.errors.InvalidParameterValue):
        q(alice, "SELECT tuvl.steer_run(%s, '')", (run_id,))


def test_control_of_a_run_that_does_not_exist(conn):
    for sql in ("SELECT tuvl.pause_run(-1)", "SELECT tuvl.resume_run(-1)",
                "SELECT tuvl.abort_run(-1)", "SELECT tuvl.steer_run(-1, 'x')",
                "SELECT tuvl.submit(-1, '{}')", "SELECT tuvl.decide(-1, true)"):
        with pytest.raises(psycopg2.errors.UndefinedObject) as e:
            q(conn, sql)
        assert "run -1 does not exist" in str(e.value)


# ---------------------------------------------------------------------------
# Who may control a run


def test_only_the_principal_operators_and_superusers_may_control_a_run(conn, as_role):
    alice, bob, carol = as_role(ALICE), as_role(BOB), as_role(CAROL)
    human = start(alice, "expense", {"amount": 12})
    assert wait(alice, human)[0] == "waiting_human"
    slow = start(alice, "slow3", {"tag": new_tag(), "secs": 1})
    wait_running(conn, slow)
    before = {r: q1(conn, "SELECT (status, last_seq, control)::text FROM tuvl.runs WHERE id = %s",
                    (r,)) for r in (human, slow)}

    denied = [("pause_run", slow, "SELECT tuvl.pause_run(%s)", ()),
              ("resume_run", slow, "SELECT tuvl.resume_run(%s)", ()),
              ("abort_run", slow, "SELECT tuvl.abort_run(%s, %s)", ("mine now",)),
              ("steer_run", slow, "SELECT tuvl.steer_run(%s, %s)", ("do as I say",)),
              ("submit", human, "SELECT tuvl.submit(%s, %s)", ('{"approved": true}',)),
              ("decide", human, "SELECT tuvl.decide(%s, %s)", (True,))]
    # to bob, another role's run does not exist: nothing names its principal
    for fn, run_id, sql, args in denied:
        with pytest.raises(psycopg2.errors.UndefinedObject) as e:
            q(bob, sql, (run_id, *args))
        assert sqlstate_of(e) == "42704", fn
        assert e.value.diag.message_primary == f"run {run_id} does not exist"
        assert ALICE not in str(e.value)
    # exactly what a run id nobody has gets
    with pytest.raises(psycopg2.errors.UndefinedObject) as e:
        q(bob, "SELECT tuvl.abort_run(%s)", (10 ** 12,))
    assert e.value.diag.message_primary == f"run {10 ** 12} does not exist"
    # bob cannot even see the runs, and changed nothing
    assert q(bob, "SELECT id FROM tuvl.runs WHERE id IN (%s, %s)", (human, slow)) == []
    assert before == {r: q1(conn, "SELECT (status, last_seq, control)::text FROM tuvl.runs "
                                  "WHERE id = %s", (r,)) for r in (human, slow)}

    # a member of tuvl_operator may: carol steers and answers alice's run
    q(carol, "SELECT tuvl.steer_run(%s, 'look at the receipt')", (human,))
    q(carol, "SELECT tuvl.submit(%s, '{\"approved\": false}')", (human,))
    assert wait(carol, human)[0] == "completed"
    assert run_row(conn, human)["end_name"] == "refused"
    assert events(conn, human, "decision")[0][3]["by"] == CAROL
    # the principal may: alice aborts her own run
    q(alice, "SELECT tuvl.abort_run(%s, 'changed my mind')", (slow,))
    assert wait(alice, slow)[0] == "aborted"
    assert events(conn, slow, "run_aborted")[0][3]["by"] == ALICE
    # and operators see it all
    assert q1(carol, "SELECT count(*) FROM tuvl.events WHERE run_id = %s", (slow,)) > 0


# ---------------------------------------------------------------------------
# The Human step


def test_a_human_step_waits_until_a_valid_submit(conn, conns, ctldb, as_role):
    alice, carol = as_role(ALICE), as_role(CAROL)
    listener = conns(ctldb)
    listen_events(listener)
    run_id = start(alice, "expense", {"amount": 42})
    status, took = wait(alice, run_id, timeout=10)
    assert status == "waiting_human" and took < 3, (status, took)

    # the checkpoint that parks the run is announced: a client shows the form from it
    got = listen_notifies(listener, 5, lambda ns: any(
        json.loads(n.payload)["run_id"] == run_id and json.loads(n.payload)["type"] == "checkpoint"
        for n in ns))
    note = next(json.loads(n.payload) for n in got
                if json.loads(n.payload)["run_id"] == run_id
                and json.loads(n.payload)["type"] == "checkpoint")
    assert note["agent_id"] == "review"
    (payload,) = q1(conn, "SELECT array_agg(payload) FROM tuvl.events WHERE run_id = %s AND seq = %s",
                    (run_id, note["seq"]))
    form = {"type": "object", "required": ["approved"],
            "properties": {"approved": {"type": "boolean"},
                           "comment": {"type": "string", "maxLength": 200}}}
    assert payload == {"step": "review", "status": "waiting_human",
                       "awaiting": {"kind": "human", "form": form}}
    row = run_row(conn, run_id)
    assert (row["status"], row["current_step"]) == ("waiting_human", "review")
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    assert row["step_state"]["awaiting"] == {"kind": "human", "form": form}

    # data that does not fit the form is refused, naming the path; nothing changes
    last_seq = q1(conn, "SELECT last_seq FROM tuvl.runs WHERE id = %s", (run_id,))
    for data, path in (({"approved": "yes"}, "$.approved"), ({"comment": "hi"}, "$"),
                       ({"approved": True, "comment": "x" * 201}, "$.comment")):
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            q(carol, "SELECT tuvl.submit(%s, %s)", (run_id, json.dumps(data)))
        assert sqlstate_of(e) == "22023"
        assert e.value.diag.message_primary == \
            'data submitted to step "review" does not match its schema'
        assert e.value.diag.message_detail.startswith(f"At {path}:"), e.value.diag.message_detail
    assert q1(conn, "SELECT (status, last_seq)::text FROM tuvl.runs WHERE id = %s",
              (run_id,)) == f"(waiting_human,{last_seq})"
    # a Human step is answered by submit(), not by the operator's resume or decide
    for sql in ("SELECT tuvl.resume_run(%s)", "SELECT tuvl.decide(%s, true)",
                "SELECT tuvl.pause_run(%s)"):
        with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
            q(carol, sql, (run_id,))

    answer = {"approved": True, "comment": "within budget"}
    q(carol, "SELECT tuvl.submit(%s, %s)", (run_id, json.dumps(answer)))
    assert wait(alice, run_id)[0] == "completed"
    row = run_row(conn, run_id)
    assert (row["end_name"], row["response"]) == ("paid", {"paid": 42, "comment": "within budget"})
    assert row["context"]["review"] == answer and row["step_state"] is None
    assert [e[1:3] for e in events(conn, run_id)][2:9] == [
        ("agent_started", "review"), ("checkpoint", "review"), ("decision", "review"),
        ("agent_completed", "review"), ("signal", "review"), ("checkpoint", "review"),
        ("agent_started", "route")]
    assert events(conn, run_id, "decision")[0][3] == {"action": "submit", "data": answer, "by": CAROL}
    assert events(conn, run_id, "agent_completed")[0][3]["output_key"] == "review"
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
        q(carol, "SELECT tuvl.submit(%s, %s)", (run_id, json.dumps(answer)))
    assert journal_violations(conn, [run_id]) == []


def test_abort_of_a_run_waiting_for_a_person(conn, as_role):
    alice = as_role(ALICE)
    run_id = start(alice, "expense", {"amount": 5})
    assert wait(alice, run_id)[0] == "waiting_human"
    q(alice, "SELECT tuvl.steer_run(%s, 'no hurry')", (run_id,))
    q(conn, "SELECT tuvl.abort_run(%s, 'duplicate')", (run_id,))
    row = run_row(conn, run_id)
    assert (row["status"], row["error"]) == ("aborted", "aborted by postgres: duplicate")
    assert events(conn, run_id)[-1][1:] == ("run_aborted", None, {
        "step": "review", "reason": "duplicate", "by": "postgres", "status": "aborted"})


# ---------------------------------------------------------------------------
# An autonomous agent in the middle of its loop


@needs_llm
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_steer_reaches_the_next_model_request(conn, as_role, provider):
    tag = new_tag()
    name = agent(conn, [tool_call("slow", tag=tag, secs=0.6), tool_call("slow", tag=tag, secs=0),
                        {"text": "done"}], provider=provider)
    run_id = start(as_role(ALICE), name, {"ticket": 1})
    wait_requests(name, 1)  # the first tool call is sleeping now
    carol = as_role(CAROL)
    messages = ["Prefer a refund over a voucher.", "Keep the answer short."]
    for m in messages:
        q(carol, "SELECT tuvl.steer_run(%s, %s)", (run_id, m))
    assert wait(conn, run_id)[0] == "completed"
    reqs = sent(name)
    assert len(reqs) == 3
    guidance = [STEER_FRAME + m for m in messages]
    assert not any(g in s for g in guidance for s in system_texts(provider, reqs[0]["body"]))
    for r in reqs[1:]:
        text = "\n".join(system_texts(provider, r["body"]))
        # once each, in the order given
        assert [text.count(g) for g in guidance] == [1, 1], text
        assert text.index(guidance[0]) < text.index(guidance[1])
    if provider == "openai":
        # after the answers of the turn they arrived in
        roles = [m["role"] for m in reqs[1]["body"]["messages"]]
        assert roles[-3:] == ["tool", "system", "system"], roles
    assert [e[2:] for e in events(conn, run_id, "decision")] == [
        ("triage", {"action": "steer", "iteration": 2, "by": CAROL, "message": m}) for m in messages]
    assert run_row(conn, run_id)["control"] is None
    assert journal_violations(conn, [run_id]) == []
    # the steer messages are part of the fixture: the replay takes them in at the same turn
    # and so asks the model exactly what the recording asked
    alice = as_role(ALICE)
    fixture = q1(alice, "SELECT tuvl.pin_run(%s)", (run_id,))
    steers = [e for e in fixture["effects"] if e["type"] == "steer"]
    assert [e["result"] for e in steers] == [{"message": m, "by": CAROL} for m in messages]
    result = q1(alice, "SELECT tuvl.replay(%s)", (json.dumps(fixture),))
    assert result["status"] == "completed" and result["effects_served"] == len(fixture["effects"]), result
    assert len(sent(name)) == 3, "a replay asks the model nothing"


@needs_llm
def test_pause_parks_an_agent_at_its_next_turn_and_resume_continues_it(conn, as_role):
    alice, carol = as_role(ALICE), as_role(CAROL)
    tag = new_tag()
    name = agent(conn, [tool_call("slow", tag=tag, secs=0.6), {"text": "finished"}])
    run_id = start(alice, name, {"ticket": 2})
    wait_requests(name, 1)
    q(carol, "SELECT tuvl.pause_run(%s)", (run_id,))
    status, took = wait(alice, run_id)
    assert status == "paused" and took < 3, (status, took)
    row = run_row(conn, run_id)
    assert row["lease_owner"] is None and row["current_step"] == "triage"
    assert set(row["control"]) == {"paused_at", "pause_max"} and row["control"]["pause_max"] is True
    assert calls(conn, tag) == ["slow"] and len(sent(name)) == 1
    paused, checkpoint = events(conn, run_id)[-2:]
    assert paused[1:] == ("paused", "triage", {"step": "triage", "iteration": 2, "by": CAROL})
    assert checkpoint[1:3] == ("checkpoint", "triage") and checkpoint[3]["status"] == "paused"
    time.sleep(0.5)
    assert len(sent(name)) == 1, "a paused agent asks nothing"

    # guidance given while paused is delivered when it continues
    q(carol, "SELECT tuvl.steer_run(%s, 'Check the warranty first.')", (run_id,))
    q(alice, "SELECT tuvl.resume_run(%s)", (run_id,))
    assert wait(alice, run_id)[0] == "completed"
    row = run_row(conn, run_id)
    assert row["response"] == "finished" and row["control"] is None
    reqs = sent(name)
    assert len(reqs) == 2
    assert STEER_FRAME + "Check the warranty first." in system_texts("openai", reqs[1]["body"])
    assert [e[1:3] for e in events(conn, run_id, "paused", "resumed", "decision")] == [
        ("paused", "triage"), ("resumed", "triage"), ("decision", "triage")]
    assert events(conn, run_id, "resumed")[0][3] == {"by": ALICE}
    assert calls(conn, tag) == ["slow"]
    assert journal_violations(conn, [run_id]) == []


@needs_llm
def test_abort_during_a_tool_call_interrupts_it_and_sends_no_further_request(conn, as_role):
    tag = new_tag()
    name = agent(conn, [tool_call("slow", tag=tag, secs=30), tool_call("slow", tag=tag),
                        {"text": "never"}])
    run_id = start(as_role(ALICE), name, {"ticket": 3})
    wait_requests(name, 1)
    wait_until(lambda: calls_in_flight(conn, tag), 10, interval=0.01,
               message="the tool call to be executing")
    q(as_role(CAROL), "SELECT tuvl.abort_run(%s, 'customer withdrew')", (run_id,))
    status, took = wait(conn, run_id)
    assert status == "aborted" and took < 2, (status, took)
    time.sleep(0.3)
    assert len(sent(name)) == 1, "no model request after the abort"
    assert calls(conn, tag) == [], "the call in progress was interrupted and rolled back"
    row = run_row(conn, run_id)
    reason = f"aborted by {CAROL}: customer withdrew"
    assert row["context"]["_last_error"] == reason
    assert row["context"]["_last_error_type"] == "aborted"
    assert row["error"] == f'warning: step "triage" was aborted and has no route for "aborted": {reason}'
    done = events(conn, run_id, "agent_completed")[0][3]
    assert done == {"signal": "aborted", "error": reason}
    assert types_of(conn, run_id)[-1] == "run_aborted"
    assert journal_violations(conn, [run_id]) == []


@needs_llm
def test_abort_of_a_paused_agent_takes_its_aborted_route(conn, as_role):
    alice = as_role(ALICE)
    tag = new_tag()
    name = agent(conn, [tool_call("slow", tag=tag, secs=0.6), {"text": "never"}],
                 routes="{ default: done, aborted: stopped }")
    run_id = start(alice, name, {"ticket": 4})
    wait_requests(name, 1)
    q(alice, "SELECT tuvl.pause_run(%s)", (run_id,))
    assert wait(alice, run_id)[0] == "paused"
    q(alice, "SELECT tuvl.abort_run(%s, 'stale')", (run_id,))
    # re-queued: the agent, not abort_run(), takes the exit, so that it can be routed
    assert wait(alice, run_id)[0] == "completed"
    row = run_row(conn, run_id)
    assert (row["end_name"], row["response"]) == ("stopped", {"stopped": f"aborted by {ALICE}: stale"})
    assert len(sent(name)) == 1
    assert events(conn, run_id, "agent_completed")[0][3]["signal"] == "aborted"
    # the abort is part of the fixture: the replayed agent takes its aborted exit at the same turn
    fixture = q1(alice, "SELECT tuvl.pin_run(%s)", (run_id,))
    assert fixture["effects"][-1]["type"] == "abort"
    result = q1(alice, "SELECT tuvl.replay(%s)", (json.dumps(fixture),))
    assert (result["status"], result["end"], result["response"]) == \
        ("completed", "stopped", {"stopped": f"aborted by {ALICE}: stale"}), result


@needs_llm
def test_a_paused_agent_past_agent_pause_max_takes_its_aborted_exit(conn, as_role, set_gucs):
    set_gucs({"tuvl.agent_pause_max": ("1", "1s")})
    alice = as_role(ALICE)
    tag = new_tag()
    name = agent(conn, [tool_call("slow", tag=tag, secs=0.5), {"text": "never"}])
    run_id = start(alice, name, {"ticket": 5})
    # a paused Functional run is not bound by the limit
    plain = start(alice, "slow3", {"tag": tag, "secs": 0.2})
    wait_requests(name, 1)
    wait_running(conn, plain)
    q(alice, "SELECT tuvl.pause_run(%s)", (run_id,))
    q(alice, "SELECT tuvl.pause_run(%s)", (plain,))
    assert wait(alice, run_id)[0] == "paused"
    assert wait(alice, plain)[0] == "paused"
    paused_at = time.monotonic()

    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "aborted",
               8, interval=0.1, message="the paused agent to be aborted")
    waited = time.monotonic() - paused_at
    assert waited < 5, waited
    row = run_row(conn, run_id)
    reason = "aborted by tuvl: paused longer than tuvl.agent_pause_max (1 s)"
    assert row["context"]["_last_error"] == reason, row["context"]
    assert "agent_pause_max" in row["context"]["_last_error"]
    assert row["context"]["_last_error_type"] == "aborted"
    assert len(sent(name)) == 1
    assert types_of(conn, run_id)[-7:] == ["paused", "checkpoint", "resumed", "agent_completed",
                                           "signal", "checkpoint", "run_aborted"]
    resumed = events(conn, run_id, "resumed")[-1][3]
    assert resumed["by"] == "tuvl" and resumed["abort"] is True and "agent_pause_max" in resumed["reason"]
    assert run_row(conn, plain)["status"] == "paused"
    q(alice, "SELECT tuvl.abort_run(%s)", (plain,))


# ---------------------------------------------------------------------------
# Tool approvals


@needs_llm
@pytest.mark.parametrize("approved", [True, False])
def test_a_tool_marked_approval_waits_for_decide(conn, as_role, approved):
    alice, carol = as_role(ALICE), as_role(CAROL)
    tag = new_tag()
    name = agent(conn, [tool_call("refund", tag=tag, amount=30), {"text": "{{last_user}}"}])
    run_id = start(alice, name, {"ticket": 6})
    status, took = wait(alice, run_id)
    assert status == "waiting_approval" and took < 5, (status, took)
    row = run_row(conn, run_id)
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    assert calls(conn, tag) == [], "the tool waits for the decision"
    assert len(sent(name)) == 1
    # step_state keeps the model's answer, not its request or headers (the journal has them)
    kept = row["step_state"]["effects"][0]
    assert kept["op"] == "llm" and kept["status"] == 200 and kept["body"]["choices"], kept
    assert "headers" not in kept and "request" not in kept, kept
    asked, checkpoint = events(conn, run_id)[-2:]
    request = {"call": 1, "call_id": "call_0_0", "tool": "refund", "iteration": 1,
               "arguments": {"tag": tag, "amount": 30}}
    assert asked[1:] == ("approval_requested", "triage", request)
    assert checkpoint[1] == "checkpoint"
    assert checkpoint[3] == {"step": "triage", "status": "waiting_approval", "awaiting": request}
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
        q(carol, "SELECT tuvl.submit(%s, '{}')", (run_id,))

    note = "within policy" if approved else "too much"
    q(carol, "SELECT tuvl.decide(%s, %s, %s)", (run_id, approved, note))
    assert wait(alice, run_id)[0] == "completed"
    (decided,) = events(conn, run_id, "approval_decided")
    assert decided[2:] == ("triage", {"call": 1, "call_id": "call_0_0", "tool": "refund",
                                      "approved": approved, "note": note, "by": CAROL})
    reqs = sent(name)
    assert len(reqs) == 2
    answer = tool_answers("openai", reqs[1]["body"])
    if approved:
        assert calls(conn, tag) == ["refund"]
        assert answer == [{"refund_result": {"refunded": 30}}]
    else:
        assert calls(conn, tag) == []
        assert answer == [{"error": "rejected by approver: too much"}]
    # the final answer echoes the tool's answer
    assert run_row(conn, run_id)["response"] == answer[0]
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState):
        q(carol, "SELECT tuvl.decide(%s, true)", (run_id,))
    assert journal_violations(conn, [run_id]) == []


@needs_llm
def test_a_call_not_decided_within_its_approval_timeout_is_rejected(conn, as_role):
    """approval_timeout: the call waits that long for tuvl.decide(); then tuvl
    rejects it as decide(run, false, ...) would and the model is told so."""
    alice = as_role(ALICE)
    tag = new_tag()
    name = agent(conn, [tool_call("refund", tag=tag, amount=40), {"text": "{{last_user}}"}],
                 approval="approval: true, approval_timeout: 1s")
    run_id = start(alice, name, {"ticket": 8})
    assert wait(alice, run_id)[0] == "waiting_approval"
    asked = run_row(conn, run_id)
    assert q1(conn, "SELECT wake_at FROM tuvl.runs WHERE id = %s", (run_id,)) is not None
    wait_until(lambda: run_row(conn, run_id)["status"] == "completed", 10, interval=0.1,
               message="the approval to time out")
    assert calls(conn, tag) == [], "a rejected call does not run"
    (decided,) = events(conn, run_id, "approval_decided")
    note = "no decision within the approval_timeout of 1 s"
    assert decided[3] == {"call": 1, "call_id": "call_0_0", "tool": "refund", "approved": False,
                          "note": note, "by": "tuvl"}
    assert tool_answers("openai", sent(name)[1]["body"]) == [{"error": "rejected by approver: " + note}]
    assert q1(conn, "SELECT wake_at FROM tuvl.runs WHERE id = %s", (run_id,)) is None
    assert journal_violations(conn, [run_id]) == []
    assert asked["status"] == "waiting_approval"


def test_approval_timeout_is_checked(conn):
    def errors(entry):
        src = (f"name: v\nsteps:\n  - id: a\n    kind: Agent\n    mode: autonomous\n    agent:\n"
               f"      model: m\n      tools: [{entry}]\n    routes: {{ default: done }}\n"
               "  - { id: t, kind: Functional, description: T, function: ctl.refund }\n"
               "ends:\n  - { id: done }\n")
        return [(r[1], r[2]) for r in q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", (src,))
                if r[0] == "error" and r[1] != "steps[0].agent.model"]
    assert errors("{ ref: t, approval: true, approval_timeout: 30m }") == []
    (e,) = errors("{ ref: t, approval_timeout: 30m }")
    assert e[0] == "steps[0].agent.tools[0].approval_timeout" and "needs approval: true" in e[1]
    (e,) = errors("{ ref: t, approval: true, approval_timeout: soon }")
    assert e[0] == "steps[0].agent.tools[0].approval_timeout"


@needs_llm
def test_abort_of_an_agent_waiting_for_approval(conn, as_role):
    alice = as_role(ALICE)
    tag = new_tag()
    name = agent(conn, [tool_call("refund", tag=tag, amount=99), {"text": "never"}])
    run_id = start(alice, name, {"ticket": 7})
    assert wait(alice, run_id)[0] == "waiting_approval"
    q(alice, "SELECT tuvl.abort_run(%s, 'not needed')", (run_id,))
    status = wait(alice, run_id, timeout=8)[0]
    assert status == "aborted", (status, types_of(conn, run_id), run_row(conn, run_id)["control"])
    assert calls(conn, tag) == [] and len(sent(name)) == 1
    assert run_row(conn, run_id)["context"]["_last_error"] == f"aborted by {ALICE}: not needed"


@needs_llm
def test_a_null_decision_is_refused(conn):
    tag = new_tag()
    name = agent(conn, [tool_call("refund", tag=tag, amount=1), {"text": "{{last_user}}"}])
    run_id = start(conn, name, {"ticket": 8})
    assert wait(conn, run_id)[0] == "waiting_approval"
    with pytest.raises(psycopg2.Error):
        q(conn, "SELECT tuvl.decide(%s, NULL)", (run_id,))
    assert run_row(conn, run_id)["status"] == "waiting_approval"
    assert calls(conn, tag) == []


# ---------------------------------------------------------------------------
# A crash while runs wait


def test_crash_of_a_worker_leaves_waiting_runs_waiting(ctldb, server_log):
    conn = connect(ctldb)
    try:
        human = start(conn, "expense", {"amount": 7})
        paused = start(conn, "slow3", {"tag": new_tag(), "secs": 0.2})
        wait_running(conn, paused)
        q(conn, "SELECT tuvl.pause_run(%s)", (paused,))
        assert wait(conn, human)[0] == "waiting_human"
        assert wait(conn, paused)[0] == "paused"
        before = {r: run_row(conn, r) for r in (human, paused)}
        victim = worker_pids(ctldb)[0]
    finally:
        conn.close()
    kill_worker(victim, server_log)
    conn = connect(ctldb)
    try:
        want = int(q1(conn, "SHOW tuvl.workers_per_database"))
        wait_until(lambda: len(worker_pids(ctldb)) == want, 20, interval=0.1,
                   message="the workers to be back")
        time.sleep(1.5)  # a maintenance round and claims: nobody must take them
        for r in (human, paused):
            row = run_row(conn, r)
            assert row["status"] == before[r]["status"], row
            assert row["lease_owner"] is None and row["lease_expires_at"] is None
            assert row["attempt"] == before[r]["attempt"], "nobody claimed it"
            assert row["step_state"] == before[r]["step_state"]
        q(conn, "SELECT tuvl.submit(%s, '{\"approved\": true, \"comment\": \"after the crash\"}')",
          (human,))
        q(conn, "SELECT tuvl.resume_run(%s)", (paused,))
        assert wait(conn, human)[0] == "completed"
        assert wait(conn, paused)[0] == "completed"
        assert run_row(conn, human)["response"] == {"paid": 7, "comment": "after the crash"}
        assert journal_violations(conn, [human, paused]) == []
    finally:
        conn.close()


# ---------------------------------------------------------------------------
# Waiting costs nothing


def test_500_waiting_runs_hold_no_lease_and_no_transaction(conn, ctldb):
    t0 = time.monotonic()
    tickers = q1(conn, "SELECT array_agg(tuvl.start_run('ticker')) FROM generate_series(1, 250)")
    # let the workers take some: those are paused between two steps, the others while queued
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND "
                                "status = 'running'", (tickers,)) >= 100,
               10, interval=0.02, message="the workers to hold 100 ticker runs")
    humans = q1(conn, "SELECT array_agg(tuvl.start_run('expense', jsonb_build_object('amount', i))) "
                      "FROM generate_series(1, 250) i")
    pause_t0 = time.monotonic()
    for run_id in tickers:
        q(conn, "SELECT tuvl.pause_run(%s)", (run_id,))
    pausing = time.monotonic() - pause_t0
    ids = humans + tickers

    def settled():
        rows = dict(q(conn, "SELECT status, count(*) FROM tuvl.runs WHERE id = ANY(%s) GROUP BY 1",
                      (ids,)))
        return rows if set(rows) <= {"waiting_human", "paused"} else None

    counts = wait_until(settled, 30, interval=0.05, message="500 runs to settle")
    settle = time.monotonic() - t0
    assert counts == {"waiting_human": 250, "paused": 250}, counts
    held_when_paused = q1(conn, "SELECT count(DISTINCT run_id) FROM tuvl.events WHERE "
                                "run_id = ANY(%s) AND type = 'run_started'", (tickers,))
    assert held_when_paused >= 100

    leased = q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND "
                      "(lease_owner IS NOT NULL OR lease_expires_at IS NOT NULL)", (ids,))
    assert leased == 0
    # the workers are idle: no open transaction, none left idle in one
    worst = []
    for _ in range(5):
        rows = q(conn, "SELECT count(*), "
                       "  count(*) FILTER (WHERE state LIKE 'idle in transaction%%'), "
                       "  count(*) FILTER (WHERE xact_start < now() - interval '1 second'), "
                       "  count(*) FILTER (WHERE xact_start IS NOT NULL) "
                       "FROM pg_stat_activity WHERE backend_type = 'tuvl worker' AND datname = %s",
                 (ctldb,))[0]
        worst.append(rows)
        assert rows[0] == len(worker_pids(ctldb)) and rows[0] > 0
        assert rows[1] == 0 and rows[2] == 0, rows
        time.sleep(0.2)
    report(f"control: 500 waiting runs (250 waiting_human, 250 paused, {held_when_paused} of them "
           f"held by a worker when paused) settled in {settle:.2f} s (250 pause_run calls: "
           f"{pausing:.2f} s); runs with a lease: {leased}; tuvl workers: {worst[0][0]}, idle in "
           f"transaction: {max(w[1] for w in worst)}, in a transaction older than 1 s: "
           f"{max(w[2] for w in worst)}, in any transaction: {max(w[3] for w in worst)} "
           f"(5 samples over 1 s)")

    # and they are answered as cheaply: abort every one of them
    t1 = time.monotonic()
    q(conn, "SELECT count(tuvl.abort_run(id, 'cleanup')) FROM unnest(%s::bigint[]) id", (ids,))
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND status = 'aborted'",
              (ids,)) == 500
    report(f"control: aborting the 500 waiting runs in one statement took {time.monotonic() - t1:.2f} s")
