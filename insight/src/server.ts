/*
 * server.ts: the HTTP front door, `insight/tuvl serve`.
 *
 * A stateless server beside the database, the way PostgREST is: it
 * connects as an authenticator role that can do nothing itself, and each
 * request is one transaction in which tuvl.authenticate() checks the
 * request's token and the transaction takes the token's role (db.ts).
 * Every permission, row filter, scope and ownership rule is the
 * database's; the server only translates HTTP to tuvl's SQL API (ops.ts)
 * and PostgreSQL's errors to HTTP statuses (errors.ts).  The one
 * connection that LISTENs (hub.ts) carries hints only: each event stream
 * reads the journal with its own token (sse.ts).
 *
 * Secure by default: tokens only in the Authorization header (never in a
 * URL, so never in an access log), nothing of a request's headers or
 * body in the log, a failed authentication answered only after a delay
 * that the caller waits out (the server holds a timer, not a connection),
 * request bodies bounded (413), CORS off unless --cors names origins, and
 * every JSON answer marked no-store.
 */
import Fastify, { LogController } from "fastify";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import type { ConnSettings } from "./conninfo.js";
import { Database, wellFormedToken } from "./db.js";
import type { Credentials } from "./db.js";
import { ApiError, errors, toApiError } from "./errors.js";
import { Hub } from "./hub.js";
import * as ops from "./ops.js";
import { openapi } from "./openapi.js";
import * as routerOps from "./routerops.js";
import { EventStream, Reader } from "./sse.js";
import { Target } from "./target.js";
import { registerConsole } from "./console.js";

export interface ServeOptions {
    db: ConnSettings;
    host: string;
    port: number;
    pool: number;
    bodyLimit: number;
    maxWait: string;
    maxStreams: number;
    authDelayMs: number;
    cors: string[];
    accessLog: boolean;
    logLevel: string;
}

type Req = FastifyRequest;
type Rep = FastifyReply;
type Body = Record<string, unknown>;

/* An authentication that failed: answered after the delay. */
class AuthFailure extends ApiError {}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/* ---------------------------------------------------------------- parsing */

function positiveId(text: string | undefined, what = "run id"): number {
    const n = Number(text);
    if (!text || !/^[0-9]{1,18}$/.test(text) || !Number.isSafeInteger(n) || n <= 0)
        throw errors.badRequest(`${what} must be a positive integer, not "${String(text).slice(0, 40)}"`);
    return n;
}

/* The request's body as a JSON object ({} when there is none). */
function jsonBody(req: Req, required = false): Body {
    const raw = typeof req.body === "string" ? req.body : "";
    if (raw.trim() === "") {
        if (required) throw errors.badRequest("the request needs a JSON body");
        return {};
    }
    let v: unknown;
    try {
        v = JSON.parse(raw);
    } catch (e) {
        throw errors.badJson((e as Error).message);
    }
    if (v === null || typeof v !== "object" || Array.isArray(v))
        throw errors.badRequest("the request body must be a JSON object");
    return v as Body;
}

function onlyKeys(body: Body, allowed: string[]): void {
    for (const k of Object.keys(body))
        if (!allowed.includes(k))
            throw errors.badRequest(`unknown key "${k.slice(0, 60)}" in the request body`,
                                    allowed.length ? `The body takes ${allowed.join(", ")}.` : "The body takes no keys.");
}

function optString(body: Body, key: string, nonEmpty = false): string | undefined {
    const v = body[key];
    if (v === undefined || v === null) return undefined;
    if (typeof v !== "string" || (nonEmpty && v === ""))
        throw errors.badRequest(`${key} must be a${nonEmpty ? " non-empty" : ""} string`);
    return v;
}

function query(req: Req): Record<string, string | undefined> {
    const q = req.query as Record<string, unknown>;
    const out: Record<string, string | undefined> = {};
    for (const [k, v] of Object.entries(q ?? {}))
        out[k] = Array.isArray(v) ? String(v[v.length - 1]) : v === undefined ? undefined : String(v);
    return out;
}

