"""Runs as users see them: notifications, tuvl.wait, principals, visibility, failures."""
import json
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import (connect, journal_violations, listen_events, listen_notifies, q, q1, wait_until, worker_pids,
                      worker_rows)

ROLES = ["alice", "bob", "carol", "dave"]

SLOW_STEPS = ["n1", "n2", "n3"]

WORKFLOWS = [
    """
name: chatty
steps:
  - id: hello
    kind: Functional
    function: app.hello
  - id: pick
    kind: Router
    on: "{{ hello_result.mood }}"
    routes: { happy: count, default: sad_end }
  - id: count
    kind: ModelOp
    sql: SELECT count(*)::int AS n FROM generate_series(1, $1::int)
    params: ["{{ n }}"]
    output: counted
    routes: { default: done }
ends:
  - id: done
    status: completed
    response: { n: "{{ counted.0.n }}", mood: "{{ hello_result.mood }}" }
  - id: sad_end
    status: completed
""",
    """
name: napper
steps:
  - { id: nap, kind: Functional, function: app.nap }
ends:
  - { id: done, status: completed }
""",
    """
name: who
steps:
  - { id: who, kind: Functional, function: app.whoami, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ who_result }}" }
""",
    """
name: peek
steps:
  - id: peek
    kind: ModelOp
    sql: SELECT secret FROM app.secrets
ends:
  - { id: done, status: completed }
""",
    """
name: doomed
steps:
  - id: judge
    kind: Functional
    function: app.judge
    routes: { bad: rejected, default: accepted }
ends:
  - { id: accepted, status: completed }
  - { id: rejected, status: failed, response: { verdict: "{{ judge_result.why }}" } }
""",
    """
name: guarded
steps:
  - { id: boom, kind: Functional, function: app.boom, routes: { error: recover } }
  - { id: never, kind: Functional, function: app.hello }
  - { id: recover, kind: Functional, function: app.recover, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ recover_result }}" }
""",
    """
name: three_naps
steps:
  - { id: n1, kind: Functional, function: app.nap }
  - { id: n2, kind: Functional, function: app.nap }
  - { id: n3, kind: Functional, function: app.nap }
ends:
  - { id: done, status: completed }
""",
    """
name: escalate
steps:
  - { id: try, kind: Functional, function: app.escalate }
  - { id: after, kind: Functional, function: app.report_settings, routes: { default: done } }
ends:
  - { id: done, status: completed }
""",
    """
name: unmapped
steps:
  - { id: boom, kind: Functional, function: app.boom }
  - { id: never, kind: Functional, function: app.hello }
ends:
  - { id: done, status: completed }
""",
]


