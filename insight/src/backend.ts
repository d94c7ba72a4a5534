/*
 * backend.ts: where the command line sends its commands: straight to the
 * database (DirectBackend, libpq's environment or --db, as psql connects)
 * or to a server of insight (HttpBackend, --url and a token).  Both give
 * the same results, in the API's JSON shapes; the formatting is the
 * caller's.
 */
import pg from "pg";

import type { ConnSettings } from "./conninfo.js";
import { ApiError, isPgError, statusOf } from "./errors.js";
import * as ops from "./ops.js";
import * as routerOps from "./routerops.js";
import { connectFirst, isFailover, unavailable } from "./target.js";

type Row = Record<string, unknown>;

export interface Backend {
    listRuns(f: ops.RunFilter): Promise<{ runs: Row[]; next: string | null }>;
    getRun(id: number): Promise<Row>;
    timeline(id: number): Promise<ops.TimelineRow[]>;
    /* every event after seq, then live ones, until the run has ended */
    follow(id: number, after: number, onEvent: (e: Row) => void): Promise<void>;
    control(action: ops.Action, id: number, args: ops.ControlArgs): Promise<Row>;
    people(): Promise<Row[]>;
    pin(id: number): Promise<Row>;
    replay(fixture: unknown, live: string[] | null): Promise<Row>;
    validate(source: string, strict: boolean): Promise<ops.Finding[]>;
    ship(source: string, strict: boolean): Promise<Row>;
    listTokens(): Promise<Row[]>;
    createToken(role: string, scopes: string[], expires: string | null | undefined): Promise<{ id: number; token: string }>;
    revokeToken(id: number): Promise<void>;
    close(): Promise<void>;
}

/* A PostgreSQL error as the API reports it. */
function apiError(e: unknown): unknown {
    if (e instanceof ApiError || !isPgError(e)) return e;
    return new ApiError(statusOf(e.code as string, e.message), e.code as string, e.message,
                        { detail: e.detail ?? null, hint: e.hint ?? null });
}

/*
 * Straight to the database, as psql connects: the first host of the
 * connection string whose session fits its target_session_attrs
 * (target.ts); `runs tail` connects again after a failover.
 */
export class DirectBackend implements Backend {
    private client: pg.Client | null = null;
    private readonly notices: string[] = [];
    /* on a router database (routerops.ts) */
    private router = false;

    constructor(private readonly settings: ConnSettings) {}

    private async connection(): Promise<pg.Client> {
        if (!this.client) {
            const { client } = await connectFirst(this.settings);
            client.on("notice", (n) => { if (n.message) this.notices.push(n.message); });
            this.router = (await client.query<{ router: boolean }>(routerOps.DETECT_SQL)).rows[0].router;
            this.client = client;
        }
        return this.client;
    }

    /* The operations of the database: tuvl's, or a router's (known once connected). */
    private async o(): Promise<Pick<typeof ops, "listRuns" | "getRun" | "timeline" | "control" | "people">> {
        await this.connection();
        return this.router ? routerOps : ops;
    }

    private async direct(what: string): Promise<void> {
        await this.connection();
        if (this.router) throw routerOps.notOnRouter(what);
    }

    /* Forget a broken connection (the next statement connects again). */
    private drop(): void {
        const c = this.client;
        this.client = null;
        c?.end().catch(() => undefined);
    }

    private async q<R = Row>(sql: ops.Statement, params?: unknown[]): Promise<R[]> {
        const client = await this.connection();
        try {
            return (await client.query(sql as string, params)).rows as R[];
        } catch (e) {
            if (isFailover(e, this.settings.targetSessionAttrs)) {
                this.drop();
                throw unavailable(`The database server went away or answered read-only (${(e as Error).message}).`);
            }
            throw apiError(e);
        }
    }

    private get query(): ops.Query {
        return (sql, params) => this.q(sql, params);
    }

