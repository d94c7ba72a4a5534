"""Compensation (sagas): completed steps undone in reverse order.

A step that declares `compensate: <step>` and completes is pushed on the
run's compensation stack (tuvl.runs.compensation).  When the run reaches an
end with `rollback: true`, fails without reaching an end (an unhandled
error), or is aborted, it becomes `compensating` and runs the compensator of
every entry, most recent first, one transition each; then it is
`compensated`, or `failed` with an error starting with "compensation_failed"
when a compensator failed (the others still ran).

The workflows here use Functional and ModelOp steps over the table cp.log:
every step and every compensator inserts one row tagged with the test's own
tag, so what ran, in which order and how often is read from that table
(ordered by id).  A compensator records what it saw under
ctx.compensation.  Runs go through the workers (tuvl.start_run + tuvl.wait)
and, where cheap, through tuvl.run().

Covered: the three triggers (rollback end, unhandled error, abort of a run
waiting at a Human step, of a paused run and of a running one); what does
not compensate (a handled error, a failed end without rollback, a run
without completed compensable steps); reverse completion order, not
declaration order, with a step completed twice compensated twice; what a
compensator sees (original step, output key, output, input); compensator
writes commit, a failed compensator's writes are rolled back, the others
still run; a Human step as a compensator; control functions refused while
compensating; ctx.idempotency_key of a Functional step; and kill -9 of the
worker while a compensator runs (compensation resumes, no finished
compensator runs twice).
"""
import json
import re
import time
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import (connect, journal_violations, kill_worker, q, q1, wait_for_server,
                      wait_run_finished, wait_until)

SCHEMA = """
CREATE SCHEMA cp;
CREATE TABLE cp.log (id bigserial PRIMARY KEY, tag text NOT NULL, what text NOT NULL,
                     seen jsonb, key text);
-- a step: one row, its id as the output
CREATE FUNCTION cp.act(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    INSERT INTO cp.log (tag, what, key) VALUES (ctx ->> 'tag', 'act', ctx ->> 'idempotency_key')
    RETURNING jsonb_build_object('row', id, 'key', key) $$;
-- a compensator: one row holding ctx.compensation
CREATE FUNCTION cp.undo(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    INSERT INTO cp.log (tag, what, seen, key)
    VALUES (ctx ->> 'tag', 'undo ' || (ctx -> 'compensation' ->> 'step'), ctx -> 'compensation',
            ctx ->> 'idempotency_key')
    RETURNING jsonb_build_object('undone', ctx -> 'compensation' ->> 'step') $$;
-- a compensator that writes, then fails: its row must not survive
CREATE FUNCTION cp.undo_fails(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO cp.log (tag, what) VALUES (ctx ->> 'tag', 'undo_fails');
        RAISE EXCEPTION 'the warehouse refuses to take back %', ctx -> 'compensation' ->> 'step';
    END $$;
-- a compensator that writes, then sleeps secs seconds
CREATE FUNCTION cp.undo_slow(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO cp.log (tag, what) VALUES (ctx ->> 'tag', 'undo ' || (ctx -> 'compensation' ->> 'step'));
        PERFORM pg_sleep(coalesce((ctx ->> 'secs')::float8, 2));
        RETURN jsonb_build_object('undone', ctx -> 'compensation' ->> 'step');
    END $$;
-- a step that writes, then fails
CREATE FUNCTION cp.boom(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO cp.log (tag, what) VALUES (ctx ->> 'tag', 'boom');
        RAISE EXCEPTION 'payment declined for %', ctx ->> 'tag';
    END $$;
-- a step that sleeps secs seconds
CREATE FUNCTION cp.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO cp.log (tag, what) VALUES (ctx ->> 'tag', 'nap');
        PERFORM pg_sleep(coalesce((ctx ->> 'secs')::float8, 1));
        RETURN '{"napped": true}';
    END $$;
-- an output of about kb kilobytes
CREATE FUNCTION cp.big(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    INSERT INTO cp.log (tag, what) VALUES (ctx ->> 'tag', 'big');
    SELECT jsonb_build_object('blob', repeat(md5(ctx ->> 'tag'), (ctx ->> 'kb')::int * 32)) $$;
-- signal "again" at its first call (per tag), "default" at the second
CREATE FUNCTION cp.twice(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$
    INSERT INTO cp.log (tag, what) VALUES (ctx ->> 'tag', 'twice') RETURNING
        jsonb_build_object('row', id, 'signal',
            CASE WHEN EXISTS (SELECT FROM cp.log WHERE tag = ctx ->> 'tag' AND what = 'twice')
                 THEN 'default' ELSE 'again' END) $$;
"""