@pytest.fixture(scope="module")
def setup(db):
    admin = connect("postgres")
    for role in ROLES:
        try:
            q(admin, f"DROP ROLE IF EXISTS {role}")
        except psycopg2.Error:
            pass
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    q(admin, "GRANT tuvl_operator TO carol")
    conn = connect(db)
    q(conn, """
        CREATE SCHEMA app;
        GRANT USAGE ON SCHEMA app TO PUBLIC;
        CREATE TABLE app.calls (who name NOT NULL, session_who name NOT NULL,
                                at timestamptz NOT NULL DEFAULT clock_timestamp());
        GRANT INSERT, SELECT ON app.calls TO alice, bob;
        CREATE TABLE app.secrets (secret text);
        INSERT INTO app.secrets VALUES ('the cake is a lie');
        REVOKE ALL ON app.secrets FROM PUBLIC;
        CREATE FUNCTION app.hello(ctx jsonb) RETURNS jsonb LANGUAGE sql
            AS $$ SELECT jsonb_build_object('mood', coalesce(ctx ->> 'mood', 'happy')) $$;
        CREATE FUNCTION app.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql
            AS $$ BEGIN PERFORM pg_sleep((ctx ->> 'sleep')::float8); RETURN '{}'; END $$;
        CREATE FUNCTION app.whoami(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO app.calls (who, session_who) VALUES (current_user, session_user);
                RETURN jsonb_build_object('user', current_user, 'superuser',
                    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user),
                    'reads_secrets', has_table_privilege('app.secrets', 'SELECT'));
            END $$;
        CREATE FUNCTION app.judge(ctx jsonb) RETURNS jsonb LANGUAGE sql
            AS $$ SELECT jsonb_build_object('signal', 'bad', 'why', 'too risky') $$;
        CREATE FUNCTION app.recover(ctx jsonb) RETURNS jsonb LANGUAGE sql
            AS $$ SELECT jsonb_build_object('saw', ctx ->> '_last_error',
                                            'type', ctx ->> '_last_error_type') $$;
        CREATE FUNCTION app.escalate(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            DECLARE
                res jsonb := '{}';
                attempt text;
            BEGIN
                FOREACH attempt IN ARRAY ARRAY['SET SESSION AUTHORIZATION postgres',
                                               'SET ROLE postgres', 'RESET ROLE',
                                               'SELECT set_config(''role'', ''postgres'', false)',
                                               'SELECT pg_read_file(''postgresql.conf'')']
                LOOP
                    BEGIN
                        EXECUTE attempt;
                        res := res || jsonb_build_object(attempt, 'became ' || current_user);
                    EXCEPTION WHEN others THEN
                        res := res || jsonb_build_object(attempt, 'refused');
                    END;
                END LOOP;
                -- Settings changed for the session must not outlive the step.
                PERFORM set_config('search_path', 'pwned', false);
                PERFORM set_config('application_name', 'pwned', false);
                PERFORM set_config('statement_timeout', '1ms', false);
                RETURN res || jsonb_build_object('user', current_user);
            END $$;
        CREATE FUNCTION app.report_settings(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
            SELECT jsonb_build_object('user', current_user,
                                      'search_path', current_setting('search_path'),
                                      'application_name', current_setting('application_name'),
                                      'statement_timeout', current_setting('statement_timeout')) $$;
        CREATE FUNCTION app.boom(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql
            AS $$ BEGIN RAISE EXCEPTION 'boom: % is not allowed', ctx ->> 'what'; END $$;
    """)
    for wf in WORKFLOWS:
        q(conn, "SELECT tuvl.register_workflow(%s)", (wf,))
    conn.close()
    yield db
    conn = connect(db)
    q(conn, "DROP OWNED BY " + ", ".join(ROLES))
    conn.close()
    for role in ROLES:
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


def finished(conn, run_id, timeout="10 s"):
    return q1(conn, "SELECT tuvl.wait(%s, %s)", (run_id, timeout))


def test_listen_receives_every_journal_event_in_seq_order(setup, conns):
    listener = conns(setup)
    channel = listen_events(listener)
    starter = conns(setup)
    run_id = q1(starter, "SELECT tuvl.start_run('chatty', '{\"n\": 7}')")
    starter_pid = starter.get_backend_pid()

    def done(got):
        return any(json.loads(n.payload).get("run_id") == run_id and
                   json.loads(n.payload).get("type") in ("run_completed", "run_failed") for n in got)

    got = listen_notifies(listener, 10, done)
    mine = [(n, json.loads(n.payload)) for n in got if json.loads(n.payload).get("run_id") == run_id]
    assert all(n.channel == channel for n, _ in mine)
    heard = [(p["seq"], p["type"], p["agent_id"]) for _, p in mine]
    journal = q(listener, "SELECT seq, type, agent_id FROM tuvl.events WHERE run_id = %s "
                          "ORDER BY seq", (run_id,))
    assert heard == [tuple(r) for r in journal], "notifications must match the journal, in order"
    assert [s for s, _, _ in heard] == list(range(1, len(journal) + 1))
    assert heard[0][1] == "run_queued" and heard[-1][1] == "run_completed"
    assert [a for _, t, a in heard if t == "agent_started"] == ["hello", "pick", "count"]
    # run_queued comes from the starting session, everything else from one worker.
    senders = {n.pid for n, p in mine if p["type"] != "run_queued"}
    assert [n.pid for n, p in mine if p["type"] == "run_queued"] == [starter_pid]
    assert len(senders) == 1 and senders <= set(worker_pids(setup))
    status, response = q(listener, "SELECT status, response FROM tuvl.runs WHERE id = %s",
                         (run_id,))[0]
    assert (status, response) == ("completed", {"n": 7, "mood": "happy"})


