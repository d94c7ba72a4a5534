#!/usr/bin/env node
// An OTLP/HTTP trace receiver for tuvl's tests (127.0.0.1 only).
//
// POST /v1/traces with an OTLP JSON ExportTraceServiceRequest: the body is
// read into the message types OpenTelemetry's own protobuf definitions
// generate (@opentelemetry/otlp-transformer, from npm), verified against
// them, encoded to protobuf and decoded back; an unknown field, a wrong
// type or a malformed id is a 400 with the reason.  Accepted spans are
// kept, ids in hex, attributes as {key: value}.
//
//   GET    /spans          {"spans": [...], "requests": n, "rejected": [...]}
//   DELETE /spans          forget them
//   POST   /_mode?status=N answer every export with status N (0: normal);
//                          ?hang=1 never answers; ?count_only=1 only counts
//                          the spans (for benchmarks: "counted" in GET /spans)
//
// node otlp_receiver.js --port N   (0: any; the port is printed on stderr)
"use strict";
const http = require("http");
const path = require("path");

const root = require(path.join(__dirname, "otlp", "node_modules", "@opentelemetry", "otlp-transformer",
                               "build", "src", "generated", "root.js"));
const pb = root.opentelemetry.proto;
const Request = pb.collector.trace.v1.ExportTraceServiceRequest;

const SPAN_FIELDS = new Set(["traceId", "spanId", "parentSpanId", "traceState", "name", "kind",
  "startTimeUnixNano", "endTimeUnixNano", "attributes", "droppedAttributesCount", "events",
  "droppedEventsCount", "links", "droppedLinksCount", "status", "flags"]);

let spans = [];
let requests = 0;
let rejected = [];
let mode = { status: 0, hang: false, countOnly: false };
let counted = 0;
const SPAN_ID = Buffer.from('"spanId"');

function hexToB64(hex, bytes, what) {
  if (typeof hex !== "string" || !new RegExp(`^[0-9a-f]{${bytes * 2}}$`).test(hex) || /^0+$/.test(hex))
    throw new Error(`${what} must be ${bytes * 2} lowercase hex digits, not all zero: ${hex}`);
  return Buffer.from(hex, "hex").toString("base64");
}

function anyValue(v) {
  if (v.stringValue !== undefined) return v.stringValue;
  if (v.intValue !== undefined) return Number(v.intValue);
  if (v.boolValue !== undefined) return v.boolValue;
  if (v.doubleValue !== undefined) return v.doubleValue;
  return null;
}

// OTLP JSON -> protobufjs object form (ids are hex in OTLP JSON, base64 for protobufjs).
function toProto(body) {
  for (const rs of body.resourceSpans || [])
    for (const ss of rs.scopeSpans || [])
      for (const s of ss.spans || []) {
        for (const k of Object.keys(s))
          if (!SPAN_FIELDS.has(k)) throw new Error(`unknown span field ${k}`);
        s.traceId = hexToB64(s.traceId, 16, "traceId");
        s.spanId = hexToB64(s.spanId, 8, "spanId");
        if (s.parentSpanId !== undefined) s.parentSpanId = hexToB64(s.parentSpanId, 8, "parentSpanId");
        for (const t of ["startTimeUnixNano", "endTimeUnixNano"])
          if (typeof s[t] !== "string" || !/^[0-9]+$/.test(s[t])) throw new Error(`${t} must be a decimal string`);
      }
  return body;
}

function accept(body) {
  const obj = toProto(body);
  const msg = Request.fromObject(obj);
  const err = Request.verify(msg);
  if (err) throw new Error(err);
  const back = Request.decode(Request.encode(msg).finish());
  const plain = Request.toObject(back, { longs: String, enums: Number, bytes: String, defaults: false });
  for (const rs of plain.resourceSpans || []) {
    const resource = {};
    for (const a of (rs.resource && rs.resource.attributes) || []) resource[a.key] = anyValue(a.value);
    for (const ss of rs.scopeSpans || [])
      for (const s of ss.spans || []) {
        const attrs = {};
        for (const a of s.attributes || []) attrs[a.key] = anyValue(a.value);
        spans.push({
          traceId: Buffer.from(s.traceId, "base64").toString("hex"),
          spanId: Buffer.from(s.spanId, "base64").toString("hex"),
          parentSpanId: s.parentSpanId ? Buffer.from(s.parentSpanId, "base64").toString("hex") : null,
          name: s.name, kind: s.kind, start: s.startTimeUnixNano, end: s.endTimeUnixNano,
          attributes: attrs, status: s.status || {}, resource, scope: ss.scope || {},
        });
      }
  }
}

const server = http.createServer((req, res) => {
  const url = new URL(req.url, "http://127.0.0.1");
  let data = [];
  // counting only (a benchmark's collector): the spans are counted as the
  // body arrives, none of it is kept or copied; a match may straddle two
  // chunks, and only such a match is in the bytes around their boundary
  const counting = mode.countOnly && req.method === "POST" && url.pathname === "/v1/traces";
  let found = 0;
  let tail = Buffer.alloc(0);
  req.on("data", (c) => {
    if (!counting) return data.push(c);
    if (tail.length) {
      const edge = Buffer.concat([tail, c.subarray(0, SPAN_ID.length - 1)]);
      if (edge.indexOf(SPAN_ID) !== -1) found++;
    }
    for (let at = c.indexOf(SPAN_ID); at !== -1; at = c.indexOf(SPAN_ID, at + SPAN_ID.length))
      found++;
    tail = Buffer.from(c.subarray(Math.max(0, c.length - (SPAN_ID.length - 1))));
  });
  req.on("end", () => {
    const send = (code, obj) => {
      res.writeHead(code, { "Content-Type": "application/json" });
      res.end(JSON.stringify(obj));
    };
    if (req.method === "GET" && url.pathname === "/spans") return send(200, { spans, requests, rejected, counted });
    if (req.method === "DELETE" && url.pathname === "/spans") {
      spans = []; requests = 0; rejected = []; counted = 0;
      return send(200, { ok: true });
    }
    if (req.method === "POST" && url.pathname === "/_mode") {
      mode = { status: Number(url.searchParams.get("status") || 0), hang: url.searchParams.get("hang") === "1",
               countOnly: url.searchParams.get("count_only") === "1" };
      return send(200, mode);
    }
    if (req.method === "POST" && url.pathname === "/v1/traces") {
      requests++;
      if (mode.hang) return;  // never answers
      if (mode.status) return send(mode.status, { error: "refused by the test" });
      if (counting) {
        counted += found;
        return send(200, { partialSuccess: {} });
      }
      if (!(req.headers["content-type"] || "").startsWith("application/json"))
        return send(415, { error: "expected application/json" });
      try {
        accept(JSON.parse(Buffer.concat(data).toString("utf8")));
      } catch (e) {
        rejected.push(String(e.message || e));
        return send(400, { error: String(e.message || e) });
      }
      return send(200, { partialSuccess: {} });
    }
    send(404, { error: "no such endpoint" });
  });
});

const i = process.argv.indexOf("--port");
server.listen(i > 0 ? Number(process.argv[i + 1]) : 0, "127.0.0.1", () => {
  process.stderr.write(`otlp receiver on 127.0.0.1:${server.address().port}\n`);
});
