/*
 * cli.ts: `insight/tuvl`, the command line, and `insight/tuvl serve`.
 *
 * Commands talk to the database directly, as psql does (libpq's
 * environment variables, or --db CONNINFO), or to a server of insight
 * (--url URL with a token from --token, --token-file or TUVL_TOKEN).
 * Human output by default; --json prints the API's JSON.  Exit status 0
 * on success, 1 when the database or the server refused (the error is
 * printed as psql prints one), 2 for a command line that makes no sense.
 */
import { readFileSync, mkdirSync, writeFileSync } from "node:fs";
import { dirname } from "node:path";

import type { Backend } from "./backend.js";
import { DirectBackend, HttpBackend } from "./backend.js";
import { connSettings, ConninfoError, describeSettings } from "./conninfo.js";
import { ApiError } from "./errors.js";
import * as fmt from "./format.js";
import { fillForm, Prompter } from "./form.js";
import * as ops from "./ops.js";

const USAGE = `insight/tuvl: tuvl's command line and HTTP server (docs/insight.md)

  insight/tuvl runs list [--workflow W] [--status S[,S...]] [--key K] [--limit N] [--before ID]
  insight/tuvl runs show ID          the run and its timeline
  insight/tuvl runs tail ID [--after SEQ]   its journal, live, until the run ends
  insight/tuvl runs pin ID [--out FILE|-]   the ended run as a replay fixture
                                     (default tests/fixtures/<workflow>/run-<id>.journal.json)
  insight/tuvl runs replay FILE [--live STEP[,STEP...]]   replay a fixture; exit 1 if it diverges
  insight/tuvl runs pause|resume ID
  insight/tuvl runs abort ID [REASON...]
  insight/tuvl runs steer ID MESSAGE...
  insight/tuvl people list
  insight/tuvl people answer ID [--data JSON | --approve | --reject | --decline | --cancel] [--note TEXT]
  insight/tuvl validate [--strict] FILE
  insight/tuvl ship [--strict] FILE  validate, then register as the next version
  insight/tuvl tokens create ROLE --scopes S[,S...] [--expires INTERVAL|never]
  insight/tuvl tokens list
  insight/tuvl tokens revoke ID
  insight/tuvl serve [--db CONNINFO] [--port 8080] [--host 127.0.0.1] [--pool 10]
               [--body-limit 1048576] [--max-wait '5 minutes'] [--max-streams 10000]
               [--auth-delay 250] [--cors ORIGIN[,ORIGIN...]] [--access-log] [--log-level info]

Where:  --db CONNINFO (else PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, as psql)
        --url URL with --token TOKEN, --token-file FILE or TUVL_TOKEN (TUVL_URL for --url)
Output: --json for the API's JSON instead of text
`;

const VALUE_FLAGS = new Set(["db", "url", "token", "token-file", "workflow", "status", "key", "limit", "before", "out", "live",
                             "scopes", "expires", "data", "note", "port", "host", "pool", "body-limit", "max-wait", "cors",
                             "auth-delay", "max-streams", "log-level", "after"]);
const BOOL_FLAGS = new Set(["json", "strict", "approve", "reject", "decline", "cancel", "access-log", "help", "version"]);

class UsageError extends Error {}

interface Args {
    words: string[];
    flags: Map<string, string>;
}

function parseArgs(argv: string[]): Args {
    const words: string[] = [];
    const flags = new Map<string, string>();
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        if (a === "--") {
            words.push(...argv.slice(i + 1));
            break;
        }
        if (a === "-h") {
            flags.set("help", "true");
            continue;
        }
        if (!a.startsWith("--") || a === "-") {
            words.push(a);
            continue;
        }
        const eq = a.indexOf("=");
        const name = eq < 0 ? a.slice(2) : a.slice(2, eq);
        if (BOOL_FLAGS.has(name)) {
            if (eq >= 0) throw new UsageError(`--${name} takes no value`);
            flags.set(name, "true");
        } else if (VALUE_FLAGS.has(name)) {
            const v = eq >= 0 ? a.slice(eq + 1) : argv[++i];
            if (v === undefined) throw new UsageError(`--${name} needs a value`);
            flags.set(name, v);
        } else throw new UsageError(`unknown option --${name}`);
    }
    return { words, flags };
}

