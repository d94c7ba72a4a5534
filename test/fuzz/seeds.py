#!/usr/bin/env python3
"""Candidate seeds for the fuzz harness, from the project's docs, tests and test servers.

    /usr/bin/python3 test/fuzz/seeds.py DIR            # write DIR/<target>/...
    seeds.py --control FILE KEPT_DIR NEW_DIR           # libFuzzer's merge control file
    seeds.py --select FILE                             # the files of NEW_DIR to keep

test/fuzz/run.sh seeds runs it and keeps, in test/fuzz/corpus/<target>/,
the hostile seeds and those that add coverage (a merge as libFuzzer's
-merge=1 makes it, whose child processes a backend cannot start: run.sh
runs the inner step, -merge_inner=1, and this script the rest); see
docs/fuzzing.md.  The candidates:

  yaml, validate   every YAML source in the docs (yaml blocks, and the
                   dollar-quoted sources of register_* calls in sql blocks),
                   the pg_regress inputs, the pgTAP and isolation tests, the
                   demo and the Python suites (validate: the workflows only)
  template         each "{{ ... }}" string and templated object of those
                   workflows, with a context
  schema           each JSON Schema in them (trigger inputs, forms, ...), with
                   an instance that matches and one that does not
  apicall          what test/servers/http_server.py answers
  llm              what test/servers/llm_server.py answers in the three wire
                   formats (text, tool calls, thinking, usage, every fault),
                   and openai-mock-api when test/servers/peers has it
  mcp              what the scripted MCP server of test/python/httputil.py
                   answers (JSON, batches, event streams with comments,
                   progress, CRLF, split data lines), and the reference server
                   @modelcontextprotocol/server-everything when installed
  json             model answers, tool arguments and the JSON above

and every target gets hostile inputs: JSON 100,000 levels deep, 1e1000000,
150,000 digits, lone surrogates, invalid UTF-8, NUL bytes, deep and
self-referencing YAML.  A response (apicall, llm, mcp) is written as the
harness reads it: the status line, header lines, an empty line, the body
(fuzz.c, input_response); a two-part input (template, schema) is its parts
joined by a NUL byte.  Names start with doc-, test-, srv- or hostile-
(run.sh replaces those in the corpus, and keeps any other file there).
No file is over 200 kB.  Needs PyYAML (Debian's python3-yaml).
"""
import glob
import hashlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time

import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CORPUS = None                       # the output directory (main)
TARGETS = ["yaml", "validate", "template", "schema", "apicall", "llm", "mcp", "json"]
PREFIXES = ("doc-", "test-", "srv-", "hostile-")
MAX_BYTES = 200_000
MCP_ID = "1"                        # the request id the harness's mcp target asks about

written = {t: set() for t in TARGETS}


def write(target, name, data):
    """Write one seed (bytes or str) unless the same bytes are there already;
    a name already taken gets a part of the digest."""
    if isinstance(data, str):
        data = data.encode()
    assert len(data) <= MAX_BYTES, (target, name, len(data))
    digest = hashlib.sha1(data).hexdigest()
    if digest in written[target]:
        return
    written[target].add(digest)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:80]
    path = os.path.join(CORPUS, target, name)
    if os.path.exists(path):
        path += "-" + digest[:8]
    with open(path, "wb") as f:
        f.write(data)


def response(status, headers, body):
    """A response as the harness reads it."""
    if isinstance(body, str):
        body = body.encode()
    head = "".join(f"{k}: {v}\n" for k, v in headers)
    return f"{status}\n{head}\n".encode() + body


# ---------------------------------------------------------------------------
# YAML sources in the docs and tests

DOLLAR = re.compile(r"\$(\w*)\$\n?(.*?)\$\1\$", re.S)


