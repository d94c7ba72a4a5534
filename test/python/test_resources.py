"""Resource isolation: no run can stall, starve or exhaust the others.

- step timeouts (timeout:, tuvl.step_timeout) for SQL, HTTP and model steps,
  in the workers and in tuvl.run(): SQL is cancelled at the deadline, the
  step takes its error route with _last_error_type timeout, what it wrote is
  rolled back;
- an abort interrupts the step executing, or the request a step waits for;
- a slow step never holds up the commits of other runs (batches are bounded
  by tuvl.max_batch_time; a slow step runs alone);
- claims are shared among principals: one role's backlog does not delay
  another role's run;
- size limits of inputs, outputs and sources, and the memory a worker holds
  for responses (tuvl.max_worker_memory).
"""
import json
import os
import threading
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, report, wait_until, worker_pids, not_under_asan
from httputil import HTTP_BASE, execute, unique
from llmutil import LLM_URL, script

SLOWPOKE = "tuvl_res_slowpoke"
QUICK = "tuvl_res_quick"
PRIO = "tuvl_res_prio"


@pytest.fixture(scope="module")
def res(db):
    admin = connect("postgres")
    for role in (SLOWPOKE, QUICK):
        q(admin, f"DROP ROLE IF EXISTS {role}")
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    q(admin, f"DROP ROLE IF EXISTS {PRIO}")
    conn = connect(db)
    q(conn, f"""
        CREATE SCHEMA rs;
        GRANT USAGE ON SCHEMA rs TO PUBLIC;
        CREATE TABLE rs.writes (tag text, at timestamptz DEFAULT clock_timestamp());
        GRANT INSERT, SELECT ON rs.writes TO PUBLIC;
        CREATE FUNCTION rs.nap(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO rs.writes (tag) VALUES (ctx ->> 'tag');
                PERFORM pg_sleep((ctx ->> 'secs')::float8);
                RETURN jsonb_build_object('slept', ctx ->> 'secs');
            END $$;
        CREATE FUNCTION rs.big(ctx jsonb) RETURNS jsonb LANGUAGE sql
            AS $$ SELECT jsonb_build_object('x', repeat('x', (ctx ->> 'bytes')::int)) $$;
    """)
    q(conn, "SELECT tuvl.register_llm(%s)",
      (f"name: res_model\nprovider: openai\nbase_url: {LLM_URL}\nmodel: res_model\n",))
    for wf in WORKFLOWS:
        q(conn, "SELECT tuvl.register_workflow(%s)", (wf,))
    conn.close()
    yield db
    conn = connect(db)
    q(conn, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
            "WHERE principal_id::text = ANY (%s))", ([SLOWPOKE, QUICK, PRIO],))
    q(conn, "DELETE FROM tuvl.runs WHERE principal_id::text = ANY (%s)", ([SLOWPOKE, QUICK, PRIO],))
    conn.close()
    for role in (SLOWPOKE, QUICK, PRIO):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


WORKFLOWS = [
    """
name: nap_1s
steps:
  - { id: nap, kind: Functional, function: rs.nap, timeout: 1s, routes: { error: handled } }
ends:
  - { id: handled, status: completed, response: { type: "{{ _last_error_type }}", error: "{{ _last_error }}" } }
""",
    """
name: nap_default
steps:
  - { id: nap, kind: Functional, function: rs.nap }
""",
    f"""
name: slow_http
steps:
  - id: call
    kind: APICall
    http: {{ url: "{HTTP_BASE}/slow?ms={{{{ ms }}}}" }}
    timeout: 1s
""",
    """
name: slow_model
steps:
  - id: ask
    kind: Agent
    mode: completion
    timeout: 1s
    agent: { model: res_model, prompt: "hello" }
""",
    """
name: quick
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS one" }
""",
    """
name: big_output
steps:
  - { id: big, kind: Functional, function: rs.big }
""",
    f"""
name: fetch_big
steps:
  - id: get
    kind: APICall
    http: {{ url: "{HTTP_BASE}/big?bytes={{{{ bytes }}}}&t={{{{ t }}}}", timeout: 60s }}
""",
]


