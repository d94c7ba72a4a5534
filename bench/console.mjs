/*
 * bench/console.mjs: the web console (issue 38) at scale.
 *
 *  1. The runs page with 1,000,000 runs in the database: the time of the
 *     requests the page makes (GET /api/console/runs, first page and a
 *     page deep in the keyset, with and without a status filter, and GET
 *     /api/console/counts), measured over loopback at the client (so an
 *     upper bound of the server's time), p50 and p95 of 30 each.
 *     Target: at most 300 ms.
 *  2. A run page with a 200-turn agent (199 tool calls, then an answer,
 *     played by the scripted LLM server) in Debian's chromium: from the
 *     navigation's start until the conversation shows all 200 model turns.
 *     Target: at most 1 s.
 *
 * Needs the cluster's libpq environment (PGHOST, PGPORT, superuser),
 * TUVL_LLM_URL (the scripted LLM server) and /usr/bin/chromium; run on
 * insight's own Node:
 *
 *   insight/node_modules/.bin/node bench/console.mjs [--runs 1000000] [--json FILE]
 */
import { spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { createRequire } from "node:module";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const require = createRequire(join(root, "insight", "package.json"));
const pg = require("pg");
const { chromium } = createRequire(join(root, "insight", "console", "package.json"))("playwright-core");

const args = process.argv.slice(2);
const opt = (name, dflt) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : dflt; };
const N = Number(opt("--runs", "1000000"));
const JSON_OUT = opt("--json", null);
const DB = "tuvl_console_bench";
const LLM_URL = process.env.TUVL_LLM_URL;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const log = (m) => process.stderr.write(`console bench: ${m}\n`);

function freePort() {
    return new Promise((resolve) => {
        const s = createServer();
        s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => resolve(p)); });
    });
}
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]; };