/* The Bearer token of a request. */
function bearer(req: Req): Credentials {
    const h = req.headers.authorization;
    if (!h) throw errors.noToken();
    const m = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(h);
    if (!m) throw new AuthFailure(401, "28000", "invalid token", {
        detail: "The Authorization header must be Bearer <token>.", headers: { "WWW-Authenticate": "Bearer" },
    });
    if (!wellFormedToken(m[1])) throw new AuthFailure(401, "28000", "invalid token", {
        detail: "The token is malformed, unknown, revoked or expired.",
        hint: "Create a new one with tuvl.create_token().", headers: { "WWW-Authenticate": "Bearer" },
    });
    return { kind: "token", token: m[1] };
}

/* Before a stream: the token's runs:read (or an error naming it), the role's channel, the run. */
const STREAM_SQL = {
    name: "tuvl_insight_stream",
    text: `SELECT tuvl._require_scope('runs:read'), tuvl.events_channel() AS channel, r.status, r.last_seq
           FROM (SELECT 1) one LEFT JOIN tuvl.runs r ON r.id OPERATOR(pg_catalog.=) $1`,
};

const runUrls = (id: number) => ({ status_url: `/api/runs/${id}`, events_url: `/api/runs/${id}/events` });

/* ---------------------------------------------------------------- the server */

export class Server {
    readonly app: FastifyInstance;
    private readonly db: Database;
    private readonly hub: Hub;
    private readonly streams = new Set<EventStream>();
    /* the journal's readers of the streams, one per token */
    private readonly readers = new Map<string, Reader>();
    private readonly opts: ServeOptions;
    /* requests waiting out the delay of a failed authentication */
    private delayed = 0;
    /* on a router database (routerops.ts): its operations, and streams poll */
    private router = false;

    constructor(opts: ServeOptions) {
        this.opts = opts;
        this.app = Fastify({
            logger: { level: opts.logLevel },
            logController: new LogController({ disableRequestLogging: true }),
            bodyLimit: opts.bodyLimit,
            return503OnClosing: true,
            forceCloseConnections: true,
        });
        const log = (msg: string) => this.app.log.warn(msg);
        const target = new Target(opts.db, log);
        this.db = new Database(target, opts.pool, log);
        this.hub = new Hub(target, log);
        this.setup();
        registerConsole(this.app, this.db, { db: opts.db, authDelayMs: opts.authDelayMs });
        this.routes();
    }

    /* The operations of the database the server is on: tuvl's, or a router's. */
    private get o(): Pick<typeof ops, "startRun" | "waitRun" | "listRuns" | "getRun" | "timeline" | "control" | "people"> {
        return this.router ? routerOps : ops;
    }

    /* What a router does not route. */
    private direct(what: string): void {
        if (this.router) throw routerOps.notOnRouter(what);
    }

    /* Run fn as the caller; a failed authentication becomes an AuthFailure. */
    private async as<T>(cred: Credentials, fn: (q: ops.Query, notices: string[]) => Promise<T>, rollback = false): Promise<T> {
        try {
            return await this.db.asCaller(cred, (tx) => fn(tx.query as ops.Query, tx.notices), { rollback });
        } catch (e) {
            const err = toApiError(e);
            if (err.sqlstate === "28000")
                throw new AuthFailure(401, "28000", err.message, { detail: err.detail, hint: err.hint, headers: { "WWW-Authenticate": "Bearer" } });
            throw e;
        }
    }

