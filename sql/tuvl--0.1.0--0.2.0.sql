/* tuvl--0.1.0--0.2.0.sql: the changes of release 0.2.0 */

\echo Use "ALTER EXTENSION tuvl UPDATE TO '0.2.0'" to load this file. \quit

/* ------------------------------------------------------------------ roles
 *
 * tuvl_user registers workflows, artifacts and model configs and starts,
 * waits for and controls its own runs; tuvl_operator also sees and
 * controls every run; tuvl_admin also manages secrets, their grants and
 * other roles' names.  Each includes the one before.  Roles are
 * cluster-wide: another database may have made them already.
 */
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'tuvl_user') THEN
        CREATE ROLE tuvl_user NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'tuvl_admin') THEN
        CREATE ROLE tuvl_admin NOLOGIN;
    END IF;
    IF NOT pg_catalog.pg_has_role('tuvl_operator', 'tuvl_user', 'MEMBER') THEN
        GRANT tuvl_user TO tuvl_operator;
    END IF;
    IF NOT pg_catalog.pg_has_role('tuvl_admin', 'tuvl_operator', 'MEMBER') THEN
        GRANT tuvl_operator TO tuvl_admin;
    END IF;
END
$$;

/* ------------------------------------------------------------------ identity by OID
 *
 * Names and runs belong to roles by OID: a role dropped and created again
 * under the same name inherits nothing.  regrole shows the role's name
 * and survives pg_dump and restore (it is dumped as the name).  Owners
 * that no longer exist pass to the extension's owner.
 */
DROP POLICY schedule_slots_start ON tuvl.schedule_slots;
DROP POLICY schedule_slots_record ON tuvl.schedule_slots;

UPDATE tuvl.workflows SET owner = (SELECT r.rolname FROM pg_catalog.pg_roles r, pg_catalog.pg_extension e
                                   WHERE e.extname OPERATOR(pg_catalog.=) 'tuvl'
                                     AND r.oid OPERATOR(pg_catalog.=) e.extowner)
WHERE pg_catalog.to_regrole(pg_catalog.quote_ident(owner::pg_catalog.text)) IS NULL;
ALTER TABLE tuvl.workflows ALTER COLUMN owner TYPE pg_catalog.regrole
    USING pg_catalog.to_regrole(pg_catalog.quote_ident(owner::pg_catalog.text));

UPDATE tuvl.artifacts SET owner = (SELECT r.rolname FROM pg_catalog.pg_roles r, pg_catalog.pg_extension e
                                   WHERE e.extname OPERATOR(pg_catalog.=) 'tuvl'
                                     AND r.oid OPERATOR(pg_catalog.=) e.extowner)
WHERE pg_catalog.to_regrole(pg_catalog.quote_ident(owner::pg_catalog.text)) IS NULL;
ALTER TABLE tuvl.artifacts ALTER COLUMN owner TYPE pg_catalog.regrole
    USING pg_catalog.to_regrole(pg_catalog.quote_ident(owner::pg_catalog.text));

UPDATE tuvl.llms SET owner = (SELECT r.rolname FROM pg_catalog.pg_roles r, pg_catalog.pg_extension e
                              WHERE e.extname OPERATOR(pg_catalog.=) 'tuvl'
                                AND r.oid OPERATOR(pg_catalog.=) e.extowner)
WHERE pg_catalog.to_regrole(pg_catalog.quote_ident(owner::pg_catalog.text)) IS NULL;
ALTER TABLE tuvl.llms ALTER COLUMN owner TYPE pg_catalog.regrole
    USING pg_catalog.to_regrole(pg_catalog.quote_ident(owner::pg_catalog.text));

/* provider openai_responses: OpenAI's Responses API */
ALTER TABLE tuvl.llms DROP CONSTRAINT llms_provider_check;
ALTER TABLE tuvl.llms ADD CONSTRAINT llms_provider_check
    CHECK (provider OPERATOR(pg_catalog.=) ANY (ARRAY['openai', 'anthropic', 'openai_responses']));

COMMENT ON COLUMN tuvl.workflows.owner IS 'the role that registered version 1; only it adds versions (tuvl.transfer hands the name over)';
COMMENT ON COLUMN tuvl.artifacts.owner IS 'the role that registered version 1; only it adds versions (tuvl.transfer hands the name over)';
COMMENT ON COLUMN tuvl.llms.owner IS 'the role that registered the config; only it replaces it (tuvl.transfer hands the name over)';

/* A run's principal: principal is its name when the run started, principal_id the role. */
ALTER TABLE tuvl.runs ADD COLUMN principal_id pg_catalog.regrole;
UPDATE tuvl.runs SET principal_id = COALESCE(
    pg_catalog.to_regrole(pg_catalog.quote_ident(principal::pg_catalog.text)), 0::pg_catalog.oid::pg_catalog.regrole);
ALTER TABLE tuvl.runs ALTER COLUMN principal_id SET NOT NULL;
COMMENT ON COLUMN tuvl.runs.principal IS 'name of the role that started the run, as it was then';
COMMENT ON COLUMN tuvl.runs.principal_id IS 'the role that started the run: its steps execute as this role';

