/*
 * tuvl_router 0.3.0: tuvl's API in a router database, routed to N tuvl
 * databases (the partitions) with PL/Proxy; docs/scaling.md.
 *
 * The partitions are PL/Proxy's foreign server tuvl_cluster (options p0,
 * p1, ... : a power of two) with a user mapping, made by the user.  Each
 * partition has GUC tuvl.partition = its number and allocates run ids
 * partition * 2^44 + n, so a call about a run goes to partition id >> 44.
 * start_run goes to the partition of a hash of (workflow, key), or to any
 * partition without a key; registrations go to every partition in two
 * phases (every partition checks, then every partition registers).
 *
 * PL/Proxy connects to a partition as the calling role unless the user
 * mapping names another: the partition's own privileges and row security
 * then hold for every call, and the router grants nothing beyond them.
 */
\echo Use "CREATE EXTENSION tuvl_router" to load this file. \quit

/* ------------------------------------------------------------------ routing */

CREATE FUNCTION tuvl_router.partition_of(run_id bigint) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN (run_id OPERATOR(pg_catalog.>>) 44)::integer;
COMMENT ON FUNCTION tuvl_router.partition_of(bigint) IS 'the partition a run id belongs to: id >> 44';

/*
 * The partition of a start: a stable hash (the first 32 bits of the MD5)
 * of the workflow and the key, so every start of one key lands on one
 * partition, whatever the router's PostgreSQL version; any partition
 * without a key.  PL/Proxy takes it modulo the number of partitions.
 */
CREATE FUNCTION tuvl_router.partition_of_key(workflow text, key text) RETURNS integer
LANGUAGE sql VOLATILE PARALLEL SAFE
RETURN CASE WHEN key IS NULL
            THEN (pg_catalog.random() OPERATOR(pg_catalog.*) 2147483647)::integer
            ELSE ('x' OPERATOR(pg_catalog.||) pg_catalog.left(pg_catalog.md5(workflow OPERATOR(pg_catalog.||)
                   pg_catalog.chr(31) OPERATOR(pg_catalog.||) key), 8))::bit(32)::integer END;
COMMENT ON FUNCTION tuvl_router.partition_of_key(text, text) IS 'where start_run sends a run: a hash of (workflow, key), PL/Proxy takes it modulo the partitions; random without a key';

/* ------------------------------------------------------------------ runs */

CREATE FUNCTION tuvl_router.start_run(workflow text, input jsonb DEFAULT '{}', key text DEFAULT NULL,
                                      not_before timestamptz DEFAULT NULL, priority integer DEFAULT 0,
                                      version integer DEFAULT NULL, traceparent text DEFAULT NULL,
                                      debounce interval DEFAULT NULL)
RETURNS bigint LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster';
    RUN ON tuvl_router.partition_of_key(workflow, key);
    TARGET tuvl.start_run;
$$;
COMMENT ON FUNCTION tuvl_router.start_run(text, jsonb, text, timestamptz, integer, integer, text, interval) IS 'tuvl.start_run on the partition of (workflow, key), or on any partition without a key; a debounced start (which needs a key) coalesces on its key''s partition';

CREATE FUNCTION tuvl_router.run(workflow text, input jsonb DEFAULT '{}', sync_timeout interval DEFAULT NULL)
RETURNS jsonb LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster';
    RUN ON ANY;
    TARGET tuvl.run;
$$;
COMMENT ON FUNCTION tuvl_router.run(text, jsonb, interval) IS 'tuvl.run on any partition';

CREATE FUNCTION tuvl_router.wait(run_id bigint, timeout interval DEFAULT '30 seconds')
RETURNS text LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster';
    RUN ON tuvl_router.partition_of(run_id);
    TARGET tuvl.wait;
$$;
COMMENT ON FUNCTION tuvl_router.wait(bigint, interval) IS 'tuvl.wait on the run''s partition';

/* ------------------------------------------------------------------ control and people: the run's partition */

