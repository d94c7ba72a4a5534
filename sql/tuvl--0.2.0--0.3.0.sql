/* tuvl--0.2.0--0.3.0.sql: the changes of release 0.3.0 */

\echo Use "ALTER EXTENSION tuvl UPDATE TO '0.3.0'" to load this file. \quit

/* ------------------------------------------------------------------ hardening: runs */

/* ------------------------------------------------------------------ hardening: names */

/* ------------------------------------------------------------------ hardening: locks and privileges */

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

/* the sweep: keep it the last statements of the script */
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA tuvl FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA tuvl FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA tuvl FROM PUBLIC;
GRANT EXECUTE ON FUNCTION tuvl.version(), tuvl.validate(text, boolean), tuvl.render(jsonb, jsonb) TO PUBLIC;