    async listRuns(f: ops.RunFilter) {
        const runs = await (await this.o()).listRuns(this.query, f);
        return { runs, next: runs.length === f.limit ? `--before ${runs[runs.length - 1].id}` : null };
    }

    async getRun(id: number) { return (await this.o()).getRun(this.query, id); }
    async timeline(id: number) { return (await this.o()).timeline(this.query, id); }
    async people() { return (await this.o()).people(this.query); }
    async pin(id: number) { await this.direct("pinning a run"); return ops.pin(this.query, id); }
    async validate(source: string, strict: boolean) { await this.direct("validation"); return ops.validate(this.query, source, strict); }
    async listTokens() { await this.direct("tokens list"); return ops.listTokens(this.query); }
    async createToken(role: string, scopes: string[], expires: string | null | undefined) {
        await this.direct("tokens create (use tuvl_router.create_token())");
        return ops.createToken(this.query, role, scopes, expires);
    }
    async revokeToken(id: number) { await this.direct("tokens revoke (use tuvl_router.revoke_token())"); return ops.revokeToken(this.query, id); }

    async control(action: ops.Action, id: number, args: ops.ControlArgs) {
        this.notices.length = 0;
        const out = await (await this.o()).control(this.query, action, id, args);
        return { ...out, notices: [...this.notices] };
    }

    async ship(source: string, strict: boolean) {
        await this.direct("ship (use tuvl_router.register_workflow())");
        await this.q("BEGIN");
        try {
            const out = await ops.ship(this.query, source, strict);
            await this.q("COMMIT");
            return out;
        } catch (e) {
            await this.q("ROLLBACK").catch(() => undefined);
            throw e;
        }
    }

    /* Replay inside a transaction that is rolled back: the SQL steps' writes go with it. */
    async replay(fixture: unknown, live: string[] | null) {
        await this.direct("replay");
        await this.q("BEGIN");
        try {
            return await ops.replay(this.query, fixture, live);
        } finally {
            await this.q("ROLLBACK").catch(() => undefined);
        }
    }

    /*
     * LISTEN on the role's channel, read the journal after the last seq at
     * each hint.  A failover (the connection broken, the server read-only)
     * does not end it: it connects again, to whichever host fits now, for
     * up to two minutes, and goes on after the last event it printed.
     */
    async follow(id: number, after: number, onEvent: (e: Row) => void): Promise<void> {
        let last = after;
        let lostAt = 0;
        for (;;) {
            try {
                await this.followOnce(id, () => last, (seq, e) => { last = seq; lostAt = 0; onEvent(e); });
                return;
            } catch (e) {
                if (!isFailover(e, this.settings.targetSessionAttrs) && !(e instanceof ApiError && e.status === 503)) throw e;
                this.drop();
                if (lostAt === 0) lostAt = Date.now();
                if (Date.now() - lostAt > 120_000) throw e;
                await new Promise((r) => setTimeout(r, 500));
            }
        }
    }

    private async followOnce(id: number, last: () => number, onEvent: (seq: number, e: Row) => void): Promise<void> {
        await this.connection();
        if (this.router) return this.pollOnce(id, last, onEvent);
        const [ch] = await this.q<{ channel: string }>("SELECT tuvl.events_channel() AS channel");
        await this.q(`LISTEN ${pg.escapeIdentifier(ch.channel)}`);
        const client = await this.connection();
        let wake: (() => void) | null = null;
        const onNote = (n: pg.Notification) => {
            try {
                if (Number(JSON.parse(n.payload ?? "{}").run_id) === id && wake) wake();
            } catch { /* not ours */ }
        };
        const onEnd = () => wake?.();
        client.on("notification", onNote);
        client.on("end", onEnd);
        try {
            for (;;) {
                const rows = await this.q<ops.EventRow>(ops.eventsSql(false), [id, last(), 500]);
                if (rows.length === 0) throw ops.runMissing(id);
                let n = 0;
                for (const r of rows) {
                    if (r.seq === null || r.data === null) continue;
                    onEvent(r.seq, r.data);
                    n++;
                }
                if (n === 500) continue;
                if (ops.FINAL.has(rows[0].status)) return;
                await new Promise<void>((resolve) => {
                    const t = setTimeout(resolve, 5000);
                    wake = () => { clearTimeout(t); resolve(); };
                });
                wake = null;
            }
        } finally {
            client.off("notification", onNote);
            client.off("end", onEnd);
            if (this.client === client)
                await this.q(`UNLISTEN ${pg.escapeIdentifier(ch.channel)}`).catch(() => undefined);
        }
    }

