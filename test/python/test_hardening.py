"""Hardening: what an ordinary role holding only tuvl_user must not be able to do.

Each test is an attack by MALLORY (a LOGIN role granted only tuvl_user)
against VICTIM (another tuvl_user), the operators or the server, one test
(or a few) per finding of the hardening issue: notification channels per
role, metric series in fixed shared memory, tuvl.graph() escaping, PUBLIC's
privileges, tuvl.transfer() to group roles, the session user inside a step,
limits on child workflows, and timeout: 0.  docs/security.md ("What an
ordinary role can and cannot do") lists them with what stops each.
"""
import json
import os
import re

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, listen_events, listen_notifies, q, q1
from httputil import execute, unique

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

MALLORY = "tuvl_hb_mallory"
VICTIM = "tuvl_hb_victim"
ONCALL = "tuvl_hb_oncall"
ADMIN = "tuvl_hb_admin"
NOBODY = "tuvl_hb_nobody"
ROLES = [MALLORY, VICTIM, ONCALL, ADMIN, NOBODY]


@pytest.fixture(scope="module")
def hb(db):
    admin = connect("postgres")
    for role in reversed(ROLES):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    for role in (MALLORY, VICTIM):
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    q(admin, f"CREATE ROLE {ONCALL} LOGIN IN ROLE tuvl_operator")
    q(admin, f"CREATE ROLE {ADMIN} LOGIN IN ROLE tuvl_admin")
    q(admin, f"CREATE ROLE {NOBODY} LOGIN")
    yield db
    conn = connect(db)
    q(conn, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
            "WHERE principal_id::text = ANY (%s))", (ROLES,))
    q(conn, "DELETE FROM tuvl.runs WHERE principal_id::text = ANY (%s)", (ROLES,))
    for table in ("workflows", "artifacts", "llms"):
        q(conn, f"DELETE FROM tuvl.{table} WHERE owner::text = ANY (%s)", (ROLES,))
    q(conn, "DELETE FROM tuvl.llm_versions WHERE registered_by::text = ANY (%s)", (ROLES,))
    conn.close()
    admin.close()
    admin = connect("postgres")     # a test restarts the server
    for role in reversed(ROLES):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


@pytest.fixture
def as_role(hb, conns):
    return lambda role=None: conns(hb, user=role)


def sqlerror(conn, sql, params=None):
    with pytest.raises(psycopg2.Error) as e:
        q(conn, sql, params)
    d = e.value.diag
    return e.value.pgcode, d.message_primary, d.message_detail or "", d.message_hint or ""


def register(conn, source):
    return q1(conn, "SELECT tuvl.register_workflow(%s)", (source,))


# ---------------------------------------------------------------------------
# 3. tuvl.graph() escapes what a workflow names

HOSTILE_KEYS = [
    'x"] \n click s_r "javascript:alert(1)"',   # a Mermaid click line
    'a\\',                                       # a backslash before dot's closing quote
    'q|p -->|y| s_r',                            # an edge label ending early
    'l"]; "s_r" -> "e_done" [label="forged',     # a dot edge
    '#quot; & &amp; <b>bold</b> `md` %s',
]


def hostile_workflow(name):
    routes = "\n".join(f"      {json_str(k)}: done" for k in HOSTILE_KEYS)
    return f"""
name: {name}
steps:
  - id: r
    kind: Router
    on: "{{{{ x }}}}"
    routes:
{routes}
      "evil": {json_str('bad"]-->x')}
  - {{ id: a-b, kind: ModelOp, sql: "SELECT 1" }}
ends:
  - {{ id: done, status: completed }}
  - {{ id: {json_str('bad"]-->x')}, status: failed }}
"""


def json_str(s):
    import json
    return json.dumps(s)


MERMAID_LINE = re.compile(
    r'^(flowchart TD'
    r'|  [se]x?_[A-Za-z0-9_]+\["[^"\n]*"\]'
    r'|  [se]x?_[A-Za-z0-9_]+\(\["[^"\n]*"\]\)'
    r'|  implicit_end\(\["\(end\): completed"\]\)'
    r'|  [se]x?_[A-Za-z0-9_]+ -\.?->\|"[^"|\n]*"\| ([se]x?_[A-Za-z0-9_]+|implicit_end))$')


