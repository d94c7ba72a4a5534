// sse.test.mjs: GET /api/runs/{id}/events with a third-party SSE client (the
// npm package eventsource): replay, then live, resume by Last-Event-ID
// without gaps or duplicates, the end, and isolation between roles.
import assert from "node:assert/strict";
import { test } from "node:test";

import { EventSource } from "eventsource";

import { api, sql, tokens as T, until, URL_, waitStatus } from "./helpers.mjs";

const start = async (wf, token = T.alice, body = {}) => {
    const r = await api("POST", `/api/workflows/${wf}/runs`, { token, body });
    assert.equal(r.status, 202, r.text);
    return r.json.run_id;
};

const TYPES = ["run_queued", "run_started", "agent_started", "agent_completed", "signal", "checkpoint", "run_completed",
               "run_failed", "run_aborted", "paused", "resumed", "decision", "stream_error"];

/*
 * Follow a run with eventsource until it stops for good (the server's 204
 * after the final event); breakAfter: cut the first connection after that
 * many events, so that the client reconnects with Last-Event-ID.
 */
function follow(id, token, { breakAfter, after, summary } = {}) {
    const seen = [];
    const requests = [];
    let connections = 0;
    return new Promise((resolve, reject) => {
        const timer = setTimeout(() => { es.close(); reject(new Error(`no end after 30 s; saw ${seen.map((e) => e.seq)}`)); }, 30_000);
        const params = new URLSearchParams();
        if (after !== undefined) params.set("after", String(after));
        if (summary) params.set("summary", "true");
        const es = new EventSource(`${URL_}/api/runs/${id}/events${params.size ? `?${params}` : ""}`, {
            fetch: async (input, init) => {
                connections++;
                const headers = new Headers(init.headers);
                requests.push({ lastEventId: headers.get("last-event-id") });
                headers.set("Authorization", `Bearer ${token}`);
                const res = await fetch(input, { ...init, headers });
                if (breakAfter === undefined || connections > 1 || !res.body) return res;
                /* the first connection breaks after breakAfter events */
                let n = 0;
                const reader = res.body.getReader();
                const body = new ReadableStream({
                    async pull(ctl) {
                        const { done, value } = await reader.read();
                        if (done) return ctl.close();
                        const text = new TextDecoder().decode(value);
                        n += (text.match(/^id: /gm) ?? []).length;
                        ctl.enqueue(value);
                        if (n >= breakAfter) {
                            reader.cancel().catch(() => undefined);
                            ctl.error(new Error("cut"));
                        }
                    },
                });
                return new Response(body, { status: res.status, headers: res.headers });
            },
        });
        for (const t of TYPES)
            es.addEventListener(t, (e) => seen.push({ seq: Number(e.lastEventId), type: e.type, data: JSON.parse(e.data) }));
        es.addEventListener("error", (e) => {
            if (es.readyState === EventSource.CLOSED) {
                clearTimeout(timer);
                resolve({ seen, requests, connections, code: e.code });
            }
        });
    });
}

test("SSE: a finished run's journal, then the end (204 stops the client)", async () => {
    const r = await api("POST", "/api/workflows/greet/runs?wait=10s", { token: T.alice, body: { input: { name: "sse" } } });
    const id = r.json.run_id;
    const { seen, code } = await follow(id, T.alice);
    assert.deepEqual(seen.map((e) => e.seq), [1, 2, 3, 4, 5, 6, 7]);
    assert.equal(seen.at(-1).type, "run_completed");
    assert.equal(code, 204);
    const e = seen[2].data;
    assert.deepEqual(Object.keys(e).sort(), ["agent_id", "engine", "latency_ms", "payload", "run_id", "seq", "tokens", "ts", "type"]);
    assert.equal(e.agent_id, "hello");
    assert.equal(e.run_id, id);
    /* ?summary=true adds tuvl.timeline()'s one-line summary */
    const s = (await follow(id, T.alice, { summary: true })).seen[2].data;
    assert.deepEqual(Object.keys(s).sort(), ["agent_id", "engine", "latency_ms", "payload", "run_id", "seq", "summary", "tokens", "ts", "type"]);
    assert.equal(s.summary, "entered ModelOp step");
});

test("SSE: live events of a running run, resumed by Last-Event-ID without gaps or duplicates", async () => {
    const id = await start("slow");
    const { seen, requests, connections } = await follow(id, T.alice, { breakAfter: 3 });
    assert.ok(connections >= 2, "the client reconnected");
    const seqs = seen.map((e) => e.seq);
    assert.deepEqual(seqs, Array.from({ length: seqs.length }, (_, i) => i + 1), `gapless and once each: ${seqs}`);
    assert.equal(seen.at(-1).type, "run_completed");
    assert.ok(requests[1].lastEventId !== null && Number(requests[1].lastEventId) >= 3, JSON.stringify(requests));
    assert.equal(await waitStatus(id, "completed"), "completed");
    const n = (await sql("SELECT count(*)::int AS n FROM tuvl.events WHERE run_id = $1", [id]))[0].n;
    assert.equal(seqs.length, n);
});

