#!/usr/bin/env python3
"""test/docs/doctest.py: every example of every page runs as written.

For each page under docs/ and README.md, in a database of its own
(doc_<page>, with the extension created unless the page creates it), the
page's ```sql and ```sh (```shell, ```bash) blocks run in page order in ONE
psql session, fed on standard input as a reader pastes them (psql variables
set with \\gset carry over from block to block; a shell block runs through
psql's \\! with the connection's PG* variables, the page's database as
PGDATABASE).  Then:

- a SQL or shell block must not fail (no ERROR, no psql error) unless a
  marker says it shows an error on purpose;
- a ``` or ```text block right after a SQL or shell block (nothing but blank
  lines between) is what the page says it prints: its lines, normalised
  (timestamps, durations, pids, widths of psql's columns), must appear in
  that order in what psql printed for the block.  Lines of "..." stand for
  anything; DETAIL, HINT and CONTEXT lines are not compared, and for a block
  that shows an error only the ERROR lines are;
- a ```yaml block is either a whole workflow (top-level name and steps) and
  then valid for tuvl.validate() (but for names of other workflows, model
  configs and artifacts, which need not exist), or a fragment, which must only parse as
  YAML (a block that has duplicate keys or before/after pairs says so with
  a marker).

The scripted servers of test/run (tuvl_peers) stand in for the examples'
services: the pages use 127.0.0.1:8080 (the HTTP test server,
test/servers/http_server.py), 127.0.0.1:8000 (the scripted LLM server,
test/servers/llm_server.py), 127.0.0.1:3001 (the MCP reference server,
/mcp) and 127.0.0.1:3026 (the scripted MCP server of revision 2026-07-28,
test/servers/mcp_stateless_server.py); the test replaces these ports with
the servers' real ones, and
a key a page reads from the reader's file (\\set key `cat FILE`) with a
value of its own.

Markers (CONTRIBUTING.md): an HTML comment on the line(s) above a block,

    <!-- doctest: skip (why) -->          not run (say why)
    <!-- doctest: error -->               the block shows an error on purpose
    <!-- doctest: placeholder (what) -->  the reader must replace something: not run
    <!-- doctest: fragment -->            a YAML block that is only part of a workflow
    <!-- doctest: unchecked (why) -->     runs, but its output is not compared
    <!-- doctest: output -->              this block (of any language, after
                                          prose) is what the SQL block before it prints

and for a whole page, anywhere in it,

    <!-- doctest: page skip (why) -->     the page cannot run here
    <!-- doctest: continues other.md -->  run other.md's blocks first, in the same database

After each page the test drops its database, the roles the page created,
its pg_cron jobs, and resets what it changed with ALTER SYSTEM.

Besides the pages, two checks read every SQL block of every page: each
SELECT, WITH, INSERT, UPDATE and DELETE without psql variables plans
(EXPLAIN) against the schema, and each tuvl.<name> the pages mention
exists.

Prints one "ok N - what" or "not ok N - what" line per page and check, the
reasons of failures indented below, and exits non-zero when one failed.
    test/docs/doctest.py [PAGE ...]      # e.g. docs/runs.md; default: all
"""
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PGBIN = os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin")
PSQL = os.path.join(PGBIN, "psql")
NEEDED = ("PGHOST", "PGPORT", "TUVL_HTTP_PORT", "TUVL_LLM_PORT", "TUVL_MCP_PORT", "TUVL_MCP26_PORT")
PAGE_TIMEOUT = 120

FENCE = re.compile(r"^( *)```([A-Za-z]*)[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*doctest:\s*(.*?)\s*-->", re.S)
BLOCK_MARKERS = ("skip", "error", "placeholder", "fragment", "unchecked", "output")
SQL, SHELL, YAML, OUTPUT = "sql", "sh", "yaml", "output"
KINDS = {"sql": SQL, "sh": SHELL, "shell": SHELL, "bash": SHELL, "yaml": YAML, "": OUTPUT,
         "text": OUTPUT}


class Block:
    def __init__(self, kind, text, line, marker, follows):
        self.kind, self.text, self.line = kind, text, line
        self.marker = marker          # (word, reason) or None
        self.follows = follows        # only blank lines between it and the block before
        self.expected = None          # the output block that follows it


