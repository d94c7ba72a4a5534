-- Steps execute as the run's principal, never as the worker's superuser.
CREATE ROLE tuvl_alice LOGIN;
CREATE ROLE tuvl_bob LOGIN;
CREATE ROLE tuvl_nobody LOGIN;
-- A role needs tuvl_user to use tuvl at all.
SET ROLE tuvl_nobody;
SELECT tuvl.start_run('alice_flow');
SELECT count(*) FROM tuvl.runs;
SELECT tuvl.version() = extversion AS version_for_everyone FROM pg_extension WHERE extname = 'tuvl';
RESET ROLE;
GRANT tuvl_user TO tuvl_alice, tuvl_bob;
CREATE SCHEMA perm;
GRANT USAGE ON SCHEMA perm TO tuvl_alice, tuvl_bob;
CREATE TABLE perm.secret (v text);
INSERT INTO perm.secret VALUES ('top secret');
CREATE TABLE perm.open (who name, v text);
GRANT SELECT, INSERT ON perm.open TO tuvl_alice, tuvl_bob;
CREATE FUNCTION perm.whoami(ctx jsonb) RETURNS jsonb LANGUAGE sql
AS $$ SELECT jsonb_build_object('current_user', current_user, 'session_user', session_user) $$;

SET ROLE tuvl_alice;
SELECT tuvl.register_workflow($$
name: alice_flow
steps:
  - id: who
    kind: Functional
    function: perm.whoami
  - id: write
    kind: ModelOp
    sql: INSERT INTO perm.open SELECT current_user, 'written by a step' RETURNING who
    output: written
  - id: peek
    kind: ModelOp
    sql: SELECT v FROM perm.secret
ends: []
$$);
-- The Functional runs as tuvl_alice; the insert is hers; the secret table is denied.
SELECT r->>'status' AS status, r->>'error' AS error FROM tuvl.run('alice_flow') AS r;
SELECT context->'who_result'->>'current_user' AS step_user, context->'written' AS written,
       principal
FROM tuvl.runs WHERE workflow = 'alice_flow';
SELECT * FROM perm.open;

-- Only the owner of a workflow registers new versions; no other role, superusers included.
SET ROLE tuvl_bob;
SELECT tuvl.register_workflow($$
name: alice_flow
steps:
  - { id: who, kind: Functional, function: perm.whoami }
$$);
-- Bob sees none of Alice's runs.
SELECT count(*) AS bob_sees FROM tuvl.runs;
SELECT count(*) AS bob_sees_events FROM tuvl.events;
-- Bob cannot write tuvl's tables directly.
INSERT INTO tuvl.journal (run_id, seq, n, events) VALUES (1, 99, 1, '\x0100');
INSERT INTO tuvl.events (run_id, seq, type) VALUES (1, 99, 'run_completed');
UPDATE tuvl.runs SET status = 'completed';
RESET ROLE;

-- Members of tuvl_operator see every run.
GRANT tuvl_operator TO tuvl_bob;
SET ROLE tuvl_bob;
SELECT count(*) > 0 AS operator_sees FROM tuvl.runs WHERE principal = 'tuvl_alice';
RESET ROLE;

DELETE FROM tuvl.runs WHERE workflow IN ('alice_flow');
DELETE FROM perm.open;
REVOKE tuvl_operator FROM tuvl_bob;
SELECT tuvl.register_workflow($$
name: alice_flow
steps:
  - { id: who, kind: Functional, function: perm.whoami }
$$);
-- Alice may not push her name onto a role she cannot act as.
SET ROLE tuvl_alice;
SELECT tuvl.transfer('workflow', 'alice_flow', 'postgres');
RESET ROLE;
-- A superuser (or a member of tuvl_admin) hands it over; then it may add a version.
SELECT tuvl.transfer('workflow', 'alice_flow', 'postgres');
SELECT tuvl.register_workflow($$
name: alice_flow
steps:
  - { id: who, kind: Functional, function: perm.whoami }
$$);
SELECT DISTINCT owner FROM tuvl.workflows WHERE name = 'alice_flow';
-- A role that owns tuvl objects cannot be dropped.
SET ROLE tuvl_bob;
SELECT tuvl.register_workflow($$
name: bob_flow
steps:
  - { id: who, kind: Functional, function: perm.whoami }
$$);
RESET ROLE;
DROP ROLE tuvl_bob;
SELECT tuvl.transfer('workflow', 'bob_flow', 'postgres');
DROP ROLE tuvl_nobody;
