#!/usr/bin/env node
// bench/insight.mjs: the HTTP front door (insight/) against tuvl's SQL API.
//
// Run with insight's own Node and packages (bench/run does, after
// insight/tuvl installed them):
//
//   insight/node_modules/.bin/node bench/insight.mjs --db bench --json /tmp/insight.json
//
// It connects as libpq's environment says (PGHOST, PGPORT, PGUSER: a
// superuser, as test/lib.sh's tuvl_start exports), makes an authenticator
// role and an application role with a token, starts `insight/tuvl serve`
// on a free port, and measures
//
// 1. starts, one at a time: POST /api/workflows/{name}/runs (202) against
//    SELECT tuvl.start_run() on a direct connection of the same role, in
//    alternating blocks; the overhead is the difference of the medians.
//    Both commit (fsync on): the commit is in both, the difference is the
//    front door's (HTTP, authenticate(), SET ROLE, BEGIN/COMMIT round trips).
// 2. starts, --clients at once: starts/s of each path for --seconds each, in
//    alternating rounds; the ratio HTTP / direct.
// 3. event streams: --streams runs wait at a Human step; one SSE client per
//    run follows it (GET /api/runs/{id}/events); the benchmark submits the
//    runs' forms at --rate per second on a direct connection, and each
//    event's delivery latency is the time its SSE message arrived minus the
//    time its NOTIFY arrived on a direct LISTEN connection of the same
//    process (the moment the commit was announced).  Every stream must get
//    every event of its run once, in order.
//
// The runs of 1 and 2 execute (a one-step workflow) while they are timed.
import { spawn } from "node:child_process";
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import http from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = dirname(dirname(fileURLToPath(import.meta.url)));
const require = createRequire(join(ROOT, "insight", "package.json"));
const pg = require("pg");
pg.types.setTypeParser(20, Number);

const args = Object.fromEntries(process.argv.slice(2).reduce((acc, a, i, all) => {
    if (a.startsWith("--")) acc.push([a.slice(2), all[i + 1] && !all[i + 1].startsWith("--") ? all[i + 1] : "true"]);
    return acc;
}, []));
const DB = args.db ?? "bench";
const LAT_N = Number(args["latency-runs"] ?? 2000);
const CLIENTS = Number(args.clients ?? 8);
const SECONDS = Number(args.seconds ?? 5);
const ROUNDS = Number(args.rounds ?? 2);
const STREAMS = Number(args.streams ?? 1000);
const RATE = Number(args.rate ?? 100);
const POOL = Number(args.pool ?? 10);

const log = (m) => process.stderr.write(`== ${new Date().toISOString().slice(11, 19)} ${m}\n`);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function summarize(xs) {
    const v = [...xs].sort((a, b) => a - b);
    const at = (p) => v[Math.min(v.length - 1, Math.max(0, Math.ceil((p / 100) * v.length) - 1))];
    return { n: v.length, min: v[0], median: at(50), p95: at(95), p99: at(99), max: v[v.length - 1],
             mean: v.reduce((a, b) => a + b, 0) / v.length };
}

const WORKFLOWS = [
    `name: insight_bench
description: one trivial step (bench/insight.mjs)
steps:
  - { id: only, kind: ModelOp, sql: "SELECT 1 AS x", routes: { default: done } }
ends:
  - { id: done, response: { ok: true } }`,
    `name: insight_bench_form
description: waits for a form, then one step (bench/insight.mjs)
steps:
  - id: ask
    kind: Human
    form: { type: object, required: [ok], properties: { ok: { type: boolean } } }
    routes: { default: after }
  - { id: after, kind: ModelOp, sql: "SELECT 1 AS x", routes: { default: done } }
ends:
  - { id: done, response: { ok: true } }`,
];

