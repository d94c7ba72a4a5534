"""The life cycle a DBA sees: retention (tuvl.purge, tuvl.retention), the
views for psql, tuvl.graph(), and a pg_dump / restore round trip.

The upgrade from 0.1.0 has a suite of its own (test/upgrade.sh), since it
installs another library.
"""
import json
import os
import subprocess

import psycopg2
import pytest

from conftest import PGBIN, TMPDIR, connect, drop_database, q, q1, wait_until, worker_pids

QUICK = """
name: quick
steps:
  - { id: s, kind: ModelOp, sql: "SELECT $1::int + 1 AS n", params: ["{{ n }}"], output: r,
      routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ r.0.n }}" }
"""

ASKS = """
name: asks
steps:
  - id: review
    kind: Human
    form: { type: object, required: [ok], properties: { ok: { type: boolean } } }
    output: answer
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "{{ answer.ok }}" }
"""

KEYED = """
name: keyed_nap
concurrency: { key: "{{ k }}", limit: 1 }
steps:
  - { id: nap, kind: Sleep, for: 30s, routes: { default: done } }
ends:
  - { id: done, status: completed }
"""

OUTSIDER = "tuvl_lifecycle_user"


@pytest.fixture(scope="module")
def wf(db):
    conn = connect(db)
    for source in (QUICK, ASKS, KEYED):
        q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    q(conn, f"DROP ROLE IF EXISTS {OUTSIDER}")
    q(conn, f"CREATE ROLE {OUTSIDER} LOGIN IN ROLE tuvl_user")
    conn.close()
    return db


@pytest.fixture
def conn(wf, conns):
    return conns(wf)


def finished(conn, n):
    ids = [q1(conn, "SELECT tuvl.start_run('quick', %s)", (json.dumps({"n": i}),)) for i in range(n)]
    for run_id in ids:
        assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (run_id,)) == "completed"
    return ids


# ---------------------------------------------------------------------------
# Retention


def test_purge_deletes_old_finished_runs_with_their_journals(conn):
    old = finished(conn, 5)
    recent = finished(conn, 2)
    waiting = q1(conn, "SELECT (tuvl.run('asks', '{}')) ->> 'run_id'")
    q(conn, "UPDATE tuvl.runs SET finished_at = now() - interval '40 days' WHERE id = ANY(%s)", (old,))
    assert q1(conn, "SELECT tuvl.purge('30 days')") == 5
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s)", (old,)) == 0
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = ANY(%s)", (old,)) == 0
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s)", (recent,)) == 2
    assert q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (int(waiting),)) == "waiting_human"
    assert q1(conn, "SELECT tuvl.purge('30 days')") == 0


def test_purge_uses_tuvl_retention_and_checks_its_argument(conn):
    old = finished(conn, 3)
    q(conn, "UPDATE tuvl.runs SET finished_at = now() - interval '3 hours' WHERE id = ANY(%s)", (old,))
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.purge()")
    assert e.value.pgcode == "22023" and "tuvl.retention" in e.value.diag.message_primary
    q(conn, "SET tuvl.retention = '2 hours'")
    assert q1(conn, "SELECT tuvl.purge()") >= 3
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.purge('-1 day')")
    assert "must not be negative" in str(e.value)
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SET tuvl.retention = 'forever'")
    assert "tuvl.retention must be an interval" in str(e.value)


def test_purge_is_for_tuvl_admin(wf, conns):
    other = conns(wf, user=OUTSIDER)
    with pytest.raises(psycopg2.Error) as e:
        q(other, "SELECT tuvl.purge('1 day')")
    assert e.value.pgcode == "42501"


