// helpers.mjs: the fixture of insight's tests, set up once for every test file.
//
// A database insight_test with tuvl, roles, workflows and tokens, made by
// the cluster's superuser (libpq's environment: PGHOST, PGPORT, PGUSER, as
// test/run's tuvl_start exports them), and a real server process,
// `insight/tuvl serve`, on 127.0.0.1 on a free port, connected as the
// authenticator role insight_auth.  Roles are the cluster's, so their names
// start with insight_.
import { spawn, spawnSync } from "node:child_process";
import { createHmac } from "node:crypto";
import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { after } from "node:test";

import pg from "pg";

export const INSIGHT = dirname(dirname(fileURLToPath(import.meta.url)));
export const ROOT = dirname(INSIGHT);
export const TUVL = join(INSIGHT, "tuvl");
export const DB = "insight_test";
export const TMP = mkdtempSync(join(tmpdir(), "insight-test-"));

pg.types.setTypeParser(20, Number);

/* A connection to the test database as the superuser (or another role). */
export async function connect(user) {
    const c = new pg.Client({ database: DB, ...(user ? { user } : {}), application_name: "insight test" });
    await c.connect();
    return c;
}

export async function sql(text, params = []) {
    const c = await connect();
    try {
        return (await c.query(text, params)).rows;
    } finally {
        await c.end();
    }
}

const WORKFLOWS = {
    insight_alice: [
        `name: greet
description: Greets someone
trigger:
  input:
    type: object
    required: [name]
    properties:
      name: { type: string, maxLength: 40 }
      address: { $ref: "#/$defs/address" }
    $defs:
      address: { type: object, properties: { city: { type: string } } }
steps:
  - id: hello
    kind: ModelOp
    sql: SELECT 'hello ' || $1 AS greeting
    params: ["{{ name }}"]
    output: g
    routes: { default: done }
ends:
  - { id: done, response: { greeting: "{{ g.0.greeting }}" } }`,
        `name: slow
trigger:
  input: { type: object, properties: { seconds: { type: number } } }
steps:
  - { id: first, kind: ModelOp, sql: "SELECT pg_sleep(0.4)", routes: { default: second } }
  - { id: second, kind: ModelOp, sql: "SELECT pg_sleep(0.4)", routes: { default: third } }
  - { id: third, kind: ModelOp, sql: "SELECT 3 AS n", output: n, routes: { default: done } }
ends:
  - { id: done, response: { n: "{{ n.0.n }}" } }`,
        `name: sleepy
steps:
  - { id: nap, kind: ModelOp, sql: "SELECT pg_sleep(1.5)", routes: { default: nap2 } }
  - { id: nap2, kind: ModelOp, sql: "SELECT pg_sleep(1.5)", routes: { default: wake } }
  - { id: wake, kind: ModelOp, sql: "SELECT 1 AS x", routes: { default: done } }
ends:
  - { id: done, response: { woke: true } }`,
        /* ten steps of 0.5 s: time for a command line to start under load, and a pause lands within 0.5 s */
        `name: steady
steps:
${Array.from({ length: 10 }, (_, i) => `  - { id: s${i}, kind: ModelOp, sql: "SELECT pg_sleep(0.5)", routes: { default: ${i < 9 ? `s${i + 1}` : "done"} } }`).join("\n")}
ends:
  - { id: done, response: { steady: true } }`,
        `name: quick_default
trigger:
  sync_timeout: 10s
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS x", routes: { default: done } }
ends:
  - { id: done, response: { quick: true } }`,
        `name: expense
trigger:
  input: { type: object, required: [amount], properties: { amount: { type: number } } }
steps:
  - id: review
    kind: Human
    form:
      type: object
      required: [approved]
      properties:
        approved: { type: boolean }
        comment: { type: string, maxLength: 200 }
    output: review
    routes: { default: route }
  - id: route
    kind: Router
    on: "{{ review.approved }}"
    routes: { "true": paid, default: refused }
ends:
  - { id: paid, response: { paid: "{{ amount }}" } }
  - { id: refused, response: { paid: 0 } }`,
        `name: writer
steps:
  - { id: write, kind: ModelOp, sql: "INSERT INTO insight_data.notes (note) VALUES ('written') RETURNING id", output: w, routes: { default: done } }
ends:
  - { id: done, response: { wrote: true } }`,
        `name: signed_hook
trigger:
  input: { type: object, required: [amount], properties: { amount: { type: number } } }
  http: { path: /insight/payments, signature: { secret: insight_hook_secret, header: X-Signature } }
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS x", routes: { default: done } }
ends:
  - { id: done, response: { amount: "{{ amount }}" } }`,
        `name: token_hook
trigger:
  http: { path: /insight/orders, method: PUT, sync_timeout: 10s }
steps:
  - { id: one, kind: ModelOp, sql: "SELECT 1 AS x", routes: { default: done } }
ends:
  - { id: done, response: { took: true } }`,
    ],
    insight_bob: [
        `name: bobs
steps:
  - { id: one, kind: ModelOp, sql: "SELECT pg_sleep(0.2)", routes: { default: done } }
ends:
  - { id: done, response: { bob: true } }`,
    ],
};