def test_run_executes_synchronously_and_returns_the_outcome(setup, conns):
    conn = conns(setup)
    result = q1(conn, "SELECT tuvl.run('chatty', '{\"n\": 3}')")
    assert set(result) >= {"run_id", "status", "end", "response"}
    assert (result["status"], result["end"], result["response"]) == \
        ("completed", "done", {"n": 3, "mood": "happy"})
    # The other route of the Router, to an end without a response.
    result = q1(conn, "SELECT tuvl.run('chatty', '{\"n\": 3, \"mood\": \"grumpy\"}')")
    assert (result["status"], result["end"], result["response"]) == ("completed", "sad_end", None)
    assert journal_violations(conn, [result["run_id"]]) == []


def test_wait_returns_the_current_status_on_timeout_and_completed_when_done(setup, conns):
    conn = conns(setup)
    run_id = q1(conn, "SELECT tuvl.start_run('napper', '{\"sleep\": 2}')")
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "running",
               3, message="the run to be claimed")
    started = time.monotonic()
    status = q1(conn, "SELECT tuvl.wait(%s, '0.5 s')", (run_id,))
    waited = time.monotonic() - started
    assert status == "running"
    assert 0.4 <= waited < 1.5, f"wait(..., 0.5 s) returned after {waited:.2f} s"

    status = q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,))
    waited_all = time.monotonic() - started
    assert status == "completed"
    assert waited_all < 4, f"wait returned {waited_all:.2f} s after a 2 s step began"
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "completed"
    # On a finished run it returns at once.
    started = time.monotonic()
    assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "completed"
    assert time.monotonic() - started < 0.5


def test_wait_on_a_run_started_in_the_same_transaction_raises(setup, conns):
    conn = conns(setup, autocommit=False)
    q(conn, "SET LOCAL statement_timeout = '5s'")
    run_id = q1(conn, "SELECT tuvl.start_run('napper', '{\"sleep\": 0}')")
    started = time.monotonic()
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as err:
        q(conn, "SELECT tuvl.wait(%s, '3 s')", (run_id,))
    assert time.monotonic() - started < 1, "it must raise, not wait for the timeout"
    assert f"run {run_id} was started in this transaction" in str(err.value)
    conn.rollback()
    # After the rollback the run never existed.
    other = conns(setup)
    assert q1(other, "SELECT count(*) FROM tuvl.runs WHERE id = %s", (run_id,)) == 0
    # Committed first, the same call works.
    conn.autocommit = True
    run_id = q1(conn, "SELECT tuvl.start_run('napper', '{\"sleep\": 0}')")
    assert finished(conn, run_id) == "completed"