function intArg(text: string | undefined, what: string): number {
    if (text === undefined) throw new UsageError(`${what} is missing`);
    const n = Number(text);
    if (!/^[0-9]+$/.test(text) || !Number.isSafeInteger(n)) throw new UsageError(`${what} must be a number, not "${text}"`);
    return n;
}

function readSource(file: string | undefined): string {
    if (!file) throw new UsageError("FILE is missing");
    try {
        return readFileSync(file === "-" ? 0 : file, "utf8");
    } catch (e) {
        throw new ApiError(400, "58P01", `could not read file "${file}": ${(e as NodeJS.ErrnoException).code ?? (e as Error).message}`);
    }
}

function backend(a: Args): Backend {
    const url = a.flags.get("url") ?? process.env.TUVL_URL;
    if (url) {
        let token = a.flags.get("token") ?? process.env.TUVL_TOKEN;
        const file = a.flags.get("token-file");
        if (file) token = readFileSync(file, "utf8").trim();
        if (!token) throw new UsageError("--url needs a token: --token, --token-file or TUVL_TOKEN");
        return new HttpBackend(url, token);
    }
    return new DirectBackend(connSettings(a.flags.get("db"), "tuvl cli"));
}

const out = (text: string) => process.stdout.write(text.endsWith("\n") ? text : text + "\n");
const json = (v: unknown) => out(JSON.stringify(v, null, 2));

/* -------------------------------------------------------------------- runs */

async function runs(a: Args, be: Backend, asJson: boolean): Promise<number> {
    const [, sub, ...rest] = a.words;
    const id = () => intArg(rest[0], "the run id");
    switch (sub) {
        case "list": {
            const status = a.flags.get("status")?.split(",").map((s) => s.trim()).filter(Boolean);
            const res = await be.listRuns({
                workflow: a.flags.get("workflow"), status, key: a.flags.get("key"),
                before: a.flags.has("before") ? intArg(a.flags.get("before"), "--before") : undefined,
                limit: a.flags.has("limit") ? intArg(a.flags.get("limit"), "--limit") : 20,
            });
            if (asJson) json(res);
            else {
                out(fmt.runsTable(res.runs));
                if (res.next) out(`more: ${res.next.startsWith("--") ? res.next : `--before ${res.runs[res.runs.length - 1].id}`}`);
            }
            return 0;
        }
        case "show": {
            const run = await be.getRun(id());
            const tl = await be.timeline(id());
            if (asJson) json({ run, timeline: tl });
            else {
                out(fmt.runHeader(run));
                out("");
                out(fmt.timelineHeader());
                for (const t of tl) out(fmt.timelineLine(t));
                const foot = fmt.runFooter(run);
                if (foot) out("\n" + foot);
            }
            return 0;
        }
        case "tail": {
            const run = await be.getRun(id());
            const created = new Date(String(run.created_at));
            if (!asJson) {
                out(fmt.runHeader(run));
                out(fmt.timelineHeader());
            }
            const after = a.flags.has("after") ? intArg(a.flags.get("after"), "--after") : 0;
            await be.follow(id(), after, (e) => (asJson ? out(JSON.stringify(e)) : out(fmt.eventLine(e, created))));
            const end = await be.getRun(id());
            if (!asJson) {
                out(`run ${end.id} ${end.status}${end.end ? ` at end ${end.end}` : ""}`);
                const foot = fmt.runFooter(end);
                if (foot) out(foot);
            }
            return 0;
        }
        case "pin": {
            const fixture = await be.pin(id());
            const dest = a.flags.get("out") ?? `tests/fixtures/${fixture.workflow}/run-${id()}.journal.json`;
            const text = JSON.stringify(fixture, null, 2) + "\n";
            if (dest === "-") process.stdout.write(text);
            else {
                mkdirSync(dirname(dest), { recursive: true });
                writeFileSync(dest, text);
                if (asJson) json({ run_id: id(), file: dest });
                else out(`pinned run ${id()} to ${dest}`);
            }
            return 0;
        }
        case "replay": {
            const file = rest[0];
            let fixture: unknown;
            try {
                fixture = JSON.parse(readSource(file));
            } catch (e) {
                if (e instanceof ApiError) throw e;
                throw new ApiError(400, "22P02", `${file} is not JSON: ${(e as Error).message}`);
            }
            const live = a.flags.get("live")?.split(",").map((s) => s.trim()).filter(Boolean) ?? null;
            const res = await be.replay(fixture, live);
            if (asJson) json(res);
            else out(`replay of ${file} ended as recorded: ${res.status}${res.end ? ` at end ${res.end}` : ""}, ` +
                     `${res.effects_served} effects served, ${res.effects_live ?? 0} live, ${res.tokens_spent ?? 0} tokens spent`);
            return 0;
        }
        case "pause":
        case "resume":
        case "abort":
        case "steer": {
            const args: ops.ControlArgs = {};
            if (sub === "abort") args.reason = rest.slice(1).join(" ") || null;
            if (sub === "steer") {
                args.message = rest.slice(1).join(" ");
                if (!args.message) throw new UsageError("steer needs a MESSAGE");
            }
            const res = await be.control(sub, id(), args);
            if (asJson) json(res);
            else {
                for (const n of (res.notices as string[] | undefined) ?? []) process.stderr.write(`NOTICE:  ${n}\n`);
                const done = { pause: "pause of", resume: "resumed", abort: "aborted", steer: "steered" }[sub];
                out(`${done} run ${res.run_id}${res.status ? ` (status ${res.status})` : ""}`);
            }
            return 0;
        }
        default:
            throw new UsageError(`unknown command: runs ${sub ?? ""}`.trim());
    }
}

