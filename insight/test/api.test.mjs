// api.test.mjs: every endpoint and scope of the server, and bad input.
import assert from "node:assert/strict";
import { test } from "node:test";

import { Validator } from "@seriousme/openapi-schema-validator";

import { api, runStatus, server, sign, sql, tokens as T, until, waitStatus } from "./helpers.mjs";

const secretOf = (t) => t.slice(t.indexOf("_", 5) + 1);
const start = (wf, body = {}, opts = {}) =>
    api("POST", `/api/workflows/${wf}/runs${opts.query ?? ""}`, { token: opts.token ?? T.alice, body, headers: opts.headers });

test("health answers without a token; an unknown route is a JSON 404", async () => {
    const h = await api("GET", "/health");
    assert.equal(h.status, 200);
    assert.equal(h.json.status, "ok");
    assert.equal(h.json.listener, true);
    const r = await api("GET", "/api/nothing", { token: T.alice });
    assert.equal(r.status, 404);
    assert.deepEqual(Object.keys(r.json).sort(), ["detail", "hint", "message", "sqlstate"]);
});

test("a start without a wait answers 202 with the run's URLs", async () => {
    const r = await start("greet", { input: { name: "ada" } });
    assert.equal(r.status, 202, r.text);
    assert.deepEqual(Object.keys(r.json).sort(), ["events_url", "run_id", "status", "status_url"]);
    assert.equal(r.json.status, "queued");
    assert.equal(r.headers.get("location"), `/api/runs/${r.json.run_id}`);
    assert.equal(r.json.events_url, `/api/runs/${r.json.run_id}/events`);
    await waitStatus(r.json.run_id, "completed");
    const g = await api("GET", r.json.status_url, { token: T.alice });
    assert.equal(g.status, 200);
    assert.equal(g.json.status, "completed");
    assert.deepEqual(g.json.response, { greeting: "hello ada" });
    assert.deepEqual(g.json.input, { name: "ada" });
    assert.equal(g.json.principal, "insight_alice");
});

test("the sync path answers with the end when the run ends within ?wait", async () => {
    const r = await start("greet", { input: { name: "bo" } }, { query: "?wait=10s" });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.status, "completed");
    assert.equal(r.json.end, "done");
    assert.deepEqual(r.json.response, { greeting: "hello bo" });
});

test("the sync path hands a run that takes longer to the workers: 202, and it goes on", async () => {
    const r = await start("slow", {}, { query: "?wait=100ms" });
    assert.equal(r.status, 202, r.text);
    assert.ok(["queued", "running"].includes(r.json.status), r.text);
    assert.equal(await waitStatus(r.json.run_id, "completed"), "completed");
    const g = await api("GET", `/api/runs/${r.json.run_id}`, { token: T.alice });
    assert.deepEqual(g.json.response, { n: 3 });
});

test("the workflow's trigger.sync_timeout makes a start synchronous; ?wait=0 does not", async () => {
    const r = await start("quick_default");
    assert.equal(r.status, 200, r.text);
    assert.deepEqual(r.json.response, { quick: true });
    const a = await start("quick_default", {}, { query: "?wait=0" });
    assert.equal(a.status, 202, a.text);
});

test("key, not_before and priority reach tuvl.start_run()", async () => {
    const a = await start("greet", { input: { name: "k" }, key: "order-17" });
    const b = await start("greet", { input: { name: "k" }, key: "order-17" });
    assert.equal(a.status, 202);
    assert.equal(b.json.run_id, a.json.run_id);
    const w = await start("greet", { input: { name: "k" }, key: "order-17" }, { query: "?wait=10s" });
    assert.equal(w.status, 200, w.text);
    assert.equal(w.json.run_id, a.json.run_id);
    const later = new Date(Date.now() + 3600_000).toISOString();
    const s = await start("greet", { input: { name: "later" }, not_before: later, priority: 5 });
    assert.equal(s.status, 202);
    assert.equal(s.json.status, "sleeping");
    const [row] = await sql("SELECT status, priority, wake_at FROM tuvl.runs WHERE id = $1", [s.json.run_id]);
    assert.equal(row.status, "sleeping");
    assert.equal(row.priority, 5);
    await sql("SELECT tuvl.abort_run($1)", [s.json.run_id]);
    const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const t = await start("greet", { input: { name: "traced" } }, { headers: { traceparent: tp } });
    assert.equal((await sql("SELECT traceparent FROM tuvl.runs WHERE id = $1", [t.json.run_id]))[0].traceparent, tp);
});

