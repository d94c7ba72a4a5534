#!/usr/bin/env node
// A closed-loop HTTP/1.1 client for measuring bench/servers/loadgen.mjs with
// many connections (bench/servers/loadgen_capacity.py, case agents10k).
// Node's standard library only.
//
// Each of --connections keep-alive connections sends the same request,
// waits for its answer and sends it again at once, as an agent whose every
// turn goes to the model.  Unlike wrk, it opens its connections gradually
// (--ramp-s), so that they do not overflow the listen backlog (somaxconn)
// and wait out SYN retransmits, and it reports the latency of the answers
// received in a window after a warm-up only.
//
//   node bench/servers/loadclient.mjs --url http://127.0.0.1:PORT/lat/1000/v1/chat/completions
//        [--body FILE] [--connections 10000] [--ramp-s 4] [--warmup-s 8] [--window-s 20]
//
// With --body the request is a POST of the file's bytes (application/json),
// otherwise a GET.  When the window ends it prints one JSON object on stdout
// and exits: {connections, window_s, answers, per_s, statuses, latency_ms:
// {min, p50, p90, p99, max, mean}, errors, closed, cpu_s} (errors: socket
// errors; closed: connections that closed and were opened again; cpu_s:
// this client's CPU time in the window).  Answers must carry Content-Length (loadgen.mjs's do).
import fs from "node:fs";
import net from "node:net";
import { createHistogram, performance } from "node:perf_hooks";

function options(argv) {
  const o = { url: null, body: null, connections: 10000, rampS: 4, warmupS: 8, windowS: 20 };
  const names = { "--url": "url", "--body": "body", "--connections": "connections", "--ramp-s": "rampS",
                  "--warmup-s": "warmupS", "--window-s": "windowS" };
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || i + 1 >= argv.length) {
      process.stderr.write(`loadclient: bad argument ${argv[i]}\n`);
      process.exit(2);
    }
    o[key] = key === "url" || key === "body" ? argv[i + 1] : Number(argv[i + 1]);
  }
  if (!o.url) {
    process.stderr.write("loadclient: --url is required\n");
    process.exit(2);
  }
  return o;
}

const opts = options(process.argv.slice(2));
const url = new URL(opts.url);
const port = Number(url.port || 80);
const body = opts.body ? fs.readFileSync(opts.body) : null;
const request = Buffer.concat([
  Buffer.from(`${body ? "POST" : "GET"} ${url.pathname}${url.search} HTTP/1.1\r\nHost: ${url.host}\r\n` +
              (body ? `Content-Type: application/json\r\nContent-Length: ${body.length}\r\n` : "") + "\r\n"),
  body || Buffer.alloc(0),
]);
const CRLFCRLF = Buffer.from("\r\n\r\n");

// µs, answers received in the window; 4 significant figures: 0.1 ms at 1 s
const latency = createHistogram({ figures: 4 });
let measuring = false;
let answers = 0;
let errors = 0;                      // socket errors
let closed = 0;                      // connections closed (and opened again)
const statuses = {};
let open = 0;

function connect() {
  const socket = net.connect({ host: url.hostname, port, noDelay: true });
  let buf = null;
  let sentAt = 0;
  const send = () => {
    sentAt = performance.now();
    socket.write(request);
  };
  let connected = false;
  socket.on("connect", () => {
    connected = true;
    open++;
    send();
  });
  socket.on("data", (chunk) => {
    buf = buf === null ? chunk : Buffer.concat([buf, chunk]);
    for (;;) {
      const end = buf.indexOf(CRLFCRLF);
      if (end < 0) return;
      const head = buf.latin1Slice(0, end);
      const m = /\r\ncontent-length:\s*(\d+)/i.exec(head);
      const total = end + 4 + (m ? Number(m[1]) : 0);
      if (buf.length < total) return;
      if (head.startsWith("HTTP/1.1 100")) {  // 100 Continue: not the answer
        buf = buf.length > total ? buf.subarray(total) : null;
        if (buf === null) return;
        continue;
      }
      if (measuring) {
        const us = Math.round((performance.now() - sentAt) * 1000);
        latency.record(us >= 1 ? us : 1);
        answers++;
        const status = head.slice(9, 12);
        statuses[status] = (statuses[status] || 0) + 1;
      }
      buf = buf.length > total ? buf.subarray(total) : null;
      send();
      if (buf === null) return;
    }
  });
  socket.on("error", () => { errors++; });
  socket.on("close", () => {
    if (connected) open--;
    if (stopped) return;
    closed++;
    setTimeout(connect, 100);                 // a new connection in its place
  });
}

let stopped = false;
let started = 0;
const perTick = Math.max(1, Math.ceil(opts.connections / Math.max(1, opts.rampS * 100)));
const ramp = setInterval(() => {
  for (let i = 0; i < perTick && started < opts.connections; i++, started++) connect();
  if (started >= opts.connections) clearInterval(ramp);
}, 10);

let cpu0, t0;
setTimeout(() => {
  measuring = true;
  cpu0 = process.cpuUsage();
  t0 = performance.now();
  setTimeout(() => {
    measuring = false;
    stopped = true;
    const cpu = process.cpuUsage(cpu0);
    const wall = (performance.now() - t0) / 1000;
    const ms = (v) => Math.round(v) / 1000;
    process.stdout.write(JSON.stringify({
      connections: open, window_s: wall, answers, per_s: answers / wall, statuses,
      latency_ms: answers ? { min: ms(latency.min), p50: ms(latency.percentile(50)), p90: ms(latency.percentile(90)),
                              p99: ms(latency.percentile(99)), max: ms(latency.max), mean: ms(latency.mean) } : null,
      errors, closed, cpu_s: (cpu.user + cpu.system) / 1e6,
    }) + "\n", () => process.exit(0));
  }, opts.windowS * 1000);
}, opts.warmupS * 1000);
