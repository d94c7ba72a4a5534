#!/usr/bin/env node
// A load generator for tuvl's benchmarks: a scripted model server (OpenAI
// Chat Completions) and a slow HTTP endpoint in one event-driven Node.js
// process, 127.0.0.1 only.  Node's standard library only (Node 18 or newer).
//
// The project's test peers (test/servers/llm_server.py, http_server.py) are
// Python servers with a thread per connection: they answer about 1,500
// requests/s and cannot hold 10,000 connections.  This one speaks HTTP/1.1
// itself on net sockets (see "HTTP/1.1" below), holds 10,000 keep-alive
// connections whose answers wait 1 s in one queue per delay, and reports
// its own CPU time and event-loop delay (GET /_stats), so that a benchmark
// can show the server was not its bottleneck.  docs/benchmarks.md, "The
// load generator", gives its capacity.
//
//   node bench/servers/loadgen.mjs [--port N] [--host 127.0.0.1] [--scripts FILE]
//                                  [--latency-ms N] [--log-max N] [--backlog N]
//
// --port 0 (the default) picks a free port; the one line on stderr names the
// port bound ("load generator on 127.0.0.1:PORT").
//
// Model endpoints (POST; the same answers as llm_server.py's OpenAI format):
//
//   /v1/chat/completions, /chat/completions
//   /lat/<ms>/v1/chat/completions     the same, answered <ms> milliseconds
//                                     later (a timer: nothing blocks), for a
//                                     base_url such as
//                                     http://127.0.0.1:PORT/lat/1000/v1
//   ...?latency_ms=N                  the same, as a query parameter
//
//   The request's `model` names a script ("s1" or "scripted/s1"); a model
//   that names no script plays the built-in "echo" (one turn: "Summary: "
//   and the first 120 characters of the last user message or tool result).
//   The turn that answers is the number of assistant messages in the
//   request's messages; past the last turn the last turn repeats.  A body
//   that is not JSON, or has no model or no non-empty messages array, or
//   asks for stream, gets 400 invalid_request_error.  Nothing else is
//   checked (llm_server.py checks requests as the real services do).
//
// Scripts: a turn is an object with these keys (all optional), as in
// llm_server.py:
//
//   text          the answer's text; "{{last_user}}" becomes the text of the
//                 last user message (or tool result), "{{turn}}" the turn
//   tool_calls    [{"name": "note", "arguments": {...}}, ...]; ids are
//                 call_<turn>_<i>; the arguments string is what Python's
//                 json.dumps writes; "arguments_raw": "..." is sent verbatim.
//                 Templates work inside string arguments too
//   finish        "length": finish_reason "length" instead of "stop"
//   finish_reason any string, sent as the finish_reason as it is
//   usage         {"prompt_tokens": n, "completion_tokens": m}; default:
//                 about one token per four characters of the request body
//                 and of the answer
//   latency_ms    the delay of this turn (default: the /lat/<ms> prefix, then
//                 ?latency_ms=, then --latency-ms, 0)
//   no_ids        true: the tool calls come without ids
//   cached_tokens, reasoning_tokens
//                 n: reported in prompt_tokens_details / completion_tokens_details
//   fault         an HTTP error status ("429", "500", 503, ...), "529"
//                 (OpenAI: 503), "quota" (429 insufficient_quota),
//                 "bad_request" (400), "malformed" (200 with a body that is
//                 not JSON) or "empty" (200 with no choices); permanent
//   retry_after   seconds, sent as Retry-After with an error fault
//   message       the error message of an error fault
//   comment       ignored
//
//   llm_server.py's "times", "thinking" and the faults "hang" and
//   "truncated" are not supported here (POST /_script answers 400).
//
// HTTP effects:
//
//   GET|POST|... /slow?ms=N           {"slept_ms": N} after N ms (default
//                                     1000, as http_server.py; 0: at once).
//                                     The body, if any, is read and dropped.
//                                     Its Idempotency-Key header is counted
//                                     (GET /_log)
//
// Control endpoints:
//
//   POST   /_script          {"name": "s1", "turns": [...]}: register (or
//                            replace) a script
//   GET    /_script          {"scripts": {name: number of turns}}
//   GET    /_script/<name>   {"name": ..., "turns": [...]}
//   DELETE /_script/<name>   remove a script (404 if there is none)
//   GET    /_log[?model=s1][&keys=1]
//                            what the benchmarks check, since DELETE /_log:
//                            {"peak": n, "peak_concurrent": n (the same: the
//                            names http_server.py and llm_server.py use),
//                            "in_flight": n, "count": requests answered (or
//                            given up by their client), "by_kind",
//                            "by_status", "disconnected",
//                            "scripts": {name: {count, by_status, by_turn}},
//                            "idempotency_keys": {distinct, requests,
//                            repeated (keys served more than once),
//                            max_per_key}, "no_key": requests without an
//                            Idempotency-Key}.  ?model=s1 adds "script": the
//                            counts of that script alone; ?keys=1 adds
//                            "key_counts": {key: times served}.  With
//                            --log-max N > 0 it also has "requests": the
//                            newest N requests {t, method, path, kind,
//                            model, script, turn, status, key, delay_ms}
//                            (only those of the script with ?model=)
//   DELETE /_log             clear all that; the peak restarts from the
//                            requests in flight now
//   GET    /_stats           the server's own load since DELETE /_stats: CPU
//                            time (process.cpuUsage()), requests by kind and
//                            status, requests in flight and their peak, open
//                            connections and their peak, event-loop delay
//                            and utilization, how late the answers left,
//                            garbage collections, memory, limits (see
//                            statsJson() below)
//   DELETE /_stats           reset those counters and peaks
//   GET    /_health          {"ok": true}
//
// Bookkeeping per request is O(1): counters, a histogram and, for /_log,
// one map entry per distinct Idempotency-Key (cleared by DELETE /_log).  No
// request is kept once answered unless --log-max is given.
//
// Requests in flight count from when a request has been read whole until
// its answer is written (or its client has gone); control requests (/_...)
// do not count.
//
// Scripts load at startup with --scripts FILE, a JSON object mapping each
// name to its turns (a list, or an object with a "turns" list).

import fs from "node:fs";
import net from "node:net";
import { PerformanceObserver, constants as perfConstants, createHistogram, monitorEventLoopDelay,
         performance } from "node:perf_hooks";
import crypto from "node:crypto";

const TURN_KEYS = new Set(["text", "tool_calls", "finish", "finish_reason", "usage", "latency_ms",
  "no_ids", "cached_tokens", "reasoning_tokens", "fault", "retry_after", "message", "comment"]);
