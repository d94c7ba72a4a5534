"""start_run(..., key, debounce): starts of one key coalesce into one run.

The run starts once its key has been quiet for the debounce interval, with
the input of the latest start (latest wins); every coalesced call returns
its id.  Concurrent starts from many sessions give one run.  Once the run has
started, a start with its key finds it, as any keyed start does.
"""
import threading
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, wait_until

ECHO = """
name: {name}
steps:
  - {{ id: s, kind: ModelOp, sql: "SELECT $1::int AS n", params: ["{{{{ n }}}}"], output: r,
       routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "{{{{ r.0.n }}}}" }}
"""


def test_starts_of_a_key_coalesce_and_the_latest_input_wins(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (ECHO.format(name="db_echo"),))
    first = q1(conn, "SELECT tuvl.start_run('db_echo', '{\"n\": 1}', key => 'k1', debounce => '2 s')")
    row = q(conn, "SELECT status, waiting_for, waiting FROM tuvl.runs_in_flight WHERE id = %s", (first,))[0]
    assert row[0] == "sleeping"
    assert row[1].startswith("debounce: starts at "), row
    assert row[2]["for"] == "debounce" and row[2]["debounce"] == "2 s", row
    t0 = time.time()
    for n in (2, 3):
        time.sleep(1.0)
        assert q1(conn, "SELECT tuvl.start_run('db_echo', jsonb_build_object('n', %s), key => 'k1', "
                        "debounce => '2 s')", (n,)) == first
        assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (first,)) == "sleeping"
    last = time.time()
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (first,)) == "completed",
               15, message="the debounced run")
    started = float(q1(conn, "SELECT extract(epoch FROM min(ts)) FROM tuvl.events WHERE run_id = %s "
                             "AND type = 'agent_started'", (first,)))
    assert started >= last + 1.5, (started - t0, last - t0)
    assert q1(conn, "SELECT response FROM tuvl.runs WHERE id = %s", (first,)) == 3
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = 'db_echo' AND key = 'k1'") == 1
    # each coalesced start is journaled with the input it brought
    inputs = [r[0] for r in q(conn, "SELECT payload -> 'input' ->> 'n' FROM tuvl.events "
                                    "WHERE run_id = %s AND type = 'run_queued' ORDER BY seq", (first,))]
    assert inputs == ["1", "2", "3"]
    # its journal says why it woke: the key was quiet for its debounce
    assert q(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'resumed'", (first,)) == [
        ({"by": "tuvl", "reason": "the debounce of key k1 is over: it was quiet for 2 s"},)]
    # started: a later start with the key finds it, its input ignored
    assert q1(conn, "SELECT tuvl.start_run('db_echo', '{\"n\": 9}', key => 'k1', debounce => '2 s')") == first
    assert q1(conn, "SELECT input ->> 'n' FROM tuvl.runs WHERE id = %s", (first,)) == "3"
    conn.close()


def test_concurrent_starts_from_many_sessions_give_one_run(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (ECHO.format(name="db_many"),))
    results, errors = [], []
    barrier = threading.Barrier(8)

    def starter(i):
        c = connect(db)
        try:
            barrier.wait()
            for j in range(5):
                results.append(q1(c, "SELECT tuvl.start_run('db_many', jsonb_build_object('n', %s), "
                                     "key => 'burst', debounce => '1 s')", (i * 10 + j,)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=starter, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 40 and len(set(results)) == 1, set(results)
    run = results[0]
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = 'db_many'") == 1
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run,)) == "completed",
               15, message="the one run")
    # the input is that of the start whose coalescing came last
    last_queued = q1(conn, "SELECT payload -> 'input' FROM tuvl.events WHERE run_id = %s "
                           "AND type = 'run_queued' ORDER BY seq DESC LIMIT 1", (run,))
    assert q1(conn, "SELECT input FROM tuvl.runs WHERE id = %s", (run,)) == last_queued
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND type = 'run_queued'",
              (run,)) == 40
    conn.close()


