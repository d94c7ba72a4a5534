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
