"""rate_limit: at most limit runs (or entries into a step) per window, per key.

A workflow's top-level rate_limit admits its runs; an APICall, MCP or Agent
step's admits each entry into the step.  A run or step over its limit sleeps
until the time reserved for it (no worker holds it), visible in
tuvl.runs_in_flight.waiting_for / waiting, and goes once that time comes,
also after a kill -9 and a restart of the cluster.  Buckets are per role: one
role's batch never holds back another's runs, and no role reads the log.
"""
import os

import psycopg2
import psycopg2.errors
import pytest

from conftest import (SERVER_LOG, connect, kill_worker, pg_ctl, q, q1, wait_for_server,
                      wait_run_finished, wait_until, worker_pids)

HTTP_PORT = int(os.environ.get("TUVL_HTTP_PORT") or 0)

LIMITED = """
name: {name}
rate_limit: {{ key: "{{{{ k }}}}", limit: {limit}, per: {per} }}
steps:
  - {{ id: s, kind: ModelOp, sql: "SELECT 1 AS one", routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
"""

ROLES = ["tuvl_rl_alice", "tuvl_rl_bob"]


@pytest.fixture(scope="module")
def roles(db):
    admin = connect("postgres")
    for role in ROLES:
        q(admin, f"DROP ROLE IF EXISTS {role}")
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    yield db
    conn = connect(db)
    q(conn, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
            "WHERE principal_id::text = ANY (%s))", (ROLES,))
    q(conn, "DELETE FROM tuvl.runs WHERE principal_id::text = ANY (%s)", (ROLES,))
    q(conn, "DELETE FROM tuvl.workflows WHERE owner::text = ANY (%s)", (ROLES,))
    conn.close()
    admin.close()
    admin = connect("postgres")  # a test restarts the cluster
    for role in ROLES:
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


def started_at(conn, ids):
    """Epoch seconds each run started (its first agent_started), in id order."""
    return [float(x) for (x,) in q(conn, """
        SELECT extract(epoch FROM min(e.ts)) FROM tuvl.events e
        WHERE e.run_id = ANY (%s) AND e.type = 'agent_started' GROUP BY e.run_id ORDER BY e.run_id""",
        (ids,))]


def most_in_window(times, per):
    """The most times in any window of length per, less 0.2 s: a limit holds
    for admissions, and a run admitted at once starts a few ms after its
    start_run() commits, a woken one as soon as the maintenance wakes it."""
    times = sorted(times)
    per -= 0.2
    return max(sum(1 for u in times if t <= u < t + per) for t in times)


def test_a_workflow_rate_limit_admits_limit_per_window_in_order(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (LIMITED.format(name="rl_runs", limit=2, per="2s"),))
    ids = [q1(conn, "SELECT tuvl.start_run('rl_runs', '{\"k\": \"a\"}')") for _ in range(5)]
    other = q1(conn, "SELECT tuvl.start_run('rl_runs', '{\"k\": \"b\"}')")
    # the third and later wait, no worker holding them, saying why and until when
    rows = q(conn, "SELECT id, status, waiting_for, waiting FROM tuvl.runs_in_flight "
                   "WHERE id = ANY (%s) ORDER BY id", (ids[2:],))
    assert [r[1] for r in rows] == ["sleeping"] * 3, rows
    assert all(r[2].startswith("rate limit: key a allows 2 per 2 s; it may start at ") for r in rows), rows
    assert all(r[3]["for"] == "rate_limit" and r[3]["key"] == "a" and r[3]["limit"] == 2 for r in rows)
    # another key is not held back
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (other,)) == "completed",
               10, message="the run of another key")
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) "
                                "AND status = 'completed'", (ids,)) == 5, 20,
               message="every limited run to complete")
    times = started_at(conn, ids)
    assert most_in_window(times, 2.0) <= 2, times
    assert times == sorted(times), "runs of a key start in the order they were started"
    assert times[4] - times[0] >= 3.9, times
    # a held run's journal says why it woke: its rate limit, not a not_before
    for i in ids[2:]:
        assert q(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'resumed'", (i,)) == [
            ({"by": "tuvl", "reason": "the rate limit of key a (2 per 2 s) lets it start"},)]
    conn.close()


