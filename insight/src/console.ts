/*
 * console.ts: the web console (insight/console/), served at /console, and
 * the few reads it needs beyond the API, under /api/console/.
 *
 * Sign-in, without any state in the server:
 *
 *  - With a role and its password: the server opens a connection as that
 *    role with that password, so PostgreSQL itself checks the password
 *    (SCRAM, as pg_hba.conf says), and on that connection the role makes
 *    itself an API token (tuvl.create_token(), every scope, 12 hours),
 *    then the connection closes.  From then on the person is that token.
 *  - With an API token: checked by tuvl.authenticate() as any request is.
 *
 * The token travels in a cookie (HttpOnly, SameSite=Strict, Path=/,
 * Secure over HTTPS) that scripts in the page cannot read.  A request
 * with the cookie and no Authorization header is a request of that token
 * (this file's onRequest hook turns the one into the other), so every
 * permission stays the database's: a person sees and may do exactly what
 * their role may in SQL, within the token's scopes.  A request that
 * changes something (any method but GET and HEAD) must also carry the
 * header X-CSRF-Token with the value the sign-in returned (a SHA-256 of
 * the token, which another site can neither read nor compute), and, when
 * the browser sends Origin, come from the server's own origin.  Signing
 * out revokes a token that a password sign-in made, and clears the
 * cookie.
 */
import { createHash, timingSafeEqual } from "node:crypto";
import { existsSync, readFileSync, statSync } from "node:fs";
import { dirname, extname, join, normalize } from "node:path";
import { fileURLToPath } from "node:url";

import pg from "pg";
import type { ConnSettings } from "./conninfo.js";
import { connectFirst } from "./target.js";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";

import type { Database } from "./db.js";
import { wellFormedToken } from "./db.js";
import { ApiError, errors, toApiError } from "./errors.js";
import * as ops from "./ops.js";

const COOKIE = "tuvl_session";
const SESSION_HOURS = 12;
const ALL_SCOPES = ["runs:start", "runs:read", "runs:control", "people:answer", "workflows:write", "admin"];
/* a text filter looks at this many of the newest runs the other filters select */
export const TEXT_WINDOW = 20_000;

type Q = ops.Query;
type Row = Record<string, unknown>;