def new_name(prefix="cp"):
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def step(sid, function, compensate=None, routes=None, output=None):
    lines = [f"  - id: {sid}", "    kind: Functional", f"    function: {function}"]
    if output:
        lines.append(f"    output: {output}")
    if compensate:
        lines.append(f"    compensate: {compensate}")
    if routes:
        lines.append(f"    routes: {routes}")
    return "\n".join(lines) + "\n"


def register(conn, body, ends, start=None):
    """Register a workflow of the given steps (YAML text) and ends; returns its name."""
    name = new_name()
    source = f"name: {name}\n" + (f"start: {start}\n" if start else "") + \
        "steps:\n" + body + "ends:\n" + ends
    q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    return name


def start(conn, name, data):
    return q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (name, json.dumps(data)))


def wait(conn, run_id, timeout=20):
    return q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))


def outcome(conn, run_id):
    status, end, response, error, compensation, context = q(
        conn, "SELECT status, end_name, response, error, compensation, context FROM tuvl.runs "
              "WHERE id = %s", (run_id,))[0]
    return {"run_id": run_id, "status": status, "end": end, "response": response, "error": error,
            "compensation": compensation, "context": context}


def execute(conn, name, data, mode):
    if mode == "sync":
        run_id = q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (name, json.dumps(data)))["run_id"]
    else:
        run_id = start(conn, name, data)
        assert wait(conn, run_id) in ("completed", "failed", "aborted", "compensated")
    return outcome(conn, run_id)


def rows(conn, tag):
    """(what, seen) of cp.log rows of a tag, in insertion order."""
    return q(conn, "SELECT what, seen FROM cp.log WHERE tag = %s ORDER BY id", (tag,))


def whats(conn, tag):
    return [r[0] for r in rows(conn, tag)]


def events(conn, run_id):
    """[(seq, type, agent_id, payload)] of a run, in order."""
    return q(conn, "SELECT seq, type, agent_id, payload FROM tuvl.events WHERE run_id = %s "
                   "ORDER BY seq", (run_id,))


def comp_events(conn, run_id):
    """(type, agent_id, payload) of the compensation_* events, in order."""
    return [(t, a, p) for _, t, a, p in events(conn, run_id) if t.startswith("compensation_")]


def assert_compensated_ok(conn, res, order):
    """Compensators ran for the steps in `order`, each started and completed ok."""
    expected = []
    for original, compensator in order:
        expected += [("compensation_started", original, {"step": original, "compensator": compensator}),
                     ("compensation_completed", original,
                      {"step": original, "compensator": compensator, "ok": True})]
    assert comp_events(conn, res["run_id"]) == expected
    assert journal_violations(conn, [res["run_id"]]) == []


@pytest.fixture(scope="module")
def cdb(db):
    conn = connect(db)
    try:
        q(conn, SCHEMA)
    finally:
        conn.close()
    return db


@pytest.fixture
def conn(cdb, conns):
    return conns(cdb)


@pytest.fixture(params=["sync", "worker"])
def mode(request):
    return request.param


CRASH = re.compile(r".*terminated by signal (?!9:).*")


@pytest.fixture(autouse=True)
def no_crash(server_log):
    """Fail a test during which a server process crashed (kill -9 of our own
    excepted), and leave the server running for the next test."""
    mark = server_log.mark()
    yield
    crashes = CRASH.findall(server_log.since(mark))
    if crashes:
        # a run that crashes its worker is claimed again and may crash it again:
        # wait until the server has stayed up for a few seconds
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            wait_for_server()
            quiet = server_log.mark()
            time.sleep(3)
            if not CRASH.search(server_log.since(quiet)):
                break
        pytest.fail("a server process crashed during the test:\n" + "\n".join(crashes))


