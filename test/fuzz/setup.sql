-- test/fuzz/setup.sql: the fuzzing database, made once per build by
-- run.sh in "postgres --single -j" (a statement ends with ";" and an
-- empty line).  The extension, the harness's entry point, and what the
-- docs' workflows refer to (a model config named "default", artifacts),
-- so that validating them takes the paths that find what they name.

CREATE EXTENSION tuvl CASCADE;

CREATE FUNCTION public.tuvl_fuzz(args text[]) RETURNS integer
    LANGUAGE C STRICT AS '$libdir/tuvl', 'tuvl_fuzz';

SELECT tuvl.register_llm($$
name: default
provider: openai
base_url: http://127.0.0.1:8000/v1
model: echo
timeout: 30s
$$);

SELECT tuvl.register_llm($$
name: claude
provider: anthropic
base_url: http://127.0.0.1:8000/v1
model: claude-test
$$);

SELECT tuvl.register_artifact($yaml$
name: support_tone
type: steering
description: How support answers customers
body: |
  You answer customers of Acme Shop. Be brief and polite.
  Never promise a refund.
$yaml$);

SELECT tuvl.register_artifact($yaml$
name: summarize_ticket
type: prompt
body: "Summarize this ticket in one sentence: {{ ticket }}"
$yaml$);

SELECT tuvl.register_artifact($yaml$
name: refund_policy
type: skill
body: Refunds over 100 EUR need a manager's approval.
$yaml$);

SELECT tuvl.register_artifact($yaml$
name: no_card_numbers
type: guardrail
description: no card numbers, and short answers
checks:
  - { check: regex_deny, pattern: '\y[0-9]{16}\y' }
  - { check: max_length, max: 4000 }
$yaml$);

SELECT tuvl.register_artifact($yaml$
name: step_counter
type: hook
description: count how steps end
events: [after_step, on_error]
action: metric
metric: shop.step_ends
$yaml$);

SELECT tuvl.register_artifact($yaml$
name: page_on_failure
type: hook
events: [on_error]
action: notify
step: tell_ops
$yaml$);

