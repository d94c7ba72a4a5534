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

/* ------------------------------------------------------------------ hardening: locks and privileges */

/* ------------------------------------------------------------------ hardening: notifications, metrics, pictures */