def dot_tokens(line):
    """The tokens of a line of dot as Graphviz's lexer reads it: in a quoted
    string only \\" is an escape (a lone backslash is itself), so a
    backslash right before the closing quote escapes it."""
    tokens, i = [], 0
    while i < len(line):
        c = line[i]
        if c in " \t":
            i += 1
        elif c == '"':
            j, text = i + 1, ""
            while True:
                if j >= len(line):
                    raise AssertionError(f"unterminated string in {line!r}")
                if line[j] == "\\" and j + 1 < len(line) and line[j + 1] == '"':
                    text += '"'
                    j += 2
                elif line[j] == '"':
                    break
                else:
                    text += line[j]
                    j += 1
            tokens.append(("str", text))
            i = j + 1
        elif line.startswith("->", i):
            tokens.append(("op", "->"))
            i += 2
        elif re.match(r"[A-Za-z0-9_]", c):
            m = re.match(r"[A-Za-z0-9_]+", line[i:])
            tokens.append(("id", m.group(0)))
            i += len(m.group(0))
        else:
            tokens.append(("op", c))
            i += 1
    return tokens


def test_graph_escapes_hostile_route_keys_and_ids(as_role):
    mal = as_role(MALLORY)
    name = unique("drawn_")
    register(mal, hostile_workflow(name))

    mermaid = q1(mal, "SELECT tuvl.graph(%s)", (name,))
    lines = mermaid.rstrip("\n").split("\n")
    for line in lines:
        assert MERMAID_LINE.match(line), (line, mermaid)
    # one line per node and edge: 2 steps, 2 ends, 6 routes, 2 default flows, the implicit end
    assert len(lines) == 1 + 2 + 2 + len(HOSTILE_KEYS) + 1 + 2 + 1, mermaid
    assert not any(l.lstrip().startswith("click") for l in lines), mermaid
    assert "<b>" not in mermaid and "`" not in mermaid
    # the label still says what the key was
    assert '-->|"a#92;"| e_done' in mermaid
    assert 'x#34;#93;   click s_r #34;javascript#58;alert#40;1#41;#34;' in mermaid

    dot = q1(mal, "SELECT tuvl.graph(%s, 'dot')", (name,))
    lines = dot.rstrip("\n").split("\n")
    assert len(lines) == 2 + 2 + 2 + len(HOSTILE_KEYS) + 1 + 2 + 1 + 1, dot
    labels = []
    for line in lines[2:-1]:
        t = dot_tokens(line)
        kinds = [k for k, _ in t]
        if kinds[:2] == ["str", "op"] and t[1][1] == "[":
            # "node" [shape=..., label="..."];
            assert kinds == ["str", "op", "id", "op", "id", "op", "id", "op", "str", "op", "op"], line
            assert re.match(r"^([se]x?_[A-Za-z0-9_]+|implicit_end)$", t[0][1]), line
        else:
            # "a" -> "b" [label="..."]; or with style=dashed
            assert kinds[:4] == ["str", "op", "str", "op"] and t[1][1] == "->", line
            assert kinds[4:] in (["id", "op", "str", "op", "op"],
                                 ["id", "op", "id", "op", "id", "op", "str", "op", "op"]), line
            labels.append(t[-3][1])
    assert lines[-1] == "}"
    # a backslash is shown through its entity, never as an escape of the quote
    assert "a&#92;" in labels
    assert 'l"]; "s_r" -> "e_done" [label="forged' in labels
    if os.path.exists("/usr/bin/dot"):
        import subprocess
        subprocess.run(["/usr/bin/dot", "-Tsvg"], input=dot.encode(), check=True, capture_output=True)


# ---------------------------------------------------------------------------
# 4. PUBLIC reads nothing it should not


