-- The behaviour of each step kind and of routing.
CREATE SCHEMA steps;
CREATE TABLE steps.log (run_input int, note text);
CREATE FUNCTION steps.classify(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    IF (ctx->>'n')::int < 0 THEN
        RAISE EXCEPTION 'negative input % is not allowed', ctx->>'n'
            USING HINT = 'Pass a positive number.';
    END IF;
    RETURN jsonb_build_object('double', (ctx->>'n')::int * 2,
                              'signal', CASE WHEN (ctx->>'n')::int > 10 THEN 'big' ELSE 'small' END);
END
$$;
CREATE FUNCTION steps.echo(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT ctx - '_last_error' $$;
CREATE FUNCTION steps.not_jsonb(ctx jsonb) RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;

SELECT tuvl.register_workflow($$
name: classify
steps:
  - id: classify
    kind: Functional
    function: steps.classify
    routes: { big: log_big, small: log_small, error: report }
  - id: log_big
    kind: ModelOp
    sql: INSERT INTO steps.log VALUES ($1, $2) RETURNING run_input, note
    params: ["{{ n }}", "big {{ classify_result.double }}"]
    routes: { default: done }
  - id: log_small
    kind: ModelOp
    sql: INSERT INTO steps.log VALUES ($1, 'small')
    params: ["{{ n }}"]
    routes: { default: done }
  - id: report
    kind: Router
    on: "{{ _last_error_type }}"
    routes: { default: failed }
ends:
  - { id: done, status: completed, response: "{{ classify_result }}" }
  - { id: failed, status: failed, response: { error: "{{ _last_error }}" } }
$$);

-- A Functional's "signal" key routes; its result lands in <id>_result.
SELECT tuvl.run('classify', '{"n": 21}');
SELECT tuvl.run('classify', '{"n": 3}');
SELECT * FROM steps.log ORDER BY run_input;
-- A raising Functional takes the error route with _last_error set and its work rolled back.
SELECT tuvl.run('classify', '{"n": -1}') AS r \gset
SELECT :'r'::jsonb - 'run_id' AS result;
SELECT context->>'_last_error' AS last_error, context->>'_last_error_type' AS type
FROM tuvl.runs WHERE id = (:'r'::jsonb->>'run_id')::bigint;
SELECT type, payload->>'signal' AS signal, payload->>'error' AS error, payload->>'sqlstate' AS sqlstate
FROM tuvl.events WHERE run_id = (:'r'::jsonb->>'run_id')::bigint
AND agent_id = 'classify' AND type = 'agent_completed';
SELECT count(*) AS rows_from_failed_run FROM steps.log WHERE run_input = -1;

-- An unmapped error fails the run and records the error on it.
SELECT tuvl.register_workflow($$
name: unmapped_error
steps:
  - id: bad_sql
    kind: ModelOp
    sql: SELECT 1 / $1::int AS x
    params: [0]
$$);
SELECT tuvl.run('unmapped_error');
SELECT status, error FROM tuvl.runs WHERE workflow = 'unmapped_error';
SELECT type, payload->>'error' AS error FROM tuvl.events
WHERE run_id = (SELECT id FROM tuvl.runs WHERE workflow = 'unmapped_error') AND type = 'run_failed';

-- A ModelOp referring to a missing table, two statements, or a function returning the wrong type.
SELECT tuvl.register_workflow($$
name: sql_errors
steps:
  - id: pick
    kind: Router
    on: "{{ case }}"
    routes: { missing: missing_table, two: two_statements, wrongtype: wrong_type }
  - id: missing_table
    kind: ModelOp
    sql: SELECT * FROM steps.nope
    routes: { error: fail }
  - id: two_statements
    kind: ModelOp
    sql: SELECT 1; SELECT 2
    routes: { error: fail }
  - id: wrong_type
    kind: Functional
    function: steps.not_jsonb
    routes: { error: fail }
  - id: unknown_function
    kind: Functional
    function: steps.does_not_exist
    routes: { error: fail }
ends:
  - { id: fail, status: failed, response: "{{ _last_error }}" }
$$);
SELECT tuvl.run('sql_errors', '{"case": "missing"}')->'response';
SELECT tuvl.run('sql_errors', '{"case": "two"}')->'response';
SELECT tuvl.run('sql_errors', '{"case": "wrongtype"}')->'response';
-- A Router value with no route and no default fails the run.
SELECT tuvl.run('sql_errors', '{"case": "other"}') - 'run_id';
-- A missing template key is a step error.
SELECT tuvl.run('sql_errors', '{}') - 'run_id';

-- ModelOp parameters: types are inferred, NULL and JSON values bind correctly.
CREATE TABLE steps.typed (i int, t text, j jsonb, b boolean, d date);
SELECT tuvl.register_workflow($$
name: typed
steps:
  - id: ins
    kind: ModelOp
    sql: INSERT INTO steps.typed VALUES ($1, $2, $3, $4, $5) RETURNING *
    params: ["{{ i }}", "{{ t }}", "{{ j }}", "{{ b }}", "{{ d }}"]
    output: row
ends: []
$$);
SELECT tuvl.run('typed', '{"i": 5, "t": "it''s; DROP TABLE x", "j": {"k": [1]}, "b": true, "d": "2026-01-02"}')->'end';
SELECT tuvl.run('typed', '{"i": null, "t": null, "j": null, "b": false, "d": null}')->'end';
SELECT * FROM steps.typed ORDER BY i NULLS LAST;
SELECT context->'row' FROM tuvl.runs WHERE workflow = 'typed' ORDER BY id;

-- Steps without a default route continue with the next step; after the last, the run completes.
SELECT tuvl.register_workflow($$
name: sequence
steps:
  - { id: one, kind: Functional, function: steps.echo, output: first, compensate: undo }
  - { id: cleanup, kind: ModelOp, sql: "DELETE FROM steps.log" }
  - { id: two, kind: ModelOp, sql: "SELECT count(*) AS n FROM steps.log", output: counted }
  - { id: undo, kind: ModelOp, sql: "SELECT 'never runs'" }
ends: []
$$);
SELECT tuvl.run('sequence', '{"n": 1}');
SELECT string_agg(agent_id, ' -> ' ORDER BY seq) FROM tuvl.events
WHERE run_id = (SELECT max(id) FROM tuvl.runs) AND type = 'agent_started';

-- The step may not change the settings of the session that runs the next step.
CREATE FUNCTION steps.set_guc(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('work_mem', '1234kB', false);
    RETURN jsonb_build_object('work_mem', current_setting('work_mem'));
END
$$;
SELECT tuvl.register_workflow($$
name: guc
steps:
  - { id: s, kind: Functional, function: steps.set_guc, routes: { default: done } }
ends:
  - { id: done, status: completed, response: "{{ s_result.work_mem }}" }
$$);
SELECT tuvl.run('guc')->'response' AS inside_step, current_setting('work_mem') AS after_step;