const ALL = ["runs:start", "runs:read", "runs:control", "people:answer", "workflows:write"];
const TOKENS = {
    alice: ["insight_alice", ALL],
    aliceStart: ["insight_alice", ["runs:start"]],
    aliceRead: ["insight_alice", ["runs:read"]],
    aliceControl: ["insight_alice", ["runs:control"]],
    aliceAdmin: ["insight_alice", ["admin"]],
    bob: ["insight_bob", ALL],
    carol: ["insight_carol", ["runs:read", "runs:control", "people:answer"]],
    nobody: ["insight_nobody", ALL],
    expired: ["insight_alice", ALL],
    revoked: ["insight_alice", ALL],
};

/* The README's refund_request, as it is written there. */
function readmeWorkflow() {
    const readme = readFileSync(join(ROOT, "README.md"), "utf8");
    const m = /SELECT tuvl\.register_workflow\(\$\$\n(name: refund_request\n[^]*?)\$\$\);/.exec(readme);
    if (!m) throw new Error("README.md has no refund_request workflow");
    return m[1];
}

async function setupDatabase() {
    const admin = new pg.Client({ database: "postgres", application_name: "insight test" });
    await admin.connect();
    /* one a run before left behind: FORCE ends its sessions and workers */
    await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
    await admin.query(`CREATE DATABASE ${DB}`);
    await admin.query(`DO $$ BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_auth') THEN CREATE ROLE insight_auth LOGIN NOINHERIT; END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_alice') THEN CREATE ROLE insight_alice LOGIN; END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_bob') THEN CREATE ROLE insight_bob LOGIN; END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_carol') THEN CREATE ROLE insight_carol LOGIN; END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_nobody') THEN CREATE ROLE insight_nobody LOGIN; END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'shop_app') THEN CREATE ROLE shop_app LOGIN; END IF;
        END $$`);
    await admin.end();
    const c = await connect();
    await c.query("CREATE EXTENSION tuvl");
    await c.query("GRANT tuvl_user TO insight_alice, insight_bob");
    await c.query("GRANT tuvl_operator TO insight_carol");
    await c.query("GRANT insight_alice, insight_bob, insight_carol, insight_nobody TO insight_auth");
    await c.query("CREATE SCHEMA insight_data; CREATE TABLE insight_data.notes (id serial PRIMARY KEY, note text)");
    await c.query("GRANT USAGE ON SCHEMA insight_data TO insight_alice; GRANT INSERT, SELECT ON insight_data.notes TO insight_alice; GRANT USAGE ON SEQUENCE insight_data.notes_id_seq TO insight_alice");
    /* docs/insight.md's examples: the role of security.md, the workflow of the README */
    await c.query("GRANT tuvl_user TO shop_app; GRANT shop_app TO insight_auth");
    await c.query(`CREATE SCHEMA shop;
        CREATE TABLE shop.orders (id int PRIMARY KEY, status text NOT NULL, amount numeric NOT NULL);
        CREATE TABLE shop.refunds (order_id int NOT NULL, amount numeric NOT NULL);
        INSERT INTO shop.orders VALUES (1, 'paid', 25.50), (2, 'shipped', 12.00);
        GRANT USAGE ON SCHEMA shop TO shop_app; GRANT SELECT ON shop.orders TO shop_app; GRANT SELECT, INSERT ON shop.refunds TO shop_app`);
    await c.query("SET ROLE shop_app");
    await c.query("SELECT tuvl.register_workflow($1)", [readmeWorkflow()]);
    await c.query("RESET ROLE");
    await c.query("SELECT tuvl.set_secret('insight_hook_secret', 'whsec_test_1234')");
    await c.query("SELECT tuvl.grant_secret('insight_hook_secret', 'insight_alice')");
    for (const [role, sources] of Object.entries(WORKFLOWS)) {
        await c.query(`SET ROLE ${role}`);
        for (const s of sources) await c.query("SELECT tuvl.register_workflow($1)", [s]);
        await c.query("RESET ROLE");
    }
    const tokens = {};
    for (const [name, [role, scopes]] of Object.entries(TOKENS))
        tokens[name] = (await c.query("SELECT tuvl.create_token($1::regrole, $2) AS t", [role, scopes])).rows[0].t;
    const id = (t) => Number(t.split("_")[1]);
    await c.query("UPDATE tuvl.token_store SET expires_at = now() - interval '1 minute' WHERE id = $1", [id(tokens.expired)]);
    await c.query("SELECT tuvl.revoke_token($1)", [id(tokens.revoked)]);
    await c.end();
    return tokens;
}

