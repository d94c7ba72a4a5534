// test/mcp/run.mjs: run the MCP conformance suite's client scenarios against
// tuvl (started by test/mcp/run.sh, on the Node 22 it installs).
//
//   node test/mcp/run.mjs [scenario ...]
//
// Environment:
//   MCP_CONFORMANCE_CLIENT    the client command (default test/mcp/client.sh;
//                             the suite appends the server URL; no spaces in
//                             its path: the suite splits the command on them)
//   MCP_CONFORMANCE_EXPECTED  the expected failures (default
//                             test/mcp/conformance-expected.yml)
//   MCP_CONFORMANCE_TIMEOUT   milliseconds a scenario's client may take (30000)
//   MCP_CONFORMANCE_RESULTS   where the suite's results go (checks.json,
//                             stdout.txt, stderr.txt per scenario; default
//                             $TUVL_TMP/mcp-conformance or a temporary
//                             directory), kept for a failure's post-mortem
//   PGHOST, PGPORT, PGUSER    the cluster (a superuser), as libpq reads them
//
// The scenarios are every client scenario `conformance list --client`
// prints, run one at a time (some check timing).  A scenario passes when
// the suite's client command exits 0 (or the scenario allows a client
// error), the client did not time out, and the suite recorded at least one
// SUCCESS check and no FAILURE or WARNING.  The expected-failures file has
// the suite's own format (`conformance client --expected-failures` reads
// it) with one more rule: every entry has the reason it fails in the
// comment lines just above it.  Output: one TAP-like line per scenario,
// then a summary; exit status 1 when any line is "not ok".
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const cli = path.join(here, 'node_modules', '@modelcontextprotocol', 'conformance', 'dist', 'index.js');
const client = process.env.MCP_CONFORMANCE_CLIENT || path.join(here, 'client.sh');
const expectedFile = process.env.MCP_CONFORMANCE_EXPECTED || path.join(here, 'conformance-expected.yml');
const timeout = Number(process.env.MCP_CONFORMANCE_TIMEOUT || 30000);
const database = 'tuvl_mcp_conformance';
const psql = process.env.PGBIN && fs.existsSync(path.join(process.env.PGBIN, 'psql'))
  ? path.join(process.env.PGBIN, 'psql') : 'psql';

let n = 0;
let bad = 0;
function ok(text) { console.log(`ok ${++n} - ${text}`); }
function notOk(text) { bad++; console.log(`not ok ${++n} - ${text}`); }
function fatal(text) {
  notOk(`mcp-conformance: ${text}`);
  process.exit(1);
}

// The expected failures: {scenario: reason}, in the file's order.
function readExpected(file) {
  let text;
  try {
    text = fs.readFileSync(file, 'utf8');
  } catch (e) {
    fatal(`cannot read ${file}: ${e.message}`);
  }
  const expected = new Map();
  let inClient = false;
  let comment = [];
  text.split('\n').forEach((line, i) => {
    const where = `${path.basename(file)} line ${i + 1}`;
    let m;
    if (/^\s*$/.test(line)) {
      comment = [];
    } else if ((m = /^\s*#\s?(.*)$/.exec(line))) {
      comment.push(m[1].trim());
    } else if (/^client:\s*(\[\s*\])?\s*$/.test(line)) {
      inClient = true;
      comment = [];
    } else if ((m = /^\s+-\s+(\S+)\s*(?:#\s*(.*))?$/.exec(line)) && inClient) {
      const reason = [...comment, m[2] || ''].join(' ').trim();
      if (!reason) fatal(`${where}: ${m[1]} has no reason (a comment just above it)`);
      if (expected.has(m[1])) fatal(`${where}: ${m[1]} is listed twice`);
      expected.set(m[1], reason);
      comment = [];
    } else {
      fatal(`${where}: expected "client:", "  - <scenario>" or a comment, got: ${line}`);
    }
  });
  return expected;
}

function run(cmd, args, opts = {}) {
  return spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 64 << 20, ...opts });
}

function sql(statement, db = 'postgres') {
  const r = run(psql, ['-qAtX', '-v', 'ON_ERROR_STOP=1', '-d', db, '-c', statement]);
  if (r.status !== 0) fatal(`psql -c "${statement}" failed: ${(r.stderr || r.error || '').toString().trim()}`);
  return r.stdout.trim();
}

function listScenarios() {
  const r = run(process.execPath, [cli, 'list', '--client']);
  if (r.status !== 0) fatal(`conformance list --client failed: ${r.stderr.trim()}`);
  const names = [];
  for (const line of r.stdout.split('\n')) {
    const m = /^\s+-\s+(\S+)/.exec(line);
    if (m) names.push(m[1]);
  }
  if (names.length === 0) fatal('conformance list --client named no scenario');
  return names;
}

function* walk(dir) {
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) yield* walk(p);
    else yield p;
  }
}

