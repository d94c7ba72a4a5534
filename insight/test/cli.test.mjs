// cli.test.mjs: the command line end to end, straight to the database (as
// psql connects) and through the server (--url with a token).
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { api, cli, readText, ROOT, sql, TMP, tokens as T, TUVL, URL_, waitStatus } from "./helpers.mjs";

const asAlice = { env: { PGUSER: "insight_alice" } };
const viaServer = (token = T.alice) => ({ env: { TUVL_URL: URL_, TUVL_TOKEN: token } });

async function startRun(wf, body = {}) {
    const r = await api("POST", `/api/workflows/${wf}/runs`, { token: T.alice, body });
    assert.equal(r.status, 202, r.text);
    return r.json.run_id;
}

/* The CLI in the background (tail follows while the run goes on). */
function cliAsync(args, env) {
    return new Promise((resolve) => {
        const p = spawn(TUVL, args, { env: { ...process.env, PGDATABASE: "insight_test", ...env } });
        let stdout = "";
        let stderr = "";
        p.stdout.on("data", (d) => { stdout += d; });
        p.stderr.on("data", (d) => { stderr += d; });
        p.on("exit", (status) => resolve({ status, stdout, stderr }));
    });
}

test("cli: runs list, show and tail, direct and through the server", async () => {
    const id = await startRun("greet", { input: { name: "cli" } });
    await waitStatus(id, "completed");
    for (const opts of [asAlice, viaServer()]) {
        let r = cli(["runs", "list", "--workflow", "greet", "--limit", "3"], opts);
        assert.equal(r.status, 0, r.stderr);
        assert.match(r.stdout, /^id +workflow +v +status/m);
        assert.match(r.stdout, new RegExp(`^${id} +greet +1 +completed`, "m"));
        r = cli(["runs", "show", String(id)], opts);
        assert.equal(r.status, 0, r.stderr);
        assert.match(r.stdout, new RegExp(`^run ${id}: greet version 1, completed at end done`, "m"));
        assert.match(r.stdout, /\+\d+\.\d{3}s +3 +hello +agent_started +entered ModelOp step/);
        assert.match(r.stdout, /response: \{"greeting":"hello cli"\}/);
        r = cli(["runs", "list", "--json", "--limit", "2"], opts);
        assert.equal(r.status, 0, r.stderr);
        const j = JSON.parse(r.stdout);
        assert.ok(j.runs.length >= 1 && j.runs.length <= 2, r.stdout);
        assert.equal(j.runs[0].id, id, "the newest first");
    }
    /* tail follows a run live to its end, both ways */
    for (const opts of [asAlice, viaServer()]) {
        const live = await startRun("slow");
        const r = await cliAsync(["runs", "tail", String(live)], opts.env);
        assert.equal(r.status, 0, r.stderr);
        const seqs = [...r.stdout.matchAll(/^ +\+\d+\.\d+s +(\d+) /gm)].map((m) => Number(m[1]));
        assert.deepEqual(seqs, Array.from({ length: seqs.length }, (_, i) => i + 1), r.stdout);
        assert.match(r.stdout, /run_completed +completed at done/);
        assert.match(r.stdout, new RegExp(`^run ${live} completed at end done`, "m"));
    }
    const r = cli(["runs", "tail", String(id), "--json"], viaServer());
    assert.equal(r.status, 0, r.stderr);
    const events = r.stdout.trim().split("\n").map((l) => JSON.parse(l));
    assert.deepEqual(events.map((e) => e.seq), [1, 2, 3, 4, 5, 6, 7]);
});

