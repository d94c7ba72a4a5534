"""kind: Workflow (child runs) and top-level concurrency.

A Workflow step starts child runs, one or one per item of for_each, at most
max_parallel in flight; the parent waits as waiting_children, held by no
worker, and is queued again by the end of its last child (or of one that did
not complete).  A failed child is the parent's error signal; aborting the
parent aborts its children.  concurrency: {key, limit} keeps the runs of a key
beyond the limit queued (held_by = 'concurrency') until one ends.

Bounds are checked from the rows themselves: a child's [started_at,
finished_at) interval is when it was in flight, so "never more than N at once"
is checked over every start, not sampled.
"""
import json
import os
import threading

import psycopg2
import pytest

from conftest import (SERVER_LOG, connect, journal_violations, kill_worker, q, q1, report,
                      wait_until, worker_pids)

CHILD = """
name: double
steps:
  - { id: s, kind: ModelOp, sql: "SELECT ($1::int * 2) AS v", params: ["{{ n }}"], output: r,
      routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ r.0.v }}" }
"""

NAPPER = """
name: napper
steps:
  - { id: nap, kind: Sleep, for: 2s, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ n }}" }
"""

NAPPER_LONG = NAPPER.replace("napper", "napper_long").replace("for: 2s", "for: 60s")

# n = 0 fails (a division by zero), anything else doubles
FRAGILE = """
name: fragile
steps:
  - { id: s, kind: ModelOp, sql: "SELECT 10 / $1::int AS v", params: ["{{ n }}"], output: r,
      routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ r.0.v }}" }
"""

PARENT = """
name: parent
steps:
  - id: fan
    kind: Workflow
    workflow: double
    for_each: "{{ items }}"
    max_parallel: 3
    input: { n: "{{ item }}" }
    output: doubled
    routes: { default: one }
  - id: one
    kind: Workflow
    workflow: double
    input: { n: 21 }
    output: single
    routes: { default: done }
ends:
  - { id: done, status: completed, response: { all: "{{ doubled }}", one: "{{ single }}" } }
"""

FAN = """
name: fan_{name}
steps:
  - id: fan
    kind: Workflow
    workflow: {child}
    for_each: "{{{{ items }}}}"
    max_parallel: {max_parallel}
    input: {{ n: "{{{{ item }}}}", secs: "{{{{ secs }}}}" }}
    output: out
    routes: {{ default: done, error: broken }}
ends:
  - {{ id: done, status: completed, response: "{{{{ out }}}}" }}
  - {{ id: broken, status: completed, response: {{ error: "{{{{ _last_error }}}}", type: "{{{{ _last_error_type }}}}" }} }}
"""

KEYED = """
name: keyed
concurrency: { key: "{{ customer }}", limit: 1 }
steps:
  - { id: nap, kind: Sleep, for: 1s, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ customer }}" }
"""


def fan(name, child, max_parallel):
    return FAN.format(name=name, child=child, max_parallel=max_parallel)


@pytest.fixture(scope="module")
def wf(db):
    conn = connect(db)
    for source in (CHILD, NAPPER, NAPPER_LONG, FRAGILE, PARENT, KEYED, fan("double", "double", 50),
                   fan("nap", "napper", 4), fan("nap_long", "napper_long", 4), fan("fragile", "fragile", 2)):
        q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    conn.close()
    return db


@pytest.fixture
def conn(wf, conns):
    return conns(wf)


def children(conn, parent):
    return q(conn, "SELECT id, status, held_by, response, parent_step FROM tuvl.runs "
                   "WHERE parent_run_id = %s ORDER BY id", (parent,))


