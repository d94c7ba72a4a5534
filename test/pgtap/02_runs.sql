-- Runs through the synchronous path, inside a transaction that is rolled back.
BEGIN;
SELECT plan(16);

CREATE FUNCTION pg_temp.noop(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"ok": true}'::jsonb $$;
CREATE TABLE public.tap_items (k int PRIMARY KEY, label text);

SELECT lives_ok($$
    SELECT tuvl.register_workflow('
name: tap_flow
trigger:
  input: { type: object, required: [k], properties: { k: { type: integer } } }
steps:
  - id: add
    kind: ModelOp
    sql: INSERT INTO public.tap_items VALUES ($1, $2) RETURNING k
    params: ["{{ k }}", "item {{ k }}"]
    routes: { default: decide, error: dup }
  - id: decide
    kind: Router
    on: "{{ add_result.0.k }}"
    routes: { "1": one, default: other }
ends:
  - { id: one, status: completed, response: { first: true } }
  - { id: other, status: completed, response: "{{ add_result.0.k }}" }
  - { id: dup, status: failed, response: "{{ _last_error }}" }
')$$, 'a valid workflow registers');

SELECT is((tuvl.run('tap_flow', '{"k": 1}'))->>'end', 'one', 'the Router routes the value 1 to its own end');
SELECT is((tuvl.run('tap_flow', '{"k": 2}'))->'response', '2'::jsonb, 'the default route catches other values and the response keeps its type');
SELECT is((SELECT count(*) FROM public.tap_items)::int, 2, 'each ModelOp wrote exactly one row');
SELECT is((tuvl.run('tap_flow', '{"k": 2}'))->>'status', 'failed', 'a duplicate key takes the error route to a failed end');
SELECT matches((SELECT response #>> '{}' FROM tuvl.runs ORDER BY id DESC LIMIT 1),
    'duplicate key value violates unique constraint', 'the error message reaches the end''s response');
SELECT is((SELECT count(*) FROM public.tap_items)::int, 2, 'the failed step''s insert was rolled back');

SELECT throws_ok($$SELECT tuvl.start_run('tap_flow', '{"k": "x"}')$$, '22023',
    'run input does not match its schema', 'input violating trigger.input is refused');
SELECT throws_ok($$SELECT tuvl.start_run('tap_flow', '{}')$$, '22023',
    'run input does not match its schema', 'a missing required key is refused');
SELECT throws_ok($$SELECT tuvl.start_run('no_such_flow')$$, '42704',
    'workflow "no_such_flow" does not exist', 'an unknown workflow is an error');
SELECT throws_ok($$SELECT tuvl.register_workflow('name: [')$$, '22P02',
    'could not parse workflow YAML', 'bad YAML is an error');
SELECT throws_ok($$SELECT tuvl.register_workflow('
name: x
steps:
  - { id: a, kind: Teleport }
')$$, '42P17', 'workflow "x" is not valid', 'an unknown step kind is an error');

-- Every run's journal is gapless and ends with exactly one terminal event.
SELECT is((SELECT count(*) FROM (SELECT run_id FROM tuvl.events GROUP BY run_id
           HAVING max(seq) <> count(*) OR min(seq) <> 1) g)::int, 0, 'journals have no gaps');
SELECT is((SELECT count(*) FROM tuvl.events WHERE type IN ('run_completed', 'run_failed'))::int,
    (SELECT count(*) FROM tuvl.runs WHERE status IN ('completed', 'failed'))::int,
    'one terminal event per finished run');
SELECT ok((SELECT bool_and(lease_owner IS NULL AND lease_expires_at IS NULL) FROM tuvl.runs
           WHERE status IN ('completed', 'failed')), 'finished runs hold no lease');
SELECT is(tuvl.version(), (SELECT extversion FROM pg_extension WHERE extname = 'tuvl'),
    'the library version matches the installed extension');

SELECT * FROM finish();
ROLLBACK;