def parse(page):
    """The page's blocks, and its page-level markers."""
    text = open(os.path.join(ROOT, page)).read()
    blocks, page_markers, last_end = [], [], 0
    for m in MARKER.finditer(text):
        words = m.group(1).split(None, 2)
        if words and words[0] in ("page", "continues"):
            page_markers.append(words)
    for m in FENCE.finditer(text):
        lang = m.group(2).lower()
        indent = len(m.group(1))
        body = "\n".join(line[indent:] if line[:indent].strip() == "" else line
                         for line in m.group(3).split("\n"))
        between = text[last_end:m.start()]
        marker = None
        mm = list(MARKER.finditer(between))
        if mm and between[mm[-1].end():].strip() == "":
            words = mm[-1].group(1).split(None, 1)
            if words and words[0] in BLOCK_MARKERS:
                marker = (words[0], words[1] if len(words) > 1 else "")
        line = text.count("\n", 0, m.start()) + 1
        kind = KINDS.get(lang)
        if kind is not None:
            blocks.append(Block(kind, body, line, marker, between.strip() == "" and blocks != []))
        else:
            blocks.append(Block("other:" + lang, body, line, marker, False))
        last_end = m.end()
    for prev, b in zip(blocks, blocks[1:]):
        if b.kind == OUTPUT and b.follows and prev.kind in (SQL, SHELL):
            prev.expected = b
    for i, b in enumerate(blocks):
        # a block of any language, after some prose, marked as the output
        if b.marker and b.marker[0] == "output":
            prev = [p for p in blocks[:i] if p.kind in (SQL, SHELL)]
            if prev:
                prev[-1].expected = b
    return blocks, page_markers


def ports(text):
    """The pages' ports of the scripted servers -> the running ones, and
    the files a reader keeps a key in (\\set key `cat FILE`) -> a value
    of the test's: tuvl refuses an empty secret."""
    for port, env in (("8080", "TUVL_HTTP_PORT"), ("8000", "TUVL_LLM_PORT"), ("3001", "TUVL_MCP_PORT"),
                      ("3026", "TUVL_MCP26_PORT")):
        text = re.sub(r"(127\.0\.0\.1|localhost):%s\b" % port, r"\g<1>:" + os.environ[env], text)
    text = re.sub(r"^(\\set\s+\w+\s+)`cat\s+[^`]+`", r"\1'doc-test-key'", text, flags=re.M)
    return text


# ---------------------------------------------------------------------------
# Comparing what a page shows with what psql printed

TS = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?([+-]\d\d(:\d\d)?|Z)?")
INTERVAL = re.compile(r"\b\d\d:\d\d:\d\d(\.\d+)?\b")
DURATION = re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|us|s|sec|secs|seconds?|milliseconds?|min|minutes?)\b")
BIG = re.compile(r"\b\d{4,}\b")
PSQL_PREFIX = re.compile(r"^psql:[^:]*:\d+: ")
RUN_ID = re.compile(r'("(?:run_id|parent_run_id|root_run_id|child_run_id)"): \d+')
HEX = re.compile(r"(?<![0-9a-f])[0-9a-f]{16,}(?![0-9a-f])")
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


HTTP_DATE = re.compile(r"\b[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT")


def norm(line):
    line = PSQL_PREFIX.sub("", line)
    line = HTTP_DATE.sub("<date>", line)
    line = re.sub(r"Python/[\d.]+", "Python/<version>", line)
    # a process id of any length: after the counter wraps, a backend's is short
    line = re.sub(r"\bPID \d+", "PID <n>", line)
    line = re.sub(r'"(latency_ms|delay_ms)": \d+', r'"\1": <ms>', line)
    for pat, rep in ((TS, "<ts>"), (INTERVAL, "<dur>"), (UUID, "<uuid>"), (HEX, "<hex>"), (DURATION, "<dur>"),
                     (BIG, "<n>")):
        line = pat.sub(rep, line)
    line = RUN_ID.sub(r"\1: <id>", line)
    line = re.sub(r"tuvl-(<hex>|[0-9a-f]{16})(-t?\d+)+", "<idempotency key>", line)
    line = re.sub(r"\b(run|runs) \d+\b", r"\1 <id>", line)
    line = re.sub(r"\s*\+$", "", line)         # psql's mark of a value's line break
    line = re.sub(r"-{3,}", "---", line)
    line = re.sub(r"\s+", " ", line).strip()
    line = re.sub(r" ?([|+]) ?", r"\1", line)
    return line


def is_error(line):
    return re.match(r"^(psql:[^:]*:\d+: )?(ERROR|FATAL|PANIC):|^psql:[^:]*:\d+: error:|"
                    r"^(psql:[^:]*:\d+: )?(unterminated|invalid command)", line) is not None