# ---------------------------------------------------------------------------
# Triggers


def test_a_rollback_end_compensates_completed_steps_in_reverse_order(conn, mode):
    tag = new_name("t")
    name = register(conn,
                    step("reserve", "cp.act", "release") +
                    step("charge", "cp.act", "refund", output="payment") +
                    step("plain", "cp.act") +
                    "  - id: check\n    kind: Router\n    on: \"{{ verdict }}\"\n"
                    "    routes: { ok: done, default: rejected }\n" +
                    step("release", "cp.undo") + step("refund", "cp.undo"),
                    "  - { id: done, status: completed, response: ok }\n"
                    "  - { id: rejected, status: completed, rollback: true, "
                    "response: { rejected: \"{{ tag }}\" } }\n")
    res = execute(conn, name, {"tag": tag, "verdict": "no"}, mode)
    # the end's status (completed) becomes compensated; its name and response stay
    assert (res["status"], res["end"], res["response"], res["error"]) == \
        ("compensated", "rejected", {"rejected": tag}, None), res
    assert whats(conn, tag) == ["act", "act", "act", "undo charge", "undo reserve"]
    assert_compensated_ok(conn, res, [("charge", "refund"), ("reserve", "release")])
    # the record: nothing left to undo, why it compensated, no failure
    comp = res["compensation"]
    assert comp["stack"] == [] and comp["failed"] == [] and comp["done"] is True
    assert comp["cause"] == {"status": "completed", "end": "rejected", "response": {"rejected": tag},
                             "error": None}
    # the compensators' outputs reach the context; ctx.compensation does not stay in it
    assert res["context"]["refund_result"] == {"undone": "charge"}
    assert res["context"]["release_result"] == {"undone": "reserve"}
    assert "compensation" not in res["context"]
    ev = events(conn, res["run_id"])
    types = [(t, a) for _, t, a, _ in ev]
    router_cp = types.index(("checkpoint", "check"))
    assert types[router_cp:] == [
        ("checkpoint", "check"),
        ("agent_started", "refund"), ("compensation_started", "charge"),
        ("agent_completed", "refund"), ("compensation_completed", "charge"), ("checkpoint", "refund"),
        ("agent_started", "release"), ("compensation_started", "reserve"),
        ("agent_completed", "release"), ("compensation_completed", "reserve"),
        ("checkpoint", "release"), ("run_completed", None)]
    payload = {(t, a): p for _, t, a, p in ev}
    assert payload[("checkpoint", "check")] == {"step": "refund", "status": "compensating"}
    assert payload[("checkpoint", "refund")] == {"step": "release", "status": "compensating"}
    assert payload[("checkpoint", "release")] == {"step": None, "status": "compensated"}
    assert payload[("run_completed", None)] == {"end": "rejected", "status": "compensated",
                                                "response": {"rejected": tag}}
    # the other route does not compensate
    ok = execute(conn, name, {"tag": tag + "-ok", "verdict": "ok"}, mode)
    assert (ok["status"], ok["end"]) == ("completed", "done")
    assert whats(conn, tag + "-ok") == ["act", "act", "act"]
    assert comp_events(conn, ok["run_id"]) == []
    assert len(ok["compensation"]["stack"]) == 2 and "cause" not in ok["compensation"]


def test_a_failed_end_with_rollback_is_compensated_and_keeps_its_error(conn):
    tag = new_name("t")
    name = register(conn, step("reserve", "cp.act", "release", routes="{ default: bad }") +
                    step("release", "cp.undo"),
                    "  - { id: bad, status: failed, rollback: true, response: { why: nope } }\n")
    res = execute(conn, name, {"tag": tag}, "sync")
    assert (res["status"], res["end"], res["response"]) == ("compensated", "bad", {"why": "nope"})
    assert res["error"] == 'the run reached end "bad", whose status is failed'
    assert res["compensation"]["cause"]["status"] == "failed"
    assert whats(conn, tag) == ["act", "undo reserve"]


