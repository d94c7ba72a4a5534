/* tuvl--0.1.0.sql: durable, agentic workflows inside PostgreSQL */

\echo Use "CREATE EXTENSION tuvl" to load this file. \quit

/*
 * The role whose members may control any run (pause, resume, abort, steer)
 * and read every run.  Roles are cluster-wide, so another database may
 * have created it already.
 */
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'tuvl_operator') THEN
        CREATE ROLE tuvl_operator NOLOGIN;
    END IF;
END
$$;

CREATE FUNCTION tuvl.version()
RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_version'
LANGUAGE C STRICT STABLE PARALLEL SAFE;
COMMENT ON FUNCTION tuvl.version() IS 'version of the loaded tuvl library';

/* Every registered version of every workflow. */
CREATE TABLE tuvl.workflows (
    name text NOT NULL CHECK (name ~ '^[a-z_][a-z0-9_]*$'),
    version integer NOT NULL CHECK (version > 0),
    source text NOT NULL,
    definition jsonb NOT NULL,
    owner name NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, version)
);
COMMENT ON TABLE tuvl.workflows IS 'every registered version of every workflow; runs are pinned to one';

CREATE TABLE tuvl.runs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workflow text NOT NULL,
    workflow_version integer NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    input jsonb NOT NULL,
    context jsonb NOT NULL,
    current_step text,
    step_state jsonb,
    end_name text,
    response jsonb,
    error text,
    attempt integer NOT NULL DEFAULT 0,
    lease_owner integer,
    lease_epoch bigint,
    lease_expires_at timestamptz,
    last_seq integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    finished_at timestamptz,
    principal name NOT NULL,
    control jsonb,
    artifacts jsonb,
    compensation jsonb,
    FOREIGN KEY (workflow, workflow_version) REFERENCES tuvl.workflows (name, version)
) WITH (fillfactor = 80);
COMMENT ON TABLE tuvl.runs IS 'one row per run: status, lease and checkpoint';
COMMENT ON COLUMN tuvl.runs.status IS 'queued, running, waiting_human, waiting_approval, paused, completed, failed, aborted, compensating or compensated; only tuvl writes this table';
COMMENT ON COLUMN tuvl.runs.attempt IS 'incremented at every claim; every write of a lease holder is fenced by it';
COMMENT ON COLUMN tuvl.runs.lease_epoch IS 'server incarnation of the lease holder: leases of older epochs belong to dead processes';
COMMENT ON COLUMN tuvl.runs.last_seq IS 'seq of the newest journal event of this run';
COMMENT ON COLUMN tuvl.runs.compensation IS 'completed steps that declare a compensate step, most recent last, and while compensating why: {"stack": [...], "cause": {...}, "failed": [...]}';
COMMENT ON COLUMN tuvl.runs.artifacts IS 'the versions of floating artifact references, resolved when the run was created: {name: version}';
COMMENT ON COLUMN tuvl.runs.control IS 'operator directives not yet applied, such as {"abort": "reason"}; read at every agent turn and between tool calls';

/* Paused agents are checked against tuvl.agent_pause_max every second. */
CREATE INDEX runs_paused_idx ON tuvl.runs (id) WHERE status = 'paused';

/* Claims scan only queued runs; lease expiry scans only running ones. */
CREATE INDEX runs_queued_idx ON tuvl.runs (id) WHERE status = 'queued';
CREATE INDEX runs_leased_idx ON tuvl.runs (lease_expires_at) WHERE status IN ('running', 'compensating');
CREATE INDEX runs_workflow_idx ON tuvl.runs (workflow, created_at);

/* The journal: append-only, seq is 1..n without gaps within a run. */
CREATE TABLE tuvl.events (
    run_id bigint NOT NULL,
    seq integer NOT NULL,
    ts timestamptz NOT NULL DEFAULT clock_timestamp(),
    type text NOT NULL,
    agent_id text,
    engine text,
    tokens integer,
    latency_ms double precision,
    payload jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, seq)
);
COMMENT ON TABLE tuvl.events IS 'the journal of every run; tuvl announces every row with NOTIFY on tuvl_events';
CREATE INDEX events_ts_idx ON tuvl.events USING brin (ts);