def most_in_flight(conn, ids):
    """The largest number of runs of ids in flight at once, taken at every
    start: from the run_started event (journaled when the first step's
    transition begins, in real time) to finished_at (set as the last
    transition writes, before it commits).  A run admitted by another's end
    can only begin after that end committed."""
    return q1(conn, """
        WITH s AS (SELECT r.id, r.finished_at,
                          (SELECT min(e.ts) FROM tuvl.events e
                           WHERE e.run_id = r.id AND e.type = 'run_started') AS began
                   FROM tuvl.runs r WHERE r.id = ANY(%(ids)s))
        SELECT coalesce(max((SELECT count(*) FROM s o
                             WHERE o.began <= x.began AND o.finished_at > x.began)), 0)
        FROM s x""", {"ids": ids})


def test_children_respond_in_order_and_name_their_parent(conn):
    run_id = q1(conn, "SELECT tuvl.start_run('parent', %s)", (json.dumps({"items": [1, 2, 3, 4, 5, 6, 7]}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,)) == \
        {"all": [2, 4, 6, 8, 10, 12, 14], "one": 42}
    kids = children(conn, run_id)
    assert [k[4] for k in kids] == ["fan"] * 7 + ["one"]
    assert all(k[1] == "completed" and k[2] is None for k in kids)
    assert most_in_flight(conn, [k[0] for k in kids[:7]]) <= 3
    types = [r[0] for r in q(conn, "SELECT type FROM tuvl.events WHERE run_id = %s AND agent_id = 'fan' "
                                   "ORDER BY seq", (run_id,))]
    assert types == ["agent_started", "children_started", "checkpoint", "resumed", "children_ended",
                     "agent_completed", "signal", "checkpoint"]
    assert q1(conn, "SELECT payload -> 'runs' FROM tuvl.events WHERE run_id = %s AND agent_id = 'fan' "
                    "AND type = 'children_started'", (run_id,)) == [k[0] for k in kids[:7]]
    assert journal_violations(conn, [run_id] + [k[0] for k in kids]) == []


def test_the_parent_waits_holding_no_worker(conn):
    run_id = q1(conn, "SELECT tuvl.start_run('fan_nap', %s)", (json.dumps({"items": [1, 2], "secs": 2}),))
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "waiting_children",
               10, message="the parent to wait")
    assert q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,)) is None
    # waiting for children is not waiting for a person: tuvl.wait() goes on waiting
    assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,)) == [1, 2]


def test_a_failed_child_is_the_parents_error_and_its_open_siblings_are_aborted(conn):
    items = [1, 0] + list(range(1, 9))
    run_id = q1(conn, "SELECT tuvl.start_run('fan_fragile', %s)", (json.dumps({"items": items, "secs": 0}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    response = q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,))
    assert response["type"] == "child_failed", response
    kids = children(conn, run_id)
    failed = kids[1][0]
    assert kids[1][1] == "failed"
    assert f"child run {failed} (workflow fragile) ended failed" in response["error"], response
    assert "division by zero" in response["error"], response
    # the held ones never started: aborted, as are any still running
    statuses = [k[1] for k in kids]
    assert "aborted" in statuses, statuses
    assert all(s in ("completed", "failed", "aborted") for s in statuses), statuses
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = %s AND status = 'aborted' "
                    "AND started_at IS NOT NULL AND error NOT LIKE %s", (run_id, "%sibling failed%")) == 0
    assert journal_violations(conn, [run_id] + [k[0] for k in kids]) == []


def test_for_each_that_is_not_a_list_takes_the_error_route(conn):
    run_id = q1(conn, "SELECT tuvl.start_run('fan_double', %s)", (json.dumps({"items": {"a": 1}, "secs": 0}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "completed"
    response = q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,))
    assert "for_each must render to a list" in response["error"], response
    assert children(conn, run_id) == []


def test_aborting_the_parent_aborts_its_children(conn):
    run_id = q1(conn, "SELECT tuvl.start_run('fan_nap_long', %s)", (json.dumps({"items": list(range(10)), "secs": 0}),))
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = %s AND status = 'sleeping'",
                          (run_id,)) == 4, 10, message="four children asleep")
    kids = children(conn, run_id)
    assert sum(1 for k in kids if k[2] == "max_parallel" and k[1] == "queued") == 6
    q(conn, "SELECT tuvl.abort_run(%s, 'enough')", (run_id,))
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run_id,)) == "aborted"
    kids = children(conn, run_id)
    assert [k[1] for k in kids] == ["aborted"] * 10
    errors = q(conn, "SELECT DISTINCT error FROM tuvl.runs WHERE parent_run_id = %s", (run_id,))
    assert errors == [(f"aborted by postgres: its parent run {run_id} was aborted: enough",)]
    assert journal_violations(conn, [run_id] + [k[0] for k in kids]) == []


