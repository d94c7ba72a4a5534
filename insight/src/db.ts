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

/* int8 (run ids, counts) as numbers; timestamps stay Dates. */
pg.types.setTypeParser(20, (v: string) => Number(v));

export type Credentials =
    | { kind: "token"; token: string }
    | { kind: "hook"; path: string; body: string; signature: string };

/* What a statement of a transaction returns. */
export interface Tx {
    role: string;
    query<R extends QueryResultRow = Record<string, unknown>>(sql: string, params?: unknown[]): Promise<R[]>;
    notices: string[];
}

const AUTH_TOKEN_SQL =
    "SELECT pg_catalog.set_config('role', pg_catalog.pg_get_userbyid(a.r), true) AS role " +
    "FROM (SELECT tuvl.authenticate($1)::pg_catalog.oid AS r) a";
const AUTH_HOOK_SQL =
    "SELECT pg_catalog.set_config('role', pg_catalog.pg_get_userbyid(a.r), true) AS role " +
    "FROM (SELECT tuvl.verify_hook($1, $2, $3)::pg_catalog.oid AS r) a";

/* Does text look like a token tuvl.create_token() made? (checked before any query) */
export function wellFormedToken(text: string): boolean {
    return /^tuvl_[1-9][0-9]{0,18}_[A-Za-z0-9_-]{43}$/.test(text);
}

export class Database {
    readonly pool: pg.Pool;
    private readonly log: (msg: string) => void;

    constructor(config: ClientConfig, max: number, log: (msg: string) => void) {
        this.pool = new pg.Pool({ ...config, max, idleTimeoutMillis: 600_000 });
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
     * rolls back and is rethrown.
     */
    async asCaller<T>(cred: Credentials, fn: (tx: Tx) => Promise<T>, opts: { rollback?: boolean } = {}): Promise<T> {
        const client = await this.connect();
        const notices: string[] = [];
        const onNotice = (n: { message?: string }) => { if (n.message) notices.push(n.message); };
        let broken: Error | undefined;
        client.on("notice", onNotice);
        try {
            await client.query("BEGIN");
            const auth = cred.kind === "token"
                ? await client.query(AUTH_TOKEN_SQL, [cred.token])
                : await client.query(AUTH_HOOK_SQL, [cred.path, cred.body, cred.signature]);
            const tx: Tx = {
                role: String(auth.rows[0].role),
                notices,
                query: async <R extends QueryResultRow>(sql: string, params?: unknown[]) =>
                    (await client.query<R>(sql, params)).rows,
            };
            const result = await fn(tx);
            await client.query(opts.rollback ? "ROLLBACK" : "COMMIT");
            return result;
        } catch (e) {
            try {
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
