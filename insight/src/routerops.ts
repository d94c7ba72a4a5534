/*
 * routerops.ts: the operations of ops.ts through a router database
 * (tuvl_router over PL/Proxy, docs/scaling.md), for `insight/tuvl serve
 * --db <router database>`.
 *
 * A router has no tuvl schema: its functions and views have tuvl's names
 * in schema tuvl_router and route each call to the run's partition (run
 * ids tell it), or to every partition.  The token's scopes are the
 * router's (tuvl_router.authenticate() recorded them for the transaction,
 * tuvl_router._require_scope() checks them); the calls run on the
 * partitions as the token's role, whose privileges and row security there
 * decide the rest.  What a router does not route (the workflows' routes
 * under /hooks, validation, shipping, fixtures and replay, tokens over
 * HTTP, the OpenAPI document) is answered 501.
 */
import { ApiError } from "./errors.js";
import type { Action, ControlArgs, Query, RunFilter, StartRequest, StartResult, TimelineRow } from "./ops.js";
import { runMissing } from "./ops.js";

/* How a router database is told from a tuvl one. */
export const DETECT_SQL = `SELECT pg_catalog.to_regnamespace('tuvl_router') IS NOT NULL
                                  AND pg_catalog.to_regnamespace('tuvl') IS NULL AS router`;

export function notOnRouter(what: string): ApiError {
    return new ApiError(501, "0A000", `${what} is not available through a router`, {
        hint: "Connect the server (or psql) to a partition for it; docs/insight.md, \"On a router\".",
    });
}

const RUN_SUMMARY = `r.id, r.workflow, r.version, r.status, r.step, r.end_name AS "end", r.key, r.priority,
    r.principal, r.parent_run_id, r.created_at, r.started_at, r.finished_at`;

/* The start, and the wait it asked for: ?wait= only (a workflow's sync_timeout is its partitions'), at most --max-wait. */
export async function startRun(q: Query, r: StartRequest): Promise<StartResult> {
    await q("SELECT tuvl_router._require_scope('runs:start')");
    const [row] = await q<{ run_id: number; status: string; wait: string | null }>(
        `SELECT tuvl_router.start_run($1, $2::pg_catalog.jsonb, key => $3, not_before => $4::pg_catalog.timestamptz,
                                      priority => coalesce($5::integer, 0), traceparent => $6,
                                      debounce => $9::pg_catalog.interval) AS run_id,
                CASE WHEN $4::pg_catalog.timestamptz OPERATOR(pg_catalog.>) pg_catalog.now() THEN 'sleeping' ELSE 'queued' END AS status,
                CASE WHEN $7::pg_catalog.interval OPERATOR(pg_catalog.>) '0'::pg_catalog.interval
                     THEN LEAST($7::pg_catalog.interval, $8::pg_catalog.interval)::text END AS wait`,
        [r.workflow, JSON.stringify(r.input ?? {}), r.key ?? null, r.notBefore ?? null, r.priority ?? null, r.traceparent ?? null,
         r.wait ?? null, r.maxWait, r.debounce ?? null],
        { last: true });
    const result: StartResult = { run_id: row.run_id, status: row.status };
    if (row.wait !== null) result.waitFor = row.wait;
    return result;
}

export async function waitRun(q: Query, runId: number, wait: string): Promise<StartResult> {
    await q("SELECT tuvl_router.wait($1, $2::pg_catalog.interval)", [runId, wait]);
    const [row] = await q<{ status: string; end: string | null; response: unknown; error: string | null }>(
        `SELECT r.status, r.end_name AS "end", r.response, r.error FROM tuvl_router.get_run($1) r`, [runId]);
    if (!row) return { run_id: runId, status: "queued" };
    const out: StartResult = { run_id: runId, status: row.status, end: row.end, response: row.response };
    if (row.status === "failed" && row.error) out.error = row.error;
    return out;
}

export async function listRuns(q: Query, f: RunFilter): Promise<Record<string, unknown>[]> {
    await q("SELECT tuvl_router._require_scope('runs:read')");
    return q(`SELECT ${RUN_SUMMARY} FROM tuvl_router.list_runs($1, $2::text[], $3, $4, $5) r ORDER BY r.id DESC`,
             [f.workflow ?? null, f.status ?? null, f.key ?? null, f.before ?? null, f.limit]);
}

