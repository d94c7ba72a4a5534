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

import { ApiError } from "./errors.js";

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

/* Does text look like a token tuvl.create_token() made? (checked before any query) */
export function wellFormedToken(text: string): boolean {
    return /^tuvl_[1-9][0-9]{0,18}_[A-Za-z0-9_-]{43}$/.test(text);
}

export class Database {
    readonly pool: pg.Pool;
    private readonly log: (msg: string) => void;

    constructor(config: ClientConfig, max: number, log: (msg: string) => void) {
        this.pool = new pg.Pool({ ...config, max, idleTimeoutMillis: 600_000, pipeline: true } as pg.PoolConfig);
        this.log = log;
        /* an idle client whose connection broke: the pool drops it */
        this.pool.on("error", (e) => this.log(`database connection lost: ${e.message}`));
    }

    private async connect(): Promise<PoolClient> {
        try {
            return await this.pool.connect();
        } catch (e) {
            this.log(`could not connect to the database: ${(e as Error).message}`);
            throw new ApiError(503, "08006", "the server could not connect to the database",
                               { hint: "Try again later; the server's log has the details." });
        }
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
                    ? send(AUTH_TOKEN_SQL, [cred.token])
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
            throw e;
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
            if (!("severity" in (e as object))) broken = e as Error;
            throw e;
        } finally {
            client.release(broken);
        }
    }

    async end(): Promise<void> {
        await this.pool.end();
    }
}