def test_tuvl_run_over_the_limit_is_refused(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (LIMITED.format(name="rl_sync", limit=1, per="1h"),))
    q(conn, "SELECT tuvl.run('rl_sync', '{\"k\": \"x\"}')")
    with pytest.raises(psycopg2.errors.ObjectNotInPrerequisiteState) as e:
        q(conn, "SELECT tuvl.run('rl_sync', '{\"k\": \"x\"}')")
    assert 'is over its rate limit for key "x"' in str(e.value)
    assert e.value.diag.message_hint.startswith("Start it with tuvl.start_run()")
    conn.close()


def test_two_roles_have_their_own_budgets(roles):
    alice = connect(roles, user=ROLES[0])
    bob = connect(roles, user=ROLES[1])
    q(alice, "SELECT tuvl.register_workflow(%s)", (LIMITED.format(name="rl_shared", limit=1, per="1h"),))
    first = q1(alice, "SELECT tuvl.start_run('rl_shared', '{\"k\": \"same\"}')")
    held = [q1(alice, "SELECT tuvl.start_run('rl_shared', '{\"k\": \"same\"}')") for _ in range(20)]
    # bob starts alice's workflow with the same key: his own budget, at once
    bobs = q1(bob, "SELECT tuvl.start_run('rl_shared', '{\"k\": \"same\"}')")
    wait_until(lambda: q1(bob, "SELECT status FROM tuvl.runs WHERE id = %s", (bobs,)) == "completed",
               10, message="bob's run, despite alice's batch")
    wait_until(lambda: q1(alice, "SELECT status FROM tuvl.runs WHERE id = %s", (first,)) == "completed",
               10, message="alice's first run")
    assert q1(alice, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) AND status = 'sleeping'",
              (held,)) == 20
    # bob sees nothing of alice's waits, and neither reads the log
    assert q1(bob, "SELECT count(*) FROM tuvl.runs_in_flight WHERE id = ANY (%s)", (held,)) == 0
    for conn in (alice, bob):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            q(conn, "SELECT * FROM tuvl.rate_limit_grants")
    alice.close()
    bob.close()


def test_a_hostile_role_cannot_stall_workers_through_a_bucket_lock(roles):
    """Buckets and their locks are per role, in tuvl's own lock space: bob,
    holding an advisory lock named like the bucket and an uncommitted start of
    alice's workflow with her key, holds back none of alice's starts or runs."""
    alice = connect(roles, user=ROLES[0])
    bob = connect(roles, user=ROLES[1], autocommit=False)
    q(alice, "SELECT tuvl.register_workflow(%s)", (LIMITED.format(name="rl_lock", limit=5, per="1s"),))
    cur = bob.cursor()
    # bob holds what he can: advisory locks named like the bucket, and a start of his own
    cur.execute("SELECT pg_advisory_xact_lock(hashtext('rate_limit'), hashtext('run/rl_lock'))")
    cur.execute("SELECT tuvl.start_run('rl_lock', '{\"k\": \"k\"}')")
    ids = [q1(alice, "SELECT tuvl.start_run('rl_lock', '{\"k\": \"k\"}')") for _ in range(3)]
    wait_until(lambda: q1(alice, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) "
                                 "AND status = 'completed'", (ids,)) == 3, 10,
               message="alice's runs while bob holds his transaction open")
    bob.rollback()
    bob.close()
    alice.close()


def test_validation_errors_name_their_path(db):
    conn = connect(db)
    bad = [
        ("rate_limit: { key: \"{{ k }}\", limit: 0, per: 1m }", "rate_limit.limit"),
        ("rate_limit: { key: \"{{ k }}\", limit: 5 }", "rate_limit.per"),
        ("rate_limit: { limit: 5, per: 1m }", "rate_limit.key"),
        ("rate_limit: { key: k, limit: 5, per: soon }", "rate_limit.per"),
        ("rate_limit: { key: k, limit: 5, per: 1m, burst: 3 }", "rate_limit.burst"),
        ("rate_limit: 100", "rate_limit"),
    ]
    for line, path in bad:
        src = f"name: rl_bad\n{line}\nsteps:\n  - {{ id: s, kind: ModelOp, sql: SELECT 1 }}\n"
        paths = [r[0] for r in q(conn, "SELECT path FROM tuvl.validate(%s) WHERE severity = 'error'",
                                 (src,))]
        assert path in paths, (line, paths)
    # on a step: only APICall, MCP and Agent take one
    src = ("name: rl_bad\nsteps:\n  - { id: s, kind: ModelOp, sql: SELECT 1, "
           "rate_limit: { key: k, limit: 1, per: 1s } }\n")
    rows = q(conn, "SELECT path, message FROM tuvl.validate(%s) WHERE severity = 'error'", (src,))
    assert ("steps[0].rate_limit",
            "rate_limit applies to APICall, MCP and Agent steps, and to a whole workflow at its top level"
            ) in [(r[0], r[1].split(" (line")[0]) for r in rows], rows
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.register_workflow(%s)",
          ("name: rl_bad\nrate_limit: { key: k, limit: -1, per: 1m }\n"
           "steps:\n  - { id: s, kind: ModelOp, sql: SELECT 1 }\n",))
    assert "rate_limit.limit" in str(e.value)
    conn.close()


