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
//                                  [--tls-dir DIR] [--http2] [--h2-max-streams N]
//                                  [--limit-rpm N] [--limit-tpm N]
//                                  [--limit-window-ms N] [--stats-file FILE]
//
// --port 0 (the default) picks a free port; the one line on stderr names the
// port bound ("load generator on 127.0.0.1:PORT", also with TLS).
//
// --tls-dir DIR serves HTTPS: ca.pem, cert.pem and key.pem in DIR, made
// there with openssl(1) when any is missing (a CA, and a certificate it
// signs for 127.0.0.1, ::1 and localhost; see "TLS" below); a client trusts
// DIR/ca.pem.  --http2 adds HTTP/2: by ALPN over TLS ("h2", HTTP/1.1 the
// fallback) and, on a plain port, h2c with prior knowledge;
// --h2-max-streams (default 128) is SETTINGS_MAX_CONCURRENT_STREAMS.
// GET /_conns counts the connections by protocol, TLS handshakes and
// resumptions, HTTP/2 sessions and streams.
//
// --limit-rpm N, --limit-tpm N enforce, for every API key (the
// Authorization bearer, x-api-key or api-key header), at most N requests /
// N tokens over a sliding window of --limit-window-ms (default 60000), as
// a model provider does: beyond them 429 rate_limit_exceeded with
// Retry-After, retry-after-ms and x-ratelimit-* (see "rate limits" below);
// 0 (the default): no limit.  POST /_limits changes them at run time.
//
// --stats-file FILE writes /_stats, /_conns and /_limits as JSON there on
// SIGTERM or SIGINT.
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
//   GET    /_conns[?list=1]  connections since DELETE /_stats: accepted,
//                            open, peak, by_protocol ("http/1.1",
//                            "http/1.1+tls", "h2+tls", "h2c"), by_address,
//                            tls {handshakes, resumed, failed}, h2
//                            {sessions, streams, peak_concurrent_streams,
//                            max_streams_per_session, goaways},
//                            requests_by_protocol; ?list=1 adds one record
//                            per connection {port, address, protocol,
//                            opened_s, closed_s, requests, streams,
//                            tls_resumed}
//   DELETE /_conns           close every connection with no request in flight
//                            (HTTP/2: GOAWAY), as a server's idle timeout
//                            would: {"ok": true, "closed": n}
//   GET    /_limits[?series=1]
//                            the rate limits and, per API key ("(none)":
//                            no key), admitted, rejected {requests, tokens,
//                            total}, tokens, window and peak_window
//                            {requests, tokens}, per_min; ?series=1 adds
//                            per_second and tokens_per_second
//   POST   /_limits          {"rpm": n, "tpm": n, "window_ms": n, "keys":
//                            {"KEY": {"rpm": n, "tpm": n} or null},
//                            "reset": true}: change the limits (400 on a
//                            bad one)
//   DELETE /_limits          forget every key's window and counters
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

import { execFileSync } from "node:child_process";
import fs from "node:fs";
import http2 from "node:http2";
import net from "node:net";
import path from "node:path";
import tls from "node:tls";
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
              backlog: 16384, tlsDir: null, http2: false, h2MaxStreams: 128, limitRpm: 0, limitTpm: 0,
              limitWindowMs: 60000, statsFile: null };
  const numeric = { "--port": "port", "--latency-ms": "latencyMs", "--log-max": "logMax",
                    "--backlog": "backlog", "--h2-max-streams": "h2MaxStreams", "--limit-rpm": "limitRpm",
                    "--limit-tpm": "limitTpm", "--limit-window-ms": "limitWindowMs" };
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
    else if (a === "--tls-dir") o.tlsDir = value();
    else if (a === "--stats-file") o.statsFile = value();
    else if (a === "--http2") o.http2 = true;
    else usage(`unknown argument ${a}`);
  }
  if (o.limitWindowMs < 1) usage("--limit-window-ms must be at least 1");
  if (o.h2MaxStreams < 1) usage("--h2-max-streams must be at least 1");
  return o;
}