/* Model configurations, by name (register_llm replaces). */
CREATE TABLE tuvl.llms (
    name text PRIMARY KEY,
    provider text NOT NULL CHECK (provider IN ('openai', 'anthropic')),
    source text NOT NULL,
    definition jsonb NOT NULL,
    owner name NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE tuvl.llms IS 'model configurations for Agent steps; API keys live in tuvl.secrets';
GRANT SELECT ON tuvl.llms TO PUBLIC;

CREATE FUNCTION tuvl.register_llm(source text)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_register_llm'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.register_llm(text) IS 'store or replace a model configuration (YAML)';

/*
 * Secrets (API keys) reach requests only through {{ secrets.NAME }}
 * templates.  Nobody but the extension's owner can read this table.
 */
CREATE TABLE tuvl.secrets (
    name text PRIMARY KEY CHECK (name ~ '^[A-Za-z_][A-Za-z0-9_]*$'),
    value text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by name NOT NULL
);
COMMENT ON TABLE tuvl.secrets IS 'secrets for {{ secrets.NAME }} templates; readable only by the extension owner';
REVOKE ALL ON tuvl.secrets FROM PUBLIC;

CREATE FUNCTION tuvl.set_secret(name text, value text)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO tuvl.secrets (name, value, updated_by) VALUES ($1, $2, session_user)
    ON CONFLICT ON CONSTRAINT secrets_pkey
    DO UPDATE SET value = excluded.value, updated_at = now(), updated_by = excluded.updated_by
$$;
COMMENT ON FUNCTION tuvl.set_secret(text, text) IS 'store or replace a secret; its value is never readable back by other roles';
REVOKE ALL ON FUNCTION tuvl.set_secret(text, text) FROM PUBLIC;


/*
 * Visibility: a role sees its own runs and their journal; members of
 * tuvl_operator see all of them.  Writes go only through the functions
 * below and the workers.
 */
ALTER TABLE tuvl.runs ENABLE ROW LEVEL SECURITY;
ALTER TABLE tuvl.events ENABLE ROW LEVEL SECURITY;
CREATE POLICY runs_visible ON tuvl.runs FOR SELECT
    USING (principal = current_user
           OR pg_catalog.pg_has_role(current_user, 'tuvl_operator', 'USAGE'));
CREATE POLICY events_visible ON tuvl.events FOR SELECT
    USING (EXISTS (SELECT 1 FROM tuvl.runs r WHERE r.id = run_id));
GRANT USAGE ON SCHEMA tuvl TO PUBLIC;
GRANT SELECT ON tuvl.workflows, tuvl.runs, tuvl.events TO PUBLIC;

/* Workflows */
CREATE FUNCTION tuvl.register_workflow(source text)
RETURNS integer
AS 'MODULE_PATHNAME', 'tuvl_register_workflow'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.register_workflow(text) IS 'parse, validate and store a workflow as a new version';

CREATE FUNCTION tuvl.validate(source text, strict boolean DEFAULT false,
                              OUT severity text, OUT path text, OUT message text)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'tuvl_validate'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.validate(text, boolean) IS 'static checks of a workflow, one row per finding';

/* Runs */
CREATE FUNCTION tuvl.start_run(workflow text, input jsonb DEFAULT '{}')
RETURNS bigint
AS 'MODULE_PATHNAME', 'tuvl_start_run'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.start_run(text, jsonb) IS 'validate the input and queue a run of the latest version of a workflow';

CREATE FUNCTION tuvl.run(workflow text, input jsonb DEFAULT '{}', sync_timeout interval DEFAULT NULL)
RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_run'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.run(text, jsonb, interval) IS 'execute a run in this backend; past sync_timeout hand it to the workers';

CREATE FUNCTION tuvl.wait(run_id bigint, timeout interval DEFAULT '30 seconds')
RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_wait'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.wait(bigint, interval) IS 'block until the run is terminal or waiting, or the timeout passes; return its status';

/* Workers, as shared memory sees them. */
CREATE FUNCTION tuvl.worker_status(OUT pid integer, OUT database oid, OUT worker integer,
                                   OUT runs_held integer, OUT transfers_in_flight integer,
                                   OUT peak_transfers_in_flight integer, OUT heartbeat timestamptz)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'tuvl_worker_status'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.worker_status() IS 'each tuvl worker: runs held, HTTP transfers in flight (now and at peak), last heartbeat';

/* Operator control and people in the loop (control.c) */
CREATE FUNCTION tuvl.pause_run(run_id bigint) RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_pause_run' LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.pause_run(bigint) IS 'pause a run at its next step or agent turn; it releases its worker';
CREATE FUNCTION tuvl.resume_run(run_id bigint) RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_resume_run' LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.resume_run(bigint) IS 'queue a paused run again; it continues from its last checkpoint';
CREATE FUNCTION tuvl.abort_run(run_id bigint, reason text DEFAULT NULL) RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_abort_run' LANGUAGE C CALLED ON NULL INPUT VOLATILE;
COMMENT ON FUNCTION tuvl.abort_run(bigint, text) IS 'abort a run at its next step, agent turn or between tool calls';
CREATE FUNCTION tuvl.steer_run(run_id bigint, message text) RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_steer_run' LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.steer_run(bigint, text) IS 'guidance appended to the run''s agent conversation at its next turn';
CREATE FUNCTION tuvl.submit(run_id bigint, data jsonb) RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_submit' LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.submit(bigint, jsonb) IS 'answer a run waiting at a Human step; data is checked against the step''s form';
CREATE FUNCTION tuvl.decide(run_id bigint, approved boolean, note text DEFAULT NULL) RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_decide' LANGUAGE C CALLED ON NULL INPUT VOLATILE;
COMMENT ON FUNCTION tuvl.decide(bigint, boolean, text) IS 'approve or reject the tool call a run is waiting on';

/* How a checkpoint applies the control directives its transition consumed. */
CREATE FUNCTION tuvl._control_apply(control jsonb, consumed text[], added jsonb, steers_done text[])
RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT nullif(CASE WHEN steers_done IS NULL OR jsonb_typeof(x->'steer') IS DISTINCT FROM 'object' THEN x
                       WHEN (x->'steer') - steers_done = '{}' THEN x - 'steer'
                       ELSE jsonb_set(x, '{steer}', (x->'steer') - steers_done) END, '{}')
    FROM (SELECT (coalesce(control, '{}') - coalesce(consumed, '{}')) || coalesce(added, '{}') AS x) s
$$;

/* Fixtures and replay (replay.c) */
CREATE FUNCTION tuvl.pin_run(run_id bigint) RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_pin_run' LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.pin_run(bigint) IS 'export an ended run as a replay fixture: input, versions and every result from outside the database (private keys redacted)';
CREATE FUNCTION tuvl.replay(fixture jsonb) RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_replay' LANGUAGE C STRICT VOLATILE;
/* A model request without the tool results in it: what replay compares. */
CREATE FUNCTION tuvl._llm_request_shape(request jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(request->'messages') = 'array' THEN
        jsonb_set(request, '{messages}', coalesce((
            SELECT jsonb_agg(CASE
                WHEN m->>'role' = 'tool' THEN m - 'content'
                WHEN jsonb_typeof(m->'content') = 'array' THEN jsonb_set(m, '{content}', coalesce((
                    SELECT jsonb_agg(CASE WHEN b->>'type' = 'tool_result' THEN b - 'content' ELSE b END
                                     ORDER BY o)
                    FROM jsonb_array_elements(m->'content') WITH ORDINALITY AS x(b, o)), '[]'))
                ELSE m END ORDER BY i)
            FROM jsonb_array_elements(request->'messages') WITH ORDINALITY AS y(m, i)), '[]'))
    ELSE request END
$$;

COMMENT ON FUNCTION tuvl.replay(jsonb) IS 'run the current workflow again with every outside result served from the fixture; raises at the first divergence';

/* For tests: NULL when the fixture replays as recorded, else why not. */
CREATE FUNCTION tuvl.replay_divergence(fixture jsonb) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM tuvl.replay(fixture);
    RETURN NULL;
EXCEPTION WHEN data_exception THEN
    IF SQLSTATE = '22000' THEN    -- a divergence; other errors propagate
        RETURN SQLERRM;
    END IF;
    RAISE;
END
$$;
COMMENT ON FUNCTION tuvl.replay_divergence(jsonb) IS 'NULL when tuvl.replay(fixture) succeeds, else the divergence it raised: for pgTAP, is(tuvl.replay_divergence(f), NULL)';

/* Schedules: pg_cron calls tuvl.start_scheduled(workflow) at every slot. */
CREATE TABLE tuvl.schedule_slots (
    workflow text NOT NULL,
    slot timestamptz NOT NULL,
    run_id bigint,
    PRIMARY KEY (workflow, slot)
);
COMMENT ON TABLE tuvl.schedule_slots IS 'the slots of scheduled workflows already started: one run per slot, however many callers';
GRANT SELECT ON tuvl.schedule_slots TO PUBLIC;

/* Who may start a workflow's slots: its owner's members and operators. */
ALTER TABLE tuvl.schedule_slots ENABLE ROW LEVEL SECURITY;
CREATE POLICY schedule_slots_read ON tuvl.schedule_slots FOR SELECT USING (true);
CREATE POLICY schedule_slots_start ON tuvl.schedule_slots FOR INSERT
    WITH CHECK (pg_has_role(current_user, (SELECT w.owner FROM tuvl.workflows w
                                           WHERE w.name = workflow AND w.version = 1), 'MEMBER')
                OR pg_has_role(current_user, 'tuvl_operator', 'MEMBER'));
CREATE POLICY schedule_slots_record ON tuvl.schedule_slots FOR UPDATE
    USING (pg_has_role(current_user, (SELECT w.owner FROM tuvl.workflows w
                                      WHERE w.name = workflow AND w.version = 1), 'MEMBER')
           OR pg_has_role(current_user, 'tuvl_operator', 'MEMBER'));
GRANT INSERT, UPDATE ON tuvl.schedule_slots TO PUBLIC;

CREATE FUNCTION tuvl.start_scheduled(workflow text, slot timestamptz DEFAULT date_trunc('minute', now()))
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    id bigint;
BEGIN
    INSERT INTO tuvl.schedule_slots AS s (workflow, slot) VALUES (start_scheduled.workflow, start_scheduled.slot)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;            -- this slot's run was started already
    END IF;
    id := tuvl.start_run(start_scheduled.workflow, jsonb_build_object('_scheduled_at', start_scheduled.slot));
    UPDATE tuvl.schedule_slots s SET run_id = id
    WHERE s.workflow = start_scheduled.workflow AND s.slot = start_scheduled.slot;
    RETURN id;
END
$$;
COMMENT ON FUNCTION tuvl.start_scheduled(text, timestamptz) IS 'start the run of one schedule slot (default: this minute) as the caller, at most once per slot; pg_cron jobs call it';

/* Artifacts */
CREATE TABLE tuvl.artifacts (
    name text NOT NULL CHECK (name ~ '^[a-z_][a-z0-9_-]*$'),
    version integer NOT NULL CHECK (version > 0),
    type text NOT NULL CHECK (type IN ('steering', 'prompt', 'skill', 'guardrail', 'hook')),
    body text,
    definition jsonb NOT NULL,
    source text NOT NULL,
    owner name NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, version)
);
COMMENT ON TABLE tuvl.artifacts IS 'every version of every artifact; workflows refer to them as artifact://name or artifact://name@version';
GRANT SELECT ON tuvl.artifacts TO PUBLIC;

CREATE FUNCTION tuvl.register_artifact(source text)
RETURNS integer
AS 'MODULE_PATHNAME', 'tuvl_register_artifact'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.register_artifact(text) IS 'store a steering, prompt, skill, guardrail or hook artifact as a new version';

/* MCP */
CREATE FUNCTION tuvl.mcp_list_tools(url text)
RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_mcp_list_tools'
LANGUAGE C STRICT VOLATILE;
COMMENT ON FUNCTION tuvl.mcp_list_tools(text) IS 'the tools an MCP server offers (tools/list), with their input schemas; remembered in tuvl.mcp_tools';

CREATE TABLE tuvl.mcp_tools (
    url text NOT NULL,
    name text NOT NULL,
    description text,
    input_schema jsonb,
    listed_at timestamptz NOT NULL,
    PRIMARY KEY (url, name)
);
COMMENT ON TABLE tuvl.mcp_tools IS 'tools last listed by tuvl.mcp_list_tools(); an agent offers a listed MCP tool''s input schema to the model';
GRANT SELECT ON tuvl.mcp_tools TO PUBLIC;

/* Templates */
CREATE FUNCTION tuvl.render(template jsonb, context jsonb DEFAULT '{}')
RETURNS jsonb
AS 'MODULE_PATHNAME', 'tuvl_render'
LANGUAGE C STRICT STABLE;
COMMENT ON FUNCTION tuvl.render(jsonb, jsonb) IS 'render a template value against a context, as a step would';

/*
 * pg_dump keeps the workflows, runs, journal and model configs.  Secrets
 * are deliberately left out of dumps: set them again after a restore.
 */
SELECT pg_catalog.pg_extension_config_dump('tuvl.workflows', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.runs', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.runs_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.events', '');
SELECT pg_catalog.pg_extension_config_dump('tuvl.llms', '');

/* Internal: is the process holding a lease still heartbeating? */
CREATE FUNCTION tuvl._lease_holder_alive(pid integer, epoch bigint)
RETURNS boolean
AS 'MODULE_PATHNAME', 'tuvl_lease_holder_alive'
LANGUAGE C VOLATILE;
REVOKE ALL ON FUNCTION tuvl._lease_holder_alive(integer, bigint) FROM PUBLIC;

/* Internal: tell the launcher a database now has the extension. */
CREATE FUNCTION tuvl._extension_created()
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_extension_created'
LANGUAGE C;
SELECT tuvl._extension_created();

REVOKE ALL ON FUNCTION tuvl._extension_created() FROM PUBLIC;