test("cli: another role's run does not exist for it; errors print as psql prints them", async () => {
    const b = await api("POST", "/api/workflows/bobs/runs", { token: T.bob, body: {} });
    let r = cli(["runs", "show", String(b.json.run_id)], asAlice);
    assert.equal(r.status, 1);
    assert.match(r.stderr, new RegExp(`^ERROR:  run ${b.json.run_id} does not exist\nHINT:  `, "m"));
    r = cli(["runs", "show", String(b.json.run_id)], viaServer());
    assert.equal(r.status, 1);
    assert.match(r.stderr, /ERROR:  run \d+ does not exist/);
    r = cli(["runs", "list"], viaServer("tuvl_1_" + "A".repeat(43)));
    assert.equal(r.status, 1);
    assert.match(r.stderr, /ERROR:  invalid token/);
    r = cli(["runs", "frobnicate"], asAlice);
    assert.equal(r.status, 2);
    r = cli(["runs", "list", "--json"], viaServer(T.aliceStart));
    assert.equal(r.status, 1);
    assert.equal(JSON.parse(r.stdout).sqlstate, "42501");
});

test("cli: pause, resume, abort and steer", async () => {
    for (const opts of [asAlice, viaServer()]) {
        const id = await startRun("steady");
        let r = cli(["runs", "pause", String(id)], opts);
        assert.equal(r.status, 0, r.stderr);
        await waitStatus(id, "paused");
        r = cli(["runs", "steer", String(id), "keep", "it", "short"], opts);
        assert.equal(r.status, 0, r.stderr);
        r = cli(["runs", "resume", String(id)], opts);
        assert.equal(r.status, 0, r.stderr);
        assert.match(r.stdout, new RegExp(`resumed run ${id}`));
        await waitStatus(id, "completed");
        const a = await startRun("steady");
        r = cli(["runs", "abort", String(a), "not", "needed"], opts);
        assert.equal(r.status, 0, r.stderr);
        await waitStatus(a, "aborted");
        assert.match((await sql("SELECT error FROM tuvl.runs WHERE id = $1", [a]))[0].error, /aborted by insight_alice: not needed/);
        r = cli(["runs", "abort", String(a)], opts);
        assert.equal(r.status, 1);
        assert.match(r.stderr, /ERROR:  cannot abort run \d+: its status is aborted/);
    }
});

test("cli: people list and answer, with a form prompt from the step's schema", async () => {
    const id = await startRun("expense", { input: { amount: 10 } });
    await waitStatus(id, "waiting_human");
    let r = cli(["people", "list"], asAlice);
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, new RegExp(`^${id} +expense +review +insight_alice +submit +form: approved, comment`, "m"), r.stdout);
    /* the prompt asks for each property; a wrong answer is asked again */
    r = cli(["people", "answer", String(id)], { ...asAlice, input: "maybe\ny\nreceipt checked\n" });
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stderr, /approved \[y\/n\]: /);
    assert.match(r.stderr, /answer y or n/);
    assert.match(r.stderr, /comment \[text, at most 200 characters\] \(optional\): /);
    await waitStatus(id, "completed");
    assert.deepEqual((await sql("SELECT context -> 'review' AS r FROM tuvl.runs WHERE id = $1", [id]))[0].r,
                     { approved: true, comment: "receipt checked" });
    /* through the server, non-interactively */
    const id2 = await startRun("expense", { input: { amount: 20 } });
    await waitStatus(id2, "waiting_human");
    r = cli(["people", "answer", String(id2), "--data", '{"approved": "no"}'], viaServer());
    assert.equal(r.status, 1);
    assert.match(r.stderr, /ERROR:  data submitted to step "review" does not match its schema/);
    r = cli(["people", "answer", String(id2), "--data", '{"approved": false}', "--json"], viaServer());
    assert.equal(r.status, 0, r.stderr);
    await waitStatus(id2, "completed");
    assert.deepEqual((await sql("SELECT response FROM tuvl.runs WHERE id = $1", [id2]))[0].response, { paid: 0 });
    r = cli(["people", "answer", String(id2)], asAlice);
    assert.equal(r.status, 1);
    assert.match(r.stderr, /waits for nobody/);
});

