/*
 * ops.ts: the operations of the API, each a few statements of tuvl's SQL
 * API, run by whoever holds the connection.
 *
 * The server runs them in a request's transaction after authenticating
 * the token (db.ts), the command line on the user's own connection.
 * Nothing here checks a permission: tuvl's functions, grants and row
 * security do, as the role of the connection, with the token's scopes.
 * Where a read would only come back empty for want of a scope (row
 * security hides the rows), the operation asks tuvl._require_scope()
 * first, so the caller learns which scope it lacks.
 */
import pg from "pg";

import { ApiError } from "./errors.js";

/* int8 (run ids, counts) as numbers; timestamps stay Dates. */
pg.types.setTypeParser(20, (v: string) => Number(v));

/* A statement: its text, or a named one (prepared once per connection). */
export type Statement = string | { name: string; text: string };
/* opts.last: the transaction's last statement (a pipelining connection sends the COMMIT with it) */
export type Query = <R = Record<string, unknown>>(sql: Statement, params?: unknown[], opts?: { last?: boolean }) => Promise<R[]>;

export const STATUSES = ["queued", "sleeping", "running", "waiting_human", "waiting_approval", "waiting_children",
                         "paused", "completed", "failed", "aborted", "compensating", "compensated"];
export const FINAL = new Set(["completed", "failed", "aborted", "compensated"]);

/* ------------------------------------------------------------ starting */

export interface StartRequest {
    workflow: string;
    input: unknown;
    key?: string | undefined;
    notBefore?: string | undefined;
    priority?: number | undefined;
    traceparent?: string | undefined;
    debounce?: string | undefined;   /* an interval: coalesce starts of key until it is quiet */
    wait?: string | undefined;       /* an interval, or undefined: the workflow's own */
    maxWait: string;                 /* the server's bound on any wait */
}

export interface StartResult {
    run_id: number;
    status: string;
    end?: string | null;
    response?: unknown;
    error?: string;
    /* a run started with start_run() that the caller wants to wait for */
    waitFor?: string;
}

/*
 * The wait of a start: ?wait=, else the workflow's trigger.http.sync_timeout,
 * else its trigger.sync_timeout (the newest version's), at most maxWait.
 * NULL or 0 means no wait.
 */
const WAIT_SQL = `
    SELECT CASE WHEN w.wait IS NOT NULL THEN LEAST(w.wait, $4::pg_catalog.interval) END AS wait
    FROM (SELECT coalesce($3::pg_catalog.interval,
                 (SELECT coalesce(w.definition OPERATOR(pg_catalog.#>>) '{trigger,http,sync_timeout}',
                                  w.definition OPERATOR(pg_catalog.#>>) '{trigger,sync_timeout}')
                  FROM tuvl.workflows w WHERE w.name OPERATOR(pg_catalog.=) $1
                  ORDER BY w.version DESC LIMIT 1)::pg_catalog.interval) AS wait) w`;

/*
 * Without key, not_before, priority, traceparent or debounce: one statement that
 * either executes the run here with tuvl.run() (the synchronous path)
 * or queues it with tuvl.start_run().
 */
const START_PLAIN_SQL = { name: "tuvl_insight_start", text: `
WITH t AS (${WAIT_SQL})
SELECT CASE WHEN t.wait OPERATOR(pg_catalog.>) '0'::pg_catalog.interval
            THEN tuvl.run($1, $2::pg_catalog.jsonb, t.wait) END AS sync,
       CASE WHEN t.wait IS NULL OR t.wait OPERATOR(pg_catalog.<=) '0'::pg_catalog.interval
            THEN tuvl.start_run($1, $2::pg_catalog.jsonb) END AS run_id
FROM t` };

/* With them: tuvl.start_run() takes them all; a wait is tuvl.wait() after the commit. */
const START_FULL_SQL = `
WITH t AS (${WAIT_SQL})
SELECT tuvl.start_run($1, $2::pg_catalog.jsonb, key => $5, not_before => $6::pg_catalog.timestamptz,
                      priority => coalesce($7::integer, 0), traceparent => $8,
                      debounce => $9::pg_catalog.interval) AS run_id,
       CASE WHEN t.wait OPERATOR(pg_catalog.>) '0'::pg_catalog.interval THEN t.wait::pg_catalog.text END AS wait,
       CASE WHEN $6::pg_catalog.timestamptz OPERATOR(pg_catalog.>) pg_catalog.now() THEN 'sleeping' ELSE 'queued' END AS status
FROM t`;

