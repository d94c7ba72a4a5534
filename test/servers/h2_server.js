#!/usr/bin/env node
// test/servers/h2_server.js: an HTTPS server that speaks HTTP/2 and HTTP/1.1
// (ALPN), for the tests of tuvl's TLS and HTTP/2 client (test_https.py).
//
//   node h2_server.js --port PORT --cert cert.pem --key key.pem [--h1-only]
//                     [--max-streams N]
//
// GET or POST /echo answers {proto, connection, resumed, method, body}: the
// protocol the request came over, the number of the TLS connection that
// carried it (1, 2, ...) and whether that connection resumed a TLS session.
// /close does the same and closes the connection after the answer (HTTP/1.1)
// or the session (HTTP/2). GET /_stats answers {connections, resumed,
// requests: {h2, "http/1.1"}, peak_in_flight} since the last POST /_reset
// (peak_in_flight: the most /echo requests waiting for their answer at
// once). --max-streams N allows N concurrent streams per HTTP/2 connection
// (SETTINGS_MAX_CONCURRENT_STREAMS; Node's default: no bound). Prints
// "ready" on stdout once listening. Node's standard library only.
'use strict';
const fs = require('fs');
const http2 = require('http2');
const https = require('https');

const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : dflt;
};
const port = Number(opt('--port', '0'));
const h1only = args.includes('--h1-only');
const maxStreams = opt('--max-streams', null);

let stats;
let inFlight = 0;
const reset = () => {
  stats = { connections: 0, resumed: 0, requests: { h2: 0, 'http/1.1': 0 }, peak_in_flight: inFlight };
};
reset();

// session tickets are on by default; one ticket key for the server's life
const tls = { cert: fs.readFileSync(opt('--cert')), key: fs.readFileSync(opt('--key')) };
// --h1-only: Node's https server, which offers HTTP/1.1 alone by ALPN
const server = h1only ? https.createServer(tls) : http2.createSecureServer({
  ...tls, allowHTTP1: true,
  ...(maxStreams !== null ? { settings: { maxConcurrentStreams: Number(maxStreams) } } : {}),
});

server.on('secureConnection', (sock) => {
  stats.connections += 1;
  sock.tuvlConnection = stats.connections;
  if (sock.isSessionReused()) stats.resumed += 1;
});

server.on('request', (req, res) => {
  const sock = req.httpVersion === '2.0' ? req.stream.session.socket : req.socket;
  const proto = req.httpVersion === '2.0' ? 'h2' : 'http/1.1';
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', () => {
    const url = new URL(req.url, 'https://x');
    const send = (code, obj, close) => {
      const body = JSON.stringify(obj);
      const headers = { 'content-type': 'application/json' };
      if (close && proto === 'http/1.1') headers.connection = 'close';
      res.writeHead(code, headers);
      res.end(body, () => {
        if (close && proto === 'h2') req.stream.session.close();
      });
    };
    if (url.pathname === '/_stats') return send(200, stats);
    if (url.pathname === '/_reset') { reset(); return send(200, { ok: true }); }
    if (url.pathname === '/echo' || url.pathname === '/close') {
      stats.requests[proto] += 1;
      inFlight += 1;
      stats.peak_in_flight = Math.max(stats.peak_in_flight, inFlight);
      const reply = () => (inFlight -= 1, send(200, {
        proto,
        connection: sock.tuvlConnection,
        resumed: sock.isSessionReused(),
        method: req.method,
        body: Buffer.concat(chunks).toString('utf8'),
      }, url.pathname === '/close'));
      const ms = Number(url.searchParams.get('ms') || 0);
      return ms > 0 ? setTimeout(reply, ms) : reply();
    }
    return send(404, { error: 'not found' });
  });
});

server.listen(port, '127.0.0.1', () => {
  process.stdout.write(`ready ${server.address().port}\n`);
});
process.on('SIGTERM', () => process.exit(0));