test("cli: runs pin and runs replay (exit 1 on a divergence)", async () => {
    const r0 = await api("POST", "/api/workflows/greet/runs?wait=10s", { token: T.alice, body: { input: { name: "pinned" } } });
    const id = r0.json.run_id;
    const file = join(TMP, "greet.journal.json");
    let r = cli(["runs", "pin", String(id), "--out", file], asAlice);
    assert.equal(r.status, 0, r.stderr);
    assert.equal(JSON.parse(readText(file)).workflow, "greet");
    r = cli(["runs", "pin", String(id)], { ...viaServer(), cwd: TMP });
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, new RegExp(`pinned run ${id} to tests/fixtures/greet/run-${id}.journal.json`));
    for (const opts of [asAlice, viaServer()]) {
        r = cli(["runs", "replay", file], opts);
        assert.equal(r.status, 0, r.stderr);
        assert.match(r.stdout, /ended as recorded: completed at end done/);
    }
    const bad = join(TMP, "bad.journal.json");
    const f = JSON.parse(readText(file));
    f.response = { greeting: "hello somebody else" };
    writeFileSync(bad, JSON.stringify(f));
    r = cli(["runs", "replay", bad], asAlice);
    assert.equal(r.status, 1);
    assert.match(r.stderr, /ERROR:  replay of run \d+ diverged: the replay's response differs from the recording's/);
    r = cli(["runs", "replay", join(TMP, "missing.json")], asAlice);
    assert.equal(r.status, 1);
    assert.match(r.stderr, /could not read file/);
});

test("cli: validate, ship --strict, and tokens create, list and revoke", async () => {
    const good = join(TMP, "cli_flow.yaml");
    writeFileSync(good, "name: cli_flow\nsteps:\n  - { id: a, kind: ModelOp, sql: SELECT 1 }\n");
    const bad = join(TMP, "bad_flow.yaml");
    writeFileSync(bad, "name: bad_flow\nsteps:\n  - { id: a, kind: ModelOp, sqll: SELECT 1 }\n");
    let r = cli(["validate", good], asAlice);
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, /cli_flow.yaml: valid/);
    r = cli(["validate", bad], asAlice);
    assert.equal(r.status, 1);
    assert.match(r.stdout, /^error +steps\[0\]/m);
    r = cli(["ship", "--strict", good], asAlice);
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, /registered cli_flow version 1/);
    r = cli(["ship", good], viaServer());
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, /registered cli_flow version 2/);
    r = cli(["ship", bad], viaServer());
    assert.equal(r.status, 1);
    assert.match(r.stdout, /not shipped/);
    assert.equal((await sql("SELECT count(*)::int AS n FROM tuvl.workflows WHERE name = 'bad_flow'"))[0].n, 0);

    r = cli(["tokens", "create", "insight_alice", "--scopes", "runs:read", "--expires", "1 hour"], asAlice);
    assert.equal(r.status, 0, r.stderr);
    const token = r.stdout.trim();
    assert.match(token, /^tuvl_\d+_[A-Za-z0-9_-]{43}$/);
    assert.match(r.stderr, /shown once/);
    r = cli(["runs", "list"], viaServer(token));
    assert.equal(r.status, 0, r.stderr);
    r = cli(["tokens", "list", "--json"], asAlice);
    const listed = JSON.parse(r.stdout).tokens.find((t) => t.id === Number(token.split("_")[1]));
    assert.deepEqual(listed.scopes, ["runs:read"]);
    r = cli(["tokens", "revoke", String(listed.id)], viaServer(T.aliceAdmin));
    assert.equal(r.status, 0, r.stderr);
    r = cli(["runs", "list"], viaServer(token));
    assert.equal(r.status, 1);
    r = cli(["tokens", "create", "insight_bob", "--scopes", "runs:read"], asAlice);
    assert.equal(r.status, 1);
    assert.match(r.stderr, /permission denied to create a token for role "insight_bob"/);
    r = cli(["tokens", "list"], viaServer(T.alice));
    assert.equal(r.status, 1);
    assert.match(r.stderr, /scope admin/);
});