// Run one scenario; {pass, reason, seconds}.
function runScenario(name, out) {
  fs.mkdirSync(out, { recursive: true });
  const started = Date.now();
  const r = run(process.execPath, [cli, 'client', '--command', client, '--scenario', name,
    '--timeout', String(timeout), '-o', out],
  { env: { ...process.env, PGDATABASE: database }, timeout: timeout + 60000 });
  const seconds = (Date.now() - started) / 1000;
  fs.writeFileSync(path.join(out, 'conformance.log'), `${r.stdout}\n${r.stderr}`);
  const files = fs.existsSync(out) ? [...walk(out)] : [];
  const checksFile = files.find((f) => path.basename(f) === 'checks.json');
  let checks = [];
  if (checksFile) {
    try {
      checks = JSON.parse(fs.readFileSync(checksFile, 'utf8'));
    } catch {
      return { pass: false, reason: `unreadable ${checksFile}`, seconds };
    }
  }
  const failed = checks.filter((c) => c.status === 'FAILURE' || c.status === 'WARNING');
  const succeeded = checks.filter((c) => c.status === 'SUCCESS');
  if (r.status === 0 && failed.length === 0 && succeeded.length > 0) return { pass: true, seconds };
  const reasons = [];
  if (r.error) reasons.push(`the suite did not finish: ${r.error.message}`);
  if (/CLIENT TIMED OUT/.test(r.stderr)) reasons.push(`client timed out after ${timeout} ms`);
  const stderrFile = files.find((f) => path.basename(f) === 'stderr.txt');
  const clientErr = stderrFile ? fs.readFileSync(stderrFile, 'utf8').trim().split('\n').pop() : '';
  if (clientErr) reasons.push(`client: ${clientErr}`);
  for (const c of failed.slice(0, 3)) reasons.push(`${c.status} ${c.id}: ${c.errorMessage || c.description}`);
  if (failed.length > 3) reasons.push(`and ${failed.length - 3} more failed checks`);
  if (checks.length > 0 && succeeded.length === 0 && failed.length === 0) reasons.push('no check succeeded');
  if (!checksFile) reasons.push('no checks recorded');
  if (reasons.length === 0) reasons.push(`the suite exited with ${r.status}`);
  return { pass: false, reason: reasons.join('; '), seconds };
}

if (!fs.existsSync(cli)) fatal(`the suite is missing: ${cli} (test/mcp/run.sh installs it)`);
if (/\s/.test(client)) fatal(`the client command's path has a space, which the suite cannot run: ${client}`);
const expected = readExpected(expectedFile);
const all = listScenarios();
const wanted = process.argv.slice(2);
for (const w of wanted) if (!all.includes(w)) fatal(`the suite has no client scenario ${w}`);
const scenarios = wanted.length ? wanted : all;

// entries naming a scenario the suite does not have are stale too
for (const name of expected.keys()) {
  if (!all.includes(name)) notOk(`${name}: listed in ${path.basename(expectedFile)} but the suite has no such scenario`);
}

sql(`DROP DATABASE IF EXISTS ${database} WITH (FORCE)`);
sql(`CREATE DATABASE ${database}`);
sql('CREATE EXTENSION tuvl', database);

const base = process.env.MCP_CONFORMANCE_RESULTS ||
  (process.env.TUVL_TMP ? path.join(process.env.TUVL_TMP, 'mcp-conformance')
    : fs.mkdtempSync(path.join(os.tmpdir(), 'tuvl-mcp-conformance.')));
const version = JSON.parse(fs.readFileSync(path.join(here, 'node_modules', '@modelcontextprotocol',
  'conformance', 'package.json'), 'utf8')).version;
console.error(`== MCP conformance ${version}: ${scenarios.length} client scenarios, results in ${base}`);

let passed = 0;
let expectedFailures = 0;
scenarios.forEach((name, i) => {
  const res = runScenario(name, path.join(base, String(i + 1)));
  const took = `${res.seconds.toFixed(1)} s`;
  const reason = expected.get(name);
  if (res.pass && reason === undefined) {
    passed++;
    ok(`${name} (${took})`);
  } else if (res.pass) {
    notOk(`${name} passes but ${path.basename(expectedFile)} lists it as failing; remove the entry (${took})`);
  } else if (reason !== undefined) {
    expectedFailures++;
    ok(`${name} # expected failure: ${reason} (${took}; seen: ${res.reason})`);
  } else {
    notOk(`${name} fails: ${res.reason} (${took}; results in ${path.join(base, String(i + 1))})`);
  }
});
console.error(`== MCP conformance ${version}: ${scenarios.length} scenarios, ${passed} passed, ` +
  `${expectedFailures} expected failures, ${bad} not ok`);
process.exit(bad ? 1 : 0);