function usage(error) {
  const text = "usage: node loadgen.mjs [--port N] [--host 127.0.0.1] [--scripts FILE] [--latency-ms N]\n" +
               "                        [--log-max N] [--backlog N] [--tls-dir DIR] [--http2]\n" +
               "                        [--h2-max-streams N] [--limit-rpm N] [--limit-tpm N]\n" +
               "                        [--limit-window-ms N] [--stats-file FILE]\n";
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
const resetHooks = [];               // more counters that DELETE /_stats resets
const eventLoopDelay = monitorEventLoopDelay({ resolution: ELD_RESOLUTION_MS });
eventLoopDelay.enable();
const stats = {
  since: 0, cpu: null, elu: null,
  received: 0, answered: 0, disconnected: 0, errors: 0, clientErrors: 0,
  byKind: { chat: 0, slow: 0, control: 0, other: 0 }, byStatus: {},
  peakInFlight: 0, peakConnections: 0, accepted: 0, acceptErrors: 0, listenOverflows: null,
  late: createHistogram(),           // µs between when an answer was due and when it left
  gc: { minor: 0, minorMs: 0, major: 0, majorMs: 0 },
  requestsByProtocol: {},            // counted requests by their connection's protocol
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
  // the connections' and the rate limits' counters (declared further down)
  for (const reset of resetHooks) reset();
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

// ---------------------------------------------------------------- rate limits

// Requests and tokens per API key over a sliding window (60 s unless
// --limit-window-ms), enforced as a model provider does: a model request
// that would take its key past the requests (rpm) or tokens (tpm) allowed
// in the window is answered 429 at once, with Retry-After (whole seconds,
// at least 1), retry-after-ms and the x-ratelimit-* headers, and is not
// counted.  A request's tokens are estimated when it arrives as its body's
// length / 4 (at least 1) and replaced, when its answer leaves, by the
// usage the answer reports (prompt + completion tokens).  Every key is
// counted (GET /_limits), limits or not; --limit-rpm / --limit-tpm (0: no
// limit) apply to every key, and POST /_limits changes them and sets them
// per key.
//
// The window of a key: the requests admitted in the last window_ms, a ring
// of (time, tokens, second since the reset) in admission order.
class KeyWindow {
  constructor(key) {
    this.key = key;
    this.times = new Float64Array(64);
    this.tokens = new Float64Array(64);
    this.secs = new Int32Array(64);
    this.head = 0;                   // sequence number of the oldest entry in the window
    this.next = 0;                   // sequence number of the next entry
    this.requests = 0;               // in the window
    this.tokenSum = 0;               // in the window
    this.resetCounters();
  }

  resetCounters() {
    this.admitted = 0;
    this.rejected = { requests: 0, tokens: 0 };
    this.tokensTotal = 0;            // of the admitted requests, as corrected by their answers
    this.peak = { requests: this.requests, tokens: this.tokenSum };
    this.firstS = null;
    this.lastS = null;
    this.perSecond = [];             // admitted requests per second since the reset
    this.tokensPerSecond = [];
  }

  slot(seq) { return seq & (this.times.length - 1); }

  // Drop the entries older than the window.
  prune(now, windowMs) {
    const edge = now - windowMs;
    while (this.head < this.next) {
      const i = this.slot(this.head);
      if (this.times[i] > edge) break;
      this.requests--;
      this.tokenSum -= this.tokens[i];
      this.head++;
    }
  }

  push(now, tokens, sec) {
    if (this.next - this.head === this.times.length) this.grow();
    const i = this.slot(this.next);
    this.times[i] = now;
    this.tokens[i] = tokens;
    this.secs[i] = sec;
    this.requests++;
    this.tokenSum += tokens;
    return this.next++;
  }

  grow() {
    const n = this.times.length;
    const times = new Float64Array(2 * n), tokens = new Float64Array(2 * n), secs = new Int32Array(2 * n);
    for (let q = this.head; q < this.next; q++) {
      times[q & (2 * n - 1)] = this.times[q & (n - 1)];
      tokens[q & (2 * n - 1)] = this.tokens[q & (n - 1)];
      secs[q & (2 * n - 1)] = this.secs[q & (n - 1)];
    }
    this.times = times;
    this.tokens = tokens;
    this.secs = secs;
  }

  // ms until `need` tokens have left the window (oldest first)
  tokensFreeIn(now, need, windowMs) {
    let freed = 0;
    for (let q = this.head; q < this.next; q++) {
      const i = this.slot(q);
      freed += this.tokens[i];
      if (freed >= need) return this.times[i] + windowMs - now;
    }
    return windowMs;
  }
}

const limits = {
  rpm: opts.limitRpm, tpm: opts.limitTpm, windowMs: opts.limitWindowMs,
  perKey: new Map(),                 // key -> {rpm, tpm}: overrides of the defaults
  keys: new Map(),                   // key -> KeyWindow
  since: performance.now(),

  of(key) {
    let w = this.keys.get(key);
    if (w === undefined) this.keys.set(key, w = new KeyWindow(key));
    return w;
  },

  limitsOf(key) {
    const o = this.perKey.get(key);
    return o === undefined ? { rpm: this.rpm, tpm: this.tpm } : o;
  },

  // Admit model request p (tokens: its estimate) or answer it 429: true
  // when it was answered.
  admit(p, tokens) {
    const key = p.apiKey === undefined ? "" : p.apiKey;
    const w = this.of(key);
    const now = performance.now();
    const { rpm, tpm } = this.limitsOf(key);
    w.prune(now, this.windowMs);
    let kind = null, waitMs = 0;
    if (rpm > 0 && w.requests + 1 > rpm) {
      kind = "requests";
      waitMs = w.times[w.slot(w.head)] + this.windowMs - now;
    } else if (tpm > 0 && w.tokenSum + tokens > tpm) {
      kind = "tokens";
      waitMs = tokens > tpm ? this.windowMs : w.tokensFreeIn(now, w.tokenSum + tokens - tpm, this.windowMs);
    }
    if (kind !== null) {
      const headers = rateHeaders(w, rpm, tpm, now, this.windowMs);
      w.rejected[kind]++;
      waitMs = Math.max(1, Math.ceil(waitMs));
      const used = kind === "requests" ? w.requests : Math.round(w.tokenSum);
      const limit = kind === "requests" ? rpm : tpm;
      const what = kind === "requests" ? "requests per min (RPM)" : "tokens per min (TPM)";
      const message = tokens > tpm && kind === "tokens"
        ? `Request too large for ${p.model} on ${what}: Limit ${limit}, Requested ${tokens}.`
        : `Rate limit reached for ${p.model} on ${what}: Limit ${limit}, Used ${used}, ` +
          `Requested ${kind === "requests" ? 1 : tokens}. Please try again in ${formatWait(waitMs)}.`;
      p.rateLimited = kind;
      p.answer(429, errorPayload(kind, message, "rate_limit_exceeded"),
               `Retry-After: ${Math.ceil(waitMs / 1000)}\r\nretry-after-ms: ${waitMs}\r\n` + headers, 0);
      return true;
    }
    const sec = Math.floor((now - this.since) / 1000);
    p.limit = w.push(now, tokens, sec);
    p.limitKey = w;
    p.limitHeaders = rateHeaders(w, rpm, tpm, now, this.windowMs);
    w.admitted++;
    w.tokensTotal += tokens;
    if (w.requests > w.peak.requests) w.peak.requests = w.requests;
    if (w.tokenSum > w.peak.tokens) w.peak.tokens = w.tokenSum;
    if (w.firstS === null) w.firstS = (now - this.since) / 1000;
    w.lastS = (now - this.since) / 1000;
    if (sec < 86400) {
      while (w.perSecond.length <= sec) { w.perSecond.push(0); w.tokensPerSecond.push(0); }
      w.perSecond[sec]++;
      w.tokensPerSecond[sec] += tokens;
    }
    return false;
  },

  // p's answer left: its tokens become the usage the answer reported.
  settle(p) {
    const w = p.limitKey, seq = p.limit;
    p.limit = null;
    if (p.status !== 200 || !p.hasUsage) return;
    const actual = p.prompt + p.completion;
    const i = w.slot(seq);
    const delta = actual - w.tokens[i];
    if (delta === 0) return;
    w.tokensTotal += delta;
    const sec = seq >= w.head ? w.secs[i] : null;
    if (seq >= w.head) {             // still in the window
      w.tokens[i] = actual;
      w.tokenSum += delta;
      if (w.tokenSum > w.peak.tokens) w.peak.tokens = w.tokenSum;
    }
    if (sec !== null && sec < w.tokensPerSecond.length) w.tokensPerSecond[sec] += delta;
  },

  resetCounters() {
    this.since = performance.now();
    for (const w of this.keys.values()) w.resetCounters();
  },

  json(query) {
    const now = performance.now();
    const elapsed = (now - this.since) / 1000;
    const series = query && query.get("series") === "1";
    const keys = {};
    for (const [key, w] of this.keys) {
      w.prune(now, this.windowMs);
      const { rpm, tpm } = this.limitsOf(key);
      const span = w.firstS === null ? 0 : elapsed - w.firstS;
      const k = {
        limits: { rpm, tpm },
        admitted: w.admitted, rejected: { ...w.rejected, total: w.rejected.requests + w.rejected.tokens },
        tokens: Math.round(w.tokensTotal),
        // in the window now, and the most at any admission since the reset
        window: { requests: w.requests, tokens: Math.round(w.tokenSum) },
        peak_window: { requests: w.peak.requests, tokens: Math.round(w.peak.tokens) },
        first_s: w.firstS, last_s: w.lastS,
        // per minute, from the key's first admission until now
        per_min: span > 0 ? { requests: w.admitted * 60 / span, tokens: w.tokensTotal * 60 / span } : null,
      };
      if (series) { k.per_second = w.perSecond; k.tokens_per_second = w.tokensPerSecond.map(Math.round); }
      keys[key === "" ? "(none)" : key] = k;
    }
    const perKey = {};
    for (const [key, l] of this.perKey) perKey[key] = l;
    return { window_ms: this.windowMs, rpm: this.rpm, tpm: this.tpm, per_key: perKey, since_reset_s: elapsed,
             keys };
  },

  configure(body) {
    if (!isObject(body)) throw new ScriptError("the body is a JSON object");
    const known = new Set(["rpm", "tpm", "window_ms", "keys", "reset"]);
    const bad = Object.keys(body).filter((k) => !known.has(k));
    if (bad.length) throw new ScriptError(`unknown keys ${JSON.stringify(bad)} (known: rpm, tpm, window_ms, keys, reset)`);
    const limitPair = (o, where) => {
      if (!isObject(o) || !Object.entries(o).every(([k, v]) => (k === "rpm" || k === "tpm") && isCount(v)))
        throw new ScriptError(`${where}: {"rpm": n, "tpm": n}, non-negative integers (0: no limit)`);
    };
    limitPair(Object.fromEntries(Object.entries(body).filter(([k]) => k === "rpm" || k === "tpm")), "rpm, tpm");
    if ("window_ms" in body && !(isCount(body.window_ms) && body.window_ms >= 1))
      throw new ScriptError("window_ms must be a positive integer");
    if ("keys" in body) {
      if (!isObject(body.keys)) throw new ScriptError('keys: {"KEY": {"rpm": n, "tpm": n}, ...}');
      for (const [k, v] of Object.entries(body.keys)) if (v !== null) limitPair(v, `keys.${k}`);
    }
    if ("rpm" in body) this.rpm = body.rpm;
    if ("tpm" in body) this.tpm = body.tpm;
    if ("window_ms" in body) this.windowMs = body.window_ms;
    if ("keys" in body) {
      for (const [k, v] of Object.entries(body.keys)) {
        const key = k === "(none)" ? "" : k;
        if (v === null) this.perKey.delete(key);
        else this.perKey.set(key, { rpm: v.rpm ?? 0, tpm: v.tpm ?? 0 });
      }
    }
    if (body.reset) { this.keys = new Map(); this.since = performance.now(); }
  },
};

resetHooks.push(() => limits.resetCounters());

// The x-ratelimit-* headers of a key's answer (as OpenAI sends them; none
// when the key has no limits).
function rateHeaders(w, rpm, tpm, now, windowMs) {
  let h = "";
  if (rpm > 0) {
    const reset = w.next > w.head ? w.times[w.slot(w.head)] + windowMs - now : 0;
    h += `x-ratelimit-limit-requests: ${rpm}\r\nx-ratelimit-remaining-requests: ${Math.max(0, rpm - w.requests)}\r\n` +
         `x-ratelimit-reset-requests: ${formatWait(Math.max(0, Math.ceil(reset)))}\r\n`;
  }
  if (tpm > 0) {
    h += `x-ratelimit-limit-tokens: ${tpm}\r\nx-ratelimit-remaining-tokens: ${Math.max(0, Math.round(tpm - w.tokenSum))}\r\n`;
  }
  return h;
}

// "1.5s", "120ms", as OpenAI writes a wait
function formatWait(ms) {
  return ms >= 1000 ? `${Number((ms / 1000).toFixed(3))}s` : `${ms}ms`;
}

// ---------------------------------------------------------------- requests

// One request from the moment it has been read whole until it is answered
// (or its client has gone).  Model, /slow and unknown-path requests are
// "counted": in flight, in /_log and in /_stats' requests; control
// requests only keep their place in their connection's order of answers.
class Pending {
  constructor(conn, method, url, key, body, keepAlive, apiKey) {
    this.conn = conn;
    this.apiKey = apiKey;            // the API key the request carried (rate limits), or undefined
    this.limit = null;               // its place in its key's window, once admitted (see Limits)
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
    this.hasUsage = false;           // a model answer with usage (the tokens its key's window counts)
    this.limitKey = null;            // its key's KeyWindow, once admitted
    this.limitHeaders = null;
    this.rateLimited = null;         // "requests" or "tokens": answered 429 by the rate limits
  }

  count(kind) {
    this.kind = kind;
    this.counted = true;
    const rec = this.conn.rec;
    if (rec !== undefined) {
      rec.requests++;
      stats.requestsByProtocol[rec.protocol] = (stats.requestsByProtocol[rec.protocol] || 0) + 1;
    }
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
    if (this.limit !== null) limits.settle(this);
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
      const p = new Pending(this, h.method, h.url, h.key, body, h.keepAlive, h.apiKey);
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
  let length = 0, chunked = false, expectContinue = false, key, connection = "", apiKey;
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
      // the API key, for the rate limits: OpenAI's "Authorization: Bearer
      // KEY", Anthropic's x-api-key, Azure's api-key
      case 13:
        if (l.slice(0, 13).toLowerCase() === "authorization") apiKey = bearer(l.slice(14));
        break;
      case 9:
        if (apiKey === undefined && l.slice(0, 9).toLowerCase() === "x-api-key") apiKey = apiKeyOf(l.slice(10));
        break;
      case 7:
        if (apiKey === undefined && l.slice(0, 7).toLowerCase() === "api-key") apiKey = apiKeyOf(l.slice(8));
        break;
      default:
    }
  }
  const keepAlive = version === "HTTP/1.1" ? !connection.includes("close") : connection.includes("keep-alive");
  return { method, url, keepAlive, length: chunked ? -1 : length, chunked, expectContinue, key, apiKey };
}

// The key of an Authorization header's value ("Bearer KEY"), or of an
// x-api-key or api-key header (a copy: a waiting request must not hold the
// request's text).
function bearer(value) {
  const v = value.trim();
  return apiKeyOf(/^bearer\s/i.test(v) ? v.slice(7) : v);
}
function apiKeyOf(value) {
  return Buffer.from(value.trim(), "latin1").latin1Slice();
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
  // the key's rate limits: answered 429 here when over them
  if (limits.admit(p, Math.max(1, raw.length >> 2))) return;
  const limitHeaders = p.limitHeaders;
  p.limitHeaders = null;

  const delay = turn && turn.latency !== undefined ? turn.latency : (latency !== undefined ? latency : opts.latencyMs);
  const fault = turn ? turn.fault : undefined;
  if (fault !== undefined && fault !== "malformed" && fault !== "empty") {
    const [status, payload] = faultError(fault, turn.source.message);
    const headers = "retry_after" in turn.source ? `Retry-After: ${formatSeconds(turn.source.retry_after)}\r\n` : "";
    return p.answer(status, payload, headers + limitHeaders, delay);
  }
  if (fault === "malformed")
    return p.answer(200, '{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": [{', limitHeaders, delay);
  if (turn) choice = choiceOf(turn, number, messages);

  // What the answer needs, kept until it leaves: the request (its body,
  // parsed) is garbage before the answer's delay, not after.
  p.choice = choice;
  p.prompt = turn && turn.promptTokens !== undefined ? turn.promptTokens : Math.max(1, raw.length >> 2);
  p.completion = turn && turn.completionTokens !== undefined ? turn.completionTokens : Math.max(1, choice.chars >> 2);
  if (turn) p.usageMore = turn.usageMore;
  p.hasUsage = true;
  return p.answer(200, null, limitHeaders, delay);
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
  if (path === "/_conns" && m === "GET") return reply(p, 200, connsJson(query));
  if (path === "/_conns" && m === "DELETE") return reply(p, 200, { ok: true, closed: closeIdle() });
  if (path === "/_limits") {
    if (m === "GET") return reply(p, 200, limits.json(query));
    if (m === "DELETE") { limits.configure({ reset: true }); return reply(p, 200, { ok: true }); }
    if (m === "POST") {
      try {
        limits.configure(JSON.parse(p.body.toString("utf8") || "null"));
      } catch (e) {
        return reply(p, 400, { ok: false, error: e.message });
      }
      return reply(p, 200, { ok: true, ...limits.json(null) });
    }
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

function rateLimited() {
  const out = { requests: 0, tokens: 0 };
  for (const w of limits.keys.values()) { out.requests += w.rejected.requests; out.tokens += w.rejected.tokens; }
  return out;
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
                client_errors: stats.clientErrors, by_protocol: stats.requestsByProtocol,
                per_s: wall > 0 ? stats.answered / wall : 0 },
    in_flight: inFlight, peak_in_flight: stats.peakInFlight,
    connections: { open: openConnections, peak: stats.peakConnections, accepted: stats.accepted,
                   accept_errors: stats.acceptErrors, by_protocol: conns.byProtocol, tls: conns.tls,
                   h2: { sessions: conns.h2.sessions, streams: conns.h2.streams,
                         peak_concurrent_streams: conns.h2.peakStreams } },
    // answered 429 by the rate limits (not by a script's fault), by limit
    rate_limited: rateLimited(),
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

// ---------------------------------------------------------------- connections

// Every TCP connection is counted when accepted (before any TLS handshake),
// by client address and address family, and by protocol once that is
// known: "http/1.1", "http/1.1+tls", "h2+tls" or "h2c".  GET /_conns lists
// them one by one (client port, protocol, requests, when opened and
// closed), so that a benchmark can tell which client process opened which
// (its sockets' local ports, /proc/PID/fd and /proc/net/tcp).
const CONN_RECORDS_MAX = 200000;
const conns = {
  records: [], dropped: 0,           // since the reset, at most CONN_RECORDS_MAX
  byAddress: new Map(),              // address -> {opened, open, peak}
  byFamily: {}, byProtocol: {},
  tls: { handshakes: 0, resumed: 0, failed: 0 },
  h2: { sessions: 0, streams: 0, peakStreams: 0, maxStreamsPerSession: 0, goaways: 0 },
};

function resetConns() {
  conns.records = [];
  conns.dropped = 0;
  for (const a of conns.byAddress.values()) { a.opened = 0; a.peak = a.open; }
  conns.byFamily = {};
  conns.byProtocol = {};
  conns.tls = { handshakes: 0, resumed: 0, failed: 0 };
  conns.h2 = { sessions: 0, streams: 0, peakStreams: 0, maxStreamsPerSession: 0, goaways: 0 };
  stats.requestsByProtocol = {};
}

resetHooks.push(resetConns);

const sinceReset = () => Math.round(performance.now() - stats.since) / 1000;

// A TCP connection accepted: its record (see GET /_conns).
function accepted(socket) {
  openConnections++;
  stats.accepted++;
  if (openConnections > stats.peakConnections) stats.peakConnections = openConnections;
  const address = socket.remoteAddress || "?";
  let a = conns.byAddress.get(address);
  if (a === undefined) conns.byAddress.set(address, a = { opened: 0, open: 0, peak: 0 });
  a.opened++;
  if (++a.open > a.peak) a.peak = a.open;
  const family = socket.remoteFamily || "?";
  conns.byFamily[family] = (conns.byFamily[family] || 0) + 1;
  const rec = { port: socket.remotePort, address, protocol: null, opened_s: sinceReset(), closed_s: null,
                requests: 0, streams: 0, tls_resumed: null };
  if (conns.records.length < CONN_RECORDS_MAX) conns.records.push(rec);
  else conns.dropped++;
  live.add(rec);
  socket.on("close", () => {
    openConnections--;
    a.open--;
    rec.closed_s = sinceReset();
    live.delete(rec);
  });
  return rec;
}

// The open connections' records; rec.idle() says whether a connection
// has no request in flight, rec.shut() closes it (DELETE /_conns).
const live = new Set();

function closeIdle() {
  let closed = 0;
  for (const rec of live) {
    if (rec.idle && rec.idle()) { rec.shut(); closed++; }
  }
  return closed;
}

function setProtocol(rec, protocol) {
  rec.protocol = protocol;
  conns.byProtocol[protocol] = (conns.byProtocol[protocol] || 0) + 1;
}

// HTTP/1.1 on a socket (plain or TLS), through Conn.
function startH1(socket, rec, protocol, first) {
  setProtocol(rec, protocol);
  const conn = new Conn(socket);
  conn.rec = rec;
  rec.idle = () => !conn.closing && !conn.closed && conn.queue.length === 0 && conn.head === null;
  rec.shut = () => { conn.closing = true; socket.end(); };
  socket.on("data", (chunk) => conn.onData(chunk));
  socket.on("end", () => conn.onEnd());
  socket.on("close", () => conn.onClose());
  socket.on("error", () => { stats.clientErrors++; });   // a reset: "close" follows
  if (first) conn.onData(first);
}

// ---------------------------------------------------------------- HTTP/2

// HTTP/2 is node:http2's (core API, streams rather than request objects):
// over TLS when the client offers "h2" by ALPN (--tls-dir with --http2),
// and in clear text (h2c) with prior knowledge on a plain port with
// --http2 (a connection that starts with the HTTP/2 preface; anything else
// is HTTP/1.1).  The server allows --h2-max-streams concurrent streams per
// connection (SETTINGS_MAX_CONCURRENT_STREAMS, default 128); a model answer
// is the same as over HTTP/1.1, with its headers in lower case.
const H2_PREFACE = Buffer.from("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
const REC = Symbol("record");
const OPEN_STREAMS = Symbol("open streams");
let nextSessionRec = null;           // the record of the connection handed to h2server

const h2server = opts.http2 ? http2.createServer({
  settings: { maxConcurrentStreams: opts.h2MaxStreams },
  maxSessionMemory: 1024,            // MB: thousands of answers waiting on one session
}) : null;

if (h2server) {
  h2server.on("session", (session) => {
    const rec = nextSessionRec;
    nextSessionRec = null;
    session[REC] = rec;
    session[OPEN_STREAMS] = 0;
    if (rec) {
      rec.idle = () => !session.closed && !session.destroyed && session[OPEN_STREAMS] === 0;
      rec.shut = () => session.close();
    }
    conns.h2.sessions++;
    session.on("error", () => { stats.clientErrors++; });
    session.on("goaway", () => { conns.h2.goaways++; });
  });
  h2server.on("stream", onStream);
  h2server.on("sessionError", () => { stats.clientErrors++; });
}

// Hand a socket (TLS after ALPN h2, or plain after the preface) to h2server.
function startH2(socket, rec, protocol) {
  setProtocol(rec, protocol);
  nextSessionRec = rec;
  h2server.emit("connection", socket);
  if (nextSessionRec !== null) {     // (not expected: the session is made at once)
    nextSessionRec = null;
    socket.destroy();
  }
}

// A plain connection with --http2: HTTP/2 if it starts with the preface.
function sniff(socket, rec) {
  let got = EMPTY;
  const onData = (chunk) => {
    got = got.length ? Buffer.concat([got, chunk]) : chunk;
    const n = Math.min(got.length, H2_PREFACE.length);
    const h2 = got.subarray(0, n).equals(H2_PREFACE.subarray(0, n));
    if (h2 && got.length < H2_PREFACE.length) return;      // wait for the rest of it
    socket.removeListener("data", onData);
    if (h2) {
      socket.pause();
      socket.unshift(got);
      startH2(socket, rec, "h2c");
    } else startH1(socket, rec, "http/1.1", got);
  };
  socket.on("data", onData);
  socket.on("error", () => { stats.clientErrors++; });
}

// The answer of one stream: Pending calls flush() when it is ready.
class StreamConn {
  constructor(stream, rec) {
    this.stream = stream;
    this.rec = rec;
    this.p = null;
  }

  flush() {
    const p = this.p;
    if (p === null || !p.ready || p.done) return;
    const stream = this.stream;
    if (stream.destroyed || stream.closed) { p.gone(); return; }
    if (p.body === null) p.body = chatAnswer(p);
    const headers = { ":status": p.status, "content-type": "application/json",
                      "content-length": Buffer.byteLength(p.body) };
    if (p.kind === "chat") headers["x-request-id"] = `req_${newId()}`;
    for (const line of p.headers.split("\r\n")) {
      const colon = line.indexOf(":");
      if (colon > 0) headers[line.slice(0, colon).toLowerCase()] = line.slice(colon + 1).trim();
    }
    try {
      if (p.method === "HEAD") stream.respond(headers, { endStream: true });
      else {
        stream.respond(headers);
        stream.end(p.body);
      }
    } catch {
      p.gone();                      // the stream was reset meanwhile
      return;
    }
    p.body = p.choice = null;
    p.sent();
  }
}

function onStream(stream, headers) {
  const session = stream.session;
  const rec = session[REC];
  rec.streams++;
  conns.h2.streams++;
  if (rec.streams > conns.h2.maxStreamsPerSession) conns.h2.maxStreamsPerSession = rec.streams;
  if (++session[OPEN_STREAMS] > conns.h2.peakStreams) conns.h2.peakStreams = session[OPEN_STREAMS];
  const sc = new StreamConn(stream, rec);
  stream.on("error", () => { stats.clientErrors++; });   // a reset: "close" follows
  stream.on("close", () => {
    session[OPEN_STREAMS]--;
    if (sc.p !== null && !sc.p.done) sc.p.gone();
  });
  const header = (name) => {
    const v = headers[name];
    return v === undefined ? undefined : apiKeyOf(Array.isArray(v) ? v[0] : String(v));
  };
  const auth = headers.authorization;
  const apiKey = auth !== undefined ? bearer(String(auth)) : (header("x-api-key") ?? header("api-key"));
  const method = METHODS[headers[":method"]] || String(headers[":method"]);
  const url = String(headers[":path"] || "/");
  const key = header("idempotency-key");
  const parts = [];
  let size = 0;
  stream.on("data", (chunk) => {
    size += chunk.length;
    if (size <= MAX_BODY) parts.push(chunk);
  });
  stream.on("end", () => {
    if (stream.destroyed) return;
    const p = new Pending(sc, method, url, key, parts.length === 1 ? parts[0] : Buffer.concat(parts), true, apiKey);
    sc.p = p;
    if (size > MAX_BODY) {
      stats.clientErrors++;
      return p.answer(413, JSON.stringify({ error: { message: "the body is too large", type: "invalid_request_error",
                                                     param: null, code: null } }), "", 0);
    }
    dispatch(p);
  });
}

// ---------------------------------------------------------------- TLS

// --tls-dir DIR: ca.pem, cert.pem and key.pem there, or, when any is
// missing, a new CA (ca.pem, ca-key.pem) and a server certificate it signs
// for 127.0.0.1, ::1 and localhost (cert.pem, key.pem; ECDSA P-256, 10
// years), made with openssl(1).  A client trusts ca.pem (curl --cacert,
// tuvl.http_ca_file).
function tlsFiles(dir) {
  const f = (n) => path.join(dir, n);
  if (!["ca.pem", "cert.pem", "key.pem"].every((n) => fs.existsSync(f(n)))) {
    fs.mkdirSync(dir, { recursive: true });
    const openssl = (...args) => execFileSync("openssl", args, { stdio: ["ignore", "ignore", "pipe"] });
    const ext = f("server.ext");
    fs.writeFileSync(ext, "basicConstraints = critical, CA:FALSE\n" +
      "keyUsage = critical, digitalSignature, keyEncipherment\nextendedKeyUsage = serverAuth\n" +
      "subjectAltName = IP:127.0.0.1, IP:::1, DNS:localhost\n");
    try {
      openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
              "-keyout", f("ca-key.pem"), "-out", f("ca.pem"), "-days", "3650", "-subj", "/CN=tuvl bench CA",
              "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign");
      openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
              "-keyout", f("key.pem"), "-out", f("server.csr"), "-subj", "/CN=127.0.0.1");
      openssl("x509", "-req", "-in", f("server.csr"), "-CA", f("ca.pem"), "-CAkey", f("ca-key.pem"),
              "-CAcreateserial", "-out", f("cert.pem"), "-days", "3650", "-extfile", ext);
    } catch (e) {
      throw new Error(`openssl could not make the certificates in ${dir}: ${(e.stderr || e.message).toString().trim()}`);
    }
    for (const n of ["server.csr", "server.ext", "ca.srl"]) fs.rmSync(f(n), { force: true });
  }
  return { key: fs.readFileSync(f("key.pem")), cert: fs.readFileSync(f("cert.pem")) };
}

// ---------------------------------------------------------------- servers

let server;
if (opts.tlsDir) {
  let files;
  try {
    files = tlsFiles(opts.tlsDir);
  } catch (e) {
    process.stderr.write(`loadgen: ${e.message}\n`);
    process.exit(1);
  }
  const pendingHandshakes = new Map();   // "address port" -> record
  server = tls.createServer({ ...files, ALPNProtocols: opts.http2 ? ["h2", "http/1.1"] : ["http/1.1"] });
  server.on("connection", (raw) => {
    raw.setNoDelay(true);
    const id = `${raw.remoteAddress} ${raw.remotePort}`;
    pendingHandshakes.set(id, accepted(raw));
    raw.on("close", () => pendingHandshakes.delete(id));
  });
  server.on("secureConnection", (socket) => {
    const id = `${socket.remoteAddress} ${socket.remotePort}`;
    const rec = pendingHandshakes.get(id);
    pendingHandshakes.delete(id);
    if (rec === undefined) { socket.destroy(); return; }
    conns.tls.handshakes++;
    rec.tls_resumed = socket.isSessionReused();
    if (rec.tls_resumed) conns.tls.resumed++;
    if (socket.alpnProtocol === "h2" && h2server) startH2(socket, rec, "h2+tls");
    else startH1(socket, rec, "http/1.1+tls", null);
  });
  server.on("tlsClientError", () => { conns.tls.failed++; });
} else {
  server = net.createServer({ noDelay: true }, (socket) => {
    socket.setNoDelay(true);         // also for Node versions without the option
    const rec = accepted(socket);
    if (h2server) sniff(socket, rec);
    else startH1(socket, rec, "http/1.1", null);
  });
}
// server.maxConnections stays unset: unlimited.

function connsJson(query) {
  const byAddress = {};
  for (const [a, c] of conns.byAddress) if (c.opened > 0 || c.open > 0) byAddress[a] = { ...c };
  const out = {
    scheme: opts.tlsDir ? "https" : "http", http2: opts.http2, h2_max_streams: opts.http2 ? opts.h2MaxStreams : null,
    accepted: stats.accepted, open: openConnections, peak: stats.peakConnections,
    by_protocol: conns.byProtocol, by_family: conns.byFamily, by_address: byAddress,
    tls: conns.tls,
    h2: { sessions: conns.h2.sessions, streams: conns.h2.streams, peak_concurrent_streams: conns.h2.peakStreams,
          max_streams_per_session: conns.h2.maxStreamsPerSession, goaways: conns.h2.goaways },
    requests_by_protocol: stats.requestsByProtocol,
    records_dropped: conns.dropped,
  };
  if (query && query.get("list") === "1") out.connections = conns.records;
  return out;
}

function writeStatsFile() {
  if (!opts.statsFile) return;
  try {
    fs.writeFileSync(opts.statsFile, JSON.stringify({ stats: statsJson(), connections: connsJson(null),
                                                      limits: limits.json(null) }, null, 2) + "\n");
  } catch (e) {
    process.stderr.write(`loadgen: --stats-file: ${e.message}\n`);
  }
}

let listening = false;
server.on("error", (e) => {
  if (!listening) {
    process.stderr.write(`loadgen: ${e.message}\n`);
    process.exit(1);
  }
  // accept() failed (EMFILE: out of file descriptors): count it, say it once
  if (stats.acceptErrors++ === 0) process.stderr.write(`loadgen: ${e.message}\n`);
});

for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => { writeStatsFile(); process.exit(0); });

server.listen({ port: opts.port, host: opts.host, backlog: opts.backlog }, () => {
  listening = true;
  // (this line as it was before TLS: the benchmarks read the port from it)
  process.stderr.write(`load generator on ${opts.host}:${server.address().port}\n`);
});