export async function startRun(q: Query, r: StartRequest): Promise<StartResult> {
    const input = JSON.stringify(r.input ?? {});
    const plain = r.key === undefined && r.notBefore === undefined && r.priority === undefined && r.traceparent === undefined
        && r.debounce === undefined;
    if (plain) {
        const [row] = await q<{ sync: StartResult | null; run_id: number | null }>(
            START_PLAIN_SQL, [r.workflow, input, r.wait ?? null, r.maxWait], { last: true });
        if (row.sync) return row.sync;
        return { run_id: row.run_id as number, status: "queued" };
    }
    const [row] = await q<{ run_id: number; wait: string | null; status: string }>(START_FULL_SQL,
        [r.workflow, input, r.wait ?? null, r.maxWait, r.key ?? null, r.notBefore ?? null, r.priority ?? null, r.traceparent ?? null, r.debounce ?? null]);
    const result: StartResult = { run_id: row.run_id, status: row.status };
    if (r.key !== undefined) {
        /* a key may have found an earlier run: its status, if the token may read it */
        const [s] = await q<{ status: string }>(
            "SELECT status FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1", [row.run_id]);
        if (s) result.status = s.status;
    }
    if (row.wait !== null) result.waitFor = row.wait;
    return result;
}

/* After START_FULL_SQL committed: wait, then the run's outcome (a later statement: a later snapshot). */
export async function waitRun(q: Query, runId: number, wait: string): Promise<StartResult> {
    await q("SELECT tuvl.wait($1, $2::pg_catalog.interval)", [runId, wait]);
    const [row] = await q<{ status: string; end: string | null; response: unknown; error: string | null }>(
        `SELECT r.status, r.end_name AS "end", r.response, r.error
         FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) $1`, [runId]);
    if (!row) return { run_id: runId, status: "queued" };
    const out: StartResult = { run_id: runId, status: row.status, end: row.end, response: row.response };
    if (row.status === "failed" && row.error) out.error = row.error;
    return out;
}

/* ------------------------------------------------------------ reading runs */

export interface RunFilter {
    workflow?: string | undefined;
    status?: string[] | undefined;
    key?: string | undefined;
    before?: number | undefined;
    limit: number;
}

const RUN_SUMMARY = `r.id, r.workflow, r.workflow_version AS version, r.status, r.current_step AS step,
    r.end_name AS "end", r.key, r.priority, r.principal, r.parent_run_id,
    r.created_at, r.started_at, r.finished_at`;

export async function listRuns(q: Query, f: RunFilter): Promise<Record<string, unknown>[]> {
    await q("SELECT tuvl._require_scope('runs:read')");
    return q(`SELECT ${RUN_SUMMARY} FROM tuvl.runs r
              WHERE ($1::text IS NULL OR r.workflow OPERATOR(pg_catalog.=) $1)
                AND ($2::text[] IS NULL OR r.status OPERATOR(pg_catalog.=) ANY ($2::text[]))
                AND ($3::text IS NULL OR r.key OPERATOR(pg_catalog.=) $3)
                AND ($4::bigint IS NULL OR r.id OPERATOR(pg_catalog.<) $4)
              ORDER BY r.id DESC LIMIT $5`,
             [f.workflow ?? null, f.status ?? null, f.key ?? null, f.before ?? null, f.limit]);
}

export async function getRun(q: Query, id: number): Promise<Record<string, unknown>> {
    await q("SELECT tuvl._require_scope('runs:read')");
    const [row] = await q(`SELECT ${RUN_SUMMARY}, r.input, r.context, r.step_state OPERATOR(pg_catalog.->) 'awaiting' AS awaiting,
                                  r.response, r.error, r.attempt, r.wake_at, r.control, r.last_seq
                           FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) $1`, [id]);
    if (!row) throw runMissing(id);
    return row;
}

export function runMissing(id: number): ApiError {
    return new ApiError(404, "42704", `run ${id} does not exist`, {
        hint: "Runs are visible to the role that started them and to members of tuvl_operator.",
    });
}

