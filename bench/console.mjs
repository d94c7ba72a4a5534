/*
 * bench/console.mjs: the web console (issue 38) at scale.
 *
 *  1. The runs page with 1,000,000 runs in the database (INSERT ... SELECT
 *     as the owner, in chunks of 100,000: two roles, the oldest 1,000 runs
 *     cb_small's; 1 % failed, 0.1 % aborted, 0.4 % waiting for a person,
 *     50 paused; every 5,000th of a second workflow, every 1,000th with a
 *     key; a journal of 8 events for every 100th): the requests the page
 *     makes, GET /api/console/runs (the first page and a page deep in the
 *     keyset) and GET /api/console/counts, for every filter the page
 *     offers (none, a status common or rare, two statuses, a rare
 *     workflow, a workflow and a status, a key, an hour ten hours back,
 *     everything older than two thirds back, a text found once or
 *     nowhere), and as a role whose 1,000 runs are the oldest.  Each 30
 *     times (after 2), as the server's time (its Server-Timing header):
 *     p50, p95 and max.  Target: at most 300 ms.
 *  2. A run page with a 200-turn agent (199 tool calls, then an answer,
 *     played by the scripted LLM server) in Debian's chromium, --rounds
 *     times (10): from the navigation's start (performance.now() of the
 *     new document) until the conversation shows all 200 model turns.
 *     Target: at most 1 s, at every round.
 *
 * Needs the cluster's libpq environment (PGHOST, PGPORT, superuser),
 * TUVL_LLM_URL (the scripted LLM server) and /usr/bin/chromium; run on
 * insight's own Node (bench/run --only console does all of it):
 *
 *   insight/node_modules/.bin/node bench/console.mjs [--runs 1000000] [--rounds 10]
 *       [--requests 30] [--json FILE] [--keep] [--no-agent]
 *
 * --keep leaves the database and its roles (and reuses them when they are
 * there: for trying a change of the queries); --no-agent skips part 2.
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
/* --keep: leave the database (and reuse it when it is there), for trying changes; --no-agent: only the runs page */
const KEEP = args.includes("--keep");
const AGENT = !args.includes("--no-agent");
const ROUNDS = Number(opt("--rounds", "10"));
const REQUESTS = Number(opt("--requests", "30"));
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

/* runs of the bulk load (the oldest SMALL_RUNS are cb_small's, the rest cb_user's) */
const SMALL_RUNS = 1000;

/*
 * N runs in chunks of 100,000 by INSERT ... SELECT as the owner (what the
 * workers would have written, without running them): 1 % failed, 0.1 %
 * aborted, 0.4 % waiting for a person, 50 paused, the rest completed;
 * every 5,000th of a second workflow, every 1,000th with a key; one run a
 * tenth of a second apart (1,000,000 runs: about 28 hours); a journal of
 * 8 events for every 100th run.
 */
async function load(db, n) {
    const t0 = Date.now();
    for (let start = 1; start <= n; start += 100_000) {
        const end = Math.min(n, start + 99_999);
        await db.query(`
            WITH r AS (
              INSERT INTO tuvl.runs (workflow, workflow_version, status, input, context, principal, principal_id,
                                     created_at, started_at, finished_at, key, response, end_name, last_seq)
              SELECT CASE WHEN i % 5000 = 7 THEN 'cb_rare' ELSE 'cb_one' END, 1, s.status,
                     jsonb_build_object('order', i, 'customer', 'c' || (i % 997)), jsonb_build_object('order', i),
                     s.who, s.who::regrole, t.at, t.at,
                     CASE WHEN s.status IN ('completed', 'failed', 'aborted') THEN t.at + interval '1 second' END,
                     CASE WHEN i % 1000 = 0 THEN 'k' || i END,
                     CASE WHEN s.status = 'completed' THEN jsonb_build_object('ok', true, 'total', i % 1000) END,
                     CASE WHEN s.status = 'completed' THEN 'done' END,
                     CASE WHEN i % 100 = 3 THEN 8 ELSE 0 END
              FROM generate_series($1::int, $2::int) i,
                   LATERAL (SELECT now() - make_interval(secs => ($3::int - i) / 10.0) AS at) t,
                   LATERAL (SELECT CASE WHEN i <= ${SMALL_RUNS} THEN 'cb_small' ELSE 'cb_user' END AS who,
                                   CASE WHEN i % 100 = 0 THEN 'failed' WHEN i % 1000 = 5 THEN 'aborted'
                                        WHEN i % 250 = 1 THEN 'waiting_human'
                                        WHEN i % 20000 = 11 THEN 'paused' ELSE 'completed' END AS status) s
              RETURNING id, last_seq, created_at)
            INSERT INTO tuvl.journal (run_id, seq, n, events)
            SELECT r.id, 1, 8,
                   tuvl._journal_block(array_fill(r.created_at, ARRAY[8]),
                                       ARRAY['run_queued', 'run_started', 'checkpoint', 'checkpoint', 'checkpoint', 'checkpoint', 'checkpoint', 'run_completed'],
                                       array_fill('a'::text, ARRAY[8]), array_fill('Functional'::text, ARRAY[8]),
                                       array_fill(NULL::int, ARRAY[8]), array_fill(1.5::float8, ARRAY[8]),
                                       (SELECT array_agg(jsonb_build_object('step', 'a', 'n', s)) FROM generate_series(1, 8) s))
            FROM r WHERE r.last_seq = 8`, [start, end, n]);
        log(`${end.toLocaleString()} of ${n.toLocaleString()} runs`);
    }
    await db.query("VACUUM ANALYZE tuvl.runs");
    await db.query("VACUUM ANALYZE tuvl.journal");
    await db.query("CHECKPOINT");
    return (Date.now() - t0) / 1000;
}