/* -------------------------------------------------------------------- people */

async function people(a: Args, be: Backend, asJson: boolean): Promise<number> {
    const [, sub, idText] = a.words;
    if (sub === "list") {
        const rows = await be.people();
        if (asJson) json({ people: rows });
        else out(fmt.peopleTable(rows));
        return 0;
    }
    if (sub !== "answer") throw new UsageError(`unknown command: people ${sub ?? ""}`.trim());
    const id = intArg(idText, "the run id");
    const run = await be.getRun(id);
    const awaiting = (run.awaiting ?? {}) as Record<string, unknown>;
    const note = a.flags.get("note") ?? null;
    let res: Record<string, unknown>;
    if (run.status === "waiting_human" && (a.flags.has("decline") || a.flags.has("cancel"))) {
        /* an MCP server's question, declined or cancelled (tuvl.reject) */
        if (a.flags.has("decline") && a.flags.has("cancel")) throw new UsageError("--decline or --cancel, not both");
        res = await be.control("reject", id, { action: a.flags.has("cancel") ? "cancel" : "decline" });
    } else if (run.status === "waiting_human" && awaiting.kind === "mcp_elicitation" && !a.flags.has("data")) {
        /* an MCP server's question: its message, then accept (its form), decline or cancel */
        process.stderr.write(`run ${id} (${run.workflow}) waits at step ${run.step}: the MCP server ${awaiting.server} ` +
                             `asks, for its tool ${awaiting.tool}:\n  ${awaiting.message ?? ""}\n` +
                             (awaiting.mode === "url" ? `  (it sends you to ${awaiting.url})\n` : ""));
        const p = new Prompter();
        try {
            let choice = "";
            while (!/^[adc]$/.test(choice)) choice = (await p.ask("accept, decline or cancel? [a/d/c]: ")).toLowerCase().slice(0, 1);
            if (choice === "a") {
                const data = awaiting.mode === "url" ? {} : await fillForm(p, (awaiting.form ?? {}) as Record<string, unknown>);
                res = await be.control("submit", id, { data });
            } else {
                res = await be.control("reject", id, { action: choice === "d" ? "decline" : "cancel" });
            }
        } finally {
            p.close();
        }
    } else if (run.status === "waiting_human") {
        let data: unknown;
        if (a.flags.has("data")) {
            try {
                data = JSON.parse(a.flags.get("data") as string);
            } catch (e) {
                throw new UsageError(`--data is not JSON: ${(e as Error).message}`);
            }
        } else {
            process.stderr.write(`run ${id} (${run.workflow}) waits at step ${run.step} for this form:\n`);
            const p = new Prompter();
            try {
                data = await fillForm(p, (awaiting.form ?? {}) as Record<string, unknown>);
            } finally {
                p.close();
            }
        }
        res = await be.control("submit", id, { data });
    } else if (run.status === "waiting_approval") {
        let approved: boolean;
        let why = note;
        if (a.flags.has("approve") || a.flags.has("reject")) {
            if (a.flags.has("approve") && a.flags.has("reject")) throw new UsageError("--approve or --reject, not both");
            approved = a.flags.has("approve");
        } else {
            process.stderr.write(`run ${id} (${run.workflow}) waits at step ${run.step} for a decision on a call of ` +
                                 `${awaiting.tool}: ${JSON.stringify(awaiting.arguments ?? {})}\n`);
            const p = new Prompter();
            try {
                for (;;) {
                    const t = await p.ask("approve? [y/n]: ");
                    if (/^(y|yes)$/i.test(t) || /^(n|no)$/i.test(t)) {
                        approved = /^y/i.test(t);
                        break;
                    }
                }
                if (why === null) why = (await p.ask("note (optional): ")) || null;
            } finally {
                p.close();
            }
        }
        res = await be.control("decide", id, { approved, note: why });
    } else {
        throw new ApiError(409, "55000", `run ${id} waits for nobody: its status is ${run.status}`,
                           { hint: "insight/tuvl people list shows the runs that wait for a person." });
    }
    if (asJson) json(res);
    else out(`answered run ${id} (status ${res.status ?? "?"})`);
    return 0;
}