test("debounce reaches tuvl.start_run(): starts of a key coalesce, the latest input wins", async () => {
    const a = await start("greet", { input: { name: "first" }, key: "burst-1", debounce: "1 s" });
    assert.equal(a.status, 202, a.text);
    assert.equal(a.json.status, "sleeping");
    const b = await start("greet", { input: { name: "second" }, key: "burst-1", debounce: "1 s" });
    assert.equal(b.status, 202, b.text);
    assert.equal(b.json.run_id, a.json.run_id);
    const [w] = await sql("SELECT waiting ->> 'for' AS f FROM tuvl.runs_in_flight WHERE id = $1", [a.json.run_id]);
    assert.equal(w.f, "debounce");
    assert.equal(await waitStatus(a.json.run_id, "completed"), "completed");
    const g = await api("GET", `/api/runs/${a.json.run_id}`, { token: T.alice });
    assert.deepEqual(g.json.input, { name: "second" });
    assert.deepEqual(g.json.response, { greeting: "hello second" });
    const [n] = await sql("SELECT count(*)::int AS n FROM tuvl.runs WHERE key = 'burst-1'");
    assert.equal(n.n, 1);
});

test("bad input gets a clear error with the status the contract gives", async () => {
    let r = await start("no_such_flow", { input: {} });
    assert.equal(r.status, 404);
    assert.equal(r.json.sqlstate, "42704");
    assert.match(r.json.message, /workflow "no_such_flow" does not exist/);

    r = await api("POST", "/api/workflows/greet/runs", { token: T.alice, raw: '{"input": {"name": "x"' });
    assert.equal(r.status, 400);
    assert.equal(r.json.sqlstate, "22P02");
    assert.match(r.json.message, /not valid JSON/);

    r = await start("greet", { input: { name: 42 } });
    assert.equal(r.status, 422);
    assert.equal(r.json.sqlstate, "22023");
    assert.equal(r.json.message, "run input does not match its schema");
    assert.match(r.json.detail, /At \$\.name: expected string, got integer/);

    r = await start("greet", { input: { nom: "x" } });
    assert.equal(r.status, 422);
    assert.match(r.json.detail, /missing required property "name"/);

    r = await start("greet", { input: [1, 2] });
    assert.equal(r.status, 422);

    r = await start("greet", { input: { name: "x" }, debounce: "5s" });
    assert.equal(r.status, 400);
    assert.match(r.json.message, /debounce needs a key/);

    r = await start("greet", { input: { name: "x" }, key: "d-bad", debounce: "soon" });
    assert.equal(r.status, 400);
    assert.equal(r.json.sqlstate, "22007");

    r = await start("greet", { input: { name: "x" }, key: "d-bad", debounce: "0 s" });
    assert.equal(r.status, 400);
    assert.match(r.json.message, /debounce must be a positive interval/);

    r = await start("greet", { input: { name: "x" }, key: "d-bad", debounce: 5 });
    assert.equal(r.status, 400);
    assert.match(r.json.message, /debounce must be a non-empty string/);

    r = await start("greet", { input: { name: "x" }, inputs: {} });
    assert.equal(r.status, 400);
    assert.match(r.json.message, /unknown key "inputs"/);

    r = await start("greet", { input: { name: "x" }, priority: "high" });
    assert.equal(r.status, 400);

    r = await start("greet", { input: { name: "x" } }, { query: "?wait=soon" });
    assert.equal(r.status, 400);
    assert.equal(r.json.sqlstate, "22007");

    r = await api("POST", "/api/workflows/greet/runs", { token: T.alice, raw: JSON.stringify({ input: { name: "x".repeat(70_000) } }) });
    assert.equal(r.status, 413);
    assert.equal(r.json.sqlstate, "54000");

    r = await api("GET", "/api/runs/abc", { token: T.alice });
    assert.equal(r.status, 400);
});