def yaml_sources():
    """(name, source) of every YAML document the docs and tests hold."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]:
        page = os.path.splitext(os.path.basename(path))[0]
        text = open(path, encoding="utf-8").read()
        for i, (lang, block) in enumerate(re.findall(r"```(\w*)\n(.*?)```", text, re.S)):
            if lang == "yaml":
                found.append((f"doc-{page}-{i}", block))
            elif lang == "sql":
                found += [(f"doc-{page}-{i}", m.group(2)) for m in DOLLAR.finditer(block)]
    tests = (sorted(glob.glob(os.path.join(ROOT, "test", "regress", "sql", "*.sql")))
             + sorted(glob.glob(os.path.join(ROOT, "test", "pgtap", "*.sql")))
             + sorted(glob.glob(os.path.join(ROOT, "test", "regress", "specs", "*.spec")))
             + sorted(glob.glob(os.path.join(ROOT, "demo", "*.sql")))
             + sorted(glob.glob(os.path.join(ROOT, "test", "python", "*.py"))))
    for path in tests:
        if os.path.basename(path).startswith("tuvl--"):
            continue
        base = os.path.splitext(os.path.basename(path))[0]
        text = open(path, encoding="utf-8").read()
        for i, m in enumerate(DOLLAR.finditer(text)):
            if re.search(r"^\s*(name|steps|kind|type|provider):", m.group(2), re.M):
                found.append((f"test-{base}-{i}", m.group(2)))
    return found


def parse(source):
    try:
        return yaml.safe_load(source)
    except yaml.YAMLError:
        return None


def walk(node):
    """Every value inside a parsed document, depth first."""
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def seed_yaml(sources):
    seen = set()
    for name, src in sources:
        if src in seen:
            continue
        seen.add(src)
        write("yaml", name + ".yaml", src)
        doc = parse(src)
        if isinstance(doc, dict) and "steps" in doc:
            write("validate", name + ".yaml", src)


# ---------------------------------------------------------------------------
# Templates and schemas, from the parsed workflows

CONTEXT = {
    "order_id": 1, "n": 41, "note": "a note", "author": "Ann", "ticket": "My card was charged twice",
    "order": [{"id": 1, "status": "paid", "amount": 25.5, "card": "4111111111111111"}],
    "user": {"name": "Ann", "email": "ann@example.com", "tags": ["vip", "de"]},
    "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-2", "qty": 1}],
    "answer": {"ok": True, "comment": "fine"}, "flag": False, "nothing": None,
    "_private": "hidden", "event": "on_error", "run_id": 7,
}


def seed_templates(docs):
    strings, objects = [], []
    for doc in docs:
        for v in walk(doc):
            if isinstance(v, str) and "{{" in v:
                if v not in strings:
                    strings.append(v)
            elif isinstance(v, dict) and "steps" not in v and "id" not in v:
                text = json.dumps(v)
                if "{{" in text and len(text) < 2000 and v not in objects:
                    objects.append(v)
    ctx = json.dumps(CONTEXT)
    for i, s in enumerate(strings[:80]):
        write("template", f"doc-string-{i}", s.encode() + b"\0" + ctx.encode())
    for i, o in enumerate(objects[:40]):
        write("template", f"doc-object-{i}", json.dumps(o).encode() + b"\0" + ctx.encode())
    extra = [
        ("{{ secrets.key }}", ctx), ("Bearer {{secrets.key}}", ctx), ("{{ secrets. }}", ctx),
        ("{{ order.0.amount }} EUR", ctx), ("{{ items.1.sku }}", ctx), ("{{ user }}", ctx),
        ("{{ nothing }}", ctx), ("{{ missing.deep.path }}", ctx), ("{{", ctx), ("}}{{}}", ctx),
        ("{{ a..b }}", ctx), ("{{ order.99 }}", ctx), ("{{ order.-1 }}", ctx),
        ("{{ user.name }} {{ user.tags }} {{ flag }}", ctx), ("   {{ n }}   ", ctx),
        ('{"a": "{{ order }}", "b": ["{{ n }}", "x {{ n }} y"]}', ctx),
        ("{{ \u00e9t\u00e9 }}", '{"\u00e9t\u00e9": 1}'), ("{{ x }}", '{"x": "\\u00e9\\ud83d\\ude00"}'),
    ]
    for i, (t, c) in enumerate(extra):
        write("template", f"doc-extra-{i}", t.encode() + b"\0" + c.encode())


SCHEMA_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def is_schema(v):
    t = v.get("type") if isinstance(v, dict) else None
    return ((isinstance(t, str) and t in SCHEMA_TYPES or isinstance(t, list))
            and any(k in v for k in ("properties", "items", "required", "enum", "minimum",
                                     "maximum", "minLength", "maxLength", "additionalProperties")))


def instance_of(schema, depth=0):
    """A value that should match schema (best effort)."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    t = schema.get("type")
    t = t[0] if isinstance(t, list) and t else t
    if t == "object":
        props = schema.get("properties") or {}
        return {k: instance_of(v, depth + 1) for k, v in props.items() if isinstance(v, dict)}
    if t == "array":
        return [instance_of(schema.get("items") or {}, depth + 1)]
    if t == "integer":
        return schema.get("minimum", 1)
    if t == "number":
        return schema.get("minimum", 1.5)
    if t == "boolean":
        return True
    if t == "string":
        return "x" * max(1, schema.get("minLength", 1))
    return None