const UNSUPPORTED_KEYS = new Set(["times", "thinking"]);
const CALL_KEYS = new Set(["name", "arguments", "arguments_raw"]);
const NAMED_FAULTS = new Set(["429", "500", "529", "408", "quota", "bad_request", "malformed", "empty"]);
const ECHO_CHARS = 120;
const ECHO_TURNS = [{ text: "Summary: {{last_user}}" }]; // for GET /_script only
const MAX_BODY = 64 << 20;          // a request body larger than this gets 413
const ANSWER_CACHE_MAX = 64;        // rendered choices kept per turn (by turn number)
const SLOW_DEFAULT_MS = 1000;       // /slow without ?ms=, as http_server.py

// Error statuses: [OpenAI type, code, message], as llm_server.py sends them.
const STATUS_ERRORS = {
  400: ["invalid_request_error", null, "Bad request."],
  401: ["invalid_request_error", "invalid_api_key", "Incorrect API key provided."],
  403: ["permission_error", null, "Your API key does not have permission to use the specified resource."],
  404: ["invalid_request_error", "model_not_found", "The requested resource was not found."],
  408: ["timeout", null, "Request timed out."],
  413: ["invalid_request_error", null, "Request exceeds the maximum size."],
  429: ["requests", "rate_limit_exceeded", "Rate limit reached for requests. Please try again later."],
  500: ["server_error", null, "The server had an error while processing your request."],
  503: ["server_error", null, "The engine is currently overloaded, please try again later."],
};

// ---------------------------------------------------------------- options

function parseOptions(argv) {
  const o = { port: 0, host: "127.0.0.1", scripts: null, latencyMs: 0, logMax: 0,
              backlog: 16384 };
  const numeric = { "--port": "port", "--latency-ms": "latencyMs", "--log-max": "logMax",
                    "--backlog": "backlog" };
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i], v;
    const eq = a.indexOf("=");
    if (a.startsWith("--") && eq > 0) { v = a.slice(eq + 1); a = a.slice(0, eq); }
    const value = () => {
      if (v !== undefined) return v;
      if (i + 1 >= argv.length) usage(`${a} needs a value`);
      return argv[++i];
    };
    if (a === "-h" || a === "--help") usage(null);
    else if (a in numeric) {
      const n = Number(value());
      if (!Number.isFinite(n) || n < 0) usage(`${a} must be a non-negative number`);
      o[numeric[a]] = n;
    } else if (a === "--host") o.host = value();
    else if (a === "--scripts") o.scripts = value();
    else usage(`unknown argument ${a}`);
  }
  return o;
}

function usage(error) {
  const text = "usage: node loadgen.mjs [--port N] [--host 127.0.0.1] [--scripts FILE] [--latency-ms N]\n" +
               "                        [--log-max N] [--backlog N]\n";
  if (error) { process.stderr.write(`loadgen: ${error}\n${text}`); process.exit(2); }
  process.stdout.write(text);
  process.exit(0);
}

// ---------------------------------------------------------------- scripts

class ScriptError extends Error {}

const isNumber = (v) => typeof v === "number" && Number.isFinite(v) && v >= 0;
const isCount = (v) => Number.isInteger(v) && v >= 0;
const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

// Validate a script's turns (as llm_server.py's check_turns does, for the
// keys supported here) and compile them; raises ScriptError.
function compileTurns(turns) {
  if (isObject(turns) && "turns" in turns) turns = turns.turns;
  if (!Array.isArray(turns) || turns.length === 0) throw new ScriptError("turns must be a non-empty array");
  return turns.map((turn, i) => {
    const where = `turn ${i}`;
    if (!isObject(turn)) throw new ScriptError(`${where}: a turn is an object`);
    const keys = Object.keys(turn);
    const unsupported = keys.filter((k) => UNSUPPORTED_KEYS.has(k));
    if (unsupported.length)
      throw new ScriptError(`${where}: ${unsupported.join(", ")} not supported by loadgen (use test/servers/llm_server.py)`);
    const unknown = keys.filter((k) => !TURN_KEYS.has(k)).sort();
    if (unknown.length)
      throw new ScriptError(`${where}: unknown keys ${JSON.stringify(unknown)} (known: ${JSON.stringify([...TURN_KEYS].sort())})`);
    for (const k of ["text", "message", "comment", "finish_reason"])
      if (k in turn && typeof turn[k] !== "string") throw new ScriptError(`${where}: ${k} must be a string`);
    if ("finish" in turn && turn.finish !== "stop" && turn.finish !== "length")
      throw new ScriptError(`${where}: finish must be "stop" or "length"`);
    for (const k of ["latency_ms", "retry_after"])
      if (k in turn && !isNumber(turn[k])) throw new ScriptError(`${where}: ${k} must be a non-negative number`);
    for (const k of ["cached_tokens", "reasoning_tokens"])
      if (k in turn && !isCount(turn[k])) throw new ScriptError(`${where}: ${k} must be a non-negative integer`);
    let fault;
    if ("fault" in turn) {
      fault = Number.isInteger(turn.fault) ? String(turn.fault) : turn.fault;
      if (typeof fault !== "string" || !(NAMED_FAULTS.has(fault) || /^[45][0-9][0-9]$/.test(fault)))
        throw new ScriptError(`${where}: fault must be an HTTP error status or one of ${JSON.stringify([...NAMED_FAULTS].sort())}` +
                              " (hang and truncated: use test/servers/llm_server.py)");
    }
    if ("usage" in turn) {
      const u = turn.usage;
      if (!isObject(u) || !Object.entries(u).every(([k, v]) =>
          ["prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"].includes(k) && isCount(v)))
        throw new ScriptError(`${where}: usage maps prompt_tokens/completion_tokens ` +
                              "(or input_tokens/output_tokens) to non-negative integers");
    }
    const calls = turn.tool_calls === undefined ? [] : turn.tool_calls;
    if (!Array.isArray(calls)) throw new ScriptError(`${where}: tool_calls must be an array`);
    calls.forEach((c, j) => {
      if (!isObject(c) || typeof c.name !== "string" || !c.name) throw new ScriptError(`${where}: tool call ${j} needs a name`);
      const bad = Object.keys(c).filter((k) => !CALL_KEYS.has(k)).sort();
      if (bad.length) throw new ScriptError(`${where}: tool call ${j}: unknown keys ${JSON.stringify(bad)}`);
      if ("arguments" in c && !isObject(c.arguments)) throw new ScriptError(`${where}: tool call ${j}: arguments must be an object`);
      if ("arguments_raw" in c && typeof c.arguments_raw !== "string")
        throw new ScriptError(`${where}: tool call ${j}: arguments_raw must be a string`);
    });
    const usage = turn.usage || {};
    const templated = JSON.stringify([turn.text, calls]);
    return {
      source: turn,
      text: turn.text,
      calls,
      fault,
      latency: turn.latency_ms,
      promptTokens: usage.prompt_tokens ?? usage.input_tokens,
      completionTokens: usage.completion_tokens ?? usage.output_tokens,
      usageMore: (turn.cached_tokens !== undefined ? `,"prompt_tokens_details":{"cached_tokens":${turn.cached_tokens}}` : "") +
                 (turn.reasoning_tokens !== undefined
                   ? `,"completion_tokens_details":{"reasoning_tokens":${turn.reasoning_tokens}}` : ""),
      // Answers that do not depend on the request's text are rendered once
      // per turn number and kept (see choiceOf).
      usesLastUser: templated.includes("{{last_user}}"),
      cache: new Map(),
    };
  });
}