async function main() {
    const root0 = new pg.Client({ database: "postgres" });
    await root0.connect();
    await root0.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
    await root0.query(`CREATE DATABASE ${DB}`);
    const db = new pg.Client({ database: DB });
    await db.connect();
    await db.query("CREATE EXTENSION tuvl");
    for (const r of ["cb_auth", "cb_user"]) await root0.query(`DROP ROLE IF EXISTS ${r}`);
    await root0.query("CREATE ROLE cb_user LOGIN IN ROLE tuvl_user");
    await root0.query("CREATE ROLE cb_auth LOGIN NOINHERIT IN ROLE cb_user");
    await db.query(`CREATE SCHEMA cb; GRANT USAGE ON SCHEMA cb TO PUBLIC;
        CREATE FUNCTION cb.tool(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"ok": true, "n": 42}'::jsonb $$;`);
    await db.query("SET ROLE cb_user");
    await db.query("SELECT tuvl.register_workflow($1)", ["name: cb_one\nsteps:\n  - { id: a, kind: Functional, function: cb.tool }\n"]);
    await db.query("RESET ROLE");

    log(`inserting ${N.toLocaleString()} runs`);
    const t0 = Date.now();
    await db.query(`INSERT INTO tuvl.runs (workflow, workflow_version, status, input, context, principal, principal_id, created_at, finished_at, key)
        SELECT 'cb_one', 1, CASE WHEN i % 100 = 0 THEN 'failed' WHEN i % 250 = 1 THEN 'waiting_human' ELSE 'completed' END,
               jsonb_build_object('order', i), jsonb_build_object('order', i), 'cb_user', 'cb_user'::regrole,
               now() - make_interval(secs => ($1 - i) / 10.0), now() - make_interval(secs => ($1 - i) / 10.0) + interval '1 second',
               CASE WHEN i % 1000 = 0 THEN 'k' || i END
        FROM generate_series(1, $1) i`, [N]);
    await db.query("VACUUM ANALYZE tuvl.runs");
    log(`inserted in ${((Date.now() - t0) / 1000).toFixed(0)} s`);

    /* the 200-turn agent */
    const turns = [];
    for (let i = 0; i < 199; i++) turns.push({ text: `Turn ${i}: checking item ${i}.`, tool_calls: [{ name: "tool", arguments: { item: i } }] });
    turns.push({ text: "All 199 items checked." });
    const root = LLM_URL.replace(/\/v1$/, "");
    await fetch(`${root}/_script`, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ name: "cb_long", turns }) });
    await db.query("SET ROLE cb_user");
    await db.query("SELECT tuvl.register_llm($1)", [`name: cb_long\nprovider: openai\nbase_url: ${LLM_URL}\nmodel: cb_long\ntimeout: 30s\n`]);
    await db.query("SELECT tuvl.register_workflow($1)", [`
name: cb_agent
steps:
  - id: work
    kind: Agent
    mode: autonomous
    agent: { model: cb_long, tools: [ { ref: tool } ], max_iterations: 250 }
    routes: { default: done }
  - { id: tool, kind: Functional, description: Check an item, function: cb.tool }
ends:
  - { id: done, status: completed, response: "{{ work_result }}" }
`]);
    const { rows: [{ id: agentRun }] } = await db.query("SELECT tuvl.start_run('cb_agent', '{\"task\": \"check 199 items\"}') AS id");
    const token = (await db.query("SELECT tuvl.create_token('cb_user', '{runs:read,runs:control}') AS t")).rows[0].t;
    await db.query("RESET ROLE");
    log(`agent run ${agentRun}: waiting for its 200 turns`);
    for (let i = 0; i < 600; i++) {
        const { rows: [r] } = await db.query("SELECT status FROM tuvl.runs WHERE id = $1", [agentRun]);
        if (["completed", "failed", "aborted"].includes(r.status)) { log(`agent run ${r.status}`); break; }
        await sleep(500);
    }
    const { rows: [{ turns: nTurns }] } = await db.query("SELECT count(*)::int AS turns FROM tuvl.events WHERE run_id = $1 AND type = 'llm_turn'", [agentRun]);

    const port = await freePort();
    const server = spawn(join(rootDir(), "insight", "tuvl"),
                         ["serve", "--db", `host=127.0.0.1 port=${process.env.PGPORT} dbname=${DB} user=cb_auth`, "--port", String(port)],
                         { stdio: ["ignore", "ignore", "inherit"] });
    const base = `http://127.0.0.1:${port}`;
    for (let i = 0; i < 600 && !(await fetch(`${base}/health`).catch(() => null))?.ok; i++) await sleep(200);
    const results = { runs: N, requests: {}, agent: {} };
    try {
        const H = { Authorization: `Bearer ${token}` };
        const deep = Math.floor(N / 2);
        const cases = {
            "first page": "/api/console/runs",
            "first page, status failed": "/api/console/runs?status=failed",
            [`page before run ${deep.toLocaleString()}`]: `/api/console/runs?before=${deep}`,
            "waiting_human, before half": `/api/console/runs?status=waiting_human&before=${deep}`,
            "text in input": "/api/console/runs?q=%22order%22%3A%20999999",
            "counts by status": "/api/console/counts",
        };
        for (const [name, path] of Object.entries(cases)) {
            const ms = [];
            for (let i = 0; i < 32; i++) {
                const t = process.hrtime.bigint();
                const r = await fetch(base + path, { headers: H });
                await r.arrayBuffer();
                if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
                if (i >= 2) ms.push(Number(process.hrtime.bigint() - t) / 1e6);
            }
            results.requests[name] = { path, p50_ms: pct(ms, 50), p95_ms: pct(ms, 95) };
            log(`${name}: p50 ${pct(ms, 50).toFixed(1)} ms, p95 ${pct(ms, 95).toFixed(1)} ms`);
        }

        const browser = await chromium.launch({ executablePath: process.env.TUVL_CHROMIUM ?? "/usr/bin/chromium", args: ["--no-sandbox", "--disable-gpu"] });
        const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
        const page = await ctx.newPage();
        await page.goto(`${base}/console/`);
        await page.getByRole("tab", { name: "API token" }).click();
        await page.getByLabel("Token").fill(token);
        await page.getByRole("button", { name: "Sign in" }).click();
        await page.getByTestId("role").waitFor();
        const times = [];
        for (let i = 0; i < 5; i++) {
            await page.goto(`${base}/console/runs`);
            await page.locator("tr[data-run]").first().waitFor();
            const t = Date.now();
            await page.goto(`${base}/console/runs/${agentRun}`);
            await page.waitForFunction((n) => document.querySelectorAll(".msg[data-event=llm_turn]").length >= n, nTurns, { timeout: 30_000, polling: 16 });
            const nav = await page.evaluate(() => performance.now());
            times.push(Math.min(nav, Date.now() - t));
        }
        await browser.close();
        results.agent = { run_id: agentRun, llm_turns: nTurns, render_ms_p50: pct(times, 50), render_ms_max: Math.max(...times) };
        log(`200-turn agent page: p50 ${pct(times, 50).toFixed(0)} ms (max ${Math.max(...times).toFixed(0)} ms) for ${nTurns} turns`);
    } finally {
        server.kill("SIGTERM");
        await db.end();
        const c = new pg.Client({ database: "postgres" });
        await c.connect();
        await c.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
        for (const r of ["cb_auth", "cb_user"]) await c.query(`DROP ROLE IF EXISTS ${r}`);
        await c.end();
        await root0.end();
    }
    const worst = Math.max(...Object.values(results.requests).map((r) => r.p95_ms));
    console.log(`### The web console (bench/console.mjs)\n`);
    console.log(`${N.toLocaleString()} runs in the database; times at the client over loopback (an upper bound of the server's time), 30 requests each:\n`);
    console.log("| request | p50 | p95 |\n|---|---|---|");
    for (const [name, r] of Object.entries(results.requests)) console.log(`| ${name} (\`${r.path}\`) | ${r.p50_ms.toFixed(1)} ms | ${r.p95_ms.toFixed(1)} ms |`);
    console.log(`\nTarget ≤ 300 ms: ${worst <= 300 ? "met" : "NOT met"} (worst p95 ${worst.toFixed(1)} ms).\n`);
    console.log(`A run page with a ${results.agent.llm_turns}-turn agent in chromium, navigation to all turns shown: p50 ${results.agent.render_ms_p50.toFixed(0)} ms, max ${results.agent.render_ms_max.toFixed(0)} ms of 5 (target ≤ 1 s: ${results.agent.render_ms_p50 <= 1000 ? "met" : "NOT met"}).`);
    if (JSON_OUT) writeFileSync(JSON_OUT, JSON.stringify(results, null, 2));
}

function rootDir() { return join(dirname(fileURLToPath(import.meta.url)), ".."); }

main().catch((e) => { console.error(e); process.exit(1); });
