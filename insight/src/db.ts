/*
 * db.ts: each request is one transaction, as the caller's role.
 *
 * The server connects as an authenticator role that holds no privileges of
 * its own and is a member (NOINHERIT) of the roles it may act as.  A
 * request's transaction begins, calls tuvl.authenticate(token) first (or
 * tuvl.verify_hook() for a signed webhook), which records the token's
 * scopes for the transaction and returns its role, and takes that role
 * for the rest of the transaction: set_config('role', name, true) is
 * SET LOCAL ROLE with the name passed as a parameter (nothing to quote),
 * done in the same statement to save a round trip.  Everything after it
 * runs as that role, under its grants and row security, and the functions
 * of the API check the token's scopes themselves.  COMMIT or ROLLBACK
 * ends the role with the transaction, so a pooled connection never
 * carries a role from one request to the next.
 *
 * The token travels only as a query parameter: a failing authenticate()
 * is logged by PostgreSQL (log_min_error_statement) with "$1", not with
 * the token.
 */
import pg from "pg";
import type { ClientConfig, PoolClient, QueryResultRow } from "pg";

import { isFailover, Target, unavailable } from "./target.js";

export type Credentials =
    | { kind: "token"; token: string }
    | { kind: "hook"; path: string; body: string; signature: string };

/* A statement: its text, or a named one (prepared once per connection, planned once per role). */
export type Statement = string | { name: string; text: string };

/* What a statement of a transaction returns. */
export interface Tx {
    /* opts.last: the transaction's last statement, sent with the COMMIT */
    query<R extends QueryResultRow = Record<string, unknown>>(sql: Statement, params?: unknown[], opts?: { last?: boolean }): Promise<R[]>;
    notices: string[];
}

const AUTH_TOKEN_SQL = {
    name: "tuvl_insight_auth",
    text: "SELECT pg_catalog.set_config('role', pg_catalog.pg_get_userbyid(a.r), true) AS role " +
    "FROM (SELECT tuvl.authenticate($1)::pg_catalog.oid AS r) a",
};
const AUTH_HOOK_SQL = {
    name: "tuvl_insight_hook",
    text: "SELECT pg_catalog.set_config('role', pg_catalog.pg_get_userbyid(a.r), true) AS role " +
    "FROM (SELECT tuvl.verify_hook($1, $2, $3)::pg_catalog.oid AS r) a",
};

/* On a router (routerops.ts): partition 0's token, the router's transaction records its scopes. */
const AUTH_ROUTER_SQL = {
    name: "tuvl_insight_auth_router",
    text: "SELECT pg_catalog.set_config('role', tuvl_router.authenticate($1), true) AS role",
};

/*
 * Does text look like a token tuvl.create_token() made? (checked before
 * any query)  Its secret is 32 bytes in 43 base64url characters, whose
 * last one carries 2 bits of padding that are 0.
 */
export function wellFormedToken(text: string): boolean {
    return /^tuvl_[1-9][0-9]{0,18}_[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]$/.test(text);
}

/*
 * A pooled connection knows the generation of the Target it was made
 * for: after a failover (the Target invalidated), a connection of an
 * older generation is closed, never used again.
 */
type GenClient = PoolClient & { tuvlGeneration?: number };

export class Database {
    readonly pool: pg.Pool;
    readonly target: Target;
    /* a router database (tuvl_router), not a tuvl one */
    router = false;
    private readonly log: (msg: string) => void;

    constructor(target: Target, max: number, log: (msg: string) => void) {
        this.target = target;
        this.log = log;
        /* each new connection goes to the host the Target chose */
        class TargetClient extends pg.Client {
            tuvlGeneration: number;
            constructor(config?: ClientConfig) {
                const host = target.current;
                super(host ? { ...(config ?? {}), host: host.host, port: host.port } : config);
                this.tuvlGeneration = host ? target.generation : -1;
            }
        }
        this.pool = new pg.Pool({ ...target.settings.base, max, idleTimeoutMillis: 600_000, pipeline: true, Client: TargetClient } as unknown as pg.PoolConfig);
        /*
         * A connection that breaks while a request holds it (a server
         * killed, a backend terminated) emits "error" on its client, and
         * the pool listens only while the client is idle: without a
         * listener of its own, that error would end the whole process.
         * The request's statement fails with the same error and answers it.
         */
        this.pool.on("connect", (client) => {
            client.on("error", () => undefined);
        });
        /* an idle client whose connection broke: the pool drops it */
        this.pool.on("error", (e, client) => {
            this.log(`database connection lost: ${e.message}`);
            if (isFailover(e, target.attrs)) target.invalidate((client as GenClient).tuvlGeneration ?? -1, e.message);
        });
    }

    /* A message, but not the same one again within 5 s (a failover's burst of requests). */
    private lastLog = { text: "", at: 0 };
    private logOnce(text: string): void {
        const now = Date.now();
        if (text === this.lastLog.text && now - this.lastLog.at < 5000) return;
        this.lastLog = { text, at: now };
        this.log(text);
    }

