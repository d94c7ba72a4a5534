"""A hostile role: it cannot borrow another role's names, locks or start keys.

MALLORY and VICTIM are ordinary login roles holding only tuvl_user.  On 0.2.0
MALLORY could register a model config or a child workflow under a name that
VICTIM's workflow referred to before it existed, and receive VICTIM's prompts,
API key and data; hold an advisory lock with the key tuvl's own admission of
concurrency keys took, stalling every worker; and lock tuvl.schedule_slots,
stopping every role's scheduled runs.  And start keys (start_run(..., key =>))
deduplicated only for superusers: a second start with the same key failed
with XX000 for everyone else.

Each test here is one such attack, or the behaviour a non-superuser is owed.
"""
import threading
import time

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, q, q1, wait_until

MALLORY = "tuvl_hr_mallory"
VICTIM = "tuvl_hr_victim"
ROLES = [MALLORY, VICTIM]


@pytest.fixture(scope="module")
def roles(db):
    admin = connect("postgres")
    for role in ROLES:
        q(admin, f"DROP ROLE IF EXISTS {role}")
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    yield db
    conn = connect(db)
    q(conn, "DELETE FROM tuvl.journal WHERE run_id IN (SELECT id FROM tuvl.runs "
            "WHERE principal_id::text = ANY (%s))", (ROLES,))
    q(conn, "DELETE FROM tuvl.runs WHERE principal_id::text = ANY (%s)", (ROLES,))
    for table in ("workflows", "artifacts", "llms"):
        q(conn, f"DELETE FROM tuvl.{table} WHERE owner::text = ANY (%s)", (ROLES,))
    q(conn, "DELETE FROM tuvl.secret_grants WHERE grantee::text = ANY (%s)", (ROLES,))
    conn.close()
    for role in ROLES:
        q(admin, f"DROP ROLE IF EXISTS {role}")
    admin.close()


@pytest.fixture
def as_role(roles, conns):
    return lambda role: conns(roles, user=role)


QUICK = """
name: {name}
steps:
  - {{ id: s, kind: ModelOp, sql: "SELECT $1::int + 1 AS n", params: ["{{{{ n }}}}"], output: r }}
"""


def test_a_start_key_deduplicates_for_an_ordinary_role(as_role):
    """0.2.0: the second start failed with XX000 'the run ... vanished' for
    every role but superusers (the lookup ran as the extension owner)."""
    victim = as_role(VICTIM)
    q(victim, "SELECT tuvl.register_workflow(%s)", (QUICK.format(name="hr_keyed"),))
    first = q1(victim, "SELECT tuvl.start_run('hr_keyed', '{\"n\": 1}', key => 'order-7')")
    second = q1(victim, "SELECT tuvl.start_run('hr_keyed', '{\"n\": 2}', key => 'order-7')")
    assert second == first
    assert q1(victim, "SELECT count(*) FROM tuvl.runs WHERE key = 'order-7'") == 1
    # another role's same key is its own run
    mallory = as_role(MALLORY)
    q(mallory, "SELECT tuvl.register_workflow(%s)", (QUICK.format(name="hr_keyed_m"),))
    other = q1(mallory, "SELECT tuvl.start_run('hr_keyed_m', '{\"n\": 1}', key => 'order-7')")
    assert other != first
    assert q1(mallory, "SELECT tuvl.start_run('hr_keyed_m', '{\"n\": 5}', key => 'order-7')") == other
