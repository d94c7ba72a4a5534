"""Shared fixtures and helpers of the tuvl integration, concurrency and crash suite.

test/run starts a throwaway cluster and exports PGHOST (its socket directory),
PGPORT, PGUSER=postgres, TUVL_TMP (where server.log lives) and TUVL_PGDATA.
Every test module gets its own database with the extension installed
(fixture ``db``); tests that change server settings do it through
``set_gucs`` (or ``GucSetter``), which always resets them; tests that crash
or restart the server wait until it accepts connections again
(``wait_for_server``), and the session ends with ``ensure_server_running``.
"""
import os
import re
import select
import signal
import subprocess
import time
import warnings

import psycopg2
import psycopg2.errors
import pytest

PGBIN = os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin")

# test/run asan: the server under AddressSanitizer, whose allocator (a
# quarantine, shadow memory) and a two- to threefold slowdown make heap
# layout, memory and sub-second timing assertions meaningless.  A test
# marked so is skipped there, with this reason in pytest's summary; it
# runs everywhere else.
UNDER_ASAN = bool(os.environ.get("TUVL_ASAN"))
ASAN_SKIP_REASON = "asserts heap layout, memory or timing, which AddressSanitizer changes"
not_under_asan = pytest.mark.skipif(UNDER_ASAN, reason=ASAN_SKIP_REASON)
# PostgreSQL built for test/run asan has no LLVM: what needs JIT runs elsewhere
ASAN_NO_JIT_REASON = "the AddressSanitizer build of PostgreSQL has no JIT (no LLVM)"
PGDATA = os.environ.get("TUVL_PGDATA")
TMPDIR = os.environ.get("TUVL_TMP")
SERVER_LOG = os.path.join(TMPDIR, "server.log") if TMPDIR else None

# Every test is bounded; these are the generous outer limits of waits.
SERVER_START_TIMEOUT = 60


def _require_cluster():
    if not os.environ.get("PGHOST") or not PGDATA or not TMPDIR:
        pytest.exit("run the suite through test/run (PGHOST, TUVL_PGDATA and TUVL_TMP must be set)",
                    returncode=2)


def connect(dbname="postgres", user=None, autocommit=True, **kw):
    """A new connection to the test cluster; autocommit unless told otherwise."""
    conn = psycopg2.connect(dbname=dbname, user=user or os.environ.get("PGUSER", "postgres"),
                            application_name="tuvl pytest", connect_timeout=10, **kw)
    conn.autocommit = autocommit
    return conn


def register_workflows(db, *sources):
    """Register each workflow source in db (as the superuser); returns db,
    for module fixtures that only register what their tests run."""
    conn = connect(db)
    try:
        for source in sources:
            q(conn, "SELECT tuvl.register_workflow(%s)", (source,))
    finally:
        conn.close()
    return db


def q(conn, sql, params=None):
    """Execute and return every row (or None for statements without rows)."""
    with conn.cursor() as cur:
        cur.execute(sql, params)
        if cur.description is None:
            return None
        return cur.fetchall()


def q1(conn, sql, params=None):
    """Execute and return the first column of the first row."""
    rows = q(conn, sql, params)
    return rows[0][0] if rows else None


def query(dbname, sql, params=None, user=None):
    """One statement on a short-lived connection."""
    conn = connect(dbname, user=user)
    try:
        return q(conn, sql, params)
    finally:
        conn.close()


def wait_until(predicate, timeout, interval=0.05, message=None, ignore=()):
    """Poll predicate until it returns something truthy; returns that value.

    Raises AssertionError after timeout seconds.  Exceptions of the types in
    ``ignore`` (e.g. connection errors during a restart) count as "not yet".
    """
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ignore as exc:  # noqa: PERF203 - retry on purpose
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout} s waiting for "
                                 f"{message or getattr(predicate, '__name__', 'condition')}{detail}")
        time.sleep(interval)


def worker_rows(dbname):
    """(pid, application_name, state, query) of the tuvl workers of a database."""
    return query("postgres",
                 "SELECT pid, application_name, state, query FROM pg_stat_activity "
                 "WHERE backend_type = 'tuvl worker' AND datname = %s ORDER BY pid",
                 (dbname,))