function loadScripts(path) {
  const data = JSON.parse(fs.readFileSync(path, "utf8"));
  if (!isObject(data)) throw new ScriptError(`${path}: a JSON object mapping script names to turns`);
  const out = new Map();
  for (const [name, turns] of Object.entries(data)) {
    try {
      out.set(name, { turns: compileTurns(turns) });
    } catch (e) {
      throw new ScriptError(`${path}: script ${name}: ${e.message}`);
    }
  }
  return out;
}

// ---------------------------------------------------------------- answers

function textOf(content) {
  if (content == null) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    const parts = [];
    for (const b of content) {
      if (typeof b === "string") parts.push(b);
      else if (isObject(b) && typeof b.text === "string") parts.push(b.text);
    }
    return parts.join("");
  }
  return "";
}

// The last user message's text, or the last tool result's content.
function lastUserText(messages) {
  for (let i = messages.length - 1; i >= 0; i--) {
    const m = messages[i];
    if (isObject(m) && (m.role === "user" || m.role === "tool")) return textOf(m.content);
  }
  return "";
}

function assistantCount(messages) {
  let n = 0;
  for (const m of messages) if (isObject(m) && m.role === "assistant") n++;
  return n;
}

function render(value, lastUser, turn) {
  if (typeof value === "string")
    return value.split("{{last_user}}").join(lastUser).split("{{turn}}").join(String(turn));
  if (Array.isArray(value)) return value.map((v) => render(v, lastUser, turn));
  if (isObject(value)) {
    const out = {};
    for (const k of Object.keys(value)) out[k] = render(value[k], lastUser, turn);
    return out;
  }
  return value;
}

// JSON as Python's json.dumps writes it (", " and ": ", non-ASCII escaped),
// so that tool-call arguments are the same strings llm_server.py sends.
function pyJson(v) {
  if (Array.isArray(v)) return "[" + v.map(pyJson).join(", ") + "]";
  if (isObject(v)) return "{" + Object.keys(v).map((k) => ascii(JSON.stringify(k)) + ": " + pyJson(v[k])).join(", ") + "}";
  return ascii(JSON.stringify(v));
}

function ascii(json) {
  return json.replace(/[\u0080-\uffff]/g, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
}

// The rendered choice of a turn at turn number `number`: {json: the text of
// choices[0] (or "" for an empty answer), chars: the answer's length}.
function renderChoice(turn, number, lastUser) {
  const text = turn.text !== undefined ? render(turn.text, lastUser, number) : null;
  const calls = render(turn.calls, lastUser, number);
  const message = { role: "assistant", content: text !== null ? text : (calls.length ? null : "") };
  let chars = text ? text.length : 0;
  if (calls.length) {
    message.tool_calls = calls.map((c, i) => {
      const args = "arguments_raw" in c ? c.arguments_raw : pyJson(c.arguments || {});
      chars += args.length + c.name.length;
      const call = { id: `call_${number}_${i}`, type: "function", function: { name: c.name, arguments: args } };
      if (turn.source.no_ids) delete call.id;
      return call;
    });
  }
  const finish = turn.source.finish_reason ??
    (calls.length ? "tool_calls" : (turn.source.finish === "length" ? "length" : "stop"));
  const json = turn.fault === "empty" ? "" : JSON.stringify({ index: 0, message, finish_reason: finish });
  return { json, chars };
}

function choiceOf(turn, number, messages) {
  if (turn.usesLastUser) return renderChoice(turn, number, lastUserText(messages));
  let c = turn.cache.get(number);
  if (c === undefined) {
    c = renderChoice(turn, number, "");
    if (turn.cache.size < ANSWER_CACHE_MAX) turn.cache.set(number, c);
  }
  return c;
}

function echoChoice(messages) {
  const line = lastUserText(messages).trim().split(/\s+/).join(" ");
  const text = "Summary: " + (line.slice(0, ECHO_CHARS) || "(empty)");
  return { json: JSON.stringify({ index: 0, message: { role: "assistant", content: text }, finish_reason: "stop" }),
           chars: text.length };
}

const ID_PREFIX = crypto.randomBytes(4).toString("hex");
let idCounter = 0;

// A unique id (a random prefix per process, then a counter), as llm_server.py.
function newId() {
  return ID_PREFIX + (++idCounter).toString(16).padStart(16, "0");
}

function errorPayload(type, message, code = null) {
  return JSON.stringify({ error: { message, type, param: null, code } });
}

// [status, body] of an error fault, as llm_server.py's OpenAI format.
function faultError(fault, message) {
  if (fault === "quota")
    return [429, errorPayload("insufficient_quota", message ||
      "You exceeded your current quota, please check your plan and billing details.", "insufficient_quota")];
  if (fault === "bad_request")
    return [400, errorPayload("invalid_request_error", message || "Invalid request (scripted bad_request).")];
  const status = fault === "529" ? 503 : Number(fault);
  const [type, code, text] = STATUS_ERRORS[status] ||
    [status >= 500 ? "server_error" : "invalid_request_error", null, `Error ${status}.`];
  return [status, errorPayload(type, message || text, code)];
}

// Retry-After as llm_server.py writes it: "2", "0.5"
const formatSeconds = (s) => String(s);

// ---------------------------------------------------------------- state

const opts = parseOptions(process.argv.slice(2));
let scripts = new Map();
if (opts.scripts) {
  try {
    scripts = loadScripts(opts.scripts);
  } catch (e) {
    process.stderr.write(`loadgen: ${e.message}\n`);
    process.exit(2);
  }
}

let inFlight = 0;                    // model and /slow requests not answered yet
let openConnections = 0;

// GET /_log: what the benchmarks check, since DELETE /_log.
const log = {
  peak: 0, count: 0, disconnected: 0, byKind: {}, byStatus: {},
  scripts: new Map(),                // name -> {count, by_status, by_turn}
  keys: new Map(),                   // Idempotency-Key -> times served
  keyRequests: 0, repeated: 0, maxPerKey: 0, noKey: 0,
  ring: opts.logMax > 0 ? new Array(opts.logMax) : null, ringNext: 0, ringSize: 0,
};

// GET /_stats: the server's own load, since DELETE /_stats.
// It samples every ELD_RESOLUTION_MS and records the whole interval between
// two samples: the delay is that minus the resolution.
const ELD_RESOLUTION_MS = 10;
const eventLoopDelay = monitorEventLoopDelay({ resolution: ELD_RESOLUTION_MS });
eventLoopDelay.enable();
const stats = {
  since: 0, cpu: null, elu: null,
  received: 0, answered: 0, disconnected: 0, errors: 0, clientErrors: 0,
  byKind: { chat: 0, slow: 0, control: 0, other: 0 }, byStatus: {},
  peakInFlight: 0, peakConnections: 0, accepted: 0, acceptErrors: 0, listenOverflows: null,
  late: createHistogram(),           // µs between when an answer was due and when it left
  gc: { minor: 0, minorMs: 0, major: 0, majorMs: 0 },
};

// Garbage collections: 10,000 answers waiting 1 s each are 10,000 requests
// that outlive young-generation collections, a cost that grows with the
// number in flight.
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) {
    const kind = e.detail ? e.detail.kind : e.kind;
    if (kind === perfConstants.NODE_PERFORMANCE_GC_MINOR) { stats.gc.minor++; stats.gc.minorMs += e.duration; }
    else { stats.gc.major++; stats.gc.majorMs += e.duration; }
  }
}).observe({ entryTypes: ["gc"] });

