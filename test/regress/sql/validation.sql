-- The static checks of tuvl.validate(), one minimal workflow per check.
--
-- Each case triggers exactly one finding, so its expected output is that
-- one row; docs/validation.md lists the same checks with their fixes.
-- Cases that workflow.sql already tests on their own (YAML syntax errors,
-- empty input, a document that is not a mapping, missing "steps") are not
-- repeated here; checks with several sites (unknown keys, durations, retry)
-- are tested at sites workflow.sql does not cover.
--
-- Reachability warnings are computed only for a workflow without errors,
-- and an autonomous agent warns about reserved exits without a route, so
-- the autonomous cases route max_iterations and aborted to keep to one row.
\set VERBOSITY default

-- The model the agent cases name (validation warns about an unregistered one).
SELECT tuvl.register_llm($$
name: m
provider: openai
base_url: http://127.0.0.1:9/v1
model: test
$$);

-- A clean workflow has no findings.
SELECT * FROM tuvl.validate($$
name: clean
steps:
  - { id: a, kind: Functional, function: f }
$$);

--
-- Structure: the document, its name, trigger, steps and ends.
--

-- "name" is required.
SELECT * FROM tuvl.validate($$
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- A workflow name is [a-z_][a-z0-9_]*.
SELECT * FROM tuvl.validate($$
name: Refund-Request
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- "description" is a string.
SELECT * FROM tuvl.validate($$
name: v
description: [refunds]
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- An unknown top-level key is a warning.
SELECT * FROM tuvl.validate($$
name: v
descripton: Refund a paid order
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- "start" names a step.
SELECT * FROM tuvl.validate($$
name: v
start: load
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- "trigger" is a mapping.
SELECT * FROM tuvl.validate($$
name: v
trigger: manual
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- An unknown key in "trigger" is a warning.
SELECT * FROM tuvl.validate($$
name: v
trigger:
  inputs: { type: object }
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- "trigger.input" is a schema of the supported subset.
SELECT * FROM tuvl.validate($$
name: v
trigger:
  input: { type: object, required: order_id }
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- "trigger.schedule" is a cron expression string.
SELECT * FROM tuvl.validate($$
name: v
trigger:
  schedule: { every: 5m }
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- "steps" is a non-empty list.
SELECT * FROM tuvl.validate($$
name: v
steps: []
$$);

-- A step is a mapping.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - load_order
$$);

-- A step needs an id ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { kind: Functional, function: f }
$$);

-- ... that is a non-empty string ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: 7, kind: Functional, function: f }
$$);

-- ... starting with a letter or _, then letters, digits, _ and - ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: 1st, kind: Functional, function: f }
$$);

-- ... and unique.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
  - { id: a, kind: Functional, function: g }
$$);

-- A step needs a kind ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, function: f }
$$);

-- ... that is one of the seven kinds.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Funtional, function: f }
$$);

-- "output" names a context key.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, output: [order] }
$$);

-- "compensate" names a step.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, compensate: undo }
$$);

-- "ends" is a list.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  done: completed
$$);

-- An end is a mapping ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  - done
$$);

-- ... with an id ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  - { status: completed }
$$);

-- ... not used by a step or another end ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  - { id: a }
$$);

-- ... a status of completed or failed ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  - { id: done, status: success }
$$);

-- ... a boolean rollback (yes is a string in YAML 1.2) ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  - { id: done, rollback: yes }
$$);

-- ... and no unknown keys (a warning).
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f }
ends:
  - { id: done, respones: ok }
$$);

--
-- Routes.
--

-- "routes" is a mapping ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, routes: done }
ends:
  - { id: done }
$$);

-- ... whose targets are strings ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, routes: { default: [done] } }
ends:
  - { id: done }
$$);

-- ... naming a step or an end.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, routes: { default: finish } }
ends:
  - { id: done }
$$);

--
-- Steps, by kind.
--

-- Functional: "function" is required.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional }
$$);

-- ModelOp: "sql" is required ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: ModelOp, params: [1] }
$$);

-- ... and "params" is a list.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: ModelOp, sql: "SELECT $1", params: "{{ order_id }}" }
$$);

