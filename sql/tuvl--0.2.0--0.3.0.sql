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

/* ------------------------------------------------------------------ hardening: bounded work */

/* Nothing in SQL: the bounds are in the C code (step_sql.c, agent.c, jsonschema.c, llm.c). */