def compare(expected, actual, errors_only):
    """None when expected's lines appear in actual in order, else why not."""
    skip = ("DETAIL:", "HINT:", "CONTEXT:")
    want = []
    for raw in ports(expected).split("\n"):
        n = norm(raw)
        if not n or n in ("...", "…") or n.startswith(skip):
            continue
        if errors_only and not n.startswith("ERROR:"):
            continue
        want.append(n)
    have = [norm(raw) for raw in actual.split("\n")]
    if errors_only:
        have = [h for h in have if h.startswith("ERROR:")]
    def matches(w, h):
        if "..." not in w:
            return w == h
        # "..." inside a line: the page shortened it
        return re.fullmatch(".*?".join(re.escape(part) for part in w.split("...")), h) is not None

    def in_order(want, have):
        i = 0
        for w in want:
            while i < len(have) and not matches(w, have[i]):
                i += 1
            if i == len(have):
                return f"the page shows {w!r}, which psql did not print (in this order)"
            i += 1
        return None

    # psql prints a notification when it next looks, after whichever command
    # was running when it arrived: notifications keep their order among
    # themselves, not their place among the results.
    def note(line):
        return line.startswith("Asynchronous notification ")
    return (in_order([w for w in want if not note(w)], [h for h in have if not note(h)])
            or in_order([w for w in want if note(w)], [h for h in have if note(h)]))


# ---------------------------------------------------------------------------
# Running a page