/* -------------------------------------------------------------------- workflows, tokens */

function printFindings(findings: ops.Finding[]): void {
    for (const f of findings) out(`${f.severity.padEnd(7)} ${f.path}: ${f.message}`);
}

async function validateCmd(a: Args, be: Backend, asJson: boolean, shipIt: boolean): Promise<number> {
    const file = a.words[1];
    const source = readSource(file);
    const strict = a.flags.has("strict");
    if (!shipIt) {
        const findings = await be.validate(source, strict);
        const bad = findings.some((f) => f.severity === "error");
        if (asJson) json({ ok: !bad, findings });
        else {
            printFindings(findings);
            out(bad ? `${file}: not valid` : `${file}: valid${findings.length ? ` (${findings.length} warning${findings.length === 1 ? "" : "s"})` : ""}`);
        }
        return bad ? 1 : 0;
    }
    try {
        const res = await be.ship(source, strict);
        if (asJson) json(res);
        else {
            printFindings((res.warnings as ops.Finding[]) ?? []);
            out(`registered ${res.workflow} version ${res.version}`);
        }
        return 0;
    } catch (e) {
        if (e instanceof ApiError && Array.isArray(e.extra?.findings) && !asJson) {
            printFindings(e.extra.findings as ops.Finding[]);
            out(`${file}: not shipped`);
            return 1;
        }
        throw e;
    }
}

async function tokens(a: Args, be: Backend, asJson: boolean): Promise<number> {
    const [, sub, arg] = a.words;
    switch (sub) {
        case "list": {
            const rows = await be.listTokens();
            if (asJson) json({ tokens: rows });
            else out(fmt.tokensTable(rows));
            return 0;
        }
        case "create": {
            if (!arg) throw new UsageError("tokens create needs a ROLE");
            const scopes = a.flags.get("scopes")?.split(",").map((s) => s.trim()).filter(Boolean);
            if (!scopes?.length) throw new UsageError("tokens create needs --scopes, such as --scopes runs:start,runs:read");
            const ex = a.flags.get("expires");
            const res = await be.createToken(arg, scopes, ex === undefined ? undefined : ex === "never" ? null : ex);
            if (asJson) json(res);
            else {
                out(res.token);
                process.stderr.write(`token ${res.id} for role ${arg}: shown once, keep it secret\n`);
            }
            return 0;
        }
        case "revoke": {
            const id = intArg(arg, "the token id");
            await be.revokeToken(id);
            if (asJson) json({ id, revoked: true });
            else out(`revoked token ${id}`);
            return 0;
        }
        default:
            throw new UsageError(`unknown command: tokens ${sub ?? ""}`.trim());
    }
}

