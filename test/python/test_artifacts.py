"""The artifact registry: versioned steering, prompt, skill, guardrail and hook texts.

tuvl.register_artifact(source) stores version 1, 2, ... of a name; workflows
refer to artifact://name (floating: the latest version when a run is
created) or artifact://name@N (pinned).  Each test registers artifacts,
scripts, model configs and workflows under fresh names of its own, so that
the scripted LLM server's log (GET /_log?model=NAME) holds exactly the
requests of that test.  Which version of an artifact a model got is read
from the system and user messages of those requests; what a run recorded
is read from tuvl.runs.artifacts and its run_queued event.

Covered: version numbering; every rejected source (SQLSTATE and message);
the type of a name never changing; who may add versions (the owner of
version 1 or a member of its role); concurrent registrations; reading
tuvl.artifacts as any role; the validation findings of artifact references
and strict mode; floating and pinned references in a completion agent
(agent.system, agent.prompt) and an autonomous agent (agent.steering,
agent.skills) for both wire formats; the versions a run records; the
run-time errors of a registry edited by hand; and kill -9 of the worker
holding a run while version 2 is published: the run keeps version 1 for
every request, the one re-sent after the crash included, and only the next
run gets version 2.
"""
import collections
import json
import os
import threading
import time
import urllib.request
import uuid

import psycopg2
import psycopg2.errors
import pytest

from conftest import connect, journal_violations, kill_worker, q, q1, wait_run_finished, wait_until
from llmutil import script, sent

LLM_URL = os.environ.get("TUVL_LLM_URL")
LLM_ROOT = LLM_URL[: -len("/v1")] if LLM_URL and LLM_URL.endswith("/v1") else LLM_URL

pytestmark = pytest.mark.skipif(not LLM_URL, reason="TUVL_LLM_URL is not set (run through test/run)")

PROVIDERS = ["openai", "anthropic"]
OWNER = "tuvl_art_owner"
OTHER = "tuvl_art_other"
MEMBER = "tuvl_art_member"   # a member of OWNER
ROLES = [OWNER, OTHER, MEMBER]

STEERING_FRAME = "Persistent operating context (always follow it):\n"
SKILLS_FRAME = "Apply the following skills and instructions when they are relevant:\n"

# Never let an http_proxy variable send the tests' own requests elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------------------
# The scripted LLM server


def system_of(provider, body):
    """The system prompt of a request body, in either wire format."""
    if provider == "anthropic":
        return body.get("system")
    texts = [m["content"] for m in body["messages"] if m["role"] == "system"]
    assert len(texts) <= 1, texts
    return texts[0] if texts else None


def first_user_of(provider, body):
    m = next(m for m in body["messages"] if m["role"] == "user")
    if isinstance(m["content"], str):
        return m["content"]
    return "".join(b["text"] for b in m["content"] if b.get("type") == "text")