test("no token, a malformed, an unknown, an expired and a revoked token: 401, the same answer", async () => {
    let r = await start("greet", { input: { name: "x" } }, { token: "" });
    assert.equal(r.status, 401);
    assert.equal(r.json.message, "no token");
    assert.equal(r.headers.get("www-authenticate"), "Bearer");
    const bodies = new Set();
    for (const t of ["nonsense", T.alice.slice(0, -1) + (T.alice.endsWith("A") ? "B" : "A"), "tuvl_999999_" + "A".repeat(43), T.expired, T.revoked]) {
        const t0 = Date.now();
        r = await start("greet", { input: { name: "x" } }, { token: t });
        assert.equal(r.status, 401, `${t}: ${r.text}`);
        assert.ok(Date.now() - t0 >= 740, "a failed authentication is answered after the delay");
        assert.equal(r.json.sqlstate, "28000");
        assert.ok(!r.text.includes(t), "the answer does not repeat the token");
        bodies.add(r.json.message + "|" + r.json.detail);
    }
    assert.equal(bodies.size, 1, [...bodies].join("\n"));
    r = await api("GET", `/api/runs?access_token=${T.alice}`);
    assert.equal(r.status, 401, "a token in the URL is not taken");
});

test("failed authentications cost the caller, not the server: others are served meanwhile", async () => {
    const bad = Array.from({ length: 40 }, () => start("greet", { input: { name: "x" } }, { token: "tuvl_1_" + "B".repeat(43) }));
    /* checked by the database, now waiting out their delay (0.75 to 1.25 s): they hold no connection */
    await until(async () => (await api("GET", "/health")).json.delayed >= 30, "30 failures waiting out their delay", 10_000);
    const good = await api("GET", "/api/runs?limit=1", { token: T.alice });
    assert.equal(good.status, 200);
    assert.ok((await api("GET", "/health")).json.delayed > 0, "the good request was served while the failures waited");
    for (const r of await Promise.all(bad)) assert.equal(r.status, 401);
});

test("scopes: the database refuses what the token does not allow (403)", async () => {
    let r = await start("greet", { input: { name: "x" } }, { token: T.aliceRead });
    assert.equal(r.status, 403, r.text);
    assert.equal(r.json.sqlstate, "42501");
    assert.match(r.json.message, /does not have scope runs:start/);

    const s = await start("sleepy", {}, { token: T.aliceStart });
    assert.equal(s.status, 202, s.text);
    const id = s.json.run_id;
    r = await api("GET", `/api/runs/${id}`, { token: T.aliceStart });
    assert.equal(r.status, 403);
    assert.match(r.json.message, /scope runs:read/);
    r = await api("GET", "/api/runs", { token: T.aliceStart });
    assert.equal(r.status, 403);
    r = await api("POST", `/api/runs/${id}/pause`, { token: T.aliceRead });
    assert.equal(r.status, 403);
    assert.match(r.json.message, /scope runs:control/);
    r = await api("POST", `/api/runs/${id}/abort`, { token: T.aliceStart, body: { reason: "no" } });
    assert.equal(r.status, 403);
    r = await api("GET", `/api/runs/${id}/events`, { token: T.aliceStart });
    assert.equal(r.status, 403);
    r = await api("POST", `/api/runs/${id}/submit`, { token: T.aliceControl, body: { data: {} } });
    assert.equal(r.status, 403);
    assert.match(r.json.message, /scope people:answer/);
    r = await api("GET", "/api/tokens", { token: T.alice });
    assert.equal(r.status, 403);
    assert.match(r.json.message, /scope admin/);
    r = await api("POST", "/api/workflows", { token: T.aliceStart, body: { source: "name: x\nsteps: [{id: a, kind: ModelOp, sql: SELECT 1}]" } });
    assert.equal(r.status, 403);
    assert.match(r.json.message, /scope workflows:write/);
    /* a role that is not a tuvl_user: its token is valid, its privileges are not there */
    r = await start("greet", { input: { name: "x" } }, { token: T.nobody });
    assert.equal(r.status, 403);
    assert.match(r.json.message, /permission denied/);
    /* runs:control without runs:read: the pause works, the status is not shown */
    r = await api("POST", `/api/runs/${id}/abort`, { token: T.aliceControl, body: { reason: "scope test" } });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.status, null);
    assert.equal(await waitStatus(id, "aborted"), "aborted");
});