def test_an_unhandled_error_compensates_and_the_failed_step_is_not_undone(conn, mode):
    tag = new_name("t")
    name = register(conn,
                    step("reserve", "cp.act", "release") + step("charge", "cp.boom", "refund") +
                    step("release", "cp.undo") + step("refund", "cp.undo"),
                    "  - { id: done, status: completed }\n")
    res = execute(conn, name, {"tag": tag}, mode)
    assert (res["status"], res["end"], res["response"]) == ("compensated", None, None), res
    # the cause's error stays the run's error
    assert res["error"].startswith('step "charge" failed: payment declined for ' + tag), res["error"]
    assert res["compensation"]["cause"]["status"] == "failed"
    # charge's own insert was rolled back with it; only reserve is undone
    assert whats(conn, tag) == ["act", "undo reserve"]
    assert_compensated_ok(conn, res, [("reserve", "release")])
    assert events(conn, res["run_id"])[-1][1:3] == ("run_completed", None)


def test_handled_errors_and_failed_ends_without_rollback_do_not_compensate(conn):
    tag = new_name("t")
    name = register(conn,
                    step("reserve", "cp.act", "release") +
                    step("charge", "cp.boom", routes="{ default: done, error: declined }") +
                    step("release", "cp.undo"),
                    "  - { id: done, status: completed }\n"
                    "  - { id: declined, status: failed, response: { declined: true } }\n")
    res = execute(conn, name, {"tag": tag}, "sync")
    assert (res["status"], res["end"]) == ("failed", "declined"), res
    assert whats(conn, tag) == ["act"]
    assert comp_events(conn, res["run_id"]) == []
    # the stack is still recorded: it simply was not used
    assert [e["step"] for e in res["compensation"]["stack"]] == ["reserve"]


def test_without_completed_compensable_steps_nothing_changes(conn):
    tag = new_name("t")
    name = register(conn, step("charge", "cp.boom", "refund") + step("refund", "cp.undo"),
                    "  - { id: done, status: completed }\n")
    res = execute(conn, name, {"tag": tag}, "sync")
    assert res["status"] == "failed" and res["compensation"] is None, res
    assert whats(conn, tag) == []
    assert [e[1] for e in events(conn, res["run_id"])][-1] == "run_failed"


@pytest.mark.parametrize("wait_kind", ["human", "paused"])
def test_abort_of_an_idle_run_is_compensated_by_a_worker(conn, wait_kind):
    tag = new_name("t")
    name = register(conn,
                    step("reserve", "cp.act", "release") + step("charge", "cp.act", "refund") +
                    "  - id: confirm\n    kind: Human\n    form: { type: object }\n"
                    "    routes: { default: done }\n" +
                    step("release", "cp.undo") + step("refund", "cp.undo"),
                    "  - { id: done, status: completed }\n")
    run_id = start(conn, name, {"tag": tag})
    assert wait(conn, run_id) == "waiting_human"
    if wait_kind == "paused":
        # a submitted run paused before a worker takes it again
        q(conn, "BEGIN")
        q(conn, "SELECT tuvl.submit(%s, '{}')", (run_id,))
        q(conn, "SELECT tuvl.pause_run(%s)", (run_id,))
        q(conn, "COMMIT")
        assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "paused"
    q(conn, "SELECT tuvl.abort_run(%s, 'the customer cancelled')", (run_id,))
    # a run with completed compensable steps goes back to the queue for a worker
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) in (
        "queued", "running", "compensating", "compensated")
    assert wait(conn, run_id) == "compensated"
    res = outcome(conn, run_id)
    assert res["error"] == "aborted by postgres: the customer cancelled"
    assert (res["end"], res["response"]) == (None, None)
    assert res["compensation"]["cause"]["status"] == "aborted"
    assert whats(conn, tag) == ["act", "act", "undo charge", "undo reserve"]
    assert_compensated_ok(conn, res, [("charge", "refund"), ("reserve", "release")])
    ev = events(conn, run_id)
    aborted = [p for _, t, _, p in ev if t == "run_aborted"]
    assert len(aborted) == 1 and aborted[0]["status"] == "compensating"
    assert aborted[0]["reason"] == "the customer cancelled" and aborted[0]["by"] == "postgres"
    assert ev[-1][1] == "run_completed" and ev[-1][3]["status"] == "compensated"
    # the Human step never completed
    assert not any(t == "agent_completed" and a == "confirm" for _, t, a, _ in ev)


