"""start_run()'s options (api.c): key, not_before, priority, version and
traceparent.

A key makes starting idempotent: concurrent starts with one key, from
separate connections, give one run, decided by a unique index.
"""
import threading
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1
from agentutil import FUNCTIONS, agdb, conn, new_name  # noqa: F401
from test_traces import OTLP_URL, receiver, spans_of, tracing  # noqa: F401


def workflow(conn, marker="v1"):
    name = new_name("st")
    register(conn, name, marker)
    return name


def register(conn, name, marker):
    q(conn, "SELECT tuvl.register_workflow(%s)", (
        f"name: {name}\nsteps:\n  - {{ id: a, kind: Functional, function: ag.record }}\n"
        f"ends:\n  - {{ id: done, status: completed, response: {marker} }}\n"
        .replace("function: ag.record }", "function: ag.record, routes: { default: done } }"),))


def wait(conn, run_id):
    return q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,))


def test_a_second_start_with_the_same_key_returns_the_first_run(conn):
    name = workflow(conn)
    first = q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"k\"}', key => 'order-1')", (name,))
    assert q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"k\"}', key => 'order-1')", (name,)) == first
    assert wait(conn, first) == "completed"
    # in any status: a finished run still holds its key
    assert q1(conn, "SELECT tuvl.start_run(%s, '{}', key => 'order-1')", (name,)) == first
    other = q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"k\"}', key => 'order-2')", (name,))
    assert other != first
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = %s", (name,)) == 2
    assert q1(conn, "SELECT key FROM tuvl.runs WHERE id = %s", (first,)) == "order-1"
    queued = q1(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND seq = 1", (first,))
    assert queued["key"] == "order-1"
    # without a key, every start is a run
    a = q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"n\"}')", (name,))
    b = q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"n\"}')", (name,))
    assert a != b


def test_concurrent_starts_with_one_key_make_exactly_one_run(agdb, conn):
    name = workflow(conn)
    barrier = threading.Barrier(8)
    ids, errors = [], []

    def start():
        c = connect(agdb, autocommit=False)
        try:
            barrier.wait()
            with c.cursor() as cur:
                cur.execute("SELECT tuvl.start_run(%s, '{\"tag\": \"c\"}', key => 'once')", (name,))
                ids.append(cur.fetchone()[0])
                cur.execute("SELECT pg_sleep(0.1)")
            c.commit()
        except psycopg2.Error as e:
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(ids) == 8
    assert len(set(ids)) == 1, ids
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = %s", (name,)) == 1
    assert wait(conn, ids[0]) == "completed"
    assert q1(conn, "SELECT count(*) FROM ag.calls WHERE tag = 'c'") >= 1


def test_a_key_of_a_rolled_back_start_is_free_again(conn):
    name = workflow(conn)
    conn.autocommit = False
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT tuvl.start_run(%s, '{}', key => 'retry')", (name,))
            rolled = cur.fetchone()[0]
        conn.rollback()
    finally:
        conn.autocommit = True
    again = q1(conn, "SELECT tuvl.start_run(%s, '{}', key => 'retry')", (name,))
    assert again != rolled and wait(conn, again) == "completed"


def test_version_runs_that_version_and_priority_is_kept(conn):
    name = workflow(conn, "v1")
    register(conn, name, "v2")
    old = q1(conn, "SELECT tuvl.start_run(%s, '{}', version => 1, priority => 7)", (name,))
    new = q1(conn, "SELECT tuvl.start_run(%s, '{}')", (name,))
    assert wait(conn, old) == "completed" and wait(conn, new) == "completed"
    assert q(conn, "SELECT workflow_version, response, priority FROM tuvl.runs WHERE id = %s", (old,)) == \
        [(1, "v1", 7)]
    assert q(conn, "SELECT workflow_version, response, priority FROM tuvl.runs WHERE id = %s", (new,)) == \
        [(2, "v2", 0)]


def test_not_before_keeps_a_run_out_of_the_queue_until_then(conn):
    """A run started with a not_before in the future sleeps (status sleeping,
    wake_at = not_before): no worker claims it before then, and a worker
    queues it within about a second after; a not_before already past starts
    the run at once."""
    name = workflow(conn, "later")
    run_id = q1(conn, "SELECT tuvl.start_run(%s, '{}', not_before => now() + interval '1.5 s')", (name,))
    status, wake_at, attempt, created = q(conn, "SELECT status, wake_at, attempt, created_at FROM tuvl.runs "
                                                "WHERE id = %s", (run_id,))[0]
    assert (status, attempt) == ("sleeping", 0) and (wake_at - created).total_seconds() == pytest.approx(1.5, abs=0.01)
    time.sleep(0.8)
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "sleeping"
    assert wait(conn, run_id) == "completed"
    started, woke = q(conn, "SELECT started_at, wake_at FROM tuvl.runs WHERE id = %s", (run_id,))[0]
    assert woke is None
    late = (started - wake_at).total_seconds()
    assert 0 <= late <= 1.5, late
    evs = q(conn, "SELECT type, payload FROM tuvl.events WHERE run_id = %s ORDER BY seq", (run_id,))
    assert [t for t, _ in evs][:3] == ["run_queued", "resumed", "run_started"], evs
    assert "not_before" in evs[0][1] and evs[1][1]["reason"] == "its not_before has come"
    past = q1(conn, "SELECT tuvl.start_run(%s, '{}', not_before => now() - interval '1 day')", (name,))
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (past,)) in ("queued", "running", "completed")
    assert wait(conn, past) == "completed"


@pytest.mark.parametrize("args,error,message", [
    ("not_before => 'infinity'", psycopg2.errors.InvalidParameterValue, "not_before must be a finite time"),
    ("key => ''", psycopg2.errors.InvalidParameterValue, "key must not be empty"),
    ("version => 0", psycopg2.errors.InvalidParameterValue, "version must be 1 or more, not 0"),
    ("version => 9", psycopg2.Error, "9"),
    ("traceparent => '00-abc-def-01'", psycopg2.errors.InvalidParameterValue,
     'traceparent "00-abc-def-01" is not a W3C trace context'),
    ("traceparent => '00-00000000000000000000000000000000-0000000000000001-01'",
     psycopg2.errors.InvalidParameterValue, "is not a W3C trace context"),
])
def test_bad_options_are_errors_that_start_nothing(conn, args, error, message):
    name = workflow(conn)
    with pytest.raises(error) as e:
        q(conn, f"SELECT tuvl.start_run(%s, '{{}}', {args})", (name,))
    assert message in str(e.value), str(e.value)
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = %s", (name,)) == 0


def test_a_run_started_with_a_traceparent_continues_that_trace(conn, tracing):
    name = workflow(conn)
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"tag\": \"t\"}', traceparent => %s)",
                (name, f"00-{trace}-{parent}-01"))
    assert wait(conn, run_id) == "completed"
    spans = spans_of(run_id, 2)
    assert {s["traceId"] for s in spans} == {trace}
    (run,) = [s for s in spans if s["name"] == f"run {name}"]
    assert run["parentSpanId"] == parent