def new_name(prefix="art"):
    """A fresh name, valid for artifacts, scripts, model configs and workflows."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------------------
# Artifacts, model configs, workflows, runs


def artifact_yaml(name, type_, body=None, **extra):
    lines = [f"name: {name}", f"type: {type_}"]
    if body is not None:
        lines.append(f"body: {json.dumps(body)}")
    lines += [f"{k}: {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def register(conn, name, type_, body=None, **extra):
    """register_artifact; returns the version stored."""
    return q1(conn, "SELECT tuvl.register_artifact(%s)", (artifact_yaml(name, type_, body, **extra),))


def register_llm(conn, name, provider, timeout="10s"):
    q(conn, "SELECT tuvl.register_llm(%s)", (
        f"name: {name}\nprovider: {provider}\nbase_url: {LLM_URL}\nmodel: {name}\n"
        f"timeout: {timeout}\n",))


def model(conn, provider, turns, timeout="10s"):
    """A script and a model config of the same fresh name."""
    name = new_name("m")
    script(name, turns)
    register_llm(conn, name, provider, timeout)
    return name


ENDS = ("ends:\n"
        '  - { id: done, status: completed, response: "{{ ask_result }}" }\n'
        '  - { id: oops, status: completed, response: { error: "{{ _last_error }}", '
        'type: "{{ _last_error_type }}" } }\n')


def completion_workflow(name, model_name, system=None, prompt="Hello."):
    """One completion Agent `ask`; end done answers its result, oops its error."""
    system_line = f"      system: {json.dumps(system)}\n" if system is not None else ""
    return (f"name: {name}\n"
            "steps:\n"
            "  - id: ask\n"
            "    kind: Agent\n"
            "    mode: completion\n"
            "    agent:\n"
            f"      model: {model_name}\n"
            f"{system_line}"
            f"      prompt: {json.dumps(prompt)}\n"
            "    routes: { default: done, error: oops }\n"
            f"{ENDS}")


def autonomous_workflow(name, model_name, steering=None, skills=None):
    """One autonomous Agent `ask` with one SQL tool `note`."""
    lines = [f"name: {name}", "steps:", "  - id: ask", "    kind: Agent", "    mode: autonomous",
             "    agent:", f"      model: {model_name}"]
    if steering is not None:
        lines.append(f"      steering: {json.dumps(steering)}")
    if skills is not None:
        lines.append(f"      skills: {json.dumps(skills)}")
    lines += ["      tools: [{ ref: note }]",
              "    routes: { default: done, error: oops, max_iterations: oops, aborted: oops }",
              "  - id: note",
              "    kind: ModelOp",
              "    description: Note a tag",
              "    sql: SELECT $1::text AS tag",
              '    params: ["{{ tag }}"]']
    return "\n".join(lines) + "\n" + ENDS


def register_workflow(conn, source):
    return q1(conn, "SELECT tuvl.register_workflow(%s)", (source,))


def outcome(conn, run_id):
    status, end, response, error, artifacts = q(
        conn, "SELECT status, end_name, response, error, artifacts FROM tuvl.runs WHERE id = %s",
        (run_id,))[0]
    return {"run_id": run_id, "status": status, "end": end, "response": response,
            "error": error, "artifacts": artifacts}


def execute(conn, workflow, data=None, mode="sync", timeout=30):
    """Run workflow once, through tuvl.run() or the workers; its outcome."""
    payload = json.dumps(data if data is not None else {})
    if mode == "sync":
        run_id = q1(conn, "SELECT tuvl.run(%s, %s::jsonb)", (workflow, payload))["run_id"]
    else:
        run_id = q1(conn, "SELECT tuvl.start_run(%s, %s::jsonb)", (workflow, payload))
        status = q1(conn, "SELECT tuvl.wait(%s, make_interval(secs => %s))", (run_id, timeout))
        assert status in ("completed", "failed"), f"run {run_id} is still {status} after {timeout} s"
    return outcome(conn, run_id)


def queued_payload(conn, run_id):
    return q1(conn, "SELECT payload FROM tuvl.events WHERE run_id = %s AND type = 'run_queued'",
              (run_id,))


def error_of(res):
    assert res["status"] == "completed" and res["end"] == "oops", res
    return res["response"]["error"], res["response"]["type"]


def sqlerror(conn, sql, params=None):
    """The error a statement raises: (sqlstate, message, detail, hint)."""
    with pytest.raises(psycopg2.Error) as e:
        q(conn, sql, params)
    d = e.value.diag
    return e.value.pgcode, d.message_primary, d.message_detail, d.message_hint


@pytest.fixture
def conn(db, conns):
    return conns(db)


@pytest.fixture(params=PROVIDERS)
def provider(request):
    return request.param


@pytest.fixture(scope="module")
def roles(db):
    admin = connect("postgres")
    for role in reversed(ROLES):
        q(admin, f"DROP ROLE IF EXISTS {role}")
    for role in ROLES:
        q(admin, f"CREATE ROLE {role} LOGIN IN ROLE tuvl_user")
    q(admin, f"GRANT {OWNER} TO {MEMBER}")
    yield ROLES
    try:
        conn = connect(db)
        q(conn, "DROP OWNED BY " + ", ".join(ROLES))
        conn.close()
    except psycopg2.Error:
        pass
    for role in reversed(ROLES):
        try:
            q(admin, f"DROP ROLE IF EXISTS {role}")
        except psycopg2.Error:
            pass
    admin.close()


# ---------------------------------------------------------------------------
# register_artifact


def test_versions_count_from_one_per_name(conn):
    tone, other = new_name("tone"), new_name("other")
    assert [register(conn, tone, "steering", f"Tone {i}.") for i in (1, 2, 3)] == [1, 2, 3]
    assert register(conn, other, "skill", "A skill.") == 1
    source = artifact_yaml(tone, "steering", "Tone 4.", description="the fourth")
    assert q1(conn, "SELECT tuvl.register_artifact(%s)", (source,)) == 4
    rows = q(conn, "SELECT version, type, body, owner, definition, source, created_at <= now() "
                   "FROM tuvl.artifacts WHERE name = %s ORDER BY version", (tone,))
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (i, "steering", f"Tone {i}.", "postgres") for i in (1, 2, 3, 4)]
    assert rows[3][4] == {"name": tone, "type": "steering", "body": "Tone 4.",
                          "description": "the fourth"}
    assert rows[3][5] == source, "the source is kept as written"
    assert all(r[6] for r in rows)
    assert q(conn, "SELECT version FROM tuvl.artifacts WHERE name = %s", (other,)) == [(1,)]


def test_a_rolled_back_registration_uses_no_version(db, conns):
    conn = conns(db, autocommit=False)
    name = new_name()
    assert register(conn, name, "prompt", "one") == 1
    conn.rollback()
    assert register(conn, name, "prompt", "one again") == 1
    conn.commit()
    assert q(conn, "SELECT version, body FROM tuvl.artifacts WHERE name = %s", (name,)) == [
        (1, "one again")]


def test_body_keeps_multi_line_text_exactly(conn):
    name = new_name()
    body = "Line one.\n  Indented {{ placeholder }}: kept.\n\nLast line, \u00e9\u00e8 \"quoted\"."
    source = f"name: {name}\ntype: prompt\nbody: |-\n" + "".join(
        f"  {line}\n" if line else "\n" for line in body.split("\n"))
    assert q1(conn, "SELECT tuvl.register_artifact(%s)", (source,)) == 1
    assert q1(conn, "SELECT body FROM tuvl.artifacts WHERE name = %s", (name,)) == body


BAD_SOURCES = [
    ("name: Support\ntype: steering\nbody: x\n", "22023",
     'artifact name "Support" is not valid',
     "A name matches [a-z_][a-z0-9_-]*, such as support_tone."),
    ("name: 1tone\ntype: steering\nbody: x\n", "22023", 'artifact name "1tone" is not valid', None),
    ("name: a.b\ntype: steering\nbody: x\n", "22023", 'artifact name "a.b" is not valid', None),
    ("name: tone@2\ntype: steering\nbody: x\n", "22023", 'artifact name "tone@2" is not valid', None),
    (f"name: {'a' * 64}\ntype: steering\nbody: x\n", "22023",
     f'artifact name "{"a" * 64}" is not valid', None),
    ("type: steering\nbody: x\n", "22023", "artifact name (missing) is not valid", None),
    ("name: tone\ntype: persona\nbody: x\n", "22023", 'artifact "tone": type "persona" is not valid',
     "Use one of steering, prompt, skill, guardrail, hook."),
    ("name: tone\ntype: Steering\nbody: x\n", "22023",
     'artifact "tone": type "Steering" is not valid', None),
    ("name: tone\nbody: x\n", "22023", 'artifact "tone": type (missing) is not valid', None),
    ("name: tone\ntype: steering\n", "22023",
     'artifact "tone": a steering artifact needs body, its text', None),
    ("name: tone\ntype: prompt\nbody: \"\"\n", "22023",
     'artifact "tone": a prompt artifact needs body, its text', None),
    ("name: tone\ntype: skill\nbody: [a, b]\n", "22023",
     'artifact "tone": a skill artifact needs body, its text', None),
    ("name: tone\ntype: skill\nbody: 42\n", "22023",
     'artifact "tone": a skill artifact needs body, its text', None),
    ("name: tone\ntype: skill\nbody: null\n", "22023",
     'artifact "tone": a skill artifact needs body, its text', None),
    ("- name: tone\n- type: skill\n", "22023",
     "an artifact must be a YAML mapping with name, type and body", None),
    ("just some text\n", "22023", "an artifact must be a YAML mapping with name, type and body", None),
    ("name: [tone\n", "22P02", "could not parse artifact YAML", None),
]


@pytest.mark.parametrize("source,sqlstate,message,hint", BAD_SOURCES,
                         ids=[f"bad{i}" for i in range(len(BAD_SOURCES))])
def test_invalid_artifacts_are_rejected(conn, source, sqlstate, message, hint):
    before = q1(conn, "SELECT count(*) FROM tuvl.artifacts")
    code, msg, _, got_hint = sqlerror(conn, "SELECT tuvl.register_artifact(%s)", (source,))
    assert (code, msg) == (sqlstate, message)
    if hint is not None:
        assert got_hint == hint
    assert q1(conn, "SELECT count(*) FROM tuvl.artifacts") == before


def test_a_63_character_name_and_hyphens_are_valid(conn):
    long_name = "a" * 51 + uuid.uuid4().hex[:12]
    assert len(long_name) == 63
    assert register(conn, long_name, "skill", "x") == 1
    assert register(conn, new_name("_with-hyphen"), "skill", "x") == 1


def test_an_unknown_key_is_an_error_for_every_type(conn):
    name = new_name()
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        register(conn, name, "skill", "Refunds need a receipt.", colour="blue")
    assert f'artifact "{name}": unknown key "colour"' in str(e.value)
    assert "A skill artifact takes name, type, description, body." in str(e.value)
    assert q1(conn, "SELECT count(*) FROM tuvl.artifacts WHERE name = %s", (name,)) == 0

    conn.notices.clear()
    guard, hook = new_name("guard"), new_name("hook")
    # the keys of 0.1.0's free-form guardrails and hooks mean nothing: refused
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q1(conn, "SELECT tuvl.register_artifact(%s)", (
            f"name: {guard}\ntype: guardrail\ncheck: regex\npattern: x\n",))
    assert f'artifact "{guard}": unknown key "check"' in str(e.value)
    with pytest.raises(psycopg2.errors.InvalidParameterValue) as e:
        q1(conn, "SELECT tuvl.register_artifact(%s)", (
            f"name: {hook}\ntype: hook\nevent: after_step\naction: metric\n",))
    assert f'artifact "{hook}": unknown key "event"' in str(e.value)
    # their own keys are stored in definition; no body
    assert q1(conn, "SELECT tuvl.register_artifact(%s)", (
        f"name: {guard}\ntype: guardrail\nchecks:\n"
        "  - { check: regex_deny, pattern: '\\d{3}-\\d{2}-\\d{4}' }\n",)) == 1
    assert q1(conn, "SELECT tuvl.register_artifact(%s)", (
        f"name: {hook}\ntype: hook\nevents: [after_step]\naction: metric\n",)) == 1
    assert conn.notices == []
    assert q(conn, "SELECT name, type, body, definition FROM tuvl.artifacts "
                   "WHERE name IN (%s, %s) ORDER BY type", (guard, hook)) == [
        (guard, "guardrail", None, {"name": guard, "type": "guardrail", "checks": [
            {"check": "regex_deny", "pattern": "\\d{3}-\\d{2}-\\d{4}"}]}),
        (hook, "hook", None, {"name": hook, "type": "hook", "events": ["after_step"],
                               "action": "metric"}),
    ]


def test_the_type_of_a_name_never_changes(conn):
    name = new_name()
    assert register(conn, name, "skill", "v1") == 1
    valid = {"steering": {"body": "v2"}, "prompt": {"body": "v2"},
             "guardrail": {"checks": [{"check": "max_length", "max": 10}]},
             "hook": {"events": ["after_step"], "action": "metric"}}
    for other in ("steering", "prompt", "guardrail", "hook"):
        code, msg, _, hint = sqlerror(conn, "SELECT tuvl.register_artifact(%s)",
                                      (artifact_yaml(name, other, **valid[other]),))
        assert code == "42809", (code, msg)
        assert msg == (f'artifact "{name}" is a skill artifact; a new version cannot change its '
                       f"type to {other}")
        assert hint == f"Register the {other} under another name."
    assert register(conn, name, "skill", "v2") == 2
    assert q(conn, "SELECT version, type FROM tuvl.artifacts WHERE name = %s ORDER BY version",
             (name,)) == [(1, "skill"), (2, "skill")]


def test_only_the_owner_of_version_1_adds_versions(db, conns, roles):
    owner, other, member = conns(db, user=OWNER), conns(db, user=OTHER), conns(db, user=MEMBER)
    admin = conns(db)
    name = new_name()
    assert register(owner, name, "steering", "Owner's v1.") == 1

    code, msg, detail, hint = sqlerror(other, "SELECT tuvl.register_artifact(%s)",
                                       (artifact_yaml(name, "steering", "Hijacked."),))
    assert code == "42501"
    assert msg == f'artifact "{name}" belongs to another role'
    # the message names no other role
    assert OWNER not in msg + detail + hint
    assert "tuvl.transfer('artifact'" in hint
    # the ownership check comes before the type check: no hint about the type leaks
    code, msg, _, _ = sqlerror(other, "SELECT tuvl.register_artifact(%s)",
                               (artifact_yaml(name, "skill", "Hijacked."),))
    assert code == "42501"

    # only the owner adds versions: not a member of its role, not a superuser
    for who in (member, admin):
        code, _, _, _ = sqlerror(who, "SELECT tuvl.register_artifact(%s)",
                                 (artifact_yaml(name, "steering", "Not yours."),))
        assert code == "42501"
    assert register(owner, name, "steering", "Owner's v2.") == 2
    # until the name is handed over (by a superuser here: the owner cannot act as postgres)
    with pytest.raises(psycopg2.errors.InsufficientPrivilege):
        q(owner, "SELECT tuvl.transfer('artifact', %s, 'postgres')", (name,))
    q(admin, "SELECT tuvl.transfer('artifact', %s, 'postgres')", (name,))
    assert register(admin, name, "steering", "Superuser's v3.") == 3
    assert q(admin, "SELECT version, owner::text, body FROM tuvl.artifacts WHERE name = %s "
                    "ORDER BY version", (name,)) == [
        (1, "postgres", "Owner's v1."), (2, "postgres", "Owner's v2."), (3, "postgres", "Superuser's v3.")]
    code, _, _, _ = sqlerror(owner, "SELECT tuvl.register_artifact(%s)",
                             (artifact_yaml(name, "steering", "Mine again?"),))
    assert code == "42501"

    # the other role registers names of its own, and then owns them
    mine = new_name()
    assert register(other, mine, "skill", "Other's skill.") == 1
    code, _, detail, _ = sqlerror(owner, "SELECT tuvl.register_artifact(%s)",
                                  (artifact_yaml(mine, "skill", "x"),))
    assert code == "42501" and OTHER not in detail


def test_every_role_reads_the_registry_and_none_writes_it(db, conns, roles):
    admin, other = conns(db), conns(db, user=OTHER)
    name = new_name()
    register(admin, name, "prompt", "Readable by all.")
    assert q(other, "SELECT name, version, type, body, owner::text FROM tuvl.artifacts WHERE name = %s",
             (name,)) == [(name, 1, "prompt", "Readable by all.", "postgres")]
    for sql in (f"UPDATE tuvl.artifacts SET body = 'x' WHERE name = '{name}'",
                f"DELETE FROM tuvl.artifacts WHERE name = '{name}'",
                f"INSERT INTO tuvl.artifacts (name, version, type, body, definition, source, owner) "
                f"VALUES ('{name}', 9, 'prompt', 'x', '{{}}', 'x', '{OTHER}')"):
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            q(other, sql)
    assert q(admin, "SELECT version, body FROM tuvl.artifacts WHERE name = %s", (name,)) == [
        (1, "Readable by all.")]


def test_concurrent_registrations_of_a_name_get_consecutive_versions(db, conns):
    name = new_name()
    first = conns(db, autocommit=False)
    second = conns(db, autocommit=False)
    assert register(first, name, "skill", "first") == 1
    got = {}

    def other():
        try:
            got["version"] = register(second, name, "skill", "second")
            second.commit()
        except psycopg2.Error as e:  # reported below
            got["error"] = e
            second.rollback()

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.5)
    assert t.is_alive(), "the second registration waits for the first transaction"
    first.commit()
    t.join(10)
    assert got == {"version": 2}, got
    assert q(first, "SELECT version, body FROM tuvl.artifacts WHERE name = %s ORDER BY version",
             (name,)) == [(1, "first"), (2, "second")]
    first.commit()


# ---------------------------------------------------------------------------
# Validation


def findings(conn, source, strict=False):
    """[(severity, path, message without its "(line, column)" suffix)]."""
    rows = q(conn, "SELECT severity, path, message FROM tuvl.validate(%s, %s)", (source, strict))
    return [(s, p, m.rsplit(" (line ", 1)[0]) for s, p, m in rows]


def test_validation_of_artifact_references(conn):
    tone, ask, skill = new_name("tone"), new_name("ask"), new_name("skill")
    guard, hook = new_name("guard"), new_name("hook")
    register(conn, tone, "steering", "v1")
    register(conn, tone, "steering", "v2")
    register(conn, ask, "prompt", "Ask {{ x }}.")
    register(conn, skill, "skill", "A skill.")
    register(conn, guard, "guardrail", checks=[{"check": "regex_deny", "pattern": "x"}])
    register(conn, hook, "hook", events=["after_step"], action="metric")
    m = model(conn, "openai", [{"text": "unused"}])
    source = f"""