def test_abort_of_an_idle_run_without_compensations_ends_it_at_once(conn):
    tag = new_name("t")
    name = register(conn, step("plain", "cp.act") +
                    "  - id: confirm\n    kind: Human\n    form: { type: object }\n",
                    "  - { id: done, status: completed }\n")
    run_id = start(conn, name, {"tag": tag})
    assert wait(conn, run_id) == "waiting_human"
    q(conn, "SELECT tuvl.abort_run(%s)", (run_id,))
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "aborted"
    assert comp_events(conn, run_id) == []


def test_abort_of_a_running_run_interrupts_the_step_and_compensates_the_completed_ones(conn):
    tag = new_name("t")
    name = register(conn,
                    step("reserve", "cp.act", "release") + step("wait_stock", "cp.nap", "restock") +
                    step("charge", "cp.act", "refund") +
                    step("release", "cp.undo") + step("restock", "cp.undo") + step("refund", "cp.undo"),
                    "  - { id: done, status: completed }\n")
    run_id = start(conn, name, {"tag": tag, "secs": 30})
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s "
                                "AND type = 'checkpoint'", (run_id,)) >= 1, 10,
               message="the first step to complete")
    wait_until(lambda: q1(conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                                "AND wait_event = 'PgSleep'") > 0, 10, interval=0.01,
               message="wait_stock to be sleeping")
    q(conn, "SELECT tuvl.abort_run(%s, 'wrong address')", (run_id,))
    started = time.monotonic()
    assert wait(conn, run_id) == "compensated"
    assert time.monotonic() - started < 3
    res = outcome(conn, run_id)
    assert res["error"] == "aborted by postgres: wrong address"
    # the step in progress was interrupted and rolled back: only reserve is undone
    assert whats(conn, tag) == ["act", "undo reserve"]
    assert_compensated_ok(conn, res, [("reserve", "release")])
    ev = events(conn, run_id)
    assert not any(t == "agent_started" and a == "charge" for _, t, a, _ in ev)
    aborted = [p for _, t, _, p in ev if t == "run_aborted"]
    assert aborted == [{"step": "wait_stock", "reason": "wrong address", "by": "postgres",
                        "status": "compensating"}]


# ---------------------------------------------------------------------------
# Order, what a compensator sees, failures


def test_compensators_run_in_reverse_completion_order_not_declaration_order(conn):
    tag = new_name("t")
    # declared a, b, c; completed c, a, twice, twice (a loop), b
    name = register(conn,
                    step("a", "cp.act", "undo_a", routes="{ default: twice }") +
                    step("b", "cp.act", "undo_b", routes="{ default: bad }") +
                    step("c", "cp.act", "undo_c", routes="{ default: a }") +
                    step("twice", "cp.twice", "undo_twice", routes="{ again: twice, default: b }") +
                    step("undo_a", "cp.undo") + step("undo_b", "cp.undo") +
                    step("undo_c", "cp.undo") + step("undo_twice", "cp.undo"),
                    "  - { id: bad, status: failed, rollback: true }\n", start="c")
    res = execute(conn, name, {"tag": tag}, "sync")
    assert res["status"] == "compensated", res
    assert whats(conn, tag) == ["act", "act", "twice", "twice", "act",
                                "undo b", "undo twice", "undo twice", "undo a", "undo c"]
    # each completion of the loop is undone with its own output
    seen = [s for w, s in rows(conn, tag) if w == "undo twice"]
    assert [s["output"]["row"] for s in seen] == sorted((s["output"]["row"] for s in seen), reverse=True)
    assert_compensated_ok(conn, res, [("b", "undo_b"), ("twice", "undo_twice"),
                                      ("twice", "undo_twice"), ("a", "undo_a"), ("c", "undo_c")])