def seed_schemas(docs):
    schemas = []
    for doc in docs:
        for v in walk(doc):
            if is_schema(v) and v not in schemas:
                schemas.append(v)
    for i, s in enumerate(schemas[:60]):
        good = instance_of(s)
        write("schema", f"doc-{i}-match", json.dumps(s).encode() + b"\0" + json.dumps(good).encode())
        bad = {"unexpected": [1, "two", None]} if not isinstance(good, dict) else "not an object"
        write("schema", f"doc-{i}-mismatch", json.dumps(s).encode() + b"\0" + json.dumps(bad).encode())
    extra = [
        ({"type": "object", "required": ["a"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 10}}}, {"a": 11, "b": 1}),
        ({"type": ["string", "null"], "minLength": 2, "maxLength": 3}, "\u00e9\u00e9\u00e9\u00e9"),
        ({"type": "array", "items": {"type": "number"}}, [1, 2.5, "3"]),
        ({"enum": [1, "a", None, {"x": [1]}]}, {"x": [1]}),
        ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array",
          "items": {"type": "object", "required": ["c"]}}}}}}, {"a": {"b": [{}, {"c": 1}]}}),
        ({"type": "integer"}, 1e300), ({"type": "integer"}, 2.0), ({"minimum": "x"}, 1),
        ({"type": "bogus", "required": "a", "properties": [], "items": 1}, {}),
        ({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "t", "description": "d",
          "default": 1, "type": "object"}, {}),
    ]
    for i, (s, inst) in enumerate(extra):
        write("schema", f"doc-extra-{i}", json.dumps(s).encode() + b"\0" + json.dumps(inst).encode())


