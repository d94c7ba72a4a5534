"""The docs' examples run as pasted: each SQL block named here is fed to
psql (as a user would paste it) in a fresh database, and must run without
an error; where the page shows a result, the test checks it.
"""
import os
import re
import subprocess

import pytest

from conftest import PGBIN, connect, create_database, drop_database, q1, wait_until, worker_pids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sql_blocks(page, heading):
    """The ```sql blocks of page under heading (until the next heading of
    the same or a higher level)."""
    text = open(os.path.join(ROOT, page)).read()
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    end = re.search(r"^#{1,%d} " % level, rest, re.M)
    section = rest[: end.start()] if end else rest
    return re.findall(r"```sql\n(.*?)```", section, re.S)


def psql(db, script):
    out = subprocess.run([f"{PGBIN}/psql", "-X", "-v", "ON_ERROR_STOP=1", "-d", db],
                         input=script, capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, f"{out.stderr}\n--- the script:\n{script}"
    return out.stdout


@pytest.fixture
def fresh():
    name = "tuvl_docs_example"
    drop_database(name)
    create_database(name)
    wait_until(lambda: len(worker_pids(name)) > 0, 10, message="workers in the docs' database")
    yield name
    drop_database(name)


def test_the_readmes_first_workflow_runs_as_pasted(fresh):
    blocks = sql_blocks("README.md", "## A first workflow")
    assert blocks
    # the database exists already: CREATE EXTENSION is the fixture's
    script = blocks[0].replace("CREATE EXTENSION tuvl;", "", 1)
    out = psql(fresh, script)
    assert '{"refunded": true}' in out and '{"refunded": false}' in out, out


def test_the_workflow_step_example_runs(fresh):
    blocks = [b for b in sql_blocks("docs/workflows.md", "### Workflow") if "register_workflow" in b]
    out = psql(fresh, blocks[0])
    assert "[2, 4, 6, 8, 10]" in out, out


def test_the_graph_example_prints_what_the_page_shows(fresh):
    block = sql_blocks("docs/workflows.md", "## Drawing a workflow")[0]
    shown = re.search(r"```mermaid\n(.*?)```", open(os.path.join(ROOT, "docs/workflows.md")).read(), re.S).group(1)
    out = psql(fresh, block.replace("SELECT tuvl.graph('refund_request');", ""))
    conn = connect(fresh)
    assert q1(conn, "SELECT tuvl.graph('refund_request')") == shown
    conn.close()


def test_the_retention_example_runs(fresh):
    block = sql_blocks("docs/operations.md", "## Retention")[0]
    # ALTER SYSTEM cannot run in the test's shared cluster for good: set it for the session
    block = block.replace("ALTER SYSTEM SET tuvl.retention = '30 days';", "SET tuvl.retention = '30 days';")
    psql(fresh, block)


# ---------------------------------------------------------------------------
# Every page against the schema

PAGES = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
               if f.endswith(".md")) + ["README.md"]


def split_statements(block):
    """The SQL statements of a block, split at semicolons outside quotes,
    dollar quotes and comments."""
    out, buf, i, quote = [], [], 0, None
    while i < len(block):
        if quote:
            if block.startswith(quote, i):
                buf.append(quote)
                i += len(quote)
                quote = None
            else:
                buf.append(block[i])
                i += 1
            continue
        m = re.match(r"'|\$[A-Za-z_]*\$", block[i:])
        if m:
            quote = m.group(0)
            buf.append(quote)
            i += len(quote)
        elif block.startswith("--", i):
            i = block.find("\n", i) if "\n" in block[i:] else len(block)
        elif block[i] == ";":
            out.append("".join(buf).strip())
            buf = []
            i += 1
        else:
            buf.append(block[i])
            i += 1
    out.append("".join(buf).strip())
    return [s for s in out if s]


def all_blocks():
    for page in PAGES:
        for block in re.findall(r"```sql\n(.*?)```", open(os.path.join(ROOT, page)).read(), re.S):
            yield page, block


def test_every_query_in_the_docs_plans_against_the_schema(fresh):
    """Each SELECT, WITH, INSERT, UPDATE and DELETE in a ```sql block of any
    page is planned (EXPLAIN, nothing executed) in a fresh database: a
    column, view, function or argument type of tuvl that a page names and
    the code does not have fails here.  Statements that use psql variables
    are left out, and so are those that fail only on the reader's own
    objects (a table outside tuvl, such as shop.orders)."""
    conn = connect(fresh, autocommit=False)
    cur = conn.cursor()
    planned, theirs, wrong = 0, 0, []
    for page, block in all_blocks():
        for st in split_statements(block):
            if not re.match(r"(?is)^(select|with|insert|update|delete)\b", st) \
                    or re.search(r"(^|\s)\\|:'|:\"|(?<![:\w]):[a-z_]+\b", st):
                continue
            try:
                cur.execute("EXPLAIN " + st)
                planned += 1
            except Exception as e:  # noqa: BLE001 -- psycopg2.Error, reported below
                message = (getattr(e, "pgerror", None) or str(e)).splitlines()[0]
                if getattr(e, "pgcode", None) in ("42P01", "42883", "3F000", "42704") \
                        and "tuvl" not in message:
                    theirs += 1
                else:
                    wrong.append(f"{page}: {message}\n    {st[:200]}")
            conn.rollback()
    conn.close()
    assert not wrong, "\n".join(wrong)
    assert planned > 200 and theirs < planned / 4, (planned, theirs)


def test_every_tuvl_name_the_docs_use_exists(fresh):
    """tuvl.<name>( is a function of the extension, or a setting; a bare
    tuvl.<name> a function, table, view or setting, or a name the C code
    spells out (a metric such as tuvl.steps, a span attribute such as
    tuvl.workflow), or a file of src/ (dotted names such as tuvl.llm.tokens
    are left to the metrics tests)."""
    conn = connect(fresh)
    cur = conn.cursor()
    cur.execute("SELECT proname FROM pg_proc WHERE pronamespace = 'tuvl'::regnamespace "
                "UNION SELECT relname FROM pg_class WHERE relnamespace = 'tuvl'::regnamespace "
                "UNION SELECT substr(name, 6) FROM pg_settings WHERE name LIKE 'tuvl.%'")
    known = {r[0] for r in cur.fetchall()}
    conn.close()
    for d, _, files in os.walk(os.path.join(ROOT, "src")):
        for f in files:
            if f.endswith((".c", ".h")):
                known.add(f.split(".")[0] if f.startswith("tuvl.") else "")
                code = open(os.path.join(d, f)).read()
                known |= set(re.findall(r'"tuvl\.([a-z_][a-z0-9_]*)', code))
    unknown = set()
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for m in re.finditer(r"(?<![/\w])tuvl\.([a-z_][a-z0-9_]*)(?![a-z0-9_.])", text):
            if m.group(1) not in known | {"so", "control", "c", "h"}:
                unknown.add(f"{page}: tuvl.{m.group(1)}")
    assert not unknown, sorted(unknown)
