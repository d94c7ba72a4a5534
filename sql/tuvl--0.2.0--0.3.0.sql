/* tuvl--0.2.0--0.3.0.sql: the changes of release 0.3.0 */

\echo Use "ALTER EXTENSION tuvl UPDATE TO '0.3.0'" to load this file. \quit

/* ------------------------------------------------------------------ hardening: runs */

/* ------------------------------------------------------------------ hardening: names */

/* ------------------------------------------------------------------ hardening: locks and privileges */

/* ------------------------------------------------------------------ hardening: notifications, metrics, pictures */

/* ------------------------------------------------------------------ hardening: bounded work */

/* Nothing in SQL: the bounds are in the C code (step_sql.c, agent.c, jsonschema.c, llm.c). */