async function setup() {
    const c = new pg.Client({ database: DB, application_name: "insight bench" });
    await c.connect();
    await c.query(`DO $$ BEGIN
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_bench_auth') THEN CREATE ROLE insight_bench_auth LOGIN NOINHERIT; END IF;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'insight_bench_app') THEN CREATE ROLE insight_bench_app LOGIN; END IF;
        END $$`);
    await c.query("GRANT tuvl_user TO insight_bench_app");
    await c.query("GRANT insight_bench_app TO insight_bench_auth");
    await c.query("SET ROLE insight_bench_app");
    for (const w of WORKFLOWS) {
        const name = /^name: (\w+)/.exec(w)[1];
        const cur = await c.query("SELECT source FROM tuvl.workflows WHERE name = $1 ORDER BY version DESC LIMIT 1", [name]);
        if (cur.rows[0]?.source !== w) await c.query("SELECT tuvl.register_workflow($1)", [w]);
    }
    const token = (await c.query("SELECT tuvl.create_token('insight_bench_app', '{runs:start,runs:read,people:answer}', '1 day') AS t")).rows[0].t;
    await c.end();
    return token;
}

async function startServer() {
    const conninfo = `host=${process.env.PGHOST} port=${process.env.PGPORT ?? 5432} dbname=${DB} user=insight_bench_auth`;
    const child = spawn(join(ROOT, "insight", "tuvl"), ["serve", "--db", conninfo, "--port", "0", "--pool", String(POOL)],
                        { stdio: ["ignore", "pipe", "inherit"] });
    let text = "";
    const url = await new Promise((resolve, reject) => {
        child.stdout.on("data", (d) => {
            text += d;
            const m = /listening on (http:\/\/[0-9.:]+)/.exec(text);
            if (m) resolve(m[1]);
        });
        child.on("exit", (code) => reject(new Error(`the server exited (${code}): ${text}`)));
    });
    child.stdout.resume();
    return { url, child };
}

/* CPU seconds (user + system) of a process so far, from /proc. */
function cpuSeconds(pid) {
    try {
        const f = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].split(" ");
        return (Number(f[11]) + Number(f[12])) / 100;      /* utime, stime in clock ticks (100/s) */
    } catch {
        return null;
    }
}

/* A keep-alive HTTP client for the starts (node:http, no pooling surprises). */
function httpClient(base, token) {
    const u = new URL(base);
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    const body = JSON.stringify({ input: {} });
    return () => new Promise((resolve, reject) => {
        const req = http.request({ host: u.hostname, port: u.port, path: "/api/workflows/insight_bench/runs", method: "POST", agent,
                                   headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json", "Content-Length": body.length } },
                                  (res) => {
                                      let d = "";
                                      res.on("data", (x) => { d += x; });
                                      res.on("end", () => (res.statusCode === 202 ? resolve(d) : reject(new Error(`HTTP ${res.statusCode}: ${d}`))));
                                  });
        req.on("error", reject);
        req.end(body);
    });
}

async function directClient() {
    const c = new pg.Client({ database: DB, user: "insight_bench_app", application_name: "insight bench direct" });
    await c.connect();
    const q = { name: "bench_start", text: "SELECT tuvl.start_run('insight_bench', '{}')" };
    return { call: () => c.query(q), end: () => c.end() };
}

async function drain() {
    const c = new pg.Client({ database: DB, application_name: "insight bench" });
    await c.connect();
    for (;;) {
        const r = await c.query("SELECT count(*)::int AS n FROM tuvl.runs WHERE workflow = 'insight_bench' AND status IN ('queued', 'running')");
        if (r.rows[0].n === 0) break;
        await sleep(50);
    }
    await c.end();
}

/* 1. One start at a time, in alternating blocks of 100. */
async function latency(url, token, pid) {
    const h = httpClient(url, token);
    const d = await directClient();
    for (let i = 0; i < 50; i++) { await h(); await d.call(); }       /* warm-up */
    await drain();
    const times = { http: [], direct: [] };
    const cpu0 = cpuSeconds(pid);
    for (let block = 0; block < (2 * LAT_N) / 100; block++) {
        const which = block % 2 ? "direct" : "http";
        const f = which === "http" ? h : d.call;
        for (let i = 0; i < 100; i++) {
            const t0 = process.hrtime.bigint();
            await f();
            times[which].push(Number(process.hrtime.bigint() - t0) / 1e6);
        }
    }
    const cpu1 = cpuSeconds(pid);
    await d.end();
    await drain();
    const http_ = summarize(times.http);
    const direct = summarize(times.direct);
    /* the server's CPU per HTTP start (it idles during the direct blocks) */
    const serverCpuMs = cpu0 === null || cpu1 === null ? null : ((cpu1 - cpu0) * 1000) / times.http.length;
    return { http: http_, direct, overhead_p50_ms: http_.median - direct.median, server_cpu_ms_per_start: serverCpuMs,
             load_after: readFileSync("/proc/loadavg", "utf8").split(" ").slice(0, 3).join(" ") };
}

/* 2. CLIENTS at once for SECONDS; rounds alternate the order. */
async function throughput(url, token) {
    const rounds = [];
    for (let r = 0; r < ROUNDS; r++) {
        const round = {};
        for (const which of r % 2 ? ["direct", "http"] : ["http", "direct"]) {
            const clients = [];
            for (let i = 0; i < CLIENTS; i++) clients.push(which === "http" ? { call: httpClient(url, token), end: async () => {} } : await directClient());
            let n = 0;
            const t0 = performance.now();
            const stop = t0 + SECONDS * 1000;
            await Promise.all(clients.map(async (c) => {
                while (performance.now() < stop) {
                    await c.call();
                    n++;
                }
            }));
            const s = (performance.now() - t0) / 1000;
            for (const c of clients) await c.end();
            round[which] = { starts: n, seconds: s, per_s: n / s };
            await drain();
        }
        round.ratio = round.http.per_s / round.direct.per_s;
        rounds.push(round);
        log(`throughput round ${r + 1}: HTTP ${round.http.per_s.toFixed(0)}/s, direct ${round.direct.per_s.toFixed(0)}/s, ratio ${round.ratio.toFixed(2)}`);
    }
    return rounds;
}

/* One SSE stream: every message's seq and arrival time. */
function openStream(url, token, runId, onEvent) {
    const u = new URL(`${url}/api/runs/${runId}/events`);
    return new Promise((resolve, reject) => {
        const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, headers: { Authorization: `Bearer ${token}` },
                                   agent: false }, (res) => {
            if (res.statusCode !== 200) return reject(new Error(`stream of run ${runId}: HTTP ${res.statusCode}`));
            let buf = "";
            res.setEncoding("utf8");
            res.on("data", (chunk) => {
                const now = performance.now();
                buf += chunk;
                let i;
                while ((i = buf.indexOf("\n\n")) >= 0) {
                    const msg = buf.slice(0, i);
                    buf = buf.slice(i + 2);
                    const m = /^id: (\d+)$/m.exec(msg);
                    if (m) onEvent(Number(m[1]), now, /^event: (\w+)$/m.exec(msg)?.[1]);
                }
            });
            res.on("end", () => resolve());
            res.on("error", reject);
        });
        req.on("error", reject);
        req.end();
    });
}