test("SSE: ?after= and Last-Event-ID resume; retry is at most 5 s", async () => {
    const r = await api("POST", "/api/workflows/greet/runs?wait=10s", { token: T.alice, body: { input: { name: "after" } } });
    const id = r.json.run_id;
    const { seen } = await follow(id, T.alice, { after: 4 });
    assert.deepEqual(seen.map((e) => e.seq), [5, 6, 7]);
    const res = await fetch(`${URL_}/api/runs/${id}/events`, { headers: { Authorization: `Bearer ${T.alice}`, "Last-Event-ID": "6" } });
    assert.equal(res.status, 200);
    assert.match(res.headers.get("content-type"), /^text\/event-stream/);
    const text = await res.text();
    const retry = Number(/^retry: (\d+)$/m.exec(text)[1]);
    assert.ok(retry > 0 && retry <= 5000);
    assert.deepEqual([...text.matchAll(/^id: (\d+)$/gm)].map((m) => Number(m[1])), [7]);
    assert.match(text, /^event: run_completed$/m);
    const done = await fetch(`${URL_}/api/runs/${id}/events`, { headers: { Authorization: `Bearer ${T.alice}`, "Last-Event-ID": "7" } });
    assert.equal(done.status, 204);
    const bad = await fetch(`${URL_}/api/runs/${id}/events?after=x`, { headers: { Authorization: `Bearer ${T.alice}` } });
    assert.equal(bad.status, 400);
});

test("SSE: a token of role A never gets role B's events; each stream has only its own run", async () => {
    const bobRun = await start("bobs", T.bob);
    let r = await fetch(`${URL_}/api/runs/${bobRun}/events`, { headers: { Authorization: `Bearer ${T.alice}` } });
    assert.equal(r.status, 404);
    const aliceRun = await start("slow");
    const bobRun2 = await start("bobs", T.bob);
    const [a, b, c] = await Promise.all([follow(aliceRun, T.alice), follow(bobRun2, T.bob), follow(bobRun2, T.carol)]);
    assert.ok(a.seen.every((e) => e.data.run_id === aliceRun));
    assert.ok(b.seen.every((e) => e.data.run_id === bobRun2));
    assert.equal(b.seen.at(-1).type, "run_completed");
    assert.deepEqual(c.seen.map((e) => e.seq), b.seen.map((e) => e.seq), "an operator follows any run");
    r = await fetch(`${URL_}/api/runs/${aliceRun}/events`, { headers: { Authorization: `Bearer ${T.bob}` } });
    assert.equal(r.status, 404);
});

test("SSE: a revoked token's stream ends at its next read", async () => {
    const [{ t }] = await sql("SELECT tuvl.create_token('insight_alice', '{runs:read,runs:start}', '1 hour') AS t");
    const id = await start("sleepy", t);
    const res = await fetch(`${URL_}/api/runs/${id}/events`, { headers: { Authorization: `Bearer ${t}` } });
    assert.equal(res.status, 200);
    const reader = res.body.getReader();
    let text = "";
    /* the first step's events commit when it ends: then revoke, before the second ends */
    while (!/event: checkpoint/.test(text)) text += new TextDecoder().decode((await reader.read()).value);
    await sql("SELECT tuvl.revoke_token($1)", [Number(t.split("_")[1])]);
    for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        text += new TextDecoder().decode(value);
    }
    assert.match(text, /event: stream_error\ndata: \{"status":401,"sqlstate":"28000","message":"invalid token"\}/);
    assert.ok(!/event: run_completed/.test(text), "no event after the revocation");
    await waitStatus(id, "completed");
});

test("SSE: 1,000 concurrent streams on one server, each gets its run's every event once", async () => {
    /* runs that wait for a person: all 1,000 streams are open before anything more happens */
    const runs = [];
    for (let i = 0; i < 20; i++) runs.push(await start("expense", T.alice, { input: { amount: i } }));
    for (const id of runs) await waitStatus(id, "waiting_human");
    const streams = [];
    for (let i = 0; i < 1000; i++) {
        const id = runs[i % runs.length];
        streams.push((async () => {
            const res = await fetch(`${URL_}/api/runs/${id}/events`, { headers: { Authorization: `Bearer ${i % 2 ? T.alice : T.carol}` } });
            assert.equal(res.status, 200);
            const text = await res.text();
            return { id, seqs: [...text.matchAll(/^id: (\d+)$/gm)].map((m) => Number(m[1])), text };
        })());
    }
    await until(async () => (await api("GET", "/health")).json.streams >= 1000, "1,000 streams open", 90_000);
    for (const id of runs) {
        const r = await api("POST", `/api/runs/${id}/submit`, { token: T.alice, body: { data: { approved: true } } });
        assert.equal(r.status, 200, r.text);
    }
    const results = await Promise.all(streams);
    const counts = new Map();
    for (const id of runs) {
        await waitStatus(id, "completed");
        counts.set(id, (await sql("SELECT count(*)::int AS n FROM tuvl.events WHERE run_id = $1", [id]))[0].n);
    }
    for (const r of results) {
        assert.deepEqual(r.seqs, Array.from({ length: counts.get(r.id) }, (_, i) => i + 1), `run ${r.id}`);
        assert.match(r.text, /event: run_completed/);
    }
});