def test_a_thousand_children_fifty_at_a_time(conn):
    items = list(range(1000))
    run_id = q1(conn, "SELECT tuvl.start_run('fan_double', %s)", (json.dumps({"items": items, "secs": 0}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '180 s')", (run_id,)) == "completed"
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (run_id,)) == [2 * i for i in items]
    ids = [k[0] for k in children(conn, run_id)]
    assert len(ids) == 1000
    peak = most_in_flight(conn, ids)
    wall = q1(conn, "SELECT extract(epoch FROM finished_at - created_at) FROM tuvl.runs WHERE id = %s", (run_id,))
    report(f"fan-out of 1,000 children, max_parallel 50: {float(wall):.1f} s, at most {peak} in flight")
    assert 1 <= peak <= 50
    assert journal_violations(conn, [run_id] + ids) == []


def test_crash_kill_9_while_children_and_sleepers_exist_loses_and_duplicates_nothing(wf, conns, server_log):
    conn = conns(wf)
    parents = [q1(conn, "SELECT tuvl.start_run('fan_nap', %s)", (json.dumps({"items": list(range(12)), "secs": 1}),))
               for _ in range(3)]
    fast = q1(conn, "SELECT tuvl.start_run('fan_double', %s)", (json.dumps({"items": list(range(300)), "secs": 0}),))
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = ANY(%s) AND status = 'sleeping'",
                          (parents,)) >= 4, 10, message="sleeping children")
    kill_worker(worker_pids(wf)[0], server_log)
    wait_until(lambda: len(worker_pids(wf)) == 2, 30, message="the workers after the crash",
               ignore=(psycopg2.OperationalError,))
    conn = conns(wf)
    for p in parents + [fast]:
        assert q1(conn, "SELECT tuvl.wait(%s, '120 s')", (p,)) == "completed", p
    for p in parents:
        assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (p,)) == list(range(12))
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (fast,)) == [2 * i for i in range(300)]
    # each child exactly once, each started by exactly one children_started
    counts = q(conn, "SELECT parent_run_id, count(*) FROM tuvl.runs WHERE parent_run_id = ANY(%s) "
                     "GROUP BY 1 ORDER BY 1", (parents + [fast],))
    assert counts == [(p, 12) for p in parents] + [(fast, 300)]
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = ANY(%s) AND type = 'children_started'",
              (parents + [fast],)) == 4
    ids = [r[0] for r in q(conn, "SELECT id FROM tuvl.runs WHERE parent_run_id = ANY(%s)", (parents + [fast],))]
    assert journal_violations(conn, parents + [fast] + ids) == []


