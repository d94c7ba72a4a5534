-- Replay as a regression test: the pattern docs/replay.md recommends.
--
-- A fixture is what tuvl.pin_run() returned for a real run; a team keeps it
-- in its repository next to the workflow.  The test registers the workflow as
-- it is now, creates the data its SQL steps read, and asserts that every
-- fixture still replays as recorded: tuvl.replay_divergence(fixture) is NULL.
-- Nothing leaves the database (the workflow has SQL steps and a Human step;
-- the person's answer is served from the fixture), and everything is rolled
-- back at the end.
BEGIN;
SELECT plan(17);
SET LOCAL client_min_messages = warning;  -- the edited versions below leave steps unreachable

CREATE SCHEMA tap_replay;
CREATE TABLE tap_replay.orders (id int PRIMARY KEY, amount numeric NOT NULL);
CREATE TABLE tap_replay.refunds (id serial PRIMARY KEY, order_id int NOT NULL, amount numeric NOT NULL);
INSERT INTO tap_replay.orders VALUES (1, 40), (2, 900);

-- The workflow as it is in the repository today.
SELECT lives_ok($$
    SELECT tuvl.register_workflow($yaml$
name: tap_refund
trigger:
  input: { type: object, required: [order_id], properties: { order_id: { type: integer } } }
steps:
  - id: load
    kind: ModelOp
    sql: SELECT amount, amount > 100 AS large FROM tap_replay.orders WHERE id = $1
    params: ["{{ order_id }}"]
    output: order
  - id: size
    kind: Router
    on: "{{ order.0.large }}"
    routes: { "true": review, default: refund }
  - id: review
    kind: Human
    form: { type: object, required: [approved], properties: { approved: { type: boolean } } }
    output: review
    routes: { default: decide }
  - id: decide
    kind: Router
    on: "{{ review.approved }}"
    routes: { "true": refund, default: refused }
  - id: refund
    kind: ModelOp
    sql: INSERT INTO tap_replay.refunds (order_id, amount) VALUES ($1, $2) RETURNING amount
    params: ["{{ order_id }}", "{{ order.0.amount }}"]
    routes: { default: done }
ends:
  - { id: done, status: completed, response: { refunded: "{{ refund_result.0.amount }}" } }
  - { id: refused, status: completed, response: { refunded: 0 } }
$yaml$)$$, 'the workflow registers');

-- The fixture pinned from a run of order 2 (a large refund a person approved),
-- exactly as SELECT tuvl.pin_run(1) returned it on the machine that recorded it.
CREATE TEMP TABLE fixtures (name text PRIMARY KEY, fixture jsonb NOT NULL);
INSERT INTO fixtures VALUES ('large_approved', $fixture$
{
    "end": "done",
    "input": {
        "order_id": 2
    },
    "run_id": 1,
    "source": "\nname: tap_refund\ntrigger:\n  input: { type: object, required: [order_id], properties: { order_id: { type: integer } } }\nsteps:\n  - id: load\n    kind: ModelOp\n    sql: SELECT amount, amount > 100 AS large FROM tap_replay.orders WHERE id = $1\n    params: [\"{{ order_id }}\"]\n    output: order\n  - id: size\n    kind: Router\n    on: \"{{ order.0.large }}\"\n    routes: { \"true\": review, default: refund }\n  - id: review\n    kind: Human\n    form: { type: object, required: [approved], properties: { approved: { type: boolean } } }\n    output: review\n    routes: { default: decide }\n  - id: decide\n    kind: Router\n    on: \"{{ review.approved }}\"\n    routes: { \"true\": refund, default: refused }\n  - id: refund\n    kind: ModelOp\n    sql: INSERT INTO tap_replay.refunds (order_id, amount) VALUES ($1, $2) RETURNING amount\n    params: [\"{{ order_id }}\", \"{{ order.0.amount }}\"]\n    routes: { default: done }\nends:\n  - { id: done, status: completed, response: { refunded: \"{{ refund_result.0.amount }}\" } }\n  - { id: refused, status: completed, response: { refunded: 0 } }\n",
    "status": "completed",
    "tokens": 0,
    "effects": [
        {
            "step": "review",
            "type": "human",
            "result": {
                "by": "postgres",
                "op": "human",
                "data": {
                    "approved": true
                }
            }
        }
    ],
    "version": 1,
    "key_base": "tuvl-98566e10dcd8093f-1",
    "response": {
        "refunded": 900
    },
    "workflow": "tap_refund",
    "artifacts": null,
    "tuvl_fixture": 1
}
$fixture$);

-- A variation edited by hand: the person refused.
INSERT INTO fixtures
SELECT 'large_refused',
       jsonb_set(jsonb_set(jsonb_set(fixture, '{effects,0,result,data,approved}', 'false'),
                           '{end}', '"refused"'), '{response}', '{"refunded": 0}')
FROM fixtures WHERE name = 'large_approved';

CREATE TEMP TABLE runs_before AS SELECT count(*) AS runs FROM tuvl.runs;

SELECT is(tuvl.replay_divergence(fixture), NULL, 'the approved large refund replays as recorded')
FROM fixtures WHERE name = 'large_approved';
SELECT is(tuvl.replay_divergence(fixture), NULL, 'the refused large refund replays as recorded')
FROM fixtures WHERE name = 'large_refused';

CREATE TEMP TABLE replayed AS
SELECT tuvl.replay(fixture) AS r FROM fixtures WHERE name = 'large_approved';
SELECT is((SELECT r - 'transitions' FROM replayed),
    '{"status": "completed", "end": "done", "response": {"refunded": 900}, "effects_served": 1,
      "effects_live": 0, "tokens_spent": 0, "cost_recorded": 0, "tokens_recorded": 0, "workflow_version": 1}'::jsonb,
    'tuvl.replay() returns the end, the response and what it served');
