-- Registering and validating workflows.
\set VERBOSITY default

-- The model the agent cases name (validation warns about an unregistered one).
SELECT tuvl.register_llm($$
name: m
provider: openai
base_url: http://127.0.0.1:9/v1
model: test
$$);

-- A clean workflow validates with no rows and registers as version 1, 2, ...
SELECT * FROM tuvl.validate($$
name: greet
steps:
  - id: hello
    kind: Router
    on: "{{ who }}"
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "hello {{ who }}" }
$$);
SELECT tuvl.register_workflow($$
name: greet
steps:
  - id: hello
    kind: Router
    on: "{{ who }}"
    routes: { default: done }
ends:
  - { id: done, status: completed, response: "hello {{ who }}" }
$$) AS version;
SELECT tuvl.register_workflow(source) AS version FROM tuvl.workflows WHERE name = 'greet';
SELECT name, version, definition->'steps'->0->>'kind' AS kind FROM tuvl.workflows ORDER BY version;

-- Bad YAML: the error names line and column.
SELECT tuvl.register_workflow($$
name: broken
steps:
  - id: a
    kind: [Router
$$);
SELECT * FROM tuvl.validate($$
name: broken
steps: [ { id: a
$$);

-- Every structural problem is reported at once, with its path and line.
SELECT * FROM tuvl.validate($$
name: Bad-Name
start: nowhere
steps:
  - id: a
    kind: Magic
  - id: a
    kind: Router
    on: "{{ x }}"
    routes: { paid: refund, default: done }
  - kind: Functional
  - id: c
    kind: ModelOp
    params: 3
    compensate: ghost
ends:
  - { id: done, status: finished }
$$) ORDER BY path, message;

-- register_workflow refuses errors and lists them all in the detail.
SELECT tuvl.register_workflow($$
name: two_errors
steps:
  - id: a
    kind: Functional
    routes: { default: missing }
$$);

-- Warnings (an unreachable step) become NOTICEs; the workflow is stored.
SELECT tuvl.register_workflow($$
name: with_warning
steps:
  - id: a
    kind: Functional
    function: pg_catalog.jsonb_strip_nulls
    routes: { default: done }
  - id: b
    kind: Functional
    function: pg_catalog.jsonb_strip_nulls
ends:
  - { id: done }
$$) AS version;

-- An unknown key is an error: a key tuvl accepts does something.
SELECT tuvl.register_workflow($$
name: with_unknown_key
steps:
  - id: a
    kind: Functional
    function: pg_catalog.jsonb_strip_nulls
    colour: blue
$$) AS version;

-- Not a mapping, empty input, missing steps, bad trigger schema.
SELECT * FROM tuvl.validate('- a list');
SELECT * FROM tuvl.validate('');
SELECT * FROM tuvl.validate('name: x');
SELECT * FROM tuvl.validate($$
name: schema_typo
trigger:
  input: { type: object, require: [a], properties: { a: { type: integr } } }
  sync_timeout: soon
steps:
  - { id: a, kind: Router, on: "{{ a }}", routes: { default: a } }
$$) ORDER BY path;

-- YAML subtleties: the key "on" stays a string key, yes/no stay strings.
SELECT definition->'steps'->0 FROM tuvl.workflows WHERE name = 'greet' AND version = 1;

-- APICall, MCP and Agent blocks are checked too.
SELECT * FROM tuvl.validate($$
name: effects
steps:
  - id: call
    kind: APICall
    http:
      method: FETCH
      url: "http://127.0.0.1/x"
      query: [a]
      idempotency: always
      retry: { on: [timeout, 404], attempts: 0, backoff: soon }
  - id: get_with_body
    kind: APICall
    http: { method: GET, url: "http://127.0.0.1/y", body: { a: 1 } }
  - id: tool
    kind: MCP
    mcp: { url: "http://127.0.0.1/mcp", tool: echo, arguments: [1], timeout: never }
  - id: think
    kind: Agent
    mode: completion
    agent:
      prompt: hi
      outcome: { enum: [yes, error, maybe], write: "" }
    routes: { yes: call }
  - id: comp
    kind: Agent
    mode: compl
    agent: { model: default }
$$) ORDER BY path, message;