CREATE FUNCTION tuvl_router.pause_run(run_id bigint) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.pause_run;
$$;
CREATE FUNCTION tuvl_router.resume_run(run_id bigint) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.resume_run;
$$;
CREATE FUNCTION tuvl_router.abort_run(run_id bigint, reason text DEFAULT NULL) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.abort_run;
$$;
CREATE FUNCTION tuvl_router.steer_run(run_id bigint, message text) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.steer_run;
$$;
CREATE FUNCTION tuvl_router.submit(run_id bigint, data jsonb) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.submit;
$$;
CREATE FUNCTION tuvl_router.reject(run_id bigint, action text DEFAULT 'decline') RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.reject;
$$;
CREATE FUNCTION tuvl_router.decide(run_id bigint, approved boolean, note text DEFAULT NULL) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.decide;
$$;
CREATE FUNCTION tuvl_router.pin_run(run_id bigint) RETURNS jsonb LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.pin_run;
$$;
CREATE FUNCTION tuvl_router.timeline(run_id bigint)
RETURNS TABLE (at interval, seq integer, step text, event text, summary text) LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id); TARGET tuvl.timeline;
$$;
COMMENT ON FUNCTION tuvl_router.pause_run(bigint) IS 'tuvl.pause_run on the run''s partition';
COMMENT ON FUNCTION tuvl_router.resume_run(bigint) IS 'tuvl.resume_run on the run''s partition';
COMMENT ON FUNCTION tuvl_router.abort_run(bigint, text) IS 'tuvl.abort_run on the run''s partition';
COMMENT ON FUNCTION tuvl_router.steer_run(bigint, text) IS 'tuvl.steer_run on the run''s partition';
COMMENT ON FUNCTION tuvl_router.submit(bigint, jsonb) IS 'tuvl.submit on the run''s partition';
COMMENT ON FUNCTION tuvl_router.reject(bigint, text) IS 'tuvl.reject on the run''s partition';
COMMENT ON FUNCTION tuvl_router.decide(bigint, boolean, text) IS 'tuvl.decide on the run''s partition';
COMMENT ON FUNCTION tuvl_router.pin_run(bigint) IS 'tuvl.pin_run on the run''s partition';
COMMENT ON FUNCTION tuvl_router.timeline(bigint) IS 'tuvl.timeline on the run''s partition';

/* ------------------------------------------------------------------ registration: every partition */

/* phase one: would each partition take it?  (NULL, or its error) */
CREATE FUNCTION tuvl_router._try_register(kind text, source text) RETURNS SETOF jsonb LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL; TARGET tuvl._try_register;
$$;
CREATE FUNCTION tuvl_router._register_workflow(source text) RETURNS SETOF integer LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL; TARGET tuvl.register_workflow;
$$;
CREATE FUNCTION tuvl_router._register_artifact(source text) RETURNS SETOF integer LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL; TARGET tuvl.register_artifact;
$$;
CREATE FUNCTION tuvl_router._register_llm(source text) RETURNS SETOF void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL; TARGET tuvl.register_llm;
$$;
CREATE FUNCTION tuvl_router._set_secret(name text, value text) RETURNS SETOF void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL; TARGET tuvl.set_secret;
$$;
CREATE FUNCTION tuvl_router._grant_secret(name text, role text) RETURNS SETOF void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT tuvl.grant_secret(name, role::pg_catalog.regrole);
$$;
CREATE FUNCTION tuvl_router._revoke_secret(name text, role text) RETURNS SETOF void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT tuvl.revoke_secret(name, role::pg_catalog.regrole);
$$;