test("a token of role A never sees role B's runs (HTTP)", async () => {
    const b = await start("bobs", {}, { token: T.bob });
    assert.equal(b.status, 202);
    const a = await start("greet", { input: { name: "a" } }, { query: "?wait=10s" });
    for (const [path, method] of [[`/api/runs/${b.json.run_id}`, "GET"], [`/api/runs/${b.json.run_id}/events`, "GET"],
                                  [`/api/runs/${b.json.run_id}/timeline`, "GET"], [`/api/runs/${b.json.run_id}/pause`, "POST"],
                                  [`/api/runs/${b.json.run_id}/fixture`, "GET"]]) {
        const r = await api(method, path, { token: T.alice });
        assert.equal(r.status, 404, `${method} ${path}: ${r.text}`);
        assert.equal(r.json.message, `run ${b.json.run_id} does not exist`);
    }
    const list = await api("GET", "/api/runs?limit=1000", { token: T.alice });
    assert.ok(list.json.runs.every((r) => r.principal === "insight_alice"));
    assert.ok(!list.json.runs.some((r) => r.id === b.json.run_id));
    const bl = await api("GET", "/api/runs?limit=1000", { token: T.bob });
    assert.ok(bl.json.runs.every((r) => r.principal === "insight_bob"));
    assert.ok(!bl.json.runs.some((r) => r.id === a.json.run_id));
    /* an operator sees both */
    const cl = await api("GET", "/api/runs?limit=1000", { token: T.carol });
    const ids = new Set(cl.json.runs.map((r) => r.id));
    assert.ok(ids.has(a.json.run_id) && ids.has(b.json.run_id));
    /* bob cannot start alice's workflow as alice: it runs as bob */
    const x = await start("greet", { input: { name: "b" } }, { token: T.bob, query: "?wait=10s" });
    assert.equal(x.status, 200, x.text);
    assert.equal((await sql("SELECT principal FROM tuvl.runs WHERE id = $1", [x.json.run_id]))[0].principal, "insight_bob");
});

test("GET /api/runs filters and pages by keyset", async () => {
    for (let i = 0; i < 5; i++) await start("greet", { input: { name: `p${i}` }, key: `page-${i}` });
    let r = await api("GET", "/api/runs?workflow=greet&key=page-3", { token: T.alice });
    assert.equal(r.status, 200);
    assert.equal(r.json.runs.length, 1);
    assert.equal(r.json.runs[0].key, "page-3");
    const seen = [];
    let next = "/api/runs?workflow=greet&limit=2";
    while (next) {
        r = await api("GET", next, { token: T.alice });
        assert.equal(r.status, 200);
        assert.ok(r.json.runs.length <= 2);
        seen.push(...r.json.runs.map((x) => x.id));
        next = r.json.next;
    }
    const all = (await sql("SELECT id FROM tuvl.runs WHERE workflow = 'greet' AND principal = 'insight_alice' ORDER BY id DESC")).map((x) => x.id);
    assert.deepEqual(seen, all);
    r = await api("GET", "/api/runs?status=completed,aborted&limit=1000", { token: T.alice });
    assert.ok(r.json.runs.every((x) => ["completed", "aborted"].includes(x.status)));
    r = await api("GET", "/api/runs?status=done", { token: T.alice });
    assert.equal(r.status, 400);
    assert.match(r.json.message, /"done" is not a status/);
    r = await api("GET", "/api/runs?limit=5000", { token: T.alice });
    assert.equal(r.status, 400);
});