STEP_LIMITED = f"""
name: rl_step
steps:
  - id: call
    kind: APICall
    rate_limit: {{ key: "{{{{ host }}}}", limit: 2, per: 2s }}
    http: {{ url: "http://127.0.0.1:{HTTP_PORT}/json" }}
    routes: {{ default: done }}
ends:
  - {{ id: done, status: completed }}
"""


@pytest.mark.skipif(not HTTP_PORT, reason="needs the HTTP test server (test/run starts it)")
def test_a_step_rate_limit_spaces_its_calls(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (STEP_LIMITED,))
    ids = [q1(conn, "SELECT tuvl.start_run('rl_step', '{\"host\": \"api\"}')") for _ in range(5)]
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs_in_flight WHERE id = ANY (%s) "
                                "AND waiting ->> 'for' = 'rate_limit' AND step = 'call'", (ids,)) >= 2,
               10, message="runs waiting in the step for its rate limit")
    row = q(conn, "SELECT waiting_for, waiting FROM tuvl.runs_in_flight WHERE id = ANY (%s) "
                  "AND waiting ->> 'for' = 'rate_limit' LIMIT 1", (ids,))[0]
    assert row[0].startswith("rate limit: key api allows 2 per 2 s; step call may go at"), row
    assert row[1]["key"] == "api" and row[1]["step"] == "call"
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) "
                                "AND status = 'completed'", (ids,)) == 5, 20,
               message="every run to complete")
    sent = [float(x) for (x,) in q(conn, """
        SELECT extract(epoch FROM e.ts) FROM tuvl.events e
        WHERE e.run_id = ANY (%s) AND e.type = 'tool_call'""", (ids,))]
    assert len(sent) == 5
    assert most_in_window(sent, 2.0) <= 2, sorted(sent)
    # the runs the limit held say so when they wake
    reasons = [r[0] for r in q(conn, "SELECT payload ->> 'reason' FROM tuvl.events "
                                     "WHERE run_id = ANY (%s) AND type = 'resumed'", (ids,))]
    assert len(reasons) >= 2 and set(reasons) == {"the rate limit of key api (2 per 2 s) lets step call go"}, \
        reasons
    conn.close()


def test_a_waiting_run_starts_once_after_kill_9_and_restart(db, server_log):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (LIMITED.format(name="rl_crash", limit=1, per="4s"),))
    ids = [q1(conn, "SELECT tuvl.start_run('rl_crash', '{\"k\": \"c\"}')") for _ in range(3)]
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY (%s) AND status = 'sleeping'",
              (ids,)) == 2
    conn.close()
    # a worker killed with -9 (the server reinitializes), then the cluster stopped hard
    kill_worker(worker_pids(db)[0], server_log)
    pg_ctl("-l", SERVER_LOG, "-m", "immediate", "-w", "-t", "60", "stop")
    pg_ctl("-l", SERVER_LOG, "-w", "-t", "60", "start")
    wait_for_server()
    conn = connect(db)
    for i in ids:
        wait_run_finished(conn, i, timeout=30)
    assert q(conn, "SELECT status, count(*) FROM tuvl.runs WHERE id = ANY (%s) GROUP BY 1", (ids,)) == [
        ("completed", 3)]
    # each started once
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = ANY (%s) AND type = 'run_completed'",
              (ids,)) == 3
    # each went at or after the time it reserved: 4 s apart from the first
    times = started_at(conn, ids)
    for i, t in enumerate(times):
        assert t >= times[0] + 4 * i - 0.2, times
    conn.close()