def documented_public_privileges():
    """The rows of the table under "### What PUBLIC may do" in docs/security.md:
    {(object, privilege)}."""
    text = open(os.path.join(ROOT, "docs", "security.md"), encoding="utf-8").read()
    section = text.split("### What PUBLIC may do", 1)[1].split("\n#", 1)[0]
    rows = set()
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)` \| ([A-Z]+) \|", line)
        if m:
            rows.add((m.group(1), m.group(2)))
    assert rows, "no table under '### What PUBLIC may do' in docs/security.md"
    return rows


PUBLIC_PRIVILEGES_SQL = """
WITH members AS (
    SELECT d.classid, d.objid FROM pg_depend d
    WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
      AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'tuvl'))
SELECT c.oid::regclass::text, a.privilege_type
FROM pg_class c
CROSS JOIN LATERAL aclexplode(coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char",
                                                           c.relowner))) a
WHERE a.grantee = 0 AND (c.relnamespace = 'tuvl'::regnamespace
                         OR (c.tableoid, c.oid) IN (SELECT classid, objid FROM members))
UNION ALL
SELECT p.oid::regprocedure::text, a.privilege_type
FROM pg_proc p CROSS JOIN LATERAL aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
WHERE a.grantee = 0 AND (p.pronamespace = 'tuvl'::regnamespace
                         OR (p.tableoid, p.oid) IN (SELECT classid, objid FROM members))
UNION ALL
SELECT t.oid::regtype::text, a.privilege_type
FROM pg_type t CROSS JOIN LATERAL aclexplode(coalesce(t.typacl, acldefault('T', t.typowner))) a
WHERE a.grantee = 0 AND (t.tableoid, t.oid) IN (SELECT classid, objid FROM members)
UNION ALL
SELECT 'schema ' || n.nspname, a.privilege_type
FROM pg_namespace n CROSS JOIN LATERAL aclexplode(n.nspacl) a
WHERE a.grantee = 0 AND n.nspname = 'tuvl'
"""


def test_public_has_exactly_the_documented_privileges(as_role):
    admin = as_role()
    granted = {(obj, priv) for obj, priv in q(admin, PUBLIC_PRIVILEGES_SQL)}
    documented = documented_public_privileges()
    assert granted == documented, (
        f"granted to PUBLIC but not in docs/security.md: {sorted(granted - documented)}; "
        f"documented but not granted: {sorted(documented - granted)}")


def test_a_role_without_tuvl_user_reads_no_table_and_calls_only_public_functions(as_role):
    nobody, admin = as_role(NOBODY), as_role()
    tables = [r[0] for r in q(admin, "SELECT c.oid::regclass::text FROM pg_class c "
                                     "WHERE c.relnamespace = 'tuvl'::regnamespace AND c.relkind IN ('r', 'v', 'p')")]
    assert "tuvl.llm_versions" in tables
    for t in tables:
        assert not q1(nobody, "SELECT has_table_privilege(%s, 'SELECT')", (t,)), t
        code, _, _, _ = sqlerror(nobody, f"SELECT 1 FROM {t} LIMIT 1")
        assert code == "42501", t
    callable_ = {r[0] for r in q(nobody, "SELECT p.oid::regprocedure::text FROM pg_proc p "
                                         "WHERE p.pronamespace = 'tuvl'::regnamespace "
                                         "AND has_function_privilege(p.oid, 'EXECUTE')")}
    # exactly the functions docs/security.md lists for PUBLIC
    assert callable_ == {obj for obj, priv in documented_public_privileges() if priv == "EXECUTE"}
    assert {"tuvl.version()", "tuvl.validate(text,boolean)", "tuvl.render(jsonb,jsonb)"} <= callable_


def test_llm_versions_are_read_like_llms(as_role):
    mal, nobody = as_role(MALLORY), as_role(NOBODY)
    model = unique("hb_model_")
    q(mal, "SELECT tuvl.register_llm(%s)", (f"name: {model}\nprovider: openai\nbase_url: http://127.0.0.1:1/v1\nmodel: x\n",))
    assert q1(mal, "SELECT count(*) FROM tuvl.llm_versions WHERE name = %s", (model,)) == 1
    assert q1(mal, "SELECT count(*) FROM tuvl.llms WHERE name = %s", (model,)) == 1
    code, msg, _, _ = sqlerror(nobody, "SELECT source FROM tuvl.llm_versions")
    assert code == "42501" and "llm_versions" in msg


# ---------------------------------------------------------------------------
# 5. transfer() to group roles


def test_transfer_to_tuvls_group_roles_or_public_is_refused(as_role):
    mal, adm = as_role(MALLORY), as_role(ADMIN)
    name = unique("official_")
    register(mal, f"name: {name}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    for group in ("tuvl_user", "tuvl_operator", "tuvl_admin"):
        for conn in (mal, adm):
            code, msg, detail, hint = sqlerror(conn, "SELECT tuvl.transfer('workflow', %s, %s)", (name, group))
            assert code == "22023", (group, code, msg)
            assert msg == f'cannot hand workflow "{name}" to role "{group}"'
            assert "look official" in detail and "CREATE ROLE" in hint
    code, msg, detail, _ = sqlerror(mal, "SELECT tuvl.transfer('workflow', %s, 0::oid::regrole)", (name,))
    assert code == "22023" and msg == f'cannot hand workflow "{name}" to PUBLIC', msg
    # PUBLIC cannot be named as a role at all
    code, _, _, _ = sqlerror(mal, "SELECT tuvl.transfer('workflow', %s, 'public')", (name,))
    assert code == "42704"
    # REASSIGN OWNED is the other door: the same refusal
    code, msg, _, _ = sqlerror(mal, "REASSIGN OWNED BY CURRENT_USER TO tuvl_user")
    assert code == "22023" and re.match(r'^cannot hand workflow ".*" to role "tuvl_user"$', msg), msg
    assert q1(mal, "SELECT owner::text FROM tuvl.workflows WHERE name = %s", (name,)) == MALLORY


def test_reassign_owned_by_current_user_never_reaches_the_owners_names(as_role):
    # REASSIGN OWNED BY CURRENT_USER once resolved CURRENT_USER inside tuvl's
    # owner frame: the extension owner's names went to the caller
    mal, admin = as_role(MALLORY), as_role()
    name = unique("owners_")
    register(admin, f"name: {name}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    mine = unique("mine_")
    register(mal, f"name: {mine}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    q(mal, "REASSIGN OWNED BY CURRENT_USER TO CURRENT_USER")
    q(mal, "DROP OWNED BY CURRENT_USER")
    assert q1(admin, "SELECT owner::text FROM tuvl.workflows WHERE name = %s", (name,)) == "postgres"
    assert q1(admin, "SELECT owner::text FROM tuvl.workflows WHERE name = %s", (mine,)) == MALLORY


# ---------------------------------------------------------------------------
# 8. timeout: 0 is bounded by tuvl.max_step_timeout


SLEEPER = """
name: {name}
steps:
  - id: nap
    kind: ModelOp
    sql: SELECT pg_sleep(60)
    {timeout}
    routes: {{ error: stopped }}
ends:
  - {{ id: stopped, status: failed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
"""


def test_timeout_zero_means_the_maximum_in_the_workers_and_in_run(as_role, set_gucs):
    import time
    mal, adm = as_role(MALLORY), as_role(ADMIN)
    set_gucs({"tuvl.max_step_timeout": ("2s", "2s")})
    zero, default = unique("nap0_"), unique("napd_")
    register(mal, SLEEPER.format(name=zero, timeout="timeout: 0"))
    register(mal, SLEEPER.format(name=default, timeout=""))
    # a role may not raise the maximum, only lower or raise its own step_timeout
    code, msg, _, _ = sqlerror(mal, "SET tuvl.max_step_timeout = '1h'")
    assert code == "42501", msg
    q(mal, "SET tuvl.step_timeout = 0")
    for name in (zero, default):
        for mode in ("worker", "sync"):
            started = time.monotonic()
            res = execute(mal, name, {}, mode, timeout=30)
            took = time.monotonic() - started
            assert res["status"] == "failed", res
            assert res["response"] == {"type": "timeout", "error": "the step's timeout of 2 s passed"}, res
            assert took < 15, (name, mode, took)
    q(mal, "SET tuvl.step_timeout = '1d'")
    res = execute(mal, default, {}, "sync")
    assert res["response"]["type"] == "timeout", res
    # a member of tuvl_admin may change it (a superuser's ALTER SYSTEM reaches the workers)
    q(adm, "SET tuvl.max_step_timeout = '4h'")
    assert q1(adm, "SHOW tuvl.max_step_timeout") == "4h"


# ---------------------------------------------------------------------------
# 7. child workflows have depth and total limits

RECURSIVE = """
name: {name}
steps:
  - id: again
    kind: Workflow
    workflow: {name}
    output: inner
    routes: {{ error: limited, default: done }}
ends:
  - {{ id: limited, status: completed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
  - {{ id: done, status: completed, response: {{ depth_below: "{{{{ inner }}}}" }} }}
"""


def test_a_workflow_that_starts_itself_stops_at_max_child_depth(as_role):
    mal, admin = as_role(MALLORY), as_role()
    name = unique("rec_")
    register(mal, RECURSIVE.format(name=name))
    code, _, _, _ = sqlerror(mal, "SET tuvl.max_child_depth = 1000")
    assert code == "42501"
    for mode in ("worker", "sync"):
        if mode == "worker":
            root = q1(mal, "SELECT tuvl.start_run(%s)", (name,))
        else:
            root = q1(mal, "SELECT (tuvl.run(%s) ->> 'run_id')::bigint", (name,))
        assert q1(mal, "SELECT tuvl.wait(%s, '60 s')", (root,)) == "completed"
        rows = q(admin, "SELECT id, status, response, root_run_id FROM tuvl.runs "
                        "WHERE id = %s OR root_run_id = %s ORDER BY id", (root, root))
        # the root and 8 children below it, a chain; the ninth was never started
        assert len(rows) == 1 + 8, rows
        assert all(r[1] == "completed" for r in rows)
        deepest = rows[-1][2]
        assert deepest["type"] == "child_limit", deepest
        assert deepest["error"] == (f'Workflow step "again" would start a child run 9 levels below run {root}, '
                                    'more than tuvl.max_child_depth (8)'), deepest
        # journaled: the deepest step failed with the error, on its error route
        failed = q1(admin, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'agent_completed'",
                    (rows[-1][0],))
        assert failed["error_type"] == "child_limit" and failed["signal"] == "error", failed
        assert failed["sqlstate"] == "54000" and failed["detail"].endswith("a chain of 8 Workflow steps."), failed


WIDE = """
name: {name}
steps:
  - id: first
    kind: Workflow
    workflow: {leaf}
    for_each: "{{{{ first }}}}"
    max_parallel: 4
    input: {{ n: "{{{{ item }}}}" }}
    output: a
    routes: {{ error: limited }}
  - id: second
    kind: Workflow
    workflow: {leaf}
    for_each: "{{{{ second }}}}"
    input: {{ n: "{{{{ item }}}}" }}
    output: b
    routes: {{ error: limited, default: done }}
ends:
  - {{ id: limited, status: failed, response: {{ type: "{{{{ _last_error_type }}}}", error: "{{{{ _last_error }}}}" }} }}
  - {{ id: done, status: completed }}
"""


def test_a_for_each_past_max_run_tree_starts_none_of_its_children(as_role, set_gucs):
    mal, admin = as_role(MALLORY), as_role()
    set_gucs({"tuvl.max_run_tree": ("50", "50")})
    leaf, name = unique("leaf_"), unique("wide_")
    register(mal, f"name: {leaf}\nsteps:\n  - {{ id: s, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n")
    register(mal, WIDE.format(name=name, leaf=leaf))
    code, _, _, _ = sqlerror(mal, "SET tuvl.max_run_tree = 1000000")
    assert code == "42501"
    # one list too big: refused before any child exists
    res = execute(mal, name, {"first": list(range(51)), "second": []}, "worker", timeout=60)
    assert res["status"] == "failed" and res["response"]["type"] == "child_limit", res
    assert res["response"]["error"] == (
        f'Workflow step "first" would start 51 child runs under run {res["run_id"]}, which has 0 already, '
        'more than tuvl.max_run_tree (50)'), res
    assert q1(admin, "SELECT count(*) FROM tuvl.runs WHERE parent_run_id = %s", (res["run_id"],)) == 0
    # the runs of every step under the root count: 30 fit, 30 more do not
    res = execute(mal, name, {"first": list(range(30)), "second": list(range(30))}, "worker", timeout=60)
    assert res["status"] == "failed" and res["response"]["type"] == "child_limit", res
    assert "would start 30 child runs" in res["response"]["error"] and "which has 30 already" in res["response"]["error"]
    assert q1(admin, "SELECT count(*) FROM tuvl.runs WHERE root_run_id = %s", (res["run_id"],)) == 30
    # within the limit, both steps run
    res = execute(mal, name, {"first": list(range(25)), "second": list(range(25))}, "worker", timeout=60)
    assert res["status"] == "completed", res


# ---------------------------------------------------------------------------
# 2. metric series live in fixed shared memory, with a quota per role

SIGNAL = """
name: {name}
steps:
  - {{ id: r, kind: Router, on: "{{{{ v }}}}", routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed }}
"""


def flood(conn, workflow, prefix, n, batch=4000):
    """n runs of workflow, each routing on a value never seen before: one new series each."""
    for first in range(0, n, batch):
        q(conn, "SELECT count(tuvl.run(%s, jsonb_build_object('v', %s || g))) "
                "FROM generate_series(%s, %s) g", (workflow, prefix, first, min(first + batch, n) - 1))


def free_shared_memory(admin):
    return q1(admin, "SELECT size FROM pg_shmem_allocations WHERE name IS NULL")


def lock_heavy(conn, n=12000):
    """One statement taking n locks in the shared lock table (it grows into free shared memory)."""
    return q1(conn, "SELECT count(pg_advisory_xact_lock(g)) FROM generate_series(1, %s) g", (n,))


def dropped(conn, role, reason):
    return q1(conn, "SELECT value FROM tuvl.metrics WHERE name = 'tuvl.metrics.dropped' "
                    "AND labels = jsonb_build_object('role', %s::text, 'reason', %s::text)", (role, reason))


def steps_of(conn, workflow):
    return q(conn, "SELECT labels ->> 'signal', value FROM tuvl.metrics "
                   "WHERE name = 'tuvl.steps' AND labels ->> 'workflow' = %s ORDER BY 1", (workflow,))


def test_a_role_flooding_metric_labels_gets_its_quota_and_no_more(as_role):
    mal, vic, oncall, admin = as_role(MALLORY), as_role(VICTIM), as_role(ONCALL), as_role()
    quota = int(q1(admin, "SHOW tuvl.metric_series_per_role"))
    assert quota == 2048
    hostile, own = unique("sig_"), unique("vsig_")
    register(mal, SIGNAL.format(name=hostile))
    register(vic, SIGNAL.format(name=own))
    free = free_shared_memory(admin)
    # 0.2.0 took the server's free shared memory from 14,500 distinct values
    # on: every transaction needing a lock slot failed with "out of shared memory"
    flood(mal, hostile, "x", 16000)
    assert free_shared_memory(admin) >= free - 65536, (free, free_shared_memory(admin))
    assert lock_heavy(vic) == 12000
    series = steps_of(mal, hostile)
    assert 0 < len(series) <= quota, len(series)
    over = dropped(mal, MALLORY, "role_quota")
    assert over is not None and over >= 16000 - quota, over
    # another role's metrics keep being recorded
    execute(vic, own, {"v": "mine"}, "sync")
    assert steps_of(vic, own) == [("mine", 1.0)]
    # a role sees its own drops, operators everyone's
    assert dropped(vic, MALLORY, "role_quota") is None
    assert dropped(oncall, MALLORY, "role_quota") == over
    prom = q1(mal, "SELECT tuvl.metrics_prometheus()")
    assert f'tuvl_metrics_dropped_total{{reason="role_quota",role="{MALLORY}"}}' in prom \
        or f'tuvl_metrics_dropped_total{{role="{MALLORY}",reason="role_quota"}}' in prom, prom


def test_a_full_table_of_series_takes_no_more_shared_memory(hb, as_role, set_gucs):
    from conftest import SERVER_LOG, pg_ctl, query, wait_for_server, wait_until, worker_pids
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    set_gucs({"tuvl.metric_series_per_role": ("8192", "8192")})
    hostile, own = unique("sig_"), unique("vsig_")
    register(mal, SIGNAL.format(name=hostile))
    register(vic, SIGNAL.format(name=own))
    execute(vic, own, {"v": "before"}, "sync")
    free = free_shared_memory(admin)
    try:
        flood(mal, hostile, "y", 9000)
        assert free_shared_memory(admin) >= free - 65536, (free, free_shared_memory(admin))
        assert lock_heavy(vic) == 12000
        assert dropped(mal, MALLORY, "table_full") > 0
        # a series that exists keeps counting; a new one of any role is dropped, and counted
        execute(vic, own, {"v": "before"}, "sync")
        execute(vic, own, {"v": "after"}, "sync")
        assert steps_of(vic, own) == [("before", 2.0)]
        assert dropped(vic, VICTIM, "table_full") >= 1
    finally:
        # series are never removed: a restart empties the table for the tests after this one
        pg_ctl("-l", SERVER_LOG, "-m", "fast", "-w", "-t", "60", "restart")
        wait_for_server()
        want = int(query("postgres", "SHOW tuvl.workers_per_database")[0][0])
        wait_until(lambda: len(worker_pids(hb)) == want, 10, message="the workers after the restart")


# ---------------------------------------------------------------------------
# 1. NOTIFY channels per role

ONE_STEP = "name: {name}\nsteps:\n  - {{ id: one, kind: ModelOp, sql: 'SELECT 1 AS x' }}\n"


def heard(conn, run_id, seconds=1.0):
    """The payloads about run_id that conn has received within seconds."""
    got = listen_notifies(conn, seconds, lambda got: False, complete=True)
    return [json.loads(n.payload) for n in got
            if n.payload.startswith("{") and json.loads(n.payload).get("run_id") == run_id]


def heard_until_end(conn, run_id):
    def ended(got):
        return any(json.loads(n.payload).get("run_id") == run_id
                   and json.loads(n.payload)["type"] == "run_completed" for n in got)
    got = listen_notifies(conn, 15, ended)
    return [json.loads(n.payload) for n in got if json.loads(n.payload).get("run_id") == run_id]


def test_each_role_hears_its_own_runs_and_operators_hear_every_run(as_role):
    mal, vic, oncall, admin = as_role(MALLORY), as_role(VICTIM), as_role(ONCALL), as_role()
    channels = {role: q1(as_role(role), "SELECT tuvl.events_channel()") for role in (MALLORY, VICTIM, ONCALL)}
    operators = channels[ONCALL]
    assert q1(admin, "SELECT tuvl.events_channel()") == operators        # a superuser is an operator
    assert len(set(channels.values())) == 3
    for c in channels.values():
        assert re.match(r"^tuvl_[0-9a-f]{32}$", c), c
    name = unique("quiet_")
    register(vic, ONE_STEP.format(name=name))
    spies = {}
    for listener_role in (MALLORY, VICTIM, ONCALL):
        spies[listener_role] = as_role(listener_role)
        listen_events(spies[listener_role])
    # MALLORY also listens where every event went before, and on every channel she can name
    q(spies[MALLORY], "LISTEN tuvl_events")
    for mode in ("worker", "sync"):
        res = execute(vic, name, {}, mode)
        assert res["status"] == "completed"
        journal = [tuple(r) for r in q(vic, "SELECT seq, type FROM tuvl.events WHERE run_id = %s ORDER BY seq",
                                       (res["run_id"],))]
        for role in (VICTIM, ONCALL):
            got = heard_until_end(spies[role], res["run_id"])
            assert [(p["seq"], p["type"]) for p in got] == journal, (role, got)
        assert heard(spies[MALLORY], res["run_id"]) == []


def test_a_role_cannot_learn_or_forge_another_roles_channel(as_role):
    mal, vic, nobody = as_role(MALLORY), as_role(VICTIM), as_role(NOBODY)
    code, _, _, _ = sqlerror(mal, "SELECT secret FROM tuvl.notify_secret")
    assert code == "42501"
    code, _, _, _ = sqlerror(mal, "SELECT tuvl.rotate_events_channels()")
    assert code == "42501"
    code, msg, _, _ = sqlerror(nobody, "SELECT tuvl.events_channel()")
    assert code == "42501" and "events_channel" in msg
    # a forged event reaches only the channel MALLORY names: her own
    listener = as_role(VICTIM)
    listen_events(listener)
    q(mal, "SELECT pg_notify(tuvl.events_channel(), %s)", ('{"run_id": 1, "type": "run_failed"}',))
    q(mal, "NOTIFY tuvl_events, '{\"run_id\": 1, \"type\": \"run_failed\"}'")
    assert listen_notifies(listener, 1, lambda got: False, complete=True) == []


def test_an_operators_own_runs_reach_the_operators_channel_once(as_role):
    oncall = as_role(ONCALL)
    name = unique("op_")
    register(oncall, ONE_STEP.format(name=name))
    listener = as_role(ONCALL)
    listen_events(listener)
    res = execute(oncall, name, {}, "worker")
    got = heard_until_end(listener, res["run_id"])
    seqs = [p["seq"] for p in got]
    assert seqs == sorted(set(seqs)), got          # each event once


def test_granting_and_revoking_tuvl_operator_moves_a_role_between_channels(as_role):
    admin, adm = as_role(), as_role(ADMIN)
    role = "tuvl_hb_temp_op"
    q(admin, f"DROP ROLE IF EXISTS {role}")
    q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    conn = as_role(role)
    try:
        own = q1(conn, "SELECT tuvl.events_channel()")
        operators = q1(admin, "SELECT tuvl.events_channel()")
        q(admin, f"GRANT tuvl_operator TO {role}")
        assert q1(conn, "SELECT tuvl.events_channel()") == operators
        q(admin, f"REVOKE tuvl_operator FROM {role}")
        assert q1(conn, "SELECT tuvl.events_channel()") == own
        # it still knows the operators' channel: a member of tuvl_admin makes new ones
        q(adm, "SELECT tuvl.rotate_events_channels()")
        new_operators = q1(admin, "SELECT tuvl.events_channel()")
        assert new_operators != operators and q1(conn, "SELECT tuvl.events_channel()") != own
        # and the workers announce on the new ones
        vic = as_role(VICTIM)
        name = unique("rot_")
        register(vic, ONE_STEP.format(name=name))
        old, new = as_role(), as_role()
        q(old, f'LISTEN "{operators}"')
        q(new, f'LISTEN "{new_operators}"')
        res = execute(vic, name, {}, "worker")
        assert heard_until_end(new, res["run_id"])[-1]["type"] == "run_completed"
        assert heard(old, res["run_id"]) == []
    finally:
        conn.close()
        q(admin, f"DROP ROLE IF EXISTS {role}")


# ---------------------------------------------------------------------------
# 6. inside a step, session_user and current_user are the principal, is_superuser is off

WHO = """
name: {name}
steps:
  - id: who
    kind: ModelOp
    sql: >-
      SELECT session_user::text AS session_user, current_user::text AS current_user,
             current_setting('is_superuser') AS is_superuser,
             (SELECT count(*) FROM hb.audit) AS audit_rows
    output: who
  - {{ id: boom, kind: ModelOp, sql: "SELECT 1 / 0", routes: {{ error: again }} }}
  - id: again
    kind: ModelOp
    sql: SELECT session_user::text AS session_user, current_setting('is_superuser') AS is_superuser
    output: again
"""


@pytest.fixture
def audit(hb):
    """A table whose row security trusts session_user, as audit and multi-tenant schemas do."""
    admin = connect(hb)
    q(admin, "DROP SCHEMA IF EXISTS hb CASCADE")
    q(admin, f"""
        CREATE SCHEMA hb;
        GRANT USAGE ON SCHEMA hb TO PUBLIC;
        CREATE TABLE hb.audit (tenant name, note text);
        INSERT INTO hb.audit VALUES ('postgres', 'superuser-only');
        ALTER TABLE hb.audit ENABLE ROW LEVEL SECURITY;
        CREATE POLICY by_session ON hb.audit USING (tenant = session_user);
        GRANT SELECT ON hb.audit TO PUBLIC;
    """)
    yield
    q(admin, "DROP SCHEMA hb CASCADE")
    admin.close()


def test_a_step_sees_its_principal_as_session_user_and_no_superuser(as_role, audit):
    mal, vic, admin = as_role(MALLORY), as_role(VICTIM), as_role()
    name = unique("who_")
    for conn in (mal, vic, admin):
        register(conn, WHO.format(name=name + "_" + q1(conn, "SELECT current_user")))
    for mode in ("worker", "sync"):
        ids = {}
        for role, conn in ((MALLORY, mal), (VICTIM, vic), ("postgres", admin)):
            ids[role] = execute(conn, f"{name}_{role}", {}, mode)["run_id"]
        for role, run_id in ids.items():
            ctx = q1(admin, "SELECT context FROM tuvl.runs WHERE id = %s", (run_id,))
            su = "on" if role == "postgres" else "off"
            assert ctx["who"] == [{"session_user": role, "current_user": role, "is_superuser": su,
                                   "audit_rows": 1 if role == "postgres" else 0}], (mode, role, ctx)
            # after a step failed (its subtransaction rolled back), the next step is the principal's too
            assert ctx["again"] == [{"session_user": role, "is_superuser": su}], (mode, role, ctx)


def test_the_session_user_comes_back_after_steps_as_another_role(as_role, audit):
    mal, admin = as_role(MALLORY), as_role()
    name = unique("who_")
    register(mal, WHO.format(name=name))
    # a superuser's session running a step as MALLORY, with SET ROLE, through a
    # SECURITY DEFINER function, and with a statement cut short by statement_timeout
    q(admin, "SET ROLE " + MALLORY)
    res = q1(admin, "SELECT tuvl.run(%s)", (name,))
    ctx = q1(mal, "SELECT context FROM tuvl.runs WHERE id = %s", (res["run_id"],))
    assert ctx["who"][0]["session_user"] == MALLORY and ctx["who"][0]["is_superuser"] == "off", ctx
    q(admin, "RESET ROLE")
    assert q(admin, "SELECT session_user::text, current_user::text, current_setting('is_superuser')") == \
        [("postgres", "postgres", "on")]
    q(admin, f"""CREATE OR REPLACE FUNCTION hb.run_as_mallory() RETURNS jsonb LANGUAGE sql SECURITY DEFINER
                 AS $$ SELECT tuvl.run('{name}') $$""")
    q(admin, f"ALTER FUNCTION hb.run_as_mallory() OWNER TO {MALLORY}")
    res = q1(admin, "SELECT hb.run_as_mallory()")
    assert res["status"] == "completed", res
    ctx = q1(mal, "SELECT context FROM tuvl.runs WHERE id = %s", (res["run_id"],))
    assert ctx["again"] == [{"session_user": MALLORY, "is_superuser": "off"}], ctx
    assert q(admin, "SELECT session_user::text, current_user::text, current_setting('is_superuser')") == \
        [("postgres", "postgres", "on")]
    slow = unique("slow_")
    register(mal, f"name: {slow}\nsteps:\n  - {{ id: nap, kind: ModelOp, sql: 'SELECT pg_sleep(5)' }}\n")
    q(admin, f"SET ROLE {MALLORY}; SET statement_timeout = '300ms'")
    q1(admin, "SELECT tuvl.run(%s)", (slow,))
    q(admin, "RESET statement_timeout; RESET ROLE")
    assert q(admin, "SELECT session_user::text, current_user::text, current_setting('is_superuser')") == \
        [("postgres", "postgres", "on")]