/* Start `insight/tuvl serve` on a free port; resolves with its URL and log. */
export async function startServer(extra = []) {
    const conninfo = `host=${process.env.PGHOST} port=${process.env.PGPORT ?? 5432} dbname=${DB} user=insight_auth`;
    const child = spawn(TUVL, ["serve", "--db", conninfo, "--port", "0", "--access-log", ...extra],
                        { stdio: ["ignore", "pipe", "pipe"] });
    const log = { text: "" };
    child.stderr.on("data", (d) => { log.text += d; });
    const url = await new Promise((resolve, reject) => {
        const t = setTimeout(() => reject(new Error(`the server did not start:\n${log.text}`)), 120_000);
        child.stdout.on("data", (d) => {
            log.text += d;
            const m = /listening on (http:\/\/[0-9.:]+)/.exec(log.text);
            if (m) {
                clearTimeout(t);
                resolve(m[1]);
            }
        });
        child.on("exit", (code) => reject(new Error(`the server exited (${code}):\n${log.text}`)));
    });
    return { url, log, child, stop: () => new Promise((r) => { child.once("exit", r); child.kill("SIGTERM"); }) };
}

/* Build the CLI once (insight/tuvl installs and builds on first use). */
const built = spawnSync(TUVL, ["--version"], { encoding: "utf8" });
if (built.status !== 0) throw new Error(`insight/tuvl does not run:\n${built.stderr}`);

export const tokens = await setupDatabase();
export const server = await startServer(["--body-limit", "65536", "--cors", "https://allowed.example", "--auth-delay", "1000"]);
export const URL_ = server.url;
/* Leave the cluster as it was: the suites that run after this one make roles of these names too. */
after(async () => {
    await server.stop();
    /*
     * The extension first, so that its workers leave the database and the
     * launcher starts none again; a terminated worker would be back before
     * a plain DROP DATABASE.  Every client is ended whatever fails: an open
     * one would keep the test runner from exiting.
     */
    const owner = new pg.Client({ database: DB, application_name: "insight test" });
    try {
        await owner.connect();
        await owner.query("DROP EXTENSION IF EXISTS tuvl CASCADE");
    } catch { /* DROP DATABASE ... WITH (FORCE) below cleans up anyway */ } finally {
        await owner.end().catch(() => {});
    }
    const admin = new pg.Client({ database: "postgres", application_name: "insight test" });
    await admin.connect();
    try {
        await admin.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
        await admin.query("DROP ROLE IF EXISTS shop_app, insight_alice, insight_bob, insight_carol, insight_nobody, insight_auth");
    } finally {
        await admin.end();
    }
});

/* A request to the server; the answer's status, headers and JSON (or text). */
export async function api(method, path, { token, body, headers = {}, raw } = {}) {
    const h = { ...headers };
    if (token) h.Authorization = `Bearer ${token}`;
    let payload;
    if (raw !== undefined) payload = raw;
    else if (body !== undefined) {
        payload = JSON.stringify(body);
        h["Content-Type"] = "application/json";
    }
    const res = await fetch(URL_ + path, { method, headers: h, body: payload });
    const text = await res.text();
    let json = null;
    try {
        json = text ? JSON.parse(text) : null;
    } catch { /* not JSON */ }
    return { status: res.status, headers: res.headers, json, text };
}

/* Poll until fn() is truthy. */
export async function until(fn, what, ms = 20_000) {
    const t0 = Date.now();
    for (;;) {
        const v = await fn();
        if (v) return v;
        if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
        await new Promise((r) => setTimeout(r, 50));
    }
}

export async function runStatus(id) {
    return (await sql("SELECT status FROM tuvl.runs WHERE id = $1", [id]))[0]?.status;
}

export async function waitStatus(id, statuses, ms = 20_000) {
    const want = Array.isArray(statuses) ? statuses : [statuses];
    return until(async () => { const s = await runStatus(id); return want.includes(s) ? s : null; }, `run ${id} to be ${want}`, ms);
}

export function sign(body, secret = "whsec_test_1234") {
    return createHmac("sha256", secret).update(body).digest("hex");
}

/* Run the CLI; its status, stdout and stderr. */
export function cli(args, { env = {}, input, cwd } = {}) {
    const out = spawnSync(TUVL, args, {
        encoding: "utf8", input, cwd,
        env: { ...process.env, PGDATABASE: DB, ...env },
        timeout: 60_000,
    });
    return { status: out.status, stdout: out.stdout, stderr: out.stderr };
}

export function readText(path) {
    return readFileSync(path, "utf8");
}