/* raise the first refusal of phase one, naming its partition */
CREATE FUNCTION tuvl_router._check_everywhere(kind text, source text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    e jsonb;
BEGIN
    SELECT r INTO e FROM tuvl_router._try_register(kind, source) r
    WHERE r IS NOT NULL ORDER BY r OPERATOR(pg_catalog.->>) 'partition' LIMIT 1;
    IF e IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = e OPERATOR(pg_catalog.->>) 'sqlstate',
            MESSAGE = e OPERATOR(pg_catalog.->>) 'message',
            DETAIL = concat_ws(' ', e OPERATOR(pg_catalog.->>) 'detail',
                               format('(partition %s refused it; nothing was registered on any partition)',
                                      e OPERATOR(pg_catalog.->>) 'partition')),
            HINT = coalesce(e OPERATOR(pg_catalog.->>) 'hint', '');
    END IF;
END;
$fn$;

/* phase two's answers must agree: one version number everywhere */
CREATE FUNCTION tuvl_router._one_version(kind text, name text, versions integer[]) RETURNS integer
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF (SELECT count(DISTINCT v) FROM unnest(versions) v) OPERATOR(pg_catalog.<>) 1 THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = format('the partitions registered different versions of %s %s', kind, coalesce(name, '')),
            DETAIL = format('Versions by partition: %s.', array_to_string(versions, ', ', 'none')),
            HINT = 'A partition registered a version in between (or another router registered there). Register the same source again until one number comes back; start runs with version => N only once it has.';
    END IF;
    RETURN versions[1];
END;
$fn$;

CREATE FUNCTION tuvl_router.register_workflow(source text) RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM tuvl_router._check_everywhere('workflow', source);
    RETURN tuvl_router._one_version('workflow', NULL,
        ARRAY(SELECT v FROM tuvl_router._register_workflow(source) v));
END;
$fn$;

CREATE FUNCTION tuvl_router.register_artifact(source text) RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM tuvl_router._check_everywhere('artifact', source);
    RETURN tuvl_router._one_version('artifact', NULL,
        ARRAY(SELECT v FROM tuvl_router._register_artifact(source) v));
END;
$fn$;

CREATE FUNCTION tuvl_router.register_llm(source text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM tuvl_router._check_everywhere('llm', source);
    PERFORM tuvl_router._register_llm(source);
END;
$fn$;

CREATE FUNCTION tuvl_router.set_secret(name text, value text) RETURNS void
LANGUAGE sql
BEGIN ATOMIC
    SELECT count(*) FROM tuvl_router._set_secret(name, value);
END;
CREATE FUNCTION tuvl_router.grant_secret(name text, role pg_catalog.regrole) RETURNS void
LANGUAGE sql
BEGIN ATOMIC
    SELECT count(*) FROM tuvl_router._grant_secret(name, role::text);
END;
CREATE FUNCTION tuvl_router.revoke_secret(name text, role pg_catalog.regrole) RETURNS void
LANGUAGE sql
BEGIN ATOMIC
    SELECT count(*) FROM tuvl_router._revoke_secret(name, role::text);
END;
COMMENT ON FUNCTION tuvl_router.register_workflow(text) IS 'tuvl.register_workflow on every partition: first every partition checks it (a dry run), then every partition registers it; the version number, one for all partitions';
COMMENT ON FUNCTION tuvl_router.register_artifact(text) IS 'tuvl.register_artifact on every partition, checked everywhere first';
COMMENT ON FUNCTION tuvl_router.register_llm(text) IS 'tuvl.register_llm on every partition, checked everywhere first';
COMMENT ON FUNCTION tuvl_router.set_secret(text, text) IS 'tuvl.set_secret on every partition';
COMMENT ON FUNCTION tuvl_router.grant_secret(text, pg_catalog.regrole) IS 'tuvl.grant_secret on every partition (the role by name: it must exist on each)';
COMMENT ON FUNCTION tuvl_router.revoke_secret(text, pg_catalog.regrole) IS 'tuvl.revoke_secret on every partition';

/* ------------------------------------------------------------------ views over all partitions */

CREATE FUNCTION tuvl_router._runs()
RETURNS TABLE (id bigint, workflow text, workflow_version integer, status text, input jsonb, context jsonb,
               current_step text, end_name text, response jsonb, error text, attempt integer,
               lease_owner integer, lease_expires_at timestamptz, created_at timestamptz,
               started_at timestamptz, finished_at timestamptz, principal text, parent_run_id bigint,
               key text, priority integer)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT id, workflow, workflow_version, status, input, context, current_step, end_name, response,
           error, attempt, lease_owner, lease_expires_at, created_at, started_at, finished_at,
           principal, parent_run_id, key, priority
    FROM tuvl.runs;
$$;
CREATE VIEW tuvl_router.runs AS
    SELECT tuvl_router.partition_of(r.id) AS partition, r.* FROM tuvl_router._runs() r;

CREATE FUNCTION tuvl_router._events()
RETURNS TABLE (run_id bigint, seq integer, ts timestamptz, type text, agent_id text, engine text,
               tokens integer, latency_ms float8, payload jsonb)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT run_id, seq, ts, type, agent_id, engine, tokens, latency_ms, payload FROM tuvl.events;
$$;
CREATE VIEW tuvl_router.events AS
    SELECT tuvl_router.partition_of(e.run_id) AS partition, e.* FROM tuvl_router._events() e;

CREATE FUNCTION tuvl_router._runs_in_flight()
RETURNS TABLE (id bigint, workflow text, version integer, status text, step text, waiting_for text,
               principal text, priority integer, parent_run_id bigint, created_at timestamptz,
               age interval, wake_at timestamptz, waiting jsonb)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT id, workflow, version, status, step, waiting_for, principal, priority, parent_run_id,
           created_at, age, wake_at, waiting
    FROM tuvl.runs_in_flight;
$$;
CREATE VIEW tuvl_router.runs_in_flight AS
    SELECT tuvl_router.partition_of(r.id) AS partition, r.* FROM tuvl_router._runs_in_flight() r;

CREATE FUNCTION tuvl_router._people_queue()
RETURNS TABLE (run_id bigint, workflow text, status text, step text, principal text, answer_with text,
               awaiting jsonb, since timestamptz, age interval, deadline timestamptz)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT run_id, workflow, status, step, principal, answer_with, awaiting, since, age, deadline
    FROM tuvl.people_queue;
$$;
CREATE VIEW tuvl_router.people_queue AS
    SELECT tuvl_router.partition_of(q.run_id) AS partition, q.* FROM tuvl_router._people_queue() q;

CREATE FUNCTION tuvl_router._metrics()
RETURNS TABLE (partition integer, name text, kind text, labels jsonb, value float8)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT coalesce(pg_catalog.current_setting('tuvl.partition', true), '-1')::integer AS partition,
           name, kind, labels, value
    FROM tuvl.metrics;
$$;
/* per partition (labels gain "partition"), so sums over it are the cluster's */
CREATE VIEW tuvl_router.metrics AS
    SELECT m.name, m.kind,
           m.labels OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object('partition', m.partition) AS labels,
           m.value
    FROM tuvl_router._metrics() m;

COMMENT ON VIEW tuvl_router.runs IS 'tuvl.runs of every partition (the contract''s columns), with the partition';
COMMENT ON VIEW tuvl_router.events IS 'tuvl.events of every partition, with the partition';
COMMENT ON VIEW tuvl_router.runs_in_flight IS 'tuvl.runs_in_flight of every partition (what each run waits for: waiting_for, and waiting as JSON), with the partition';
COMMENT ON VIEW tuvl_router.people_queue IS 'tuvl.people_queue of every partition, with the partition';
COMMENT ON VIEW tuvl_router.metrics IS 'tuvl.metrics of every partition, each series labelled with its partition';

/* ------------------------------------------------------------------ the Insight server on a router */

/*
 * insight/tuvl serve on a router database (docs/insight.md, "On a
 * router").  Tokens are partition 0's (tuvl.create_token there, or
 * tuvl_router.create_token): tuvl_router.authenticate() checks a token on
 * partition 0 and records its scopes for the router's transaction, where
 * tuvl_router._require_scope() checks them before each call; the calls
 * then run on the partitions as the token's role (the server takes it
 * with SET LOCAL ROLE), under its privileges and row security there.
 */
CREATE FUNCTION tuvl_router._authenticate(token text, OUT role text, OUT scopes text[])
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON 0;
    SELECT a.r::text AS role,
           ARRAY(SELECT s FROM pg_catalog.unnest(ARRAY['runs:start', 'runs:read', 'runs:control', 'people:answer',
                                                       'workflows:write', 'admin']) s
                 WHERE a.r IS NOT NULL AND tuvl._has_scope(s)) AS scopes
    FROM (SELECT tuvl.authenticate(token) AS r) a;
$$;

CREATE FUNCTION tuvl_router.authenticate(token text) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    a record;
BEGIN
    IF coalesce(current_setting('tuvl_router.scopes', true), '') LIKE 'token:%' THEN
        RAISE EXCEPTION USING ERRCODE = '25000', MESSAGE = 'this transaction is authenticated already',
            HINT = 'Authenticate once per transaction, first.';
    END IF;
    SELECT * INTO a FROM tuvl_router._authenticate(token);
    PERFORM set_config('tuvl_router.scopes', 'token:' OPERATOR(pg_catalog.||) array_to_string(a.scopes, ','), true);
    RETURN a.role;
END;
$fn$;

/* raise unless the transaction's token (if it authenticated one) has the scope */
CREATE FUNCTION tuvl_router._require_scope(scope text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    s text := coalesce(current_setting('tuvl_router.scopes', true), '');
BEGIN
    IF s LIKE 'token:%' AND NOT scope OPERATOR(pg_catalog.=) ANY (string_to_array(substr(s, 7), ',')) THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = format('the token of this request does not have scope %s', scope),
            HINT = format('Create a token with that scope: tuvl.create_token(role, ARRAY[%L]) on partition 0.', scope);
    END IF;
END;
$fn$;

CREATE FUNCTION tuvl_router.create_token(role pg_catalog.regrole, scopes text[], expires interval DEFAULT '90 days')
RETURNS text LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON 0;
    SELECT tuvl.create_token(role::pg_catalog.regrole, scopes, expires);
$$;
CREATE FUNCTION tuvl_router.revoke_token(id bigint) RETURNS void LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON 0; TARGET tuvl.revoke_token;
$$;

/* one run, with what GET /api/runs/{id} shows; on its partition */
CREATE FUNCTION tuvl_router.get_run(run_id bigint)
RETURNS TABLE (id bigint, workflow text, version integer, status text, step text, end_name text, key text,
               priority integer, principal text, parent_run_id bigint, created_at timestamptz,
               started_at timestamptz, finished_at timestamptz, input jsonb, context jsonb, awaiting jsonb,
               response jsonb, error text, attempt integer, wake_at timestamptz, control jsonb, last_seq integer)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id);
    SELECT r.id, r.workflow, r.workflow_version AS version, r.status, r.current_step AS step, r.end_name, r.key,
           r.priority, r.principal::text AS principal, r.parent_run_id, r.created_at, r.started_at, r.finished_at,
           r.input, r.context, r.step_state OPERATOR(pg_catalog.->) 'awaiting' AS awaiting, r.response, r.error,
           r.attempt, r.wake_at, r.control, r.last_seq
    FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) run_id;
$$;

/*
 * A run's journal after a seq, with the run's status read by the same
 * statement (no row: the run is not there or not visible); on its
 * partition.  What an event stream polls through a router.
 */
CREATE FUNCTION tuvl_router.events_after(run_id bigint, after_seq integer, max_events integer DEFAULT 200,
                                         with_summary boolean DEFAULT false)
RETURNS TABLE (status text, seq integer, type text, data text)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON tuvl_router.partition_of(run_id);
    SELECT r.status, e.seq, e.type, e.data
    FROM tuvl.runs r
    LEFT JOIN LATERAL (
        SELECT e.seq, e.type,
               (CASE WHEN with_summary
                     THEN pg_catalog.json_build_object('run_id', e.run_id, 'seq', e.seq, 'ts', e.ts, 'type', e.type,
                              'agent_id', e.agent_id, 'engine', e.engine, 'tokens', e.tokens,
                              'latency_ms', e.latency_ms, 'payload', e.payload,
                              'summary', tuvl._event_summary(e.type, e.payload, e.tokens, e.latency_ms))
                     ELSE pg_catalog.json_build_object('run_id', e.run_id, 'seq', e.seq, 'ts', e.ts, 'type', e.type,
                              'agent_id', e.agent_id, 'engine', e.engine, 'tokens', e.tokens,
                              'latency_ms', e.latency_ms, 'payload', e.payload) END)::text AS data
        FROM tuvl.events e
        WHERE e.run_id OPERATOR(pg_catalog.=) r.id AND e.seq OPERATOR(pg_catalog.>) after_seq
        ORDER BY e.seq
        LIMIT max_events) e ON true
    WHERE r.id OPERATOR(pg_catalog.=) run_id
    ORDER BY e.seq;
$$;

/* runs newest (highest id) first, filtered on each partition, then merged */
CREATE FUNCTION tuvl_router._list_runs(of_workflow text, with_status text[], with_key text, before_id bigint,
                                       max_runs integer)
RETURNS TABLE (id bigint, workflow text, version integer, status text, step text, end_name text, key text,
               priority integer, principal text, parent_run_id bigint, created_at timestamptz,
               started_at timestamptz, finished_at timestamptz)
LANGUAGE plproxy AS $$
    CLUSTER 'tuvl_cluster'; RUN ON ALL;
    SELECT r.id, r.workflow, r.workflow_version AS version, r.status, r.current_step AS step, r.end_name, r.key,
           r.priority, r.principal::text AS principal, r.parent_run_id, r.created_at, r.started_at, r.finished_at
    FROM tuvl.runs r
    WHERE (of_workflow IS NULL OR r.workflow OPERATOR(pg_catalog.=) of_workflow)
      AND (with_status IS NULL OR r.status OPERATOR(pg_catalog.=) ANY (with_status))
      AND (with_key IS NULL OR r.key OPERATOR(pg_catalog.=) with_key)
      AND (before_id IS NULL OR r.id OPERATOR(pg_catalog.<) before_id)
    ORDER BY r.id DESC LIMIT max_runs;
$$;
CREATE FUNCTION tuvl_router.list_runs(of_workflow text DEFAULT NULL, with_status text[] DEFAULT NULL,
                                      with_key text DEFAULT NULL, before_id bigint DEFAULT NULL,
                                      max_runs integer DEFAULT 50)
RETURNS TABLE (id bigint, workflow text, version integer, status text, step text, end_name text, key text,
               priority integer, principal text, parent_run_id bigint, created_at timestamptz,
               started_at timestamptz, finished_at timestamptz)
LANGUAGE sql STABLE
BEGIN ATOMIC
    SELECT r.id, r.workflow, r.version, r.status, r.step, r.end_name, r.key, r.priority, r.principal,
           r.parent_run_id, r.created_at, r.started_at, r.finished_at
    FROM tuvl_router._list_runs(of_workflow, with_status, with_key, before_id, max_runs) r
    ORDER BY r.id DESC LIMIT max_runs;
END;

COMMENT ON FUNCTION tuvl_router.authenticate(text) IS 'the role of a token of partition 0, its scopes recorded for the router''s transaction (the Insight server on a router)';
COMMENT ON FUNCTION tuvl_router._require_scope(text) IS 'raise unless the transaction''s token (if any) allows the scope';
COMMENT ON FUNCTION tuvl_router.create_token(pg_catalog.regrole, text[], interval) IS 'tuvl.create_token on partition 0, where tuvl_router.authenticate checks tokens';
COMMENT ON FUNCTION tuvl_router.revoke_token(bigint) IS 'tuvl.revoke_token on partition 0';
COMMENT ON FUNCTION tuvl_router.get_run(bigint) IS 'one run (GET /api/runs/{id}''s columns), from its partition';
COMMENT ON FUNCTION tuvl_router.events_after(bigint, integer, integer, boolean) IS 'a run''s journal after a seq with the run''s status, from its partition: what event streams poll through a router';
COMMENT ON FUNCTION tuvl_router.list_runs(text, text[], text, bigint, integer) IS 'runs by id, newest first, filtered on every partition';

/*
 * Every role may call the router: each call runs on the partitions as the
 * calling role (PL/Proxy connects as it unless the user mapping names
 * another), where tuvl's privileges and row security decide.  A role also
 * needs USAGE on the foreign server tuvl_cluster (docs/scaling.md).
 */
GRANT USAGE ON SCHEMA tuvl_router TO PUBLIC;
GRANT SELECT ON tuvl_router.runs, tuvl_router.events, tuvl_router.runs_in_flight,
    tuvl_router.people_queue, tuvl_router.metrics TO PUBLIC;