-- Router: "on" is required ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Router, routes: { default: done } }
ends:
  - { id: done }
$$);

-- ... and so are "routes".
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Router, on: "{{ status }}" }
$$);

-- APICall: an "http" mapping is required ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall }
$$);

-- ... with a url.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { method: POST } }
$$);

-- An unknown key in "http" is a warning.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", header: { A: b } } }
$$);

-- The method is one of the HTTP methods.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", method: FETCH } }
$$);

-- A GET or HEAD request has no body.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", method: GET, body: { a: 1 } } }
$$);

-- "headers" is a mapping.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", headers: ["Accept: text/plain"] } }
$$);

-- "query" is a mapping.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", query: "q=1" } }
$$);

-- "idempotency" is auto or none.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", idempotency: always } }
$$);

-- "timeout" is a duration.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", timeout: forever } }
$$);

-- "retry" is a mapping ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", retry: 3 } }
$$);

-- ... whose "on" is a list ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", retry: { on: timeout } } }
$$);

-- ... of known conditions, with positive "attempts" and a duration "backoff".
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", retry: { on: [500] } } }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", retry: { attempts: 0 } } }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: APICall, http: { url: "http://127.0.0.1/x", retry: { backoff: soon } } }
$$);

-- MCP: an "mcp" mapping is required ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: MCP }
$$);

-- ... with a url and a tool ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: MCP, mcp: { url: "http://127.0.0.1/mcp" } }
$$);

-- ... whose "arguments" are a mapping or one template.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: MCP, mcp: { url: "http://127.0.0.1/mcp", tool: search, arguments: [refunds] } }
$$);

-- Agent: "mode" is required ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, agent: { model: m, prompt: hi } }
$$);

-- ... and is completion or autonomous ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: chat, agent: { model: m, prompt: hi } }
$$);

-- ... and "agent" is a mapping.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: gpt-4o-mini }
$$);

-- Human: "form" is required ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Human }
$$);

-- ... and is a schema of the supported subset.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: a
    kind: Human
    form: { type: object, properties: { ok: { type: bool } } }
$$);

--
-- Agents: completion mode.
--

-- agent.model is required.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { prompt: hi } }
$$);

-- A completion agent needs agent.prompt.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: Be brief. } }
$$);

-- An unknown key in "agent" is a warning.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, temperature: 0 } }
$$);

-- Removed contracts name their replacement.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, output: summary } }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, steering_files: [tone.md] } }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: { output_key: answer } } }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: { signal_from: decision } } }
$$);

-- A step-level "output" is ignored on an Agent step (a warning).
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi }, output: summary }
$$);

-- Tools are ignored by a completion agent (a warning).
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, tools: [{ ref: lookup }] } }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
$$);

-- agent.retry takes the conditions timeout and error.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, retry: { on: [429] } } }
$$);

-- agent.outcome is a mapping ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: [approve, reject] } }
$$);

-- ... whose "write" names a context key ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: { write: "" } } }
$$);

-- ... whose "enum" is a list ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: { enum: approve } } }
$$);

-- ... of strings ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: { enum: [1] } } }
$$);

-- ... that are not reserved exits ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, outcome: { enum: [aborted] } } }
$$);

-- ... and each have a route.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: a
    kind: Agent
    mode: completion
    agent: { model: m, prompt: hi, outcome: { enum: [approve, reject] } }
    routes: { approve: done }
ends:
  - { id: done }
$$);

-- context_injection is a list ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi }, context_injection: order }
$$);

-- ... of non-empty strings ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi }, context_injection: [""] }
$$);

-- ... that are not private keys.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi }, context_injection: [_token] }
$$);

--
-- Agents: autonomous mode.  Every case starts from this clean agent.
--
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- "system" is a completion-mode field.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      system: You are a support agent.
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- "prompt" is a completion-mode field.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      prompt: "Answer: {{ question }}"
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- Without agent.steering the model has no instructions (a warning).
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- agent.steering is text or an artifact:// reference.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: [Answer questions about orders.]
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- An autonomous agent needs tools ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
    routes: { max_iterations: done, aborted: done }