name: checks
steps:
  - id: a
    kind: Agent
    mode: completion
    agent:
      model: {m}
      system: artifact://{skill}@1
      prompt: artifact://{tone}@1
      guardrails: {{ input: [artifact://{guard}@1, "no PII"] }}
    routes: {{ default: b, guardrail_violation: b }}
  - id: b
    kind: Agent
    mode: autonomous
    agent:
      model: {m}
      steering: artifact://{tone}@3
      skills: [artifact://{skill}@1, "Inline text is fine.", artifact://nope_{skill},
               artifact://{ask}@1, artifact://{skill}@0, "artifact://Bad", 42]
      tools: [{{ ref: c }}]
      guardrails: {{ output: [artifact://{skill}@1] }}
    routes: {{ default: done, error: done, max_iterations: done, aborted: done,
               guardrail_violation: done }}
  - id: c
    kind: ModelOp
    description: A tool
    sql: SELECT 1
ends:
  - {{ id: done, status: completed }}
"""
    assert sorted(findings(conn, source)) == sorted([
        ("error", "steps[0].agent.system",
         f"artifact://{skill}@1 is a skill artifact, but this field takes a steering or prompt "
         "artifact"),
        ("error", "steps[0].agent.prompt",
         f"artifact://{tone}@1 is a steering artifact, but this field takes a prompt artifact"),
        ("error", "steps[0].agent.guardrails.input[1]",
         "a guardrail gate must list only artifact:// references to a guardrail artifact"),
        ("error", "steps[1].agent.steering",
         f'artifact "{tone}" has no version 3; its latest version is 2'),
        ("error", "steps[1].agent.skills[2]",
         f'artifact "nope_{skill}" does not exist; register it with tuvl.register_artifact()'),
        ("error", "steps[1].agent.skills[3]",
         f"artifact://{ask}@1 is a prompt artifact, but this field takes a skill artifact"),
        ("error", "steps[1].agent.skills[4]",
         f'"artifact://{skill}@0" is not a valid artifact reference; write artifact://name or '
         "artifact://name@version"),
        ("error", "steps[1].agent.skills[5]",
         '"artifact://Bad" is not a valid artifact reference; write artifact://name or '
         "artifact://name@version"),
        ("error", "steps[1].agent.skills[6]", "a skill must be text or an artifact:// reference"),
        ("error", "steps[1].agent.guardrails.output[0]",
         f"artifact://{skill}@1 is a skill artifact, but this field takes a guardrail artifact"),
    ])
    code, msg, detail, _ = sqlerror(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    assert (code, msg) == ("42P17", 'workflow "checks" is not valid')
    assert f'steps[1].agent.steering: artifact "{tone}" has no version 3' in detail


def test_floating_references_warn_and_strict_makes_them_errors(conn):
    tone, ask = new_name("tone"), new_name("ask")
    register(conn, tone, "steering", "v1")
    register(conn, tone, "steering", "v2")
    register(conn, ask, "prompt", "Hello.")
    m = model(conn, "openai", [{"text": "unused"}])
    name = new_name("wf")
    floating = completion_workflow(name, m, system=f"artifact://{tone}",
                                   prompt=f"artifact://{ask}@1")
    message = (f"floating artifact reference artifact://{tone} (now version 2); pin it as "
               f"artifact://{tone}@2 so that new versions cannot change this workflow")
    assert findings(conn, floating) == [("warning", "steps[0].agent.system", message)]
    assert findings(conn, floating, strict=True) == [("error", "steps[0].agent.system", message)]
    pinned = completion_workflow(name, m, system=f"artifact://{tone}@2",
                                 prompt=f"artifact://{ask}@1")
    assert findings(conn, pinned, strict=True) == []
    # register_workflow is never strict: the warning is a NOTICE
    conn.notices.clear()
    assert register_workflow(conn, floating) == 1
    assert any(f'workflow "{name}": steps[0].agent.system: {message}' in n
               for n in conn.notices), conn.notices


def test_a_steering_site_takes_a_prompt_artifact_and_a_prompt_site_does_not(conn):
    tone, ask = new_name("tone"), new_name("ask")
    register(conn, tone, "steering", "v1")
    register(conn, ask, "prompt", "Hello.")
    m = model(conn, "openai", [{"text": "unused"}])
    ok = completion_workflow(new_name("wf"), m, system=f"artifact://{ask}@1",
                             prompt=f"artifact://{ask}@1")
    assert findings(conn, ok) == []
    bad = completion_workflow(new_name("wf"), m, prompt=f"artifact://{tone}@1")
    assert findings(conn, bad) == [
        ("error", "steps[0].agent.prompt",
         f"artifact://{tone}@1 is a steering artifact, but this field takes a prompt artifact")]


# ---------------------------------------------------------------------------
# Resolution at run time


@pytest.mark.parametrize("mode", ["sync", "worker"])
def test_completion_agent_floating_and_pinned_references(conn, provider, mode):
    tone, ask = new_name("tone"), new_name("ask")
    register(conn, tone, "steering", "TONE-V1: answer briefly.")
    register(conn, ask, "prompt", "ASK-V1: greet {{ who }}.")
    m = model(conn, provider, [{"text": "Hi."}])
    floating, pinned = new_name("float"), new_name("pin")
    register_workflow(conn, completion_workflow(floating, m, system=f"artifact://{tone}",
                                                prompt=f"artifact://{ask}"))
    register_workflow(conn, completion_workflow(pinned, m, system=f"artifact://{tone}@1",
                                                prompt=f"artifact://{ask}@1"))

    def run_and_request(wf):
        n = len(sent(m))
        res = execute(conn, wf, {"who": "Ada"}, mode)
        assert (res["status"], res["end"], res["response"]) == ("completed", "done", "Hi."), res
        reqs = sent(m)[n:]
        assert len(reqs) == 1
        return res, system_of(provider, reqs[0]["body"]), first_user_of(provider, reqs[0]["body"])

    # the artifact's body is the field's text: a template, rendered with the context
    res, system, user = run_and_request(floating)
    assert (system, user) == ("TONE-V1: answer briefly.", "ASK-V1: greet Ada.")
    assert res["artifacts"] == {tone: 1, ask: 1}

    register(conn, tone, "steering", "TONE-V2: answer at length.")
    register(conn, ask, "prompt", "ASK-V2: welcome {{ who }}.")
    res, system, user = run_and_request(floating)
    assert (system, user) == ("TONE-V2: answer at length.", "ASK-V2: welcome Ada.")
    assert res["artifacts"] == {tone: 2, ask: 2}

    res, system, user = run_and_request(pinned)
    assert (system, user) == ("TONE-V1: answer briefly.", "ASK-V1: greet Ada.")
    assert res["artifacts"] is None, "a run records only floating references"


def test_autonomous_agent_steering_and_skills(conn, provider):
    tone, skill, fixed = new_name("tone"), new_name("skill"), new_name("fixed")
    register(conn, tone, "steering", "TONE-V1: you triage tickets.")
    register(conn, skill, "skill", "SKILL-V1: refunds over {{ limit }} need approval.")
    register(conn, fixed, "skill", "FIXED-V1: quote the order id.")
    register(conn, fixed, "skill", "FIXED-V2: never quote the order id.")
    m = model(conn, provider, [{"tool_calls": [{"name": "note", "arguments": {"tag": "t"}}]},
                               {"text": "Triaged."}])
    wf = new_name("wf")
    register_workflow(conn, autonomous_workflow(
        wf, m, steering=f"artifact://{tone}",
        skills=[f"artifact://{skill}", "INLINE: be terse.", f"artifact://{fixed}@1"]))

    def run_and_systems():
        n = len(sent(m))
        res = execute(conn, wf, {"limit": 100}, "worker")
        assert (res["status"], res["end"], res["response"]) == ("completed", "done", "Triaged."), res
        reqs = sent(m)[n:]
        assert [r["turn"] for r in reqs] == [0, 1]
        return res, [system_of(provider, r["body"]) for r in reqs]

    res, systems = run_and_systems()
    expected = (f"{STEERING_FRAME}TONE-V1: you triage tickets.\n\n{SKILLS_FRAME}"
                # an autonomous agent sends bodies as written: no template rendering
                "- SKILL-V1: refunds over {{ limit }} need approval.\n"
                "- INLINE: be terse.\n"
                "- FIXED-V1: quote the order id.\n\n")
    assert all(s.startswith(expected) for s in systems), systems[0]
    assert systems[0] == systems[1], "every turn carries the same system prompt"
    assert res["artifacts"] == {tone: 1, skill: 1}

    register(conn, tone, "steering", "TONE-V2: you escalate tickets.")
    register(conn, skill, "skill", "SKILL-V2: refunds need no approval.")
    res, systems = run_and_systems()
    expected = (f"{STEERING_FRAME}TONE-V2: you escalate tickets.\n\n{SKILLS_FRAME}"
                "- SKILL-V2: refunds need no approval.\n"
                "- INLINE: be terse.\n"
                "- FIXED-V1: quote the order id.\n\n")
    assert all(s.startswith(expected) for s in systems), systems[0]
    assert res["artifacts"] == {tone: 2, skill: 2}


def test_a_steering_site_takes_a_prompt_artifact_at_run_time(conn, provider):
    ask = new_name("ask")
    register(conn, ask, "prompt", "PROMPT-AS-STEERING.")
    m = model(conn, provider, [{"text": "ok"}])
    wf = new_name("wf")
    register_workflow(conn, autonomous_workflow(wf, m, steering=f"artifact://{ask}@1"))
    res = execute(conn, wf)
    assert res["end"] == "done", res
    (req,) = sent(m)
    assert system_of(provider, req["body"]).startswith(f"{STEERING_FRAME}PROMPT-AS-STEERING.\n\n")


def test_runs_record_the_versions_of_floating_references(conn):
    tone, skill, guard, hook = (new_name("tone"), new_name("skill"), new_name("guard"),
                                new_name("hook"))
    register(conn, tone, "steering", "v1")
    register(conn, tone, "steering", "v2")
    register(conn, skill, "skill", "s1")
    register(conn, guard, "guardrail", checks=[{"check": "regex_deny", "pattern": "x"}])
    register(conn, hook, "hook", events=["after_step"], action="metric")
    m = model(conn, "openai", [{"text": "done"}])
    wf = new_name("wf")
    source = autonomous_workflow(wf, m, steering=f"artifact://{tone}",
                                 skills=[f"artifact://{skill}", f"artifact://{skill}@1"])
    source = source.replace(
        "      tools: [{ ref: note }]\n",
        f"      tools: [{{ ref: note }}]\n      guardrails: {{ output: [artifact://{guard}] }}\n")
    source = source.replace("aborted: oops }", "aborted: oops, guardrail_violation: oops }")
    register_workflow(conn, source)
    expected = {tone: 2, skill: 1, guard: 1}   # floating ones only; hook is pinned

    for mode in ("sync", "worker"):
        res = execute(conn, wf, mode=mode)
        assert res["end"] == "done", res
        assert res["artifacts"] == expected
        payload = queued_payload(conn, res["run_id"])
        assert payload["artifacts"] == expected
        assert payload["workflow"] == wf and payload["version"] == 1

    # start_run resolves at creation, in the creating transaction
    tx = connect(conn.info.dbname, autocommit=False)
    try:
        run_id = q1(tx, "SELECT tuvl.start_run(%s)", (wf,))
        register(conn, tone, "steering", "v3 (committed before the run)")
        tx.commit()
    finally:
        tx.close()
    assert q1(conn, "SELECT tuvl.wait(%s, '30 s')", (run_id,)) == "completed"
    assert outcome(conn, run_id)["artifacts"] == expected

    # a workflow without floating references records nothing
    plain = new_name("plain")
    register_workflow(conn, completion_workflow(plain, m, system="Inline."))
    res = execute(conn, plain)
    assert res["artifacts"] is None
    assert "artifacts" not in queued_payload(conn, res["run_id"])


def test_a_floating_reference_to_a_missing_artifact_refuses_the_run(db, conns):
    """Only reachable by editing the registry by hand: validation refuses an unknown name."""
    conn = conns(db)
    tone = new_name("tone")
    register(conn, tone, "steering", "v1")
    wf = new_name("wf")
    m = model(conn, "openai", [{"text": "unused"}])
    register_workflow(conn, completion_workflow(wf, m, system=f"artifact://{tone}"))
    q(conn, "DELETE FROM tuvl.artifacts WHERE name = %s", (tone,))
    runs = q1(conn, "SELECT count(*) FROM tuvl.runs")
    for fn in ("start_run", "run"):
        code, msg, detail, hint = sqlerror(conn, f"SELECT tuvl.{fn}(%s)", (wf,))
        assert (code, msg) == ("42704", f'artifact "{tone}" does not exist')
        assert detail == f"The workflow refers to artifact://{tone}."
        assert hint == "Register it with tuvl.register_artifact()."
    assert q1(conn, "SELECT count(*) FROM tuvl.runs") == runs, "no run was created"


def test_a_registry_edited_by_hand_gives_precise_run_time_errors(conn, provider):
    """Validation makes these unreachable through register_artifact alone (a name's
    type never changes, versions are never removed); a superuser who edits
    tuvl.artifacts directly gets them at run time, on the step's error route."""
    swap, gone, tone = new_name("swap"), new_name("gone"), new_name("tone")
    register(conn, swap, "prompt", "Say hi.")
    register(conn, gone, "prompt", "Say bye.")
    register(conn, tone, "steering", "Steer.")
    m = model(conn, provider, [{"text": "ok"}])
    wrong_type, no_version = new_name("wt"), new_name("nv")
    register_workflow(conn, completion_workflow(wrong_type, m, prompt=f"artifact://{swap}@1"))
    register_workflow(conn, completion_workflow(no_version, m, prompt=f"artifact://{gone}@1"))
    auto = new_name("auto")
    register_workflow(conn, autonomous_workflow(auto, m, steering=f"artifact://{tone}@1"))
    assert execute(conn, wrong_type)["end"] == "done"

    q(conn, "DELETE FROM tuvl.artifacts WHERE name IN (%s, %s, %s)", (swap, gone, tone))
    register(conn, swap, "skill", "Now a skill.")
    register(conn, tone, "skill", "Now a skill too.")
    n = len(sent(m))

    error, _ = error_of(execute(conn, wrong_type, mode="worker"))
    assert error == f'agent.prompt of step "ask" refers to artifact://{swap}@1, a skill artifact'
    error, _ = error_of(execute(conn, no_version, mode="worker"))
    assert error == f'artifact "{gone}" has no version 1'
    error, _ = error_of(execute(conn, auto, mode="worker"))
    assert error == f'agent.steering of step "ask" refers to artifact://{tone}@1, a skill artifact'
    assert len(sent(m)) == n, "nothing was sent to the model"


def test_artifact_text_outside_a_reference_site_is_plain_text(conn):
    wf = new_name("wf")
    missing = new_name("nowhere")
    register_workflow(conn, f"""
name: {wf}
description: "Docs live at artifact://{missing}"
steps:
  - {{ id: r, kind: Router, on: "x", routes: {{ default: done }} }}
ends:
  - {{ id: done, status: completed, response: "artifact://{missing}" }}
""")
    res = execute(conn, wf)
    assert (res["status"], res["response"]) == ("completed", f"artifact://{missing}")


# ---------------------------------------------------------------------------
# A version published while a run is in flight, and kill -9 of its worker


def kill_holder(conn_db, run_id, server_log):
    """kill -9 the worker holding run_id; wait for the restart."""
    conn = connect(conn_db)
    try:
        holder = q1(conn, "SELECT lease_owner FROM tuvl.runs WHERE id = %s", (run_id,))
        assert holder, "a worker holds the run"
        assert q1(conn, "SELECT backend_type FROM pg_stat_activity WHERE pid = %s",
                  (holder,)) == "tuvl worker"
    finally:
        conn.close()
    kill_worker(holder, server_log)


def wait_finished(db, run_id):
    conn = connect(db)
    try:
        wait_run_finished(conn, run_id)
        res = outcome(conn, run_id)
        res["attempt"] = q1(conn, "SELECT attempt FROM tuvl.runs WHERE id = %s", (run_id,))
        res["queued"] = queued_payload(conn, run_id)
        assert journal_violations(conn, [run_id]) == []
        return res
    finally:
        conn.close()


def in_flight(m, n):
    """The request number n (0-based) of model m has reached the server and is unanswered."""
    reqs = sent(m)
    return len(reqs) == n + 1 and reqs[n]["status"] is None


@pytest.mark.parametrize("provider", PROVIDERS)
def test_crash_of_a_worker_and_a_new_version_leave_a_run_its_versions(db, provider,
                                                                           server_log):
    conn = connect(db)
    try:
        tone, skill = new_name("tone"), new_name("skill")
        register(conn, tone, "steering", "TONE-V1: refunds are fine.")
        register(conn, skill, "skill", "SKILL-V1: check the receipt.")
        m = model(conn, provider, [
            {"tool_calls": [{"name": "note", "arguments": {"tag": "first"}}], "latency_ms": 3000},
            {"tool_calls": [{"name": "note", "arguments": {"tag": "second"}}]},
            {"text": "Refund approved."}], timeout="20s")
        wf = new_name("wf")
        register_workflow(conn, autonomous_workflow(wf, m, steering=f"artifact://{tone}",
                                                    skills=[f"artifact://{skill}"]))
        run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"ticket\": 7}')", (wf,))
        wait_until(lambda: in_flight(m, 0), 15, message="the first request to be in flight")
        # version 2 is published while the run's first model call is in flight
        assert register(conn, tone, "steering", "TONE-V2: refunds are forbidden.") == 2
        assert register(conn, skill, "skill", "SKILL-V2: ignore the receipt.") == 2
    finally:
        conn.close()

    kill_holder(db, run_id, server_log)
    res = wait_finished(db, run_id)
    assert (res["status"], res["end"], res["response"]) == ("completed", "done",
                                                             "Refund approved."), res
    assert res["attempt"] >= 2, "the run was claimed again after the crash"
    assert res["artifacts"] == {tone: 1, skill: 1}
    assert res["queued"]["artifacts"] == {tone: 1, skill: 1}

    reqs = sent(m)
    assert collections.Counter(r["turn"] for r in reqs) == {0: 2, 1: 1, 2: 1}, \
        [(r["turn"], r["status"]) for r in reqs]
    assert reqs[0]["status"] is None, "the first request never got its answer to tuvl"
    assert reqs[0]["body"] == reqs[1]["body"], "the request re-sent after the crash is identical"
    for r in reqs:
        system = system_of(provider, r["body"])
        assert "TONE-V1: refunds are fine." in system and "SKILL-V1: check the receipt." in system
        assert "V2" not in system, system

    # the next run gets version 2
    conn = connect(db)
    try:
        script(m, [{"tool_calls": [{"name": "note", "arguments": {"tag": "x"}}]},
                   {"text": "Refund refused."}])
        n = len(sent(m))
        res = execute(conn, wf, {"ticket": 8}, "worker")
        assert (res["end"], res["response"]) == ("done", "Refund refused."), res
        assert res["artifacts"] == {tone: 2, skill: 2}
        later = sent(m)[n:]
        assert len(later) == 2
        for r in later:
            system = system_of(provider, r["body"])
            assert "TONE-V2: refunds are forbidden." in system
            assert "SKILL-V2: ignore the receipt." in system
            assert "V1" not in system, system
    finally:
        conn.close()


def test_crash_of_a_worker_and_a_new_version_leave_a_completion_run_its_versions(
        db, server_log):
    """Two completion steps share artifact://tone and artifact://ask (floating); the
    first is slow.  Version 2 is published and the worker killed while it is in
    flight: the request rebuilt after the crash and the second step's request
    still carry version 1."""
    conn = connect(db)
    try:
        tone, ask = new_name("tone"), new_name("ask")
        register(conn, tone, "steering", "TONE-V1: be kind.")
        register(conn, ask, "prompt", "ASK-V1: summarize {{ topic }}.")
        slow = model(conn, "openai", [{"text": "first answer", "latency_ms": 3000}], timeout="20s")
        fast = model(conn, "openai", [{"text": "second answer"}])
        wf = new_name("wf")
        register_workflow(conn, f"""
name: {wf}
steps:
  - id: first
    kind: Agent
    mode: completion
    agent: {{ model: {slow}, system: "artifact://{tone}", prompt: "artifact://{ask}" }}
  - id: ask
    kind: Agent
    mode: completion
    agent: {{ model: {fast}, system: "artifact://{tone}", prompt: "artifact://{ask}" }}
    routes: {{ default: done, error: oops }}
{ENDS}""")
        run_id = q1(conn, "SELECT tuvl.start_run(%s, '{\"topic\": \"refunds\"}')", (wf,))
        wait_until(lambda: in_flight(slow, 0), 15, message="the first request to be in flight")
        assert register(conn, tone, "steering", "TONE-V2: be blunt.") == 2
        assert register(conn, ask, "prompt", "ASK-V2: ignore {{ topic }}.") == 2
    finally:
        conn.close()

    kill_holder(db, run_id, server_log)
    res = wait_finished(db, run_id)
    assert (res["status"], res["end"], res["response"]) == ("completed", "done",
                                                             "second answer"), res
    assert res["attempt"] >= 2
    assert res["artifacts"] == res["queued"]["artifacts"] == {tone: 1, ask: 1}
    reqs = sent(slow) + sent(fast)
    assert [r["status"] for r in reqs] == [None, 200, 200]
    for r in reqs:
        assert system_of("openai", r["body"]) == "TONE-V1: be kind."
        assert first_user_of("openai", r["body"]) == "ASK-V1: summarize refunds."

    conn = connect(db)
    try:
        script(slow, [{"text": "first answer"}])
        res = execute(conn, wf, {"topic": "returns"}, "worker")
        assert res["artifacts"] == {tone: 2, ask: 2}
        for m in (slow, fast):
            body = sent(m)[-1]["body"]
            assert system_of("openai", body) == "TONE-V2: be blunt."
            assert first_user_of("openai", body) == "ASK-V2: ignore returns."
    finally:
        conn.close()