function resetStats() {
  stats.since = performance.now();
  stats.cpu = process.cpuUsage();
  stats.elu = performance.eventLoopUtilization();
  stats.received = stats.answered = stats.disconnected = stats.errors = stats.clientErrors = 0;
  stats.accepted = stats.acceptErrors = 0;
  stats.byKind = { chat: 0, slow: 0, control: 0, other: 0 };
  stats.byStatus = {};
  stats.peakInFlight = inFlight;
  stats.peakConnections = openConnections;
  stats.late.reset();
  stats.listenOverflows = listenOverflows();
  stats.gc = { minor: 0, minorMs: 0, major: 0, majorMs: 0 };
  eventLoopDelay.reset();
}
resetStats();

function resetLog() {
  log.peak = inFlight;
  log.count = log.disconnected = log.keyRequests = log.repeated = log.maxPerKey = log.noKey = 0;
  log.byKind = {};
  log.byStatus = {};
  log.scripts = new Map();
  log.keys = new Map();
  if (log.ring) { log.ring = new Array(opts.logMax); log.ringNext = log.ringSize = 0; }
}

// ---------------------------------------------------------------- requests

// One request from the moment it has been read whole until it is answered
// (or its client has gone).  Model, /slow and unknown-path requests are
// "counted": in flight, in /_log and in /_stats' requests; control
// requests only keep their place in their connection's order of answers.
class Pending {
  constructor(conn, method, url, key, body, keepAlive) {
    this.conn = conn;
    this.method = method;
    this.url = url;
    this.key = key;                  // the Idempotency-Key header, or undefined
    this.body = body;                // the request body (a Buffer), then the answer (a string)
    this.keepAlive = keepAlive;
    this.kind = "control";           // "chat", "slow", "other" or "control"
    this.counted = false;
    this.t0 = performance.now();
    this.delay = 0;
    this.ready = false;              // the answer may leave (when the ones before it have)
    this.done = false;               // answered, or its client has gone
    this.status = 0;
    this.headers = "";               // extra header lines, each ending with \r\n
    this.script = null;
    this.turn = null;
    this.model = null;
    // A model answer is written out only when it leaves (see chatAnswer):
    // until then a request holds little more than this object.
    this.choice = null;              // {json, chars} of the answer's choice
    this.prompt = 0;
    this.completion = 0;
    this.usageMore = "";             // usage fields after total_tokens
  }

  count(kind) {
    this.kind = kind;
    this.counted = true;
    inFlight++;
    if (inFlight > log.peak) log.peak = inFlight;
    if (inFlight > stats.peakInFlight) stats.peakInFlight = inFlight;
    stats.received++;
  }

  // Answer `status` with the JSON text `body` (null: the model answer of
  // this.choice) after `delay` ms.
  answer(status, body, headers, delay) {
    this.status = status;
    this.body = body;
    this.headers = headers || "";
    this.delay = delay > 0 ? delay : 0;
    if (this.delay > 0) schedule(this);
    else this.send();
  }

  send() {
    this.ready = true;
    this.conn.flush();
  }

  // Written to the socket (by Conn.flush).
  sent() {
    this.done = true;
    if (!this.counted) return;
    inFlight--;
    const late = (performance.now() - this.t0 - this.delay) * 1000;
    stats.late.record(late >= 1 ? Math.round(late) : 1);
    stats.answered++;
    stats.byKind[this.kind]++;
    stats.byStatus[this.status] = (stats.byStatus[this.status] || 0) + 1;
    this.tally(this.status);
  }

  // Its client went away before the answer (a delayed one stays in its
  // queue, done, until it is due).
  gone() {
    this.done = true;
    if (!this.counted) return;
    inFlight--;
    stats.disconnected++;
    log.disconnected++;
    this.tally(null);
  }

  // The /_log counters of this request (status null: its client went away).
  tally(status) {
    log.count++;
    log.byKind[this.kind] = (log.byKind[this.kind] || 0) + 1;
    const st = status === null ? "disconnected" : String(status);
    log.byStatus[st] = (log.byStatus[st] || 0) + 1;
    if (this.script !== null) {
      let s = log.scripts.get(this.script);
      if (s === undefined) log.scripts.set(this.script, s = { count: 0, by_status: {}, by_turn: {} });
      s.count++;
      s.by_status[st] = (s.by_status[st] || 0) + 1;
      s.by_turn[this.turn] = (s.by_turn[this.turn] || 0) + 1;
    }
    const key = this.key;
    if (key === undefined) log.noKey++;
    else if (status !== null) {
      const n = (log.keys.get(key) || 0) + 1;
      log.keys.set(key, n);
      log.keyRequests++;
      if (n === 2) log.repeated++;
      if (n > log.maxPerKey) log.maxPerKey = n;
    }
    if (log.ring) {
      log.ring[log.ringNext] = {
        t: Date.now() / 1000, method: this.method, path: this.url, kind: this.kind,
        model: this.model, script: this.script, turn: this.turn, status, key: key ?? null, delay_ms: this.delay,
      };
      log.ringNext = (log.ringNext + 1) % log.ring.length;
      if (log.ringSize < log.ring.length) log.ringSize++;
    }
  }
}

