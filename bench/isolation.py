#!/usr/bin/env python3
"""Batch isolation check: a failing step in a batch affects no other run.

Workers advance many runs per transaction, each transition in its own
subtransaction.  This queues N runs (default 1,000) of workflow `iso`, whose
first step is a Functional that writes a row to bench.iso_side and then, for
every 10th run (input i % 10 = 0), raises; there is no error route, so those
runs fail.  A second Functional step follows for the others.  Both functions
record txid_current(), the worker's top-level transaction, so the check can
show that failing and succeeding transitions shared commits.

Checks (each printed as PASS/FAIL; the exit status is 1 if any fails):
  * exactly N/10 runs failed, the rest completed, and the failed ones are
    exactly the runs with i % 10 = 0;
  * every run's journal is gapless: seq = 1..n, n = runs.last_seq, and it
    ends with run_completed or run_failed;
  * the side table holds one row per completed run and none of a failed
    run (a failed step's writes were rolled back with it, the others' kept);
  * failing transitions shared their transaction with succeeding ones.
"""
import argparse
import re
import sys
import time

from common import connect, log, register_workflow_once, wait_for_workers, write_json

WORKFLOW = """\
name: iso
description: every 10th run fails in its first step (batch isolation check)
trigger:
  input:
    type: object
    required: [i]
    properties: { i: { type: integer } }
steps:
  - { id: first, kind: Functional, function: bench.iso_first }
  - { id: second, kind: Functional, function: bench.iso_second }
"""