# ---------------------------------------------------------------------------
# Servers: run them and keep what they answer

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def fetch(port, method, path, body=None, headers=None):
    """(status, [(name, value)], body bytes) of one request."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    h = {"Content-Type": "application/json"} if data is not None else {}
    h.update(headers or {})
    c.request(method, path, data, h)
    r = c.getresponse()
    out = (r.status, [(k.lower(), v) for k, v in r.getheaders()], r.read())
    c.close()
    return out


def keep(headers):
    """The headers that carry meaning (no dates: the seeds stay the same)."""
    return [(k, v) for k, v in headers if k not in ("date", "server", "keep-alive", "connection")]


class Server:
    """A test server in a child process on a free port."""

    def __init__(self, argv, env=None, port=None):
        self.port = port or free_port()
        argv = [a.replace("PORT", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(argv, env=dict(os.environ, **(env or {}), PORT=str(self.port)),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_port(self.port):
            self.close()
            raise RuntimeError(f"{argv[0]} did not start")

    def close(self):
        self.proc.terminate()
        self.proc.wait()


def seed_http():
    srv = Server([sys.executable, os.path.join(ROOT, "test", "servers", "http_server.py"), "--port", "PORT"])
    try:
        for name, method, path, body in [
                ("json", "POST", "/json", {"order_id": 1, "secret": "sk-fuzz-secret"}),
                ("text", "GET", "/text", None), ("status-503", "GET", "/status/503", None),
                ("status-404", "GET", "/status/404", None),
                ("ratelimit", "GET", "/ratelimit/a?times=1&retry_after=2", None),
                ("big", "GET", "/big?bytes=20000", None), ("malformed", "GET", "/malformed", None)]:
            status, headers, data = fetch(srv.port, method, path, body)
            write("apicall", f"srv-http-{name}", response(status, keep(headers), data))
    finally:
        srv.close()
    crafted = [
        ("retry-after-date", response(503, [("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")], "")),
        ("retry-after-ms", response(429, [("retry-after-ms", "1500.5"), ("retry-after", "1e400")], "{}")),
        ("retry-after-junk", response(429, [("retry-after", "1.2.3"), ("retry-after-ms", "nan")], "")),
        ("secrets", response(200, [("content-type", "text/plain"), ("x-token", "sk-fuzz-secret")],
                             'key=sk-fuzz-secret p%40ss%20w%2Frd%26%22x%22 "p@ss w/rd&\\"x\\"" \u00e9t\u00e9')),
        ("secrets-json", response(200, [("content-type", "application/json")],
                                  json.dumps({"k": "sk-fuzz-secret", "p": 'p@ss w/rd&"x"'}))),
        ("timeout", b"0 timeout\n\n"), ("too-large", b"0 too_large\n\n"),
        ("not-allowed", b"0 not_allowed\n\n"), ("redirects", b"0 redirects\n\n"),
        ("refused", b"0 error\n\nConnection refused"),
        ("json-says-text", response(200, [("content-type", "text/plain")], '{"a": [1, 2]}')),
        ("json-array", response(200, [("content-type", "application/vnd.api+json")], "[1, 2, 3]")),
        ("scalar", response(200, [("content-type", "application/json")], "42")),
        ("empty", response(204, [], "")),
        ("crlf", b"200\r\ncontent-type: application/json\r\nx-a:  b \r\n\r\n{\"a\": 1}"),
        ("no-headers", b"200\n\n{}"), ("status-only", b"418"),
        ("odd-header", response(200, [("Content-Type", "application/json; charset=utf-8"), (":", ":"), ("x", "")], "{}")),
    ]
    for name, data in crafted:
        write("apicall", f"srv-{name}", data)


LLM_SCRIPTS = {
    "text": [{"text": "The order {{last_user}} is paid.", "usage": {"prompt_tokens": 12, "completion_tokens": 7}}],
    "tools": [{"tool_calls": [{"name": "lookup", "arguments": {"order_id": 1}},
                              {"name": "write_note", "arguments": {"note": "caf\u00e9 \"quoted\""}}]}],
    "tools_raw": [{"tool_calls": [{"name": "lookup", "arguments_raw": "{\"order_id\": 1"}]}],
    "no_ids": [{"tool_calls": [{"name": "lookup", "arguments": {}}], "no_ids": True}],
    "length": [{"text": "cut", "finish": "length"}],
    "cached": [{"text": "ok", "cached_tokens": 5, "reasoning_tokens": 3,
                "usage": {"prompt_tokens": 10, "completion_tokens": 4}}],
    "thinking": [{"text": "done", "thinking": "let me think",
                  "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]}],
    "outcome": [{"text": "```json\n{\"outcome\": \"approve\", \"result\": {\"refund\": 25.5}}\n```"}],
    "f429": [{"fault": "429", "retry_after": 2, "message": "slow down"}],
    "f429frac": [{"fault": "429", "retry_after": 0.5}],
    "f500": [{"fault": "500"}], "f529": [{"fault": "529"}], "f408": [{"fault": "408"}],
    "quota": [{"fault": "quota"}], "bad_request": [{"fault": "bad_request", "message": "bad"}],
    "malformed": [{"fault": "malformed"}], "empty": [{"fault": "empty"}], "f401": [{"fault": "401"}],
}


def llm_request(fmt, model):
    if fmt == "anthropic":
        return ("/v1/messages", {"model": model, "max_tokens": 100, "system": "You help.",
                                 "messages": [{"role": "user", "content": "order 1"}],
                                 "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]},
                {"anthropic-version": "2023-06-01", "x-api-key": "k"})
    if fmt == "responses":
        return ("/v1/responses", {"model": model, "input": "order 1", "instructions": "You help.",
                                  "tools": [{"type": "function", "name": "lookup",
                                             "parameters": {"type": "object"}}]}, {})
    return ("/v1/chat/completions", {"model": model, "messages": [{"role": "system", "content": "You help."},
                                                                  {"role": "user", "content": "order 1"}],
                                     "tools": [{"type": "function", "function": {
                                         "name": "lookup", "parameters": {"type": "object"}}}]}, {})


def seed_llm():
    scripts = os.path.join(CORPUS, "llm-scripts.json")
    with open(scripts, "w") as f:
        json.dump(LLM_SCRIPTS, f)
    srv = Server([sys.executable, os.path.join(ROOT, "test", "servers", "llm_server.py"),
                  "--port", "PORT", "--scripts", scripts, "--no-validate"])
    try:
        for fmt in ("openai", "anthropic", "responses"):
            for model in ["echo"] + list(LLM_SCRIPTS):
                path, body, headers = llm_request(fmt, model)
                status, h, data = fetch(srv.port, "POST", path, body, headers)
                data = re.sub(rb'"(id|created|created_at)": ?("[^"]*"|[0-9]+)', rb'"\1": "fixed"', data)
                write("llm", f"srv-{fmt}-{model}", response(status, keep(h), data))
                if model == "tools":
                    for call in re.findall(rb'"arguments": ?"((?:[^"\\]|\\.)*)"', data):
                        write("json", f"srv-args-{fmt}", json.loads(b'"' + call + b'"'))
    finally:
        srv.close()
        os.unlink(scripts)
    mock = os.path.join(ROOT, "test", "servers", "peers", "node_modules", ".bin", "openai-mock-api")
    if os.path.exists(mock):
        srv = Server([mock, "--config", os.path.join(ROOT, "test", "servers", "openai_mock.yaml"), "--port", "PORT"])
        try:
            for word in ("peer-weather", "peer-hello"):
                status, h, data = fetch(srv.port, "POST", "/v1/chat/completions",
                                        {"model": "m", "messages": [{"role": "system", "content": "s"},
                                                                    {"role": "user", "content": word}]},
                                        {"Authorization": "Bearer peer-test-key"})
                data = re.sub(rb'"(id|created)": ?("[^"]*"|[0-9]+)', rb'"\1": "fixed"', data)
                write("llm", f"srv-openai-mock-{word}", response(status, keep(h), data))
        finally:
            srv.close()
    crafted = {
        "openai-usage-overflow": {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 99999999999, "completion_tokens": -1}},
        "openai-null-content": {"choices": [{"message": {"content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": None, "arguments": {"not": "a string"}}}]}}]},
        "openai-choices-object": {"choices": {"0": 1}},
        "anthropic-blocks": {"content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                         {"type": "redacted_thinking", "data": "d"},
                                         {"type": "text", "text": "a"}, {"type": "tool_use", "id": "t1",
                                                                          "name": "lookup", "input": [1]},
                                         {"type": "image"}, 7], "stop_reason": "tool_use",
                             "usage": {"input_tokens": 3, "output_tokens": 4, "cache_read_input_tokens": 2}},
        "responses-items": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                            "output": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                                        "encrypted_content": "e"},
                                       {"type": "message", "content": [{"type": "output_text", "text": "hi"},
                                                                       {"type": "refusal", "refusal": "no"}]},
                                       {"type": "function_call", "call_id": "c", "name": "lookup",
                                        "arguments": "{}"}, None],
                            "usage": {"input_tokens": 1, "output_tokens": 2,
                                      "input_tokens_details": {"cached_tokens": 1},
                                      "output_tokens_details": {"reasoning_tokens": 1}}},
        "error-object": {"error": {"type": "insufficient_quota", "code": "insufficient_quota",
                                   "message": "You exceeded your current quota, spend limit"}},
    }
    for name, body in crafted.items():
        status = 429 if name.startswith("error") else 200
        write("llm", f"srv-{name}", response(status, [("content-type", "application/json")], json.dumps(body)))


def seed_mcp():
    sys.path.insert(0, os.path.join(ROOT, "test", "python"))
    try:
        import httputil
    except Exception as e:          # conftest needs psycopg2 and pytest
        print(f"seeds: the scripted MCP server is not importable ({e}); skipped", file=sys.stderr)
        httputil = None
    if httputil:
        srv = httputil.ScriptedMcpServer()
        try:
            status, h, data = fetch(srv.port, "POST", "/mcp", {"jsonrpc": "2.0", "id": MCP_ID, "method": "initialize",
                                                               "params": {"protocolVersion": httputil.MCP_VERSION}})
            write("mcp", "srv-scripted-initialize", response(status, keep(h), data))
            sid = dict(h).get("mcp-session-id")
            hdr = {"Mcp-Session-Id": sid, "Accept": "application/json, text/event-stream"}
            status, h, data = fetch(srv.port, "POST", "/mcp", {"jsonrpc": "2.0", "id": MCP_ID,
                                                               "method": "tools/list"}, hdr)
            write("mcp", "srv-scripted-tools-list", response(status, keep(h), data))
            for tool in ("chatty", "plain", "batch", "rpcerror", "eof", "other"):
                status, h, data = fetch(srv.port, "POST", "/mcp", {
                    "jsonrpc": "2.0", "id": MCP_ID, "method": "tools/call",
                    "params": {"name": tool, "arguments": {"say": "hi"}}}, hdr)
                write("mcp", f"srv-scripted-{tool}", response(status, keep(h), data))
            status, h, data = fetch(srv.port, "POST", "/mcp", {"jsonrpc": "2.0", "id": MCP_ID,
                                                               "method": "tools/list"}, {"Mcp-Session-Id": "gone"})
            write("mcp", "srv-scripted-lost-session", response(status, keep(h), data))
        finally:
            srv.close()
    everything = os.path.join(ROOT, "test", "servers", "mcp", "node_modules", ".bin", "mcp-server-everything")
    if os.path.exists(everything):
        srv = Server([everything, "streamableHttp"])
        try:
            acc = {"Accept": "application/json, text/event-stream"}
            status, h, data = fetch(srv.port, "POST", "/mcp", {
                "jsonrpc": "2.0", "id": MCP_ID, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                           "clientInfo": {"name": "seeds", "version": "1"}}}, acc)
            write("mcp", "srv-everything-initialize", response(status, keep(h), data))
            acc["Mcp-Session-Id"] = dict(h).get("mcp-session-id", "")
            fetch(srv.port, "POST", "/mcp", {"jsonrpc": "2.0", "method": "notifications/initialized"}, acc)
            for method, params in [("tools/list", {}), ("tools/call", {"name": "echo", "arguments": {"message": "hi"}}),
                                   ("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}})]:
                status, h, data = fetch(srv.port, "POST", "/mcp", {"jsonrpc": "2.0", "id": MCP_ID,
                                                                   "method": method, "params": params}, acc)
                write("mcp", f"srv-everything-{method.replace('/', '-')}-{params.get('name', '')}",
                      response(status, keep(h), data))
                if method == "tools/list":
                    for m in re.finditer(rb"^data: (.*)$", data, re.M):
                        for tool in json.loads(m.group(1)).get("result", {}).get("tools", [])[:20]:
                            s = tool.get("inputSchema")
                            if isinstance(s, dict):
                                write("schema", f"srv-everything-{tool['name']}",
                                      json.dumps(s).encode() + b"\0" + json.dumps(instance_of(s)).encode())
        finally:
            srv.close()
    ok = json.dumps({"jsonrpc": "2.0", "id": MCP_ID, "result": {"content": [{"type": "text", "text": "hi"}]}})
    sse = [("sse-lf", "event: message\ndata: " + ok + "\n\n"),
           ("sse-cr-only", "data: " + ok + "\r\r"),
           ("sse-numeric-id", 'data: {"jsonrpc": "2.0", "id": 1, "result": {}}\n\n'),
           ("sse-id-01", 'data: {"jsonrpc": "2.0", "id": 1.0e0, "result": {}}\n\n'),
           ("sse-split", "data: {\"jsonrpc\": \"2.0\",\ndata: \"id\": \"1\", \"result\": {}}\n\n"),
           ("sse-comments", ": hi\n\nretry: 10\nid: 3\nevent: ping\n\n" + "data:" + ok),
           ("sse-error", 'data: {"jsonrpc": "2.0", "id": "1", "error": {"code": "x", "message": 5}}\n\n'),
           ("sse-no-answer", 'data: {"jsonrpc": "2.0", "method": "notifications/progress"}\n\n'),
           ("sse-empty-data", "data:\n\ndata: \n\n"),
           ("sse-tools", "data: " + json.dumps({"jsonrpc": "2.0", "id": "1", "result": {"tools": [
               {"name": "t", "inputSchema": {"type": "object", "required": ["a"], "properties": {
                   "a": {"type": "array", "items": {"enum": [1]}}}}}, {"name": 3}, "x"]}}) + "\n\n")]
    for name, body in sse:
        write("mcp", f"srv-{name}", response(200, [("content-type", "text/event-stream")], body))
    write("mcp", "srv-batch", response(200, [("content-type", "application/json")],
                                       json.dumps([{"jsonrpc": "2.0", "method": "x"}, json.loads(ok)])))
    write("mcp", "srv-json-no-ctype", response(200, [], ok))


# ---------------------------------------------------------------------------
# Hostile inputs

def hostile_json(big):
    """JSON a parser chokes on; big: at full size (the json target), else
    smaller versions of the deep and long ones (deep arrays stay deep)."""
    depth, digits, length, keys = (30_000, 150_000, 150_000, 8_000) if big else (3_000, 5_000, 10_000, 500)
    return {
        "deep-array": b"[" * 100_000,
        "deep-object": b'{"a":' * depth + b"1" + b"}" * depth,
        "huge-exponent": b'{"n": 1e1000000}',
        "huge-negative-exponent": b'{"n": 1e-1000000}',
        "huge-integer": b'{"n": ' + b"9" * digits + b"}",
        "lone-surrogate": b'{"s": "\\ud800"}',
        "escaped-nul": b'{"s": "a\\u0000b"}',
        "invalid-utf8": b'{"s": "\xff\xfe\xc0\xaf\xe2\x82"}',
        "nul-byte": b'{"s": "a\x00b"}',
        "bom": b"\xef\xbb\xbf{}",
        "long-string": b'{"s": "' + b"x" * length + b'"}',
        "many-keys": b"{" + b",".join(b'"k%d": %d' % (i, i) for i in range(keys)) + b"}",
        "duplicate-keys": b'{"a": 1, "a": {"a": [1, {"a": null}]}}',
    }


def seed_hostile():
    for name, data in hostile_json(True).items():
        write("json", f"hostile-{name}", data)
    for name, small in hostile_json(False).items():
        write("json", f"hostile-fenced-{name}", b"```json\n" + small + b"\n```")
        ctype = [("content-type", "application/json")]
        write("apicall", f"hostile-{name}", response(200, ctype, small))
        write("llm", f"hostile-{name}", response(200, ctype, small))
        write("mcp", f"hostile-{name}", response(200, ctype, small))
        write("mcp", f"hostile-sse-{name}", response(200, [("content-type", "text/event-stream")],
                                                      b"data: " + small + b"\n\n"))
        write("template", f"hostile-context-{name}", b"{{ s }} {{ n }} {{ a }}\0" + small)
        write("schema", f"hostile-instance-{name}", b'{"type": "object"}\0' + small)
        write("schema", f"hostile-schema-{name}", small + b"\0{}")
    for name, inner in [("huge-exponent", b"1e1000000"), ("deep", b"[" * 50_000 + b"]" * 50_000),
                        ("huge-tokens", b"99999999999999999999")]:
        write("llm", f"hostile-openai-args-{name}", response(200, [("content-type", "application/json")],
              b'{"choices": [{"message": {"tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '
              + json.dumps(inner.decode()).encode() + b'}}]}, "finish_reason": "tool_calls"}], '
              b'"usage": {"prompt_tokens": ' + (inner if name == "huge-tokens" else b"1") + b"}}"))
        write("llm", f"hostile-anthropic-{name}", response(200, [("content-type", "application/json")],
              b'{"content": [{"type": "tool_use", "id": "t", "name": "f", "input": ' + inner + b'}], '
              b'"usage": {"input_tokens": ' + (inner if name == "huge-tokens" else b"1") + b"}}"))
        write("llm", f"hostile-answer-{name}", response(200, [("content-type", "application/json")],
              b'{"choices": [{"message": {"content": ' + json.dumps("```json\n" + inner.decode() + "\n```").encode()
              + b'}}]}'))
    write("apicall", "hostile-header-utf8", b"200\nx-bad: \xff\xfe\xc0\nx-\xe9: v\ncontent-type: application/json\n\n{}")
    write("apicall", "hostile-body-utf8", response(200, [("content-type", "text/plain")], b"\xff\xfe\xfd"))
    write("apicall", "hostile-body-nul", response(200, [("content-type", "application/json")], b'{"a":\x00 1}'))
    write("mcp", "hostile-sse-utf8", response(200, [("content-type", "text/event-stream")], b"data: \xff\n\n"))
    write("mcp", "hostile-sse-no-newline", response(200, [("content-type", "text/event-stream")],
          b"data: " + b"[" * 10_000))
    yaml_bad = {
        "deep-flow": b"[" * 100_000,
        "deep-block": "".join("  " * i + "a:\n" for i in range(150)).encode() + b"  " * 150 + b"b: 1\n",
        "deep-seq": b"x: " + b"- " * 200 + b"1\n",
        "laughs": b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
            b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n" % ((98 + i, 98 + i) + (97 + i,) * 9)
            for i in range(8)),
        "self-alias": b"a: &a [*a]\n",
        "unknown-alias": b"a: *nothing\n",
        "tags": b"a: !!binary aGk=\nb: !!float .inf\nc: !!python/object:os.system x\nd: !custom 1\ne: !!int 0x1F\n",
        "numbers": b"a: 1e1000000\nb: 0x" + b"f" * 64 + b"\nc: 0o777777777777777777777777\nd: .NaN\ne: -.inf\nf: 1_000\n",
        "multi-doc": b"name: a\n---\nname: b\n",
        "duplicate-keys": b"name: a\nname: b\nsteps: []\n",
        "merge-keys": b"base: &b {kind: Router}\nsteps:\n  - <<: *b\n    id: s\n",
        "complex-key": b"? [a, b]\n: 1\n{x: 1}: 2\n",
        "tabs": b"name:\ta\nsteps:\n\t- id: s\n",
        "invalid-utf8": b"name: \xff\xfe\nsteps: []\n",
        "nul": b"name: a\x00b\nsteps: []\n",
        "bom": b"\xef\xbb\xbfname: a\n",
        "many-nodes": b"a: [" + b",".join(b"0" for _ in range(60_000)) + b"]\n",
        "long-key": b"k" * 150_000 + b": 1\n",
        "empty": b"",
        "only-comment": b"# nothing\n",
        "scalar-root": b"just a string\n",
        "null-root": b"~\n",
        "anchors-everywhere": b"&r name: &n wf\nsteps: &s\n"
                              b"  - &x {id: a, kind: Router, on: &o x, routes: {default: *o}}\n"
                              b"ends: [{id: x, status: completed}]\n",
    }
    for name, data in yaml_bad.items():
        write("yaml", f"hostile-{name}", data)
        write("validate", f"hostile-{name}", data)
    wf = (b"name: w\nsteps:\n" + b"".join(b"  - { id: s%d, kind: Router, on: \"{{ x }}\", routes: { default: s%d } }\n"
                                          % (i, i + 1) for i in range(300))
          + b"  - { id: s300, kind: Router, on: x, routes: { default: done } }\nends:\n  - { id: done, status: completed }\n")
    write("validate", "hostile-many-steps", wf)
    write("validate", "hostile-route-cycle",
          b"name: w\nsteps:\n  - { id: a, kind: Router, on: x, routes: { default: b } }\n"
          b"  - { id: b, kind: Router, on: x, routes: { default: a } }\nends: []\n")
    write("validate", "hostile-wrong-types",
          b"name: [1]\ntrigger: 5\nsteps: {a: 1}\nends: x\nhooks: [1, null, {}]\nguardrails: 3\n")
    # a pattern the regex engine would reserve gigabytes for before calling
    # it too complex (found by fuzzing validate): refused by its length
    long_pattern = "^(web|" + "k" * 113_000 + "mail)$"
    write("validate", "hostile-long-pattern",
          "name: w\ntrigger:\n  input:\n    type: object\n    properties:\n"
          f"      channel: {{ anyOf: [{{ type: string, pattern: '{long_pattern}' }}] }}\n"
          "steps:\n  - { id: a, kind: Functional, function: pg_catalog.jsonb_strip_nulls }\n")
    write("schema", "hostile-long-pattern",
          json.dumps({"type": "object", "properties": {"s": {"type": "string", "pattern": long_pattern}}})
          + '\0{"s": "webmail"}')
    write("validate", "hostile-durations",
          b"name: w\ntrigger: {sync_timeout: 99999999999999999h}\nsteps:\n"
          b"  - { id: s, kind: Sleep, for: -1s, timeout: 1e9d, routes: { default: done } }\n"
          b"ends:\n  - { id: done, status: completed }\n")


def merge_control(path, kept_dir, new_dir):
    """libFuzzer's merge control file: the number of files, the number in
    the first (kept) corpus, then their paths, the kept ones first."""
    kept = sorted(glob.glob(os.path.join(kept_dir, "*")))
    new = sorted(glob.glob(os.path.join(new_dir, "*")), key=lambda f: (os.path.getsize(f), f))
    with open(path, "w") as f:
        f.write(f"{len(kept) + len(new)}\n{len(kept)}\n")
        f.write("".join(p + "\n" for p in kept + new))


def merge_select(path):
    """The new files to keep: smallest first, each reaching an edge of the
    code (libFuzzer's COV records; its merge counts finer features, which
    would keep most files) that neither the kept corpus nor a file kept
    before it reaches."""
    lines = open(path).read().split("\n")
    n, nkept = int(lines[0]), int(lines[1])
    files = lines[2:2 + n]
    features = {}
    for line in lines[2 + n:]:
        if line.startswith("COV "):
            parts = line.split()
            features[int(parts[1])] = set(parts[2:])
    seen = set()
    for i in range(nkept):
        seen |= features.get(i, set())
    for i in range(nkept, n):
        new = features.get(i, set()) - seen
        if new:
            seen |= new
            print(files[i])


def main():
    global CORPUS
    if len(sys.argv) == 5 and sys.argv[1] == "--control":
        return merge_control(*sys.argv[2:])
    if len(sys.argv) == 3 and sys.argv[1] == "--select":
        return merge_select(sys.argv[2])
    if len(sys.argv) != 2:
        sys.exit("usage: seeds.py DIR | --control FILE KEPT_DIR NEW_DIR | --select FILE")
    CORPUS = sys.argv[1]
    for t in TARGETS:
        os.makedirs(os.path.join(CORPUS, t), exist_ok=True)
    sources = yaml_sources()
    seed_yaml(sources)
    docs = [d for d in (parse(s) for _, s in sources) if isinstance(d, (dict, list))]
    seed_templates(docs)
    seed_schemas(docs)
    for _, s in sources:
        doc = parse(s)
        if isinstance(doc, dict):
            for v in walk(doc):
                if isinstance(v, dict) and ("response" in v or "params" in v):
                    write("json", "doc-value", json.dumps(v, ensure_ascii=False))
    seed_http()
    seed_llm()
    seed_mcp()
    seed_hostile()
    print(" ".join(f"{t}: {len(os.listdir(os.path.join(CORPUS, t)))}" for t in TARGETS))


if __name__ == "__main__":
    main()