    /*
     * A connection to the host that fits (target_session_attrs), or a 503
     * with Retry-After while none does (a failover).
     */
    private async connect(): Promise<GenClient> {
        for (let tries = 0; tries < 100; tries++) {
            const gen = this.target.generation;
            let client: GenClient;
            try {
                await this.target.resolve();
                client = await this.pool.connect() as GenClient;
            } catch (e) {
                this.logOnce(`could not connect to the database: ${(e as Error).message}`);
                if (isFailover(e, this.target.attrs)) this.target.invalidate(gen, (e as Error).message);
                throw unavailable("The server could not connect to a database server that fits its connection string; its log has the details.");
            }
            if (client.tuvlGeneration === this.target.generation && this.target.current) return client;
            client.release(true);       /* made for a server of before the failover */
        }
        throw unavailable("The database server changed too often.");
    }

    /* An error of a statement on client: a failover's becomes a 503, and the Target chooses again. */
    private failed(client: GenClient, e: unknown): unknown {
        if (!isFailover(e, this.target.attrs)) return e;
        this.log(`database: ${(e as Error).message}`);
        this.target.invalidate(client.tuvlGeneration ?? -1, (e as Error).message);
        return unavailable(`The database server went away or answered read-only (${(e as Error).message}).`);
    }

    /*
     * Run fn in a transaction authenticated by cred, as its role; commit
     * (or, with rollback, roll back) and return fn's result.  Any error
     * rolls back and is rethrown; when the authentication failed, its
     * error is the one thrown.
     *
     * The connection pipelines (pg's pipeline mode): BEGIN, the
     * authentication and fn's first statement leave together, and a
     * statement fn marks as the last one leaves with the COMMIT, so a
     * one-statement request costs one round trip, as a direct call does.
     * Nothing runs unauthenticated: a statement behind a failed
     * authenticate() meets an aborted transaction (25P02) and does nothing.
     */
    async asCaller<T>(cred: Credentials, fn: (tx: Tx) => Promise<T>, opts: { rollback?: boolean } = {}): Promise<T> {
        const client = await this.connect();
        const notices: string[] = [];
        const onNotice = (n: { message?: string }) => { if (n.message) notices.push(n.message); };
        let broken: Error | undefined;
        const sent: Promise<unknown>[] = [];
        const send = <R extends QueryResultRow>(sql: Statement, params?: unknown[]) => {
            const p = client.query<R>(sql as string, params);
            p.catch(() => undefined);
            sent.push(p);
            return p;
        };
        const end = opts.rollback ? "ROLLBACK" : "COMMIT";
        let ended: Promise<unknown> | null = null;
        client.on("notice", onNotice);
        /* what is sent in this tick leaves in one write (a syscall is dear) */
        const socket = (client as unknown as { connection?: { stream?: { cork?: () => void; uncork?: () => void } } }).connection?.stream;
        socket?.cork?.();
        const uncork = () => socket?.uncork?.();
        try {
            const begun = Promise.all([
                send("BEGIN"),
                cred.kind === "token"
                    ? send(this.router ? AUTH_ROUTER_SQL : AUTH_TOKEN_SQL, [cred.token])
                    : send(AUTH_HOOK_SQL, [cred.path, cred.body, cred.signature]),
            ]);
            begun.catch(() => undefined);       /* awaited below; not an unhandled rejection meanwhile */
            const tx: Tx = {
                notices,
                query: async <R extends QueryResultRow>(sql: Statement, params?: unknown[], o?: { last?: boolean }) => {
                    /* after the COMMIT, a statement would run as the authenticator, outside the transaction */
                    if (ended) throw new Error("a statement after the transaction's last one");
                    const p = send<R>(sql, params);
                    if (o?.last) ended = send(end);
                    return (await p).rows;
                },
            };
            let result: T;
            let running: Promise<T>;
            try {
                running = fn(tx);       /* its first statement is sent now, with BEGIN and the authentication */
            } finally {
                uncork();
            }
            try {
                result = await running;
            } catch (e) {
                await begun;            /* a failed authentication is the reason */
                throw e;
            }
            await begun;
            await (ended ?? send(end));
            return result;
        } catch (e) {
            try {
                await Promise.allSettled(sent);
                await client.query("ROLLBACK");
            } catch (e2) {
                broken = e2 as Error;
            }
            if (isFailover(e, this.target.attrs)) broken ??= e as Error;
            throw this.failed(client, e);
        } finally {
            client.off("notice", onNotice);
            client.release(broken);
        }
    }

    /* A statement as the authenticator itself (route lookups, health). */
    async anonymous<R extends QueryResultRow>(sql: string, params: unknown[] = []): Promise<R[]> {
        const client = await this.connect();
        let broken: Error | undefined;
        try {
            return (await client.query<R>(sql, params)).rows;
        } catch (e) {
            if (!("severity" in (e as object)) || isFailover(e, this.target.attrs)) broken = e as Error;
            throw this.failed(client, e);
        } finally {
            client.release(broken);
        }
    }

    async end(): Promise<void> {
        await this.pool.end();
    }
}