test("cli: connects like psql (PGHOST...) or with --db CONNINFO; a bad conninfo is a usage error", () => {
    let r = cli(["runs", "list", "--db", `host=${process.env.PGHOST} port=${process.env.PGPORT} dbname=insight_test user=insight_bob`]);
    assert.equal(r.status, 0, r.stderr);
    assert.ok(!/insight_alice/.test(r.stdout), "bob sees no run of alice");
    r = cli(["runs", "list", "--db", "hots=x"]);
    assert.equal(r.status, 2);
    assert.match(r.stderr, /invalid connection option "hots"/);
    r = cli(["runs", "list"], { env: { PGPORT: "1" } });
    assert.equal(r.status, 1);
});

/* The scripted MCP server of revision 2026-07-28 (test/servers), on a free port. */
function startMcp26() {
    const p = spawn("python3", [join(ROOT, "test", "servers", "mcp_stateless_server.py"), "--port", "0"],
                    { stdio: ["ignore", "ignore", "pipe"] });
    return new Promise((resolve, reject) => {
        let err = "";
        p.stderr.on("data", (d) => {
            err += d;
            const m = /:(\d+)\n/.exec(err);
            if (m) resolve({ url: `http://127.0.0.1:${m[1]}/mcp`, stop: () => p.kill() });
        });
        p.on("exit", () => reject(new Error(`the MCP server ended: ${err}`)));
    });
}

test("cli: people answer an MCP server's question: declined, cancelled through the server, accepted", async () => {
    const mcp = await startMcp26();
    try {
        const c = `SET ROLE insight_alice; SELECT tuvl.register_workflow($y$
name: cli_ask
steps:
  - id: confirm
    kind: MCP
    mcp: { url: "${mcp.url}", tool: confirm, arguments: { operation: "{{ op }}" } }
    output: answer
    routes: { default: done }
ends:
  - { id: done, response: "{{ answer.text }}" }
$y$); RESET ROLE`;
        await sql(c);
        const ask = async (op) => {
            const id = await startRun("cli_ask", { input: { op } });
            await waitStatus(id, "waiting_human");
            return id;
        };
        const response = async (id) => (await sql("SELECT response FROM tuvl.runs WHERE id = $1", [id]))[0].response;
        let id = await ask("drop");
        let r = cli(["people", "answer", String(id), "--decline"], asAlice);
        assert.equal(r.status, 0, r.stderr);
        await waitStatus(id, "completed");
        assert.equal(await response(id), "drop: declined");
        id = await ask("move");
        r = cli(["people", "answer", String(id), "--cancel"], viaServer());
        assert.equal(r.status, 0, r.stderr);
        await waitStatus(id, "completed");
        assert.equal(await response(id), "move: cancelled");
        /* the prompt: the server's message, then the form's fields */
        id = await ask("deploy");
        r = cli(["people", "answer", String(id)], { ...asAlice, input: "a\ny\nlooks good\n" });
        assert.equal(r.status, 0, r.stderr);
        assert.match(r.stderr, /the MCP server http:\/\/127\.0\.0\.1:\d+\/mcp asks, for its tool confirm:\n {2}Confirm deploy\?/);
        assert.match(r.stderr, /accept, decline or cancel\? \[a\/d\/c\]: /);
        await waitStatus(id, "completed");
        assert.equal(await response(id), "deploy: accepted confirmed=true note=looks good");
        /* decline is refused for a Human step */
        const h = await startRun("expense", { input: { amount: 5 } });
        await waitStatus(h, "waiting_human");
        r = cli(["people", "answer", String(h), "--decline"], asAlice);
        assert.equal(r.status, 1);
        assert.match(r.stderr, /its Human step "review" waits for data/);
        r = cli(["people", "answer", String(h), "--data", '{"approved": true}'], asAlice);
        assert.equal(r.status, 0, r.stderr);
    } finally {
        mcp.stop();
    }
});