    private setup(): void {
        const app = this.app;
        app.removeAllContentTypeParsers();
        app.addContentTypeParser("*", { parseAs: "string" }, (_req, body, done) => done(null, body));

        app.addHook("onRequest", async (req, reply) => {
            (req as Req & { t0?: bigint }).t0 = process.hrtime.bigint();
            const origin = req.headers.origin;
            if (origin && this.opts.cors.length && (this.opts.cors.includes("*") || this.opts.cors.includes(origin))) {
                reply.header("Access-Control-Allow-Origin", this.opts.cors.includes("*") ? "*" : origin);
                reply.header("Vary", "Origin");
                reply.header("Access-Control-Expose-Headers", "Location, Retry-After, WWW-Authenticate");
                if (req.method === "OPTIONS") {
                    reply.header("Access-Control-Allow-Methods", "GET, POST, PUT, DELETE");
                    reply.header("Access-Control-Allow-Headers", "Authorization, Content-Type, Last-Event-ID, traceparent");
                    reply.header("Access-Control-Max-Age", "600");
                    return reply.code(204).send();
                }
            }
            return undefined;
        });
        app.addHook("onSend", async (_req, reply, payload) => {
            reply.header("X-Content-Type-Options", "nosniff");
            if (!reply.hasHeader("Cache-Control")) reply.header("Cache-Control", "no-store");
            return payload;
        });
        if (this.opts.accessLog)
            app.addHook("onResponse", async (req, reply) => {
                const t0 = (req as Req & { t0?: bigint }).t0 ?? process.hrtime.bigint();
                const ms = Number(process.hrtime.bigint() - t0) / 1e6;
                app.log.info(`${req.method} ${req.url.split("?")[0]} ${reply.statusCode} ${ms.toFixed(1)} ms`);
            });

        app.setNotFoundHandler(async (req, reply) => {
            const e = errors.notFound(`no route ${req.method} ${req.url.split("?")[0].slice(0, 200)}`);
            return reply.code(404).send(e.body());
        });
        app.setErrorHandler(async (error: unknown, req, reply) => {
            let err: ApiError;
            const code = (error as { code?: string }).code;
            if (code === "FST_ERR_CTP_BODY_TOO_LARGE") err = errors.tooLarge(this.opts.bodyLimit);
            else if (typeof code === "string" && code.startsWith("FST_ERR_CTP"))
                err = errors.badRequest((error as Error).message);
            else err = toApiError(error);
            if (err.status >= 500 && !(error instanceof ApiError))
                req.log.error({ err: error }, `${req.method} ${req.url.split("?")[0]} failed`);
            if (error instanceof AuthFailure) {
                this.delayed++;
                try {
                    await sleep(this.opts.authDelayMs * (0.75 + Math.random() / 2));
                } finally {
                    this.delayed--;
                }
            }
            if (err.headers) for (const [k, v] of Object.entries(err.headers)) reply.header(k, v);
            return reply.code(err.status).send(err.body());
        });
    }