// Delayed answers: a first-in first-out queue per delay (answers of the
// same delay are due in the order they came) and one timer per queue,
// rather than a timer per answer.  A timer counts from the loop's idea of
// now, taken when the loop iteration began, so it may fire early: no
// answer leaves before its delay is over.
class DelayQueue {
  constructor(delay) {
    this.delay = delay;
    this.items = new Array(16);      // a ring
    this.head = 0;
    this.size = 0;
    this.timer = null;
  }

  push(p) {
    if (this.size === this.items.length) {
      const bigger = new Array(this.items.length * 2);
      for (let i = 0; i < this.size; i++) bigger[i] = this.items[(this.head + i) % this.items.length];
      this.items = bigger;
      this.head = 0;
    }
    this.items[(this.head + this.size) % this.items.length] = p;
    this.size++;
    if (this.timer === null) this.timer = setTimeout(runDelayQueue, this.delay, this);
  }
}

const delayQueues = new Map();       // delay (ms) -> DelayQueue

function schedule(p) {
  let q = delayQueues.get(p.delay);
  if (q === undefined) delayQueues.set(p.delay, q = new DelayQueue(p.delay));
  q.push(p);
}

function runDelayQueue(q) {
  q.timer = null;
  const now = performance.now();
  while (q.size > 0) {
    const p = q.items[q.head];
    const left = p.t0 + p.delay - now;
    if (left > 0 && !p.done) {
      q.timer = setTimeout(runDelayQueue, Math.ceil(left), q);
      return;
    }
    q.items[q.head] = undefined;
    q.head = (q.head + 1) % q.items.length;
    q.size--;
    if (!p.done) p.send();
  }
  delayQueues.delete(q.delay);
}

// ---------------------------------------------------------------- HTTP/1.1

// The protocol is written here on net sockets rather than with node:http:
// at 10,000 connections each waiting 1 s, node:http's request and response
// objects (streams, header maps, a timer per socket) live for the whole
// second, and collecting them cost twice the CPU per answer this does
// (docs/benchmarks.md).  What a request holds while it waits is a Pending
// (its answer is written out when it leaves).
//
// HTTP/1.0 and 1.1, keep-alive (HTTP/1.1 unless "Connection: close";
// HTTP/1.0 with "Connection: keep-alive"), pipelined requests answered in
// order, Content-Length and chunked bodies, "Expect: 100-continue".  An idle
// connection is never closed by the server.  A request it cannot read gets
// 400 (431 for a header section over 64 kB, 413 for a body over 64 MB,
// 501 for a transfer coding other than chunked) and the connection closes.

const MAX_HEAD = 64 << 10;
const METHODS = { GET: "GET", POST: "POST", PUT: "PUT", DELETE: "DELETE", PATCH: "PATCH", HEAD: "HEAD",
                  OPTIONS: "OPTIONS" };
const CRLF = Buffer.from("\r\n");
const CRLFCRLF = Buffer.from("\r\n\r\n");
const EMPTY = Buffer.alloc(0);
const REASONS = {
  100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
  404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
  413: "Payload Too Large", 422: "Unprocessable Entity", 429: "Too Many Requests",
  431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
  502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout", 529: "Overloaded",
};

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// The Date header, made once a second.
let dateMs = 0;
let dateLine = "";
function dateHeader() {
  const now = Date.now();
  if (now - dateMs >= 1000) {
    dateMs = now - (now % 1000);
    dateLine = `Date: ${new Date(dateMs).toUTCString()}\r\n`;
  }
  return dateLine;
}

class Conn {
  constructor(socket) {
    this.socket = socket;
    this.buf = null;                 // bytes read and not parsed yet
    this.parts = null;               // ... or, while a Content-Length body arrives, its pieces
    this.partsLength = 0;
    this.head = null;                // the request whose header section has been read
    this.queue = [];                 // requests not answered yet, in arrival order
    this.closing = false;            // reads no more requests (Connection: close, an error, EOF)
    this.closed = false;
  }

  onData(chunk) {
    if (this.closing) return;
    if (this.parts !== null) {
      this.parts.push(chunk);
      this.partsLength += chunk.length;
      if (this.partsLength < this.head.length) return;
      chunk = Buffer.concat(this.parts, this.partsLength);
      this.parts = null;
    } else if (this.buf !== null) chunk = Buffer.concat([this.buf, chunk]);
    this.buf = chunk;
    try {
      this.parse();
    } catch (e) {
      if (!(e instanceof HttpError)) throw e;
      this.reject(e.status, e.message);
    }
  }

  // Read every complete request in this.buf.
  parse() {
    while (!this.closing) {
      const buf = this.buf;
      let h = this.head;
      if (h === null) {
        if (buf === null) return;
        const end = buf.indexOf(CRLFCRLF);
        if (end < 0) {
          if (buf.length > MAX_HEAD) throw new HttpError(431, "the header section is too large");
          // a lone CRLF between requests (RFC 9112, 2.2), or the start of one
          if (buf.length === 2 && buf[0] === 13 && buf[1] === 10) this.buf = null;
          return;
        }
        if (end > MAX_HEAD) throw new HttpError(431, "the header section is too large");
        h = this.head = parseHead(buf.latin1Slice(0, end));
        this.buf = end + 4 < buf.length ? buf.subarray(end + 4) : null;
        // (not between the answers of pipelined requests before it)
        if (h.expectContinue && h.length !== 0 && this.buf === null && this.queue.length === 0)
          this.socket.write("HTTP/1.1 100 Continue\r\n\r\n");
      }
      let body = EMPTY;
      if (h.chunked) {
        if (this.buf === null) return;
        const got = dechunk(this.buf);
        if (got === null) {
          if (this.buf.length > MAX_BODY) throw new HttpError(413, "the body is too large");
          return;
        }
        body = got.body;
        this.buf = got.next < this.buf.length ? this.buf.subarray(got.next) : null;
      } else if (h.length > 0) {
        const have = this.buf === null ? 0 : this.buf.length;
        if (have < h.length) {
          // collect the pieces; concatenate once, when they are all here
          this.parts = have ? [this.buf] : [];
          this.partsLength = have;
          this.buf = null;
          return;
        }
        body = this.buf.subarray(0, h.length);
        this.buf = h.length < have ? this.buf.subarray(h.length) : null;
      }
      this.head = null;
      if (!h.keepAlive) this.closing = true;
      const p = new Pending(this, h.method, h.url, h.key, body, h.keepAlive);
      this.queue.push(p);
      dispatch(p);
    }
  }