ends:
  - { id: done }
$$);

-- ... as a list ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: lookup
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... of mappings ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [lookup]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... with a ref ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ description: Look up an order }]
    routes: { max_iterations: done, aborted: done }
ends:
  - { id: done }
$$);

-- ... that is not the agent itself ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: agent }]
    routes: { max_iterations: done, aborted: done }
ends:
  - { id: done }
$$);

-- ... but a step of this workflow ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup_order }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... that is not an Agent or Human step ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: summarize }]
    routes: { max_iterations: done, aborted: done }
  - { id: summarize, kind: Agent, mode: completion, description: Summarize, agent: { model: m, prompt: hi } }
ends:
  - { id: done }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: ask }]
    routes: { max_iterations: done, aborted: done }
  - { id: ask, kind: Human, description: Ask a person, form: { type: object } }
ends:
  - { id: done }
$$);

-- ... with a description, on the step or on the tool entry ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f }
ends:
  - { id: done }
$$);

-- ... mapping "parameters" ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup, parameters: [order_id] }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... a boolean "writes_context" ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup, writes_context: yes }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... a boolean "approval" ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup, approval: always }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... and no unknown keys (a warning).
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup, approve: true }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- max_iterations and token_budget are positive integers.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
      max_iterations: 0
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
      token_budget: 1.5
    routes: { max_iterations: done, budget_exceeded: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- Reserved exits without a route are warnings: max_iterations ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
    routes: { aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... budget_exceeded, when there is a token_budget ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
      token_budget: 20000
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... and aborted; without routes at all the path has no line and column.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
    routes: { max_iterations: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: Answer questions about orders.
      tools: [{ ref: lookup }]
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
$$) ORDER BY message DESC;

--
-- Guardrails, hooks and artifact references.  The artifacts exist only in
-- this transaction.
--
BEGIN;
SELECT tuvl.register_artifact($$
name: tone
type: steering
body: Be brief.
$$) AS version;
SELECT tuvl.register_artifact($$
name: tone
type: steering
body: Be brief and polite.
$$) AS version;
SELECT tuvl.register_artifact($$
name: ask
type: prompt
body: "Summarize {{ order }}"
$$) AS version;
SELECT tuvl.register_artifact($$
name: refunds
type: skill
body: Refunds above 500 need a manager.
$$) AS version;
SELECT tuvl.register_artifact($$
name: no_pii
type: guardrail
checks:
  - { check: regex_deny, pattern: '\y[0-9]{16}\y' }
$$) AS version;
SELECT tuvl.register_artifact($$
name: audit
type: hook
events: [before_step, after_step]
action: metric
$$) AS version;

-- Every site with a pinned reference of a type it takes: no findings.
-- agent.system takes a prompt artifact as well as a steering one; a step
-- named only as a tool or as a compensator is reachable.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: artifact://tone@2
      skills: [artifact://refunds@1, Never promise a date.]
      guardrails: { input: [artifact://no_pii@1], output: [artifact://no_pii@1], tools: [artifact://no_pii@1] }
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done, guardrail_violation: done }
  - id: summarize
    kind: Agent
    mode: completion
    agent: { model: m, system: artifact://ask@1, prompt: artifact://ask@1 }
    compensate: undo
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
  - { id: undo, kind: Functional, function: g }
ends:
  - { id: done }
$$);

-- A malformed reference.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: "artifact://tone@latest", prompt: hi } }
$$);

-- An artifact that does not exist.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: "artifact://tonne@1", prompt: hi } }
$$);

-- A version that does not exist.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: "artifact://tone@3", prompt: hi } }
$$);

-- The wrong type for the site: agent.steering (and agent.system) ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: artifact://refunds@1
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- ... agent.prompt ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: "artifact://tone@1" } }
$$);

-- ... agent.skills ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, skills: ["artifact://tone@1"] } }
$$);

-- ... a guardrail gate ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, guardrails: { input: ["artifact://refunds@1"] } } }
$$);