    /* Through a router (no notifications): poll the run's partition, soon after events, slower while idle. */
    private async pollOnce(id: number, last: () => number, onEvent: (seq: number, e: Row) => void): Promise<void> {
        let pause = 25;
        for (;;) {
            const rows = await this.q<ops.EventRow>(routerOps.EVENTS_SQL, [id, last(), 500]);
            if (rows.length === 0) throw ops.runMissing(id);
            let n = 0;
            for (const r of rows) {
                if (r.seq === null || r.data === null) continue;
                onEvent(r.seq, r.data);
                n++;
            }
            if (n === 500) continue;
            if (ops.FINAL.has(rows[0].status)) return;
            pause = n > 0 ? 25 : Math.min(Math.round(pause * 1.5), 250);
            await new Promise((r) => setTimeout(r, pause));
        }
    }

    async close(): Promise<void> {
        const c = this.client;
        this.client = null;
        if (c) await c.end();
    }
}

export class HttpBackend implements Backend {
    private readonly base: string;
    private readonly token: string;

    constructor(url: string, token: string) {
        this.base = url.replace(/\/+$/, "");
        this.token = token;
    }

    private async call<T = Row>(method: string, path: string, body?: unknown): Promise<T> {
        let res: Response;
        try {
            res = await fetch(this.base + path, {
                method,
                headers: { Authorization: `Bearer ${this.token}`, ...(body === undefined ? {} : { "Content-Type": "application/json" }) },
                body: body === undefined ? undefined : JSON.stringify(body),
            });
        } catch (e) {
            throw new ApiError(503, "08006", `could not reach ${this.base}: ${(e as Error).cause ?? (e as Error).message}`);
        }
        const text = await res.text();
        let data: unknown = null;
        try {
            data = text === "" ? null : JSON.parse(text);
        } catch {
            throw new ApiError(res.status, null, `the server answered ${res.status} with something that is not JSON`);
        }
        if (!res.ok) {
            const d = (data ?? {}) as Row;
            const extra: Row = {};
            if (d.findings) extra.findings = d.findings;
            throw new ApiError(res.status, (d.sqlstate as string) ?? null, String(d.message ?? `HTTP ${res.status}`),
                               { detail: (d.detail as string) ?? null, hint: (d.hint as string) ?? null, extra });
        }
        return data as T;
    }

    async listRuns(f: ops.RunFilter) {
        const p = new URLSearchParams();
        if (f.workflow) p.set("workflow", f.workflow);
        if (f.status) p.set("status", f.status.join(","));
        if (f.key) p.set("key", f.key);
        if (f.before) p.set("before", String(f.before));
        p.set("limit", String(f.limit));
        return this.call<{ runs: Row[]; next: string | null }>("GET", `/api/runs?${p}`);
    }

