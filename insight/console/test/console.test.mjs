/*
 * The console in a real browser: Debian's chromium (/usr/bin/chromium, or
 * TUVL_CHROMIUM) driven by playwright-core, against a real `insight/tuvl
 * serve` and the test cluster of test/run (PGHOST, PGPORT, TUVL_LLM_URL).
 * Never a downloaded browser: a missing chromium or console build fails.
 *
 * Roles: con_auth (the server's authenticator, NOINHERIT, member of the
 * others), con_alice and con_bob (tuvl_user, with passwords that
 * PostgreSQL checks by SCRAM: pg_hba.conf gets a line for them), and
 * con_carol (tuvl_operator).  Workflows are alice's.
 *
 *   test/run console
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";

import pg from "pg";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
const insight = join(here, "..", "..");
const CHROMIUM = process.env.TUVL_CHROMIUM ?? "/usr/bin/chromium";
const LLM_URL = process.env.TUVL_LLM_URL;
const LLM_ROOT = LLM_URL?.replace(/\/v1$/, "");
const DB = "tuvl_console";
const PW = { con_alice: "alice-Secret-1", con_bob: "bob-Secret-2", con_carol: "carol-Secret-3" };

let server, base, browser, admin, alice, hbaFile, hbaBefore;
const TIMEOUT = 20_000;

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function freePort() {
    return new Promise((resolve) => {
        const s = createServer();
        s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); });
    });
}

async function connect(database, user = "postgres", password) {
    const c = new pg.Client({ host: process.env.PGHOST, port: Number(process.env.PGPORT), database, user, password });
    await c.connect();
    return c;
}

async function script(name, turns) {
    const r = await fetch(`${LLM_ROOT}/_script`, { method: "POST", headers: { "Content-Type": "application/json" },
                                                   body: JSON.stringify({ name, turns }) });
    assert.equal(r.status, 200);
}

async function waitFor(fn, what, ms = TIMEOUT) {
    const t0 = Date.now();
    for (;;) {
        const v = await fn();
        if (v) return v;
        if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
        await sleep(100);
    }
}

/* a peer of test/servers (python, --port 0): its process and port, from the one line it prints */
async function startPeer(script, banner, ...args) {
    const proc = spawn("/usr/bin/python3", [join(insight, "..", "test", "servers", script), "--port", "0", ...args],
                       { stdio: ["ignore", "ignore", "pipe"] });
    let err = "";
    const port = await new Promise((resolve, reject) => {
        proc.stderr.on("data", (d) => {
            err += d;
            const m = new RegExp(`${banner}127\\.0\\.0\\.1:([0-9]+)\\n`).exec(err);
            if (m) resolve(Number(m[1]));
        });
        proc.once("exit", () => reject(new Error(`${script} did not start: ${err}`)));
    });
    proc.stderr.resume();
    return { proc, port, base: `http://127.0.0.1:${port}` };
}

const status = async (id) => (await admin.query("SELECT status FROM tuvl.runs WHERE id = $1", [id])).rows[0]?.status;
const waitStatus = (id, s) => waitFor(async () => (await status(id)) === s, `run ${id} to be ${s}`);
const start = async (wf, input = {}) => (await alice.query("SELECT tuvl.start_run($1, $2::jsonb) AS id", [wf, JSON.stringify(input)])).rows[0].id;
const events = async (id, type) => (await admin.query("SELECT type, payload FROM tuvl.events WHERE run_id = $1 AND type = $2 ORDER BY seq", [id, type])).rows;

const SCHEMA = `
CREATE SCHEMA con;
GRANT USAGE ON SCHEMA con TO PUBLIC;
CREATE FUNCTION con.slow(ctx jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
    BEGIN PERFORM pg_sleep(coalesce((ctx ->> 'secs')::float8, 0.4)); RETURN '{"slept": true}'::jsonb; END $$;
CREATE FUNCTION con.lookup(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"order": "A-17", "total": 42}'::jsonb $$;
CREATE FUNCTION con.refund(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('refunded', ctx -> 'amount') $$;
`;

const SLOW = `
name: con_slow
description: three slow steps
steps:
  - { id: a, kind: Functional, function: con.slow, output: a }
  - { id: b, kind: Functional, function: con.slow, output: b }
  - { id: c, kind: Functional, function: con.slow, output: c, routes: { default: done } }
ends:
  - { id: done, status: completed, response: { ok: true } }
`;

const EXPENSE = `
name: con_expense
steps:
  - id: review
    kind: Human
    description: A manager approves or rejects the expense
    form:
      type: object
      required: [approved]
      properties:
        approved: { type: boolean, title: Approved }
        comment: { type: string, title: Comment, maxLength: 10 }
    output: review
    routes: { default: done }
ends:
  - { id: done, status: completed, response: { approved: "{{ review.approved }}", comment: "{{ review.comment }}" } }
`;