-- ... and hooks.
SELECT * FROM tuvl.validate($$
name: v
hooks: [artifact://no_pii@1]
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- A floating reference is a warning naming the version it resolves to now ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: "artifact://tone", prompt: hi } }
$$);

-- ... and an error with strict => true.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: "artifact://tone", prompt: hi } }
$$, strict => true);

-- agent.skills is a list ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, skills: "artifact://refunds@1" } }
$$);

-- ... of texts or references.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, skills: [{ name: refunds }] } }
$$);

-- Guardrails are a mapping of gates ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, guardrails: ["artifact://no_pii@1"] } }
$$);

-- ... named input, output or tools ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, guardrails: { inputs: ["artifact://no_pii@1"] } } }
$$);

-- ... where tools needs mode: autonomous ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, guardrails: { tools: ["artifact://no_pii@1"] } } }
$$);

-- ... each gate a list ...
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi, guardrails: { output: "artifact://no_pii@1" } } }
$$);

-- ... of references only; step-level guardrails are checked the same way.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, prompt: hi }, guardrails: { output: [no card numbers] } }
$$);

-- An autonomous agent with guardrails and no guardrail_violation route (a warning).
SELECT * FROM tuvl.validate($$
name: v
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      steering: artifact://tone@2
      guardrails: { output: [artifact://no_pii@1] }
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f, description: Look up an order }
ends:
  - { id: done }
$$);

-- An empty supervisor is an error.  The hooks, the concurrency and trigger.http here
-- are fine.
SELECT * FROM tuvl.validate($$
name: v
hooks: [artifact://audit@1]
supervisor: { rules: [] }
concurrency: { key: x, limit: 1 }
trigger: { http: { path: /orders } }
steps:
  - { id: a, kind: Functional, function: f, hooks: [artifact://audit@1] }
$$);

-- trigger.http: a route under /hooks, POST or PUT, a sync timeout, a signature's secret.
SELECT * FROM tuvl.validate($$
name: v
trigger: { http: { path: orders/, method: GET, sync_timeout: soon, signature: { header: "X Sig" }, cors: true } }
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- An unknown key is an error naming its path, at the top level too.
SELECT * FROM tuvl.validate($$
name: v
steps_end: done
steps:
  - { id: a, kind: Functional, function: f }
$$);

-- register_workflow() is never strict: a floating reference is a NOTICE,
-- and the workflow is stored.
SELECT tuvl.register_workflow($$
name: validation_notices
steps:
  - { id: a, kind: Agent, mode: completion, agent: { model: m, system: "artifact://tone", prompt: hi } }
$$) AS version;
ROLLBACK;

--
-- Reachability, computed only when there are no errors.
--

-- A step nothing leads to is a warning.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, routes: { default: done } }
  - { id: b, kind: Functional, function: g }
ends:
  - { id: done }
$$);

-- With an error in the workflow, reachability is not checked.
SELECT * FROM tuvl.validate($$
name: v
steps:
  - { id: a, kind: Functional, function: f, routes: { default: done } }
  - { id: b, kind: Functional }
ends:
  - { id: done }
$$);

--
-- register_workflow() runs the same checks.
--

-- Errors refuse the workflow; the detail lists every error, and only errors
-- (not the warning that agent.steering is missing).
SELECT tuvl.register_workflow($$
name: validation_errors
steps:
  - id: agent
    kind: Agent
    mode: autonomous
    agent:
      model: m
      system: You are a support agent.
      tools: [{ ref: lookup }]
    routes: { max_iterations: done, aborted: done }
  - { id: lookup, kind: Functional, function: f }
ends:
  - { id: done, status: ok }
$$);

-- Warnings become NOTICEs and the workflow is stored; the unreachable step
-- is found because there are no errors.
SELECT tuvl.register_workflow($$
name: validation_warnings
steps:
  - { id: a, kind: Functional, function: f, routes: { default: done } }
  - { id: b, kind: Functional, function: g }
ends:
  - { id: done }
$$) AS version;

-- An agent.model that no tuvl.register_llm() call gave: a warning, as the
-- model may be registered before a run reaches the step.
SELECT * FROM tuvl.validate($$
name: unregistered_model
steps:
  - id: a
    kind: Agent
    mode: completion
    agent: { model: nobody_registered_this, prompt: hi }
$$);

-- A tool whose step declares compensate: a tool call is never compensated.
SELECT * FROM tuvl.validate($$
name: compensated_tool
steps:
  - id: a
    kind: Agent
    mode: autonomous
    agent: { model: m, steering: s, tools: [{ ref: t }] }
    routes: { max_iterations: e, aborted: e }
  - { id: t, kind: Functional, function: f, description: T, compensate: u }
  - { id: u, kind: Functional, function: g }
ends: [{ id: e }]
$$);

-- Guardrail and hook artifacts are checked when they are registered (each
-- statement on its own: every one fails).
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
body: No card numbers.
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: []
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: regex_deny, pattern: '([0-9]' }]
$$);
-- a pattern longer than 8192 bytes is refused before it is compiled
SELECT tuvl.register_artifact('name: bad_guard
type: guardrail
checks: [{ check: regex_deny, pattern: ''(card|' || repeat('k', 8190) || ')'' }]');
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: regex_deny }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: max_length, max: 0 }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: json_schema, schema: { type: objekt } }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: regex_allow, pattern: x, flags: i }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: spell_check }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: pii_mask }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: pii_mask, patterns: [email, ssn] }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: pii_mask, fields: [], patterns: [email] }]
$$);
SELECT tuvl.register_artifact($$
name: bad_guard
type: guardrail
checks: [{ check: llm_judge, model: judge, prompt: "" }]
$$);
SELECT tuvl.register_artifact($$
name: bad_hook
type: hook
events: [before_lunch]
action: metric
$$);
SELECT tuvl.register_artifact($$
name: bad_hook
type: hook
events: [after_step]
action: notify
$$);
SELECT tuvl.register_artifact($$
name: bad_hook
type: hook
events: [after_step]
action: email
$$);