def test_purge_keeps_the_children_of_a_parent_that_has_not_ended(conn):
    q(conn, "SELECT tuvl.register_workflow(%s)", ("""
name: fan_quick
steps:
  - { id: f, kind: Workflow, workflow: quick, for_each: "{{ l }}", input: { n: "{{ item }}" }, output: o,
      routes: { default: ask } }
  - id: ask
    kind: Human
    form: { type: object }
    routes: { default: done }
ends:
  - { id: done, status: completed }
""",))
    parent = q1(conn, "SELECT tuvl.start_run('fan_quick', '{\"l\": [1, 2]}')")
    assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (parent,)) == "waiting_human"
    kids = [r[0] for r in q(conn, "SELECT id FROM tuvl.runs WHERE parent_run_id = %s", (parent,))]
    q(conn, "UPDATE tuvl.runs SET finished_at = now() - interval '40 days' WHERE id = ANY(%s)", (kids,))
    q(conn, "SELECT tuvl.purge('30 days')")
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s)", (kids,)) == 2
    q(conn, "SELECT tuvl.submit(%s, '{}')", (parent,))
    assert q1(conn, "SELECT tuvl.wait(%s, '20 s')", (parent,)) == "completed"
    q(conn, "SELECT tuvl.purge('30 days')")
    assert q1(conn, "SELECT count(*) FROM tuvl.runs WHERE id = ANY(%s)", (kids,)) == 0


# ---------------------------------------------------------------------------
# Views


def test_views_say_what_runs_wait_for(conn):
    human = int(q1(conn, "SELECT (tuvl.run('asks', '{}')) ->> 'run_id'"))
    first = q1(conn, "SELECT tuvl.start_run('keyed_nap', '{\"k\": \"a\"}')")
    held = q1(conn, "SELECT tuvl.start_run('keyed_nap', '{\"k\": \"a\"}')")
    wait_until(lambda: q1(conn, "SELECT status FROM tuvl.runs WHERE id = %s", (first,)) == "sleeping", 10,
               message="the first keyed run to sleep")
    rows = dict(q(conn, "SELECT id, waiting_for FROM tuvl.runs_in_flight WHERE id = ANY(%s)", ([human, first, held],)))
    assert rows[human] == "waiting for tuvl.submit()"
    assert rows[first].startswith("sleeping until ")
    assert rows[held] == "held: 1 runs of concurrency key a are in flight"
    people = q(conn, "SELECT run_id, status, step, answer_with, age IS NOT NULL FROM tuvl.people_queue "
                     "WHERE run_id = %s", (human,))
    assert people == [(human, "waiting_human", "review", "tuvl.submit()", True)]
    depth = q(conn, "SELECT ready, held FROM tuvl.queue_depth WHERE workflow = 'keyed_nap'")
    assert depth == [(0, 1)]
    workers = q1(conn, "SELECT count(*) FROM tuvl.workers WHERE database = current_database()")
    assert workers == len(worker_pids(conn.info.dbname))
    assert q1(conn, "SELECT count(*) >= 0 FROM tuvl.slow_steps")
    for v in ("runs_in_flight", "people_queue", "slow_steps", "workers", "queue_depth"):
        assert q1(conn, "SELECT obj_description(%s::regclass, 'pg_class')", (f"tuvl.{v}",)), v
    q(conn, "SELECT tuvl.abort_run(%s)", (first,))
    q(conn, "SELECT tuvl.abort_run(%s)", (held,))
    q(conn, "SELECT tuvl.abort_run(%s)", (human,))


def test_a_role_sees_only_its_own_runs_in_the_views(wf, conns):
    admin = conns(wf)
    mine = int(q1(admin, "SELECT (tuvl.run('asks', '{}')) ->> 'run_id'"))
    other = conns(wf, user=OUTSIDER)
    assert q1(other, "SELECT count(*) FROM tuvl.runs_in_flight WHERE id = %s", (mine,)) == 0
    assert q1(other, "SELECT count(*) FROM tuvl.people_queue WHERE run_id = %s", (mine,)) == 0
    q(admin, "SELECT tuvl.abort_run(%s)", (mine,))


# ---------------------------------------------------------------------------
# tuvl.graph