test("pause, resume, abort and steer (scope runs:control), and their wrong states (409)", async () => {
    const s = await start("slow");
    const id = s.json.run_id;
    let r = await api("POST", `/api/runs/${id}/pause`, { token: T.alice });
    assert.equal(r.status, 200, r.text);
    assert.equal(await waitStatus(id, "paused"), "paused");
    r = await api("POST", `/api/runs/${id}/pause`, { token: T.alice });
    assert.equal(r.status, 200);
    assert.deepEqual(r.json.notices, [`run ${id} is already paused`]);
    r = await api("POST", `/api/runs/${id}/steer`, { token: T.alice, body: { message: "be brief" } });
    assert.equal(r.status, 200, r.text);
    r = await api("POST", `/api/runs/${id}/steer`, { token: T.alice, body: { message: "" } });
    assert.equal(r.status, 400);
    r = await api("POST", `/api/runs/${id}/steer`, { token: T.alice, body: {} });
    assert.equal(r.status, 400);
    r = await api("POST", `/api/runs/${id}/resume`, { token: T.alice });
    assert.equal(r.status, 200);
    assert.equal(await waitStatus(id, "completed"), "completed");
    r = await api("POST", `/api/runs/${id}/resume`, { token: T.alice });
    assert.equal(r.status, 409);
    assert.equal(r.json.sqlstate, "55000");

    const s2 = await start("sleepy");
    r = await api("POST", `/api/runs/${s2.json.run_id}/abort`, { token: T.carol, body: { reason: "an operator says no" } });
    assert.equal(r.status, 200, r.text);
    assert.equal(await waitStatus(s2.json.run_id, "aborted"), "aborted");
    const g = await api("GET", `/api/runs/${s2.json.run_id}`, { token: T.alice });
    assert.match(g.json.error, /aborted by insight_carol: an operator says no/);
    r = await api("POST", `/api/runs/${s2.json.run_id}/abort`, { token: T.alice });
    assert.equal(r.status, 409);
    r = await api("POST", `/api/runs/${s2.json.run_id}/pause`, { token: T.alice, body: { now: true } });
    assert.equal(r.status, 400);
});

test("people: the queue, a form answered with submit (422 when it does not fit), decide refused", async () => {
    const s = await start("expense", { input: { amount: 42.5 } });
    const id = s.json.run_id;
    await waitStatus(id, "waiting_human");
    let r = await api("GET", "/api/people", { token: T.alice });
    assert.equal(r.status, 200);
    const p = r.json.people.find((x) => x.run_id === id);
    assert.ok(p, r.text);
    assert.equal(p.answer_with, "submit");
    assert.equal(p.step, "review");
    assert.deepEqual(p.awaiting.form.required, ["approved"]);
    assert.equal((await api("GET", "/api/people", { token: T.bob })).json.people.some((x) => x.run_id === id), false);
    r = await api("POST", `/api/runs/${id}/submit`, { token: T.alice, body: { data: { approved: "yes" } } });
    assert.equal(r.status, 422);
    assert.match(r.json.detail, /At \$\.approved: expected boolean, got string/);
    r = await api("POST", `/api/runs/${id}/decide`, { token: T.alice, body: { approved: true } });
    assert.equal(r.status, 409);
    r = await api("POST", `/api/runs/${id}/decide`, { token: T.alice, body: { approved: "yes" } });
    assert.equal(r.status, 400);
    r = await api("POST", `/api/runs/${id}/submit`, { token: T.bob, body: { data: { approved: true } } });
    assert.equal(r.status, 404);
    r = await api("POST", `/api/runs/${id}/submit`, { token: T.alice, body: { data: { approved: true, comment: "ok" } } });
    assert.equal(r.status, 200, r.text);
    assert.equal(await waitStatus(id, "completed"), "completed");
    assert.deepEqual((await api("GET", `/api/runs/${id}`, { token: T.alice })).json.response, { paid: 42.5 });
});

test("fixture and replay: pinned, replayed with the writes rolled back, a divergence is 409", async () => {
    const s = await start("writer", {}, { query: "?wait=10s" });
    assert.equal(s.status, 200, s.text);
    const before = (await sql("SELECT count(*)::int AS n FROM insight_data.notes"))[0].n;
    let r = await api("GET", `/api/runs/${s.json.run_id}/fixture`, { token: T.alice });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.workflow, "writer");
    const fixture = r.json;
    r = await api("POST", "/api/replay", { token: T.alice, body: { fixture } });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.status, "completed");
    assert.equal(r.json.tokens_spent, 0);
    assert.equal((await sql("SELECT count(*)::int AS n FROM insight_data.notes"))[0].n, before, "the replay's writes were rolled back");
    r = await api("POST", "/api/replay", { token: T.alice, body: { fixture: { ...fixture, response: { wrote: false } } } });
    assert.equal(r.status, 409, r.text);
    assert.equal(r.json.sqlstate, "22000");
    assert.match(r.json.message, /diverged/);
    r = await api("POST", "/api/replay", { token: T.alice, body: { fixture: { nothing: 1 } } });
    assert.equal(r.status, 400);
    r = await api("POST", "/api/replay", { token: T.aliceRead, body: { fixture } });
    assert.equal(r.status, 403);
    const live = await start("sleepy");
    r = await api("GET", `/api/runs/${live.json.run_id}/fixture`, { token: T.alice });
    assert.equal(r.status, 409);
    assert.match(r.json.message, /has not ended/);
    await sql("SELECT tuvl.abort_run($1)", [live.json.run_id]);
});