    getRun(id: number) { return this.call("GET", `/api/runs/${id}`); }
    async timeline(id: number) { return (await this.call<{ timeline: ops.TimelineRow[] }>("GET", `/api/runs/${id}/timeline`)).timeline; }
    control(action: ops.Action, id: number, args: ops.ControlArgs) {
        const body: Row = {};
        if (action === "abort" && args.reason) body.reason = args.reason;
        if (action === "steer") body.message = args.message;
        if (action === "submit") body.data = args.data;
        if (action === "reject") body.action = args.action ?? "decline";
        if (action === "decide") {
            body.approved = args.approved;
            if (args.note) body.note = args.note;
        }
        return this.call("POST", `/api/runs/${id}/${action}`, body);
    }
    async people() { return (await this.call<{ people: Row[] }>("GET", "/api/people")).people; }
    pin(id: number) { return this.call("GET", `/api/runs/${id}/fixture`); }
    replay(fixture: unknown, live: string[] | null) { return this.call("POST", "/api/replay", live ? { fixture, live } : { fixture }); }
    async validate(source: string, strict: boolean) {
        return (await this.call<{ findings: ops.Finding[] }>("POST", "/api/validate", { source, strict })).findings;
    }
    ship(source: string, strict: boolean) { return this.call("POST", "/api/workflows", { source, strict }); }
    async listTokens() { return (await this.call<{ tokens: Row[] }>("GET", "/api/tokens")).tokens; }
    createToken(role: string, scopes: string[], expires: string | null | undefined) {
        return this.call<{ id: number; token: string }>("POST", "/api/tokens", expires === undefined ? { role, scopes } : { role, scopes, expires });
    }
    async revokeToken(id: number) { await this.call("DELETE", `/api/tokens/${id}`); }

    /* The SSE stream; reconnects with Last-Event-ID until the server answers 204 (ended). */
    async follow(id: number, after: number, onEvent: (e: Row) => void): Promise<void> {
        let last = after;
        let failures = 0;
        for (;;) {
            let res: Response;
            try {
                res = await fetch(`${this.base}/api/runs/${id}/events?summary=true`, {
                    headers: { Authorization: `Bearer ${this.token}`, Accept: "text/event-stream", "Last-Event-ID": String(last) },
                });
            } catch (e) {
                if (++failures > 5) throw new ApiError(503, "08006", `could not reach ${this.base}: ${(e as Error).message}`);
                await new Promise((r) => setTimeout(r, 1000));
                continue;
            }
            if (res.status === 204) return;
            if (!res.ok || !res.body) {
                const d = (await res.json().catch(() => ({}))) as Row;
                throw new ApiError(res.status, (d.sqlstate as string) ?? null, String(d.message ?? `HTTP ${res.status}`),
                                   { detail: (d.detail as string) ?? null, hint: (d.hint as string) ?? null });
            }
            failures = 0;
            const decoder = new TextDecoder();
            let buf = "";
            let msg: { id?: string; event?: string; data: string[] } = { data: [] };
            try {
                for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
                    buf += decoder.decode(chunk, { stream: true });
                    let nl: number;
                    while ((nl = buf.indexOf("\n")) >= 0) {
                        const line = buf.slice(0, nl).replace(/\r$/, "");
                        buf = buf.slice(nl + 1);
                        if (line === "") {
                            if (msg.data.length) {
                                const data = JSON.parse(msg.data.join("\n")) as Row;
                                if (msg.event === "stream_error")
                                    throw new ApiError(Number(data.status ?? 500), (data.sqlstate as string) ?? null, String(data.message));
                                onEvent(data);
                                if (msg.id) last = Number(msg.id);
                            }
                            msg = { data: [] };
                        } else if (!line.startsWith(":")) {
                            const c = line.indexOf(":");
                            const field = c < 0 ? line : line.slice(0, c);
                            const value = c < 0 ? "" : line.slice(c + 1).replace(/^ /, "");
                            if (field === "data") msg.data.push(value);
                            else if (field === "id") msg.id = value;
                            else if (field === "event") msg.event = value;
                        }
                    }
                }
            } catch (e) {
                if (e instanceof ApiError) throw e;
                /* the connection broke: reconnect from the last event */
            }
        }
    }

    async close(): Promise<void> { /* nothing held */ }
}