export interface TimelineRow {
    at_ms: number;
    seq: number;
    step: string | null;
    event: string;
    summary: string | null;
}

export async function timeline(q: Query, id: number): Promise<TimelineRow[]> {
    const rows = await q<TimelineRow>(
        `SELECT (EXTRACT(epoch FROM t.at) OPERATOR(pg_catalog.*) 1000)::float8 AS at_ms,
                t.seq, t.step, t.event, t.summary FROM tuvl.timeline($1) t ORDER BY t.seq`, [id]);
    if (rows.length === 0) throw runMissing(id);
    return rows;
}

/* Events after seq (at most limit), with the run's status read by the same statement. */
export interface EventRow {
    status: string;
    seq: number | null;
    type: string | null;
    data: Record<string, unknown> | null;
}

/* data as json text (the server passes it through) or as json (parsed) */
export function eventsSql(asText: boolean): string {
    return `
SELECT r.status, e.seq, e.type, e.data${asText ? "::text AS data" : ""}
FROM tuvl.runs r
LEFT JOIN LATERAL (
    SELECT e.seq, e.type,
           pg_catalog.json_build_object('run_id', e.run_id, 'seq', e.seq, 'ts', e.ts, 'type', e.type,
               'agent_id', e.agent_id, 'engine', e.engine, 'tokens', e.tokens, 'latency_ms', e.latency_ms,
               'payload', e.payload,
               'summary', tuvl._event_summary(e.type, e.payload, e.tokens, e.latency_ms)) AS data
    FROM tuvl.events e
    WHERE e.run_id OPERATOR(pg_catalog.=) r.id AND e.seq OPERATOR(pg_catalog.>) $2
    ORDER BY e.seq
    LIMIT $3) e ON true
WHERE r.id OPERATOR(pg_catalog.=) $1
ORDER BY e.seq`;
}

/* ------------------------------------------------------------ control and people */

export type Action = "pause" | "resume" | "abort" | "steer" | "submit" | "reject" | "decide";

export interface ControlArgs {
    reason?: string | null;
    message?: string;
    data?: unknown;
    approved?: boolean;
    note?: string | null;
    action?: "decline" | "cancel";
}

const CONTROL_SQL: Record<Action, string> = {
    pause: "SELECT tuvl.pause_run($1)",
    resume: "SELECT tuvl.resume_run($1)",
    abort: "SELECT tuvl.abort_run($1, $2)",
    steer: "SELECT tuvl.steer_run($1, $2)",
    submit: "SELECT tuvl.submit($1, $2::pg_catalog.jsonb)",
    reject: "SELECT tuvl.reject($1, $2)",
    decide: "SELECT tuvl.decide($1, $2, $3)",
};

export async function control(q: Query, action: Action, id: number, a: ControlArgs): Promise<{ run_id: number; status: string | null }> {
    const params: unknown[] = [id];
    if (action === "abort") params.push(a.reason ?? null);
    else if (action === "steer") params.push(a.message);
    else if (action === "submit") params.push(JSON.stringify(a.data));
    else if (action === "reject") params.push(a.action ?? "decline");
    else if (action === "decide") params.push(a.approved, a.note ?? null);
    await q(CONTROL_SQL[action], params);
    const [s] = await q<{ status: string }>("SELECT status FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1", [id]);
    return { run_id: id, status: s ? s.status : null };
}

export async function people(q: Query): Promise<Record<string, unknown>[]> {
    await q("SELECT tuvl._require_scope('runs:read')");
    return q(`SELECT p.run_id, p.workflow, p.status, p.step, p.principal,
                     CASE WHEN p.status OPERATOR(pg_catalog.=) 'waiting_human' THEN 'submit' ELSE 'decide' END AS answer_with,
                     p.awaiting, p.since,
                     pg_catalog.round(EXTRACT(epoch FROM p.age), 3)::float8 AS age_s,
                     p.deadline
              FROM tuvl.people_queue p ORDER BY p.since, p.run_id`);
}

/* ------------------------------------------------------------ fixtures */