    private routes(): void {
        const app = this.app;

        app.get("/health", async (_req, reply) => {
            try {
                await this.db.anonymous("SELECT 1");
            } catch {
                return reply.code(503).send({ status: "unavailable", database: false, listener: this.hub.connected });
            }
            return { status: "ok", database: true, listener: this.router ? "polling" : this.hub.connected,
                     streams: this.streams.size, delayed: this.delayed };
        });

        app.get("/api/openapi.json", async (req) => {
            this.direct("the OpenAPI document");
            const { version, workflows } = await this.as(bearer(req), (q) => ops.workflows(q));
            return openapi(version, workflows);
        });

        app.post("/api/workflows/:name/runs", async (req, reply) => {
            const body = jsonBody(req);
            onlyKeys(body, ["input", "key", "not_before", "priority", "debounce"]);
            const input = body.input ?? {};
            if (input === null || typeof input !== "object" || Array.isArray(input))
                throw new ApiError(422, "22023", "run input does not match its schema", {
                    detail: "At $: the input must be a JSON object.", hint: "Correct the run input so that it satisfies the schema.",
                });
            const priority = body.priority;
            if (priority !== undefined && priority !== null && !Number.isInteger(priority))
                throw errors.badRequest("priority must be an integer");
            const name = (req.params as { name: string }).name;
            return this.start(req, reply, bearer(req), {
                workflow: name, input,
                key: optString(body, "key", true), notBefore: optString(body, "not_before"),
                priority: priority === null ? undefined : (priority as number | undefined),
                debounce: optString(body, "debounce", true),
            });
        });

        const hook = async (req: Req, reply: Rep) => {
            this.direct("a workflow's route under /hooks");
            const path = "/" + ((req.params as { "*": string })["*"] ?? "");
            const [route] = await this.db.anonymous<{ workflow: string; method: string; signature_header: string | null }>(
                "SELECT workflow, method, signature_header FROM tuvl.http_route($1)", [path]);
            if (!route) throw errors.notFound(`no workflow is served at /hooks${path}`);
            if (route.method !== req.method) throw errors.methodNotAllowed(route.method);
            const raw = typeof req.body === "string" ? req.body : "";
            const signature = route.signature_header ? req.headers[route.signature_header.toLowerCase()] : undefined;
            let cred: Credentials;
            if (typeof signature === "string") cred = { kind: "hook", path, body: raw, signature };
            else if (req.headers.authorization) cred = bearer(req);
            else if (route.signature_header)
                throw new ApiError(401, "28000", "no signature", {
                    detail: `The route takes a Bearer token, or the body's HMAC-SHA256 in header ${route.signature_header}.`,
                });
            else throw errors.noToken();
            const input = jsonBody(req, true);
            return this.start(req, reply, cred, { workflow: route.workflow, input });
        };
        app.post("/hooks/*", hook);
        app.put("/hooks/*", hook);

        app.get("/api/runs", async (req) => {
            const q = query(req);
            const status = q.status ? q.status.split(",").map((s) => s.trim()).filter(Boolean) : undefined;
            for (const s of status ?? [])
                if (!ops.STATUSES.includes(s))
                    throw errors.badRequest(`"${s.slice(0, 40)}" is not a status`, `Statuses are ${ops.STATUSES.join(", ")}.`);
            const limit = q.limit === undefined ? 50 : positiveId(q.limit, "limit");
            if (limit > 1000) throw errors.badRequest("limit must be at most 1000");
            const filter: ops.RunFilter = {
                workflow: q.workflow || undefined, status, key: q.key || undefined,
                before: q.before === undefined ? undefined : positiveId(q.before, "before"), limit,
            };
            const runs = await this.as(bearer(req), (qq) => this.o.listRuns(qq, filter));
            let next: string | null = null;
            if (runs.length === limit) {
                const p = new URLSearchParams();
                if (filter.workflow) p.set("workflow", filter.workflow);
                if (status) p.set("status", status.join(","));
                if (filter.key) p.set("key", filter.key);
                if (q.limit !== undefined) p.set("limit", String(limit));
                p.set("before", String(runs[runs.length - 1].id));
                next = `/api/runs?${p.toString()}`;
            }
            return { runs, next };
        });

        app.get("/api/runs/:id", async (req) => {
            const id = positiveId((req.params as { id: string }).id);
            const run = await this.as(bearer(req), (q) => this.o.getRun(q, id));
            return { ...run, events_url: `/api/runs/${id}/events` };
        });

        app.get("/api/runs/:id/timeline", async (req) => {
            const id = positiveId((req.params as { id: string }).id);
            return { timeline: await this.as(bearer(req), (q) => this.o.timeline(q, id)) };
        });

        app.get("/api/runs/:id/events", async (req, reply) => this.events(req, reply));

        for (const action of ["pause", "resume", "abort", "steer", "submit", "reject", "decide"] as ops.Action[])
            app.post(`/api/runs/:id/${action}`, async (req) => {
                const id = positiveId((req.params as { id: string }).id);
                const args = controlArgs(action, jsonBody(req));
                return this.as(bearer(req), async (q, notices) => ({ ...(await this.o.control(q, action, id, args)), notices }));
            });

        app.get("/api/people", async (req) => ({ people: await this.as(bearer(req), (q) => this.o.people(q)) }));

        app.get("/api/runs/:id/fixture", async (req) => {
            this.direct("pinning a run");
            const id = positiveId((req.params as { id: string }).id);
            return this.as(bearer(req), (q) => ops.pin(q, id));
        });

        app.post("/api/replay", async (req) => {
            this.direct("replay");
            const body = jsonBody(req, true);
            onlyKeys(body, ["fixture", "live"]);
            if (body.fixture === null || typeof body.fixture !== "object")
                throw errors.badRequest("fixture must be the JSON object tuvl.pin_run() returned");
            const live = body.live ?? null;
            if (live !== null && (!Array.isArray(live) || live.some((s) => typeof s !== "string")))
                throw errors.badRequest("live must be a list of step ids");
            return this.as(bearer(req), (q) => ops.replay(q, body.fixture, live as string[] | null), true);
        });

        app.post("/api/validate", async (req) => {
            this.direct("validation");
            const { source, strict } = sourceBody(req);
            const findings = await this.as(bearer(req), (q) => ops.validate(q, source, strict));
            return { ok: !findings.some((f) => f.severity === "error"), findings };
        });

        app.post("/api/workflows", async (req, reply) => {
            this.direct("shipping a workflow (use tuvl_router.register_workflow())");
            const { source, strict } = sourceBody(req);
            const out = await this.as(bearer(req), (q) => ops.ship(q, source, strict));
            return reply.code(201).send(out);
        });

        app.get("/api/tokens", async (req) => {
            this.direct("tokens over HTTP");
            return { tokens: await this.as(bearer(req), (q) => ops.listTokens(q)) };
        });
        app.post("/api/tokens", async (req, reply) => {
            this.direct("tokens over HTTP");
            const body = jsonBody(req, true);
            onlyKeys(body, ["role", "scopes", "expires"]);
            const role = optString(body, "role", true);
            const scopes = body.scopes;
            if (!role) throw errors.badRequest("role must name a role");
            if (!Array.isArray(scopes) || scopes.some((s) => typeof s !== "string"))
                throw errors.badRequest("scopes must be a list such as [\"runs:start\", \"runs:read\"]");
            const expires = body.expires === null ? null : optString(body, "expires", true);
            const out = await this.as(bearer(req), (q) => ops.createToken(q, role, scopes as string[], expires));
            return reply.code(201).send(out);
        });
        app.delete("/api/tokens/:id", async (req) => {
            this.direct("tokens over HTTP");
            const id = positiveId((req.params as { id: string }).id, "token id");
            await this.as(bearer(req), (q) => ops.revokeToken(q, id));
            return { id, revoked: true };
        });
    }