/* 3. STREAMS streams, the runs' forms submitted at RATE per second. */
async function streams(url, token) {
    const c = new pg.Client({ database: DB, user: "insight_bench_app", application_name: "insight bench streams" });
    await c.connect();
    const ids = (await c.query("SELECT tuvl.start_run('insight_bench_form', '{}') AS id FROM generate_series(1, $1)", [STREAMS])).rows.map((r) => r.id);
    for (;;) {
        const r = await c.query("SELECT count(*)::int AS n FROM tuvl.runs WHERE id = ANY($1) AND status = 'waiting_human'", [ids]);
        if (r.rows[0].n === ids.length) break;
        await sleep(100);
    }
    const last = new Map((await c.query("SELECT id, last_seq FROM tuvl.runs WHERE id = ANY($1)", [ids])).rows.map((r) => [r.id, r.last_seq]));
    /* the direct listener: when each event's NOTIFY arrived */
    const listener = new pg.Client({ database: DB, user: "insight_bench_app", application_name: "insight bench listener" });
    await listener.connect();
    const ch = (await listener.query("SELECT tuvl.events_channel() AS c")).rows[0].c;
    const notified = new Map();
    listener.on("notification", (n) => {
        const p = JSON.parse(n.payload);
        notified.set(`${p.run_id}:${p.seq}`, performance.now());
    });
    await listener.query(`LISTEN ${pg.escapeIdentifier(ch)}`);

    const received = new Map();
    const seqs = new Map(ids.map((id) => [id, []]));
    let ended = 0;
    const t0 = performance.now();
    const done = ids.map((id) => openStream(url, token, id, (seq, at) => {
        seqs.get(id).push(seq);
        received.set(`${id}:${seq}`, at);
    }).then(() => { ended++; }));
    /* every stream has its journal so far */
    for (;;) {
        if (ids.every((id) => seqs.get(id).length >= last.get(id))) break;
        if (performance.now() - t0 > 120_000) throw new Error("the streams did not all open within 120 s");
        await sleep(50);
    }
    const openS = (performance.now() - t0) / 1000;
    log(`${ids.length} streams open in ${openS.toFixed(1)} s; submitting at ${RATE}/s`);
    const health = await (await fetch(`${url}/health`)).json();
    const submitter = new pg.Client({ database: DB, user: "insight_bench_app", application_name: "insight bench submit" });
    await submitter.connect();
    const s0 = performance.now();
    for (let i = 0; i < ids.length; i++) {
        const due = s0 + (i * 1000) / RATE;
        const wait = due - performance.now();
        if (wait > 0) await sleep(wait);
        await submitter.query("SELECT tuvl.submit($1, '{\"ok\": true}')", [ids[i]]);
    }
    const submitS = (performance.now() - s0) / 1000;
    await Promise.race([Promise.all(done), sleep(120_000)]);
    await submitter.end();
    await listener.end();
    /* checks and latencies */
    const final = new Map((await c.query("SELECT id, last_seq, status FROM tuvl.runs WHERE id = ANY($1)", [ids])).rows.map((r) => [r.id, r]));
    await c.end();
    let bad = 0;
    const lat = [];
    let missingNotify = 0;
    for (const id of ids) {
        const s = seqs.get(id);
        const want = final.get(id).last_seq;
        if (s.length !== want || s.some((x, i) => x !== i + 1) || final.get(id).status !== "completed") bad++;
        for (let seq = last.get(id) + 1; seq <= want; seq++) {
            const n = notified.get(`${id}:${seq}`);
            const r = received.get(`${id}:${seq}`);
            if (n === undefined) { missingNotify++; continue; }
            if (r !== undefined) lat.push(r - n);
        }
    }
    return {
        streams: ids.length, open_s: openS, submit_s: submitS, rate: RATE, ended, streams_at_server: health.streams,
        live_events: lat.length, delivery_ms: summarize(lat), missing_notifications: missingNotify,
        ok: bad === 0 && ended === ids.length, bad_streams: bad,
    };
}