-- JSON Schema: pattern, const, anyOf, minItems/maxItems and $ref to $defs.
SELECT * FROM tuvl.validate($$
name: schema_checks
trigger:
  input:
    type: object
    properties:
      code: { type: string, pattern: '(' }
      tags: { type: array, minItems: -1, maxItems: 2.5 }
      kind: { anyOf: [] }
      item: { $ref: "#/$defs/missing" }
steps:
  - { id: a, kind: Functional, function: pg_catalog.jsonb_strip_nulls }
$$);
-- 8192 bytes is the longest pattern; the regex engine never sees a longer one
SELECT severity, path, left(message, 40), right(message, 40) FROM tuvl.validate(format($$
name: long_patterns
trigger:
  input:
    type: object
    properties:
      fits: { type: string, pattern: '%s' }
      long: { type: string, pattern: '%s' }
steps:
  - { id: a, kind: Functional, function: pg_catalog.jsonb_strip_nulls }
$$, '^(web|' || repeat('k', 8184) || ')$', '^(web|' || repeat('k', 113000) || ')$'));
SELECT tuvl.register_workflow($$
name: schema_runs
trigger:
  input:
    type: object
    $defs:
      item: { type: object, required: [sku], properties: { sku: { type: string, pattern: '^[A-Z]{3}-[0-9]+$' } } }
    properties:
      version: { const: 2 }
      items: { type: array, minItems: 1, maxItems: 3, items: { $ref: "#/$defs/item" } }
      channel: { anyOf: [{ type: string, pattern: '^(web|mail)$' }, { type: integer, minimum: 1 }] }
steps:
  - { id: a, kind: Functional, function: pg_catalog.jsonb_strip_nulls }
$$) AS version;
SELECT tuvl.start_run('schema_runs', '{"version": 1}');
SELECT tuvl.start_run('schema_runs', '{"items": []}');
SELECT tuvl.start_run('schema_runs', '{"items": [{"sku": "ABC-1"}, {"sku": "abc"}]}');
SELECT tuvl.start_run('schema_runs', '{"channel": "phone"}');
SELECT tuvl.start_run('schema_runs', '{"channel": 0}');