def sh(cmd, db="postgres", check=True):
    out = subprocess.run([PSQL, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db, "-At", "-c", cmd],
                         capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{cmd}: {out.stderr.strip()}")
    return out.stdout


def dbname(page):
    return "doc_" + re.sub(r"[^a-z0-9]+", "_", os.path.basename(page).lower().rsplit(".", 1)[0])


def roles():
    return set(sh("SELECT rolname FROM pg_roles").split())


def cleanup(db, before_roles, text):
    sh(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    for r in sorted(roles() - before_roles):
        sh(f'DROP OWNED BY "{r}" CASCADE', check=False)
        sh(f'DROP ROLE IF EXISTS "{r}"', check=False)
    if "schedule" in text:
        sh(f"SELECT cron.unschedule(jobid) FROM cron.job WHERE database = '{db}'", check=False)
    if "ALTER SYSTEM" in text:
        sh("ALTER SYSTEM RESET ALL")
        sh("SELECT pg_reload_conf()")


def runnable(b):
    return b.kind in (SQL, SHELL) and not (b.marker and b.marker[0] in ("skip", "placeholder"))


def run_page(page, blocks, db, workdir, continued):
    """Run the blocks in one psql session; returns the failures."""
    script, order = [], []
    for n, (pg, b) in enumerate(continued + [(page, b) for b in blocks]):
        if not runnable(b):
            continue
        text = ports(b.text)
        if b.kind == SQL:
            script.append(text.rstrip() + "\n")
        else:
            path = os.path.join(workdir, f"block{n}.sh")
            with open(path, "w") as f:
                f.write("set -e -o pipefail\n" + text)
            script.append(f"\\! cd {workdir} && bash {path} </dev/null 2>&1; rc=$?; [ $rc -eq 0 ] || echo @@exit $rc@@\n")
        script.append(f"\\echo @@doctest {n}@@\n")
        order.append((n, pg, b))
    env = dict(os.environ, PGDATABASE=db)
    try:
        out = subprocess.run(["stdbuf", "-o0", "-e0", PSQL, "-X", "-d", db],
                             input="".join(script), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir,
                             timeout=PAGE_TIMEOUT).stdout
    except subprocess.TimeoutExpired as e:
        return [f"the page did not finish within {PAGE_TIMEOUT} s; its output:\n"
                + (e.output or b"").decode(errors="replace")[-2000:]]
    outputs, cur = {}, []
    for line in out.split("\n"):
        m = re.search(r"@@doctest (\d+)@@$", line)
        if m:
            # a shell block's output may lack its last newline
            if m.start() > 0:
                cur.append(line[:m.start()])
            outputs[int(m.group(1))] = "\n".join(cur)
            cur = []
        else:
            cur.append(line)
    failures = []
    for n, pg, b in order:
        where = f"{pg}:{b.line}"
        got = outputs.get(n)
        if got is None:
            failures.append(f"{where}: psql stopped before this block; the rest:\n" + "\n".join(cur)[-1500:])
            break
        if pg != page:
            if any(is_error(line) for line in got.split("\n")):
                failures.append(f"{where} (continued page): failed:\n{indent(got)}")
            continue
        errored = any(is_error(line) for line in got.split("\n"))
        if b.kind == SHELL and re.search(r"^@@exit \d+@@", got, re.M):
            errored = True
        want_error = b.marker is not None and b.marker[0] == "error"
        if errored and not want_error:
            failures.append(f"{where}: failed:\n{indent(got)}")
            continue
        if want_error and not errored:
            failures.append(f"{where}: marked error, but ran without one:\n{indent(got)}")
            continue
        if b.expected is not None and not (b.marker and b.marker[0] == "unchecked"):
            why = compare(b.expected.text, got, want_error)
            if why:
                failures.append(f"{where}: {why}; psql printed:\n{indent(got)}")
    return failures


def check_yaml(page, blocks, db):
    import yaml
    failures = []
    for b in blocks:
        if b.kind != YAML or (b.marker and b.marker[0] in ("skip", "placeholder")):
            continue
        where = f"{page}:{b.line}"
        try:
            docs = list(yaml.safe_load_all(b.text))
        except yaml.YAMLError as e:
            failures.append(f"{where}: not YAML: {str(e).splitlines()[0]}")
            continue
        whole = len(docs) == 1 and isinstance(docs[0], dict) and "name" in docs[0] and "steps" in docs[0]
        if not whole or (b.marker and b.marker[0] == "fragment"):
            continue
        rows = subprocess.run([PSQL, "-X", "-At", "-d", db, "-v", "src=" + ports(b.text)],
                              input="SELECT severity || ' ' || path || ': ' || message "
                                    "FROM tuvl.validate(:'src') WHERE severity = 'error' "
                                    # a name the reader registers elsewhere
                                    "AND message NOT LIKE '%does not exist%'\n",
                              capture_output=True, text=True)
        found = (rows.stdout + rows.stderr).strip()
        want_error = b.marker is not None and b.marker[0] == "error"
        if found and not want_error:
            failures.append(f"{where}: a whole workflow that tuvl.validate() finds wrong:\n{indent(found)}")
        elif want_error and not found:
            failures.append(f"{where}: marked error, but tuvl.validate() finds nothing wrong")
    return failures


def indent(text):
    lines = text.strip("\n").split("\n")
    if len(lines) > 40:
        lines = lines[:15] + ["    ..."] + lines[-20:]
    return "\n".join("    " + line for line in lines)


def test_page(page):
    blocks, page_markers = parse(page)
    for words in page_markers:
        if words[:2] == ["page", "skip"]:
            return "skip", (words[2] if len(words) > 2 else "")
    continued = []
    for words in page_markers:
        if words[0] == "continues":
            other = os.path.join(os.path.dirname(page), words[1])
            continued += [(other, b) for b in parse(other)[0]]
    if not any(runnable(b) or b.kind == YAML for b in blocks):
        return "ok", "0 blocks"
    db = dbname(page)
    before = roles()
    text = "".join(b.text for _, b in continued + [(page, b) for b in blocks])
    sh(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    sh(f"CREATE DATABASE {db}")
    creates = any(re.search(r"^\s*CREATE EXTENSION (IF NOT EXISTS )?tuvl\b", b.text, re.M | re.I)
                  for _, b in continued + [(page, b) for b in blocks] if b.kind == SQL and runnable(b))
    try:
        if not creates:
            sh("CREATE EXTENSION tuvl", db)
            # the page's first run must not wait for its workers
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and sh(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'tuvl worker' "
                    f"AND datname = '{db}'").strip() == "0":
                time.sleep(0.1)
        with tempfile.TemporaryDirectory(prefix="tuvl-doctest.") as workdir:
            os.chmod(workdir, 0o777)
            failures = run_page(page, blocks, db, workdir, continued)
        failures += check_yaml(page, blocks, db)
    finally:
        cleanup(db, before, text)
    n = sum(1 for b in blocks if runnable(b)) + sum(1 for b in blocks if b.kind == YAML)
    return ("fail", failures) if failures else ("ok", f"{n} blocks")


# ---------------------------------------------------------------------------
# Every page against the schema (formerly test/python/test_docs.py)

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


def check_plans(pages):
    """Each SELECT, WITH, INSERT, UPDATE and DELETE of a ```sql block is
    planned (EXPLAIN, nothing executed) in a fresh database: a column, view,
    function or argument type of tuvl that a page names and the code does
    not have fails here.  Statements with psql variables are left out, and
    so are those that fail only on the reader's own objects."""
    import psycopg2
    db = "doc_plans"
    sh(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    sh(f"CREATE DATABASE {db}")
    sh("CREATE EXTENSION tuvl", db)
    conn = psycopg2.connect(dbname=db)
    cur = conn.cursor()
    planned, theirs, wrong = 0, 0, []
    try:
        for page in pages:
            for b in parse(page)[0]:
                if b.kind != SQL:
                    continue
                for st in split_statements(b.text):
                    if not re.match(r"(?is)^(select|with|insert|update|delete)\b", st) \
                            or re.search(r"(^|\s)\\|:'|:\"|(?<![:\w]):[a-z_]+\b", st):
                        continue
                    try:
                        cur.execute("EXPLAIN " + st)
                        planned += 1
                    except psycopg2.Error as e:
                        message = (e.pgerror or str(e)).splitlines()[0]
                        # the router's functions exist only in a router database
                        if e.pgcode in ("42P01", "42883", "3F000", "42704") and \
                                "tuvl" not in message.replace('schema "tuvl_router"', ""):
                            theirs += 1
                        else:
                            wrong.append(f"{page}:{b.line}: {message}\n    {st[:200]}")
                    conn.rollback()
    finally:
        conn.close()
        sh(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    if planned <= 150 or theirs >= planned / 4:
        wrong.append(f"too few statements planned: {planned} planned, {theirs} on the reader's objects")
    return wrong


def check_names(pages):
    """tuvl.<name>( is a function of the extension, or a setting; a bare
    tuvl.<name> a function, table, view or setting, or a name the C code
    spells out (a metric, a span attribute), or a file of src/."""
    db = "doc_names"
    sh(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    sh(f"CREATE DATABASE {db}")
    try:
        sh("CREATE EXTENSION tuvl", db)
        known = set(sh("SELECT proname FROM pg_proc WHERE pronamespace = 'tuvl'::regnamespace "
                       "UNION SELECT relname FROM pg_class WHERE relnamespace = 'tuvl'::regnamespace "
                       "UNION SELECT substr(name, 6) FROM pg_settings WHERE name LIKE 'tuvl.%'", db).split())
    finally:
        sh(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    for d, _, files in os.walk(os.path.join(ROOT, "src")):
        for f in files:
            if f.endswith((".c", ".h")):
                known.add(f.split(".")[0] if f.startswith("tuvl.") else "")
                known |= set(re.findall(r'"tuvl\.([a-z_][a-z0-9_]*)', open(os.path.join(d, f)).read()))
    unknown = []
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        for m in re.finditer(r"(?<![/\w])tuvl\.([a-z_][a-z0-9_]*)(?![a-z0-9_.])", text):
            if m.group(1) not in known | {"so", "control", "c", "h"}:
                unknown.append(f"{page}: tuvl.{m.group(1)}")
    return sorted(set(unknown))


def main(args):
    missing = [v for v in NEEDED if not os.environ.get(v)]
    for tool in (PSQL, "/usr/bin/stdbuf"):
        if not os.access(tool, os.X_OK):
            missing.append(tool)
    try:
        import psycopg2  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as e:
        missing.append(str(e))
    if missing:
        print("not ok 1 - the doc test needs " + ", ".join(missing) +
              " (run it through test/run docs, which starts the cluster and the servers)")
        return 1
    all_pages = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                       if f.endswith(".md"))
    pages = args or all_pages
    n, failed = 0, 0
    for page in pages:
        n += 1
        started = time.monotonic()
        status, what = test_page(page)
        took = time.monotonic() - started
        if status == "ok":
            print(f"ok {n} - {page} ({what}, {took:.1f} s)", flush=True)
        elif status == "skip":
            print(f"ok {n} - {page} # skip {what}", flush=True)
        else:
            failed += 1
            print(f"not ok {n} - {page} ({took:.1f} s)")
            for f in what:
                print(indent(f))
            sys.stdout.flush()
    if not args:
        for name, check in (("every query of the pages plans against the schema", check_plans),
                            ("every tuvl.<name> the pages mention exists", check_names)):
            n += 1
            wrong = check(all_pages)
            if wrong:
                failed += 1
                print(f"not ok {n} - {name}")
                for w in wrong:
                    print(indent(w))
            else:
                print(f"ok {n} - {name}")
    print(f"# {n - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