def test_children_run_as_the_parents_principal(wf, conns):
    admin = conns(wf)
    q(admin, "DROP ROLE IF EXISTS kid_owner")
    q(admin, "CREATE ROLE kid_owner LOGIN IN ROLE tuvl_user")
    conn = conns(wf, user="kid_owner")
    run_id = q1(conn, "SELECT tuvl.start_run('parent', %s)", (json.dumps({"items": [1]}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert q(conn, "SELECT DISTINCT principal FROM tuvl.runs WHERE parent_run_id = %s", (run_id,)) == [("kid_owner",)]
    # the children are the role's own runs: it sees and controls them as its own
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = %s", (run_id,)) == 2


def test_a_replay_serves_the_childrens_outcome(conn):
    run_id = q1(conn, "SELECT tuvl.start_run('parent', %s)", (json.dumps({"items": [4, 5]}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    fixture = q1(conn, "SELECT tuvl.pin_run(%s)", (run_id,))
    assert [e["type"] for e in fixture["effects"]] == ["children", "children"]
    before = q1(conn, "SELECT count(*) FROM tuvl.runs")
    result = q1(conn, "SELECT tuvl.replay(%s)", (json.dumps(fixture),))
    assert result["status"] == "completed" and result["effects_served"] == 2, result
    assert result["response"] == {"all": [8, 10], "one": 42}
    assert q1(conn, "SELECT count(*) FROM tuvl.runs") == before
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.replay(%s, live => array['fan'])", (json.dumps(fixture),))
    assert "cannot run live in a replay" in str(e.value)


@pytest.mark.parametrize("step,path,message", [
    ("{ id: w, kind: Workflow }", "steps[0]", "a Workflow step is missing required key \"workflow\""),
    ("{ id: w, kind: Workflow, workflow: double, for_each: [1, 2] }", "steps[0].for_each",
     "for_each must be a template naming a list"),
    ("{ id: w, kind: Workflow, workflow: double, max_parallel: 2 }", "steps[0].max_parallel",
     "max_parallel bounds a for_each fan-out"),
    ("{ id: w, kind: Workflow, workflow: double, for_each: \"{{ l }}\", max_parallel: 0 }",
     "steps[0].max_parallel", "max_parallel must be a positive integer"),
    ("{ id: w, kind: Workflow, workflow: double, input: [1] }", "steps[0].input", "input must be a mapping"),
    ("{ id: w, kind: Workflow, workflow: double, timeout: 5s }", "steps[0].timeout",
     "a Workflow step takes no timeout"),
    ("{ id: w, kind: Workflow, workflow: double, parallel: 2 }", "steps[0].parallel", "unknown key"),
])
def test_workflow_steps_are_checked(conn, step, path, message):
    source = f"name: bad\nsteps:\n  - {step}\nends:\n  - {{ id: done, status: completed }}\n"
    findings = q(conn, "SELECT path, message FROM tuvl.validate(%s) WHERE severity = 'error'", (source,))
    assert any(p == path and message in m for p, m in findings), findings


# ---------------------------------------------------------------------------
# concurrency: {key, limit}


def test_runs_beyond_the_limit_of_a_key_stay_queued_until_one_ends(conn):
    a = [q1(conn, "SELECT tuvl.start_run('keyed', '{\"customer\": \"acme\"}')") for _ in range(3)]
    b = q1(conn, "SELECT tuvl.start_run('keyed', '{\"customer\": \"globex\"}')")
    rows = q(conn, "SELECT id, status, held_by, concurrency_key FROM tuvl.runs WHERE id = ANY(%s) ORDER BY id",
             (a + [b],))
    assert [r[2] for r in rows] == [None, "concurrency", "concurrency", None], rows
    assert [r[1] for r in rows[1:3]] == ["queued", "queued"]
    assert [r[3] for r in rows] == ["acme"] * 3 + ["globex"]
    for run_id in a + [b]:
        assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
    assert most_in_flight(conn, a) == 1
    # the other key ran beside the first: not one after the other
    assert q1(conn, "SELECT (SELECT started_at FROM tuvl.runs WHERE id = %s) < "
                    "(SELECT finished_at FROM tuvl.runs WHERE id = %s)", (b, a[0]))
    started = [r[0] for r in q(conn, "SELECT id FROM tuvl.runs WHERE id = ANY(%s) ORDER BY started_at", (a,))]
    assert started == a


def test_concurrent_starts_of_one_key_never_exceed_the_limit(wf, conns):
    ids = []
    lock = threading.Lock()

    def starter():
        c = connect(wf)
        for _ in range(3):
            run_id = q1(c, "SELECT tuvl.start_run('keyed', '{\"customer\": \"initech\"}')")
            with lock:
                ids.append(run_id)
        c.close()

    # four sessions starting at once; each run sleeps 1 s, one after the other
    threads = [threading.Thread(target=starter) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn = conns(wf)
    assert len(ids) == 12
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s) AND held_by IS NULL "
                    "AND finished_at IS NULL", (ids,)) <= 1
    for run_id in ids:
        assert q1(conn, "SELECT tuvl.wait(%s, '60 s')", (run_id,)) == "completed"
    assert most_in_flight(conn, ids) == 1


def test_an_aborted_run_lets_the_next_of_its_key_start(conn):
    first = q1(conn, "SELECT tuvl.start_run('keyed', '{\"customer\": \"hooli\"}')")
    second = q1(conn, "SELECT tuvl.start_run('keyed', '{\"customer\": \"hooli\"}')")
    assert q1(conn, "SELECT held_by FROM tuvl.runs WHERE id = %s", (second,)) == "concurrency"
    q(conn, "SELECT tuvl.abort_run(%s)", (first,))
    assert q1(conn, "SELECT held_by FROM tuvl.runs WHERE id = %s", (second,)) is None
    assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (second,)) == "completed"


def test_tuvl_run_refuses_a_full_key(conn):
    first = q1(conn, "SELECT tuvl.start_run('keyed', '{\"customer\": \"umbrella\"}')")
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.run('keyed', '{\"customer\": \"umbrella\"}')")
    assert "already has 1 runs in flight with concurrency key \"umbrella\"" in str(e.value)
    assert e.value.pgcode == "55000"
    assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (first,)) == "completed"


@pytest.mark.parametrize("block,path,message", [
    ("concurrency: 1", "concurrency", "concurrency must be a mapping"),
    ("concurrency: { limit: 1 }", "concurrency.key", "concurrency needs key"),
    ("concurrency: { key: \"{{ c }}\" }", "concurrency.limit", "concurrency needs limit"),
    ("concurrency: { key: \"{{ c }}\", limit: 0 }", "concurrency.limit", "limit must be a positive integer"),
    ("concurrency: { key: \"{{ c }}\", limit: 1, per: x }", "concurrency.per", "unknown key"),
])
def test_concurrency_is_checked(conn, block, path, message):
    source = (f"name: bad\n{block}\nsteps:\n  - {{ id: s, kind: Router, on: x, routes: {{ x: done }} }}\n"
              "ends:\n  - { id: done, status: completed }\n")
    findings = q(conn, "SELECT path, message FROM tuvl.validate(%s) WHERE severity = 'error'", (source,))
    assert any(p == path and message in m for p, m in findings), findings


# ---------------------------------------------------------------------------
# A parent's compensation runs its children's

BOOKING = """
name: booking
steps:
  - { id: book, kind: ModelOp, sql: "INSERT INTO kids.bookings (n) VALUES ($1::int) RETURNING n",
      params: ["{{ n }}"], output: b, compensate: unbook, routes: { default: done } }
  - { id: unbook, kind: ModelOp, sql: "INSERT INTO kids.undone (n) VALUES ($1::int)", params: ["{{ n }}"] }
ends:
  - { id: done, status: completed, response: "{{ b.0.n }}" }
"""

TRIP = """
name: trip
steps:
  - id: book_all
    kind: Workflow
    workflow: booking
    for_each: "{{ items }}"
    max_parallel: 2
    input: { n: "{{ item }}" }
    output: booked
    routes: { default: pay }
  - { id: pay, kind: ModelOp, sql: "SELECT 1 / $1::int AS ok", params: ["{{ pay }}"], output: paid,
      routes: { default: done, error: refund } }
ends:
  - { id: done, status: completed, response: "{{ booked }}" }
  - { id: refund, status: failed, rollback: true }
"""


@pytest.fixture(scope="module")
def trips(wf):
    conn = connect(wf)
    q(conn, "CREATE SCHEMA IF NOT EXISTS kids; "
            "CREATE TABLE IF NOT EXISTS kids.bookings (n int); CREATE TABLE IF NOT EXISTS kids.undone (n int); "
            "GRANT USAGE ON SCHEMA kids TO PUBLIC; GRANT ALL ON kids.bookings, kids.undone TO PUBLIC")
    q(conn, "SELECT tuvl.register_workflow(%s)", (BOOKING,))
    q(conn, "SELECT tuvl.register_workflow(%s)", (TRIP,))
    conn.close()
    return wf


def test_a_parents_compensation_compensates_its_children(trips, conns):
    conn = conns(trips)
    q(conn, "TRUNCATE kids.bookings, kids.undone")
    run_id = q1(conn, "SELECT tuvl.start_run('trip', %s)", (json.dumps({"items": [1, 2, 3], "pay": 0}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "compensated"
    kids = children(conn, run_id)
    assert [k[1] for k in kids] == ["compensated"] * 3
    assert [k[3] for k in kids] == [1, 2, 3], "a compensated child keeps the response it had"
    assert sorted(r[0] for r in q(conn, "SELECT n FROM kids.undone")) == [1, 2, 3]
    types = [r[0] for r in q(conn, "SELECT type FROM tuvl.events WHERE run_id = %s ORDER BY seq", (run_id,))]
    assert "children_compensating" in types and types[-1] == "run_completed", types
    child_types = [r[0] for r in q(conn, "SELECT type FROM tuvl.events WHERE run_id = %s ORDER BY seq",
                                   (kids[0][0],))]
    assert child_types.count("run_completed") == 2, child_types
    assert child_types.index("compensation_completed") > child_types.index("run_completed"), child_types
    assert journal_violations(conn, [run_id] + [k[0] for k in kids]) == []
    # and when it goes through, nothing is undone
    run_id = q1(conn, "SELECT tuvl.start_run('trip', %s)", (json.dumps({"items": [7], "pay": 1}),))
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert [k[1] for k in children(conn, run_id)] == ["completed"]
    assert q1(conn, "SELECT count(*) FROM kids.undone WHERE n = 7") == 0


def test_a_workflow_step_takes_no_compensate(conn):
    source = ("name: bad\nsteps:\n  - { id: w, kind: Workflow, workflow: double, compensate: x }\n"
              "  - { id: x, kind: Router, on: a, routes: { a: done } }\nends:\n  - { id: done, status: completed }\n")
    findings = q(conn, "SELECT path, message FROM tuvl.validate(%s) WHERE severity = 'error'", (source,))
    assert any(p == "steps[0].compensate" and "takes no compensate" in m for p, m in findings), findings


def test_a_role_cannot_hold_back_anothers_runs_by_filling_a_key(wf, conns):
    """The limit holds per role: any tuvl_user may start any workflow, and
    must not be able to block another role's runs of a key."""
    admin = conns(wf)
    q(admin, "DROP ROLE IF EXISTS key_squatter")
    q(admin, "CREATE ROLE key_squatter LOGIN IN ROLE tuvl_user")
    squatter = conns(wf, user="key_squatter")
    theirs = q1(squatter, "SELECT tuvl.start_run('keyed', '{\"customer\": \"wayne\"}')")
    mine = q1(admin, "SELECT tuvl.start_run('keyed', '{\"customer\": \"wayne\"}')")
    assert q1(admin, "SELECT held_by FROM tuvl.runs WHERE id = %s", (mine,)) is None
    second = q1(admin, "SELECT tuvl.start_run('keyed', '{\"customer\": \"wayne\"}')")
    assert q1(admin, "SELECT held_by FROM tuvl.runs WHERE id = %s", (second,)) == "concurrency"
    for run_id in (theirs, mine, second):
        assert q1(admin, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