    /* Start a run; 200 with its end when it ended within the wait, else 202. */
    private async start(req: Req, reply: Rep, cred: Credentials,
                        r: { workflow: string; input: unknown; key?: string; notBefore?: string; priority?: number;
                             debounce?: string }): Promise<unknown> {
        const wait = query(req).wait;
        const tp = req.headers.traceparent;
        const start: ops.StartRequest = {
            ...r, wait: wait === undefined || wait === "" ? undefined : wait, maxWait: this.opts.maxWait,
            traceparent: typeof tp === "string" ? tp : undefined,
        };
        let out = await this.as(cred, (q) => this.o.startRun(q, start));
        if (out.waitFor) {
            const waitFor = out.waitFor;
            out = await this.as(cred, (q) => this.o.waitRun(q, out.run_id, waitFor));
        }
        const urls = runUrls(out.run_id);
        if (ops.FINAL.has(out.status)) return reply.code(200).send({ ...out, ...urls });
        reply.header("Location", urls.status_url);
        return reply.code(202).send({ run_id: out.run_id, status: out.status, ...urls });
    }

    /* GET /api/runs/{id}/events: check, then hand the socket to an EventStream. */
    private async events(req: Req, reply: Rep): Promise<unknown> {
        const id = positiveId((req.params as { id: string }).id);
        const lastId = req.headers["last-event-id"];
        const afterText = typeof lastId === "string" && lastId !== "" ? lastId : query(req).after;
        let after = 0;
        if (afterText !== undefined && afterText !== "") {
            if (!/^[0-9]{1,9}$/.test(afterText)) throw errors.badRequest("Last-Event-ID and after must be a seq (an integer, 0 or more)");
            after = Number(afterText);
        }
        if (this.streams.size >= this.opts.maxStreams)
            throw new ApiError(503, "53300", "too many event streams", { hint: "The server's --max-streams bounds them.", headers: { "Retry-After": "5" } });
        const cred = bearer(req);
        const info = await this.as(cred, async (q) => {
            const [row] = await q<{ channel: string; status: string | null; last_seq: number | null }>(
                this.router ? routerOps.STREAM_SQL : STREAM_SQL, [id], { last: true });
            return row;
        });
        if (!info || info.status === null) throw ops.runMissing(id);
        if (ops.FINAL.has(info.status) && (info.last_seq ?? 0) <= after) return reply.code(204).send();
        const key = (cred as { token: string }).token;
        let reader = this.readers.get(key);
        if (!reader) this.readers.set(key, (reader = new Reader(this.db, cred)));
        reader.users++;
        const summary = /^(1|true|yes)$/i.test(query(req).summary ?? "");
        reply.hijack();
        const ended = () => {
            this.streams.delete(stream);
            if (--reader.users === 0) this.readers.delete(key);
        };
        const stream = new EventStream(this.router ? null : this.hub, reader, id, info.channel ?? "", after, summary, reply.raw,
                                       (m) => this.app.log.warn(m), ended);
        this.streams.add(stream);
        try {
            await stream.start();
        } catch (e) {
            stream.close();
            this.app.log.warn(`event stream of run ${id}: ${(e as Error).message}`);
        }
        return undefined;
    }

