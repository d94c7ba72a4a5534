/*
 * errors.ts: every error of the API is JSON, {sqlstate, message, detail,
 * hint}, with the HTTP status its SQLSTATE calls for.
 *
 * An error PostgreSQL raised keeps its SQLSTATE, message, detail and hint
 * as PostgreSQL gave them to the caller's role.  Errors of the server
 * itself (no token, a body that is not JSON, a body too large) take the
 * SQLSTATE of the PostgreSQL error closest in meaning, so that a client
 * handles both alike.  Nothing else leaves the server: an unexpected
 * failure is a 500 "internal error" and its stack goes to the server's
 * log only.
 */

export interface ErrorBody {
    sqlstate: string | null;
    message: string;
    detail: string | null;
    hint: string | null;
}

export class ApiError extends Error {
    readonly status: number;
    readonly sqlstate: string | null;
    readonly detail: string | null;
    readonly hint: string | null;
    readonly extra: Record<string, unknown> | undefined;
    readonly headers: Record<string, string> | undefined;

    constructor(status: number, sqlstate: string | null, message: string,
                opts: { detail?: string | null; hint?: string | null; extra?: Record<string, unknown>; headers?: Record<string, string> } = {}) {
        super(message);
        this.status = status;
        this.sqlstate = sqlstate;
        this.detail = opts.detail ?? null;
        this.hint = opts.hint ?? null;
        this.extra = opts.extra;
        this.headers = opts.headers;
    }

    body(): ErrorBody & Record<string, unknown> {
        return { sqlstate: this.sqlstate, message: this.message, detail: this.detail, hint: this.hint, ...(this.extra ?? {}) };
    }
}

/* The shape of an error node-postgres reports for an ErrorResponse. */
export interface PgError extends Error {
    code?: string;
    detail?: string;
    hint?: string;
    severity?: string;
}

export function isPgError(e: unknown): e is PgError {
    return e instanceof Error && typeof (e as PgError).code === "string" && /^[0-9A-Z]{5}$/.test((e as PgError).code as string)
        && typeof (e as PgError).severity === "string";
}

/* The HTTP status of a SQLSTATE (the table in docs/insight.md). */
export function statusOf(sqlstate: string, message: string): number {
    switch (sqlstate) {
        case "28000":
        case "28P01":
            return 401;
        case "42501":
            return 403;
        case "42704":
            return 404;
        case "54000":
            return 413;
        case "55000":
        case "55006":
        case "55P03":
        case "23505":
        case "22000":
            return 409;
        case "40001":
        case "40P01":
            return 503;
        case "57014":
            return 504;
        case "22023":
            return /does not match its schema/.test(message) ? 422 : 400;
    }
    const cls = sqlstate.slice(0, 2);
    /* tuvl missing, or not the version the server needs: the operator's to fix */
    if (sqlstate === "42883" || sqlstate === "42P01" || sqlstate === "3F000") return 500;
    if (cls === "22" || cls === "23" || cls === "42" || cls === "2F" || cls === "P0") return 400;
    if (cls === "08" || cls === "53" || cls === "57") return 503;
    return 500;
}

/* An ApiError from anything a handler threw. */
export function toApiError(e: unknown): ApiError {
    if (e instanceof ApiError) return e;
    if (isPgError(e)) {
        const code = e.code as string;
        const headers: Record<string, string> = {};
        const status = statusOf(code, e.message);
        if (status === 503) headers["Retry-After"] = "1";
        return new ApiError(status, code, e.message,
                            { detail: e.detail ?? null, hint: e.hint ?? null, headers });
    }
    return new ApiError(500, "XX000", "internal error", { hint: "The server's log has the details." });
}

/* The server's own errors. */
export const errors = {
    noToken: () => new ApiError(401, "28000", "no token", {
        detail: "The request has no Authorization header with a Bearer token.",
        hint: "Send Authorization: Bearer <token>; create one with tuvl.create_token().",
        headers: { "WWW-Authenticate": "Bearer" },
    }),
    badJson: (why: string) => new ApiError(400, "22P02", "the request body is not valid JSON", { detail: why }),
    badRequest: (message: string, hint?: string) => new ApiError(400, "22023", message, { hint: hint ?? null }),
    tooLarge: (limit: number) => new ApiError(413, "54000", `the request body is larger than ${limit} bytes`, {
        hint: "The server's --body-limit bounds request bodies.",
    }),
    notFound: (what: string) => new ApiError(404, "42704", what),
    methodNotAllowed: (allow: string) => new ApiError(405, "0A000", `this route takes ${allow}`, { headers: { Allow: allow } }),
};
