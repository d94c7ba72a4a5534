/* tuvl--0.2.0--0.3.0.sql: the changes of release 0.3.0 */

\echo Use "ALTER EXTENSION tuvl UPDATE TO '0.3.0'" to load this file. \quit

/* ------------------------------------------------------------------ hardening: runs */

/*
 * A run whose worker died while holding it is taken up again, at most
 * tuvl.max_recoveries times in a row: the reclaim counts, progress resets.
 */
ALTER TABLE tuvl.runs ADD COLUMN recoveries integer NOT NULL DEFAULT 0;
COMMENT ON COLUMN tuvl.runs.recoveries IS 'times the run was taken up again after its worker died while holding it, since it last got further; past tuvl.max_recoveries it fails with _last_error_type recovery_limit';

/* ------------------------------------------------------------------ hardening: names */

/*
 * What a workflow names (model configs, child workflows, artifacts) must
 * exist when it is registered and be its owner's, or another role's that
 * granted its use; the role whose content each is gets pinned in refs
 * and checked at every use (uses.c).  Versions registered before 0.3.0
 * have no refs.
 */
ALTER TABLE tuvl.workflows ADD COLUMN refs jsonb;
COMMENT ON COLUMN tuvl.workflows.refs IS 'what the version names and whose work each was when it was registered: {"llm:default": role oid, "workflow:child": ..., "artifact:tone": ...}; NULL for versions registered before 0.3.0';

CREATE TABLE tuvl.use_grants (
    kind text NOT NULL CHECK (kind IN ('workflow', 'llm', 'artifact')),
    name text NOT NULL,
    grantee pg_catalog.regrole NOT NULL,
    granted_by pg_catalog.regrole NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (kind, name, grantee)
);
COMMENT ON TABLE tuvl.use_grants IS 'which roles'' workflows may name which workflows, model configs and artifacts of other roles (tuvl.grant_use, tuvl.revoke_use)';
SELECT pg_catalog.pg_extension_config_dump('tuvl.use_grants', '');

CREATE FUNCTION tuvl.grant_use(kind text, name text, role pg_catalog.regrole)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_grant_use'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.grant_use(text, text, pg_catalog.regrole) IS 'let the workflows of a role (and of its members) name a workflow, llm or artifact of yours (its owner, tuvl_admin or a superuser)';

CREATE FUNCTION tuvl.revoke_use(kind text, name text, role pg_catalog.regrole)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_revoke_use'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.revoke_use(text, text, pg_catalog.regrole) IS 'take back tuvl.grant_use(): the next use by that role''s runs is refused';

REVOKE ALL ON FUNCTION tuvl.grant_use(text, text, pg_catalog.regrole), tuvl.revoke_use(text, text, pg_catalog.regrole) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.grant_use(text, text, pg_catalog.regrole), tuvl.revoke_use(text, text, pg_catalog.regrole) TO tuvl_user;
GRANT SELECT ON tuvl.use_grants TO tuvl_user;

/* ------------------------------------------------------------------ hardening: locks and privileges */

/*
 * tuvl_user could write tuvl.schedule_slots, and so LOCK it: every role's
 * scheduled runs stopped.  Slots are now taken and recorded only through
 * two functions, which check the caller as the policies did.
 */
CREATE FUNCTION tuvl._take_slot(workflow text, slot timestamptz)
RETURNS boolean
AS 'MODULE_PATHNAME', 'tuvl_take_slot'
LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl._take_slot(text, timestamptz) IS 'for tuvl.start_scheduled(): take a slot of a schedule (false when a run was started for it already)';

CREATE FUNCTION tuvl._record_slot(workflow text, slot timestamptz, run_id bigint)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_record_slot'
LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl._record_slot(text, timestamptz, bigint) IS 'for tuvl.start_scheduled(): the run a slot started';

REVOKE ALL ON FUNCTION tuvl._take_slot(text, timestamptz), tuvl._record_slot(text, timestamptz, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl._take_slot(text, timestamptz), tuvl._record_slot(text, timestamptz, bigint) TO tuvl_user;
REVOKE INSERT, UPDATE ON tuvl.schedule_slots FROM tuvl_user;
DROP POLICY schedule_slots_start ON tuvl.schedule_slots;
DROP POLICY schedule_slots_record ON tuvl.schedule_slots;

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
        IF NOT tuvl._take_slot(start_scheduled.workflow, one) THEN
            id := NULL;         -- this slot's run was started already
            CONTINUE;
        END IF;
        id := tuvl.start_run(start_scheduled.workflow, pg_catalog.jsonb_build_object('_scheduled_at', one));
        PERFORM tuvl._record_slot(start_scheduled.workflow, one, id);
    END LOOP;
    RETURN id;                  -- the run of the slot asked for
END
$$;

/* ------------------------------------------------------------------ hardening: notifications, metrics, pictures */

/*
 * What PUBLIC may do (docs/security.md lists it, test_hardening.py checks
 * the list): use the schema, and call tuvl.version(), tuvl.validate() and
 * tuvl.render(), which read nothing.  tuvl.llm_versions is read like
 * tuvl.llms, by tuvl_user; tuvl.graph() and tuvl._journal_events() were
 * executable by PUBLIC since they were created after 0.2.0's sweep.  This
 * section comes last in the script, so the sweep below also takes back
 * the default EXECUTE of every function the sections above created:
 * each grants its own to the roles that need them.
 */
REVOKE ALL ON tuvl.llm_versions FROM PUBLIC;
GRANT SELECT ON tuvl.llm_versions TO tuvl_user;

/*
 * tuvl.graph() escapes everything a workflow names.  Step ids, end ids,
 * statuses, kinds and route keys (signals, which any text may be) reach
 * the picture only through tuvl._graph_text(): for Mermaid every
 * character but letters, digits, space and _ . - becomes an entity code
 * (#34; for ", #35; for #), control characters become spaces, and labels
 * are quoted; for dot, " is \" while \ and & become the entities &#92;
 * and &amp; (a backslash before the closing quote would escape it), and
 * control characters become spaces.  Node ids are s_<id> or e_<id> when
 * the id is letters, digits and _, and sx_<hex> or ex_<hex> of its
 * UTF-8 bytes otherwise, so no id is quoted in Mermaid or collides.
 */
CREATE FUNCTION tuvl._graph_text(t text, format text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT CASE WHEN format OPERATOR(pg_catalog.=) 'dot'
        THEN pg_catalog.regexp_replace(
                 pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(t, '&', '&amp;'), E'\\', '&#92;'),
                                    '"', E'\\"'),
                 '[\x01-\x1f\x7f]', ' ', 'g')
        ELSE (SELECT pg_catalog.string_agg(
                         CASE WHEN c.ch OPERATOR(pg_catalog.~) '^[A-Za-z0-9 _.-]$' THEN c.ch
                              WHEN c.ch OPERATOR(pg_catalog.~) '^[\x01-\x1f\x7f]$' THEN ' '
                              ELSE '#' OPERATOR(pg_catalog.||) pg_catalog.ascii(c.ch) OPERATOR(pg_catalog.||) ';' END,
                         '' ORDER BY c.n)
              FROM pg_catalog.regexp_split_to_table(t, '') WITH ORDINALITY AS c(ch, n))
    END;
END;
COMMENT ON FUNCTION tuvl._graph_text(text, text) IS 'a label of tuvl.graph() escaped for format (mermaid or dot): nothing in it can end the label or start a statement';

CREATE FUNCTION tuvl._graph_node(prefix text, id text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT CASE WHEN id OPERATOR(pg_catalog.~) '^[A-Za-z0-9_]+$' THEN prefix OPERATOR(pg_catalog.||) '_' OPERATOR(pg_catalog.||) id
                ELSE prefix OPERATOR(pg_catalog.||) 'x_'
                     OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.convert_to(id, 'UTF8'), 'hex') END;
END;
COMMENT ON FUNCTION tuvl._graph_node(text, text) IS 'the node id tuvl.graph() gives step or end id: prefix_id, or prefixx_<hex> when id has other characters than letters, digits and _';