    async listen(): Promise<string> {
        await this.hub.start();
        /* a router database: no notifications there (they happen on the partitions), streams poll */
        const [r] = await this.db.anonymous<{ router: boolean }>(routerOps.DETECT_SQL);
        if (r.router) {
            this.router = this.db.router = true;
            await this.hub.close();
            this.app.log.info("on a router database (tuvl_router): event streams poll the partitions' journals");
        }
        return this.app.listen({ host: this.opts.host, port: this.opts.port });
    }

    async close(): Promise<void> {
        for (const s of this.streams) s.close();
        await this.app.close();
        await this.hub.close();
        await this.db.end();
    }
}

function controlArgs(action: ops.Action, body: Body): ops.ControlArgs {
    switch (action) {
        case "pause":
        case "resume":
            onlyKeys(body, []);
            return {};
        case "abort":
            onlyKeys(body, ["reason"]);
            return { reason: optString(body, "reason") ?? null };
        case "steer": {
            onlyKeys(body, ["message"]);
            const message = optString(body, "message");
            if (message === undefined) throw errors.badRequest("steer needs a message", "Send {\"message\": \"...\"}.");
            return { message };
        }
        case "submit":
            onlyKeys(body, ["data"]);
            if (body.data === undefined) throw errors.badRequest("submit needs data", "Send {\"data\": {...}}, the form's fields.");
            return { data: body.data };
        case "reject": {
            onlyKeys(body, ["action"]);
            const action = body.action ?? "decline";
            if (action !== "decline" && action !== "cancel")
                throw errors.badRequest("action must be decline or cancel", "Send {\"action\": \"decline\"} or {\"action\": \"cancel\"}; accept with submit.");
            return { action: action as "decline" | "cancel" };
        }
        case "decide":
            onlyKeys(body, ["approved", "note"]);
            if (typeof body.approved !== "boolean")
                throw errors.badRequest("decide needs approved, true or false", "Send {\"approved\": true, \"note\": \"...\"}.");
            return { approved: body.approved, note: optString(body, "note") ?? null };
    }
}

function sourceBody(req: Req): { source: string; strict: boolean } {
    const body = jsonBody(req, true);
    onlyKeys(body, ["source", "strict"]);
    if (typeof body.source !== "string") throw errors.badRequest("source must be the workflow's YAML, as a string");
    if (body.strict !== undefined && typeof body.strict !== "boolean") throw errors.badRequest("strict must be true or false");
    return { source: body.source, strict: body.strict === true };
}
