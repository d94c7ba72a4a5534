"""Workers waiting on the network: no transaction held, SIGTERM honoured at once.

A worker whose runs all wait for slow HTTP responses sits in its wait
(latch plus the transfers' sockets), never inside a transaction, and a
SIGTERM makes it exit within a second even mid-transfer; its runs are then
taken over and complete.
"""
import os
import signal
import time

from conftest import connect, q, q1, report, wait_until, worker_pids

PORT = os.environ.get("TUVL_HTTP_PORT")

SLOW = """
name: slow_call
steps:
  - id: call
    kind: APICall
    http:
      url: "http://127.0.0.1:%s/slow?ms=4000&k={{ k }}"
      idempotency: auto
      timeout: 30s
ends: []
"""


def test_waiting_worker_holds_no_transaction_and_exits_on_sigterm(db):
    conn = connect(db)
    q(conn, "SELECT tuvl.register_workflow(%s)", (SLOW % PORT,))
    q(conn, "SELECT tuvl.start_run('slow_call', jsonb_build_object('k', i)) FROM generate_series(1, 40) i")

    # every run has sent its request (tool_call journaled) and now waits
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id "
                                "WHERE r.workflow = 'slow_call' AND e.type = 'tool_call'") == 40,
               timeout=10, message="requests were not sent")
    time.sleep(0.3)

    # the workers say how many transfers they have in flight
    in_flight = q1(conn, "SELECT sum(transfers_in_flight) FROM tuvl.worker_status() "
                         "WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database())")
    assert in_flight == 40, "tuvl.worker_status() shows %s transfers in flight, not 40" % in_flight

    # no worker is inside a transaction while its runs wait on the network
    rows = q(conn, "SELECT pid, state, backend_xid, backend_xmin, xact_start FROM pg_stat_activity "
                   "WHERE datname = current_database() AND backend_type = 'tuvl worker'")
    assert rows, "no tuvl worker"
    for pid, state, xid, xmin, xact_start in rows:
        assert state == "idle", "worker %d is %s while waiting on HTTP" % (pid, state)
        assert xid is None and xmin is None and xact_start is None, \
            "worker %d holds a transaction or snapshot while waiting on HTTP" % pid

    # SIGTERM mid-transfer: the worker is gone within a second
    busy = q(conn, "SELECT lease_owner, count(*) FROM tuvl.runs WHERE workflow = 'slow_call' "
                   "AND status = 'running' GROUP BY 1 ORDER BY 2 DESC LIMIT 1")
    assert busy, "no run is held"
    pid = busy[0][0]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: pid not in worker_pids(db), timeout=1.0,
               message="worker %d still alive 1 s after SIGTERM" % pid)
    gone = time.monotonic() - t0
    report("SIGTERM of a worker with %d HTTP requests in flight: gone in %.3f s" % (busy[0][1], gone))

    # its runs are taken over and every run completes once
    wait_until(lambda: q1(conn, "SELECT count(*) FROM tuvl.runs WHERE workflow = 'slow_call' "
                                "AND status = 'completed'") == 40, timeout=30,
               message="runs did not complete after the SIGTERM")
    assert q1(conn, "SELECT count(*) FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id "
                    "WHERE r.workflow = 'slow_call' AND e.type = 'run_completed'") == 40
    conn.close()