def writes(conn, tag):
    return q1(conn, "SELECT count(*) FROM rs.writes WHERE tag = %s", (tag,))


def timed(conn, workflow, data, mode):
    started = time.monotonic()
    res = execute(conn, workflow, data, mode, timeout=60)
    return res, time.monotonic() - started


# ---------------------------------------------------------------------------
# Timeouts


@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_a_sql_step_is_cancelled_at_its_timeout_and_rolled_back(res, conns, mode):
    conn = conns(res)
    tag = unique()
    out, took = timed(conn, "nap_1s", {"tag": tag, "secs": 20}, mode)
    assert 0.9 < took < 2.5, took
    assert out["end"] == "handled", out
    assert out["response"] == {"type": "timeout", "error": "the step's timeout of 1 s passed"}
    # what the step wrote before the deadline is gone with it
    assert writes(conn, tag) == 0
    row = q(conn, "SELECT type, payload FROM tuvl.events WHERE run_id = %s AND type = 'agent_completed'",
            (out["run_id"],))[0]
    assert row[1]["error_type"] == "timeout" and row[1]["sqlstate"] == "57014"


def test_a_step_within_its_timeout_completes(res, conns):
    conn = conns(res)
    out = execute(conn, "nap_1s", {"tag": unique(), "secs": 0.2}, "worker")
    assert out["status"] == "completed" and out["end"] is None, out


def test_tuvl_step_timeout_is_the_default_timeout(res, conns, set_gucs):
    conn = conns(res)
    q(conn, "SET tuvl.step_timeout = '500ms'")
    out, took = timed(conn, "nap_default", {"tag": unique(), "secs": 20}, "sync")
    assert out["status"] == "failed" and took < 2, (out, took)
    assert "the step's timeout of 500 ms passed" in out["error"]
    set_gucs({"tuvl.step_timeout": ("700ms", "700ms")})
    out, took = timed(conn, "nap_default", {"tag": unique(), "secs": 20}, "worker")
    assert out["status"] == "failed" and took < 2.5, (out, took)
    assert "the step's timeout of 700 ms passed" in out["error"]


@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_a_request_is_abandoned_at_the_steps_timeout(res, conns, mode):
    conn = conns(res)
    out, took = timed(conn, "slow_http", {"ms": 10000}, mode)
    assert out["status"] == "failed" and took < 3, (out, took)
    assert "the step's timeout of 1 s passed" in out["error"], out
    ctx = q1(conn, "SELECT context FROM tuvl.runs WHERE id = %s", (out["run_id"],))
    assert ctx["_last_error_type"] == "timeout"


@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_a_model_call_is_abandoned_at_the_steps_timeout(res, conns, mode):
    conn = conns(res)
    script("res_model", [{"text": "too late", "latency_ms": 10000}])
    out, took = timed(conn, "slow_model", {}, mode)
    assert out["status"] == "failed" and took < 3, (out, took)
    assert "the step's timeout of 1 s passed" in out["error"], out


def test_timeout_must_be_a_duration_and_a_human_step_waits_days(res, conns):
    """A Human step waits for a person: timeout: 2d, as the contract writes
    it (durations take days up to 24), with a route for the timeout."""
    conn = conns(res)
    rows = q(conn, "SELECT severity, path, message FROM tuvl.validate(%s)", ("""
name: bad_timeouts
steps:
  - { id: a, kind: ModelOp, sql: "SELECT 1", timeout: soon }
  - { id: b, kind: Human, form: { type: object }, timeout: 2d }
""",))
    assert ("error", "steps[0].timeout") in [(r[0], r[1]) for r in rows], rows
    assert ("error", "steps[1].timeout") not in [(r[0], r[1]) for r in rows], rows
    assert ("error", "steps[1].routes") in [(r[0], r[1]) for r in rows], rows


# ---------------------------------------------------------------------------
# Aborts interrupt what is executing