def worker_pids(dbname):
    """Pids of the tuvl workers connected to a database, sorted."""
    return [r[0] for r in worker_rows(dbname)]


def launcher_pid():
    rows = query("postgres", "SELECT pid FROM pg_stat_activity WHERE backend_type = 'tuvl launcher'")
    return rows[0][0] if rows else None


def pg_ctl(*args, timeout=120):
    """Run pg_ctl on the test cluster as the postgres OS user."""
    # the server's executable (TUVL_VALGRIND in test/lib.sh) survives restarts
    server = ["-p", os.environ["TUVL_POSTGRES"]] if os.environ.get("TUVL_POSTGRES") else []
    cmd = ["runuser", "-u", "postgres", "--", os.path.join(PGBIN, "pg_ctl"), "-D", PGDATA, *server, *args]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout, check=True, text=True)


def server_accepts_connections():
    try:
        conn = connect("postgres")
    except psycopg2.OperationalError:
        return False
    try:
        return q1(conn, "SELECT 1") == 1
    except psycopg2.Error:
        return False
    finally:
        conn.close()


def wait_for_server(timeout=SERVER_START_TIMEOUT):
    """Wait until the server accepts connections again (after a crash restart)."""
    return wait_until(server_accepts_connections, timeout, interval=0.05,
                      message="the server to accept connections")


def kill_worker(pid, server_log):
    """kill -9 a tuvl worker and return once the server has gone through
    crash recovery and accepts connections again."""
    mark = server_log.mark()
    os.kill(pid, signal.SIGKILL)
    server_log.wait_for(mark, r"all server processes terminated; reinitializing", 30)
    wait_for_server()


def wait_run_finished(conn, run_id, timeout=40):
    """Wait until run_id has ended (connections may fail while the server restarts)."""
    wait_until(lambda: q1(conn, "SELECT finished_at IS NOT NULL FROM tuvl.runs WHERE id = %s",
                          (run_id,)), timeout, interval=0.1,
               message="the run to finish after the crash", ignore=(psycopg2.OperationalError,))


def ensure_server_running():
    """Leave a healthy server behind, whatever a test did to it."""
    if server_accepts_connections():
        return
    pidfile = os.path.join(PGDATA, "postmaster.pid")
    if not os.path.exists(pidfile):
        pg_ctl("-l", SERVER_LOG, "-w", "-t", "60", "start")
    wait_for_server()


class ServerLog:
    """The server log of the test cluster, read from a mark onwards."""

    def __init__(self, path=SERVER_LOG):
        self.path = path

    def mark(self):
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def since(self, mark):
        with open(self.path, "r", encoding="utf-8", errors="replace") as f:
            f.seek(mark)
            return f.read()

    def wait_for(self, mark, pattern, timeout):
        regex = re.compile(pattern)
        return wait_until(lambda: regex.search(self.since(mark)), timeout,
                          message=f"server log line matching {pattern!r}")


def log_timestamp(line):
    """Epoch seconds of a server log line ('%m [%p] ...' prefix, UTC or local)."""
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) (\S+)", line)
    if not m:
        return None
    # Let the server parse its own time zone abbreviation.
    return float(query("postgres", "SELECT extract(epoch FROM %s::timestamptz)",
                       (f"{m.group(1)} {m.group(2)}",))[0][0])


def listen_events(conn):
    """LISTEN on conn for journal events: on the channel tuvl.events_channel()
    gives its role (a superuser's or operator's carries every run's events).
    Returns the channel's name."""
    channel = q1(conn, "SELECT tuvl.events_channel()")
    q(conn, f'LISTEN "{channel}"')
    return channel


def listen_notifies(conn, timeout, until, complete=False):
    """Collect notifications on conn until until(list) is true; returns them.

    With complete=True, collect for the whole timeout and return what arrived
    (everything already queued is delivered at once).
    """
    got = []
    deadline = time.monotonic() + timeout
    while not until(got):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if complete:
                return got
            raise AssertionError(f"timed out after {timeout} s; notifications so far: {got}")
        if select.select([conn], [], [], min(remaining, 0.5)) == ([], [], []):
            continue
        conn.poll()
        while conn.notifies:
            got.append(conn.notifies.pop(0))
    return got


MEASUREMENTS = []