export interface ConsoleOptions {
    db: ConnSettings;
    authDelayMs: number;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export function csrfOf(token: string): string {
    return createHash("sha256").update("tuvl console csrf\0" + token).digest("base64url");
}

function cookies(req: FastifyRequest): Record<string, string> {
    const out: Record<string, string> = {};
    for (const part of (req.headers.cookie ?? "").split(";")) {
        const i = part.indexOf("=");
        if (i > 0) out[part.slice(0, i).trim()] = decodeURIComponent(part.slice(i + 1).trim());
    }
    return out;
}

/* The session cookie's value: "p." (made by a password sign-in) or "t." and the token. */
function session(req: FastifyRequest): { token: string; minted: boolean } | null {
    const v = cookies(req)[COOKIE];
    if (!v || v.length < 3 || (v[0] !== "p" && v[0] !== "t") || v[1] !== ".") return null;
    const token = v.slice(2);
    if (!wellFormedToken(token)) return null;
    return { token, minted: v[0] === "p" };
}

function sameText(a: string, b: string): boolean {
    const x = Buffer.from(a);
    const y = Buffer.from(b);
    return x.length === y.length && timingSafeEqual(x, y);
}

function setCookie(req: FastifyRequest, reply: FastifyReply, value: string, maxAge: number): void {
    const secure = req.protocol === "https" ? "; Secure" : "";
    reply.header("Set-Cookie", `${COOKIE}=${encodeURIComponent(value)}; Path=/; HttpOnly; SameSite=Strict; Max-Age=${maxAge}${secure}`);
}

function positive(text: string | undefined, what: string): number | undefined {
    if (text === undefined || text === "") return undefined;
    if (!/^[0-9]{1,18}$/.test(text) || Number(text) <= 0) throw errors.badRequest(`${what} must be a positive integer`);
    return Number(text);
}

function queryOf(req: FastifyRequest): Record<string, string | undefined> {
    const q = (req.query ?? {}) as Record<string, unknown>;
    const out: Record<string, string | undefined> = {};
    for (const [k, v] of Object.entries(q)) out[k] = Array.isArray(v) ? String(v[v.length - 1]) : v === undefined ? undefined : String(v);
    return out;
}

function bodyOf(req: FastifyRequest): Row {
    const raw = typeof req.body === "string" ? req.body : "";
    if (raw.trim() === "") return {};
    let v: unknown;
    try {
        v = JSON.parse(raw);
    } catch (e) {
        throw errors.badJson((e as Error).message);
    }
    if (v === null || typeof v !== "object" || Array.isArray(v)) throw errors.badRequest("the request body must be a JSON object");
    return v as Row;
}

/* ------------------------------------------------------------ the reads */

export interface ConsoleRunFilter {
    workflow?: string | undefined;
    status?: string[] | undefined;
    key?: string | undefined;
    from?: string | undefined;
    to?: string | undefined;
    text?: string | undefined;
    before?: number | undefined;
    limit: number;
}

/*
 * The runs page: newest first, by id (keyset paging: a page is one index
 * range however many runs there are); text is searched in the input and
 * the response.  Parameters: $1 workflow, $2 statuses, $3 key, $4 from,
 * $5 to, $6 text, $7 before (an id), $8 the limit, $9 the caller's own
 * role unless it is a member of tuvl_operator (NULL: every role's).
 *
 * Row security decides what the caller sees, whatever these say; $9 only
 * says again what row security implies for a role that is not an
 * operator (its own runs), as a condition the planner can use with an
 * index (runs_principal_idx, runs_status_idx), where the policy's OR of
 * the two cases cannot.  With the values known when the statement is
 * planned (an unnamed statement: a custom plan), the filters that are
 * NULL fold away and the planner chooses among the primary key,
 * runs_status_idx, runs_workflow_idx and runs_created_idx by the
 * values it is given.
 *
 * Those three indexes hold ended runs only (a run enters them once, when
 * it ends, not at every write of its row while it runs: the WAL of a
 * step), and runs_active_idx the runs in flight: the list reads the ended
 * runs and the runs in flight as two branches of a UNION ALL, each in the
 * list's order up to the limit, each branch's condition the predicate of
 * its indexes (see from()), and takes the first of both.
 */
const FILTERS = `
    ($1::text IS NULL OR r.workflow OPERATOR(pg_catalog.=) $1)
    AND ($3::text IS NULL OR r.key OPERATOR(pg_catalog.=) $3)
    AND ($4::timestamptz IS NULL OR r.created_at OPERATOR(pg_catalog.>=) $4::timestamptz)
    AND ($5::timestamptz IS NULL OR r.created_at OPERATOR(pg_catalog.<) $5::timestamptz)
    AND ($9::pg_catalog.oid IS NULL OR r.principal_id OPERATOR(pg_catalog.=) $9::pg_catalog.oid)`;

const STATUS_WHERE = `($2::text[] IS NULL OR r.status OPERATOR(pg_catalog.=) ANY ($2::text[]))`;

const TEXT_WHERE = `($6::text IS NULL OR pg_catalog.strpos(pg_catalog.lower(r.input::text), pg_catalog.lower($6)) OPERATOR(pg_catalog.>) 0
         OR pg_catalog.strpos(pg_catalog.lower(coalesce(r.response::text, '')), pg_catalog.lower($6)) OPERATOR(pg_catalog.>) 0)`;

/* the filters but the text, and the page: where a text search looks */
const WINDOW_WHERE = `${FILTERS} AND ${STATUS_WHERE}
    AND ($7::bigint IS NULL OR r.id OPERATOR(pg_catalog.<) $7)
    AND ($6::text IS NULL OR true) AND ($8::integer IS NULL OR true)`;

/*
 * With a time (from, to), newest first by creation time, and the page
 * after the run $7 in that order: an index range of runs_created_idx.
 * Ordered by id, the planner would read the primary key backwards from
 * the newest run until it reached the time (it takes the runs of a time
 * to be spread evenly among the ids): 500 ms to reach ten hours back in
 * 1,000,000 runs.
 */
const WINDOW_WHERE_BY_TIME = `${FILTERS} AND ${STATUS_WHERE}
    AND ($7::bigint IS NULL
         OR ROW(r.created_at, r.id) OPERATOR(pg_catalog.<)
            ROW((SELECT b.created_at FROM tuvl.runs b WHERE b.id OPERATOR(pg_catalog.=) $7), $7))
    AND ($6::text IS NULL OR true) AND ($8::integer IS NULL OR true)`;

/* the order of the list and where it goes on: by id, or by time when the filter has one */
function order(f: ConsoleRunFilter): { where: string; by: string } {
    return f.from !== undefined || f.to !== undefined
        ? { where: WINDOW_WHERE_BY_TIME, by: "r.created_at DESC, r.id DESC" }
        : { where: WINDOW_WHERE, by: "r.id DESC" };
}

/* the ended statuses, as the predicates of the console's indexes name them (sql/tuvl--0.2.0--0.3.0.sql) */
const ENDED_SQL = "'{completed,failed,aborted,compensated}'::pg_catalog.text[]";
const ENDED_WHERE = `r.status OPERATOR(pg_catalog.=) ANY (${ENDED_SQL})`;
const ACTIVE_WHERE = `r.status OPERATOR(pg_catalog.<>) ALL (${ENDED_SQL})`;

/* the list's columns; a text search reads the input and the response too */
const LIST_COLUMNS = `r.id, r.workflow, r.workflow_version, r.status, r.current_step, r.end_name, r.key, r.principal,
    r.parent_run_id, r.created_at, r.started_at, r.finished_at, r.last_seq`;
const TEXT_COLUMNS = `${LIST_COLUMNS}, r.input, r.response`;

/*
 * The runs the filter selects, the first limit of them in the list's
 * order, as a derived table r of columns: the ended runs and the runs in
 * flight, each a branch in that order up to the limit (the branch whose
 * statuses the filter leaves out is not there).  Each branch states the
 * predicate of its indexes, so that the planner may use them whatever
 * else the filter says.
 */
function from(f: ConsoleRunFilter, columns: string, limit: string): string {
    const o = order(f);
    const ended = f.status === undefined || f.status.some((s) => ops.FINAL.has(s));
    const active = f.status === undefined || f.status.some((s) => !ops.FINAL.has(s));
    const branch = (which: string) => `(SELECT ${columns} FROM tuvl.runs r WHERE ${o.where} AND ${which}
                                        ORDER BY ${o.by} LIMIT ${limit})`;
    const branches = [...(ended ? [branch(ENDED_WHERE)] : []), ...(active ? [branch(ACTIVE_WHERE)] : [])];
    return `(${branches.join(" UNION ALL ")}) r`;
}

/* counts by status stop at this many runs of a status */
export const COUNT_CAP = 50_000;

/*
 * The caller's own role for $9: NULL for a member of tuvl_operator (row
 * security shows it every role's runs), and the scope's check.
 */
async function ownRole(q: Q): Promise<number | null> {
    const [r] = await q<{ own: number | null }>(
        `SELECT tuvl._require_scope('runs:read'),
                CASE WHEN pg_catalog.pg_has_role('tuvl_operator', 'USAGE') THEN NULL
                     ELSE (SELECT a.oid::pg_catalog.int8 FROM pg_catalog.pg_roles a
                           WHERE a.rolname OPERATOR(pg_catalog.=) CURRENT_USER) END AS own`);
    return r.own === null ? null : Number(r.own);
}

function params(f: ConsoleRunFilter, own: number | null, before: number | null, limit: number | null): unknown[] {
    return [f.workflow ?? null, f.status ?? null, f.key ?? null, f.from ?? null, f.to ?? null, f.text ?? null,
            before, limit, own];
}

/* Where the text window of a search ended (null: it reached the oldest run). */
export async function consoleTextWindowEnd(q: Q, f: ConsoleRunFilter): Promise<number | null> {
    const own = await ownRole(q);
    const o = order(f);
    const [w] = await q<{ last: number | null }>(
        `SELECT (pg_catalog.array_agg(x.id ORDER BY x.n DESC))[1] AS last
         FROM (SELECT r.id, pg_catalog.row_number() OVER (ORDER BY ${o.by}) AS n
               FROM ${from(f, "r.id, r.created_at", String(TEXT_WINDOW))}
               ORDER BY ${o.by} LIMIT ${TEXT_WINDOW}) x
         HAVING pg_catalog.count(*) OPERATOR(pg_catalog.=) ${TEXT_WINDOW}`, params(f, own, f.before ?? null, null));
    return w?.last ?? null;
}

export async function consoleRuns(q: Q, f: ConsoleRunFilter): Promise<Row[]> {
    const own = await ownRole(q);
    /*
     * Text is searched among the TEXT_WINDOW newest runs (before the page)
     * that the other filters select: a text found in no run would
     * otherwise read every run's input and response.
     */
    const o = order(f);
    const columns = `r.id, r.workflow, r.workflow_version AS version, r.status, r.current_step AS step,
                     r.end_name AS "end", r.key, r.principal, r.parent_run_id, r.created_at, r.started_at,
                     r.finished_at, r.last_seq`;
    if (f.text === undefined)
        return q(`SELECT ${columns} FROM ${from(f, LIST_COLUMNS, "$8")}
                  ORDER BY ${o.by} LIMIT $8`, params(f, own, f.before ?? null, f.limit));
    return q(`SELECT ${columns}
              FROM (SELECT r.* FROM ${from(f, TEXT_COLUMNS, String(TEXT_WINDOW))}
                    ORDER BY ${o.by} LIMIT ${TEXT_WINDOW}) r
              WHERE ${TEXT_WHERE}
              ORDER BY ${o.by} LIMIT $8`, params(f, own, f.before ?? null, f.limit));
}

export interface Counts {
    counts: Record<string, number>;
    /* the statuses whose count stopped at cap: at least that many */
    capped: string[];
    cap: number;
    /* with a text: the counts are of the runs among the newest window the other filters select */
    window?: number;
}

/*
 * Counts by status of the runs the filter selects: each status counted on
 * its own, up to COUNT_CAP (then "at least"), by a statement of one
 * branch a status with the status as a value the planner sees, so that a
 * rare status is an index range (runs_status_idx) and a common one stops
 * at the cap; with a text, among the TEXT_WINDOW newest runs the other
 * filters select (as the list searches).  Exact whatever the table's
 * size, and what row security lets the caller see, no more.
 */
export async function consoleCounts(q: Q, f: ConsoleRunFilter): Promise<Counts> {
    const own = await ownRole(q);
    const counts: Record<string, number> = {};
    if (f.text !== undefined) {
        const rows = await q<{ status: string; n: number }>(
            `SELECT r.status, pg_catalog.count(*) AS n
             FROM (SELECT r.status, r.input, r.response FROM ${from(f, TEXT_COLUMNS, String(TEXT_WINDOW))}
                   ORDER BY ${order(f).by} LIMIT ${TEXT_WINDOW}) r
             WHERE ${TEXT_WHERE}
             GROUP BY r.status`, params(f, own, null, null));
        for (const r of rows) counts[r.status] = Number(r.n);
        return { counts, capped: [], cap: COUNT_CAP, window: TEXT_WINDOW };
    }
    const statuses = f.status ?? ops.STATUSES;
    /* each branch states the predicate of the indexes that hold its status */
    const branches = statuses.map((s, i) => `
        SELECT $${10 + i}::text AS status,
               (SELECT pg_catalog.count(*) FROM (SELECT FROM tuvl.runs r
                                                  WHERE r.status OPERATOR(pg_catalog.=) $${10 + i}::text
                                                    AND ${ops.FINAL.has(s) ? ENDED_WHERE : ACTIVE_WHERE} AND ${FILTERS}
                                                  LIMIT $8) x) AS n`);
    const rows = await q<{ status: string; n: number }>(
        `SELECT c.status, c.n FROM (${branches.join(" UNION ALL ")}) c
         WHERE c.n OPERATOR(pg_catalog.>) 0 AND ($2::text[] IS NULL OR true) AND ($6::text IS NULL OR true)
               AND ($7::bigint IS NULL OR true)`,
        [...params(f, own, null, COUNT_CAP), ...statuses]);
    const capped: string[] = [];
    for (const r of rows) {
        counts[r.status] = Number(r.n);
        if (Number(r.n) >= COUNT_CAP) capped.push(r.status);
    }
    return { counts, capped, cap: COUNT_CAP };
}

/* A run for its page: the run, its parent and children, its workflow's graph and breakpoints. */
export async function consoleRun(q: Q, id: number): Promise<Row> {
    const run = await ops.getRun(q, id);
    const [parent] = await q(`SELECT r.id, r.workflow, r.status FROM tuvl.runs r
                              WHERE r.id OPERATOR(pg_catalog.=) $1`, [run.parent_run_id ?? null]);
    const children = await q(`SELECT r.id, r.workflow, r.status, r.current_step AS step, r.created_at
                              FROM tuvl.runs r WHERE r.parent_run_id OPERATOR(pg_catalog.=) $1
                              ORDER BY r.id LIMIT 500`, [id]);
    let graph: string | null = null;
    const [wf] = await q<{ source: string; steps: unknown }>(
        `SELECT w.source, w.definition OPERATOR(pg_catalog.->) 'steps' AS steps FROM tuvl.workflows w
         WHERE w.name OPERATOR(pg_catalog.=) $1 AND w.version OPERATOR(pg_catalog.=) $2`, [run.workflow, run.version]);
    try {
        await q("SAVEPOINT graph");
        [{ graph }] = await q<{ graph: string }>("SELECT tuvl.graph($1, 'dot') AS graph", [run.workflow]);
        await q("RELEASE SAVEPOINT graph");
    } catch {
        await q("ROLLBACK TO SAVEPOINT graph");
    }
    const breakpoints = await q<{ step: string }>(
        `SELECT b.step FROM tuvl.breakpoints b WHERE b.workflow OPERATOR(pg_catalog.=) $1 ORDER BY b.step`, [run.workflow]);
    return {
        run, parent: parent ?? null, children, graph, source: wf?.source ?? null,
        steps: Array.isArray(wf?.steps) ? (wf.steps as Row[]).map((s) => ({ id: s.id, kind: s.kind })) : [],
        breakpoints: breakpoints.map((b) => b.step),
    };
}

/*
 * A run's whole journal for its page, in one read: the events as the
 * event stream sends them (without summaries), aggregated to JSON text by
 * the database and passed through as it is, and the seq the stream goes
 * on from.  The page renders it once and then follows the stream after
 * last_seq, instead of taking a long run's journal from the stream in
 * pages and rendering at each.
 */
export async function consoleJournal(q: Q, id: number): Promise<string> {
    await q("SELECT tuvl._require_scope('runs:read')");
    const [row] = await q<{ body: string | null }>(
        `SELECT pg_catalog.json_build_object('run_id', r.id, 'status', r.status, 'last_seq', r.last_seq,
                    'events', coalesce((SELECT pg_catalog.json_agg(pg_catalog.json_build_object(
                                 'run_id', e.run_id, 'seq', e.seq, 'ts', e.ts, 'type', e.type, 'agent_id', e.agent_id,
                                 'engine', e.engine, 'tokens', e.tokens, 'latency_ms', e.latency_ms, 'payload', e.payload)
                               ORDER BY e.seq)
                         FROM tuvl.events e WHERE e.run_id OPERATOR(pg_catalog.=) r.id), '[]'::pg_catalog.json))::text AS body
         FROM tuvl.runs r WHERE r.id OPERATOR(pg_catalog.=) $1`, [id]);
    if (!row?.body) throw ops.runMissing(id);
    return row.body;
}

export async function consoleWorkflows(q: Q): Promise<Row[]> {
    return q(`SELECT w.name, pg_catalog.max(w.version) AS version, pg_catalog.count(*) AS versions,
                     (pg_catalog.array_agg(w.owner::text ORDER BY w.version DESC))[1] AS owner,
                     pg_catalog.max(w.created_at) AS updated_at,
                     (pg_catalog.array_agg(w.definition OPERATOR(pg_catalog.->>) 'description' ORDER BY w.version DESC))[1] AS description
              FROM tuvl.workflows w GROUP BY w.name ORDER BY w.name`);
}

export async function consoleWorkflow(q: Q, name: string, version: number | undefined): Promise<Row> {
    const versions = await q(`SELECT w.version, w.owner::text AS owner, w.created_at FROM tuvl.workflows w
                              WHERE w.name OPERATOR(pg_catalog.=) $1 ORDER BY w.version DESC`, [name]);
    if (versions.length === 0)
        throw new ApiError(404, "42704", `workflow "${name.slice(0, 80)}" does not exist`, { hint: "Register it with tuvl.register_workflow()." });
    const v = version ?? Number(versions[0].version);
    const [w] = await q<{ source: string; steps: unknown }>(
        `SELECT w.source, w.definition OPERATOR(pg_catalog.->) 'steps' AS steps FROM tuvl.workflows w
         WHERE w.name OPERATOR(pg_catalog.=) $1 AND w.version OPERATOR(pg_catalog.=) $2`, [name, v]);
    if (!w) throw new ApiError(404, "42704", `workflow "${name.slice(0, 80)}" has no version ${v}`);
    const [{ graph }] = await q<{ graph: string }>("SELECT tuvl.graph($1, 'dot') AS graph", [name]);
    const breakpoints = await q<{ step: string }>(
        `SELECT b.step FROM tuvl.breakpoints b WHERE b.workflow OPERATOR(pg_catalog.=) $1 ORDER BY b.step`, [name]);
    return {
        name, version: v, versions, source: w.source, graph,
        steps: Array.isArray(w.steps) ? (w.steps as Row[]).map((s) => ({ id: s.id, kind: s.kind })) : [],
        breakpoints: breakpoints.map((b) => b.step),
    };
}

export async function consoleMetrics(q: Q): Promise<Row[]> {
    await q("SELECT tuvl._require_scope('runs:read')");
    return q("SELECT m.name, m.kind, m.labels, m.value FROM tuvl.metrics m ORDER BY m.name, m.labels::text");
}

export async function consoleWorkers(q: Q): Promise<Row[]> {
    return q(`SELECT w.pid, w.database, w.worker, w.runs_held, w.transfers_in_flight, w.peak_transfers_in_flight,
                     w.heartbeat, EXTRACT(epoch FROM w.since_heartbeat)::float8 AS since_heartbeat_s, w.state
              FROM tuvl.workers w ORDER BY w.pid`);
}

/* ------------------------------------------------------------ static files */

const TYPES: Record<string, string> = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml", ".png": "image/png", ".json": "application/json", ".ico": "image/x-icon",
    ".woff2": "font/woff2", ".map": "application/json",
};