def test_compensation_records_survive_the_workers_commits(conn):
    # Through the workers every transition commits before the next: the
    # compensation record staged by a transition must outlive that commit.
    # Three compensable steps of 100 kB outputs make the record (every entry
    # holds the step's output and input) grow past 600 kB.
    tag = new_name("t")
    name = register(conn,
                    step("a", "cp.big", "undo_a") + step("b", "cp.big", "undo_b") +
                    step("c", "cp.big", "undo_c") + step("d", "cp.boom") +
                    step("undo_a", "cp.undo") + step("undo_b", "cp.undo") + step("undo_c", "cp.undo"),
                    "  - { id: done, status: completed }\n")
    res = execute(conn, name, {"tag": tag, "kb": 100}, "worker")
    assert res["status"] == "compensated", res
    assert whats(conn, tag) == ["big", "big", "big", "undo c", "undo b", "undo a"]
    assert q1(conn, "SELECT attempt FROM tuvl.runs WHERE id = %s", (res["run_id"],)) == 1
    assert_compensated_ok(conn, res, [("c", "undo_c"), ("b", "undo_b"), ("a", "undo_a")])


def test_a_compensator_sees_the_original_steps_output_and_input(conn):
    tag = new_name("t")
    name = register(conn,
                    step("reserve", "cp.act", "release", output="reservation") +
                    step("charge", "cp.act", "refund", routes="{ default: done }") +
                    step("release", "cp.undo") + step("refund", "cp.undo"),
                    "  - { id: done, status: failed, rollback: true }\n")
    res = execute(conn, name, {"tag": tag, "_card": "4242"}, "sync")
    assert res["status"] == "compensated"
    (_, r1, _), (_, r2, _) = q(conn, "SELECT what, id, key FROM cp.log WHERE tag = %s AND what = 'act' "
                                     "ORDER BY id", (tag,))
    seen = {w: s for w, s in rows(conn, tag) if w.startswith("undo")}
    reservation = res["context"]["reservation"]
    charge = res["context"]["charge_result"]
    assert reservation["row"] == r1 and charge["row"] == r2
    # exactly these keys: the original step, its output key and output, and the
    # context it ran against (private keys included: it is the run's own data)
    assert seen["undo charge"] == {"step": "charge", "output_key": "charge_result", "output": charge,
                                   "input": {"tag": tag, "_card": "4242", "reservation": reservation}}
    assert seen["undo reserve"] == {"step": "reserve", "output_key": "reservation",
                                    "output": reservation, "input": {"tag": tag, "_card": "4242"}}


def test_a_modelop_compensator_reads_the_output_through_templates_and_its_writes_commit(conn, conns, cdb):
    tag = new_name("t")
    name = register(conn,
                    "  - id: book\n    kind: ModelOp\n"
                    "    sql: INSERT INTO cp.log (tag, what) VALUES ($1, 'booked') RETURNING id\n"
                    "    params: [\"{{ tag }}\"]\n    output: booking\n    compensate: cancel\n"
                    "  - id: cancel\n    kind: ModelOp\n"
                    "    sql: UPDATE cp.log SET what = 'cancelled', seen = $2::jsonb WHERE id = $1 RETURNING id\n"
                    "    params: [\"{{ compensation.output.0.id }}\", \"{{ compensation.input }}\"]\n"
                    "  - id: fail\n    kind: Functional\n    function: cp.boom\n",
                    "  - { id: done, status: completed }\n", start="book")
    res = execute(conn, name, {"tag": tag}, "worker")
    assert res["status"] == "compensated", res
    other = conns(cdb)  # another session sees the compensator's committed write
    assert q(other, "SELECT what, seen FROM cp.log WHERE tag = %s ORDER BY id", (tag,)) == \
        [("cancelled", {"tag": tag})]
    assert res["context"]["cancel_result"] == [{"id": res["context"]["booking"][0]["id"]}]