FUNCTIONS = [
    "CREATE SCHEMA IF NOT EXISTS bench",
    "CREATE TABLE IF NOT EXISTS bench.iso_side (i integer NOT NULL, step text NOT NULL, xid bigint NOT NULL)",
    """CREATE OR REPLACE FUNCTION bench.iso_first(ctx jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    i integer := (ctx->>'i')::integer;
BEGIN
    INSERT INTO bench.iso_side VALUES (i, 'first', txid_current());
    IF i % 10 = 0 THEN
        RAISE EXCEPTION 'bench: run with i = % fails on purpose in transaction %', i, txid_current();
    END IF;
    RETURN jsonb_build_object('first', i);
END
$$""",
    """CREATE OR REPLACE FUNCTION bench.iso_second(ctx jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO bench.iso_side VALUES ((ctx->>'i')::integer, 'second', txid_current());
    RETURN jsonb_build_object('second', true);
END
$$""",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="bench")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    n = args.runs
    want_failed = n // 10

    conn = connect(args.db)
    cur = conn.cursor()
    for sql in FUNCTIONS:
        cur.execute(sql)
    register_workflow_once(cur, "iso", WORKFLOW)
    cur.execute("TRUNCATE bench.iso_side")
    cur.execute("DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs WHERE workflow = 'iso')")
    cur.execute("DELETE FROM tuvl.runs WHERE workflow = 'iso'")
    wait_for_workers(args.db)

    conn.autocommit = False
    cur.execute("SELECT count(tuvl.start_run('iso', jsonb_build_object('i', g))) "
                "FROM generate_series(1, %s) g", (n,))
    conn.commit()
    conn.autocommit = True
    t0 = time.time()
    while True:
        cur.execute("SELECT count(*) FROM tuvl.runs WHERE workflow = 'iso' AND status IN ('queued', 'running')")
        if cur.fetchone()[0] == 0 or time.time() - t0 > 120:
            break
        time.sleep(0.02)
    elapsed = time.time() - t0

    checks = []

    def check(name, ok, detail):
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        log("%s  %s: %s" % ("PASS" if ok else "FAIL", name, detail))

    cur.execute("SELECT status, count(*) FROM tuvl.runs WHERE workflow = 'iso' GROUP BY 1 ORDER BY 1")
    by_status = dict(cur.fetchall())
    check("statuses", by_status == {"completed": n - want_failed, "failed": want_failed},
          "%s (want %d completed, %d failed)" % (by_status, n - want_failed, want_failed))

    cur.execute("SELECT count(*) FROM tuvl.runs WHERE workflow = 'iso' "
                "AND (status = 'failed') <> ((input->>'i')::integer % 10 = 0)")
    wrong = cur.fetchone()[0]
    check("the failed runs are exactly those with i % 10 = 0", wrong == 0, "%d runs in the wrong state" % wrong)

    # Fresh statistics: the tables may have been truncated and refilled
    # since autovacuum last looked, and a stale estimate of one row turns
    # the journal check into a nested loop over every event.
    cur.execute("ANALYZE tuvl.runs, tuvl.journal")
    cur.execute("""
        WITH r AS (SELECT id, last_seq FROM tuvl.runs WHERE workflow = 'iso'),
             e AS (SELECT run_id, count(*) AS n, min(seq) AS minseq, max(seq) AS maxseq,
                          (array_agg(type ORDER BY seq DESC))[1] AS last_type
                   FROM tuvl.events WHERE run_id IN (SELECT id FROM r) GROUP BY run_id)
        SELECT count(*) FILTER (WHERE e.run_id IS NOT NULL
                                  AND (e.n <> e.maxseq OR e.minseq <> 1 OR e.maxseq <> r.last_seq
                                       OR e.last_type NOT IN ('run_completed', 'run_failed'))),
               count(*) FILTER (WHERE e.run_id IS NULL),
               min(e.n), max(e.n), sum(e.n)
        FROM r LEFT JOIN e ON e.run_id = r.id""")
    bad, no_journal, min_events, max_events, events = cur.fetchone()
    check("every journal is gapless (seq 1..last_seq, ends in run_completed/run_failed)",
          bad == 0 and no_journal == 0,
          "%d bad, %d without journal; %s events, %s..%s per run" % (bad, no_journal, events, min_events, max_events))

    cur.execute("SELECT count(*) FILTER (WHERE step = 'first'), count(*) FILTER (WHERE step = 'second'), "
                "count(*) FILTER (WHERE i % 10 = 0), count(DISTINCT (i, step)) = count(*) FROM bench.iso_side")
    first, second, of_failed, unique = cur.fetchone()
    ok_rows = n - want_failed
    check("side effects: committed once per completed run, rolled back for failed ones",
          first == ok_rows and second == ok_rows and of_failed == 0 and unique,
          "%d first-step rows, %d second-step rows, %d rows of failed runs, unique=%s (want %d, %d, 0, True)"
          % (first, second, of_failed, unique, ok_rows, ok_rows))

    # Transactions in which a step failed, from the error messages, against
    # the transactions in which first steps succeeded.
    cur.execute("SELECT error FROM tuvl.runs WHERE workflow = 'iso' AND status = 'failed'")
    failed_xids = set()
    for (error,) in cur.fetchall():
        m = re.search(r"in transaction (\d+)", error or "")
        if m:
            failed_xids.add(int(m.group(1)))
    cur.execute("SELECT xid, count(*) FROM bench.iso_side GROUP BY xid")
    ok_by_xid = dict(cur.fetchall())
    shared = [x for x in failed_xids if x in ok_by_xid]
    neighbours = sum(ok_by_xid[x] for x in shared)
    check("failing transitions shared commits with succeeding ones",
          len(shared) > 0,
          "%d of the %d transactions with a failing step also committed %d successful step writes; "
          "%d worker transactions in all, %.1f successful steps each on average"
          % (len(shared), len(failed_xids), neighbours, len(ok_by_xid),
             (2 * ok_rows) / max(1, len(ok_by_xid))))

    ok = all(c["ok"] for c in checks)
    log("batch isolation: %s (%d runs in %.2f s)" % ("PASS" if ok else "FAIL", n, elapsed))
    write_json(args.json, {"runs": n, "elapsed_s": elapsed, "by_status": by_status,
                           "checks": checks, "ok": ok})
    conn.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
