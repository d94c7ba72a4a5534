#!/usr/bin/env node
// An OTLP/HTTP trace receiver for tuvl's tests (127.0.0.1 only).
//
// POST /v1/traces with an ExportTraceServiceRequest in OTLP/HTTP's binary
// protobuf encoding (application/x-protobuf; anything else is a 415): the
// body is decoded with the message types OpenTelemetry's own protobuf
// definitions generate (@opentelemetry/otlp-transformer, from npm) and
// must encode back to the very same bytes (an unknown field, a wrong wire
// type, a field out of its place or a default written out differs); ids
// must be 16 and 8 bytes, not all zero.  A body that is not is a 400 with
// the reason.  Accepted spans are kept, ids in hex, attributes as
// {key: value}.
//
//   GET    /spans          {"spans": [...], "requests": n, "rejected": [...]}
//   DELETE /spans          forget them
//   POST   /_mode?status=N answer every export with status N (0: normal);
//                          ?hang=1 never answers; ?count_only=1 only counts
//                          the spans, walking the body's fields and keeping
//                          nothing (for benchmarks: "counted" in GET /spans)
//
// node otlp_receiver.js --port N   (0: any; the port is printed on stderr)
"use strict";
const http = require("http");
const path = require("path");

const root = require(path.join(__dirname, "otlp", "node_modules", "@opentelemetry", "otlp-transformer",
                               "build", "src", "generated", "root.js"));
const pb = root.opentelemetry.proto;
const Request = pb.collector.trace.v1.ExportTraceServiceRequest;

let spans = [];
let requests = 0;
let rejected = [];
let mode = { status: 0, hang: false, countOnly: false };
let counted = 0;

function anyValue(v) {
  if (v.stringValue !== undefined) return v.stringValue;
  if (v.intValue !== undefined) return Number(v.intValue);
  if (v.boolValue !== undefined) return v.boolValue;
  if (v.doubleValue !== undefined) return v.doubleValue;
  return null;
}

function acceptProtobuf(buf) {
  const msg = Request.decode(buf);
  const again = Buffer.from(Request.encode(msg).finish());
  if (!again.equals(buf))
    throw new Error(`the body is not the canonical encoding of an ExportTraceServiceRequest ` +
                    `(${buf.length} bytes, ${again.length} encoded back)`);
  const id = (what, b, bytes, optional) => {
    if (optional && (!b || b.length === 0)) return;
    if (!b || b.length !== bytes || b.every((x) => x === 0))
      throw new Error(`${what} must be ${bytes} bytes, not all zero: ${Buffer.from(b || []).toString("hex")}`);
  };
  for (const rs of msg.resourceSpans)
    for (const ss of rs.scopeSpans)
      for (const s of ss.spans) {
        id("traceId", s.traceId, 16);
        id("spanId", s.spanId, 8);
        id("parentSpanId", s.parentSpanId, 8, true);
      }
  keep(msg);
}

// Walk a protobuf body's fields: resource_spans (1) > scope_spans (2) > spans (2).
function countProtobuf(buf) {
  let found = 0;
  const varint = (at) => {
    let v = 0, mul = 1, b;
    do { b = buf[at.pos++]; v += (b & 0x7f) * mul; mul *= 128; } while (b & 0x80);
    return v;
  };
  const fields = (start, end, want, fn) => {
    const at = { pos: start };
    while (at.pos < end) {
      const tag = varint(at), wire = tag & 7, field = tag >>> 3;
      if (wire === 0) varint(at);
      else if (wire === 1) at.pos += 8;
      else if (wire === 5) at.pos += 4;
      else if (wire === 2) {
        const len = varint(at);
        if (field === want) fn(at.pos, at.pos + len);
        at.pos += len;
      } else throw new Error(`wire type ${wire} at ${at.pos}`);
    }
    if (at.pos !== end) throw new Error(`a field runs past its message at ${end}`);
  };
  fields(0, buf.length, 1, (s, e) => fields(s, e, 2, (s2, e2) => fields(s2, e2, 2, () => found++)));
  return found;
}

function keep(msg) {
  const plain = Request.toObject(msg, { longs: String, enums: Number, bytes: String, defaults: false });
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
  req.on("data", (c) => data.push(c));
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
      if (!(req.headers["content-type"] || "").startsWith("application/x-protobuf"))
        return send(415, { error: "expected application/x-protobuf" });
      try {
        if (mode.countOnly) counted += countProtobuf(Buffer.concat(data));
        else acceptProtobuf(Buffer.concat(data));
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