test("the timeline endpoint gives tuvl.timeline() rows", async () => {
    const s = await start("greet", { input: { name: "t" } }, { query: "?wait=10s" });
    const r = await api("GET", `/api/runs/${s.json.run_id}/timeline`, { token: T.alice });
    assert.equal(r.status, 200);
    assert.deepEqual(r.json.timeline.map((x) => x.event),
                     ["run_queued", "run_started", "agent_started", "agent_completed", "signal", "checkpoint", "run_completed"]);
    assert.equal(r.json.timeline[2].step, "hello");
    assert.ok(r.json.timeline.every((x) => typeof x.at_ms === "number"));
});

test("validate and ship (scope workflows:write), and tokens (scope admin)", async () => {
    const good = "name: shipped_flow\nsteps:\n  - { id: a, kind: ModelOp, sql: SELECT 1 }\n";
    let r = await api("POST", "/api/validate", { token: T.aliceRead, body: { source: "name: x\nsteps: [{id: a, kind: Nope}]" } });
    assert.equal(r.status, 200);
    assert.equal(r.json.ok, false);
    assert.ok(r.json.findings.some((f) => f.severity === "error"));
    r = await api("POST", "/api/workflows", { token: T.alice, body: { source: good } });
    assert.equal(r.status, 201, r.text);
    assert.equal(r.json.workflow, "shipped_flow");
    assert.equal(r.json.version, 1);
    r = await api("POST", "/api/workflows", { token: T.alice, body: { source: good, strict: true } });
    assert.equal(r.json.version, 2);
    r = await api("POST", "/api/workflows", { token: T.alice, body: { source: "name: x\nsteps: [{id: a, kind: Nope}]" } });
    assert.equal(r.status, 422);
    assert.ok(r.json.findings.length > 0);
    r = await api("POST", "/api/workflows", { token: T.bob, body: { source: good } });
    assert.equal(r.status, 403, r.text);
    assert.match(r.json.message, /belongs to another role/);

    r = await api("POST", "/api/tokens", { token: T.aliceAdmin, body: { role: "insight_alice", scopes: ["runs:read"], expires: "1 hour" } });
    assert.equal(r.status, 201, r.text);
    const made = r.json;
    assert.match(made.token, /^tuvl_\d+_/);
    r = await api("GET", "/api/runs?limit=1", { token: made.token });
    assert.equal(r.status, 200);
    r = await api("GET", "/api/tokens", { token: T.aliceAdmin });
    assert.equal(r.status, 200);
    const listed = r.json.tokens.find((t) => t.id === made.id);
    assert.deepEqual(listed.scopes, ["runs:read"]);
    assert.ok(!JSON.stringify(r.json).includes(secretOf(made.token)), "no secret in the list");
    assert.ok(r.json.tokens.every((t) => t.role === "insight_alice"));
    r = await api("POST", "/api/tokens", { token: T.aliceAdmin, body: { role: "insight_bob", scopes: ["runs:read"] } });
    assert.equal(r.status, 403);
    r = await api("POST", "/api/tokens", { token: T.aliceAdmin, body: { role: "insight_alice", scopes: ["everything"] } });
    assert.equal(r.status, 400);
    r = await api("DELETE", `/api/tokens/${made.id}`, { token: T.aliceAdmin });
    assert.equal(r.status, 200);
    r = await api("GET", "/api/runs?limit=1", { token: made.token });
    assert.equal(r.status, 401);
});