async function setup(root0, fresh) {
    if (fresh) {
        await root0.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
        await root0.query(`CREATE DATABASE ${DB}`);
    }
    const db = new pg.Client({ database: DB });
    await db.connect();
    if (!fresh) return db;
    await db.query("CREATE EXTENSION tuvl");
    for (const r of ["cb_auth", "cb_user", "cb_small"]) await root0.query(`DROP ROLE IF EXISTS ${r}`);
    await root0.query("CREATE ROLE cb_user LOGIN IN ROLE tuvl_user");
    await root0.query("CREATE ROLE cb_small LOGIN IN ROLE tuvl_user");
    await root0.query("CREATE ROLE cb_auth LOGIN NOINHERIT IN ROLE cb_user, cb_small");
    await db.query(`CREATE SCHEMA cb; GRANT USAGE ON SCHEMA cb TO PUBLIC;
        CREATE FUNCTION cb.tool(ctx jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"ok": true, "n": 42}'::jsonb $$;`);
    await db.query("SET ROLE cb_user");
    await db.query("SELECT tuvl.register_workflow($1)", ["name: cb_one\nsteps:\n  - { id: a, kind: Functional, function: cb.tool }\n"]);
    await db.query("SELECT tuvl.register_workflow($1)", ["name: cb_rare\nsteps:\n  - { id: a, kind: Functional, function: cb.tool }\n"]);
    await db.query("RESET ROLE");
    log(`inserting ${N.toLocaleString()} runs`);
    const s = await load(db, N);
    log(`inserted in ${s.toFixed(0)} s`);
    return db;
}

/* the 200-turn agent: 199 tool calls, then an answer */
async function agentRun(db) {
    const { rows: [done] } = await db.query("SELECT id FROM tuvl.runs WHERE workflow = 'cb_agent' AND status = 'completed' ORDER BY id DESC LIMIT 1");
    if (done) {
        const { rows: [{ turns: n }] } = await db.query("SELECT count(*)::int AS turns FROM tuvl.events WHERE run_id = $1 AND type = 'llm_turn'", [done.id]);
        return { id: done.id, nTurns: n };
    }
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
    const { rows: [{ id }] } = await db.query("SELECT tuvl.start_run('cb_agent', '{\"task\": \"check 199 items\"}') AS id");
    await db.query("RESET ROLE");
    log(`agent run ${id}: waiting for its 200 turns`);
    for (let i = 0; i < 600; i++) {
        const { rows: [r] } = await db.query("SELECT status FROM tuvl.runs WHERE id = $1", [id]);
        if (["completed", "failed", "aborted"].includes(r.status)) { log(`agent run ${r.status}`); break; }
        await sleep(500);
    }
    const { rows: [{ turns: nTurns }] } = await db.query("SELECT count(*)::int AS turns FROM tuvl.events WHERE run_id = $1 AND type = 'llm_turn'", [id]);
    return { id, nTurns };
}

const stats = (xs) => ({ p50_ms: pct(xs, 50), p95_ms: pct(xs, 95), max_ms: Math.max(...xs) });