async function main() {
    const token = await setup();
    const server = await startServer();
    log(`server at ${server.url}, pool ${POOL}`);
    const out = { config: { latency_runs: LAT_N, clients: CLIENTS, seconds: SECONDS, rounds: ROUNDS, streams: STREAMS, rate: RATE, pool: POOL,
                            node: process.version } };
    try {
        if (!args["streams-only"]) {
            log(`latency: ${LAT_N} starts each way, one at a time, alternating blocks of 100`);
            out.latency = await latency(server.url, token, server.child.pid);
            log(`latency p50: HTTP ${out.latency.http.median.toFixed(3)} ms, direct ${out.latency.direct.median.toFixed(3)} ms, overhead ${out.latency.overhead_p50_ms.toFixed(3)} ms; server CPU ${out.latency.server_cpu_ms_per_start?.toFixed(3)} ms per start; load ${out.latency.load_after}`);
            log(`throughput: ${CLIENTS} clients, ${SECONDS} s each way, ${ROUNDS} rounds`);
            out.throughput = await throughput(server.url, token);
        }
        log(`streams: ${STREAMS} SSE clients`);
        out.streams = await streams(server.url, token);
        const d = out.streams.delivery_ms;
        log(`delivery after commit: p50 ${d.median?.toFixed(1)} ms, p99 ${d.p99?.toFixed(1)} ms, max ${d.max?.toFixed(1)} ms over ${d.n} events; ok ${out.streams.ok}`);
    } finally {
        server.child.kill("SIGTERM");
    }
    const ratios = (out.throughput ?? []).map((r) => r.ratio).sort((a, b) => a - b);
    out.ratio_median = ratios[Math.floor(ratios.length / 2)];
    out.ok = out.streams.ok;
    if (args.json) writeFileSync(args.json, JSON.stringify(out, null, 2));
    else process.stdout.write(JSON.stringify(out, null, 2) + "\n");
    process.exit(out.ok ? 0 : 1);
}

main().catch((e) => {
    process.stderr.write(`bench/insight.mjs: ${e.stack ?? e}\n`);
    process.exit(1);
});