function agentYaml(model) {
    return `
name: con_agent
steps:
  - id: triage
    kind: Agent
    mode: autonomous
    agent:
      model: ${model}
      tools:
        - { ref: lookup }
        - { ref: refund, approval: true }
      max_iterations: 6
    routes: { default: done }
  - id: lookup
    kind: Functional
    description: Look an order up
    function: con.lookup
  - id: refund
    kind: Functional
    description: Refund an order
    function: con.refund
ends:
  - { id: done, status: completed, response: "{{ triage_result }}" }
`;
}

async function newPage(ctxOpts = {}) {
    const ctx = await browser.newContext({ acceptDownloads: true, ...ctxOpts });
    const page = await ctx.newPage();
    page.setDefaultTimeout(TIMEOUT);
    return page;
}

async function signIn(page, role) {
    await page.goto(`${base}/console/`);
    await page.getByLabel("PostgreSQL role").fill(role);
    await page.getByLabel("Password").fill(PW[role]);
    await page.getByRole("button", { name: "Sign in" }).click();
    await page.getByTestId("role").filter({ hasText: role }).waitFor();
}

before(async () => {
    assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: apt-get install chromium (test/run installs it)`);
    assert.ok(existsSync(join(insight, "console", "dist", "index.html")), "the console is not built (insight/tuvl builds it)");
    assert.ok(LLM_URL, "TUVL_LLM_URL is not set: run through test/run console");

    const pgc = await connect("postgres");
    await pgc.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
    await pgc.query(`CREATE DATABASE ${DB}`);
    admin = await connect(DB);
    await admin.query("CREATE EXTENSION tuvl");
    for (const r of ["con_auth", "con_alice", "con_bob", "con_carol"]) {
        await pgc.query(`DROP OWNED BY ${r}`).catch(() => undefined);
        await pgc.query(`DROP ROLE IF EXISTS ${r}`);
    }
    await pgc.query("SET password_encryption = 'scram-sha-256'");
    for (const r of ["con_alice", "con_bob", "con_carol"]) await pgc.query(`CREATE ROLE ${r} LOGIN PASSWORD '${PW[r]}' IN ROLE tuvl_user`);
    await pgc.query("GRANT tuvl_operator TO con_carol");
    await pgc.query("CREATE ROLE con_auth LOGIN NOINHERIT");
    await pgc.query("GRANT con_alice, con_bob, con_carol TO con_auth");
    /* the test roles' passwords are checked (SCRAM) over TCP; every other role keeps trust */
    hbaFile = (await pgc.query("SHOW hba_file")).rows[0].hba_file;
    hbaBefore = readFileSync(hbaFile, "utf8");
    writeFileSync(hbaFile, "host all con_alice,con_bob,con_carol 127.0.0.1/32 scram-sha-256\n" + hbaBefore);
    await pgc.query("SELECT pg_reload_conf()");
    await pgc.end();

    await admin.query(SCHEMA);
    await admin.query(`GRANT CREATE ON DATABASE ${DB} TO con_alice`);
    alice = await connect(DB, "con_alice", PW.con_alice);
    for (const src of [SLOW, EXPENSE]) await alice.query("SELECT tuvl.register_workflow($1)", [src]);
    await script("con_agent", [
        { text: "Let me look the order up.", tool_calls: [{ name: "lookup", arguments: { order: "A-17" } }] },
        { tool_calls: [{ name: "refund", arguments: { order: "A-17", amount: 42 } }] },
        { text: "Refund handled: {{last_user}}" },
    ]);
    await alice.query("SELECT tuvl.register_llm($1)", [`name: con_agent\nprovider: openai\nbase_url: ${LLM_URL}\nmodel: con_agent\ntimeout: 10s\n`]);
    await alice.query("SELECT tuvl.register_workflow($1)", [agentYaml("con_agent")]);

    const port = await freePort();
    server = spawn(join(insight, "tuvl"), ["serve", "--db", `host=127.0.0.1 port=${process.env.PGPORT} dbname=${DB} user=con_auth`,
                                           "--port", String(port)], { stdio: ["ignore", "inherit", "inherit"] });
    base = `http://127.0.0.1:${port}`;
    await waitFor(async () => (await fetch(`${base}/health`).catch(() => null))?.ok, "the server", 120_000);
    browser = await chromium.launch({ executablePath: CHROMIUM, args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"] });
});

/*
 * TUVL_SCREENSHOTS=DIR: the main pages as PNG files in DIR, from the data
 * the tests left (insight/console/screenshots runs this for docs/insight.md).
 */
async function screenshots(dir) {
    const waiting = await start("con_expense", {});
    await waitStatus(waiting, "waiting_human");
    const { rows: [{ id: agentRun }] } = await admin.query("SELECT max(id) AS id FROM tuvl.runs WHERE workflow = 'con_agent' AND status = 'completed'");
    const page = await newPage({ viewport: { width: 1280, height: 800 } });
    await signIn(page, "con_alice");
    const shot = async (path, name, ready) => {
        await page.goto(`${base}${path}`);
        await ready();
        await sleep(300);
        await page.screenshot({ path: join(dir, name), fullPage: false });
    };
    await shot("/console/runs", "insight-runs.png", () => page.locator("tr[data-run]").first().waitFor());
    await shot(`/console/runs/${agentRun}`, "insight-run-agent.png", () => page.locator(".toolcall").first().waitFor());
    await shot("/console/people", "insight-people.png", () => page.getByTestId(`form-${waiting}`).waitFor());
    await shot("/console/workflows/con_slow", "insight-workflow.png", () => page.locator(".graph svg").waitFor());
    await shot("/console/metrics", "insight-metrics.png", () => page.getByRole("img", { name: "Runs by status" }).waitFor());
    await page.goto(`${base}/console/fixtures?run=${agentRun}`);
    await page.getByRole("button", { name: "Replay", exact: true }).click();
    await page.getByTestId("replay-result").waitFor();
    await page.screenshot({ path: join(dir, "insight-fixtures.png") });
    await page.setViewportSize({ width: 390, height: 844 });
    await shot(`/console/runs/${agentRun}`, "insight-phone.png", () => page.locator(".toolcall").first().waitFor());
    await page.context().close();
}

after(async () => {
    if (process.env.TUVL_SCREENSHOTS && browser) await screenshots(process.env.TUVL_SCREENSHOTS);
    await browser?.close();
    if (server) { server.kill("SIGTERM"); await new Promise((r) => server.once("exit", r)); }
    await alice?.end();
    await admin?.end();
    if (hbaFile) {
        writeFileSync(hbaFile, hbaBefore);
        const pgc = await connect("postgres");
        await pgc.query("SELECT pg_reload_conf()");
        /* TUVL_CONSOLE_KEEP=1 keeps the database and its roles to look at */
        if (!process.env.TUVL_CONSOLE_KEEP) {
            await pgc.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
            for (const r of ["con_auth", "con_alice", "con_bob", "con_carol"]) await pgc.query(`DROP ROLE IF EXISTS ${r}`);
        }
        await pgc.end();
    }
});

describe("console", () => {
    test("sign in: a wrong password is refused by PostgreSQL, the right one opens the runs page; the cookie is HttpOnly and SameSite", async () => {
        const page = await newPage();
        await page.goto(`${base}/console/`);
        await page.getByLabel("PostgreSQL role").fill("con_alice");
        await page.getByLabel("Password").fill("wrong");
        await page.getByRole("button", { name: "Sign in" }).click();
        await page.getByRole("alert").filter({ hasText: "sign-in failed" }).waitFor();
        await page.getByLabel("Password").fill(PW.con_alice);
        await page.getByRole("button", { name: "Sign in" }).click();
        await page.getByRole("heading", { name: "Runs" }).waitFor();
        const [cookie] = await page.context().cookies();
        assert.equal(cookie.name, "tuvl_session");
        assert.equal(cookie.httpOnly, true);
        assert.equal(cookie.sameSite, "Strict");
        assert.equal(await page.evaluate(() => document.cookie), "", "scripts cannot read the session");
        /* a POST with the cookie but without the CSRF header is refused */
        const r = await page.evaluate(async () => (await fetch("/api/runs/1/pause", { method: "POST" })).status);
        assert.equal(r, 403);
        await page.context().close();
    });

    test("sign in with an API token", async () => {
        const { rows: [{ t }] } = await alice.query("SELECT tuvl.create_token('con_alice', '{runs:read}') AS t");
        const page = await newPage();
        await page.goto(`${base}/console/`);
        await page.getByRole("tab", { name: "API token" }).click();
        await page.getByLabel("Token").fill(t);
        await page.getByRole("button", { name: "Sign in" }).click();
        await page.getByTestId("role").filter({ hasText: "con_alice" }).waitFor();
        await page.context().close();
    });

    test("a run goes from queued to completed on its page without a reload", async () => {
        const page = await newPage();
        await signIn(page, "con_alice");
        const id = await start("con_slow", { secs: 1.5 });
        await page.goto(`${base}/console/runs/${id}`);
        await page.evaluate(() => {
            window.__seen = [];
            window.__marker = "same page";
            const note = () => {
                const b = document.querySelector("h1 .badge");
                if (b && window.__seen[window.__seen.length - 1] !== b.dataset.status) window.__seen.push(b.dataset.status);
            };
            note();
            new MutationObserver(note).observe(document.body, { subtree: true, childList: true, attributes: true });
        });
        await page.locator("h1 .badge[data-status=completed]").waitFor();
        const seen = await page.evaluate(() => window.__seen);
        assert.ok(["queued", "running"].includes(seen[0]), `first status seen: ${seen}`);
        assert.equal(seen[seen.length - 1], "completed");
        assert.equal(await page.evaluate(() => window.__marker), "same page");
        await page.getByRole("tab", { name: /Timeline/ }).click();
        await page.locator("tr[data-event=run_queued]").waitFor();
        await page.locator("tr[data-event=run_completed]").waitFor();
        /* the runs list shows it, and filters by status */
        await page.goto(`${base}/console/runs?status=completed`);
        await page.locator(`tr[data-run="${id}"]`).waitFor();
        await page.context().close();
    });

    test("a run's page reads its journal once, renders it, and follows the stream only after its last seq", async () => {
        const done = await start("con_slow", { secs: 0.1 });
        await waitStatus(done, "completed");
        const page = await newPage();
        await signIn(page, "con_alice");
        const urls = [];
        page.on("request", (r) => urls.push(new URL(r.url()).pathname + new URL(r.url()).search));
        await page.goto(`${base}/console/runs/${done}`);
        await page.getByRole("tab", { name: /Timeline/ }).click();
        await page.locator("tr[data-event=run_completed]").waitFor();
        assert.equal(urls.filter((u) => u === `/api/console/runs/${done}/journal`).length, 1, urls.join(" "));
        assert.deepEqual(urls.filter((u) => u.startsWith(`/api/runs/${done}/events`)), [], "an ended run needs no stream");
        /* a live run: the stream starts after what the journal read gave */
        const live = await start("con_slow", { secs: 1.5 });
        urls.length = 0;
        await page.goto(`${base}/console/runs/${live}`);
        await page.locator("h1 .badge[data-status=completed]").waitFor();
        const streams = urls.filter((u) => u.startsWith(`/api/runs/${live}/events`));
        assert.ok(streams.length >= 1 && streams.every((u) => /[?&]after=[0-9]+/.test(u)), streams.join(" "));
        await page.context().close();
    });

    test("an agent run shows its conversation with tool calls; a tool call is approved, another rejected, with notes", async () => {
        const r1 = await start("con_agent", { task: "refund order A-17" });
        const r2 = await start("con_agent", { task: "refund order A-17 again" });
        await waitStatus(r1, "waiting_approval");
        await waitStatus(r2, "waiting_approval");
        const page = await newPage();
        await signIn(page, "con_alice");
        await page.goto(`${base}/console/runs/${r1}`);
        await page.getByRole("tab", { name: "Conversation" }).click();
        await page.locator(".toolcall[data-tool=lookup]").first().waitFor();
        await page.locator(".msg[data-event=tool_result]").first().waitFor();
        await page.locator(".toolcall[data-tool=refund]").first().waitFor();

        await page.goto(`${base}/console/people`);
        const a1 = page.getByTestId(`approval-${r1}`);
        await a1.getByLabel("Note (optional)").fill("ok by me");
        await a1.getByRole("button", { name: "Approve" }).click();
        await page.getByRole("status").filter({ hasText: `Approved: refund of run #${r1}` }).waitFor();
        const a2 = page.getByTestId(`approval-${r2}`);
        await a2.getByLabel("Note (optional)").fill("twice is too many");
        await a2.getByRole("button", { name: "Reject" }).click();
        await page.getByRole("status").filter({ hasText: `Rejected: refund of run #${r2}` }).waitFor();
        const [d1] = await events(r1, "approval_decided");
        const [d2] = await events(r2, "approval_decided");
        assert.equal(d1.payload.approved, true);
        assert.equal(d1.payload.note, "ok by me");
        assert.equal(d1.payload.by, "con_alice");
        assert.equal(d2.payload.approved, false);
        assert.equal(d2.payload.note, "twice is too many");
        await waitStatus(r1, "completed");
        await page.context().close();
    });

    test("a Human step's form: a schema violation is refused before submit, a valid answer completes the run", async () => {
        const id = await start("con_expense", {});
        await waitStatus(id, "waiting_human");
        const page = await newPage();
        await signIn(page, "con_alice");
        await page.goto(`${base}/console/people`);
        const form = page.getByTestId(`form-${id}`);
        await form.getByLabel("Approved").check();
        await form.getByLabel("Comment").fill("far too long a comment");
        let posted = 0;
        page.on("request", (r) => { if (r.url().endsWith(`/api/runs/${id}/submit`)) posted++; });
        await form.getByRole("button", { name: "Submit" }).click();
        await form.locator(".error-detail, .errors").first().waitFor();
        assert.equal(posted, 0, "an invalid form is not sent");
        assert.equal(await status(id), "waiting_human");
        await form.getByLabel("Comment").fill("fine");
        await form.getByRole("button", { name: "Submit" }).click();
        await page.getByRole("status").filter({ hasText: `Submitted to run #${id}` }).waitFor();
        await waitStatus(id, "completed");
        const { rows: [r] } = await admin.query("SELECT response FROM tuvl.runs WHERE id = $1", [id]);
        assert.deepEqual(r.response, { approved: true, comment: "fine" });
        await page.context().close();
    });

    test("abort asks for a confirmation; cancel leaves the run, confirm aborts it", async () => {
        const id = await start("con_slow", { secs: 10 });
        const page = await newPage();
        await signIn(page, "con_alice");
        await page.goto(`${base}/console/runs/${id}`);
        await page.getByRole("button", { name: "Abort" }).click();
        const dialog = page.getByRole("dialog");
        await dialog.getByRole("button", { name: "Cancel" }).click();
        await dialog.waitFor({ state: "hidden" });
        assert.ok(!["aborted"].includes(await status(id)));
        await page.getByRole("button", { name: "Abort" }).click();
        await dialog.getByLabel("Reason (optional)").fill("changed my mind");
        await dialog.getByRole("button", { name: "Abort run" }).click();
        await page.locator("h1 .badge[data-status=aborted]").waitFor();
        const [a] = await events(id, "run_aborted");
        assert.equal(a.payload.reason, "changed my mind");
        assert.equal(a.payload.by, "con_alice");
        await page.context().close();
    });

    test("pin a run (a fixture is downloaded) and replay it, with a step live; a changed fixture shows where it diverged", async () => {
        const { rows: [{ id }] } = await admin.query("SELECT id FROM tuvl.runs WHERE workflow = 'con_agent' AND status = 'completed' ORDER BY id LIMIT 1");
        assert.ok(id, "the agent run completed");
        const page = await newPage();
        await signIn(page, "con_alice");
        await page.goto(`${base}/console/fixtures`);
        await page.getByLabel("Run").fill(String(id));
        const [dl] = await Promise.all([page.waitForEvent("download"), page.getByRole("button", { name: /Pin and download/ }).click()]);
        const fixture = JSON.parse(readFileSync(await dl.path(), "utf8"));
        assert.equal(fixture.run_id, Number(id));
        assert.ok(fixture.effects.length > 0);
        await page.getByRole("button", { name: "Replay", exact: true }).click();
        await page.getByTestId("replay-result").filter({ hasText: "same as recorded" }).waitFor();
        /* the Functional tool steps live (SQL runs for real anyway); the model's answers from the recording */
        await page.getByRole("checkbox", { name: "triage" }).check();
        await page.getByRole("button", { name: "Replay", exact: true }).click();
        await page.getByTestId("replay-result").waitFor();
        /* a fixture whose recorded answer was changed: the replay diverges and says where */
        const changed = structuredClone(fixture);
        const llm = changed.effects.find((e) => e.op === "llm" || e.type === "llm") ?? changed.effects[0];
        llm.step = "somewhere_else";
        const file = join(process.env.TUVL_TMP ?? "/tmp", `changed-${id}.json`);
        writeFileSync(file, JSON.stringify(changed));
        await page.getByLabel("Fixture file").setInputFiles(file);
        await page.getByRole("button", { name: "Replay", exact: true }).click();
        await page.getByTestId("divergence").filter({ hasText: "diverged" }).waitFor();
        await page.context().close();
    });

    test("dev mode: a breakpoint pauses a run before its step; step mode advances it one step per click", async () => {
        const page = await newPage();
        await signIn(page, "con_alice");
        await page.goto(`${base}/console/workflows/con_slow`);
        await page.locator("input[data-breakpoint=b]").click();
        await page.locator(".graph g.node.bp[data-step=b]").waitFor();
        const id = await start("con_slow", { secs: 0.2 });
        await waitStatus(id, "paused");
        const { rows: [r] } = await admin.query("SELECT current_step FROM tuvl.runs WHERE id = $1", [id]);
        assert.equal(r.current_step, "b");
        const [p] = await events(id, "paused");
        assert.equal(p.payload.by, "breakpoint");
        await page.goto(`${base}/console/runs/${id}`);
        await page.getByTestId("current-step").filter({ hasText: "b" }).waitFor();
        await page.getByRole("button", { name: "Step", exact: true }).click();
        await page.getByRole("dialog").getByRole("button", { name: "Step", exact: true }).click();
        await waitFor(async () => (await events(id, "paused")).length === 2 && (await status(id)) === "paused", "the second pause");
        const ps = await events(id, "paused");
        assert.equal(ps[1].payload.by, "step");
        assert.equal(ps[1].payload.step, "c");
        await page.getByTestId("current-step").filter({ hasText: "c" }).waitFor();
        await page.getByRole("button", { name: "Step", exact: true }).click();
        await page.getByRole("dialog").getByRole("button", { name: "Step", exact: true }).click();
        await page.locator("h1 .badge[data-status=completed]").waitFor();
        /* clear the breakpoint: the next run goes through */
        await page.goto(`${base}/console/workflows/con_slow`);
        await page.locator("input[data-breakpoint=b]").click();
        await page.locator(".graph g.node.bp").waitFor({ state: "detached" });
        const id2 = await start("con_slow", { secs: 0.1 });
        await waitStatus(id2, "completed");
        await page.context().close();
    });

    test("a second role sees none of the first role's runs", async () => {
        const page = await newPage();
        await signIn(page, "con_bob");
        await page.goto(`${base}/console/runs`);
        await page.getByRole("table", { name: "Runs" }).getByText("No runs.").waitFor();
        const { rows: [{ id }] } = await admin.query("SELECT max(id) AS id FROM tuvl.runs WHERE principal = 'con_alice'");
        await page.goto(`${base}/console/runs/${id}`);
        await page.getByRole("alert").filter({ hasText: `run ${id} does not exist` }).waitFor();
        await page.goto(`${base}/console/people`);
        await page.getByText("Nothing waits for you.").waitFor();
        const sse = await page.evaluate(async (rid) => (await fetch(`/api/runs/${rid}/events`)).status, id);
        assert.equal(sse, 404);
        await page.context().close();
    });

    /*
     * The runs page's reads at scale (bench/console.mjs measures them at
     * 1,000,000 runs): 50,010 runs of con_bob made by INSERT as the owner,
     * older than alice's; every filter; counts exact up to the cap and what
     * SQL as that role counts; a time's runs newest first by creation time
     * with the keyset going on in that order.  The runs are removed at the
     * end (the other tests expect bob to have none).
     */
    test("the runs page's list and counts: every filter, the cap, only what the role may see in SQL", async () => {
        await admin.query(`
            INSERT INTO tuvl.runs (workflow, workflow_version, status, input, context, principal, principal_id,
                                   created_at, finished_at, key)
            SELECT 'con_slow', 1, CASE WHEN i % 10000 = 1 THEN 'failed' WHEN i % 20000 = 2 THEN 'paused' ELSE 'completed' END,
                   jsonb_build_object('n', i), '{}', 'con_bob', 'con_bob'::regrole,
                   /* created an hour ago and before, 0.1 s apart; ids 50,001 to 50,010 made earlier than the ones before them */
                   now() - interval '1 hour' - make_interval(secs => CASE WHEN i > 50000 THEN 50000 + i ELSE 50010 - i END / 10.0),
                   CASE WHEN i % 20000 <> 2 THEN now() END, CASE WHEN i % 1000 = 0 THEN 'bk' || i END
            FROM generate_series(1, 50010) i`);
        await admin.query("ANALYZE tuvl.runs");
        try {
            await admin.query("SET ROLE con_bob");
            const { rows: [{ t: bobToken }] } = await admin.query("SELECT tuvl.create_token('con_bob', '{runs:read}') AS t");
            const inSql = Object.fromEntries((await admin.query("SELECT status, count(*)::int AS n FROM tuvl.runs GROUP BY status")).rows.map((r) => [r.status, r.n]));
            await admin.query("SET ROLE con_carol");
            const { rows: [{ t: carolToken }] } = await admin.query("SELECT tuvl.create_token('con_carol', '{runs:read}') AS t");
            await admin.query("RESET ROLE");
            assert.deepEqual(inSql, { completed: 50001, failed: 6, paused: 3 });
            const get = async (token, path) => {
                const r = await fetch(base + path, { headers: { Authorization: `Bearer ${token}` } });
                const body = await r.json();
                assert.equal(r.status, 200, JSON.stringify(body));
                assert.match(r.headers.get("server-timing") ?? "", /^app;dur=[0-9.]+$/);
                return body;
            };
            /* counts: each status exactly up to the cap (then "at least"), as SQL counts them for bob; none of alice's */
            const c = await get(bobToken, "/api/console/counts");
            assert.deepEqual(c.counts, { completed: 50000, failed: 6, paused: 3 });
            assert.deepEqual(c.capped, ["completed"]);
            assert.equal(c.cap, 50000);
            assert.deepEqual((await get(bobToken, "/api/console/counts?status=failed,paused")).counts, { failed: 6, paused: 3 });
            assert.deepEqual((await get(bobToken, "/api/console/counts?key=bk20000")).counts, { completed: 1 });
            assert.deepEqual((await get(bobToken, "/api/console/counts?workflow=con_agent")).counts, {});
            /* the operator sees every role's */
            const all = await get(carolToken, "/api/console/counts");
            const { rows: [{ n: alicesDone }] } = await admin.query("SELECT count(*)::int AS n FROM tuvl.runs WHERE principal = 'con_alice' AND status = 'completed'");
            assert.equal(all.counts.completed, Math.min(50000, 50001 + alicesDone));
            assert.ok(all.counts.failed >= 6);
            /* the list: newest first by id, the keyset goes on; a status; a key; none of alice's */
            const p1 = await get(bobToken, "/api/console/runs?limit=20");
            assert.equal(p1.runs.length, 20);
            assert.ok(p1.runs.every((r) => r.principal === "con_bob"));
            const ids = p1.runs.map((r) => r.id);
            assert.deepEqual(ids, [...ids].sort((a, b) => b - a));
            const p2 = await get(bobToken, `/api/console/runs?limit=20&before=${p1.next_before}`);
            assert.ok(p2.runs[0].id < ids[19]);
            const failed = await get(bobToken, "/api/console/runs?status=failed");
            assert.equal(failed.runs.length, 6);
            assert.ok(failed.runs.every((r) => r.status === "failed"));
            assert.deepEqual((await get(bobToken, "/api/console/runs?key=bk20000")).runs.map((r) => r.key), ["bk20000"]);
            /*
             * A page where a run in flight meets ended runs (the console reads
             * the two from different indexes): the ids SQL gives, in its order.
             */
            const { rows: [{ id: pausedId }] } = await admin.query(
                "SELECT id FROM tuvl.runs WHERE principal = 'con_bob' AND status = 'paused' ORDER BY id LIMIT 1 OFFSET 1");
            const around = await get(bobToken, `/api/console/runs?limit=20&before=${Number(pausedId) + 5}`);
            const { rows: sqlOrder } = await admin.query(
                "SELECT id FROM tuvl.runs WHERE principal = 'con_bob' AND id < $1 ORDER BY id DESC LIMIT 20", [Number(pausedId) + 5]);
            assert.deepEqual(around.runs.map((r) => Number(r.id)), sqlOrder.map((r) => Number(r.id)));
            assert.deepEqual(around.runs.filter((r) => r.status === "paused").map((r) => Number(r.id)), [Number(pausedId)]);
            /* and by time */
            const byTime = await get(bobToken, `/api/console/runs?limit=20&before=${Number(pausedId) + 5}&from=2000-01-01T00:00:00Z`);
            const { rows: sqlByTime } = await admin.query(
                `SELECT id FROM tuvl.runs WHERE principal = 'con_bob'
                   AND (created_at, id) < (SELECT created_at, id FROM tuvl.runs WHERE id = $1)
                 ORDER BY created_at DESC, id DESC LIMIT 20`, [Number(pausedId) + 5]);
            assert.deepEqual(byTime.runs.map((r) => Number(r.id)), sqlByTime.map((r) => Number(r.id)));
            assert.ok(byTime.runs.some((r) => r.status === "paused"), "the page by time holds the run in flight");
            /* a time: newest first by creation time (ids 50,001 to 50,010 are older than 1 to 50,000), page after page */
            const { rows: [{ lo, hi }] } = await admin.query(
                "SELECT min(created_at) AS lo, max(created_at) + interval '1 ms' AS hi FROM tuvl.runs WHERE principal = 'con_bob'");
            const span = `from=${encodeURIComponent(lo.toISOString())}&to=${encodeURIComponent(hi.toISOString())}`;
            const seen = [];
            let before = null;
            for (let i = 0; i < 3; i++) {
                const pg = await get(bobToken, `/api/console/runs?${span}&limit=20${before ? `&before=${before}` : ""}`);
                seen.push(...pg.runs);
                before = pg.next_before;
            }
            const times = seen.map((r) => Date.parse(r.created_at));
            assert.deepEqual(times, [...times].sort((a, b) => b - a), "newest first by creation time");
            assert.equal(new Set(seen.map((r) => r.id)).size, 60, "no run twice across pages");
            const { rows: newest } = await admin.query(
                "SELECT id FROM tuvl.runs WHERE principal = 'con_bob' ORDER BY created_at DESC, id DESC LIMIT 60");
            assert.deepEqual(seen.map((r) => Number(r.id)), newest.map((r) => Number(r.id)));
            /* the oldest by time: the ten newest by id (i = 50,001 to 50,010), the oldest of them last */
            const oldest = await get(bobToken, `/api/console/runs?to=${encodeURIComponent(new Date(Date.parse(lo.toISOString()) + 950).toISOString())}`);
            assert.deepEqual(oldest.runs.map((r) => r.id), ids.slice(0, 10).reverse());
            /* text: among the newest runs the other filters select, and counted there */
            const text = await get(bobToken, `/api/console/runs?q=${encodeURIComponent('"n": 49999')}`);
            assert.deepEqual(text.runs.map((r) => r.principal), ["con_bob"]);
            const tc = await get(bobToken, `/api/console/counts?q=${encodeURIComponent('"n": 49999')}`);
            assert.deepEqual(tc.counts, { completed: 1 });
            assert.equal(tc.window, 20000);

            /*
             * Counts while another transaction holds runs locked and changed
             * (a worker moving them, an abort not yet committed): the counts
             * answer at once, with what is committed; after the commit, with
             * the change.
             */
            const locker = await connect(DB);
            try {
                await locker.query("BEGIN");
                await locker.query("UPDATE tuvl.runs SET status = 'failed' WHERE principal = 'con_bob' AND status = 'paused'");
                await locker.query("SELECT 1 FROM tuvl.runs WHERE principal = 'con_bob' AND status = 'failed' FOR UPDATE");
                const t0 = Date.now();
                const during = await get(bobToken, "/api/console/counts?status=failed,paused");
                assert.ok(Date.now() - t0 < 5000, `counts waited ${Date.now() - t0} ms for the locks`);
                assert.deepEqual(during.counts, { failed: 6, paused: 3 });
                assert.equal((await get(bobToken, "/api/console/runs?status=paused")).runs.length, 3);
                await locker.query("COMMIT");
                assert.deepEqual((await get(bobToken, "/api/console/counts?status=failed,paused")).counts, { failed: 9 });
            } finally {
                await locker.query("ROLLBACK").catch(() => undefined);
                await locker.end();
            }
        } finally {
            await admin.query("RESET ROLE");
            await admin.query("DELETE FROM tuvl.runs WHERE principal = 'con_bob'");
        }
    });

    /*
     * Issue 40's "connect" button: the authorization-code grant completed
     * by a person in the browser, against the scripted authorization
     * server of the MCP tests (approves at once) and the MCP server it
     * protects; then a run of alice calls the server with the token.
     */
    test("MCP: a person connects their role to an OAuth MCP server; their runs use it, the callback works once", async () => {
        const as = await startPeer("oauth_server.py", "OAuth authorization server on ");
        const mcp = await startPeer("mcp_stateless_server.py", "MCP 2026-07-28 server on ", "--auth", as.base, "--scopes", "mcp:tools");
        const url = `${mcp.base}/mcp`;
        try {
            const page = await newPage();
            await signIn(page, "con_alice");
            await page.getByRole("link", { name: "MCP" }).click();
            await page.getByLabel("MCP server URL").fill(url);
            const authorized = page.waitForRequest((r) => r.url().startsWith(`${as.base}/authorize?`));
            await page.getByRole("button", { name: "Connect" }).click();
            const authz = new URL((await authorized).url());
            assert.match(authz.searchParams.get("redirect_uri"), /^http:\/\/127\.0\.0\.1:[0-9]+\/console\/mcp\/callback$/);
            assert.equal(authz.searchParams.get("code_challenge_method"), "S256");
            await page.getByTestId("mcp-connected").filter({ hasText: url }).waitFor();
            assert.equal(new URL(page.url()).pathname, "/console/mcp", "the code is not left in the address bar");
            const { rows } = await admin.query("SELECT role::text AS role FROM tuvl.mcp_oauth_tokens WHERE url = $1", [url]);
            assert.deepEqual(rows, [{ role: "con_alice" }]);
            /* alice's runs call the server with the token */
            await alice.query("SELECT tuvl.register_workflow($1)", [`
name: con_mcp
steps:
  - id: call
    kind: MCP
    mcp: { url: "${url}", tool: echo, arguments: { text: "hello" }, auth: { oauth: { grant: authorization_code } } }
    output: res
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "{{ res.text }}" }
`]);
            const id = await start("con_mcp", {});
            await waitFor(async () => ["completed", "failed"].includes(await status(id)), `run ${id} to end`);
            const { rows: [run] } = await admin.query("SELECT status, response FROM tuvl.runs WHERE id = $1", [id]);
            assert.equal(run.status, "completed", JSON.stringify(run));
            assert.match(JSON.stringify(run.response), /hello/);
            /* the callback again (its state is used up), or a made-up one: refused, nothing connected */
            const again = await newPage();
            await signIn(again, "con_bob");
            await again.goto(`${base}/console/mcp/callback?code=made-up&state=made-up`);
            await again.getByRole("alert").waitFor();
            const { rows: bobs } = await admin.query("SELECT 1 FROM tuvl.mcp_oauth_tokens WHERE role = 'con_bob'::regrole");
            assert.equal(bobs.length, 0);
            /* a bad URL is refused before anything is sent */
            const bad = await again.evaluate(async () => (await fetch("/api/console/mcp/connect", { method: "POST", body: "{\"url\": \"ftp://x\"}" })).status);
            assert.equal(bad, 403, "without the CSRF header");
            await page.context().close();
            await again.context().close();
        } finally {
            mcp.proc.kill();
            as.proc.kill();
        }
    });

    test("the workflows, metrics and workers pages", async () => {
        const page = await newPage({ viewport: { width: 390, height: 844 } });
        await signIn(page, "con_carol");
        await page.goto(`${base}/console/workflows`);
        await page.getByRole("link", { name: "con_agent" }).click();
        await page.getByText("kind: Agent").waitFor();
        await page.goto(`${base}/console/metrics`);
        await page.getByRole("img", { name: "Runs by status" }).waitFor();
        await page.goto(`${base}/console/workers`);
        await page.getByRole("table", { name: "Workers" }).locator("tbody tr").first().waitFor();
        /* keyboard: the pages' links take the focus and Enter follows them */
        await page.goto(`${base}/console/runs`);
        await page.getByRole("heading", { name: "Runs" }).waitFor();
        for (let i = 0; i < 12 && (await page.evaluate(() => document.activeElement?.textContent)) !== "People"; i++)
            await page.keyboard.press("Tab");
        await page.keyboard.press("Enter");
        await page.getByRole("heading", { name: "People" }).waitFor();
        await page.context().close();
    });
});