def report(message):
    """Print a measured number and repeat it in the summary at the end of the run."""
    message = message.strip()
    print("\n" + message)
    MEASUREMENTS.append(message)


def pytest_terminal_summary(terminalreporter):
    if MEASUREMENTS:
        terminalreporter.section("tuvl measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def cluster():
    """The cluster test/run started; left running at the end."""
    _require_cluster()
    wait_for_server()
    yield
    ensure_server_running()


@pytest.fixture
def server_log():
    return ServerLog()


@pytest.fixture
def conns():
    """Connection factory: conns(dbname, user=None, autocommit=True); all closed at teardown."""
    opened = []

    def factory(dbname="postgres", user=None, autocommit=True):
        conn = connect(dbname, user=user, autocommit=autocommit)
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        try:
            conn.close()
        except psycopg2.Error:
            pass


def _workers_per_database():
    return int(query("postgres", "SHOW tuvl.workers_per_database")[0][0])


def create_database(name):
    admin = connect("postgres")
    try:
        q(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        q(admin, f'CREATE DATABASE "{name}"')
    finally:
        admin.close()
    conn = connect(name)
    try:
        q(conn, "CREATE EXTENSION tuvl")
    finally:
        conn.close()


def drop_database(name, drop_extension=True):
    """DROP EXTENSION (workers leave by themselves), then DROP DATABASE ... WITH (FORCE)."""
    ensure_server_running()
    if drop_extension:
        try:
            conn = connect(name)
        except psycopg2.OperationalError:
            conn = None
        if conn is not None:
            try:
                for attempt in range(3):
                    try:
                        q(conn, "DROP EXTENSION IF EXISTS tuvl CASCADE")
                        break
                    except psycopg2.errors.DeadlockDetected:
                        # see test_workers.py::test_drop_extension_while_runs_execute_...
                        continue
            except psycopg2.Error:
                pass  # DROP DATABASE ... WITH (FORCE) below still cleans up
            finally:
                conn.close()
            try:
                wait_until(lambda: not worker_pids(name), 10, interval=0.1,
                           message=f"the workers of {name} to exit")
            except AssertionError:
                pass  # FORCE below terminates them anyway
    admin = connect("postgres")
    try:
        q(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()


@pytest.fixture(scope="module")
def db(request):
    """A fresh database tuvl_<module> with the extension and its worker pool running."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    name = "tuvl_" + re.sub(r"^test_", "", module)
    create_database(name)
    want = _workers_per_database()
    try:
        wait_until(lambda: len(worker_pids(name)) == want, 3,
                   message=f"{want} tuvl workers in {name}")
    except AssertionError:
        # The launcher's probe of a new database can race with CREATE EXTENSION
        # (see test_workers.py::test_create_extension_in_a_long_transaction_...):
        # installing again makes it look once more.
        warnings.warn(f"no tuvl workers in {name} after CREATE EXTENSION; installing again")
        conn = connect(name)
        try:
            q(conn, "DROP EXTENSION tuvl")
            q(conn, "CREATE EXTENSION tuvl")
        finally:
            conn.close()
        wait_until(lambda: len(worker_pids(name)) == want, 10,
                   message=f"{want} tuvl workers in {name}")
    yield name
    drop_database(name)


@pytest.fixture
def fresh_databases():
    """Factory of extra databases (without the extension); dropped at teardown."""
    made = []

    def factory(name):
        admin = connect("postgres")
        try:
            q(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            q(admin, f'CREATE DATABASE "{name}"')
        finally:
            admin.close()
        made.append(name)
        return name

    yield factory
    for name in made:
        drop_database(name)


_GUC_NAME = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?$")


CRASH_PATTERN = r"terminated by signal|all server processes terminated; reinitializing"


def reload_conf():
    """pg_reload_conf(); returns True when the reload crashed the server.

    A reload must never take the server down (it once crashed the launcher:
    test_workers.py::test_config_reload_does_not_crash_the_server).  If it
    does, the server has been reinitialised with the new settings: wait
    until it accepts connections again, so that the tests that only need
    the settings still test their own behaviour, and warn.
    """
    log = ServerLog()
    mark = log.mark()
    admin = connect("postgres")
    try:
        q(admin, "SELECT pg_reload_conf()")
    except psycopg2.OperationalError:
        pass  # the connection died with the server: the log says why
    finally:
        admin.close()
    # The launcher and the workers handle SIGHUP at once; a crash shows within a second.
    deadline = time.monotonic() + 1.0
    crashed = False
    while time.monotonic() < deadline and not crashed:
        time.sleep(0.05)
        crashed = re.search(CRASH_PATTERN, log.since(mark)) is not None
    if crashed:
        warnings.warn("pg_reload_conf() crashed the server; it was reinitialised")
        log.wait_for(mark, r"database system is ready to accept connections", SERVER_START_TIMEOUT)
        wait_for_server()
    return crashed


def _reload_and_wait(expected):
    reload_conf()

    def applied():
        conn = connect("postgres")
        try:
            return all(q1(conn, "SELECT current_setting(%s)", (n,)) == v
                       for n, v in expected.items())
        finally:
            conn.close()

    wait_until(applied, 10, message=f"settings {expected} to be reloaded",
               ignore=(psycopg2.OperationalError,))


class GucSetter:
    """ALTER SYSTEM SET + reload, remembering every setting it touched for reset()."""

    def __init__(self):
        self.touched = []

    def __call__(self, settings):
        """settings: {name: value}; a (value, shown) pair also waits until SHOW prints shown."""
        expected = {}
        admin = connect("postgres")
        try:
            for name, value in settings.items():
                assert _GUC_NAME.match(name), name
                shown = None
                if isinstance(value, tuple):
                    value, shown = value
                if name not in self.touched:
                    self.touched.append(name)
                q(admin, f"ALTER SYSTEM SET {name} = %s", (str(value),))
                if shown is not None:
                    expected[name] = shown
        finally:
            admin.close()
        _reload_and_wait(expected)

    def reset(self):
        if not self.touched:
            return
        ensure_server_running()
        admin = connect("postgres")
        try:
            for name in self.touched:
                q(admin, f"ALTER SYSTEM RESET {name}")
        finally:
            admin.close()
        self.touched = []
        reload_conf()


@pytest.fixture
def set_gucs():
    """set_gucs({'tuvl.lease_timeout': ('2s', '2s'), ...}); always reset at teardown."""
    setter = GucSetter()
    yield setter
    setter.reset()


# ---------------------------------------------------------------------------
# Journal checks shared by several modules


def journal_violations(conn, run_ids=None):
    """Runs whose journal is not exactly seq 1..n, or whose last_seq disagrees.

    Returns a list of (run_id, n_events, min_seq, max_seq, distinct_seq, last_seq).
    """
    return q(conn, """
        SELECT r.id, count(e.seq), min(e.seq), max(e.seq), count(DISTINCT e.seq), r.last_seq
          FROM tuvl.runs r LEFT JOIN tuvl.events e ON e.run_id = r.id
         WHERE %(ids)s::bigint[] IS NULL OR r.id = ANY(%(ids)s::bigint[])
         GROUP BY r.id, r.last_seq
        HAVING count(e.seq) = 0 OR min(e.seq) <> 1 OR max(e.seq) <> count(e.seq)
            OR count(DISTINCT e.seq) <> count(e.seq) OR max(e.seq) <> r.last_seq
         ORDER BY r.id""", {"ids": run_ids})


def expected_event_types(step_ids):
    """The journal of a run that went through step_ids once each and completed."""
    types = ["run_queued", "run_started"]
    for _ in step_ids:
        types += ["agent_started", "agent_completed", "signal", "checkpoint"]
    return types + ["run_completed"]


def expected_agent_ids(step_ids):
    ids = [None, None]
    for s in step_ids:
        ids += [s, s, s, s]
    return ids + [None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under test/run (TUVL_REQUIRE_PEERS) every peer server is there, so a
    test skipped for want of one is a failure: coverage lost in silence.
    Only not_under_asan's skip and the JIT test's, under test/run asan,
    stay skips."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("TUVL_REQUIRE_PEERS") and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if UNDER_ASAN and (ASAN_SKIP_REASON in reason or ASAN_NO_JIT_REASON in reason):
            return
        rep.outcome = "failed"
        rep.longrepr = f"skipped under test/run, where every peer server must be running: {reason}"