def test_a_failing_compensator_fails_the_run_and_the_others_still_run(conn, mode):
    tag = new_name("t")
    name = register(conn,
                    step("a", "cp.act", "undo_a") + step("b", "cp.act", "undo_b") +
                    step("c", "cp.act", "undo_c", routes="{ default: rollback }") +
                    step("undo_a", "cp.undo") + step("undo_b", "cp.undo_fails") +
                    step("undo_c", "cp.undo"),
                    "  - { id: rollback, status: completed, rollback: true, response: { gave_up: true } }\n")
    res = execute(conn, name, {"tag": tag}, mode)
    assert res["status"] == "failed", res
    assert res["error"] == ('compensation_failed: compensator "undo_b" of step "b" failed: '
                            'the warehouse refuses to take back b')
    assert (res["end"], res["response"]) == ("rollback", {"gave_up": True})
    # undo_b's own insert was rolled back; undo_a still ran after it
    assert whats(conn, tag) == ["act", "act", "act", "undo c", "undo a"]
    assert comp_events(conn, res["run_id"]) == [
        ("compensation_started", "c", {"step": "c", "compensator": "undo_c"}),
        ("compensation_completed", "c", {"step": "c", "compensator": "undo_c", "ok": True}),
        ("compensation_started", "b", {"step": "b", "compensator": "undo_b"}),
        ("compensation_completed", "b", {"step": "b", "compensator": "undo_b", "ok": False,
                                         "error": "the warehouse refuses to take back b"}),
        ("compensation_started", "a", {"step": "a", "compensator": "undo_a"}),
        ("compensation_completed", "a", {"step": "a", "compensator": "undo_a", "ok": True})]
    assert res["compensation"]["failed"] == [
        {"step": "b", "compensator": "undo_b", "error": "the warehouse refuses to take back b"}]
    ev = events(conn, res["run_id"])
    assert ev[-1][1] == "run_failed" and ev[-1][3]["error"] == res["error"]
    assert ev[-2][3] == {"step": None, "status": "failed"}
    assert journal_violations(conn, [res["run_id"]]) == []


def test_two_failing_compensators_are_both_named(conn):
    tag = new_name("t")
    name = register(conn, step("a", "cp.act", "undo_a") + step("b", "cp.act", "undo_b") +
                    step("c", "cp.boom") + step("undo_a", "cp.undo_fails") +
                    step("undo_b", "cp.undo_fails"),
                    "  - { id: done, status: completed }\n")
    res = execute(conn, name, {"tag": tag}, "sync")
    assert res["status"] == "failed"
    assert res["error"] == (
        'compensation_failed: compensator "undo_b" of step "b" failed: the warehouse refuses to take back b; '
        'compensator "undo_a" of step "a" failed: the warehouse refuses to take back a')
    assert whats(conn, tag) == ["act", "act"]


def test_a_human_step_can_be_a_compensator(conn):
    tag = new_name("t")
    name = register(conn,
                    step("ship", "cp.act", "recall", routes="{ default: bad }") +
                    "  - id: recall\n    kind: Human\n"
                    "    form: { type: object, required: [recalled], properties: { recalled: { type: boolean } } }\n",
                    "  - { id: bad, status: failed, rollback: true }\n")
    run_id = start(conn, name, {"tag": tag})
    assert wait(conn, run_id) == "waiting_human"
    assert q1(conn, "SELECT current_step FROM tuvl.runs WHERE id = %s", (run_id,)) == "recall"
    assert outcome(conn, run_id)["compensation"]["cause"]["end"] == "bad"
    q(conn, "SELECT tuvl.submit(%s, '{\"recalled\": true}')", (run_id,))
    assert wait(conn, run_id) == "compensated"
    res = outcome(conn, run_id)
    assert res["context"]["recall_result"] == {"recalled": True}
    assert_compensated_ok(conn, res, [("ship", "recall")])


def test_control_functions_refuse_a_compensating_run(conn):
    tag = new_name("t")
    name = register(conn, step("a", "cp.act", "undo_a", routes="{ default: bad }") +
                    step("undo_a", "cp.undo_slow"),
                    "  - { id: bad, status: failed, rollback: true }\n")
    run_id = start(conn, name, {"tag": tag, "secs": 1.5})
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "compensating",
               10, message="the run to compensate")
    for call in ("tuvl.abort_run(%s)", "tuvl.pause_run(%s)", "tuvl.steer_run(%s, 'stop')",
                 "tuvl.pin_run(%s)"):
        with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as exc:
            q(conn, "SELECT " + call, (run_id,))
        assert "its status is compensating" in str(exc.value)
    assert wait(conn, run_id) == "compensated"


