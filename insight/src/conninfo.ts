/*
 * conninfo.ts: connection settings the way libpq (and so psql) reads them.
 *
 * A CONNINFO is either keyword=value pairs ("host=/var/run/postgresql
 * dbname=shop user=insight", values in single quotes when they hold
 * spaces, \' and \\ inside) or a URI (postgresql://user@host:5432/db).
 * What it leaves out comes from libpq's environment variables (PGHOST,
 * PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGAPPNAME, PGSSLMODE,
 * PGCONNECT_TIMEOUT, PGOPTIONS), then from libpq's defaults: the socket
 * directory /var/run/postgresql when it exists (localhost otherwise), port
 * 5432, the operating system's user name, a database named like the user.
 * A password not given is looked up in ~/.pgpass (or PGPASSFILE) by
 * node-postgres.
 */
import { existsSync } from "node:fs";
import { userInfo } from "node:os";
import type { ClientConfig } from "pg";
import { parse as parseUri } from "pg-connection-string";

export class ConninfoError extends Error {}

const KEYWORDS = new Set([
    "host", "hostaddr", "port", "dbname", "user", "password", "application_name",
    "sslmode", "connect_timeout", "options", "passfile", "fallback_application_name",
]);

/* The keyword=value pairs of a libpq connection string. */
function parsePairs(text: string): Map<string, string> {
    const out = new Map<string, string>();
    let i = 0;
    const n = text.length;
    const space = (c: string | undefined) => c !== undefined && /\s/.test(c);
    while (i < n) {
        while (space(text[i])) i++;
        if (i >= n) break;
        let key = "";
        while (i < n && text[i] !== "=" && !space(text[i])) key += text[i++];
        while (space(text[i])) i++;
        if (text[i] !== "=")
            throw new ConninfoError(`missing "=" after "${key}" in connection info string`);
        i++;
        while (space(text[i])) i++;
        let value = "";
        if (text[i] === "'") {
            i++;
            for (;;) {
                if (i >= n) throw new ConninfoError("unterminated quoted string in connection info string");
                const c = text[i++];
                if (c === "\\" && i < n) value += text[i++];
                else if (c === "'") break;
                else value += c;
            }
        } else {
            while (i < n && !space(text[i])) {
                const c = text[i++];
                value += c === "\\" && i < n ? text[i++] : c;
            }
        }
        if (!KEYWORDS.has(key))
            throw new ConninfoError(`invalid connection option "${key}"`);
        out.set(key, value);
    }
    return out;
}

/* The settings of a URI, as keyword=value pairs. */
function uriPairs(text: string): Map<string, string> {
    const u = parseUri(text) as Record<string, unknown>;
    const out = new Map<string, string>();
    const put = (k: string, v: unknown) => {
        if (typeof v === "string" && v !== "") out.set(k, v);
        else if (typeof v === "number") out.set(k, String(v));
    };
    put("host", u.host);
    put("port", u.port);
    put("dbname", u.database);
    put("user", u.user);
    put("password", u.password);
    put("application_name", u.application_name);
    put("options", u.options);
    if (typeof u.sslmode === "string") put("sslmode", u.sslmode);
    return out;
}

/*
 * The pg ClientConfig of a CONNINFO (or of the environment alone when it
 * is empty or undefined).
 */
export function clientConfig(conninfo: string | undefined, applicationName: string): ClientConfig {
    const text = (conninfo ?? "").trim();
    const given = /^postgres(ql)?:\/\//.test(text) ? uriPairs(text) : parsePairs(text);
    const env = process.env;
    const pick = (key: string, envName: string) => given.get(key) ?? (env[envName] || undefined);

    let host = given.get("hostaddr") ?? pick("host", "PGHOST");
    if (host === undefined)
        host = existsSync("/var/run/postgresql") ? "/var/run/postgresql" : "localhost";
    const user = pick("user", "PGUSER") ?? userInfo().username;
    const portText = pick("port", "PGPORT") ?? "5432";
    const port = Number(portText);
    if (!Number.isInteger(port) || port <= 0 || port > 65535)
        throw new ConninfoError(`invalid port number: "${portText}"`);
    const config: ClientConfig = {
        host,
        port,
        user,
        database: pick("dbname", "PGDATABASE") ?? user,
        application_name: pick("application_name", "PGAPPNAME") ?? given.get("fallback_application_name") ?? applicationName,
    };
    const password = pick("password", "PGPASSWORD");
    if (password !== undefined) config.password = password;
    const timeout = pick("connect_timeout", "PGCONNECT_TIMEOUT");
    if (timeout !== undefined && Number(timeout) > 0) config.connectionTimeoutMillis = Number(timeout) * 1000;
    const options = pick("options", "PGOPTIONS");
    if (options !== undefined) config.options = options;
    const sslmode = pick("sslmode", "PGSSLMODE") ?? "disable";
    switch (sslmode) {
        case "disable":
        case "allow":
        case "prefer":
            break;
        case "require":
            config.ssl = { rejectUnauthorized: false };
            break;
        case "verify-ca":
        case "verify-full":
            config.ssl = { rejectUnauthorized: true };
            break;
        default:
            throw new ConninfoError(`invalid sslmode value: "${sslmode}"`);
    }
    return config;
}

/* Where a config connects, for messages: never the password. */
export function describe(config: ClientConfig): string {
    const where = String(config.host).startsWith("/") ? `socket ${config.host}/.s.PGSQL.${config.port}` : `${config.host}:${config.port}`;
    return `database "${config.database}" as "${config.user}" on ${where}`;
}
