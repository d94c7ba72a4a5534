-- Starting, running and waiting for runs.
CREATE SCHEMA shop;
CREATE TABLE shop.orders (id int PRIMARY KEY, status text, amount numeric);
INSERT INTO shop.orders VALUES (1, 'paid', 10), (2, 'new', 5);

SELECT tuvl.register_workflow($$
name: refund_request
trigger:
  input:
    type: object
    required: [order_id]
    properties:
      order_id: { type: integer, minimum: 1 }
      note: { type: string, maxLength: 10 }
steps:
  - id: load_order
    kind: ModelOp
    sql: SELECT id, status, amount FROM shop.orders WHERE id = $1
    params: ["{{ order_id }}"]
    output: order
    routes: { default: check }
  - id: check
    kind: Router
    on: "{{ order.0.status }}"
    routes: { paid: done, default: rejected }
ends:
  - { id: done, status: completed, response: { refunded: true, amount: "{{ order.0.amount }}" } }
  - { id: rejected, status: completed, response: { refunded: false } }
$$) AS version;

-- The synchronous path executes in this backend and returns the end.
SELECT tuvl.run('refund_request', '{"order_id": 1}');
SELECT tuvl.run('refund_request', '{"order_id": 2}');

-- The run row and its journal.
SELECT id, workflow, workflow_version, status, current_step, end_name, response, error,
       attempt, lease_owner IS NULL AS lease_released, principal,
       started_at IS NOT NULL AS started, finished_at >= started_at AS finished
FROM tuvl.runs ORDER BY id;
SELECT seq, type, agent_id, engine, payload - 'input' AS payload
FROM tuvl.events WHERE run_id = 1 ORDER BY seq;
SELECT run_id, max(seq) = count(*) AS gapless, min(seq) = 1 AS starts_at_one
FROM tuvl.events GROUP BY run_id ORDER BY run_id;

-- Input is validated against trigger.input: the error names path and rule.
SELECT tuvl.start_run('refund_request', '{"order_id": "7"}');
SELECT tuvl.start_run('refund_request', '{"order_id": 0}');
SELECT tuvl.start_run('refund_request', '{"note": "x"}');
SELECT tuvl.start_run('refund_request', '{"order_id": 1, "note": "far too long"}');
SELECT tuvl.start_run('refund_request', '[1, 2]');
SELECT tuvl.start_run('no_such_workflow', '{}');
SELECT tuvl.start_run(NULL, '{}');

-- start_run queues a run; wait() refuses to wait inside the same transaction.
BEGIN;
SELECT tuvl.start_run('refund_request', '{"order_id": 1}') AS queued_run \gset
SELECT status, attempt FROM tuvl.runs WHERE id = :queued_run;
SELECT seq, type FROM tuvl.events WHERE run_id = :queued_run;
SELECT tuvl.wait(:queued_run, '1 second');
ROLLBACK;

-- After commit the workers pick it up and wait() returns its final status.
SELECT tuvl.start_run('refund_request', '{"order_id": 1}') AS queued_run \gset
SELECT tuvl.wait(:queued_run, '30 seconds');
SELECT status, end_name, response, attempt FROM tuvl.runs WHERE id = :queued_run;
SELECT string_agg(type, ', ' ORDER BY seq) FROM tuvl.events WHERE run_id = :queued_run;
SELECT tuvl.wait(-1, '1 second');

-- A sync_timeout of zero hands the run to the workers after the first step.
SELECT tuvl.run('refund_request', '{"order_id": 1}', '0 seconds') - 'run_id' AS handed_over;
SELECT tuvl.wait(max(id), '30 seconds') FROM tuvl.runs;

-- wait() refuses REPEATABLE READ, whose snapshot would never change.
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT tuvl.wait(1, '1 second');
ROLLBACK;