LIMITED_ECHO = """
name: {name}
rate_limit: {{ key: "{{{{ g }}}}", limit: 1, per: 3s }}
steps:
  - {{ id: s, kind: ModelOp, sql: "SELECT $1::int AS n", params: ["{{{{ n }}}}"], output: r,
       routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "{{{{ r.0.n }}}}" }}
"""


def test_a_debounced_run_its_rate_limit_holds_says_both_when_it_wakes(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (LIMITED_ECHO.format(name="db_limited"),))
    first = q1(conn, "SELECT tuvl.start_run('db_limited', '{\"n\": 1, \"g\": \"grp\"}')")
    # quiet after 1 s, but the rate limit of grp lets it start 3 s after the first
    later = q1(conn, "SELECT tuvl.start_run('db_limited', '{\"n\": 2, \"g\": \"grp\"}', key => 'dk', "
                     "debounce => '1 s')")
    assert q1(conn, "SELECT waiting ->> 'for' FROM tuvl.runs_in_flight WHERE id = %s", (later,)) == "rate_limit"
    for run in (first, later):
        wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (run,)) == "completed",
                   15, message="the runs")
    assert q(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'resumed'", (later,)) == [
        ({"by": "tuvl", "reason": "the debounce of key dk is over (quiet for 1 s) and the rate limit of key grp "
                                  "(1 per 3 s) lets it start"},)]
    conn.close()


def test_debounce_arguments_are_checked(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (ECHO.format(name="db_args"),))
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q(conn, "SELECT tuvl.start_run('db_args', '{\"n\": 1}', debounce => '1 s')")
    assert "debounce needs a key" in str(e.value)
    for bad in ("0 s", "-1 s", "1 mon", "40 days"):
        with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
            q(conn, "SELECT tuvl.start_run('db_args', '{\"n\": 1}', key => 'x', debounce => %s)", (bad,))
        assert "debounce must be a positive interval" in str(e.value)
    conn.close()


def test_another_role_cannot_join_or_see_a_debounced_run(db):
    admin = connect("postgres")
    roles = ["tuvl_db_alice", "tuvl_db_mallory"]
    for r in roles:
        q(admin, f"DROP ROLE IF EXISTS {r}")
        q(admin, f"CREATE ROLE {r} LOGIN IN ROLE tuvl_user")
    try:
        alice = connect(db, user=roles[0])
        mallory = connect(db, user=roles[1])
        q(alice, "SELECT tuvl.register_workflow(%s)", (ECHO.format(name="db_roles"),))
        mine = q1(alice, "SELECT tuvl.start_run('db_roles', '{\"n\": 1}', key => 'k', debounce => '3 s')")
        # mallory's start of the same workflow and key is his own run: alice's input stays
        theirs = q1(mallory, "SELECT tuvl.start_run('db_roles', '{\"n\": 666}', key => 'k', debounce => '3 s')")
        assert theirs != mine
        assert q1(alice, "SELECT input ->> 'n' FROM tuvl.runs WHERE id = %s", (mine,)) == "1"
        assert q1(mallory, "SELECT count(*) FROM tuvl.runs_in_flight WHERE id = %s", (mine,)) == 0
        wait_until(lambda: q1(alice, "SELECT status FROM tuvl.runs WHERE id = %s", (mine,)) == "completed",
                   15, message="alice's run")
        assert q1(alice, "SELECT response FROM tuvl.runs WHERE id = %s", (mine,)) == 1
        alice.close()
        mallory.close()
    finally:
        conn = connect(db)
        q(conn, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
                "WHERE principal_id::text = ANY (%s))", (roles,))
        q(conn, "DELETE FROM tuvl.runs WHERE principal_id::text = ANY (%s)", (roles,))
        q(conn, "DELETE FROM tuvl.workflows WHERE owner::text = ANY (%s)", (roles,))
        conn.close()
        for r in roles:
            q(admin, f"DROP ROLE IF EXISTS {r}")
        admin.close()