/* -------------------------------------------------------------------- serve */

async function serve(a: Args): Promise<number> {
    const { Server } = await import("./server.js");
    const f = a.flags;
    const num = (name: string, dflt: number) => (f.has(name) ? intArg(f.get(name), `--${name}`) : dflt);
    const config = connSettings(f.get("db"), "tuvl insight");
    const server = new Server({
        db: config,
        host: f.get("host") ?? "127.0.0.1",
        port: num("port", 8080),
        pool: Math.max(1, num("pool", 10)),
        bodyLimit: Math.max(1024, num("body-limit", 1024 * 1024)),
        maxWait: f.get("max-wait") ?? "5 minutes",
        maxStreams: num("max-streams", 10000),
        authDelayMs: num("auth-delay", 250),
        cors: (f.get("cors") ?? "").split(",").map((s) => s.trim()).filter(Boolean),
        accessLog: f.has("access-log"),
        logLevel: f.get("log-level") ?? "info",
    });
    const stop = async (sig: string) => {
        server.app.log.info(`${sig}: stopping`);
        await server.close().catch(() => undefined);
        process.exit(0);
    };
    process.once("SIGTERM", () => void stop("SIGTERM"));
    process.once("SIGINT", () => void stop("SIGINT"));
    const where = await server.listen();
    server.app.log.info(`tuvl insight listening on ${where}, ${describeSettings(config)}`);
    return -1;          /* keep running */
}

/* -------------------------------------------------------------------- main */

function printError(e: unknown, asJson: boolean): void {
    if (e instanceof ApiError) {
        if (asJson) {
            process.stdout.write(JSON.stringify(e.body()) + "\n");
            return;
        }
        process.stderr.write(`ERROR:  ${e.message}\n`);
        if (e.detail) process.stderr.write(`DETAIL:  ${e.detail}\n`);
        if (e.hint) process.stderr.write(`HINT:  ${e.hint}\n`);
        return;
    }
    const err = e as NodeJS.ErrnoException;
    const where = err.code === "ECONNREFUSED" || err.code === "ENOENT" ? " (is the server running, and are PGHOST/PGPORT or --db right?)" : "";
    process.stderr.write(`insight/tuvl: ${err.message}${where}\n`);
}

async function main(argv: string[]): Promise<number> {
    let a: Args;
    try {
        a = parseArgs(argv);
    } catch (e) {
        process.stderr.write(`insight/tuvl: ${(e as Error).message}\n${USAGE}`);
        return 2;
    }
    if (a.flags.has("version")) {
        out("insight/tuvl 0.3.0");
        return 0;
    }
    const cmd = a.words[0];
    if (a.flags.has("help") || !cmd || cmd === "help") {
        process.stdout.write(USAGE);
        return cmd || a.flags.has("help") ? 0 : 2;
    }
    const asJson = a.flags.has("json");
    let be: Backend | undefined;
    try {
        if (cmd === "serve") return await serve(a);
        be = backend(a);
        switch (cmd) {
            case "runs": return await runs(a, be, asJson);
            case "people": return await people(a, be, asJson);
            case "validate": return await validateCmd(a, be, asJson, false);
            case "ship": return await validateCmd(a, be, asJson, true);
            case "tokens": return await tokens(a, be, asJson);
            default: throw new UsageError(`unknown command: ${cmd}`);
        }
    } catch (e) {
        if (e instanceof UsageError || e instanceof ConninfoError) {
            process.stderr.write(`insight/tuvl: ${e.message}\n`);
            if (e instanceof UsageError) process.stderr.write("Try insight/tuvl --help.\n");
            return 2;
        }
        printError(e, asJson);
        return 1;
    } finally {
        if (be) await be.close().catch(() => undefined);
    }
}

/* a reader that stopped reading (| head) is not an error */
process.stdout.on("error", (e: NodeJS.ErrnoException) => {
    if (e.code === "EPIPE") process.exit(process.exitCode ?? 0);
    throw e;
});

main(process.argv.slice(2)).then((code) => {
    if (code >= 0) process.exitCode = code;
}, (e) => {
    process.stderr.write(`insight/tuvl: ${(e as Error).stack ?? e}\n`);
    process.exitCode = 1;
});