def test_a_run_executes_as_the_role_that_started_it(setup, conns):
    alice = conns(setup, user="alice")
    run_id = q1(alice, "SELECT tuvl.start_run('who')")
    assert finished(alice, run_id) == "completed"
    admin = conns(setup)
    principal, response, context = q(admin, "SELECT principal, response, context FROM tuvl.runs "
                                            "WHERE id = %s", (run_id,))[0]
    assert principal == "alice"
    assert response == {"user": "alice", "superuser": False, "reads_secrets": False}
    assert context["who_result"] == response
    # The worker executed it as alice, who is also the step's session user
    # (the worker's own, a superuser, is never a step's: see test_hardening.py).
    assert q(admin, "SELECT who, session_who FROM app.calls") == [("alice", "alice")]
    assert q1(admin, "SELECT payload ->> 'principal' FROM tuvl.events "
                     "WHERE run_id = %s AND type = 'run_started'", (run_id,)) == "alice"

    # The synchronous path too, and another role's run as that role.
    result = q1(alice, "SELECT tuvl.run('who')")
    assert result["response"] == {"user": "alice", "superuser": False, "reads_secrets": False}
    bob = conns(setup, user="bob")
    bob_run = q1(bob, "SELECT tuvl.start_run('who')")
    assert finished(bob, bob_run) == "completed"
    assert q1(admin, "SELECT principal FROM tuvl.runs WHERE id = %s", (bob_run,)) == "bob"
    assert q(admin, "SELECT who, count(*) FROM app.calls GROUP BY 1 ORDER BY 1") == \
        [("alice", 2), ("bob", 1)]


def test_modelop_on_a_table_the_principal_cannot_read_fails_the_run(setup, conns):
    alice = conns(setup, user="alice")
    run_id = q1(alice, "SELECT tuvl.start_run('peek')")
    assert finished(alice, run_id) == "failed"
    admin = conns(setup)
    status, error, context = q(admin, "SELECT status, error, context FROM tuvl.runs WHERE id = %s",
                               (run_id,))[0]
    assert status == "failed"
    assert "permission denied for table secrets" in error
    assert "the cake is a lie" not in json.dumps(context)
    events = q(admin, "SELECT type, payload FROM tuvl.events WHERE run_id = %s ORDER BY seq",
               (run_id,))
    assert events[-1][0] == "run_failed"
    assert "permission denied for table secrets" in events[-1][1]["error"]
    completed = [p for t, p in events if t == "agent_completed"]
    assert len(completed) == 1
    assert completed[0]["signal"] == "error" and completed[0]["sqlstate"] == "42501"
    assert journal_violations(admin, [run_id]) == []
    # The same workflow started by a role that may read the table completes.
    own = q1(admin, "SELECT tuvl.start_run('peek')")
    assert finished(admin, own) == "completed"
    assert q1(admin, "SELECT context -> 'peek_result' FROM tuvl.runs WHERE id = %s", (own,)) == \
        [{"secret": "the cake is a lie"}]


def test_roles_see_only_their_own_runs_and_operators_see_all(setup, conns):
    alice, bob, carol = (conns(setup, user=r) for r in ("alice", "bob", "carol"))
    a = q1(alice, "SELECT tuvl.start_run('napper', '{\"sleep\": 0}')")
    b = q1(bob, "SELECT tuvl.start_run('napper', '{\"sleep\": 0}')")
    assert finished(alice, a) == "completed" and finished(bob, b) == "completed"

    def visible(conn, table, column):
        return {r[0] for r in q(conn, f"SELECT DISTINCT {column} FROM tuvl.{table} "
                                      f"WHERE {column} IN (%s, %s)", (a, b))}

    assert visible(alice, "runs", "id") == {a}
    assert visible(bob, "runs", "id") == {b}
    assert visible(alice, "events", "run_id") == {a}
    assert visible(bob, "events", "run_id") == {b}
    assert visible(carol, "runs", "id") == {a, b}
    assert visible(carol, "events", "run_id") == {a, b}
    # Nobody sees another role's runs through tuvl.wait either.
    with pytest.raises(psycopg2.Error, match=f"run {a} does not exist"):
        q(bob, "SELECT tuvl.wait(%s, '1 s')", (a,))
    assert q1(carol, "SELECT tuvl.wait(%s, '1 s')", (a,)) == "completed"
    # And nobody but the extension writes the tables.
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(alice, "UPDATE tuvl.runs SET status = 'queued' WHERE id = %s", (a,))