/* insight/console/dist, beside insight/dist where this file is built to */
export function consoleDir(): string {
    return join(dirname(fileURLToPath(import.meta.url)), "..", "console", "dist");
}

/* ------------------------------------------------------------ the routes */

export function registerConsole(app: FastifyInstance, db: Database, opts: ConsoleOptions): void {
    const root = consoleDir();

    /* a request with the session cookie and no Authorization header is the cookie's token's */
    app.addHook("onRequest", async (req) => {
        if (req.headers.authorization || !req.url.startsWith("/api/")) return;
        const s = session(req);
        if (!s) return;
        if (req.method !== "GET" && req.method !== "HEAD") {
            const sent = req.headers["x-csrf-token"];
            if (typeof sent !== "string" || !sameText(sent, csrfOf(s.token)))
                throw new ApiError(403, "42501", "the request has no valid CSRF token",
                                   { hint: "Requests of the console send the X-CSRF-Token header its sign-in returned." });
            const origin = req.headers.origin;
            if (origin && origin !== "null" && new URL(origin).host !== req.headers.host)
                throw new ApiError(403, "42501", "the request comes from another site");
        }
        req.headers.authorization = `Bearer ${s.token}`;
    });

    /* the console's reads say how long the server took (bench/console.mjs reads it) */
    app.addHook("onSend", async (req, reply, payload) => {
        const t0 = (req as FastifyRequest & { t0?: bigint }).t0;
        if (t0 !== undefined && req.url.startsWith("/api/console/"))
            reply.header("Server-Timing", `app;dur=${(Number(process.hrtime.bigint() - t0) / 1e6).toFixed(1)}`);
        return payload;
    });

    const as = async <T>(req: FastifyRequest, fn: (q: Q) => Promise<T>): Promise<T> => {
        const h = req.headers.authorization;
        const m = h ? /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(h) : null;
        if (!m || !wellFormedToken(m[1])) throw errors.noToken();
        try {
            return await db.asCaller({ kind: "token", token: m[1] }, (tx) => fn(tx.query as Q));
        } catch (e) {
            const err = toApiError(e);
            if (err.sqlstate === "28000") {
                await sleep(opts.authDelayMs * (0.75 + Math.random() / 2));
                throw new ApiError(401, "28000", err.message, { detail: err.detail, hint: err.hint });
            }
            throw e;
        }
    };

    /* who am I: the role, the token's scopes, the CSRF token */
    const whoami = (token: string) => async (q: Q) => (await q<{ role: string; operator: boolean; scopes: string[] | null }>(
        `SELECT CURRENT_USER::text AS role, pg_catalog.pg_has_role('tuvl_operator', 'USAGE') AS operator,
                (SELECT t.scopes FROM tuvl.tokens t WHERE t.id OPERATOR(pg_catalog.=) $1) AS scopes`,
        [Number(token.split("_")[1])]))[0];

    app.post("/api/console/session", async (req, reply) => {
        const body = bodyOf(req);
        let token: string;
        let minted = false;
        if (typeof body.token === "string") {
            token = body.token.trim();
            if (!wellFormedToken(token)) {
                await sleep(opts.authDelayMs * (0.75 + Math.random() / 2));
                throw new ApiError(401, "28000", "invalid token", { detail: "The token is malformed, unknown, revoked or expired." });
            }
        } else if (typeof body.role === "string" && typeof body.password === "string") {
            if (body.role === "" || body.role.length > 63) throw errors.badRequest("role must name a role");
            let client: pg.Client;
            try {
                /* the host the server's settings choose (the primary, after a failover) */
                ({ client } = await connectFirst(opts.db, { user: body.role, password: body.password,
                    application_name: "tuvl insight sign-in" }));
            } catch (e) {
                const code = (e as { code?: string }).code;
                await sleep(opts.authDelayMs * (0.75 + Math.random() / 2));
                if (code === "28P01" || code === "28000" || code === "3D000")
                    throw new ApiError(401, "28000", "sign-in failed", { detail: "The role or the password is wrong, or the role may not connect." });
                throw new ApiError(503, "08006", "the server could not connect to the database", { hint: "Try again later." });
            }
            try {
                const { rows } = await client.query<{ token: string }>(
                    "SELECT tuvl.create_token(CURRENT_USER::pg_catalog.regrole, $1::text[], $2::pg_catalog.interval) AS token",
                    [ALL_SCOPES, `${SESSION_HOURS} hours`]);
                token = rows[0].token;
                minted = true;
            } catch (e) {
                const err = toApiError(e);
                throw new ApiError(403, err.sqlstate ?? "42501", "the role may not use tuvl", { detail: err.message, hint: "Grant it tuvl_user." });
            } finally {
                await client.end().catch(() => undefined);
            }
        } else throw errors.badRequest("sign in with {\"role\", \"password\"} or {\"token\"}");
        const me = await as({ headers: { authorization: `Bearer ${token}` } } as FastifyRequest, whoami(token));
        setCookie(req, reply, `${minted ? "p" : "t"}.${token}`, SESSION_HOURS * 3600);
        return { role: me.role, operator: me.operator, scopes: me.scopes, csrf: csrfOf(token), signed_in_with: minted ? "password" : "token" };
    });

    app.get("/api/console/session", async (req) => {
        const s = session(req);
        if (!s || req.headers.authorization !== `Bearer ${s.token}`) throw errors.noToken();
        const me = await as(req, whoami(s.token));
        return { role: me.role, operator: me.operator, scopes: me.scopes, csrf: csrfOf(s.token), signed_in_with: s.minted ? "password" : "token" };
    });

    app.delete("/api/console/session", async (req, reply) => {
        const s = session(req);
        if (s && s.minted) {
            try {
                await as(req, (q) => q("SELECT tuvl.revoke_token($1)", [Number(s.token.split("_")[1])]));
            } catch { /* already revoked or expired: signed out all the same */ }
        }
        setCookie(req, reply, "", 0);
        return { signed_out: true };
    });

    const filterOf = (req: FastifyRequest): ConsoleRunFilter => {
        const q = queryOf(req);
        const status = q.status ? q.status.split(",").map((s) => s.trim()).filter(Boolean) : undefined;
        for (const s of status ?? [])
            if (!ops.STATUSES.includes(s)) throw errors.badRequest(`"${s.slice(0, 40)}" is not a status`);
        const limit = positive(q.limit, "limit") ?? 50;
        if (limit > 500) throw errors.badRequest("limit must be at most 500");
        for (const t of [q.from, q.to])
            if (t && Number.isNaN(Date.parse(t))) throw errors.badRequest(`"${t.slice(0, 40)}" is not a time`);
        return {
            workflow: q.workflow || undefined, status, key: q.key || undefined, from: q.from || undefined,
            to: q.to || undefined, text: q.q || undefined, before: positive(q.before, "before"), limit,
        };
    };

    app.get("/api/console/runs", async (req) => {
        const f = filterOf(req);
        const runs = await as(req, (q) => consoleRuns(q, f));
        /* a text search goes on from where its window ended, even when it found less than a page */
        let next: unknown = runs.length === f.limit ? runs[runs.length - 1].id : null;
        if (f.text && next === null) {
            next = await as(req, (q) => consoleTextWindowEnd(q, f));
        }
        return { runs, next_before: next, text_window: f.text ? TEXT_WINDOW : undefined };
    });
    app.get("/api/console/counts", async (req) => {
        const f = filterOf(req);
        return as(req, (q) => consoleCounts(q, f));
    });
    app.get("/api/console/runs/:id", async (req) => {
        const id = positive((req.params as { id: string }).id, "run id") as number;
        return as(req, (q) => consoleRun(q, id));
    });
    app.get("/api/console/runs/:id/journal", async (req, reply) => {
        const id = positive((req.params as { id: string }).id, "run id") as number;
        const body = await as(req, (q) => consoleJournal(q, id));
        return reply.type("application/json; charset=utf-8").send(body);
    });
    app.get("/api/console/workflows", async (req) => ({ workflows: await as(req, consoleWorkflows) }));
    app.get("/api/console/workflows/:name", async (req) => {
        const name = (req.params as { name: string }).name;
        const version = positive(queryOf(req).version, "version");
        return as(req, (q) => consoleWorkflow(q, name, version));
    });
    app.get("/api/console/metrics", async (req) => ({ metrics: await as(req, consoleMetrics) }));
    app.get("/api/console/workers", async (req) => ({ workers: await as(req, consoleWorkers) }));

    /* dev mode: breakpoints and step mode (tuvl.set_breakpoint, clear_breakpoint, step_run) */
    app.post("/api/console/breakpoints", async (req) => {
        const b = bodyOf(req);
        if (typeof b.workflow !== "string" || typeof b.step !== "string") throw errors.badRequest("send {\"workflow\", \"step\"}");
        const on = b.on !== false;
        await as(req, (q) => q(on ? "SELECT tuvl.set_breakpoint($1, $2)" : "SELECT tuvl.clear_breakpoint($1, $2)", [b.workflow, b.step]));
        return { workflow: b.workflow, step: b.step, on };
    });
    app.post("/api/runs/:id/step", async (req) => {
        const id = positive((req.params as { id: string }).id, "run id") as number;
        return as(req, async (q) => {
            await q("SELECT tuvl.step_run($1)", [id]);
            const [s] = await q<{ status: string }>("SELECT status FROM tuvl.runs WHERE id OPERATOR(pg_catalog.=) $1", [id]);
            return { run_id: id, status: s ? s.status : null };
        });
    });

    /*
     * MCP OAuth (docs/mcp.md#oauth): a person connects their role to an MCP
     * server with the authorization-code grant.  connect: tuvl.mcp_connect()
     * with the console's callback page as the redirect URI, in the person's
     * transaction (tuvl.oauth_redirect_uri set for it alone); the page sends
     * the person to the URL it returns.  The authorization server sends them
     * back to /console/mcp/callback, a page of the console (a navigation
     * from another site carries no SameSite=Strict cookie; the page's own
     * request does), which posts its URL to finish: tuvl.mcp_connect_finish()
     * as the same role, which stores the tokens as that role's secrets.
     */
    app.post("/api/console/mcp/connect", async (req) => {
        const b = bodyOf(req);
        if (typeof b.url !== "string" || !/^https?:\/\/[^\s]+$/.test(b.url) || b.url.length > 2000)
            throw errors.badRequest("send {\"url\"}: the MCP server's http:// or https:// URL");
        if (b.auth !== undefined && b.auth !== null && (typeof b.auth !== "object" || Array.isArray(b.auth)))
            throw errors.badRequest("auth must be a JSON object: the step's mcp.auth, such as {\"oauth\": {\"grant\": \"authorization_code\"}}");
        const host = req.headers.host;
        if (!host) throw errors.badRequest("the request has no Host header");
        /* behind a proxy that ends TLS, the scheme it says (a wrong one would only spoil the caller's own grant) */
        const forwarded = String(req.headers["x-forwarded-proto"] ?? "").split(",")[0].trim();
        const scheme = forwarded === "https" || forwarded === "http" ? forwarded : req.protocol;
        const redirect = `${scheme}://${host}/console/mcp/callback`;
        return as(req, async (q) => {
            await q("SELECT pg_catalog.set_config('tuvl.oauth_redirect_uri', $1, true)", [redirect]);
            const [r] = await q<{ url: string }>("SELECT tuvl.mcp_connect($1, $2::pg_catalog.jsonb) AS url",
                                                 [b.url, b.auth === undefined || b.auth === null ? null : JSON.stringify(b.auth)]);
            return { authorize_url: r.url, redirect_uri: redirect };
        });
    });
    app.post("/api/console/mcp/finish", async (req) => {
        const b = bodyOf(req);
        if (typeof b.callback_url !== "string" || b.callback_url.length > 8000)
            throw errors.badRequest("send {\"callback_url\"}: the URL the authorization server sent the person back to");
        return as(req, async (q) => {
            const [r] = await q<{ url: string }>("SELECT tuvl.mcp_connect_finish($1) AS url", [b.callback_url]);
            return { url: r.url };
        });
    });

    /* the application: files of insight/console/dist, index.html for every page of it */
    const index = join(root, "index.html");
    const sendFile = (reply: FastifyReply, file: string) => {
        const type = TYPES[extname(file)] ?? "application/octet-stream";
        reply.header("Content-Type", type);
        reply.header("Cache-Control", file.endsWith("index.html") ? "no-cache" : "public, max-age=3600");
        reply.header("Content-Security-Policy",
                     "default-src 'self'; script-src 'self' 'unsafe-eval'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'");
        reply.header("X-Frame-Options", "DENY");
        reply.header("Referrer-Policy", "no-referrer");
        return reply.send(readFileSync(file));
    };
    app.get("/", async (_req, reply) => reply.redirect("/console/"));
    app.get("/console", async (_req, reply) => reply.redirect("/console/"));
    app.get("/console/*", async (req, reply) => {
        if (!existsSync(index))
            throw new ApiError(503, null, "the console is not built", { hint: "Run insight/tuvl once (it builds insight/console/dist)." });
        const rel = normalize("/" + ((req.params as { "*": string })["*"] ?? "")).replace(/^\/+/, "");
        const file = join(root, rel);
        if (rel !== "" && file.startsWith(root + "/") && existsSync(file) && statSync(file).isFile()) return sendFile(reply, file);
        return sendFile(reply, index);
    });
}