CREATE OR REPLACE FUNCTION tuvl.graph(workflow text, format text DEFAULT 'mermaid') RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $graph$
DECLARE
    def jsonb;
    steps jsonb;
    off_line text[] := '{}';
    main text[] := '{}';
    lines text[] := '{}';
    s jsonb;
    sid text;
    node text;
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

    lines := lines || CASE WHEN dot THEN format('digraph "%s" {', tuvl._graph_text(graph.workflow, 'dot'))
                           ELSE 'flowchart TD' END;
    IF dot THEN lines := lines || '  rankdir=TB;'::text; END IF;
    FOR s IN SELECT value FROM jsonb_array_elements(steps) LOOP
        node := tuvl._graph_node('s', s ->> 'id');
        lines := lines || CASE WHEN dot
            THEN format('  "%s" [shape=box, label="%s\n%s"];', node, tuvl._graph_text(s ->> 'id', 'dot'),
                        tuvl._graph_text(s ->> 'kind', 'dot'))
            ELSE format('  %s["%s<br/><i>%s</i>"]', node, tuvl._graph_text(s ->> 'id', 'mermaid'),
                        tuvl._graph_text(s ->> 'kind', 'mermaid')) END;
    END LOOP;
    FOR s IN SELECT value FROM jsonb_array_elements(coalesce(def -> 'ends', '[]')) LOOP
        node := tuvl._graph_node('e', s ->> 'id');
        lines := lines || CASE WHEN dot
            THEN format('  "%s" [shape=oval, label="%s\n%s"];', node, tuvl._graph_text(s ->> 'id', 'dot'),
                        tuvl._graph_text(coalesce(s ->> 'status', 'completed'), 'dot'))
            ELSE format('  %s(["%s: %s"])', node, tuvl._graph_text(s ->> 'id', 'mermaid'),
                        tuvl._graph_text(coalesce(s ->> 'status', 'completed'), 'mermaid')) END;
    END LOOP;

    FOR s IN SELECT value FROM jsonb_array_elements(steps) LOOP
        sid := s ->> 'id';
        node := tuvl._graph_node('s', sid);
        FOR kv IN SELECT key, value #>> '{}' AS target FROM jsonb_each(coalesce(s -> 'routes', '{}')) LOOP
            nxt := CASE WHEN EXISTS (SELECT 1 FROM jsonb_array_elements(steps) x WHERE x ->> 'id' = kv.target)
                        THEN tuvl._graph_node('s', kv.target) ELSE tuvl._graph_node('e', kv.target) END;
            lines := lines || CASE WHEN dot
                THEN format('  "%s" -> "%s" [label="%s"];', node, nxt, tuvl._graph_text(kv.key, 'dot'))
                ELSE format('  %s -->|"%s"| %s', node, tuvl._graph_text(kv.key, 'mermaid'), nxt) END;
        END LOOP;
        -- the default signal without a route flows down the main line
        IF sid = ANY (main) AND NOT coalesce(s -> 'routes', '{}') ? 'default' THEN
            idx := array_position(main, sid);
            IF idx < array_length(main, 1) THEN
                nxt := tuvl._graph_node('s', main[idx + 1]);
            ELSE
                nxt := 'implicit_end';
                implicit := true;
            END IF;
            lines := lines || CASE WHEN dot
                THEN format('  "%s" -> "%s" [label="default"];', node, nxt)
                ELSE format('  %s -->|"default"| %s', node, nxt) END;
        END IF;
        IF s ? 'compensate' THEN
            lines := lines || CASE WHEN dot
                THEN format('  "%s" -> "%s" [style=dashed, label="compensate"];', node,
                            tuvl._graph_node('s', s ->> 'compensate'))
                ELSE format('  %s -.->|"compensate"| %s', node, tuvl._graph_node('s', s ->> 'compensate')) END;
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
GRANT EXECUTE ON FUNCTION tuvl._graph_text(text, text), tuvl._graph_node(text, text) TO tuvl_user;

/*
 * tuvl.max_step_timeout (src/tuvl.c) bounds every step's timeout, and
 * timeout: 0 means it.  It is superuser-only; members of tuvl_admin may
 * set it too, in a session (for tuvl.run()) and with ALTER SYSTEM (for
 * the workers, at the next reload).  Parameter privileges are in a shared
 * catalog: granting them again in each database would lock their row
 * until the CREATE EXTENSION commits, and a CREATE EXTENSION in another
 * database would wait for it.  So only the first grants them.
 */
DO $$
BEGIN
    IF NOT pg_catalog.has_parameter_privilege('tuvl_admin', 'tuvl.max_step_timeout', 'SET, ALTER SYSTEM') THEN
        GRANT SET, ALTER SYSTEM ON PARAMETER tuvl.max_step_timeout TO tuvl_admin;
    END IF;
END
$$;

/*
 * Child workflows have limits (src/step_workflow.c): a Workflow step
 * starts no child deeper than tuvl.max_child_depth below the root run,
 * nor more runs under one root than tuvl.max_run_tree.  A child names
 * the root of its tree in root_run_id, so the runs under a root are
 * counted through one index.  Children of before this release have none
 * and are not counted.
 */
ALTER TABLE tuvl.runs ADD COLUMN root_run_id bigint;
COMMENT ON COLUMN tuvl.runs.root_run_id IS 'for a child run (parent_step set): the run at the top of its tree of Workflow steps; NULL otherwise';
CREATE INDEX runs_root_idx ON tuvl.runs (root_run_id) WHERE root_run_id IS NOT NULL;

/*
 * NOTIFY channels per role (src/channel.c).  Every journal event used to
 * go to the one channel tuvl_events, where any role could LISTEN (and
 * learn when other roles' runs ran and which steps they took) or NOTIFY
 * forged payloads.  Now each event goes to the channel of its run's
 * principal and to the operators' channel, each "tuvl_" and 32 hex digits
 * of an HMAC of the role (or "operators") keyed by this secret, which
 * only the extension's owner reads.  It is not dumped: a restored
 * database makes a new one, and so new channels.
 */