def test_reaching_an_end_with_status_failed_fails_the_run(setup, conns):
    conn = conns(setup)
    run_id = q1(conn, "SELECT tuvl.start_run('doomed')")
    assert finished(conn, run_id) == "failed"
    status, end_name, response, error = q(
        conn, "SELECT status, end_name, response, error FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert (status, end_name, response) == ("failed", "rejected", {"verdict": "too risky"})
    assert "rejected" in error
    events = q(conn, "SELECT type, payload FROM tuvl.events WHERE run_id = %s ORDER BY seq",
               (run_id,))
    assert events[-1][0] == "run_failed"
    assert events[-1][1]["end"] == "rejected" and events[-1][1]["status"] == "failed"
    assert [p["signal"] for t, p in events if t == "signal"] == ["bad"]
    assert journal_violations(conn, [run_id]) == []
    # tuvl.run reports the same.
    result = q1(conn, "SELECT tuvl.run('doomed')")
    assert (result["status"], result["end"]) == ("failed", "rejected")


def test_an_error_without_a_route_fails_the_run_with_last_error_in_the_context(setup, conns):
    conn = conns(setup)
    run_id = q1(conn, "SELECT tuvl.start_run('unmapped', '{\"what\": \"juggling\"}')")
    assert finished(conn, run_id) == "failed"
    status, error, context, step = q(conn, "SELECT status, error, context, current_step "
                                           "FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert status == "failed"
    assert "boom: juggling is not allowed" in context["_last_error"]
    assert error.startswith('step "boom" failed') and "boom: juggling is not allowed" in error
    events = q(conn, "SELECT type, agent_id, payload FROM tuvl.events WHERE run_id = %s "
                     "ORDER BY seq", (run_id,))
    types = [e[0] for e in events]
    assert types == ["run_queued", "run_started", "agent_started", "agent_completed", "signal",
                     "checkpoint", "run_failed"]
    assert events[3][2]["signal"] == "error" and events[3][2]["sqlstate"] == "P0001"
    # The next step never ran.
    assert "never" not in {e[1] for e in events}
    assert journal_violations(conn, [run_id]) == []


def test_an_error_with_a_route_continues_there_with_last_error_in_the_context(setup, conns):
    conn = conns(setup)
    result = q1(conn, "SELECT tuvl.run('guarded', '{\"what\": \"yodeling\"}')")
    assert (result["status"], result["end"]) == ("completed", "done")
    assert "boom: yodeling is not allowed" in result["response"]["saw"]
    assert result["response"]["type"]
    steps = [r[0] for r in q(conn, "SELECT agent_id FROM tuvl.events WHERE run_id = %s "
                                   "AND type = 'agent_started' ORDER BY seq", (result["run_id"],))]
    assert steps == ["boom", "recover"]
    assert [r[0] for r in q(conn, "SELECT payload ->> 'signal' FROM tuvl.events WHERE run_id = %s "
                                  "AND type = 'signal' ORDER BY seq", (result["run_id"],))] == \
        ["error", "default"]


def test_run_past_its_sync_timeout_is_handed_to_the_workers(setup, conns):
    conn = conns(setup)
    started = time.monotonic()
    result = q1(conn, "SELECT tuvl.run('three_naps', '{\"sleep\": 0.3}', '0.1 s')")
    returned = time.monotonic() - started
    run_id = result["run_id"]
    assert result["status"] == "queued", result
    assert returned < 0.9, f"tuvl.run returned after {returned:.2f} s, past the sync timeout"
    assert finished(conn, run_id) == "completed"
    attempt, principal = q(conn, "SELECT attempt, principal FROM tuvl.runs WHERE id = %s",
                           (run_id,))[0]
    assert attempt == 2, "executed by this session first, then claimed by a worker"
    assert principal == "postgres"
    assert journal_violations(conn, [run_id]) == []
    types = [r[0] for r in q(conn, "SELECT type FROM tuvl.events WHERE run_id = %s ORDER BY seq",
                             (run_id,))]
    assert types == ["run_queued", "run_started"] + \
        ["agent_started", "agent_completed", "signal", "checkpoint"] * 3 + ["run_completed"]
    assert [r[0] for r in q(conn, "SELECT agent_id FROM tuvl.events WHERE run_id = %s "
                                  "AND type = 'agent_started' ORDER BY seq", (run_id,))] == SLOW_STEPS


def test_a_step_can_neither_escalate_nor_leave_settings_behind(setup, conns):
    alice = conns(setup, user="alice")
    run_id = q1(alice, "SELECT tuvl.start_run('escalate')")
    assert finished(alice, run_id) == "completed"
    context = q1(conns(setup), "SELECT context FROM tuvl.runs WHERE id = %s", (run_id,))
    tried = context["try_result"]
    # The worker's session user is a superuser; the step must not get to use it.
    assert tried.pop("user") == "alice"
    assert tried and all(v == "refused" for v in tried.values()), tried
    after = context["after_result"]
    assert after["user"] == "alice"
    assert after["search_path"] != "pwned" and after["statement_timeout"] == "0"
    assert after["application_name"].startswith("tuvl worker")
    # The worker itself still says who it is.
    assert all(r[1].startswith("tuvl worker") for r in worker_rows(setup))


def test_drop_role_is_refused_while_the_role_has_runs_in_flight(setup, conns):
    admin = conns(setup)
    dave = conns(setup, user="dave", autocommit=False)
    run_id = q1(dave, "SELECT tuvl.start_run('napper', '{\"sleep\": 0}')")
    q(dave, "SELECT tuvl.pause_run(%s)", (run_id,))
    dave.commit()
    with pytest.raises(psycopg2.errors.DependentObjectsStillExist) as e:
        q(admin, "DROP ROLE dave")
    assert e.value.diag.message_primary == 'role "dave" cannot be dropped because it owns tuvl objects'
    assert e.value.diag.message_detail == "In this database it has 1 run in flight."
    assert "tuvl.abort_run()" in e.value.diag.message_hint
    q(dave, "SELECT tuvl.abort_run(%s)", (run_id,))
    dave.commit()
    assert q1(admin, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "aborted"


def test_a_run_whose_principal_was_dropped_fails_and_a_new_role_of_that_name_inherits_nothing(
        setup, conns):
    admin = conns(setup)
    dave = conns(setup, user="dave", autocommit=False)
    run_id = q1(dave, "SELECT tuvl.start_run('napper', '{\"sleep\": 0}')")
    q(dave, "SELECT tuvl.pause_run(%s)", (run_id,))
    dave.commit()
    dave.close()
    # dropped where tuvl is not installed (no check there), the role leaves its run behind
    q(conns("postgres"), "DROP ROLE dave")
    try:
        q(admin, "SELECT tuvl.resume_run(%s)", (run_id,))
        status = q1(admin, "SELECT tuvl.wait(%s, '5 s')", (run_id,))
        row = q(admin, "SELECT status, error, lease_owner FROM tuvl.runs WHERE id = %s",
                (run_id,))[0]
        assert status == "failed", f"run of a dropped role: {row}"
        assert 'role "dave"' in row[1]
        assert q1(admin, "SELECT type FROM tuvl.events WHERE run_id = %s ORDER BY seq DESC LIMIT 1",
                  (run_id,)) == "run_failed"
    finally:
        q(admin, "CREATE ROLE dave LOGIN IN ROLE tuvl_user")  # the module teardown drops it again
    # identity is the role, not its name: the new dave sees and controls none of it
    dave = conns(setup, user="dave")
    assert q(dave, "SELECT id FROM tuvl.runs WHERE id = %s", (run_id,)) == []
    with pytest.raises(psycopg2.errors.UndefinedObject):
        q(dave, "SELECT tuvl.pin_run(%s)", (run_id,))
