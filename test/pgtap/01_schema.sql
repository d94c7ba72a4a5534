-- The public SQL surface of the contract exists with the documented signatures.
BEGIN;
SELECT plan(46);

SELECT has_schema('tuvl');
SELECT has_table('tuvl', 'workflows', 'tuvl.workflows exists');
SELECT has_table('tuvl', 'runs', 'tuvl.runs exists');
SELECT has_view('tuvl', 'events', 'tuvl.events exists (a view of tuvl.journal)');
SELECT has_table('tuvl', 'journal', 'tuvl.journal exists');
SELECT columns_are('tuvl', 'events',
    ARRAY['run_id', 'seq', 'ts', 'type', 'agent_id', 'engine', 'tokens', 'latency_ms', 'payload'],
    'the journal has the contract''s columns');
SELECT has_column('tuvl', 'runs', c, 'tuvl.runs has ' || c)
FROM unnest(ARRAY['id', 'workflow', 'workflow_version', 'status', 'input', 'context',
                  'current_step', 'end_name', 'response', 'error', 'attempt', 'lease_owner',
                  'lease_expires_at', 'created_at', 'started_at', 'finished_at', 'principal']) AS c;
SELECT has_function('tuvl', 'register_workflow', ARRAY['text']);
SELECT has_function('tuvl', 'validate', ARRAY['text', 'boolean']);
SELECT has_function('tuvl', 'start_run', ARRAY['text', 'jsonb', 'text', 'timestamp with time zone', 'integer', 'integer', 'text', 'interval']);
SELECT has_function('tuvl', 'run', ARRAY['text', 'jsonb', 'interval']);
SELECT has_function('tuvl', 'wait', ARRAY['bigint', 'interval']);
SELECT has_function('tuvl', 'metrics_prometheus', ARRAY[]::text[]);
SELECT has_view('tuvl', 'metrics', 'tuvl.metrics exists');
SELECT columns_are('tuvl', 'metrics', ARRAY['name', 'kind', 'labels', 'value'],
    'tuvl.metrics has the contract''s columns');
SELECT has_column('tuvl', 'runs', 'parent_run_id', 'tuvl.runs has parent_run_id');
SELECT has_role('tuvl_operator');
SELECT has_function('tuvl', 'replay', ARRAY['jsonb', 'text[]']);
SELECT has_function('tuvl', 'purge', ARRAY['interval']);
SELECT function_returns('tuvl', 'purge', ARRAY['interval'], 'bigint');
SELECT has_function('tuvl', 'graph', ARRAY['text', 'text']);
SELECT function_returns('tuvl', 'graph', ARRAY['text', 'text'], 'text');
SELECT has_view('tuvl', v, 'tuvl.' || v || ' exists')
FROM unnest(ARRAY['runs_in_flight', 'people_queue', 'slow_steps', 'workers', 'queue_depth']) AS v;
SELECT has_column('tuvl', 'runs', c, 'tuvl.runs has ' || c)
FROM unnest(ARRAY['parent_step', 'held_by']) AS c;
SELECT has_table('tuvl', 'llm_versions', 'tuvl.llm_versions exists');
SELECT * FROM finish();
ROLLBACK;