  // Write the answers that are ready, in order.
  flush() {
    const q = this.queue;
    while (q.length > 0 && q[0].ready) {
      const p = q.shift();
      if (this.closed || !this.socket.writable) { p.gone(); continue; }
      let headers = p.headers;
      if (p.kind === "chat") headers += `x-request-id: req_${newId()}\r\n`;
      if (p.body === null) p.body = chatAnswer(p);
      let head = `HTTP/1.1 ${p.status} ${REASONS[p.status] || "Unknown"}\r\n` +
                 `Content-Type: application/json\r\nContent-Length: ${Buffer.byteLength(p.body)}\r\n` +
                 headers + dateHeader();
      if (!p.keepAlive) head += "Connection: close\r\n";
      this.socket.write(p.method === "HEAD" ? head + "\r\n" : head + "\r\n" + p.body);
      p.body = p.choice = null;
      p.sent();
      if (!p.keepAlive) return this.socket.end();
    }
    if (q.length === 0 && this.closing && !this.closed) this.socket.end();
  }

  // A request that cannot be read: answer `status` and close.
  reject(status, message) {
    stats.clientErrors++;
    this.closing = true;
    this.buf = this.parts = this.head = null;
    const p = new Pending(this, "GET", "", undefined, EMPTY, false);
    this.queue.push(p);
    p.answer(status, JSON.stringify({ error: { message, type: "invalid_request_error", param: null, code: null } }),
             "", 0);
  }

  // The client sends nothing more: it has gone, as node:http and
  // llm_server.py take it (no HTTP client half-closes and waits for an
  // answer).  Node ends the socket.
  onEnd() {
    this.closing = true;
    this.buf = this.parts = this.head = null;
    this.abandon();
  }

  onClose() {
    this.closed = true;
    openConnections--;
    this.abandon();
  }

  abandon() {
    const q = this.queue;
    this.queue = [];
    for (const p of q) if (!p.done) p.gone();
  }
}

// {method, url, keepAlive, length, chunked, expectContinue, key} of a header
// section (latin1 text without the final CRLFCRLF); throws HttpError.
function parseHead(text) {
  const lines = text.split("\r\n");
  let i = 0;
  while (i < lines.length && lines[i] === "") i++;       // CRLFs before a request
  const line = lines[i] || "";
  const sp1 = line.indexOf(" "), sp2 = line.lastIndexOf(" ");
  if (sp1 <= 0 || sp2 === sp1) throw new HttpError(400, `bad request line ${JSON.stringify(line.slice(0, 200))}`);
  // (method and key are not slices of `text`: a waiting request would hold it)
  const method = METHODS[line.slice(0, sp1)] || Buffer.from(line.slice(0, sp1), "latin1").latin1Slice();
  const version = line.slice(sp2 + 1);
  let url = line.slice(sp1 + 1, sp2);
  if (version !== "HTTP/1.1" && version !== "HTTP/1.0")
    throw new HttpError(400, `bad request line ${JSON.stringify(line.slice(0, 200))}`);
  if (url.startsWith("http://") || url.startsWith("https://")) {   // absolute form
    const slash = url.indexOf("/", url.indexOf("//") + 2);
    url = slash < 0 ? "/" : url.slice(slash);
  }
  let length = 0, chunked = false, expectContinue = false, key, connection = "";
  for (i++; i < lines.length; i++) {
    const l = lines[i];
    const colon = l.indexOf(":");
    if (colon <= 0) throw new HttpError(400, "bad header line");
    // only the headers of interest are looked at (by their length first)
    switch (colon) {
      case 14:
        if (l.slice(0, 14).toLowerCase() === "content-length") {
          const v = l.slice(15).trim();
          if (!/^[0-9]+$/.test(v)) throw new HttpError(400, "bad Content-Length");
          length = Number(v);
          if (length > MAX_BODY) throw new HttpError(413, "the body is too large");
        }
        break;
      case 17:
        if (l.slice(0, 17).toLowerCase() === "transfer-encoding") {
          const v = l.slice(18).trim().toLowerCase();
          if (v !== "chunked") throw new HttpError(501, `transfer coding ${JSON.stringify(v)} not supported`);
          chunked = true;
        }
        break;
      case 10:
        if (l.slice(0, 10).toLowerCase() === "connection") connection = l.slice(11).trim().toLowerCase();
        break;
      case 6:
        if (l.slice(0, 6).toLowerCase() === "expect") expectContinue = l.slice(7).trim().toLowerCase() === "100-continue";
        break;
      case 15:
        if (l.slice(0, 15).toLowerCase() === "idempotency-key")
          key = Buffer.from(l.slice(16).trim(), "latin1").latin1Slice();
        break;
      default:
    }
  }
  const keepAlive = version === "HTTP/1.1" ? !connection.includes("close") : connection.includes("keep-alive");
  return { method, url, keepAlive, length: chunked ? -1 : length, chunked, expectContinue, key };
}

// A chunked body at the start of buf: {body, next (the offset after it)},
// or null while incomplete; throws HttpError when malformed.
function dechunk(buf) {
  const parts = [];
  let pos = 0, size = 0;
  for (;;) {
    const eol = buf.indexOf(CRLF, pos);
    if (eol < 0) return null;
    const line = buf.latin1Slice(pos, eol);
    const n = parseInt(line.split(";")[0].trim(), 16);
    if (!(n >= 0) || !/^[0-9a-fA-F]+$/.test(line.split(";")[0].trim())) throw new HttpError(400, "bad chunk size");
    pos = eol + 2;
    if (n === 0) {
      // trailer fields, then an empty line
      for (;;) {
        const e = buf.indexOf(CRLF, pos);
        if (e < 0) return null;
        const empty = e === pos;
        pos = e + 2;
        if (empty) return { body: parts.length === 1 ? parts[0] : Buffer.concat(parts, size), next: pos };
      }
    }
    if (buf.length < pos + n + 2) return null;
    if (buf[pos + n] !== 13 || buf[pos + n + 1] !== 10) throw new HttpError(400, "bad chunk");
    parts.push(buf.subarray(pos, pos + n));
    size += n;
    if (size > MAX_BODY) throw new HttpError(413, "the body is too large");
    pos += n + 2;
  }
}

// ---------------------------------------------------------------- routing

function dispatch(p) {
  try {
    route(p);
  } catch (e) {
    // A bug here must not stop a benchmark: answer 500, say it (a few times).
    stats.errors++;
    if (stats.errors <= 10) process.stderr.write(`loadgen: ${p.method} ${p.url}: ${e.stack || e}\n`);
    if (!p.ready && p.status === 0) p.answer(500, errorPayload("server_error", String(e.message || e)), "", 0);
  }
}