SELECT is((SELECT count(*) FROM tap_replay.refunds WHERE order_id = 2)::int, 2,
    'SQL steps really execute during a replay (two approved replays, two rows)');
SELECT is((SELECT count(*) FROM tuvl.runs), (SELECT runs FROM runs_before),
    'a replay leaves no run behind');

-- Record, pin and replay in one transaction: a small refund needs nobody.
CREATE TEMP TABLE recorded AS SELECT tuvl.run('tap_refund', '{"order_id": 1}') AS r;
SELECT is((SELECT r ->> 'status' FROM recorded), 'completed', 'a small refund completes at once');
INSERT INTO fixtures SELECT 'small', tuvl.pin_run((r ->> 'run_id')::bigint) FROM recorded;
SELECT is((SELECT fixture -> 'effects' FROM fixtures WHERE name = 'small'), '[]'::jsonb,
    'a run of SQL steps only has no effects to serve');
SELECT is(tuvl.replay_divergence(fixture), NULL, 'a run pinned in this transaction replays')
FROM fixtures WHERE name = 'small';

SELECT throws_ok($$SELECT tuvl.replay(jsonb_set(fixture, '{response}', '{"refunded": 1}'))
                   FROM fixtures WHERE name = 'large_approved'$$,
    '22000', 'replay of run 1 diverged: the replay''s response differs from the recording''s',
    'tuvl.replay() raises data_exception at a divergence');

-- Change 1: large refunds no longer need a person.  The recorded answer is
-- left over; the small refund is unaffected.
SELECT lives_ok($$
    SELECT tuvl.register_workflow(replace(fixture ->> 'source',
        'routes: { "true": review, default: refund }', 'routes: { default: refund }'))
    FROM fixtures WHERE name = 'large_approved'$$, 'version 2 skips the review');
SELECT is(tuvl.replay_divergence(fixture),
    'replay of run 1 diverged: the replay used 0 of the 1 recorded effects; the next one is a human of step "review"',
    'a removed Human step is a divergence')
FROM fixtures WHERE name = 'large_approved';
SELECT is(tuvl.replay_divergence(fixture), NULL, 'the small refund still replays under version 2')
FROM fixtures WHERE name = 'small';

-- Change 2: the decision is read the wrong way round.
SELECT lives_ok($$
    SELECT tuvl.register_workflow(replace(fixture ->> 'source',
        'routes: { "true": refund, default: refused }', 'routes: { "false": refund, default: refused }'))
    FROM fixtures WHERE name = 'large_approved'$$, 'version 3 inverts the decision');
SELECT is(tuvl.replay_divergence(fixture),
    'replay of run 1 diverged: the recorded run ended at end "done", the replay at end "refused"',
    'another route is a divergence naming both ends')
FROM fixtures WHERE name = 'large_approved';

-- Change 3: the SQL of a step refunds less.
SELECT lives_ok($$
    SELECT tuvl.register_workflow(replace(fixture ->> 'source', 'VALUES ($1, $2)', 'VALUES ($1, $2 * 0.9)'))
    FROM fixtures WHERE name = 'large_approved'$$, 'version 4 refunds 90%');
SELECT matches(tuvl.replay_divergence(fixture),
    '^replay of run \d+ diverged: the replay''s response differs from the recording''s$',
    'another response is a divergence')
FROM fixtures WHERE name = 'small';

SELECT * FROM finish();
ROLLBACK;