export async function getRun(q: Query, id: number): Promise<Record<string, unknown>> {
    await q("SELECT tuvl_router._require_scope('runs:read')");
    const [row] = await q(`SELECT ${RUN_SUMMARY}, r.input, r.context, r.awaiting, r.response, r.error, r.attempt,
                                  r.wake_at, r.control, r.last_seq
                           FROM tuvl_router.get_run($1) r`, [id]);
    if (!row) throw runMissing(id);
    return row;
}

export async function timeline(q: Query, id: number): Promise<TimelineRow[]> {
    await q("SELECT tuvl_router._require_scope('runs:read')");
    const rows = await q<TimelineRow>(
        `SELECT (EXTRACT(epoch FROM t.at) OPERATOR(pg_catalog.*) 1000)::float8 AS at_ms,
                t.seq, t.step, t.event, t.summary FROM tuvl_router.timeline($1) t ORDER BY t.seq`, [id]);
    if (rows.length === 0) throw runMissing(id);
    return rows;
}

const CONTROL_SQL: Record<Action, [string, string]> = {
    pause: ["runs:control", "SELECT tuvl_router.pause_run($1)"],
    resume: ["runs:control", "SELECT tuvl_router.resume_run($1)"],
    abort: ["runs:control", "SELECT tuvl_router.abort_run($1, $2)"],
    steer: ["runs:control", "SELECT tuvl_router.steer_run($1, $2)"],
    submit: ["people:answer", "SELECT tuvl_router.submit($1, $2::pg_catalog.jsonb)"],
    reject: ["people:answer", "SELECT tuvl_router.reject($1, $2)"],
    decide: ["people:answer", "SELECT tuvl_router.decide($1, $2, $3)"],
};

export async function control(q: Query, action: Action, id: number, a: ControlArgs): Promise<{ run_id: number; status: string | null }> {
    const params: unknown[] = [id];
    if (action === "abort") params.push(a.reason ?? null);
    else if (action === "steer") params.push(a.message);
    else if (action === "submit") params.push(JSON.stringify(a.data));
    else if (action === "reject") params.push(a.action ?? "decline");
    else if (action === "decide") params.push(a.approved, a.note ?? null);
    const [scope, sql] = CONTROL_SQL[action];
    await q("SELECT tuvl_router._require_scope($1)", [scope]);
    await q(sql, params);
    const [s] = await q<{ status: string }>("SELECT r.status FROM tuvl_router.get_run($1) r", [id]);
    return { run_id: id, status: s ? s.status : null };
}

export async function people(q: Query): Promise<Record<string, unknown>[]> {
    await q("SELECT tuvl_router._require_scope('runs:read')");
    return q(`SELECT p.run_id, p.workflow, p.status, p.step, p.principal,
                     CASE WHEN p.status OPERATOR(pg_catalog.=) 'waiting_human' THEN 'submit' ELSE 'decide' END AS answer_with,
                     p.awaiting, p.since,
                     pg_catalog.round(EXTRACT(epoch FROM p.age), 3)::float8 AS age_s,
                     p.deadline
              FROM tuvl_router.people_queue p ORDER BY p.since, p.run_id`);
}

/* Before a stream: the scope, no channel (a router has no notifications), the run. */
export const STREAM_SQL = {
    name: "tuvl_insight_stream_router",
    text: `SELECT tuvl_router._require_scope('runs:read'), NULL::text AS channel, r.status, r.last_seq
           FROM (SELECT 1) one LEFT JOIN tuvl_router.get_run($1) r ON true`,
};

/* The events after q.after of each run q.run_id, at most $4 each, with the runs' statuses, from their partitions. */
export const BATCH_SQL = `
SELECT q.i, e.status, e.seq, e.type, e.data
FROM ROWS FROM (pg_catalog.unnest($1::bigint[]), pg_catalog.unnest($2::integer[]), pg_catalog.unnest($3::boolean[]))
     WITH ORDINALITY AS q(run_id, after, summary, i)
LEFT JOIN LATERAL tuvl_router.events_after(q.run_id, q.after, $4, q.summary) e ON true
ORDER BY q.i, e.seq`;

/* The CLI's follow through a router: the events after $2 (at most $3), with the summary. */
export const EVENTS_SQL = `
SELECT e.status, e.seq, e.type, e.data::pg_catalog.json AS data
FROM tuvl_router.events_after($1, $2, $3, true) e ORDER BY e.seq`;