test("webhooks: a signed route takes the HMAC of its body, a token route a Bearer token", async () => {
    const body = JSON.stringify({ amount: 12.5 });
    let r = await api("POST", "/hooks/insight/payments", { raw: body, headers: { "X-Signature": `sha256=${sign(body)}`, "Content-Type": "application/json" } });
    assert.ok([200, 202].includes(r.status), r.text);
    assert.equal((await sql("SELECT principal, input FROM tuvl.runs WHERE id = $1", [r.json.run_id]))[0].principal, "insight_alice");
    r = await api("POST", "/hooks/insight/payments", { raw: body, headers: { "X-Signature": sign(body) } });
    assert.ok([200, 202].includes(r.status), "plain hex works too");
    const t0 = Date.now();
    r = await api("POST", "/hooks/insight/payments", { raw: body, headers: { "X-Signature": sign(body + " ") } });
    assert.equal(r.status, 401);
    assert.equal(r.json.message, "invalid signature");
    assert.ok(Date.now() - t0 >= 290);
    r = await api("POST", "/hooks/insight/payments", { raw: body, headers: { "X-Signature": sign(body, "wrong secret") } });
    assert.equal(r.status, 401);
    r = await api("POST", "/hooks/insight/payments", { raw: body });
    assert.equal(r.status, 401);
    assert.equal(r.json.message, "no signature");
    r = await api("POST", "/hooks/insight/payments", { raw: JSON.stringify({ amount: "x" }), headers: { "X-Signature": sign(JSON.stringify({ amount: "x" })) } });
    assert.equal(r.status, 422);
    r = await api("POST", "/hooks/insight/payments", { token: T.alice, raw: body });
    assert.ok([200, 202].includes(r.status), "a token works on a signed route");
    r = await api("POST", "/hooks/insight/nowhere", { raw: body });
    assert.equal(r.status, 404);
    r = await api("POST", "/hooks/insight/../payments", { raw: body });
    assert.equal(r.status, 404);
    r = await api("PUT", "/hooks/insight/orders", { token: T.aliceStart, raw: "{}" });
    assert.equal(r.status, 200, r.text);
    assert.deepEqual(r.json.response, { took: true });
    r = await api("POST", "/hooks/insight/orders", { token: T.aliceStart, raw: "{}" });
    assert.equal(r.status, 405);
    assert.equal(r.headers.get("allow"), "PUT");
    r = await api("PUT", "/hooks/insight/orders", { token: T.aliceRead, raw: "{}" });
    assert.equal(r.status, 403);
    r = await api("PUT", "/hooks/insight/orders", { raw: "{}" });
    assert.equal(r.status, 401);
    r = await api("PUT", "/hooks/insight/orders", { token: T.aliceStart, raw: "[]" });
    assert.equal(r.status, 400);
});

test("the OpenAPI document is valid OpenAPI 3.1 and has each workflow's input schema", async () => {
    let r = await api("GET", "/api/openapi.json");
    assert.equal(r.status, 401);
    r = await api("GET", "/api/openapi.json", { token: T.aliceRead });
    assert.equal(r.status, 200);
    const doc = r.json;
    const result = await new Validator().validate(doc);
    assert.equal(result.valid, true, JSON.stringify(result.errors, null, 1));
    assert.equal(doc.openapi, "3.1.0");
    const greet = doc.paths["/api/workflows/greet/runs"].post;
    assert.deepEqual(greet.requestBody.content["application/json"].schema, { $ref: "#/components/schemas/start.greet" });
    const input = doc.components.schemas["input.greet"];
    assert.deepEqual(input.required, ["name"]);
    assert.equal(input.properties.address.$ref, "#/components/schemas/input.greet/$defs/address");
    assert.ok(doc.paths["/hooks/insight/payments"].post);
    assert.ok(doc.paths["/hooks/insight/orders"].put);
    assert.ok(doc.components.securitySchemes["signature.X-Signature"]);
    for (const p of ["/api/runs", "/api/runs/{id}", "/api/runs/{id}/events", "/api/runs/{id}/pause", "/api/runs/{id}/resume",
                     "/api/runs/{id}/abort", "/api/runs/{id}/steer", "/api/runs/{id}/submit", "/api/runs/{id}/decide",
                     "/api/people", "/api/runs/{id}/fixture", "/api/replay"])
        assert.ok(doc.paths[p], p);
});