async function main() {
    const root0 = new pg.Client({ database: "postgres" });
    await root0.connect();
    const reuse = KEEP && (await root0.query("SELECT 1 FROM pg_database WHERE datname = $1", [DB])).rowCount === 1;
    const db = await setup(root0, !reuse);
    const { rows: [{ n: inDb }] } = await db.query("SELECT count(*)::int AS n FROM tuvl.runs");
    await db.query("SET ROLE cb_user");
    const token = (await db.query("SELECT tuvl.create_token('cb_user', '{runs:read,runs:control}') AS t")).rows[0].t;
    await db.query("SET ROLE cb_small");
    const smallToken = (await db.query("SELECT tuvl.create_token('cb_small', '{runs:read}') AS t")).rows[0].t;
    await db.query("RESET ROLE");
    const agent = AGENT ? await agentRun(db) : null;

    const port = await freePort();
    const server = spawn(join(rootDir(), "insight", "tuvl"),
                         ["serve", "--db", `host=127.0.0.1 port=${process.env.PGPORT} dbname=${DB} user=cb_auth`, "--port", String(port)],
                         { stdio: ["ignore", "ignore", "inherit"] });
    const base = `http://127.0.0.1:${port}`;
    for (let i = 0; i < 600 && !(await fetch(`${base}/health`).catch(() => null))?.ok; i++) await sleep(200);
    const results = { runs: inDb, requests: {}, agent: {} };
    try {
        const H = { Authorization: `Bearer ${token}` };
        const HS = { Authorization: `Bearer ${smallToken}` };
        const deep = Math.floor(inDb / 2);
        /* times a third and two thirds back: a window of an hour in the middle, and everything older than two thirds */
        const { rows: [tm] } = await db.query(`SELECT (max(created_at) - interval '10 hours') AS mid, (max(created_at) - interval '9 hours') AS mid_end,
                                                      (max(created_at) - (max(created_at) - min(created_at)) * 2 / 3) AS old,
                                                      (max(created_at) - (max(created_at) - min(created_at)) * 5 / 6) AS older FROM tuvl.runs`);
        /* a page deep in a time's runs: before the run made just before this time (the list is by time then) */
        const runAt = async (t) => (await db.query("SELECT id FROM tuvl.runs WHERE created_at < $1 ORDER BY created_at DESC LIMIT 1", [t])).rows[0].id;
        const deepOf = {
            "an hour 10 hours back": await runAt(new Date(new Date(tm.mid).getTime() + 1_800_000)),
            "older than two thirds back": await runAt(tm.older),
        };
        const iso = (d) => encodeURIComponent(new Date(d).toISOString());
        const filters = {
            "no filter": "",
            "status failed (1 %)": "status=failed",
            "status waiting_human (0.4 %)": "status=waiting_human",
            "status paused (50 runs)": "status=paused",
            "status completed or failed": "status=completed,failed",
            "workflow cb_rare (200 runs)": "workflow=cb_rare",
            "workflow cb_one and status aborted": "workflow=cb_one&status=aborted",
            "key": `key=k${Math.floor(inDb / 2000) * 1000}`,
            "an hour 10 hours back": `from=${iso(tm.mid)}&to=${iso(tm.mid_end)}`,
            "older than two thirds back": `to=${iso(tm.old)}`,
            "text found once": `q=${encodeURIComponent(`"order": ${inDb - 5}`)}`,
            "text found nowhere": "q=nowhere-to-be-found",
        };
        const cases = [];
        for (const [name, f] of Object.entries(filters)) {
            const amp = f ? "&" : "";
            cases.push([`runs, ${name}, first page`, `/api/console/runs?${f}`, H]);
            const before = deepOf[name] ?? deep;
            cases.push([`runs, ${name}, a page before run ${before.toLocaleString()}`, `/api/console/runs?${f}${amp}before=${before}`, H]);
            cases.push([`counts, ${name}`, `/api/console/counts?${f}`, H]);
        }
        cases.push(["runs, role of the 1,000 oldest runs, first page", "/api/console/runs", HS]);
        cases.push(["runs, role of the 1,000 oldest runs, status failed", "/api/console/runs?status=failed", HS]);
        cases.push(["counts, role of the 1,000 oldest runs", "/api/console/counts", HS]);
        for (const [name, path, h] of cases) {
            const server = [], client = [];
            let body;
            for (let i = 0; i < REQUESTS + 2; i++) {
                const t = process.hrtime.bigint();
                const r = await fetch(base + path, { headers: h });
                body = await r.json();
                if (!r.ok) throw new Error(`${path}: HTTP ${r.status}: ${JSON.stringify(body)}`);
                const ms = Number(process.hrtime.bigint() - t) / 1e6;
                const st = /dur=([0-9.]+)/.exec(r.headers.get("server-timing") ?? "");
                if (i >= 2) { client.push(ms); server.push(st ? Number(st[1]) : ms); }
            }
            const shown = body.runs ? `${body.runs.length} runs` : body.counts ? Object.entries(body.counts).map(([s, n]) => `${s} ${n}`).join(", ") : "";
            results.requests[name] = { path, server: stats(server), client: stats(client), shown };
            log(`${name}: server p50 ${pct(server, 50).toFixed(1)}, p95 ${pct(server, 95).toFixed(1)}, max ${Math.max(...server).toFixed(1)} ms (${shown})`);
        }

        if (agent) {
            const browser = await chromium.launch({ executablePath: process.env.TUVL_CHROMIUM ?? "/usr/bin/chromium", args: ["--no-sandbox", "--disable-gpu"] });
            const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
            const page = await ctx.newPage();
            await page.goto(`${base}/console/`);
            await page.getByRole("tab", { name: "API token" }).click();
            await page.getByLabel("Token").fill(token);
            await page.getByRole("button", { name: "Sign in" }).click();
            await page.getByTestId("role").waitFor();
            const times = [];
            for (let i = 0; i < ROUNDS; i++) {
                /* from the navigation's start (performance.now() of the new document) until every turn is shown */
                await page.goto(`${base}/console/runs/${agent.id}`, { waitUntil: "commit" });
                const h = await page.waitForFunction((n) => document.querySelectorAll(".msg[data-event=llm_turn]").length >= n && performance.now(),
                                                     agent.nTurns, { timeout: 30_000, polling: "raf" });
                times.push(await h.jsonValue());
                await page.goto("about:blank");
            }
            await browser.close();
            results.agent = { run_id: agent.id, llm_turns: agent.nTurns, rounds: ROUNDS, times_ms: times, ...stats(times) };
            log(`${agent.nTurns}-turn agent page: p50 ${pct(times, 50).toFixed(0)} ms, max ${Math.max(...times).toFixed(0)} ms of ${ROUNDS}`);
        }
    } finally {
        server.kill("SIGTERM");
        await db.end();
        if (!KEEP) {
            const c = new pg.Client({ database: "postgres" });
            await c.connect();
            await c.query(`DROP DATABASE IF EXISTS ${DB} WITH (FORCE)`);
            for (const r of ["cb_auth", "cb_user", "cb_small"]) await c.query(`DROP ROLE IF EXISTS ${r}`);
            await c.end();
        }
        await root0.end();
    }
    const rows = Object.entries(results.requests);
    const worst = Math.max(...rows.map(([, r]) => r.server.max_ms));
    const worst95 = Math.max(...rows.map(([, r]) => r.server.p95_ms));
    console.log(`### The web console (bench/console.mjs)\n`);
    console.log(`${inDb.toLocaleString()} runs in the database; the server's time (its Server-Timing header), ${REQUESTS} requests of each:\n`);
    console.log("| request | p50 | p95 | max | shows |\n|---|---|---|---|---|");
    for (const [name, r] of rows)
        console.log(`| ${name} | ${r.server.p50_ms.toFixed(1)} ms | ${r.server.p95_ms.toFixed(1)} ms | ${r.server.max_ms.toFixed(1)} ms | ${r.shown} |`);
    console.log(`\nTarget ≤ 300 ms: ${worst95 <= 300 ? "met" : "NOT met"} at p95 (worst p95 ${worst95.toFixed(1)} ms, worst of all ${worst.toFixed(1)} ms).\n`);
    if (agent) {
        const a = results.agent;
        console.log(`A run page with a ${a.llm_turns}-turn agent in chromium, from the navigation's start until every turn is shown, ${a.rounds} rounds: `
                    + `p50 ${a.p50_ms.toFixed(0)} ms, p95 ${a.p95_ms.toFixed(0)} ms, max ${a.max_ms.toFixed(0)} ms `
                    + `(target ≤ 1 s at every round: ${a.max_ms <= 1000 ? "met" : "NOT met"}).`);
    }
    if (JSON_OUT) writeFileSync(JSON_OUT, JSON.stringify(results, null, 2));
}

function rootDir() { return join(dirname(fileURLToPath(import.meta.url)), ".."); }

main().catch((e) => { console.error(e); process.exit(1); });
