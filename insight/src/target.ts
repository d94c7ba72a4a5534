/*
 * target.ts: which server of a multi-host connection string to use, as
 * libpq chooses it, and choosing again after a failover.
 *
 * node-postgres connects to one host.  A Target holds the hosts of a
 * CONNINFO (conninfo.ts) and its target_session_attrs, and connects as
 * libpq does: each host in order, keeping the first whose session fits
 * (read-write: a session that accepts writes, SHOW transaction_read_only
 * is off; read-only: the opposite; primary: not in recovery; standby: in
 * recovery; prefer-standby: a standby, else any; any: the first that
 * answers).  The server's pool and its listener connect where the Target
 * says (current); when a connection breaks or finds its server read-only
 * (a failover: the old primary gone or demoted), the caller invalidates
 * the Target and the next connection tries the hosts again, from the
 * first, and keeps whichever fits now.  Listeners learn of the new host
 * ("resolved") and move too.
 *
 * While no host fits (the standby is being promoted), choosing fails
 * fast: one attempt at a time, and a failed one answers for 250 ms, so a
 * burst of requests during a failover costs a few connection attempts,
 * not one per request.
 */
import { EventEmitter } from "node:events";

import pg from "pg";
import type { ClientConfig } from "pg";

import type { ConnSettings, HostSpec, SessionAttrs } from "./conninfo.js";
import { ApiError, isPgError } from "./errors.js";

const FAILED_FOR_MS = 250;

/* The SQLSTATEs of a server that is going away or cannot take the session now. */
const GONE = new Set(["57P01", "57P02", "57P03", "08000", "08001", "08003", "08004", "08006", "08007", "08P01"]);

/* Does the session of a connected client fit attrs?  (any: yes, asks nothing) */
export async function fits(client: pg.Client, attrs: SessionAttrs, standbyPass = false): Promise<boolean> {
    if (attrs === "any" || (attrs === "prefer-standby" && !standbyPass)) return true;
    const r = await client.query<{ recovery: boolean; ro: string }>(
        "SELECT pg_catalog.pg_is_in_recovery() AS recovery, pg_catalog.current_setting('transaction_read_only') AS ro");
    const { recovery, ro } = r.rows[0];
    switch (attrs) {
        case "read-write":
            return ro === "off";
        case "read-only":
            return ro === "on";
        case "primary":
            return !recovery;
        case "standby":
        case "prefer-standby":
            return recovery;
    }
    return true;
}

const hostName = (h: HostSpec) => (h.host.startsWith("/") ? `socket ${h.host}/.s.PGSQL.${h.port}` : `${h.host}:${h.port}`);

/* No host fits: why, host by host, as libpq says it. */
export class NoHostError extends Error {
    constructor(readonly reasons: string[]) {
        super(`no server fits the connection string: ${reasons.join("; ")}`);
    }
}

/*
 * Connect a client to the first host of s that fits its
 * target_session_attrs (libpq's order); throws NoHostError.
 */
export async function connectFirst(s: ConnSettings, extra: Partial<ClientConfig> = {}): Promise<{ client: pg.Client; host: HostSpec }> {
    const reasons: string[] = [];
    const passes = s.targetSessionAttrs === "prefer-standby" ? [true, false] : [false];
    for (const standbyPass of passes)
        for (const h of s.hosts) {
            const client = new pg.Client({ ...s.base, ...extra, host: h.host, port: h.port });
            client.on("error", () => undefined);        /* an error after the end: nothing to do */
            try {
                await client.connect();
                if (await fits(client, s.targetSessionAttrs, standbyPass)) return { client, host: h };
                reasons.push(`${hostName(h)}: session is not ${standbyPass ? "standby" : s.targetSessionAttrs}`);
            } catch (e) {
                /* one host, any session: its own error, as before multi-host */
                if (s.hosts.length === 1 && s.targetSessionAttrs === "any") throw e;
                reasons.push(`${hostName(h)}: ${(e as Error).message}`);
            }
            await client.end().catch(() => undefined);
        }
    throw new NoHostError(reasons);
}

/*
 * Is e what a failover looks like from a connection: the connection
 * broke or was refused, the server is shutting down or starting, or (when
 * the session must accept writes) the server answered read-only?
 */
export function isFailover(e: unknown, attrs: SessionAttrs): boolean {
    if (e instanceof NoHostError) return true;
    if (isPgError(e)) {
        const code = e.code as string;
        if (GONE.has(code)) return true;
        return code === "25006" && (attrs === "read-write" || attrs === "primary");
    }
    if (e instanceof ApiError) return false;
    const err = e as NodeJS.ErrnoException;
    if (!(err instanceof Error)) return false;
    return ["ECONNREFUSED", "ECONNRESET", "EPIPE", "ETIMEDOUT", "ENOENT", "EHOSTUNREACH", "ENETUNREACH"].includes(err.code ?? "")
        || /Connection terminated|connection timeout|Client has encountered a connection error|not queryable|Query read timeout/i.test(err.message);
}

/* The answer of a request that met a failover: 503, and when to try again. */
export function unavailable(why: string): ApiError {
    return new ApiError(503, "08006", "the database is not available", {
        detail: why,
        hint: "The database is unreachable or failing over to another server; try again in a moment (Retry-After).",
        headers: { "Retry-After": "1" },
    });
}

export class Target extends EventEmitter {
    readonly settings: ConnSettings;
    /* the host that fits, null until chosen (again) */
    current: HostSpec | null = null;
    /* bumped at each invalidation: a connection of an older generation is not used again */
    generation = 0;
    private choosing: Promise<HostSpec> | null = null;
    private failedAt = 0;
    private failure: Error | null = null;

    constructor(settings: ConnSettings, private readonly log: (msg: string) => void) {
        super();
        this.settings = settings;
    }

    get attrs(): SessionAttrs {
        return this.settings.targetSessionAttrs;
    }

    /* The host to connect to: the one chosen, or choose (one attempt at a time). */
    async resolve(): Promise<HostSpec> {
        if (this.current) return this.current;
        /* one host and nothing to check: nothing to choose */
        if (this.settings.hosts.length === 1 && this.attrs === "any") return (this.current = this.settings.hosts[0]);
        if (this.failure && Date.now() - this.failedAt < FAILED_FOR_MS) throw this.failure;
        if (!this.choosing)
            this.choosing = this.choose().finally(() => { this.choosing = null; });
        return this.choosing;
    }

    private async choose(): Promise<HostSpec> {
        const gen = this.generation;
        try {
            const { client, host } = await connectFirst(this.settings, {
                application_name: `${this.settings.base.application_name ?? "tuvl"} (choosing a server)`,
            });
            await client.end().catch(() => undefined);
            this.failure = null;
            if (gen === this.generation) {
                const moved = this.last !== null && (this.last.host !== host.host || this.last.port !== host.port);
                this.current = host;
                this.last = host;
                if (moved) this.log(`database: now on ${hostName(host)}`);
                this.emit("resolved", host);
            }
            return host;
        } catch (e) {
            this.failure = e as Error;
            this.failedAt = Date.now();
            throw e;
        }
    }

    private last: HostSpec | null = null;

    /* A connection of generation gen met a failover: choose again (once per generation). */
    invalidate(gen: number, why: string): void {
        if (gen !== this.generation) return;
        this.generation++;
        if (this.current) this.log(`database: lost ${hostName(this.current)} (${why}); choosing a server again`);
        this.current = null;
        this.failure = null;
    }
}

export { hostName };