def test_an_abort_interrupts_a_long_sql_step_at_once(res, conns):
    conn = conns(res)
    tag = unique()
    run_id = q1(conn, "SELECT tuvl.start_run('nap_default', %s)",
                (json.dumps({"tag": tag, "secs": 60}),))
    wait_until(lambda: q1(conn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                                "AND wait_event = 'PgSleep'") > 0, 10, interval=0.01,
               message="the step to be sleeping")
    started = time.monotonic()
    q(conn, "SELECT tuvl.abort_run(%s, 'too slow')", (run_id,))
    assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "aborted"
    took = time.monotonic() - started
    report(f"abort of a step in pg_sleep(60): run aborted {took:.2f} s after abort_run()")
    assert took < 2, took
    assert writes(conn, tag) == 0


def test_an_abort_drops_the_request_a_step_waits_for(res, conns):
    conn = conns(res)
    run_id = q1(conn, "SELECT tuvl.start_run('slow_http', '{\"ms\": 30000}')")
    # the slow_http step's own timeout is 1 s: give it a longer one for this test
    q(conn, "SELECT tuvl.register_workflow(%s)", (f"""
name: slow_http_long
steps:
  - id: call
    kind: APICall
    http: {{ url: "{HTTP_BASE}/slow?ms={{{{ ms }}}}", timeout: 60s }}
""",))
    q(conn, "SELECT tuvl.abort_run(%s)", (run_id,))
    run_id = q1(conn, "SELECT tuvl.start_run('slow_http_long', '{\"ms\": 30000}')")
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND type = 'tool_call'",
                          (run_id,)), 10, message="the request to be sent")
    time.sleep(0.3)
    started = time.monotonic()
    q(conn, "SELECT tuvl.abort_run(%s, 'no answer')", (run_id,))
    assert q1(conn, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "aborted"
    assert time.monotonic() - started < 2
    # nothing was journaled for the abandoned request
    assert q1(conn, "SELECT count(*) FROM tuvl.events WHERE run_id = %s AND type = 'tool_result'",
              (run_id,)) == 0


def test_aborting_several_runs_of_one_worker_at_once_aborts_each(res, conns, set_gucs):
    # a long batch budget keeps three sleeping runs in one worker's batch:
    # one executes, two wait for their turn; one statement aborts all three,
    # and each worker remembers every abort, not just the last one it got
    set_gucs({"tuvl.max_batch_time": ("1min", "1min")})
    conn, admin = conns(res, autocommit=False), conns(res)
    tags = [unique("multi") for _ in range(3)]
    ids = [q1(conn, "SELECT tuvl.start_run('nap_default', %s)", (json.dumps({"tag": t, "secs": 60}),))
           for t in tags]
    conn.commit()
    wait_until(lambda: q1(admin, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                                 "AND wait_event = 'PgSleep'") > 0, 10, interval=0.01,
               message="a step to be sleeping")
    holders = q(admin, "SELECT DISTINCT lease_owner FROM tuvl.runs WHERE id = ANY (%s)", (ids,))
    started = time.monotonic()
    q(admin, "SELECT tuvl.abort_run(id, 'all of them') FROM unnest(%s::bigint[]) AS id ORDER BY id", (ids,))
    for run_id in ids:
        assert q1(admin, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "aborted", \
            q(admin, "SELECT status, error FROM tuvl.runs WHERE id = %s", (run_id,))
    assert time.monotonic() - started < 3
    assert len(holders) == 1, holders    # the case this test is about
    assert sum(writes(admin, t) for t in tags) == 0


# ---------------------------------------------------------------------------
# Slow steps and the commits of others


def test_a_slow_step_never_holds_up_other_runs(res, conns):
    slow, quick, admin = conns(res, user=SLOWPOKE), conns(res, user=QUICK), conns(res)
    slow_ids = [q1(slow, "SELECT tuvl.start_run('nap_default', %s)",
                   (json.dumps({"tag": unique(), "secs": 3}),)) for _ in range(3)]
    wait_until(lambda: q1(admin, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                                 "AND wait_event = 'PgSleep'") > 0, 10, interval=0.01,
               message="a slow step to be sleeping")
    latencies = []
    for _ in range(30):
        run_id = q1(quick, "SELECT tuvl.start_run('quick')")
        assert q1(quick, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "completed"
        latencies.append(q1(admin, "SELECT extract(epoch FROM finished_at - created_at) FROM tuvl.runs "
                                   "WHERE id = %s", (run_id,)))
    latencies.sort()
    report(f"30 trivial runs of one role while another's steps sleep 3 s: latency median "
           f"{latencies[15] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    # a batch's budget (tuvl.max_batch_time, 50 ms) and a little
    assert latencies[-1] < 0.25, latencies
    # the slow runs still complete, one worker at a time
    for run_id in slow_ids:
        assert q1(admin, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"


# ---------------------------------------------------------------------------
# Fair claims


def test_one_roles_backlog_does_not_delay_another_roles_run(res, conns):
    slow, quick, admin = conns(res, user=SLOWPOKE), conns(res, user=QUICK), conns(res)
    q(slow, "SELECT count(tuvl.start_run('quick')) FROM generate_series(1, 20000)")
    started = time.monotonic()
    run_id = q1(quick, "SELECT tuvl.start_run('quick')")
    assert q1(quick, "SELECT tuvl.wait(%s, '10 s')", (run_id,)) == "completed"
    took = time.monotonic() - started
    backlog = q1(admin, "SELECT count(*) FROM tuvl.runs WHERE status = 'queued' "
                        "AND principal_id = %s::regrole", (SLOWPOKE,))
    report(f"a run started behind another role's 20,000 queued runs: done in {took * 1000:.0f} ms, "
           f"{backlog} of them still queued")
    assert took < 1.0 and backlog > 5000, (took, backlog)
    wait_until(lambda: q1(admin, "SELECT count(*) FROM tuvl.runs WHERE finished_at IS NULL "
                                 "AND principal_id = %s::regrole", (SLOWPOKE,)) == 0, 120,
               interval=0.5, message="the backlog to drain")


def test_priority_orders_runs_within_a_principal(res, conns):
    conn, admin = conns(res, autocommit=False), conns(res)
    # queued in one transaction, so that the workers see them together, by a
    # role new to the queue: the priority is set by hand after queueing,
    # which the claims' cursors (queue.c) would not see for a role they
    # have claimed for before
    q(admin, f"DROP ROLE IF EXISTS {PRIO}")
    q(admin, f"CREATE ROLE {PRIO} IN ROLE tuvl_user")
    q(conn, f"SET ROLE {PRIO}")
    ids = [q1(conn, "SELECT tuvl.start_run('quick')") for _ in range(400)]
    q(conn, "RESET ROLE")
    q(conn, "UPDATE tuvl.runs SET priority = 5 WHERE id = ANY (%s)", (ids[-10:],))
    conn.commit()
    for run_id in ids:
        q1(admin, "SELECT tuvl.wait(%s, '30 s')", (run_id,))
    started = dict(q(admin, "SELECT id, started_at FROM tuvl.runs WHERE id = ANY (%s)", (ids,)))
    first = min(started.values())
    # the ten of higher priority were claimed first, though queued last
    assert all(started[i] == first for i in ids[-10:]), [started[i] for i in ids[-10:]]
    assert sum(1 for i in ids[:-10] if started[i] > first) > 0


def test_a_run_committed_after_younger_ones_were_claimed_is_claimed_at_once(res, conns):
    # the claims go on from where the last one stopped (queue.c): a run whose
    # id is older than runs already claimed, because its transaction
    # committed later, must not wait behind that position
    late, admin = conns(res, autocommit=False), conns(res)
    old_id = q1(late, "SELECT tuvl.start_run('quick')")
    young = [q1(admin, "SELECT tuvl.start_run('quick')") for _ in range(50)]
    for run_id in young:
        assert q1(admin, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert old_id < min(young)
    late.commit()
    started = time.time()
    assert q1(admin, "SELECT tuvl.wait(%s, '30 s')", (old_id,)) == "completed"
    # well before the registry's periodic rescan (10 s) would find it
    assert time.time() - started < 2.0


def test_runs_handed_back_behind_the_cursor_are_claimed_again(res, conns):
    # a worker that takes a slow step alone hands its other runs back to
    # the queue, behind the position later claims start from
    conn = conns(res)
    started = time.time()
    slow = [q1(conn, "SELECT tuvl.start_run('nap_default', %s)",
               (json.dumps({"tag": unique("handback"), "secs": 2}),)) for _ in range(2)]
    quick = [q1(conn, "SELECT tuvl.start_run('quick')") for _ in range(300)]
    for run_id in quick:
        assert q1(conn, "SELECT tuvl.wait(%s, '60 s')", (run_id,)) == "completed", run_id
    # not left for the registry's periodic rescan (10 s)
    took = time.time() - started
    for run_id in slow:
        assert q1(conn, "SELECT tuvl.wait(%s, '60 s')", (run_id,)) == "completed", run_id
    assert took < 6.0, took


# ---------------------------------------------------------------------------
# Size limits


def test_inputs_sources_and_outputs_have_size_limits(res, conns):
    conn = conns(res)
    big = "x" * (9 * 1024 * 1024)
    with pytest.raises(psycopg2.errors.ProgramLimitExceeded) as e:
        q(conn, "SELECT tuvl.start_run('quick', %s)", (json.dumps({"blob": big}),))
    assert "the run input is 9.0 MB, more than tuvl.max_input_size (8 MB)" in str(e.value)
    source = "name: huge\ndescription: " + "y" * (2 * 1024 * 1024) + "\nsteps: []\n"
    with pytest.raises(psycopg2.errors.ProgramLimitExceeded) as e:
        q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    assert "the workflow source is 2.0 MB, more than tuvl.max_source_size (1 MB)" in str(e.value)
    rows = q(conn, "SELECT message FROM tuvl.validate(%s)", (source,))
    assert any("tuvl.max_source_size" in r[0] for r in rows), rows
    out = execute(conn, "big_output", {"bytes": 17 * 1024 * 1024}, "sync")
    assert out["status"] == "failed", out
    assert "the step's output is 17.0 MB, more than tuvl.max_output_size (16 MB)" in out["error"]
    ctx = q1(conn, "SELECT context FROM tuvl.runs WHERE id = %s", (out["run_id"],))
    assert ctx["_last_error_type"] == "too_large"


# ---------------------------------------------------------------------------
# Memory


def rss_anon_kb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


@not_under_asan
def test_large_responses_in_flight_stay_within_the_workers_memory_limit(res, conns, set_gucs):
    limit_mb = 128
    set_gucs({"tuvl.max_worker_memory": (f"{limit_mb}MB", f"{limit_mb}MB")})
    conn = conns(res)
    pids = worker_pids(res)
    base = {pid: rss_anon_kb(pid) for pid in pids}
    peak = dict(base)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for pid in pids:
                peak[pid] = max(peak[pid], rss_anon_kb(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tok = unique()
    try:
        ids = [q1(conn, "SELECT tuvl.start_run('fetch_big', %s)",
                  (json.dumps({"bytes": 10 * 1000 * 1000, "t": f"{tok}{i}"}),)) for i in range(60)]
        for run_id in ids:
            assert q1(conn, "SELECT tuvl.wait(%s, '120 s')", (run_id,)) == "completed", \
                q(conn, "SELECT status, error FROM tuvl.runs WHERE id = %s", (run_id,))
    finally:
        stop.set()
        sampler.join()
    growth = {pid: (peak[pid] - base[pid]) / 1024 for pid in pids}
    report("60 runs fetching 10 MB each, tuvl.max_worker_memory = %d MB: peak private memory "
           "growth per worker %s MB" % (limit_mb, ", ".join(f"{g:.0f}" for g in growth.values())))
    # the limit, plus the working copies of the one result being journaled
    for pid, g in growth.items():
        assert g < limit_mb + 12 * 10, (pid, g)
    sizes = q(conn, "SELECT length(context -> 'get_result' ->> 'body') FROM tuvl.runs WHERE id = ANY (%s)",
              (ids,))
    assert all(s[0] == 10 * 1000 * 1000 for s in sizes)