# ---------------------------------------------------------------------------
# Idempotency keys


def test_functional_steps_and_compensators_get_a_stable_idempotency_key(conn):
    tag = new_name("t")
    name = register(conn, step("reserve", "cp.act", "release", routes="{ default: bad }") +
                    step("release", "cp.undo"),
                    "  - { id: bad, status: failed, rollback: true }\n")
    res = execute(conn, name, {"tag": tag}, "worker")
    keys = q(conn, "SELECT what, key FROM cp.log WHERE tag = %s ORDER BY id", (tag,))
    started = {a: s for s, t, a, _ in events(conn, res["run_id"]) if t == "agent_started"}
    # tuvl-<installation>-<run id>-<seq of the step's agent_started>-0
    prefix = keys[0][1].rsplit("-", 3)[0]
    assert prefix.startswith("tuvl-") and len(prefix) == len("tuvl-") + 16
    assert keys == [("act", f"{prefix}-{res['run_id']}-{started['reserve']}-0"),
                    ("undo reserve", f"{prefix}-{res['run_id']}-{started['release']}-0")]
    assert res["context"]["release_result"] == {"undone": "reserve"}
    # not part of the context
    assert "idempotency_key" not in res["context"]


# ---------------------------------------------------------------------------
# kill -9 of the worker while a compensator runs


def test_crash_kill_9_during_compensation_resumes_and_runs_no_finished_compensator_twice(cdb, server_log):
    conn = connect(cdb)
    tag = new_name("t")
    try:
        name = register(conn,
                        step("a", "cp.act", "undo_a") + step("b", "cp.act", "undo_b") +
                        step("c", "cp.act", "undo_c", routes="{ default: bad }") +
                        step("undo_a", "cp.undo") + step("undo_b", "cp.undo_slow") +
                        step("undo_c", "cp.undo"),
                        "  - { id: bad, status: failed, rollback: true }\n")
        run_id = start(conn, name, {"tag": tag, "secs": 2})
        # undo_c has committed; undo_b has inserted its row (uncommitted) and sleeps
        wait_until(lambda: whats(conn, tag)[-1:] == ["undo c"], 15, message="undo_c to commit")
        wait_until(lambda: q1(conn, "SELECT count(*) FROM pg_stat_activity WHERE pid = "
                                    "(SELECT lease_owner FROM tuvl.runs WHERE id = %s) "
                                    "AND wait_event = 'PgSleep'", (run_id,)), 5,
                   message="undo_b to sleep")
        holder, status, attempt = q(conn, "SELECT lease_owner, status, attempt FROM tuvl.runs "
                                          "WHERE id = %s", (run_id,))[0]
        assert status == "compensating" and holder
        assert q1(conn, "SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (holder,)) == \
            "tuvl worker"
    finally:
        conn.close()
    kill_worker(holder, server_log)
    conn = connect(cdb)
    try:
        wait_run_finished(conn, run_id)
        res = outcome(conn, run_id)
        assert res["status"] == "compensated", res
        assert q1(conn, "SELECT attempt FROM tuvl.runs WHERE id = %s", (run_id,)) > attempt
        # one row per compensator: undo_c did not run again, undo_b's first try was rolled back
        assert whats(conn, tag) == ["act", "act", "act", "undo c", "undo b", "undo a"]
        ev = events(conn, run_id)
        assert [(t, a) for _, t, a, _ in ev if t == "compensation_completed"] == [
            ("compensation_completed", "c"), ("compensation_completed", "b"),
            ("compensation_completed", "a")]
        # undo_b was entered twice (the first entry's events died with its transaction)
        assert [a for _, t, a, _ in ev if t == "compensation_started"] == ["c", "b", "a"]
        assert journal_violations(conn, [run_id]) == []
    finally:
        conn.close()