test("hostile: no token in the server's log or answers, CORS only for the configured origin", async () => {
    for (const t of Object.values(T)) assert.ok(!server.log.text.includes(secretOf(t)), "a token's secret is in the log");
    assert.ok(!server.log.text.includes("whsec_test_1234"));
    let r = await api("GET", "/api/runs", { token: T.alice, headers: { Origin: "https://evil.example" } });
    assert.equal(r.headers.get("access-control-allow-origin"), null);
    r = await api("OPTIONS", "/api/runs", { headers: { Origin: "https://evil.example", "Access-Control-Request-Method": "GET" } });
    assert.equal(r.headers.get("access-control-allow-origin"), null);
    r = await api("OPTIONS", "/api/runs", { headers: { Origin: "https://allowed.example", "Access-Control-Request-Method": "GET" } });
    assert.equal(r.status, 204);
    assert.equal(r.headers.get("access-control-allow-origin"), "https://allowed.example");
    assert.match(r.headers.get("access-control-allow-headers"), /Authorization/);
    r = await api("GET", "/api/runs?limit=1", { token: T.alice });
    assert.equal(r.headers.get("cache-control"), "no-store");
    assert.equal(r.headers.get("x-content-type-options"), "nosniff");
    /* names are parameters, never SQL */
    r = await start("greet'; DROP TABLE tuvl.runs; --", { input: {} });
    assert.equal(r.status, 404);
    assert.ok((await sql("SELECT count(*)::int AS n FROM tuvl.runs"))[0].n > 0);
    r = await api("GET", "/api/runs", { headers: { Authorization: "Bearer " + "x".repeat(5000) } });
    assert.equal(r.status, 401);
    r = await api("GET", "/api/runs", { headers: { Authorization: "Basic YWxpY2U6cGFzcw==" } });
    assert.equal(r.status, 401);
    r = await api("GET", "/api/runs/99999999999999999999", { token: T.alice });
    assert.equal(r.status, 400);
    /* an error inside a step is the run's, not the server's */
    assert.ok(!/"level":50/.test(server.log.text), "no error in the server's log:\n" + server.log.text.split("\n").filter((l) => l.includes('"level":50')).join("\n"));
});

export { start, until, runStatus };

test("a connection killed in the middle of a request is a 503, and the server goes on", async () => {
    /* the synchronous path runs the workflow in the request's own transaction */
    const pending = start("sleepy", {}, { query: "?wait=10s" });
    let killed = 0;
    await until(async () => {
        const rows = await sql(`SELECT pg_terminate_backend(pid) AS t FROM pg_stat_activity
                                WHERE usename = 'insight_auth' AND state = 'active' AND query LIKE '%tuvl.run(%'`);
        killed = rows.filter((r) => r.t).length;
        return killed > 0;
    }, "the request's backend", 10_000);
    const r = await pending;
    assert.equal(r.status, 503, r.text);
    assert.equal(r.json.sqlstate, "08006");
    assert.ok(r.headers.get("retry-after"), "a 503 says when to try again");
    /* the server is still up, and its pool has a working connection again */
    assert.equal(server.child.exitCode, null, server.log.text.slice(-2000));
    const ok = await start("greet", { input: { name: "after" } });
    assert.equal(ok.status, 202, ok.text);
    assert.equal((await api("GET", "/health")).status, 200);
});

test("a token has one spelling: another that decodes to the same secret is refused", async () => {
    const t = T.alice;
    const id = t.slice(5, t.indexOf("_", 5));
    const secret = t.slice(t.indexOf("_", 5) + 1);
    const b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    /* the same 4 high bits in the last character, other padding bits */
    const last = b64.indexOf(secret.at(-1));
    const sibling = secret.slice(0, -1) + b64[last + 1];
    const authenticate = async (token) => {
        try {
            await sql("SELECT tuvl.authenticate($1)", [token]);
            return "accepted";
        } catch (e) {
            return e.code;
        }
    };
    assert.equal(await authenticate(t), "accepted");
    for (const bad of [`tuvl_${id}_${sibling}`, `tuvl_+${id}_${secret}`, `tuvl_0${id}_${secret}`, `tuvl_ ${id}_${secret}`])
        assert.equal(await authenticate(bad), "28000", bad);
    /* and the server refuses them before asking the database */
    const r = await api("GET", "/api/runs", { token: `tuvl_${id}_${sibling}` });
    assert.equal(r.status, 401);
});