function route(p) {
  const url = p.url;
  if (log.ring === null) p.url = null;   // only the log of requests needs it later
  const q = url.indexOf("?");
  let path = q < 0 ? url : url.slice(0, q);
  const query = q < 0 ? null : new URLSearchParams(url.slice(q + 1));
  if (path.startsWith("/_")) return control(p, path, query);
  if (path === "/slow") {
    p.count("slow");
    const ms = query && query.has("ms") ? Number(query.get("ms")) : SLOW_DEFAULT_MS;
    if (!isNumber(ms)) return p.answer(400, JSON.stringify({ error: "ms must be a non-negative number" }), "", 0);
    return p.answer(200, `{"slept_ms":${ms}}`, "", ms);
  }
  let latency;
  if (path.startsWith("/lat/")) {
    const slash = path.indexOf("/", 5);
    const ms = Number(slash < 0 ? NaN : path.slice(5, slash));
    if (isNumber(ms)) { latency = ms; path = path.slice(slash); }
  }
  if (query && query.has("latency_ms")) {
    const ms = Number(query.get("latency_ms"));
    if (isNumber(ms)) latency = ms;
  }
  if (path.length > 1 && path.endsWith("/")) path = path.slice(0, -1);
  if (path === "/v1/chat/completions" || path === "/chat/completions") {
    p.count("chat");
    if (p.method !== "POST")
      return p.answer(405, errorPayload("invalid_request_error", `${p.method} is not allowed; use POST`), "", 0);
    return chat(p, latency);
  }
  p.count("other");
  const other = /^\/(v1\/)?(messages|responses)$/.test(path)
    ? "loadgen speaks only OpenAI Chat Completions (the other formats: test/servers/llm_server.py)"
    : `no endpoint ${url}`;
  return p.answer(404, errorPayload("invalid_request_error", other, "unknown_url"), "", 0);
}

function chat(p, latency) {
  const raw = p.body;
  let body;
  try {
    body = JSON.parse(raw.toString("utf8"));
  } catch {
    return p.answer(400, errorPayload("invalid_request_error", "We could not parse the JSON body of your request."), "", 0);
  }
  const bad = (m) => p.answer(400, errorPayload("invalid_request_error", m), "", 0);
  if (!isObject(body)) return bad("the request body must be a JSON object");
  if (typeof body.model !== "string" || !body.model) return bad("model: field required");
  const messages = body.messages;
  if (!Array.isArray(messages) || messages.length === 0) return bad("messages: a non-empty array is required");
  if (body.stream) return bad("stream: the load generator does not stream; send stream false");

  const model = body.model;
  let name = model.startsWith("scripted/") ? model.slice(9) : model;
  const script = scripts.get(name);
  const number = assistantCount(messages);
  let turn = null, choice;
  if (script === undefined) {
    name = "echo";
    choice = echoChoice(messages);
  } else {
    turn = script.turns[Math.min(number, script.turns.length - 1)];
  }
  p.script = name;
  p.turn = number;
  p.model = model;

  const delay = turn && turn.latency !== undefined ? turn.latency : (latency !== undefined ? latency : opts.latencyMs);
  const fault = turn ? turn.fault : undefined;
  if (fault !== undefined && fault !== "malformed" && fault !== "empty") {
    const [status, payload] = faultError(fault, turn.source.message);
    const headers = "retry_after" in turn.source ? `Retry-After: ${formatSeconds(turn.source.retry_after)}\r\n` : "";
    return p.answer(status, payload, headers, delay);
  }
  if (fault === "malformed")
    return p.answer(200, '{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": [{', "", delay);
  if (turn) choice = choiceOf(turn, number, messages);

  // What the answer needs, kept until it leaves: the request (its body,
  // parsed) is garbage before the answer's delay, not after.
  p.choice = choice;
  p.prompt = turn && turn.promptTokens !== undefined ? turn.promptTokens : Math.max(1, raw.length >> 2);
  p.completion = turn && turn.completionTokens !== undefined ? turn.completionTokens : Math.max(1, choice.chars >> 2);
  if (turn) p.usageMore = turn.usageMore;
  return p.answer(200, null, "", delay);
}

// The text of a model answer, made when it leaves.
function chatAnswer(p) {
  return `{"id":"chatcmpl-${newId()}","object":"chat.completion","created":${Math.floor(Date.now() / 1000)},` +
         `"model":${JSON.stringify(p.model)},"choices":[${p.choice.json}],"usage":{"prompt_tokens":${p.prompt},` +
         `"completion_tokens":${p.completion},"total_tokens":${p.prompt + p.completion}${p.usageMore}}}`;
}

// ---------------------------------------------------------------- control endpoints

function reply(p, status, payload) {
  p.answer(status, typeof payload === "string" ? payload : JSON.stringify(payload), "", 0);
}

function control(p, path, query) {
  stats.byKind.control++;
  const m = p.method;
  if (path === "/_health") return reply(p, 200, { ok: true });
  if (path === "/_stats") {
    if (m === "DELETE") { resetStats(); return reply(p, 200, { ok: true }); }
    if (m === "GET") return reply(p, 200, statsJson());
  }
  if (path === "/_log") {
    if (m === "DELETE") { resetLog(); return reply(p, 200, { ok: true }); }
    if (m === "GET") return reply(p, 200, logJson(query));
  }
  if (path === "/_script" && m === "POST") {
    let body, turns;
    try {
      body = JSON.parse(p.body.toString("utf8") || "null");
      if (!isObject(body) || typeof body.name !== "string" || !body.name)
        throw new ScriptError('the body is {"name": ..., "turns": [...]}');
      turns = compileTurns(body.turns);
    } catch (e) {
      return reply(p, 400, { ok: false, error: e.message });
    }
    scripts.set(body.name, { turns });
    return reply(p, 200, { ok: true, name: body.name, turns: turns.length });
  }
  if (path === "/_script" && m === "GET") {
    const names = {};
    for (const [n, s] of scripts) names[n] = s.turns.length;
    if (!("echo" in names)) names.echo = ECHO_TURNS.length;
    return reply(p, 200, { scripts: names });
  }
  if (path.startsWith("/_script/")) {
    let name;
    try {
      name = decodeURIComponent(path.slice(9));
    } catch {
      name = path.slice(9);
    }
    const s = scripts.get(name);
    if (m === "DELETE") {
      if (!s) return reply(p, 404, { ok: false, error: `no script ${name}` });
      scripts.delete(name);
      return reply(p, 200, { ok: true });
    }
    if (m === "GET") {
      if (!s && name !== "echo") return reply(p, 404, { ok: false, error: `no script ${name}` });
      return reply(p, 200, { name, turns: s ? s.turns.map((t) => t.source) : ECHO_TURNS });
    }
  }
  return reply(p, 404, { ok: false, error: `no control endpoint ${m} ${path}` });
}

