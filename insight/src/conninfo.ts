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

export class ConninfoError extends Error {}

const KEYWORDS = new Set([
    "host", "hostaddr", "port", "dbname", "user", "password", "application_name",
    "sslmode", "connect_timeout", "options", "passfile", "fallback_application_name",
    "target_session_attrs",
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

function decode(part: string, text: string): string {
    try {
        return decodeURIComponent(part);
    } catch {
        throw new ConninfoError(`invalid percent-encoded token: "${part}" in URI "${text.replace(/:[^:@/]*@/, ":...@")}"`);
    }
}

/*
 * The settings of a URI, as keyword=value pairs:
 * postgresql://[user[:password]@][host[:port]][,host[:port]...][/dbname][?key=value&...]
 * (an IPv6 address in brackets, a socket directory percent-encoded or in ?host=).
 */
function uriPairs(text: string): Map<string, string> {
    const out = new Map<string, string>();
    let rest = text.replace(/^postgres(ql)?:\/\//, "");
    let query = "";
    const qi = rest.indexOf("?");
    if (qi >= 0) {
        query = rest.slice(qi + 1);
        rest = rest.slice(0, qi);
    }
    const si = rest.indexOf("/");
    let authority = rest;
    if (si >= 0) {
        authority = rest.slice(0, si);
        const db = decode(rest.slice(si + 1), text);
        if (db !== "") out.set("dbname", db);
    }
    const at = authority.lastIndexOf("@");
    if (at >= 0) {
        const userinfo = authority.slice(0, at);
        authority = authority.slice(at + 1);
        const ci = userinfo.indexOf(":");
        const user = decode(ci >= 0 ? userinfo.slice(0, ci) : userinfo, text);
        if (user !== "") out.set("user", user);
        if (ci >= 0) out.set("password", decode(userinfo.slice(ci + 1), text));
    }
    if (authority !== "") {
        const hosts: string[] = [];
        const ports: string[] = [];
        for (const part of authority.split(",")) {
            let host = part;
            let port = "";
            if (part.startsWith("[")) {
                const close = part.indexOf("]");
                if (close < 0) throw new ConninfoError(`end of string reached when looking for matching "]" in IPv6 host address in URI "${text}"`);
                host = part.slice(1, close);
                const after = part.slice(close + 1);
                if (after.startsWith(":")) port = after.slice(1);
                else if (after !== "")
                    throw new ConninfoError(`unexpected character "${after[0]}" at position ${text.indexOf(part) + close + 2} in URI (expected ":" or "/"): "${text}"`);
            } else {
                const ci = part.indexOf(":");
                if (ci >= 0) {
                    host = part.slice(0, ci);
                    port = part.slice(ci + 1);
                }
            }
            hosts.push(decode(host, text));
            ports.push(decode(port, text));
        }
        if (hosts.some((h) => h !== "")) out.set("host", hosts.join(","));
        if (ports.some((p) => p !== "")) out.set("port", ports.join(","));
    }
    for (const pair of query.split("&")) {
        if (pair === "") continue;
        const ei = pair.indexOf("=");
        if (ei < 0) throw new ConninfoError(`missing key/value separator "=" in URI query parameter: "${pair}"`);
        const key = decode(pair.slice(0, ei), text);
        const value = decode(pair.slice(ei + 1), text);
        if (key === "ssl" && value === "true") out.set("sslmode", "require");
        else if (!KEYWORDS.has(key)) throw new ConninfoError(`invalid URI query parameter: "${key}"`);
        else out.set(key, value);
    }
    return out;
}

/* A host to try: a name, an address or a socket directory, and a port. */
export interface HostSpec {
    host: string;
    port: number;
}

/* libpq's target_session_attrs: which server of a list a session keeps. */
export const SESSION_ATTRS = ["any", "read-write", "read-only", "primary", "standby", "prefer-standby"] as const;
export type SessionAttrs = (typeof SESSION_ATTRS)[number];

/*
 * Where and how to connect: the hosts to try in order, the session
 * attributes a server must have to be kept, and the rest of the
 * settings (the same for every host).
 */
export interface ConnSettings {
    hosts: HostSpec[];
    targetSessionAttrs: SessionAttrs;
    base: ClientConfig;
}

/* libpq's comma-separated lists: "a,b", an empty element is the default. */
function list(text: string | undefined): string[] | undefined {
    return text === undefined ? undefined : text.split(",").map((s) => s.trim());
}

/*
 * The settings of a CONNINFO (or of the environment alone when it is
 * empty or undefined), with libpq's multi-host forms: host=a,b
 * port=5432,5433 (one port for every host, or one per host; hostaddr
 * likewise), postgresql://a:5432,b:5433/db, and target_session_attrs (or
 * PGTARGETSESSIONATTRS).
 */
export function connSettings(conninfo: string | undefined, applicationName: string): ConnSettings {
    const text = (conninfo ?? "").trim();
    const given = /^postgres(ql)?:\/\//.test(text) ? uriPairs(text) : parsePairs(text);
    const env = process.env;
    const pick = (key: string, envName: string) => given.get(key) ?? (env[envName] || undefined);

    const names = list(pick("host", "PGHOST"));
    const addrs = list(given.get("hostaddr") ?? (env.PGHOSTADDR || undefined));
    if (names && addrs && names.length !== addrs.length)
        throw new ConninfoError(`could not match ${names.length} host names to ${addrs.length} hostaddr values`);
    const dflt = existsSync("/var/run/postgresql") ? "/var/run/postgresql" : "localhost";
    const count = (addrs ?? names ?? [""]).length;
    const hostAt = (i: number) => addrs?.[i] || names?.[i] || dflt;
    const portTexts = list(pick("port", "PGPORT")) ?? [""];
    if (portTexts.length !== 1 && portTexts.length !== count)
        throw new ConninfoError(`could not match ${portTexts.length} port numbers to ${count} hosts`);
    const hosts: HostSpec[] = [];
    for (let i = 0; i < count; i++) {
        const portText = (portTexts.length === 1 ? portTexts[0] : portTexts[i]) || "5432";
        const port = Number(portText);
        if (!/^[0-9]+$/.test(portText) || port <= 0 || port > 65535)
            throw new ConninfoError(`invalid port number: "${portText}"`);
        hosts.push({ host: hostAt(i), port });
    }
    const attrs = pick("target_session_attrs", "PGTARGETSESSIONATTRS") ?? "any";
    if (!(SESSION_ATTRS as readonly string[]).includes(attrs))
        throw new ConninfoError(`invalid target_session_attrs value: "${attrs}"`);

    const user = pick("user", "PGUSER") ?? userInfo().username;
    const config: ClientConfig = {
        user,
        database: pick("dbname", "PGDATABASE") ?? user,
        application_name: pick("application_name", "PGAPPNAME") ?? given.get("fallback_application_name") ?? applicationName,
    };
    const password = pick("password", "PGPASSWORD");
    if (password !== undefined) config.password = password;
    const timeout = pick("connect_timeout", "PGCONNECT_TIMEOUT");
    if (timeout !== undefined && Number(timeout) > 0) config.connectionTimeoutMillis = Number(timeout) * 1000;
    /*
     * JIT compilation off: every statement here is short, and the planner
     * compiles one whose estimate passes jit_above_cost, as a journal read
     * does on tables without statistics yet (15-40 ms a statement, where the
     * statement itself takes one).  Options given may turn it back on.
     */
    const options = pick("options", "PGOPTIONS");
    config.options = "-c jit=off" + (options !== undefined ? ` ${options}` : "");
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
    return { hosts, targetSessionAttrs: attrs as SessionAttrs, base: config };
}

/* The pg ClientConfig of a CONNINFO's first host. */
export function clientConfig(conninfo: string | undefined, applicationName: string): ClientConfig {
    const s = connSettings(conninfo, applicationName);
    return { ...s.base, host: s.hosts[0].host, port: s.hosts[0].port };
}

/* Where settings connect, for messages: never the password. */
export function describeSettings(s: ConnSettings): string {
    const where = (h: HostSpec) => (h.host.startsWith("/") ? `socket ${h.host}/.s.PGSQL.${h.port}` : `${h.host}:${h.port}`);
    const hosts = s.hosts.map(where).join(", ");
    return `database "${s.base.database}" as "${s.base.user}" on ${hosts}` +
        (s.targetSessionAttrs === "any" ? "" : ` (target_session_attrs=${s.targetSessionAttrs})`);
}

/* Where a config connects, for messages: never the password. */
export function describe(config: ClientConfig): string {
    const where = String(config.host).startsWith("/") ? `socket ${config.host}/.s.PGSQL.${config.port}` : `${config.host}:${config.port}`;
    return `database "${config.database}" as "${config.user}" on ${where}`;
}