DROP POLICY runs_visible ON tuvl.runs;
/* text, not name: 64 bytes in every version of every row, for a few */
ALTER TABLE tuvl.runs ALTER COLUMN principal TYPE text;
CREATE POLICY runs_visible ON tuvl.runs FOR SELECT
    USING (principal_id::pg_catalog.oid OPERATOR(pg_catalog.=)
               (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
           OR pg_catalog.pg_has_role('tuvl_operator', 'USAGE'));

CREATE POLICY schedule_slots_start ON tuvl.schedule_slots FOR INSERT
    WITH CHECK (pg_catalog.pg_has_role((SELECT w.owner FROM tuvl.workflows w
                                        WHERE w.name OPERATOR(pg_catalog.=) workflow
                                          AND w.version OPERATOR(pg_catalog.=) 1), 'MEMBER')
                OR pg_catalog.pg_has_role('tuvl_operator', 'MEMBER'));
CREATE POLICY schedule_slots_record ON tuvl.schedule_slots FOR UPDATE
    USING (pg_catalog.pg_has_role((SELECT w.owner FROM tuvl.workflows w
                                   WHERE w.name OPERATOR(pg_catalog.=) workflow
                                     AND w.version OPERATOR(pg_catalog.=) 1), 'MEMBER')
           OR pg_catalog.pg_has_role('tuvl_operator', 'MEMBER'));

/* ------------------------------------------------------------------ claims
 *
 * Workers share the queue among principals (lease.c) and take each one's
 * runs by priority, then age, from where the last claim stopped (queue.c):
 * the key is -priority so that (key, id) compares as one ascending row.
 * bigint: -priority of the smallest integer does not fit an integer.
 */
ALTER TABLE tuvl.runs ADD COLUMN priority integer NOT NULL DEFAULT 0;
COMMENT ON COLUMN tuvl.runs.priority IS 'higher first among the queued runs of the same principal';
DROP INDEX tuvl.runs_queued_idx;
CREATE INDEX runs_queued_fair_idx
    ON tuvl.runs ((principal_id::pg_catalog.oid), (OPERATOR(pg_catalog.-) priority::pg_catalog.int8), id)
    WHERE status = 'queued';

/* ------------------------------------------------------------------ timers
 *
 * A run whose Sleep step waits (or started with not_before) is sleeping
 * until wake_at; a Human step with a timeout waits until then.  The
 * workers' maintenance queues those whose time has come, through this
 * index.
 */
ALTER TABLE tuvl.runs ADD COLUMN wake_at timestamptz;
COMMENT ON COLUMN tuvl.runs.wake_at IS 'when a sleeping run wakes, or a Human step''s timeout passes; NULL otherwise';
CREATE INDEX runs_sleeping_idx ON tuvl.runs (wake_at) WHERE status = 'sleeping';
CREATE INDEX runs_human_timeout_idx ON tuvl.runs (wake_at)
    WHERE status = 'waiting_human' AND wake_at IS NOT NULL;
CREATE INDEX runs_approval_timeout_idx ON tuvl.runs (wake_at)
    WHERE status = 'waiting_approval' AND wake_at IS NOT NULL;
COMMENT ON COLUMN tuvl.runs.status IS 'queued, running, waiting_human, waiting_approval, paused, sleeping, completed, failed, aborted, compensating or compensated; only tuvl writes this table';

/* ------------------------------------------------------------------ secrets
 *
 * A run may use a secret only when its principal holds a grant for it
 * (a grant to a role is usable by its members).  Secrets and grants are
 * managed by tuvl_admin; values are never readable back.
 */
CREATE TABLE tuvl.secret_grants (
    secret text NOT NULL,
    grantee pg_catalog.regrole NOT NULL,
    granted_by name NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (secret, grantee)
);
COMMENT ON TABLE tuvl.secret_grants IS 'which roles'' runs may use which secrets (tuvl.grant_secret, tuvl.revoke_secret); kept by pg_dump, unlike the secrets themselves';
ALTER TABLE tuvl.secret_grants ENABLE ROW LEVEL SECURITY;
CREATE POLICY secret_grants_visible ON tuvl.secret_grants FOR SELECT
    USING (pg_catalog.pg_has_role(grantee, 'USAGE') OR pg_catalog.pg_has_role('tuvl_admin', 'USAGE'));

CREATE OR REPLACE FUNCTION tuvl.set_secret(name text, value text)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    INSERT INTO tuvl.secrets AS s (name, value, updated_by) VALUES ($1, $2, SESSION_USER)
    ON CONFLICT ON CONSTRAINT secrets_pkey
    DO UPDATE SET value = excluded.value, updated_at = pg_catalog.now(), updated_by = excluded.updated_by;
END;
COMMENT ON FUNCTION tuvl.set_secret(text, text) IS 'store or replace a secret (tuvl_admin); its value is never readable back; runs use it only where tuvl.grant_secret allows';

CREATE FUNCTION tuvl.grant_secret(name text, role pg_catalog.regrole)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF role IS NULL OR name IS NULL THEN
        RAISE EXCEPTION 'secret name and role must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM tuvl.secrets s WHERE s.name OPERATOR(pg_catalog.=) grant_secret.name) THEN
        RAISE EXCEPTION 'secret "%" does not exist', grant_secret.name
            USING ERRCODE = 'undefined_object', HINT = 'Store it first with tuvl.set_secret().';
    END IF;
    INSERT INTO tuvl.secret_grants AS g (secret, grantee, granted_by)
    VALUES (grant_secret.name, grant_secret.role, SESSION_USER)
    ON CONFLICT (secret, grantee) DO NOTHING;
END
$$;
COMMENT ON FUNCTION tuvl.grant_secret(text, pg_catalog.regrole) IS 'let the runs of a role (and of its members) use a secret (tuvl_admin)';

CREATE FUNCTION tuvl.revoke_secret(name text, role pg_catalog.regrole)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM tuvl.secret_grants g
    WHERE g.secret OPERATOR(pg_catalog.=) revoke_secret.name
      AND g.grantee OPERATOR(pg_catalog.=) revoke_secret.role;
    IF NOT FOUND THEN
        RAISE NOTICE 'role "%" held no grant for secret "%"', revoke_secret.role, revoke_secret.name;
    END IF;
END
$$;
COMMENT ON FUNCTION tuvl.revoke_secret(text, pg_catalog.regrole) IS 'take a secret grant back (tuvl_admin); runs check grants at every use';

/* ------------------------------------------------------------------ names */
CREATE FUNCTION tuvl.transfer(kind text, name text, new_owner pg_catalog.regrole)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_transfer'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.transfer(text, text, pg_catalog.regrole) IS 'hand a workflow, artifact or llm name (every version) to another role: its owner, tuvl_admin or a superuser';

/* ------------------------------------------------------------------ SQL bodies
 *
 * SQL-standard bodies are parsed when they are created: nothing a caller
 * puts on its search_path changes what they mean.  PL/pgSQL functions
 * pin their search_path and qualify what they call.
 */
CREATE OR REPLACE FUNCTION tuvl._control_apply(control jsonb, consumed text[], added jsonb, steers_done text[])
RETURNS jsonb LANGUAGE sql IMMUTABLE
RETURN (
    SELECT NULLIF(
        CASE WHEN steers_done IS NULL
                  OR pg_catalog.jsonb_typeof(x OPERATOR(pg_catalog.->) 'steer') IS DISTINCT FROM 'object' THEN x
             WHEN (x OPERATOR(pg_catalog.->) 'steer') OPERATOR(pg_catalog.-) steers_done
                  OPERATOR(pg_catalog.=) '{}'::pg_catalog.jsonb THEN x OPERATOR(pg_catalog.-) 'steer'::pg_catalog.text
             ELSE pg_catalog.jsonb_set(x, '{steer}',
                                       (x OPERATOR(pg_catalog.->) 'steer') OPERATOR(pg_catalog.-) steers_done) END,
        '{}'::pg_catalog.jsonb)
    FROM (SELECT (COALESCE(control, '{}'::pg_catalog.jsonb)
                  OPERATOR(pg_catalog.-) COALESCE(consumed, '{}'::pg_catalog.text[]))
                 OPERATOR(pg_catalog.||) COALESCE(added, '{}'::pg_catalog.jsonb) AS x) s);

CREATE OR REPLACE FUNCTION tuvl._llm_request_shape(request jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE
RETURN (
    SELECT CASE WHEN pg_catalog.jsonb_typeof(request OPERATOR(pg_catalog.->) 'messages') OPERATOR(pg_catalog.=) 'array' THEN
        pg_catalog.jsonb_set(request, '{messages}', COALESCE((
            SELECT pg_catalog.jsonb_agg(CASE
                WHEN m OPERATOR(pg_catalog.->>) 'role' OPERATOR(pg_catalog.=) 'tool'
                    THEN m OPERATOR(pg_catalog.-) 'content'::pg_catalog.text
                WHEN pg_catalog.jsonb_typeof(m OPERATOR(pg_catalog.->) 'content') OPERATOR(pg_catalog.=) 'array'
                    THEN pg_catalog.jsonb_set(m, '{content}', COALESCE((
                        SELECT pg_catalog.jsonb_agg(CASE WHEN b OPERATOR(pg_catalog.->>) 'type' OPERATOR(pg_catalog.=) 'tool_result'
                                                         THEN b OPERATOR(pg_catalog.-) 'content'::pg_catalog.text ELSE b END
                                                    ORDER BY o)
                        FROM pg_catalog.jsonb_array_elements(m OPERATOR(pg_catalog.->) 'content')
                             WITH ORDINALITY AS x(b, o)), '[]'::pg_catalog.jsonb))
                ELSE m END ORDER BY i)
            FROM pg_catalog.jsonb_array_elements(request OPERATOR(pg_catalog.->) 'messages')
                 WITH ORDINALITY AS y(m, i)), '[]'::pg_catalog.jsonb))
    ELSE request END);

/* replay(fixture, live): the steps named in live make their effects for real */
DROP FUNCTION tuvl.replay_divergence(jsonb);
DROP FUNCTION tuvl.replay(jsonb);
CREATE FUNCTION tuvl.replay(fixture jsonb, live text[] DEFAULT NULL) RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_replay' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.replay(jsonb, text[]) IS 'run the current workflow again with every outside result served from the fixture, except the effects of the steps named in live, which are made for real; raises at the first divergence';

CREATE FUNCTION tuvl.replay_divergence(fixture jsonb, live text[] DEFAULT NULL) RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM tuvl.replay(fixture, live);
    RETURN NULL;
EXCEPTION WHEN data_exception THEN
    IF SQLSTATE OPERATOR(pg_catalog.=) '22000' THEN    -- a divergence; other errors propagate
        RETURN SQLERRM;
    END IF;
    RAISE;
END
$$;
COMMENT ON FUNCTION tuvl.replay_divergence(jsonb, text[]) IS 'NULL when tuvl.replay(fixture, live) succeeds, else the divergence it raised: for pgTAP, is(tuvl.replay_divergence(f), NULL)';

/*
 * Missed slots: pg_cron never fires a slot it missed.  With
 * trigger.catch_up: N, start_scheduled() also starts the last N slots of
 * the schedule since the last slot it started (tuvl._missed_slots reads
 * the schedule as pg_cron does), oldest first, each at most once.
 */
CREATE FUNCTION tuvl._missed_slots(schedule text, after timestamptz, before timestamptz, max integer)
RETURNS timestamptz[]
AS 'MODULE_PATHNAME', 'tuvl_missed_slots' LANGUAGE C STRICT IMMUTABLE PARALLEL SAFE;
COMMENT ON FUNCTION tuvl._missed_slots(text, timestamptz, timestamptz, integer) IS 'the last max slots of a cron schedule strictly between after and before (UTC, at most 400 days back), oldest first';

CREATE OR REPLACE FUNCTION tuvl.start_scheduled(workflow text, slot timestamptz DEFAULT pg_catalog.date_trunc('minute', pg_catalog.now()))
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    id bigint;
    trig jsonb;
    last_slot timestamptz;
    slots timestamptz[] := ARRAY[start_scheduled.slot];
    one timestamptz;
BEGIN
    SELECT w.definition OPERATOR(pg_catalog.->) 'trigger' INTO trig FROM tuvl.workflows w
    WHERE w.name OPERATOR(pg_catalog.=) start_scheduled.workflow ORDER BY w.version DESC LIMIT 1;
    IF (trig OPERATOR(pg_catalog.->>) 'catch_up')::pg_catalog.int4 OPERATOR(pg_catalog.>) 0 THEN
        SELECT pg_catalog.max(s.slot) INTO last_slot FROM tuvl.schedule_slots s
        WHERE s.workflow OPERATOR(pg_catalog.=) start_scheduled.workflow
          AND s.slot OPERATOR(pg_catalog.<) start_scheduled.slot;
        IF last_slot IS NOT NULL THEN
            slots := tuvl._missed_slots(trig OPERATOR(pg_catalog.->>) 'schedule', last_slot, start_scheduled.slot,
                                        (trig OPERATOR(pg_catalog.->>) 'catch_up')::pg_catalog.int4)
                     OPERATOR(pg_catalog.||) slots;
        END IF;
    END IF;
    FOREACH one IN ARRAY slots LOOP
        INSERT INTO tuvl.schedule_slots AS s (workflow, slot) VALUES (start_scheduled.workflow, one)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            id := NULL;         -- this slot's run was started already
            CONTINUE;
        END IF;
        id := tuvl.start_run(start_scheduled.workflow, pg_catalog.jsonb_build_object('_scheduled_at', one));
        UPDATE tuvl.schedule_slots s SET run_id = id
        WHERE s.workflow OPERATOR(pg_catalog.=) start_scheduled.workflow
          AND s.slot OPERATOR(pg_catalog.=) one;
    END LOOP;
    RETURN id;                  -- the run of the slot asked for
END
$$;

/* ------------------------------------------------------------------ privileges
 *
 * PUBLIC keeps only what needs no grant: the schema, the version and the
 * pure functions of the documentation's examples (validate, render).
 * Everything else goes to the roles above.
 */
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA tuvl FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA tuvl FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.version(), tuvl.validate(text, boolean), tuvl.render(jsonb, jsonb) TO PUBLIC;

GRANT EXECUTE ON FUNCTION
    tuvl.register_workflow(text), tuvl.register_llm(text), tuvl.register_artifact(text),
    tuvl.start_run(text, jsonb), tuvl.run(text, jsonb, interval), tuvl.wait(bigint, interval),
    tuvl.pause_run(bigint), tuvl.resume_run(bigint), tuvl.abort_run(bigint, text),
    tuvl.steer_run(bigint, text), tuvl.submit(bigint, jsonb), tuvl.decide(bigint, boolean, text),
    tuvl.pin_run(bigint), tuvl.replay(jsonb, text[]), tuvl.replay_divergence(jsonb, text[]),
    tuvl.mcp_list_tools(text), tuvl.start_scheduled(text, timestamptz),
    tuvl.transfer(text, text, pg_catalog.regrole)
TO tuvl_user;
GRANT EXECUTE ON FUNCTION tuvl.worker_status() TO tuvl_operator;
GRANT EXECUTE ON FUNCTION tuvl.set_secret(text, text), tuvl.grant_secret(text, pg_catalog.regrole),
    tuvl.revoke_secret(text, pg_catalog.regrole)
TO tuvl_admin;

GRANT SELECT ON tuvl.workflows, tuvl.runs, tuvl.events, tuvl.llms, tuvl.artifacts,
    tuvl.mcp_tools, tuvl.schedule_slots, tuvl.secret_grants TO tuvl_user;
GRANT INSERT, UPDATE ON tuvl.schedule_slots TO tuvl_user;
GRANT SELECT (name, updated_at, updated_by) ON tuvl.secrets TO tuvl_admin;

/*
 * Roles that used tuvl 0.1.0 (they own names or started runs) keep
 * working after the update: they become members of tuvl_user.  Secrets
 * are not granted to anyone: grant them with tuvl.grant_secret.
 */
DO $$
DECLARE
    r pg_catalog.regrole;
BEGIN
    FOR r IN SELECT DISTINCT x.role FROM (
                 SELECT w.owner AS role FROM tuvl.workflows w
                 UNION SELECT a.owner FROM tuvl.artifacts a
                 UNION SELECT l.owner FROM tuvl.llms l
                 UNION SELECT u.principal_id FROM tuvl.runs u) x
             WHERE x.role::pg_catalog.oid OPERATOR(pg_catalog.<>) 0
               AND NOT pg_catalog.pg_has_role(x.role::pg_catalog.oid, 'tuvl_user', 'MEMBER')
               AND NOT (SELECT a.rolsuper FROM pg_catalog.pg_roles a WHERE a.oid OPERATOR(pg_catalog.=) x.role)
    LOOP
        EXECUTE pg_catalog.format('GRANT tuvl_user TO %s', r);
    END LOOP;
END
$$;

/* pg_dump keeps the registry too; secrets stay out of dumps (set them again after a restore). */
SELECT pg_catalog.pg_extension_config_dump('tuvl.artifacts', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.schedule_slots', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.mcp_tools', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.secret_grants', '');

/*
 * Notify hooks (src/hook.c): a hook with action notify starts a run of the
 * same workflow version that executes one APICall step on the hook's
 * payload and ends.  It is created in the transaction of the transition
 * that fired the hook, so it exists exactly when that transition
 * committed; parent_run_id names that run.
 */
ALTER TABLE tuvl.runs ADD COLUMN parent_run_id bigint;
ALTER TABLE tuvl.runs ADD COLUMN hook jsonb;
COMMENT ON COLUMN tuvl.runs.parent_run_id IS 'the run whose notify hook started this one, or NULL';
COMMENT ON COLUMN tuvl.runs.hook IS 'for a run a notify hook started: {"hook", "version", "event", "step"}, where step is the one APICall step it executes; NULL otherwise';
CREATE INDEX runs_parent_idx ON tuvl.runs (parent_run_id) WHERE parent_run_id IS NOT NULL;

/*
 * Metrics (src/metrics.c): counters and histograms of steps, agents,
 * tokens, the supervisor and the metric hooks in shared memory (one
 * series per name, labels and role; tuvl._metric_series() returns those
 * the caller may see), and gauges read from tuvl.runs.  Nothing here reads
 * the journal.
 */
CREATE FUNCTION tuvl._metric_series(OUT name text, OUT kind text, OUT labels jsonb, OUT value float8)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'tuvl_metric_series' LANGUAGE C STRICT VOLATILE PARALLEL RESTRICTED;
COMMENT ON FUNCTION tuvl._metric_series() IS 'the shared-memory series of this database the caller may see, one row per role (read tuvl.metrics)';

CREATE OR REPLACE VIEW tuvl.metrics WITH (security_invoker = true) AS
    SELECT s.name, s.kind, s.labels, pg_catalog.sum(s.value)::pg_catalog.float8 AS value
    FROM tuvl._metric_series() s
    GROUP BY s.name, s.kind, s.labels
    UNION ALL
    SELECT 'tuvl.runs', 'gauge', pg_catalog.jsonb_build_object('status', r.status),
           pg_catalog.count(*)::pg_catalog.float8
    FROM tuvl.runs r
    GROUP BY r.status
    UNION ALL
    SELECT 'tuvl.queue.depth', 'gauge', '{}'::jsonb, pg_catalog.count(*)::pg_catalog.float8
    FROM tuvl.runs r WHERE r.status OPERATOR(pg_catalog.=) 'queued'
    UNION ALL
    SELECT 'tuvl.queue.oldest_age_seconds', 'gauge', '{}'::jsonb,
           COALESCE(EXTRACT(epoch FROM pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) pg_catalog.min(r.created_at)), 0)::pg_catalog.float8
    FROM tuvl.runs r WHERE r.status OPERATOR(pg_catalog.=) 'queued';
COMMENT ON VIEW tuvl.metrics IS 'metrics: name, kind (counter, gauge or histogram_bucket), labels, value; a role sees its own runs'', tuvl_operator all';
GRANT SELECT ON tuvl.metrics TO tuvl_user;

CREATE FUNCTION tuvl.metrics_prometheus() RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_metrics_prometheus' LANGUAGE C STRICT STABLE;
COMMENT ON FUNCTION tuvl.metrics_prometheus() IS 'tuvl.metrics in the Prometheus text exposition format';
REVOKE ALL ON FUNCTION tuvl._metric_series(), tuvl.metrics_prometheus() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl._metric_series(), tuvl.metrics_prometheus() TO tuvl_user;
GRANT EXECUTE ON FUNCTION tuvl._missed_slots(text, timestamptz, timestamptz, integer) TO tuvl_user;

/*
 * start_run() with a key, a priority, a version and a traceparent (api.c).
 * A key is unique per role and workflow: a second start with it returns
 * the first run, whatever its status, and the unique index settles
 * concurrent starts.  not_before is refused until runs can wait for a
 * time without a worker.
 */
ALTER TABLE tuvl.runs ADD COLUMN key text;
ALTER TABLE tuvl.runs ADD COLUMN traceparent text;
COMMENT ON COLUMN tuvl.runs.key IS 'the key start_run() was given: one run per role, workflow and key';
COMMENT ON COLUMN tuvl.runs.traceparent IS 'the W3C trace context start_run() was given: the run''s spans continue that trace';
CREATE UNIQUE INDEX runs_key_idx ON tuvl.runs (principal_id, workflow, key) WHERE key IS NOT NULL;

DROP FUNCTION tuvl.start_run(text, jsonb);
CREATE FUNCTION tuvl.start_run(workflow text, input jsonb DEFAULT '{}', key text DEFAULT NULL,
                               not_before timestamptz DEFAULT NULL, priority integer DEFAULT 0,
                               version integer DEFAULT NULL, traceparent text DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'tuvl_start_run'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text) IS 'validate the input and queue a run (of the latest version, or of version), once per key';
REVOKE ALL ON FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text) TO tuvl_user;

/* mcp_list_tools() with headers, such as a bearer token (src/mcp.c). */
DROP FUNCTION tuvl.mcp_list_tools(text);
CREATE FUNCTION tuvl.mcp_list_tools(url text, headers jsonb DEFAULT NULL)
RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_mcp_list_tools'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.mcp_list_tools(text, jsonb) IS 'the tools an MCP server offers (tools/list, every page), with their input schemas; headers may name secrets; remembered in tuvl.mcp_tools';
REVOKE ALL ON FUNCTION tuvl.mcp_list_tools(text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.mcp_list_tools(text, jsonb) TO tuvl_user;

/* ------------------------------------------------------------------ children
 *
 * A Workflow step (src/step_workflow.c) starts child runs in its own
 * transition: each names its parent (parent_run_id, as a notify hook's run
 * does) and the step that started it (parent_step, NULL for a hook's run).
 * The parent waits as waiting_children, held by no worker; the child whose
 * end leaves nothing to wait for (or that failed) queues it again, through
 * the trigger below, in the transaction that ended the child.
 *
 * Runs that may not start yet stay queued but held (held_by): children
 * beyond the step's max_parallel, runs beyond their workflow's
 * concurrency limit.  Claims take only runs nobody holds back.
 */
ALTER TABLE tuvl.runs ADD COLUMN parent_step text;
ALTER TABLE tuvl.runs ADD COLUMN held_by text;
ALTER TABLE tuvl.runs ADD COLUMN concurrency_key text;
ALTER TABLE tuvl.runs ADD COLUMN concurrency_limit integer;
COMMENT ON COLUMN tuvl.runs.parent_run_id IS 'the run whose Workflow step (parent_step) or notify hook started this one, or NULL';
COMMENT ON COLUMN tuvl.runs.parent_step IS 'the parent''s Workflow step that started this run, or NULL';
COMMENT ON COLUMN tuvl.runs.held_by IS 'why a queued run may not start yet: max_parallel (its siblings fill the parent step''s max_parallel) or concurrency (runs of its concurrency key fill the limit); NULL otherwise';
COMMENT ON COLUMN tuvl.runs.concurrency_key IS 'the rendered concurrency.key of the workflow, or NULL';
COMMENT ON COLUMN tuvl.runs.concurrency_limit IS 'concurrency.limit of the run''s workflow version, or NULL';
COMMENT ON COLUMN tuvl.runs.status IS 'queued, running, waiting_human, waiting_approval, waiting_children, paused, sleeping, completed, failed, aborted, compensating or compensated; only tuvl writes this table';

DROP INDEX tuvl.runs_queued_fair_idx;
CREATE INDEX runs_queued_fair_idx
    ON tuvl.runs ((principal_id::pg_catalog.oid), (OPERATOR(pg_catalog.-) priority::pg_catalog.int8), id)
    WHERE status = 'queued' AND held_by IS NULL;
CREATE INDEX runs_held_idx ON tuvl.runs (parent_run_id, id) WHERE held_by = 'max_parallel';
CREATE INDEX runs_children_open_idx ON tuvl.runs (parent_run_id)
    WHERE parent_step IS NOT NULL AND finished_at IS NULL;
CREATE INDEX runs_concurrency_idx ON tuvl.runs (workflow, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND finished_at IS NULL;

CREATE FUNCTION tuvl._run_ended() RETURNS trigger
AS 'MODULE_PATHNAME', 'tuvl_run_ended' LANGUAGE C;
COMMENT ON FUNCTION tuvl._run_ended() IS 'trigger: a child run or a run with a concurrency key ended; queue its parent or the next run held back';
REVOKE ALL ON FUNCTION tuvl._run_ended() FROM PUBLIC;
CREATE TRIGGER runs_ended AFTER UPDATE OF status ON tuvl.runs
    FOR EACH ROW
    WHEN (NEW.finished_at IS NOT NULL AND OLD.finished_at IS NULL
          AND (NEW.parent_step IS NOT NULL OR NEW.concurrency_key IS NOT NULL))
    EXECUTE FUNCTION tuvl._run_ended();

CREATE FUNCTION tuvl._control_changed() RETURNS trigger
AS 'MODULE_PATHNAME', 'tuvl_control_changed' LANGUAGE C;
COMMENT ON FUNCTION tuvl._control_changed() IS 'trigger: a run''s operator directives changed; the workers read their copies again after this commits';
REVOKE ALL ON FUNCTION tuvl._control_changed() FROM PUBLIC;
CREATE TRIGGER runs_control AFTER UPDATE OF control ON tuvl.runs
    FOR EACH ROW
    WHEN (OLD.control IS DISTINCT FROM NEW.control)
    EXECUTE FUNCTION tuvl._control_changed();

/* ------------------------------------------------------------------ model config versions
 *
 * register_llm() keeps every version of a config (llm.c): tuvl.llms holds
 * the current one, tuvl.llm_versions all of them.  A run uses the
 * versions current when it was started (its created_at), as it uses the
 * workflow version of then: registering a config changes new runs only.
 * The configs of before this release become version 1, current for every
 * run that already exists.
 */
ALTER TABLE tuvl.llms ADD COLUMN version integer NOT NULL DEFAULT 1;
COMMENT ON COLUMN tuvl.llms.version IS 'the current version (tuvl.llm_versions holds each)';
CREATE TABLE tuvl.llm_versions (
    name text NOT NULL,
    version integer NOT NULL,
    provider text NOT NULL,
    source text NOT NULL,
    definition jsonb NOT NULL,
    registered_by pg_catalog.regrole NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, version)
);
COMMENT ON TABLE tuvl.llm_versions IS 'every version of each model config; a run uses those current when it started';
COMMENT ON COLUMN tuvl.llm_versions.created_at IS 'when it was registered: runs created from then on use it';
INSERT INTO tuvl.llm_versions (name, version, provider, source, definition, registered_by, created_at)
    SELECT name, 1, provider, source, definition, owner, '-infinity' FROM tuvl.llms;
GRANT SELECT ON tuvl.llm_versions TO PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('tuvl.llm_versions', '');

/* ------------------------------------------------------------------ retention
 *
 * tuvl.purge() (retention.c) deletes finished runs older than its argument
 * or tuvl.retention, with their journals, in batches that lock only
 * finished runs.  Members of tuvl_admin may call it.
 */
CREATE FUNCTION tuvl.purge(older_than interval DEFAULT NULL) RETURNS bigint
AS 'MODULE_PATHNAME', 'tuvl_purge' LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.purge(interval) IS 'delete the runs that finished longer ago than older_than (default tuvl.retention), with their journals; returns how many runs';
REVOKE ALL ON FUNCTION tuvl.purge(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.purge(interval) TO tuvl_admin;

CREATE INDEX runs_finished_idx ON tuvl.runs (finished_at) WHERE finished_at IS NOT NULL;

/*
 * An llm_turn after a step's first journals its request as a delta from
 * the turn before (llm_request.c); tuvl.llm_request() rebuilds it whole,
 * from the journal the caller can read.
 */
CREATE FUNCTION tuvl.llm_request(run_id bigint, seq integer) RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_llm_request' LANGUAGE C STRICT STABLE;
COMMENT ON FUNCTION tuvl.llm_request(bigint, integer) IS 'the whole request of an llm_turn event, rebuilt from the deltas of the step''s turns; NULL when the event is not an llm_turn';
REVOKE ALL ON FUNCTION tuvl.llm_request(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.llm_request(bigint, integer) TO tuvl_user;

/* ------------------------------------------------------------------ views
 *
 * What tuvl is doing, for psql.  Each reads tuvl.runs as the caller: a role
 * sees its own runs, tuvl_operator every run.
 */
CREATE VIEW tuvl.runs_in_flight WITH (security_invoker = true) AS
    SELECT r.id, r.workflow, r.workflow_version AS version, r.status, r.current_step AS step,
           CASE
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by OPERATOR(pg_catalog.=) 'concurrency'
                   THEN pg_catalog.format('held: %s runs of concurrency key %s are in flight',
                                          r.concurrency_limit, r.concurrency_key)
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by OPERATOR(pg_catalog.=) 'max_parallel'
                   THEN pg_catalog.format('held: its siblings fill max_parallel of run %s', r.parent_run_id)
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' THEN 'waiting for a worker'
               WHEN r.status OPERATOR(pg_catalog.=) 'running'
                   THEN pg_catalog.format('held by process %s', r.lease_owner)
               WHEN r.status OPERATOR(pg_catalog.=) 'waiting_human' THEN 'waiting for tuvl.submit()'
               WHEN r.status OPERATOR(pg_catalog.=) 'waiting_approval' THEN 'waiting for tuvl.decide()'
               WHEN r.status OPERATOR(pg_catalog.=) 'paused' THEN 'paused: waiting for tuvl.resume_run()'
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping' THEN pg_catalog.format('sleeping until %s', r.wake_at)
               WHEN r.status OPERATOR(pg_catalog.=) 'waiting_children'
                   THEN pg_catalog.format('waiting for %s child runs',
                                          (SELECT pg_catalog.count(*) FROM tuvl.runs c
                                           WHERE c.parent_run_id OPERATOR(pg_catalog.=) r.id
                                             AND c.parent_step IS NOT NULL AND c.finished_at IS NULL))
               WHEN r.status OPERATOR(pg_catalog.=) 'compensating' THEN 'undoing its completed steps'
           END AS waiting_for,
           r.principal, r.priority, r.parent_run_id, r.created_at,
           pg_catalog.now() OPERATOR(pg_catalog.-) r.created_at AS age,
           r.wake_at
    FROM tuvl.runs r
    WHERE r.finished_at IS NULL;
COMMENT ON VIEW tuvl.runs_in_flight IS 'runs that have not ended, with what each waits for and its age';

CREATE VIEW tuvl.slow_steps WITH (security_invoker = true) AS
    SELECT r.id AS run_id, r.workflow, r.current_step AS step, r.status,
           pg_catalog.to_timestamp(((r.step_state OPERATOR(pg_catalog.->>) 'entered')::pg_catalog.float8
                                    OPERATOR(pg_catalog./) 1000000) OPERATOR(pg_catalog.+) 946684800) AS entered_at,
           pg_catalog.now() OPERATOR(pg_catalog.-)
           pg_catalog.to_timestamp(((r.step_state OPERATOR(pg_catalog.->>) 'entered')::pg_catalog.float8
                                    OPERATOR(pg_catalog./) 1000000) OPERATOR(pg_catalog.+) 946684800) AS in_step
    FROM tuvl.runs r
    WHERE r.finished_at IS NULL AND r.step_state OPERATOR(pg_catalog.?) 'entered'
      AND r.status OPERATOR(pg_catalog.=) ANY ('{running,queued,compensating}'::pg_catalog.text[]);
COMMENT ON VIEW tuvl.slow_steps IS 'runs in the middle of a step that waits for a request, a model or an agent''s next turn: how long they have been in it (ORDER BY in_step DESC)';

CREATE VIEW tuvl.workers WITH (security_invoker = true) AS
    SELECT w.pid, d.datname AS database, w.worker, w.runs_held, w.transfers_in_flight,
           w.peak_transfers_in_flight, w.heartbeat,
           pg_catalog.now() OPERATOR(pg_catalog.-) w.heartbeat AS since_heartbeat,
           a.state, a.query AS activity
    FROM tuvl.worker_status() w
    LEFT JOIN pg_catalog.pg_database d ON d.oid OPERATOR(pg_catalog.=) w.database
    LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) w.pid;
COMMENT ON VIEW tuvl.workers IS 'each tuvl worker of the server: its database, the runs it holds, its HTTP transfers, its last heartbeat and what it does now';

CREATE VIEW tuvl.queue_depth WITH (security_invoker = true) AS
    SELECT r.workflow,
           pg_catalog.count(*) FILTER (WHERE r.held_by IS NULL) AS ready,
           pg_catalog.count(*) FILTER (WHERE r.held_by IS NOT NULL) AS held,
           pg_catalog.min(r.created_at) FILTER (WHERE r.held_by IS NULL) AS oldest_ready,
           pg_catalog.now() OPERATOR(pg_catalog.-) pg_catalog.min(r.created_at) FILTER (WHERE r.held_by IS NULL) AS oldest_ready_age
    FROM tuvl.runs r
    WHERE r.status OPERATOR(pg_catalog.=) 'queued'
    GROUP BY r.workflow;
COMMENT ON VIEW tuvl.queue_depth IS 'queued runs per workflow: ready for a worker, held back (max_parallel, concurrency), and the age of the oldest ready one';

GRANT SELECT ON tuvl.runs_in_flight, tuvl.slow_steps, tuvl.workers, tuvl.queue_depth TO tuvl_user;

/* ------------------------------------------------------------------ graph
 *
 * tuvl.graph(workflow, format) draws the newest version's steps, routes
 * and ends as Mermaid or Graphviz dot text.  A step's default signal with
 * no route flows to the next main-line step (or the implicit end); a
 * compensator hangs off its step by a dashed edge.
 */
CREATE FUNCTION tuvl.graph(workflow text, format text DEFAULT 'mermaid') RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $graph$
DECLARE
    def jsonb;
    steps jsonb;
    n int;
    off_line text[] := '{}';
    main text[] := '{}';
    lines text[] := '{}';
    s jsonb;
    sid text;
    kv record;
    nxt text;
    idx int;
    dot boolean;
    implicit boolean := false;
BEGIN
    IF format IS NULL OR format NOT IN ('mermaid', 'dot') THEN
        RAISE EXCEPTION 'format must be mermaid or dot, not %', coalesce(format, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    dot := format = 'dot';
    SELECT w.definition INTO def FROM tuvl.workflows w
     WHERE w.name = graph.workflow ORDER BY w.version DESC LIMIT 1;
    IF def IS NULL THEN
        RAISE EXCEPTION 'workflow "%" does not exist', graph.workflow
            USING ERRCODE = 'undefined_object', HINT = 'Register it with tuvl.register_workflow().';
    END IF;
    steps := coalesce(def -> 'steps', '[]');
    n := jsonb_array_length(steps);
    -- steps off the main line: compensators and agent tools named by ref
    FOR s IN SELECT value FROM jsonb_array_elements(steps) LOOP
        IF s ? 'compensate' THEN off_line := off_line || (s ->> 'compensate'); END IF;
        IF jsonb_typeof(s -> 'agent' -> 'tools') = 'array' THEN
            off_line := off_line || ARRAY(SELECT t ->> 'ref' FROM jsonb_array_elements(s -> 'agent' -> 'tools') t
                                          WHERE jsonb_typeof(t) = 'object' AND t ? 'ref');
        END IF;
    END LOOP;
    FOR s IN SELECT value FROM jsonb_array_elements(steps) LOOP
        IF NOT (s ->> 'id') = ANY (off_line) THEN main := main || (s ->> 'id'); END IF;
    END LOOP;

    lines := lines || CASE WHEN dot THEN format('digraph %s {', to_json(graph.workflow)::text)
                           ELSE 'flowchart TD' END;
    IF dot THEN lines := lines || '  rankdir=TB;'::text; END IF;
    FOR s IN SELECT value FROM jsonb_array_elements(steps) LOOP
        sid := s ->> 'id';
        lines := lines || CASE WHEN dot
            THEN format('  %s [shape=box, label=%s];', to_json('s_' || sid)::text, to_json(sid || E'\n' || (s ->> 'kind'))::text)
            ELSE format('  s_%s["%s<br/><i>%s</i>"]', sid, replace(sid, '"', '#quot;'), s ->> 'kind') END;
    END LOOP;
    FOR s IN SELECT value FROM jsonb_array_elements(coalesce(def -> 'ends', '[]')) LOOP
        lines := lines || CASE WHEN dot
            THEN format('  %s [shape=oval, label=%s];', to_json('e_' || (s ->> 'id'))::text,
                        to_json((s ->> 'id') || E'\n' || coalesce(s ->> 'status', 'completed'))::text)
            ELSE format('  e_%s(["%s: %s"])', s ->> 'id', s ->> 'id', coalesce(s ->> 'status', 'completed')) END;
    END LOOP;

    FOR s IN SELECT value FROM jsonb_array_elements(steps) LOOP
        sid := s ->> 'id';
        FOR kv IN SELECT key, value #>> '{}' AS target FROM jsonb_each(coalesce(s -> 'routes', '{}')) LOOP
            nxt := CASE WHEN EXISTS (SELECT 1 FROM jsonb_array_elements(steps) x WHERE x ->> 'id' = kv.target)
                        THEN 's_' || kv.target ELSE 'e_' || kv.target END;
            lines := lines || CASE WHEN dot
                THEN format('  %s -> %s [label=%s];', to_json('s_' || sid)::text, to_json(nxt)::text, to_json(kv.key)::text)
                ELSE format('  s_%s -->|%s| %s', sid, kv.key, nxt) END;
        END LOOP;
        -- the default signal without a route flows down the main line
        IF sid = ANY (main) AND NOT coalesce(s -> 'routes', '{}') ? 'default' THEN
            idx := array_position(main, sid);
            IF idx < array_length(main, 1) THEN
                nxt := 's_' || main[idx + 1];
            ELSE
                nxt := 'implicit_end';
                implicit := true;
            END IF;
            lines := lines || CASE WHEN dot
                THEN format('  %s -> %s [label="default"];', to_json('s_' || sid)::text, to_json(nxt)::text)
                ELSE format('  s_%s -->|default| %s', sid, nxt) END;
        END IF;
        IF s ? 'compensate' THEN
            lines := lines || CASE WHEN dot
                THEN format('  %s -> %s [style=dashed, label="compensate"];', to_json('s_' || sid)::text,
                            to_json('s_' || (s ->> 'compensate'))::text)
                ELSE format('  s_%s -.->|compensate| s_%s', sid, s ->> 'compensate') END;
        END IF;
    END LOOP;
    IF implicit THEN
        lines := lines || CASE WHEN dot THEN '  "implicit_end" [shape=oval, label="(end)\ncompleted"];'
                               ELSE '  implicit_end(["(end): completed"])' END;
    END IF;
    IF dot THEN lines := lines || '}'::text; END IF;
    RETURN array_to_string(lines, E'\n') || E'\n';
END
$graph$;
COMMENT ON FUNCTION tuvl.graph(text, text) IS 'the newest version of a workflow drawn as Mermaid (flowchart) or Graphviz dot text: steps, routes, the default flow, compensators and ends';
GRANT EXECUTE ON FUNCTION tuvl.graph(text, text) TO tuvl_user;

/*
 * The journal, packed: one row of tuvl.journal per transition (a block
 * of its events, src/journal_block.c) instead of one row of tuvl.events
 * per event; tuvl.events is now a view showing one row per event, as
 * before.  One row and one index entry per transition is most of what
 * keeps a step's WAL small.  The events of 0.1.0 move into blocks of at
 * most 100.
 */
CREATE FUNCTION tuvl._journal_events(seq integer, events bytea,
    OUT seq integer, OUT ts timestamptz, OUT type text, OUT agent_id text, OUT engine text,
    OUT tokens integer, OUT latency_ms double precision, OUT payload jsonb)
    RETURNS SETOF record
    AS 'MODULE_PATHNAME', 'tuvl_journal_events' LANGUAGE C IMMUTABLE STRICT PARALLEL SAFE ROWS 5;
COMMENT ON FUNCTION tuvl._journal_events(integer, bytea) IS 'the events of a block of tuvl.journal whose first event is seq, one row each (read them in tuvl.events)';
GRANT EXECUTE ON FUNCTION tuvl._journal_events(integer, bytea) TO tuvl_user;

CREATE FUNCTION tuvl._journal_block(ts timestamptz[], type text[], agent_id text[], engine text[],
    tokens integer[], latency_ms double precision[], payload jsonb[]) RETURNS bytea
    AS 'MODULE_PATHNAME', 'tuvl_journal_block' LANGUAGE C IMMUTABLE PARALLEL SAFE;
COMMENT ON FUNCTION tuvl._journal_block(timestamptz[], text[], text[], text[], integer[], double precision[], jsonb[]) IS 'events given as parallel arrays, packed as one block of tuvl.journal';
REVOKE ALL ON FUNCTION tuvl._journal_block(timestamptz[], text[], text[], text[], integer[], double precision[], jsonb[]) FROM PUBLIC;

CREATE TABLE tuvl.journal (
    run_id bigint NOT NULL,
    seq integer NOT NULL,
    n integer NOT NULL,
    events bytea NOT NULL,
    PRIMARY KEY (run_id, seq)
);
COMMENT ON TABLE tuvl.journal IS 'the journal of every run, as blocks of events (one per transition); read it in the view tuvl.events';
COMMENT ON COLUMN tuvl.journal.seq IS 'the seq of the block''s first event';
COMMENT ON COLUMN tuvl.journal.n IS 'how many events the block holds: seq to seq + n - 1';
COMMENT ON COLUMN tuvl.journal.events IS 'the events, packed (tuvl._journal_events unpacks them)';
ALTER TABLE tuvl.journal ENABLE ROW LEVEL SECURITY;
CREATE POLICY journal_visible ON tuvl.journal FOR SELECT
    USING (EXISTS (SELECT 1 FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) run_id));
GRANT SELECT ON tuvl.journal TO tuvl_user;
SELECT pg_catalog.pg_extension_config_dump('tuvl.journal', '');

INSERT INTO tuvl.journal (run_id, seq, n, events)
    SELECT e.run_id, pg_catalog.min(e.seq), pg_catalog.count(*)::integer,
           tuvl._journal_block(pg_catalog.array_agg(e.ts ORDER BY e.seq),
                               pg_catalog.array_agg(e.type ORDER BY e.seq),
                               pg_catalog.array_agg(e.agent_id ORDER BY e.seq),
                               pg_catalog.array_agg(e.engine ORDER BY e.seq),
                               pg_catalog.array_agg(e.tokens ORDER BY e.seq),
                               pg_catalog.array_agg(e.latency_ms ORDER BY e.seq),
                               pg_catalog.array_agg(e.payload ORDER BY e.seq))
    FROM tuvl.events e
    GROUP BY e.run_id, (e.seq OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog./) 100;

ALTER EXTENSION tuvl DROP TABLE tuvl.events;   -- forgets it as a table pg_dump keeps
DROP TABLE tuvl.events;

CREATE VIEW tuvl.events WITH (security_invoker = true) AS
    SELECT j.run_id, e.seq, e.ts, e.type, e.agent_id, e.engine, e.tokens, e.latency_ms, e.payload
    FROM tuvl.journal j
    CROSS JOIN LATERAL tuvl._journal_events(j.seq, j.events) e;
COMMENT ON VIEW tuvl.events IS 'the journal of every run, one row per event: seq is 1, 2, ... without gaps within a run; tuvl announces every event with NOTIFY on tuvl_events';
GRANT SELECT ON tuvl.events TO tuvl_user;

CREATE VIEW tuvl.people_queue WITH (security_invoker = true) AS
    SELECT r.id AS run_id, r.workflow, r.status, r.current_step AS step, r.principal,
           CASE WHEN r.status OPERATOR(pg_catalog.=) 'waiting_human' THEN 'tuvl.submit()' ELSE 'tuvl.decide()' END AS answer_with,
           r.step_state OPERATOR(pg_catalog.->) 'awaiting' AS awaiting,
           c.since, pg_catalog.now() OPERATOR(pg_catalog.-) c.since AS age,
           r.wake_at AS deadline
    FROM tuvl.runs r
    CROSS JOIN LATERAL (SELECT pg_catalog.max(e.ts) AS since
                        FROM (SELECT j.seq, j.events FROM tuvl.journal j
                              WHERE j.run_id OPERATOR(pg_catalog.=) r.id
                              ORDER BY j.seq DESC LIMIT 5) j
                        CROSS JOIN LATERAL tuvl._journal_events(j.seq, j.events) e
                        WHERE e.type OPERATOR(pg_catalog.=) 'checkpoint') c
    WHERE r.status OPERATOR(pg_catalog.=) ANY ('{waiting_human,waiting_approval}'::pg_catalog.text[]);
COMMENT ON VIEW tuvl.people_queue IS 'runs waiting for a person: data for a Human step (tuvl.submit) or a decision on a tool call (tuvl.decide), oldest first by age, with the deadline of a timeout';
GRANT SELECT ON tuvl.people_queue TO tuvl_user;

/*
 * Room on every page of tuvl.runs for the next versions of its rows: a
 * run's row is written at every step, and a new version that fits on
 * the same page is a HOT update (no index entries, a smaller WAL
 * record).  Half of each page stays free when rows are inserted; the
 * versions of the previous batch can be pruned only once no snapshot of
 * another worker sees them, so one free version per row is not enough.
 */
ALTER TABLE tuvl.runs SET (fillfactor = 50);

/*
 * The runs under lease, by holder rather than by lease_expires_at: a
 * renewal, which rewrites lease_expires_at of every run a worker holds
 * (thousands, every tuvl.heartbeat_interval), then changes no indexed
 * column and can be a HOT update.  The maintenance that reclaims runs
 * asks which holders are alive, never for an order of expiry.
 */
DROP INDEX tuvl.runs_leased_idx;
CREATE INDEX runs_leased_idx ON tuvl.runs (lease_owner) WHERE status IN ('running', 'compensating');