def test_graph_draws_steps_routes_and_ends(conn):
    q(conn, "SELECT tuvl.register_workflow(%s)", ("""
name: drawn
steps:
  - { id: charge, kind: ModelOp, sql: "SELECT 1", compensate: refund, routes: { error: failed } }
  - { id: check, kind: Router, on: "{{ x }}", routes: { yes: done, no: failed } }
  - { id: refund, kind: ModelOp, sql: "SELECT 2" }
ends:
  - { id: done, status: completed }
  - { id: failed, status: failed, rollback: true }
""",))
    mermaid = q1(conn, "SELECT tuvl.graph('drawn')")
    lines = mermaid.splitlines()
    assert lines[0] == "flowchart TD"
    for line in ('  s_charge["charge<br/><i>ModelOp</i>"]', '  s_charge -->|"error"| e_failed',
                 '  s_charge -->|"default"| s_check', '  s_check -->|"yes"| e_done', '  s_check -->|"no"| e_failed',
                 '  s_charge -.->|"compensate"| s_refund', '  e_done(["done: completed"])'):
        assert line in lines, (line, mermaid)
    # refund is off the main line: nothing flows into it by default
    assert not any(l.endswith('-->|"default"| s_refund') for l in lines), mermaid
    dot = q1(conn, "SELECT tuvl.graph('drawn', 'dot')")
    assert dot.startswith('digraph "drawn" {') and dot.rstrip().endswith("}")
    assert '"s_charge" -> "s_refund" [style=dashed, label="compensate"];' in dot
    if os.path.exists("/usr/bin/dot"):
        subprocess.run(["/usr/bin/dot", "-Tsvg"], input=dot.encode(), check=True, capture_output=True)
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.graph('drawn', 'png')")
    assert e.value.pgcode == "22023"
    with pytest.raises(psycopg2.Error) as e:
        q(conn, "SELECT tuvl.graph('nope')")
    assert e.value.pgcode == "42704"


# ---------------------------------------------------------------------------
# pg_dump and restore


def test_dump_and_restore_keep_workflows_artifacts_models_runs_and_journals(wf, conns):
    conn = conns(wf)
    q(conn, "SELECT tuvl.register_llm(%s)", ("name: dumped\nprovider: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: m\n",))
    q(conn, "SELECT tuvl.register_llm(%s)", ("name: dumped\nprovider: openai\nbase_url: http://127.0.0.1:9/v1\nmodel: m2\n",))
    q(conn, "SELECT tuvl.register_artifact(%s)", ("name: dumped_note\ntype: steering\nbody: Be brief.\n",))
    finished(conn, 3)
    counts_sql = ("SELECT (SELECT count(*) FROM tuvl.workflows), (SELECT count(*) FROM tuvl.artifacts), "
                  "(SELECT count(*) FROM tuvl.llms), (SELECT count(*) FROM tuvl.llm_versions), "
                  "(SELECT count(*) FROM tuvl.runs), (SELECT count(*) FROM tuvl.events), "
                  "(SELECT max(id) FROM tuvl.runs)")
    before = q(conn, counts_sql)[0]
    dump = os.path.join(TMPDIR, "lifecycle.dump")
    env = dict(os.environ)
    subprocess.run([f"{PGBIN}/pg_dump", "-Fc", "-f", dump, wf], check=True, env=env)
    restored = wf + "_restored"
    drop_database(restored)
    subprocess.run([f"{PGBIN}/createdb", restored], check=True, env=env)
    subprocess.run([f"{PGBIN}/pg_restore", "-d", restored, dump], check=True, env=env, capture_output=True)
    try:
        other = conns(restored)
        assert q(other, counts_sql)[0] == before
        # the sequence came along: a new run takes a new id
        run_id = q1(other, "SELECT tuvl.start_run('quick', '{\"n\": 1}')")
        assert run_id > before[6]
        assert q1(other, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
        assert q1(other, "SELECT count(*) FROM tuvl.secrets") == 0
    finally:
        drop_database(restored)