function logJson(query) {
  const scriptsOut = {};
  for (const [n, s] of log.scripts) scriptsOut[n] = s;
  const out = {
    peak: log.peak, peak_concurrent: log.peak, in_flight: inFlight,
    count: log.count, by_kind: log.byKind, by_status: log.byStatus, disconnected: log.disconnected,
    scripts: scriptsOut,
    idempotency_keys: { distinct: log.keys.size, requests: log.keyRequests, repeated: log.repeated,
                        max_per_key: log.maxPerKey },
    no_key: log.noKey,
  };
  let model = query && query.get("model");
  if (model) {
    if (model.startsWith("scripted/")) model = model.slice(9);
    out.script = log.scripts.get(model) || { count: 0, by_status: {}, by_turn: {} };
  }
  if (query && query.get("keys") === "1") out.key_counts = Object.fromEntries(log.keys);
  if (log.ring) {
    const n = log.ring.length, rows = [];
    for (let i = 0; i < log.ringSize; i++) {
      const e = log.ring[(log.ringNext - log.ringSize + i + n) % n];
      if (!model || e.script === model || e.model === model) rows.push(e);
    }
    out.requests = rows;
  }
  return out;
}

// {count, p50, p90, p99, max, mean} in ms of a histogram of values in
// `unitNs` nanoseconds, less `offsetMs` (at least 0)
function histogramMs(h, unitNs, offsetMs = 0) {
  if (h.count === 0) return { count: 0, p50: 0, p90: 0, p99: 0, max: 0, mean: 0 };
  const ms = (v) => Math.max(0, Math.round(v * unitNs / 1e3 - offsetMs * 1e3) / 1e3);
  return { count: h.count, p50: ms(h.percentile(50)), p90: ms(h.percentile(90)),
           p99: ms(h.percentile(99)), max: ms(h.max), mean: ms(h.mean) };
}

function readLimits() {
  const out = { nofile_soft: null, nofile_hard: null, somaxconn: null, backlog_asked: opts.backlog };
  try {
    const line = fs.readFileSync("/proc/self/limits", "utf8").split("\n").find((l) => l.startsWith("Max open files"));
    const [soft, hard] = line.slice(25).trim().split(/\s+/);
    out.nofile_soft = Number(soft) || soft;
    out.nofile_hard = Number(hard) || hard;
  } catch { /* not Linux */ }
  try {
    out.somaxconn = Number(fs.readFileSync("/proc/sys/net/core/somaxconn", "utf8"));
  } catch { /* not Linux */ }
  return out;
}
const LIMITS = readLimits();

// The machine's TcpExt ListenOverflows counter (all listening sockets, not
// only this one's): connections the kernel dropped at a full accept queue
// (at most somaxconn); their clients retry the SYN after 1 s, then 3 s, ...
function listenOverflows() {
  try {
    const lines = fs.readFileSync("/proc/net/netstat", "utf8").split("\n");
    for (let i = 0; i + 1 < lines.length; i += 2) {
      if (!lines[i].startsWith("TcpExt:")) continue;
      const names = lines[i].split(" "), values = lines[i + 1].split(" ");
      const at = names.indexOf("ListenOverflows");
      return at > 0 ? Number(values[at]) : null;
    }
  } catch { /* not Linux */ }
  return null;
}

// The server's own load since DELETE /_stats (or since it started).
function statsJson() {
  const wall = (performance.now() - stats.since) / 1000;
  const total = process.cpuUsage();
  const since = process.cpuUsage(stats.cpu);
  const cpuSince = (since.user + since.system) / 1e6;
  const elu = performance.eventLoopUtilization(stats.elu);
  const mem = process.memoryUsage();
  return {
    pid: process.pid, node: process.version, uptime_s: process.uptime(), since_reset_s: wall,
    // CPU seconds of the whole process (all its threads), since it started
    cpu: { user_s: total.user / 1e6, system_s: total.system / 1e6, total_s: (total.user + total.system) / 1e6 },
    // ... and since the reset; `cpus` is the average number of CPUs busy
    cpu_since_reset: {
      user_s: since.user / 1e6, system_s: since.system / 1e6, total_s: cpuSince,
      cpus: wall > 0 ? cpuSince / wall : 0,
      us_per_request: stats.answered > 0 ? (cpuSince * 1e6) / stats.answered : null,
    },
    // errors: the server's own (answered 500); client_errors: requests it
    // could not read, and connections reset
    requests: { received: stats.received, answered: stats.answered, disconnected: stats.disconnected,
                by_kind: stats.byKind, by_status: stats.byStatus, errors: stats.errors,
                client_errors: stats.clientErrors,
                per_s: wall > 0 ? stats.answered / wall : 0 },
    in_flight: inFlight, peak_in_flight: stats.peakInFlight,
    connections: { open: openConnections, peak: stats.peakConnections, accepted: stats.accepted,
                   accept_errors: stats.acceptErrors },
    // delay: how late the event loop ran a timer due every 10 ms;
    // utilization: the share of the time the loop was busy (1: saturated)
    event_loop: { delay_ms: histogramMs(eventLoopDelay, 1, ELD_RESOLUTION_MS), utilization: elu.utilization },
    // how long after it was due each answer left (after the request
    // arrived, for a 0 ms answer: the time to read, parse and answer it)
    late_ms: histogramMs(stats.late, 1000),
    // garbage collections: minor (young generation) and the others, with
    // their wall time (their CPU time is part of cpu_since_reset)
    gc: { minor: stats.gc.minor, minor_ms: Math.round(stats.gc.minorMs), major: stats.gc.major,
          major_ms: Math.round(stats.gc.majorMs) },
    memory: { rss_mb: mem.rss / 1048576, heap_used_mb: mem.heapUsed / 1048576 },
    limits: LIMITS,
    // dropped connection attempts, machine-wide, since the reset (null: unknown)
    listen_overflows: stats.listenOverflows === null ? null : listenOverflows() - stats.listenOverflows,
  };
}

// ---------------------------------------------------------------- server

const server = net.createServer({ noDelay: true }, (socket) => {
  socket.setNoDelay(true);           // also for Node versions without the option
  openConnections++;
  stats.accepted++;
  if (openConnections > stats.peakConnections) stats.peakConnections = openConnections;
  const conn = new Conn(socket);
  socket.on("data", (chunk) => conn.onData(chunk));
  socket.on("end", () => conn.onEnd());
  socket.on("close", () => conn.onClose());
  socket.on("error", () => { stats.clientErrors++; });   // a reset: "close" follows
});
// server.maxConnections stays unset: unlimited.

let listening = false;
server.on("error", (e) => {
  if (!listening) {
    process.stderr.write(`loadgen: ${e.message}\n`);
    process.exit(1);
  }
  // accept() failed (EMFILE: out of file descriptors): count it, say it once
  if (stats.acceptErrors++ === 0) process.stderr.write(`loadgen: ${e.message}\n`);
});

for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => process.exit(0));

server.listen({ port: opts.port, host: opts.host, backlog: opts.backlog }, () => {
  listening = true;
  process.stderr.write(`load generator on ${opts.host}:${server.address().port}\n`);
});