CREATE TABLE tuvl.notify_secret (
    secret bytea NOT NULL CHECK (pg_catalog.octet_length(secret) OPERATOR(pg_catalog.=) 32),
    rotated_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE tuvl.notify_secret IS 'the key of the NOTIFY channels of the journal (one row); readable by the extension owner only; tuvl.rotate_events_channels() replaces it';
CREATE UNIQUE INDEX notify_secret_one_row ON tuvl.notify_secret ((true));
INSERT INTO tuvl.notify_secret (secret)
    VALUES (pg_catalog.decode(pg_catalog.replace(pg_catalog.gen_random_uuid()::pg_catalog.text
                                                 OPERATOR(pg_catalog.||) pg_catalog.gen_random_uuid()::pg_catalog.text,
                                                 '-', ''), 'hex'));
REVOKE ALL ON tuvl.notify_secret FROM PUBLIC;

CREATE FUNCTION tuvl.events_channel() RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_events_channel' LANGUAGE C STABLE STRICT PARALLEL RESTRICTED;
COMMENT ON FUNCTION tuvl.events_channel() IS 'the NOTIFY channel to LISTEN on for the journal events of your runs (for a member of tuvl_operator: of every run)';
GRANT EXECUTE ON FUNCTION tuvl.events_channel() TO tuvl_user;

CREATE FUNCTION tuvl.rotate_events_channels() RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_rotate_events_channels' LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl.rotate_events_channels() IS 'a new key for the NOTIFY channels: every role and the operators get new channels (after a role lost tuvl_operator, say)';
GRANT EXECUTE ON FUNCTION tuvl.rotate_events_channels() TO tuvl_admin;

COMMENT ON VIEW tuvl.events IS 'the journal of every run, one row per event: seq is 1, 2, ... without gaps within a run; tuvl announces every event with NOTIFY on the channel of the run''s principal and on the operators'' channel (tuvl.events_channel())';

/* ------------------------------------------------------------------ hardening: bounded work */

/* Nothing in SQL: the bounds are in the C code (step_sql.c, agent.c, jsonschema.c, llm.c). */

/* ------------------------------------------------------------------ performance: compression */

/*
 * Every transition rewrites its run's row: an agent's conversation, in
 * step_state and context, grows with each turn and was compressed again
 * with pglz each time (12 % of the workers' CPU for 50-turn agents).  LZ4
 * compresses it several times faster, as it does the journal's blocks.
 * Values stored before keep their compression until they are rewritten.
 * A server built without LZ4 keeps pglz.
 */
DO $$
BEGIN
    ALTER TABLE tuvl.runs ALTER COLUMN context SET COMPRESSION lz4,
                          ALTER COLUMN step_state SET COMPRESSION lz4,
                          ALTER COLUMN input SET COMPRESSION lz4,
                          ALTER COLUMN response SET COMPRESSION lz4;
    ALTER TABLE tuvl.journal ALTER COLUMN events SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this server has no LZ4 compression: tuvl''s tables keep pglz';
END
$$;

/* ------------------------------------------------------------------ insight: tokens and scopes
 *
 * API tokens for the HTTP front door (insight/): each stands for a role,
 * with scopes, and is stored as the SHA-256 of its secret (tokens.c).  A
 * request's transaction calls tuvl.authenticate(token) first; the
 * functions of the API and the row security of tuvl.runs then check the
 * token's scopes themselves.
 */
CREATE TABLE tuvl.token_store (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    role pg_catalog.regrole NOT NULL,
    scopes text[] NOT NULL,
    secret_hash bytea NOT NULL,
    created_by pg_catalog.regrole NOT NULL,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    expires_at timestamptz,
    last_used_at timestamptz,
    revoked_at timestamptz
);
COMMENT ON TABLE tuvl.token_store IS 'API tokens: the role each stands for, its scopes and the SHA-256 of its secret (read tuvl.tokens)';
SELECT pg_catalog.pg_extension_config_dump('tuvl.token_store', '');

CREATE VIEW tuvl.tokens WITH (security_barrier = true) AS
    SELECT t.id, t.role, t.scopes, t.created_at, t.expires_at, t.last_used_at, t.revoked_at
    FROM tuvl.token_store t
    WHERE pg_catalog.pg_has_role(t.role, 'MEMBER') OR pg_catalog.pg_has_role('tuvl_admin', 'MEMBER');
COMMENT ON VIEW tuvl.tokens IS 'API tokens without their secrets: a role sees the tokens of the roles it belongs to, tuvl_admin all';
GRANT SELECT ON tuvl.tokens TO tuvl_user;

CREATE FUNCTION tuvl.create_token(role pg_catalog.regrole, scopes text[],
                                  expires interval DEFAULT '90 days')
RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_create_token'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.create_token(pg_catalog.regrole, text[], interval) IS 'a new API token for a role (a member of it, or tuvl_admin), with scopes among runs:start, runs:read, runs:control, people:answer, workflows:write, admin; shown once, stored hashed; expires NULL: never';

CREATE FUNCTION tuvl.revoke_token(id bigint)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_revoke_token'
LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl.revoke_token(bigint) IS 'the token authenticates nothing from now on';

CREATE FUNCTION tuvl.authenticate(token text)
RETURNS pg_catalog.regrole
AS 'MODULE_PATHNAME', 'tuvl_authenticate'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.authenticate(text) IS 'the role a token stands for, its scopes recorded for the rest of the transaction (call it first in each request''s transaction, then SET LOCAL ROLE to the role); 28000 for a token that is not valid';

CREATE FUNCTION tuvl._has_scope(scope text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'tuvl_has_scope'
LANGUAGE C STABLE STRICT PARALLEL RESTRICTED;
COMMENT ON FUNCTION tuvl._has_scope(text) IS 'does the transaction''s token (if it authenticated one) allow the scope? true without a token';

CREATE FUNCTION tuvl._require_scope(scope text)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_require_scope'
LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl._require_scope(text) IS 'raise unless the transaction''s token (if any) allows the scope';

REVOKE ALL ON FUNCTION tuvl.create_token(pg_catalog.regrole, text[], interval), tuvl.revoke_token(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.create_token(pg_catalog.regrole, text[], interval), tuvl.revoke_token(bigint) TO tuvl_user;

/* a token's runs:read scope governs what a request reads of runs and journals */
ALTER POLICY runs_visible ON tuvl.runs
    USING ((principal_id::pg_catalog.oid OPERATOR(pg_catalog.=)
                (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
            OR pg_catalog.pg_has_role('tuvl_operator', 'USAGE'))
           AND tuvl._has_scope('runs:read'));

/* the secrets' functions: a token needs its admin scope */
CREATE OR REPLACE FUNCTION tuvl.set_secret(name text, value text)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT tuvl._require_scope('admin');
    INSERT INTO tuvl.secrets AS s (name, value, updated_by) VALUES ($1, $2, SESSION_USER)
    ON CONFLICT ON CONSTRAINT secrets_pkey
    DO UPDATE SET value = excluded.value, updated_at = pg_catalog.now(), updated_by = excluded.updated_by;
END;

CREATE OR REPLACE FUNCTION tuvl.grant_secret(name text, role pg_catalog.regrole)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM tuvl._require_scope('admin');
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

CREATE OR REPLACE FUNCTION tuvl.revoke_secret(name text, role pg_catalog.regrole)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM tuvl._require_scope('admin');
    DELETE FROM tuvl.secret_grants g
    WHERE g.secret OPERATOR(pg_catalog.=) revoke_secret.name
      AND g.grantee OPERATOR(pg_catalog.=) revoke_secret.role;
    IF NOT FOUND THEN
        RAISE NOTICE 'role "%" held no grant for secret "%"', revoke_secret.role, revoke_secret.name;
    END IF;
END
$$;

/* ------------------------------------------------------------------ insight: the timeline */

/*
 * tuvl.timeline(run_id): the journal as a person reads it, one row per
 * event: the time since the run was created, the step, the event and a
 * one-line summary.  Reads tuvl.events as the caller: a run it may not see
 * has no rows.
 */
CREATE FUNCTION tuvl._event_summary(type text, payload jsonb, tokens integer, latency_ms double precision)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN pg_catalog.left(CASE type
    WHEN 'run_queued' THEN pg_catalog.concat_ws(' ', 'queued', payload OPERATOR(pg_catalog.->>) 'workflow', 'v' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'version'),
                                                'by ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'principal'), 'key ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'key'),
                                                'held by ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'held_by'))
    WHEN 'run_started' THEN pg_catalog.concat_ws(' ', 'started, attempt', payload OPERATOR(pg_catalog.->>) 'attempt')
    WHEN 'agent_started' THEN pg_catalog.concat_ws(' ', 'entered', payload OPERATOR(pg_catalog.->>) 'kind', 'step')
    WHEN 'agent_completed' THEN CASE WHEN payload OPERATOR(pg_catalog.?) 'error'
        THEN pg_catalog.concat_ws(' ', 'failed', '(' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'error_type') OPERATOR(pg_catalog.||) '):', payload OPERATOR(pg_catalog.->>) 'error')
        ELSE pg_catalog.concat_ws(' ', 'done, signal', payload OPERATOR(pg_catalog.->>) 'signal',
                                  'output ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'output_key')) END
    WHEN 'signal' THEN 'signal ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'signal')
    WHEN 'checkpoint' THEN CASE WHEN payload OPERATOR(pg_catalog.?) 'end' THEN pg_catalog.concat_ws(' ', 'end', payload OPERATOR(pg_catalog.->>) 'end', '->', payload OPERATOR(pg_catalog.->>) 'status')
        ELSE pg_catalog.concat_ws(' ', 'next', coalesce(payload OPERATOR(pg_catalog.->>) 'step', '(none)'), '->', payload OPERATOR(pg_catalog.->>) 'status') END
    WHEN 'tool_call' THEN pg_catalog.concat_ws(' ', 'request',
        coalesce(payload OPERATOR(pg_catalog.#>>) '{request,method}', payload OPERATOR(pg_catalog.#>>) '{request,rpc}', payload OPERATOR(pg_catalog.->>) 'tool'),
        coalesce(payload OPERATOR(pg_catalog.#>>) '{request,url}', payload OPERATOR(pg_catalog.#>>) '{request,tool}'),
        'after ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'delay_ms') OPERATOR(pg_catalog.||) ' ms')
    WHEN 'tool_result' THEN pg_catalog.concat_ws(' ', coalesce('HTTP ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.#>>) '{result,status}'), 'no response'),
        (payload OPERATOR(pg_catalog.#>>) '{result,error}'), 'in ' OPERATOR(pg_catalog.||) pg_catalog.round(latency_ms) OPERATOR(pg_catalog.||) ' ms')
    WHEN 'llm_turn' THEN pg_catalog.concat_ws(' ', payload OPERATOR(pg_catalog.->>) 'model', coalesce(tokens, 0) OPERATOR(pg_catalog.||) ' tokens',
        'in ' OPERATOR(pg_catalog.||) pg_catalog.round(latency_ms) OPERATOR(pg_catalog.||) ' ms', payload OPERATOR(pg_catalog.->>) 'finish_reason', payload OPERATOR(pg_catalog.->>) 'error')
    WHEN 'judge_verdict' THEN pg_catalog.concat_ws(' ', payload OPERATOR(pg_catalog.->>) 'source', payload OPERATOR(pg_catalog.->>) 'rule', 'verdict',
        payload OPERATOR(pg_catalog.->>) 'verdict', '->', payload OPERATOR(pg_catalog.->>) 'action', '(' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'reason') OPERATOR(pg_catalog.||) ')')
    WHEN 'decision' THEN pg_catalog.concat_ws(' ', 'decision by', payload OPERATOR(pg_catalog.->>) 'by', payload OPERATOR(pg_catalog.->>) 'kind',
        payload OPERATOR(pg_catalog.->>) 'message')
    WHEN 'approval_requested' THEN pg_catalog.concat_ws(' ', 'approval requested for', payload OPERATOR(pg_catalog.->>) 'tool')
    WHEN 'approval_decided' THEN pg_catalog.concat_ws(' ', CASE WHEN (payload OPERATOR(pg_catalog.->>) 'approved')::pg_catalog.bool
        THEN 'approved' ELSE 'rejected' END, 'by', payload OPERATOR(pg_catalog.->>) 'by', payload OPERATOR(pg_catalog.->>) 'note')
    WHEN 'paused' THEN pg_catalog.concat_ws(' ', 'paused by', payload OPERATOR(pg_catalog.->>) 'by', payload OPERATOR(pg_catalog.->>) 'reason')
    WHEN 'resumed' THEN pg_catalog.concat_ws(' ', 'resumed by', payload OPERATOR(pg_catalog.->>) 'by')
    WHEN 'run_completed' THEN pg_catalog.concat_ws(' ', 'completed at', payload OPERATOR(pg_catalog.->>) 'end',
        'response ' OPERATOR(pg_catalog.||) (payload OPERATOR(pg_catalog.->>) 'response'))
    WHEN 'run_failed' THEN pg_catalog.concat_ws(' ', 'failed:', payload OPERATOR(pg_catalog.->>) 'error')
    WHEN 'run_aborted' THEN pg_catalog.concat_ws(' ', 'aborted by', payload OPERATOR(pg_catalog.->>) 'by', payload OPERATOR(pg_catalog.->>) 'reason')
    WHEN 'compensation_started' THEN pg_catalog.concat_ws(' ', 'compensating with', payload OPERATOR(pg_catalog.->>) 'step')
    WHEN 'compensation_completed' THEN pg_catalog.concat_ws(' ', 'compensated', payload OPERATOR(pg_catalog.->>) 'step',
        payload OPERATOR(pg_catalog.->>) 'error')
    WHEN 'children_started' THEN pg_catalog.concat_ws(' ', 'started', payload OPERATOR(pg_catalog.->>) 'count', 'runs of', payload OPERATOR(pg_catalog.->>) 'workflow')
    WHEN 'children_ended' THEN pg_catalog.concat_ws(' ', payload OPERATOR(pg_catalog.->>) 'count', 'runs of', payload OPERATOR(pg_catalog.->>) 'workflow',
        'ended', payload OPERATOR(pg_catalog.->>) 'error')
    ELSE payload::pg_catalog.text END, 200);
COMMENT ON FUNCTION tuvl._event_summary(text, jsonb, integer, double precision) IS 'one line saying what a journal event says (tuvl.timeline)';

CREATE FUNCTION tuvl.timeline(run_id bigint)
RETURNS TABLE (at interval, seq integer, step text, event text, summary text)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT tuvl._require_scope('runs:read');
    SELECT e.ts OPERATOR(pg_catalog.-) r.created_at, e.seq, e.agent_id, e.type,
           tuvl._event_summary(e.type, e.payload, e.tokens, e.latency_ms)
    FROM tuvl.runs r JOIN tuvl.events e ON e.run_id OPERATOR(pg_catalog.=) r.id
    WHERE r.id OPERATOR(pg_catalog.=) timeline.run_id
    ORDER BY e.seq;
END;
COMMENT ON FUNCTION tuvl.timeline(bigint) IS 'a run''s journal as readable rows: time since the run was created, seq, step, event, one-line summary';
REVOKE ALL ON FUNCTION tuvl.timeline(bigint), tuvl._event_summary(text, jsonb, integer, double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.timeline(bigint), tuvl._event_summary(text, jsonb, integer, double precision) TO tuvl_user;

/* ------------------------------------------------------------------ insight: routes of workflows */

/*
 * The server of insight/ serves a workflow with trigger.http at
 * /hooks<path>: it looks the route up, then authenticates the request
 * with a token or, for a signed route, with tuvl.verify_hook().
 */
CREATE FUNCTION tuvl.http_route(path text)
RETURNS TABLE (workflow text, method text, sync_timeout text, signature_header text)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT w.name,
           pg_catalog.upper(coalesce(w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,method}', 'POST')),
           coalesce(w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,sync_timeout}',
                    w.definition OPERATOR(pg_catalog.#>>) '{trigger,sync_timeout}'),
           CASE WHEN w.definition OPERATOR(pg_catalog.#>) '{trigger,http,signature}' IS NOT NULL
                THEN coalesce(w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,signature,header}', 'X-Signature') END
    FROM tuvl.workflows w
    WHERE w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,path}' OPERATOR(pg_catalog.=) http_route.path
      AND w.version OPERATOR(pg_catalog.=) (SELECT pg_catalog.max(x.version) FROM tuvl.workflows x
                                            WHERE x.name OPERATOR(pg_catalog.=) w.name)
    LIMIT 1;
END;
COMMENT ON FUNCTION tuvl.http_route(text) IS 'the workflow served at /hooks<path> (trigger.http of its newest version): name, method, sync timeout, and the header of its signature when it is signed';

CREATE FUNCTION tuvl.verify_hook(path text, body text, signature text)
RETURNS pg_catalog.regrole
AS 'MODULE_PATHNAME', 'tuvl_verify_hook'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.verify_hook(text, text, text) IS 'the owner of the workflow served at path, when signature (hex, or sha256=<hex>) is the HMAC-SHA256 of body under its trigger.http.signature secret; authenticates the transaction as that role with scope runs:start; 28000 otherwise';

/* ------------------------------------------------------------------ Beyond one server (issue 42) */
-- Beyond one server (issue 42)

/*
 * Run ids carry their partition (docs/scaling.md): behind tuvl_router a
 * database has GUC tuvl.partition = p and its runs get the ids
 * p * 2^44 + n, n from tuvl.run_id_seq (1 .. 2^44 - 1), so the router
 * reads a run's partition from its id (id >> 44) without a lookup.  Not
 * partitioned (tuvl.partition = -1, the default), ids are n, as before.
 * The identity column becomes a plain column whose default is
 * tuvl._next_run_id(); the sequence goes on where the identity's stopped.
 */
CREATE SEQUENCE tuvl.run_id_seq AS bigint MINVALUE 1 MAXVALUE 17592186044415;
SELECT pg_catalog.setval('tuvl.run_id_seq', s.last_value, s.is_called) FROM tuvl.runs_id_seq s;
/* out of the extension first, which also takes it off its dump list */
ALTER EXTENSION tuvl DROP SEQUENCE tuvl.runs_id_seq;
ALTER TABLE tuvl.runs ALTER COLUMN id DROP IDENTITY;
ALTER SEQUENCE tuvl.run_id_seq OWNED BY tuvl.runs.id;
SELECT pg_catalog.pg_extension_config_dump('tuvl.run_id_seq', '');
COMMENT ON SEQUENCE tuvl.run_id_seq IS 'the per-partition part of run ids: id = partition * 2^44 + nextval';

CREATE FUNCTION tuvl._next_run_id() RETURNS bigint
LANGUAGE sql VOLATILE
RETURN pg_catalog.nextval('tuvl.run_id_seq'::pg_catalog.regclass)
       OPERATOR(pg_catalog.+)
       (GREATEST(coalesce(pg_catalog.current_setting('tuvl.partition', true), '-1')::integer, 0)::bigint
        OPERATOR(pg_catalog.<<) 44);
COMMENT ON FUNCTION tuvl._next_run_id() IS 'a new run id: tuvl.partition * 2^44 + the next value of tuvl.run_id_seq';
ALTER TABLE tuvl.runs ALTER COLUMN id SET DEFAULT tuvl._next_run_id();

/*
 * What tuvl_router calls on every partition before it registers anything
 * anywhere: the registration itself, in a subtransaction rolled back at
 * once, so every check (validation, ownership, grants, sizes) runs as it
 * will for real.  Returns NULL when the partition would accept it, or the
 * error (sqlstate, message, detail, hint) it would raise.  SECURITY
 * INVOKER: it checks as the caller.
 */
CREATE FUNCTION tuvl._try_register(kind text, source text)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    st text; msg text; det text; hnt text;
BEGIN
    BEGIN
        CASE kind
            WHEN 'workflow' THEN PERFORM tuvl.register_workflow(source);
            WHEN 'artifact' THEN PERFORM tuvl.register_artifact(source);
            WHEN 'llm' THEN PERFORM tuvl.register_llm(source);
            ELSE RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = pg_catalog.format('unknown registration kind "%s"', kind),
                HINT = 'The kinds are workflow, artifact and llm.';
        END CASE;
        RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = 'tuvl dry run';
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT,
            det = PG_EXCEPTION_DETAIL, hnt = PG_EXCEPTION_HINT;
        IF st OPERATOR(pg_catalog.=) 'P0001' AND msg OPERATOR(pg_catalog.=) 'tuvl dry run' THEN
            RETURN NULL;
        END IF;
        RETURN pg_catalog.jsonb_build_object('sqlstate', st, 'message', msg,
            'detail', NULLIF(det, ''), 'hint', NULLIF(hnt, ''),
            'partition', pg_catalog.current_setting('tuvl.partition', true));
    END;
END;
$fn$;
COMMENT ON FUNCTION tuvl._try_register(text, text) IS 'tuvl_router''s first phase: would this partition register the source (kind workflow, artifact or llm)? NULL if so, else the error as JSON';
REVOKE ALL ON FUNCTION tuvl._try_register(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl._try_register(text, text) TO tuvl_user;

/* ------------------------------------------------------------------ flow control: model admission and costs (issue 41) */

/*
 * What a run's priced model calls cost so far, in the currency of the
 * model configs' price: added at each llm_turn that has a cost, checked
 * against a workflow's max_cost before each call (src/agent/agent_outcome.c).
 */
ALTER TABLE tuvl.runs ADD COLUMN cost float8 NOT NULL DEFAULT 0;
COMMENT ON COLUMN tuvl.runs.cost IS 'what the run''s model calls cost so far at their configs'' price (the sum of its llm_turn events'' cost)';

/*
 * The model calls waiting for their config's limits now (shared memory,
 * src/effects/admission.c): what tuvl.runs_in_flight.waiting_for shows
 * for a run whose call waits.  A role sees its own runs', tuvl_operator
 * every run's.
 */
CREATE FUNCTION tuvl._model_admission_waits(OUT run_id bigint, OUT config text,
                                            OUT since timestamptz, OUT reason text)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'tuvl_model_admission_waits' LANGUAGE C STRICT VOLATILE PARALLEL RESTRICTED;
COMMENT ON FUNCTION tuvl._model_admission_waits() IS 'model calls waiting for their config''s limits: run, config, since when, and why (paused by a 429, concurrency or rate)';
GRANT EXECUTE ON FUNCTION tuvl._model_admission_waits() TO tuvl_user;

/* ------------------------------------------------------------------ flow control: rate limits and debounce (issue 41) */

/*
 * rate_limit (a workflow's, admitting its runs; an APICall, MCP or Agent
 * step's, admitting each entry into it): the times reserved per bucket
 * (ratelimit.c).  A bucket is the workflow's, the role's, the limit's,
 * per's and the rendered key's; only the extension's owner reads or
 * writes the log, so no role learns of or uses another's budget.
 */
CREATE TABLE tuvl.rate_limit_grants (
    bucket text NOT NULL,
    at timestamptz NOT NULL
);
CREATE INDEX rate_limit_grants_idx ON tuvl.rate_limit_grants (bucket, at);
COMMENT ON TABLE tuvl.rate_limit_grants IS 'rate_limit: the times admitted or reserved per bucket (workflow, role, limit, per, rendered key); pruned past per when the bucket is used';
COMMENT ON COLUMN tuvl.rate_limit_grants.bucket IS 'run/ or step/, the workflow, the principal''s OID, limit, per in ms and the rendered key';
COMMENT ON COLUMN tuvl.rate_limit_grants.at IS 'when the run or step may go (or went)';

/*
 * What a run that has not started waits for besides a worker: its
 * debounce, its rate limit (then when it may go), as a JSON object whose
 * "for" names it; NULL otherwise and once it wakes.
 */
ALTER TABLE tuvl.runs ADD COLUMN waiting jsonb;
COMMENT ON COLUMN tuvl.runs.waiting IS 'what a sleeping run that has not started waits for: {"for": "debounce" or "rate_limit", "until", "debounce", "rate_limit": {key, limit, per, per_ms, at_us}}; NULL otherwise';

/* start_run(..., debounce): coalesce starts of a key until it is quiet (api.c) */
DROP FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text);
CREATE FUNCTION tuvl.start_run(workflow text, input jsonb DEFAULT '{}', key text DEFAULT NULL,
                               not_before timestamptz DEFAULT NULL, priority integer DEFAULT 0,
                               version integer DEFAULT NULL, traceparent text DEFAULT NULL,
                               debounce interval DEFAULT NULL)
RETURNS bigint
AS 'MODULE_PATHNAME', 'tuvl_start_run'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text, interval) IS 'validate the input and queue a run (of the latest version, or of version), once per key; with debounce, starts of the key coalesce into one run that starts once the key has been quiet that long, with the latest input';
REVOKE ALL ON FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.start_run(text, jsonb, text, timestamptz, integer, integer, text, interval) TO tuvl_user;

/* ------------------------------------------------------------------ errors that say what to do, schedules (issue 44) */

/* an empty secret would be sent as an empty key and fail far from here */
CREATE OR REPLACE FUNCTION tuvl.set_secret(name text, value text)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM tuvl._require_scope('admin');
    IF set_secret.name IS NULL OR set_secret.name OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'a secret''s name must not be empty' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'Name it as templates will: {{ secrets.NAME }}.';
    END IF;
    IF set_secret.value IS NULL OR set_secret.value OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'the value of secret "%" must not be empty', set_secret.name
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass the key or token itself; to stop runs using the secret, take its grants back with tuvl.revoke_secret().';
    END IF;
    INSERT INTO tuvl.secrets AS s (name, value, updated_by) VALUES (set_secret.name, set_secret.value, SESSION_USER)
    ON CONFLICT ON CONSTRAINT secrets_pkey
    DO UPDATE SET value = excluded.value, updated_at = pg_catalog.now(), updated_by = excluded.updated_by;
END
$$;

/*
 * tuvl.schedules: each scheduled workflow (trigger.schedule of its newest
 * version) with its pg_cron job and how the job's last run went, from
 * cron.job_run_details, so that a job that fails (pg_cron cannot connect,
 * the role lost its grant) is seen in tuvl.  Without pg_cron in this
 * database, or without the right to read its tables, the job columns are
 * NULL.  tuvl._cron_jobs() reads pg_cron's tables as the caller.
 */
CREATE FUNCTION tuvl._cron_jobs()
RETURNS TABLE (jobname text, jobid bigint, active boolean, username text, database text,
               last_status text, last_message text, last_start timestamptz, last_end timestamptz,
               failures_24h bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF pg_catalog.to_regclass('cron.job') IS NULL
       OR pg_catalog.to_regclass('cron.job_run_details') IS NULL
       OR NOT pg_catalog.has_schema_privilege('cron', 'USAGE')
       OR NOT pg_catalog.has_table_privilege('cron.job', 'SELECT')
       OR NOT pg_catalog.has_table_privilege('cron.job_run_details', 'SELECT') THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE $q$
        SELECT j.jobname::pg_catalog.text, j.jobid, j.active, j.username::pg_catalog.text,
               j.database::pg_catalog.text, d.status, d.return_message, d.start_time, d.end_time,
               (SELECT pg_catalog.count(*) FROM cron.job_run_details f
                WHERE f.jobid OPERATOR(pg_catalog.=) j.jobid
                  AND f.status OPERATOR(pg_catalog.=) 'failed'
                  AND f.start_time OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) '1 day'::pg_catalog.interval))
        FROM cron.job j
        LEFT JOIN LATERAL (SELECT r.status, r.return_message, r.start_time, r.end_time
                           FROM cron.job_run_details r
                           WHERE r.jobid OPERATOR(pg_catalog.=) j.jobid
                           ORDER BY r.runid DESC LIMIT 1) d ON true
        WHERE j.jobname OPERATOR(pg_catalog.~~) 'tuvl\_%'
    $q$;
END
$$;
COMMENT ON FUNCTION tuvl._cron_jobs() IS 'for tuvl.schedules: the pg_cron jobs named tuvl_* the caller may read, with their last run; none without pg_cron';

CREATE VIEW tuvl.schedules AS
    SELECT w.name AS workflow, w.version,
           w.definition OPERATOR(pg_catalog.#>>) '{trigger,schedule}' AS schedule,
           w.owner,
           c.jobid, c.active, c.database,
           c.last_status, c.last_message, c.last_start, c.last_end, c.failures_24h,
           (SELECT pg_catalog.max(s.slot) FROM tuvl.schedule_slots s
            WHERE s.workflow OPERATOR(pg_catalog.=) w.name) AS last_slot
    FROM tuvl.workflows w
    LEFT JOIN tuvl._cron_jobs() c ON c.jobname OPERATOR(pg_catalog.=) ('tuvl_' OPERATOR(pg_catalog.||) w.name)
                                 AND c.database OPERATOR(pg_catalog.=) pg_catalog.current_database()
    WHERE w.version OPERATOR(pg_catalog.=) (SELECT pg_catalog.max(x.version) FROM tuvl.workflows x
                                            WHERE x.name OPERATOR(pg_catalog.=) w.name)
      AND w.definition OPERATOR(pg_catalog.#>>) '{trigger,schedule}' IS NOT NULL;
COMMENT ON VIEW tuvl.schedules IS 'scheduled workflows, their pg_cron job and how its last run went (last_status failed, last_message says why); the job columns are NULL without pg_cron here or the right to read its tables, jobid NULL when no job exists';
GRANT SELECT ON tuvl.schedules TO tuvl_user;
GRANT EXECUTE ON FUNCTION tuvl._cron_jobs() TO tuvl_user;


/* ------------------------------------------------------------------ console: dev mode (issue 38) */

/*
 * Insight's dev mode, kept in the database so that it holds for runs on
 * any worker and survives restarts, as a pause does.  A breakpoint
 * (workflow, step) set by a role stops that role's runs of the workflow
 * before they enter the step (a member of tuvl_operator: everyone's
 * runs); the run parks paused, its paused event saying by: breakpoint.
 * tuvl.step_run() lets a paused run execute the step it stopped before
 * and stop again before the next one (by: step); tuvl.resume_run() lets
 * it go on.  tuvl.dev_runs keeps per run whether it is in step mode and
 * the step it may enter once without stopping (the one it stopped
 * before).
 *
 * Only tuvl writes the two tables: the C functions below and the workers
 * (src/api/devmode.c, src/runtime/breakpoints.c), through the owner
 * switch, which also keep the gate in shared memory that spares runs the
 * question while the database has no breakpoint and no run in step mode.
 * Ordinary roles may only read them, their own rows (row security): a
 * role that could write them could LOCK them and stall the workers.
 */
CREATE TABLE tuvl.breakpoints (
    workflow text NOT NULL,
    step text NOT NULL,
    role pg_catalog.regrole NOT NULL,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (workflow, step, role)
);
COMMENT ON TABLE tuvl.breakpoints IS 'dev mode: runs of workflow stop before step (runs of role; a member of tuvl_operator: all runs); written by tuvl.set_breakpoint, tuvl.clear_breakpoint only';
SELECT pg_catalog.pg_extension_config_dump('tuvl.breakpoints', '');
ALTER TABLE tuvl.breakpoints ENABLE ROW LEVEL SECURITY;
CREATE POLICY breakpoints_visible ON tuvl.breakpoints FOR SELECT
    USING (pg_catalog.pg_has_role(role::pg_catalog.oid, 'MEMBER') OR pg_catalog.pg_has_role('tuvl_operator', 'USAGE'));
GRANT SELECT ON tuvl.breakpoints TO tuvl_user;

/*
 * No foreign key to tuvl.runs: one would make every DELETE of runs
 * (tuvl.purge()) fire a cascade trigger per run and refuse TRUNCATE
 * tuvl.runs.  A run's row goes when the run ends (breakpoints.c); one
 * left behind (a run aborted while paused) is seen by nobody, as its run
 * is gone or ended.
 */
CREATE TABLE tuvl.dev_runs (
    run_id bigint PRIMARY KEY,
    step_mode boolean NOT NULL DEFAULT false,
    pass_step text,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE tuvl.dev_runs IS 'dev mode of a run: step_mode (stop before the next step it enters) and pass_step (the step it may enter once without stopping: the one it stopped before); written by tuvl.step_run and the workers only';
SELECT pg_catalog.pg_extension_config_dump('tuvl.dev_runs', '');
ALTER TABLE tuvl.dev_runs ENABLE ROW LEVEL SECURITY;
CREATE POLICY dev_runs_visible ON tuvl.dev_runs FOR SELECT
    USING (EXISTS (SELECT 1 FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) dev_runs.run_id OFFSET 0));
GRANT SELECT ON tuvl.dev_runs TO tuvl_user;

CREATE FUNCTION tuvl.set_breakpoint(workflow text, step text)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_set_breakpoint'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.set_breakpoint(text, text) IS 'dev mode: your runs of workflow (a member of tuvl_operator: all its runs) pause before they enter step; the paused event says by: breakpoint';

CREATE FUNCTION tuvl.clear_breakpoint(workflow text, step text)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_clear_breakpoint'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.clear_breakpoint(text, text) IS 'dev mode: remove your breakpoint before step of workflow';

CREATE FUNCTION tuvl.step_run(run_id bigint)
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_step_run'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.step_run(bigint) IS 'dev mode: a paused run executes the step it stopped before and pauses again before the next (by: step); at an end the run ends';

GRANT EXECUTE ON FUNCTION tuvl.set_breakpoint(text, text), tuvl.clear_breakpoint(text, text),
    tuvl.step_run(bigint) TO tuvl_user;

/*
 * The console's counts by status read up to 50,000 runs, and the policy of
 * tuvl.runs called pg_has_role() and tuvl._has_scope() for each of them:
 * most of the query's time.  Neither depends on the row, so each becomes a
 * scalar subquery, which PostgreSQL evaluates once a query (an InitPlan).
 * The rule is the same; the journal's policies reach it through EXISTS.
 */
ALTER POLICY runs_visible ON tuvl.runs
    USING ((principal_id::pg_catalog.oid OPERATOR(pg_catalog.=)
                (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER)
            OR (SELECT pg_catalog.pg_has_role('tuvl_operator', 'USAGE')))
           AND (SELECT tuvl._has_scope('runs:read')));

/*
 * The journal's policy probes the run's row.  Planned before the journal
 * has statistics (a fresh database), EXISTS became a hashed SubPlan that
 * read every run the role may see on each query: 64 ms to read one run's
 * new events at 33,000 runs.  OFFSET 0 keeps the subquery as it is
 * written (PostgreSQL neither hashes nor flattens it), so each row of
 * the journal costs one index probe of tuvl.runs, whose policy's InitPlans
 * still run once a query.
 */
ALTER POLICY journal_visible ON tuvl.journal
    USING (EXISTS (SELECT 1 FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) run_id OFFSET 0));

/* ------------------------------------------------------------------ mcp: OAuth and elicitation (issue 40) */

/*
 * OAuth 2.1 for MCP servers (docs/mcp.md#oauth).  An access token is a
 * secret (tuvl.secrets, named mcp_oauth_...) granted to the role that
 * connected; tuvl.mcp_oauth_tokens says which server URL it is for and how
 * to refresh it.  tuvl.mcp_oauth_pending holds an authorization-code grant
 * between tuvl.mcp_connect() and tuvl.mcp_connect_finish().  Both tables
 * are the extension owner's alone, like tuvl.secrets.
 */
CREATE TABLE tuvl.mcp_oauth_tokens (
    url text NOT NULL,
    role pg_catalog.regrole NOT NULL,
    secret text NOT NULL,
    refresh_secret text,
    expires_at timestamptz,
    scope text,
    token_endpoint text NOT NULL,
    client_id text,
    client_secret text,
    auth_method text NOT NULL DEFAULT 'none',
    resource text,
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (url, role)
);
COMMENT ON TABLE tuvl.mcp_oauth_tokens IS 'OAuth tokens of MCP servers, per server URL and role (the token itself is the secret named in secret); readable only by the extension owner';
REVOKE ALL ON tuvl.mcp_oauth_tokens FROM PUBLIC;
/* which token is whose, for tuvl.grant_secret(); never the values */
GRANT SELECT (url, role, secret, expires_at, scope, updated_at) ON tuvl.mcp_oauth_tokens TO tuvl_admin;

CREATE TABLE tuvl.mcp_oauth_pending (
    state text PRIMARY KEY,
    role pg_catalog.regrole NOT NULL,
    url text NOT NULL,
    verifier text NOT NULL,
    redirect_uri text NOT NULL,
    token_endpoint text NOT NULL,
    client_id text NOT NULL,
    client_secret text,
    auth_method text NOT NULL,
    resource text,
    scope text,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE tuvl.mcp_oauth_pending IS 'authorization-code grants started by tuvl.mcp_connect() and not finished yet; readable only by the extension owner';
REVOKE ALL ON tuvl.mcp_oauth_pending FROM PUBLIC;

CREATE FUNCTION tuvl.mcp_connect(url text, auth jsonb DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_mcp_connect'
LANGUAGE C VOLATILE;
COMMENT ON FUNCTION tuvl.mcp_connect(text, jsonb) IS 'start an OAuth authorization-code grant for an MCP server (discovery, registration, PKCE) for the calling role; returns the URL a person opens';

CREATE FUNCTION tuvl.mcp_connect_finish(callback_url text)
RETURNS text
AS 'MODULE_PATHNAME', 'tuvl_mcp_connect_finish'
LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl.mcp_connect_finish(text) IS 'finish an OAuth grant started by tuvl.mcp_connect() with the URL the person was sent back to; stores the tokens as secrets of the calling role and returns the MCP server URL';
GRANT EXECUTE ON FUNCTION tuvl.mcp_connect(text, jsonb), tuvl.mcp_connect_finish(text) TO tuvl_user;

/* ------------------------------------------------------------------ flow control: waits and scale (issue 41, session 5) */

/*
 * runs_in_flight: waiting_for (text, for people) says what each run waits
 * for; the new column waiting says it as JSON, {"for": kind, ...}: kinds
 * worker, process, person, decision, resume, timer, children,
 * compensation, concurrency, max_parallel, rate_limit, debounce, llm.  A
 * step that parks with an awaiting object of another kind (a later
 * feature's) shows as that kind with its fields, with no change here.
 *
 * A run whose model call waits for its config's limits
 * (tuvl._model_admission_waits(), shared memory) says so: waiting_for
 * "llm:<config>: waiting for model admission: <why> (since T)", waiting
 * {"for": "llm", "config", "reason" (paused, concurrency or rate),
 * "since", "step", "pid"}.  The function checks the token's runs:read
 * scope, so the view calls it only when the transaction may read runs.
 * The view is defined once in this script, here, after all it reads.
 */
CREATE OR REPLACE VIEW tuvl.runs_in_flight WITH (security_invoker = true) AS
    SELECT r.id, r.workflow, r.workflow_version AS version, r.status, r.current_step AS step,
           CASE
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping' AND r.current_step IS NULL
                    AND r.waiting OPERATOR(pg_catalog.->>) 'for' OPERATOR(pg_catalog.=) 'rate_limit'
                   THEN pg_catalog.format('rate limit: key %s allows %s per %s; it may start at %s',
                                          r.waiting OPERATOR(pg_catalog.->) 'rate_limit' OPERATOR(pg_catalog.->>) 'key',
                                          r.waiting OPERATOR(pg_catalog.->) 'rate_limit' OPERATOR(pg_catalog.->>) 'limit',
                                          r.waiting OPERATOR(pg_catalog.->) 'rate_limit' OPERATOR(pg_catalog.->>) 'per',
                                          r.wake_at)
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping' AND r.current_step IS NULL
                    AND r.waiting OPERATOR(pg_catalog.->>) 'for' OPERATOR(pg_catalog.=) 'debounce'
                   THEN pg_catalog.format('debounce: starts at %s unless started again with its key (quiet for %s)',
                                          r.wake_at, r.waiting OPERATOR(pg_catalog.->>) 'debounce')
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping'
                    AND r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'kind' OPERATOR(pg_catalog.=) 'rate_limit'
                   THEN pg_catalog.format('rate limit: key %s allows %s per %s; step %s may go at %s',
                                          r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'key',
                                          r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'limit',
                                          r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'per',
                                          r.current_step, r.wake_at)
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping'
                    AND r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'kind' OPERATOR(pg_catalog.<>) 'sleep'
                   THEN pg_catalog.format('%s: step %s may go at %s',
                                          r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'kind',
                                          r.current_step, r.wake_at)
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by OPERATOR(pg_catalog.=) 'concurrency'
                   THEN pg_catalog.format('held: %s runs of concurrency key %s are in flight',
                                          r.concurrency_limit, r.concurrency_key)
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by OPERATOR(pg_catalog.=) 'max_parallel'
                   THEN pg_catalog.format('held: its siblings fill max_parallel of run %s', r.parent_run_id)
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' THEN 'waiting for a worker'
               WHEN a.run_id IS NOT NULL
                   THEN pg_catalog.format('llm:%s: waiting for model admission: %s (since %s)', a.config,
                                          CASE
                                              WHEN a.reason OPERATOR(pg_catalog.=) 'paused'
                                                  THEN 'paused by a 429 from the provider'
                                              WHEN a.reason OPERATOR(pg_catalog.=) 'concurrency'
                                                  THEN 'its concurrency limit is reached'
                                              ELSE 'its rpm or tpm is used up'
                                          END, a.since)
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
           r.wake_at,
           CASE
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping' AND r.current_step IS NULL AND r.waiting IS NOT NULL
                   THEN pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
                       'for', r.waiting OPERATOR(pg_catalog.->>) 'for',
                       'key', r.waiting OPERATOR(pg_catalog.->) 'rate_limit' OPERATOR(pg_catalog.->>) 'key',
                       'limit', (r.waiting OPERATOR(pg_catalog.->) 'rate_limit' OPERATOR(pg_catalog.->>) 'limit')::pg_catalog.int4,
                       'per', r.waiting OPERATOR(pg_catalog.->) 'rate_limit' OPERATOR(pg_catalog.->>) 'per',
                       'debounce', r.waiting OPERATOR(pg_catalog.->>) 'debounce',
                       'until', r.wake_at))
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping'
                    AND r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'kind' OPERATOR(pg_catalog.<>) 'sleep'
                   THEN (r.step_state OPERATOR(pg_catalog.->) 'awaiting'
                         OPERATOR(pg_catalog.-) '{kind,until,until_us,wake_epoch}'::pg_catalog.text[])
                        OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(
                            'for', r.step_state OPERATOR(pg_catalog.->) 'awaiting' OPERATOR(pg_catalog.->>) 'kind',
                            'step', r.current_step, 'until', r.wake_at)
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' AND r.held_by IS NOT NULL
                   THEN pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
                       'for', r.held_by,
                       'key', CASE WHEN r.held_by OPERATOR(pg_catalog.=) 'concurrency' THEN r.concurrency_key END,
                       'limit', CASE WHEN r.held_by OPERATOR(pg_catalog.=) 'concurrency' THEN r.concurrency_limit END,
                       'parent_run_id', CASE WHEN r.held_by OPERATOR(pg_catalog.=) 'max_parallel' THEN r.parent_run_id END))
               WHEN r.status OPERATOR(pg_catalog.=) 'queued' THEN '{"for": "worker"}'::pg_catalog.jsonb
               WHEN a.run_id IS NOT NULL
                   THEN pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
                       'for', 'llm', 'config', a.config, 'reason', a.reason, 'since', a.since,
                       'step', r.current_step, 'pid', r.lease_owner))
               WHEN r.status OPERATOR(pg_catalog.=) 'running'
                   THEN pg_catalog.jsonb_build_object('for', 'process', 'pid', r.lease_owner)
               WHEN r.status OPERATOR(pg_catalog.=) 'waiting_human' THEN '{"for": "person"}'::pg_catalog.jsonb
               WHEN r.status OPERATOR(pg_catalog.=) 'waiting_approval' THEN '{"for": "decision"}'::pg_catalog.jsonb
               WHEN r.status OPERATOR(pg_catalog.=) 'paused' THEN '{"for": "resume"}'::pg_catalog.jsonb
               WHEN r.status OPERATOR(pg_catalog.=) 'sleeping'
                   THEN pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object('for', 'timer', 'step', r.current_step,
                                                                                    'until', r.wake_at))
               WHEN r.status OPERATOR(pg_catalog.=) 'waiting_children' THEN '{"for": "children"}'::pg_catalog.jsonb
               WHEN r.status OPERATOR(pg_catalog.=) 'compensating' THEN '{"for": "compensation"}'::pg_catalog.jsonb
           END AS waiting
    FROM tuvl.runs r
    LEFT JOIN (SELECT DISTINCT ON (w.run_id) w.run_id, w.config, w.reason, w.since
               FROM tuvl._model_admission_waits() w
               WHERE (SELECT tuvl._has_scope('runs:read'))
               ORDER BY w.run_id, w.since) a
           ON a.run_id OPERATOR(pg_catalog.=) r.id AND r.status OPERATOR(pg_catalog.=) 'running'
    WHERE r.finished_at IS NULL;
COMMENT ON VIEW tuvl.runs_in_flight IS 'runs that have not ended, with what each waits for (waiting_for for people, waiting as JSON whose "for" names it) and its age';
COMMENT ON COLUMN tuvl.runs_in_flight.waiting IS 'what the run waits for, as JSON: "for" is worker, process, person, decision, resume, timer, children, compensation, concurrency, max_parallel, rate_limit, debounce, llm (or the kind of a later feature''s wait), with key, limit, per, until, step, config, reason, since when they apply';

/* ------------------------------------------------------------------ mcp: elicitation as a person's wait, tasks (issue 40, session 5) */

/*
 * An MCP server's question (mcp.elicitation: ask) parks the run as
 * waiting_human; tuvl.submit() accepts it with the content, tuvl.reject()
 * declines or cancels it.
 */
CREATE FUNCTION tuvl.reject(run_id bigint, action text DEFAULT 'decline')
RETURNS void
AS 'MODULE_PATHNAME', 'tuvl_reject'
LANGUAGE C VOLATILE STRICT;
COMMENT ON FUNCTION tuvl.reject(bigint, text) IS 'decline (action decline) or cancel (action cancel) the question an MCP server asked a run waiting_human at an MCP step';
GRANT EXECUTE ON FUNCTION tuvl.reject(bigint, text) TO tuvl_user;

/* ------------------------------------------------------------------ console: scale (issue 38, session 5) */

/*
 * The console's runs page at 1,000,000 runs (insight/src/console.ts,
 * bench/console.mjs).  Row security's "principal_id = your role OR you are
 * an operator" cannot be an index condition; the console says the first
 * half again for a role that is not an operator, and these make it and
 * the filters index ranges in the list's order (by id, or by creation
 * time when the filter has a time):
 *
 *   runs_principal_idx  a role's ended runs, newest first (a role whose
 *                       runs are all old: 1.0 s to reach them through the
 *                       primary key, 18 ms with it)
 *   runs_status_idx     an end status's runs (and a role's of that
 *                       status), newest first, and counts by status
 *                       (index-only)
 *   runs_created_idx    a time's ended runs, newest first
 *   runs_active_idx     the runs in flight, newest first
 *
 * The first three hold ended runs only, whose rows no longer change: a
 * run enters each once, when it ends, rather than at its insert and at
 * every update that is not HOT (the claim, and each version that finds no
 * room on its page), which cost 200 of the 1,180 bytes of WAL a step made
 * (bench/wal.py).  The runs in flight are the fourth's; the console reads
 * the two sets as two ranges of a UNION ALL, each in the list's order.
 *
 * On an existing database of many runs, building them takes a while (10 s
 * for 1,000,000 runs on a small machine) and blocks writes to tuvl.runs
 * meanwhile; ALTER EXTENSION tuvl UPDATE is best run when it is quiet.
 */
CREATE INDEX runs_principal_idx ON tuvl.runs (principal_id, id)
    WHERE status = ANY ('{completed,failed,aborted,compensated}'::text[]);
CREATE INDEX runs_status_idx ON tuvl.runs (status, principal_id, id) INCLUDE (created_at)
    WHERE status = ANY ('{completed,failed,aborted,compensated}'::text[]);
CREATE INDEX runs_created_idx ON tuvl.runs (created_at, id) INCLUDE (status, principal_id)
    WHERE status = ANY ('{completed,failed,aborted,compensated}'::text[]);
CREATE INDEX runs_active_idx ON tuvl.runs (id)
    WHERE status <> ALL ('{completed,failed,aborted,compensated}'::text[]);

/*
 * Room on every page of tuvl.runs for the next versions of its rows, as
 * 0.2.0 meant with a fillfactor of 50: measured, not enough.  A run's row
 * is small when it is queued (about 120 bytes) and grows with its context,
 * so half a page took some 32 of them, and the runs a claim took together
 * got their new versions on the same pages in the same transactions,
 * while the other worker's snapshot kept the versions before them: about
 * one of a run's four steps moved its row to another page, entering every
 * index (bench/wal.py, 10,000
 * five-step runs: 0.56 updates a step not HOT at 50, 0.41 at 20, which is
 * the claim and the end alone; 1,050 bytes a step against 980).  A fifth
 * of each page at insert costs little room in the end: 10,000 ended runs
 * took 1,304 pages against 1,077 at 50, whose moved versions leave holes
 * (one-step runs, whose rows stay small: 770 against 527); 10,000 queued
 * runs 770 against 313 until they run.  docs/operations.md says how to
 * trade the WAL for room.
 */
ALTER TABLE tuvl.runs SET (fillfactor = 20);

/* ------------------------------------------------------------------ performance: agent turns (issue 43, session 5) */

/* the sweep: keep it the last statements of the script */
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA tuvl FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA tuvl FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA tuvl FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.version(), tuvl.validate(text, boolean), tuvl.render(jsonb, jsonb) TO PUBLIC;
/*
 * ... and what the HTTP front door calls before it knows the caller's role
 * (an authenticator role need not be a tuvl_user): the token and webhook
 * checks, the route lookup, and the scope checks of row security.
 */
GRANT EXECUTE ON FUNCTION tuvl.authenticate(text), tuvl.verify_hook(text, text, text),
    tuvl.http_route(text), tuvl._has_scope(text), tuvl._require_scope(text) TO PUBLIC;