export async function pin(q: Query, id: number): Promise<Record<string, unknown>> {
    const [row] = await q<{ f: Record<string, unknown> }>("SELECT tuvl.pin_run($1) AS f", [id]);
    return row.f;
}

/* Replay; the caller rolls its transaction back (the SQL steps' writes with it). */
export async function replay(q: Query, fixture: unknown, live: string[] | null): Promise<Record<string, unknown>> {
    const [row] = await q<{ r: Record<string, unknown> }>(
        "SELECT tuvl.replay($1::pg_catalog.jsonb, $2::text[]) AS r", [JSON.stringify(fixture), live]);
    return row.r;
}

/* ------------------------------------------------------------ workflows */

export interface Finding {
    severity: string;
    path: string;
    message: string;
}

export async function validate(q: Query, source: string, strict: boolean): Promise<Finding[]> {
    return q<Finding>("SELECT severity, path, message FROM tuvl.validate($1, $2)", [source, strict]);
}

/* Validate (strict when asked), then register: the new version, and the warnings. */
export async function ship(q: Query, source: string, strict: boolean): Promise<{ workflow: string; version: number; warnings: Finding[] }> {
    const findings = await validate(q, source, strict);
    const errs = findings.filter((f) => f.severity === "error");
    if (errs.length > 0)
        throw new ApiError(422, "22023", `the workflow has ${errs.length} error${errs.length === 1 ? "" : "s"}`, {
            detail: errs.map((f) => `${f.path}: ${f.message}`).join("\n"),
            hint: "Correct them and ship again; insight/tuvl validate FILE lists them.",
            extra: { findings },
        });
    const [row] = await q<{ version: number }>("SELECT tuvl.register_workflow($1) AS version", [source]);
    /* a later statement sees the new version (the one that made it does not) */
    const [named] = await q<{ name: string }>(
        `SELECT w.name FROM tuvl.workflows w
         WHERE w.version OPERATOR(pg_catalog.=) $2 AND w.source OPERATOR(pg_catalog.=) $1
         ORDER BY w.created_at DESC LIMIT 1`, [source, row.version]);
    return { workflow: named?.name ?? "", version: row.version, warnings: findings.filter((f) => f.severity !== "error") };
}

/* ------------------------------------------------------------ tokens */

export async function listTokens(q: Query): Promise<Record<string, unknown>[]> {
    await q("SELECT tuvl._require_scope('admin')");
    return q(`SELECT t.id, t.role::text AS role, t.scopes, t.created_at, t.expires_at, t.last_used_at, t.revoked_at
              FROM tuvl.tokens t ORDER BY t.id`);
}

export async function createToken(q: Query, role: string, scopes: string[], expires: string | null | undefined): Promise<{ id: number; token: string }> {
    const rows = expires === undefined
        ? await q<{ token: string }>("SELECT tuvl.create_token($1::pg_catalog.regrole, $2::text[]) AS token", [role, scopes])
        : await q<{ token: string }>("SELECT tuvl.create_token($1::pg_catalog.regrole, $2::text[], $3::pg_catalog.interval) AS token",
                                     [role, scopes, expires]);
    const token = rows[0].token;
    return { id: Number(token.split("_")[1]), token };
}

export async function revokeToken(q: Query, id: number): Promise<void> {
    await q("SELECT tuvl.revoke_token($1)", [id]);
}

/* ------------------------------------------------------------ routes of workflows */

export interface WorkflowInfo {
    name: string;
    version: number;
    description: string | null;
    trigger: Record<string, unknown> | null;
}

export async function workflows(q: Query): Promise<{ version: string; workflows: WorkflowInfo[] }> {
    const rows = await q<WorkflowInfo>(
        `SELECT w.name, w.version, w.definition OPERATOR(pg_catalog.->>) 'description' AS description,
                w.definition OPERATOR(pg_catalog.->) 'trigger' AS trigger
         FROM tuvl.workflows w
         WHERE w.version OPERATOR(pg_catalog.=) (SELECT pg_catalog.max(x.version) FROM tuvl.workflows x
                                                WHERE x.name OPERATOR(pg_catalog.=) w.name)
         ORDER BY w.name`);
    const [v] = await q<{ v: string }>("SELECT tuvl.version() AS v");
    return { version: v.v, workflows: rows };
}
