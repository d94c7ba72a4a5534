"""Automatic failover with pg_auto_failover (test/run ha; docs/scaling.md).

Builds a formation on 127.0.0.1 (a monitor, a primary and a synchronous
secondary, each managed by its own pg_autoctl keeper) with the monitor
timeouts the runbook recommends, runs a mixed load on it through a
multi-host connection string (five-step runs with an SQL effect, a Sleep
timer and an Agent step against the scripted LLM server; a Human step
waiting), stops the primary's WAL sender for a second (the standby falls
behind), kills the primary's whole "host" (its keeper and every
PostgreSQL process, kill -9) and checks that the formation fails over by
itself: every run a client saw acknowledged completes exactly once with a
gapless journal, the timers fire, the waiting Human step is answered on the
new primary, the clients reconnect, and tuvl's workers wait quietly while
the promoted node is still read-only.  The Insight server (insight/tuvl
serve) and the CLI use a multi-host connection string too: the server
answers 503 with Retry-After (never a 500) while no node is read-write,
starts runs on the new primary as soon as it is, and an event stream
opened before the kill gets every event of its run once.  Prints the
measured times (lines starting with "ha:").

TUVL_HA_ASYNC=1 makes the standby asynchronous (replication-quorum false),
to see what synchronous replication buys.

Needs pg_autoctl on PATH and pg_auto_failover's extension in PGBIN's
installation: test/run installs them; missing, the suite fails.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psycopg2
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "servers"))
from insight_proc import INSIGHT, InsightProcess  # noqa: E402

PGBIN = os.environ.get("PGBIN", "/usr/lib/postgresql/15/bin")
PG_CONFIG = os.environ.get("PG_CONFIG", os.path.join(PGBIN, "pg_config"))
LLM_URL = os.environ.get("TUVL_LLM_URL")

# The runbook's monitor settings (docs/scaling.md, "Failover"): a dead
# primary is noticed in about 2 s instead of 20, and the promoted standby
# waits 5 s (not 30) for the old primary to demote itself.
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": "1000",
    "pgautofailover.health_check_timeout": "1000",
    "pgautofailover.health_check_max_retries": "1",
    "pgautofailover.health_check_retry_delay": "500",
    "pgautofailover.node_considered_unhealthy_timeout": "2000",
    "pgautofailover.primary_demote_timeout": "5000",
}
# ... and the keepers': a primary that loses the monitor and its standby
# demotes itself after 3 s, before the standby can be promoted (5 s).
KEEPER_SETTINGS = {"timeout.network_partition_timeout": "3"}

# Bounds of the test (the measured times are printed, see docs/scaling.md).
FAILOVER_LIMIT = 45       # kill -> read-write new primary
DRAIN_LIMIT = 90          # kill -> every acknowledged run completed

FIVE = """
name: ha_five
trigger:
  input: { type: object, required: [n], properties: { n: { type: integer } } }
steps:
  - id: one
    kind: ModelOp
    sql: INSERT INTO public.ha_effects (n, step) VALUES ($1, 'one')
    params: ["{{ n }}"]
  - id: nap
    kind: Sleep
    for: 1s
  - id: think
    kind: Agent
    mode: completion
    agent: { model: ha_echo, prompt: "run {{ n }}" }
  - id: two
    kind: ModelOp
    sql: INSERT INTO public.ha_effects (n, step) VALUES ($1, 'two')
    params: ["{{ n }}"]
  - id: three
    kind: ModelOp
    sql: INSERT INTO public.ha_effects (n, step) VALUES ($1, 'three')
    params: ["{{ n }}"]
ends:
  - { id: done, status: completed }
"""

HELLO = """
name: ha_hello
steps:
  - {id: hi, kind: ModelOp, sql: "SELECT 1 AS x"}
ends:
  - {id: done, status: completed}
"""


ASK = """
name: ha_ask
steps:
  - id: ask
    kind: Human
    form: { type: object, required: [ok], properties: { ok: { type: boolean } } }
ends:
  - { id: done, status: completed, response: "{{ ask_result }}" }
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def as_owner(cmd):
    """initdb and pg_autoctl refuse root: run them as postgres then."""
    return (["runuser", "-u", "postgres", "--"] + cmd) if os.geteuid() == 0 else cmd


class Formation:
    """A monitor and two nodes, each with its pg_autoctl keeper."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp(prefix="tuvl-ha.")
        os.chmod(self.tmp, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.tmp, "postgres", "postgres")
        self.env = dict(os.environ, PG_CONFIG=PG_CONFIG,
                        XDG_CONFIG_HOME=f"{self.tmp}/xdg/config",
                        XDG_DATA_HOME=f"{self.tmp}/xdg/data",
                        XDG_RUNTIME_DIR=f"{self.tmp}/xdg/run")
        for k in ("PGHOST", "PGPORT", "PGDATABASE", "PGUSER"):
            self.env.pop(k, None)
        self.pg_autoctl = shutil.which("pg_autoctl")
        self.ports = {"monitor": free_port(), "node1": free_port(), "node2": free_port()}
        self.keepers = {}
        self.monitor_uri = (f"postgres://autoctl_node@127.0.0.1:{self.ports['monitor']}"
                            "/pg_auto_failover?sslmode=disable")
        self.uri = ("postgresql://127.0.0.1:{},127.0.0.1:{}/postgres?user=postgres"
                    "&target_session_attrs=read-write&connect_timeout=2").format(
                        self.ports["node1"], self.ports["node2"])

    def ctl(self, *args, log=None):
        out = open(log, "w") if log else subprocess.PIPE
        r = subprocess.run(as_owner([self.pg_autoctl, *args]), env=self.env, stdout=out,
                           stderr=subprocess.STDOUT, text=True, errors="replace", timeout=300)
        if r.returncode != 0:
            text = open(log).read() if log else r.stdout
            raise AssertionError(f"pg_autoctl {' '.join(args)} failed:\n{text[-3000:]}")
        return r.stdout

    def run_keeper(self, name):
        log = open(f"{self.tmp}/{name}.keeper.log", "w")
        self.keepers[name] = subprocess.Popen(
            as_owner([self.pg_autoctl, "run", "--pgdata", f"{self.tmp}/{name}"]), env=self.env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def connect(self, name, dbname="postgres", **kw):
        return psycopg2.connect(host="127.0.0.1", port=self.ports[name], dbname=dbname,
                                user="postgres", connect_timeout=2, **kw)

    def wait_sql(self, name, sql, want, timeout, dbname="postgres"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                c = self.connect(name, dbname)
                try:
                    c.autocommit = True
                    with c.cursor() as cur:
                        cur.execute(sql)
                        last = cur.fetchone()[0]
                finally:
                    c.close()
                if last == want:
                    return
            except psycopg2.Error as e:
                last = e
            time.sleep(0.1)
        raise AssertionError(f"{name}: {sql} gave {last!r}, not {want!r}, for {timeout} s")

    def build(self):
        t = self.tmp
        common = ["--auth", "trust", "--no-ssl", "--pgctl", f"{PGBIN}/pg_ctl", "--hostname", "127.0.0.1"]
        self.ctl("create", "monitor", "--pgdata", f"{t}/monitor", "--pgport", str(self.ports["monitor"]),
                 *common, log=f"{t}/monitor.create.log")
        # pg_autoctl starts the monitor with -h *: keep every server on 127.0.0.1
        self.ctl("config", "set", "--pgdata", f"{t}/monitor", "postgresql.listen_addresses", "127.0.0.1")
        self.run_keeper("monitor")
        self.wait_sql("monitor", "SELECT 1", 1, 60, dbname="pg_auto_failover")
        mon = self.connect("monitor", "pg_auto_failover")
        mon.autocommit = True
        with mon.cursor() as cur:
            for k, v in MONITOR_SETTINGS.items():
                cur.execute(f"ALTER SYSTEM SET {k} = %s", (v,))
            cur.execute("SELECT pg_reload_conf()")
        mon.close()
        for name in ("node1", "node2"):
            self.ctl("create", "postgres", "--pgdata", f"{t}/{name}", "--pgport", str(self.ports[name]),
                     "--listen", "127.0.0.1", "--name", name, "--monitor", self.monitor_uri, *common,
                     log=f"{t}/{name}.create.log")
            for k, v in KEEPER_SETTINGS.items():
                self.ctl("config", "set", "--pgdata", f"{t}/{name}", k, v)
            if name == "node1":
                # the standby is a base backup of this directory: it inherits these
                with open(f"{t}/node1/postgresql.conf", "a") as f:
                    f.write("shared_preload_libraries = 'tuvl'\nmax_worker_processes = 20\n"
                            "log_line_prefix = '%m [%p] %q%a '\n"
                            "tuvl.http_allowed_hosts = '127.0.0.1:*'\n")
            self.run_keeper(name)
            if name == "node1":
                self.wait_sql("node1", "SELECT NOT pg_is_in_recovery()", True, 120)
                c = self.connect("node1")
                c.autocommit = True
                with c.cursor() as cur:
                    cur.execute("CREATE EXTENSION tuvl")
                c.close()
        self.wait_states({"node1": "primary", "node2": "secondary"}, 180)
        if os.environ.get("TUVL_HA_ASYNC"):
            # to see the test fail without synchronous replication
            # (the monitor's function: pg_autoctl set node ... garbles the node name)
            mon = self.connect("monitor", "pg_auto_failover")
            mon.autocommit = True
            with mon.cursor() as cur:
                cur.execute("SELECT pgautofailover.set_node_replication_quorum('default', 'node2', false)")
            mon.close()
            self.wait_sql("node1", "SELECT current_setting('synchronous_standby_names')", "", 60)
            return
        # synchronous: a commit returns once the standby has it
        self.wait_sql("node1", "SELECT current_setting('synchronous_standby_names') <> ''", True, 60)

    def states(self):
        c = self.connect("monitor", "pg_auto_failover")
        try:
            with c.cursor() as cur:
                cur.execute("SELECT nodename, reportedstate::text, goalstate::text FROM pgautofailover.node")
                return {n: (r, g) for n, r, g in cur.fetchall()}
        finally:
            c.close()

    def wait_states(self, want, timeout):
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            try:
                got = self.states()
                if all(got.get(n, (None, None)) == (s, s) for n, s in want.items()):
                    return
            except psycopg2.Error as e:
                got = e
            time.sleep(0.2)
        raise AssertionError(f"formation states {got}, not {want}, after {timeout} s")

    def host_pids(self, name):
        """The node's keeper with its children and every PostgreSQL process of its data directory."""
        pids = set()
        keeper = self.keepers[name].pid
        todo = [keeper]
        while todo:
            p = todo.pop()
            pids.add(p)
            try:
                with open(f"/proc/{p}/task/{p}/children") as f:
                    todo += [int(x) for x in f.read().split()]
            except OSError:
                pass
        try:
            with open(f"{self.tmp}/{name}/postmaster.pid") as f:
                pm = int(f.readline())
            pids.add(pm)
            with open(f"/proc/{pm}/task/{pm}/children") as f:
                pids.update(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
        return pids

    def kill_host(self, name):
        pids = self.host_pids(name)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def log_text(self, name):
        text = ""
        d = f"{self.tmp}/{name}/log"
        for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            with open(os.path.join(d, fn), errors="replace") as f:
                text += f.read()
        return text

    def stop(self):
        for name, p in self.keepers.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.keepers.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # anything left (a keeper that hung, or a postmaster it left behind)
        for name in ("monitor", "node1", "node2"):
            for p in self.host_pids(name) if name in self.keepers else ():
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not os.environ.get("TUVL_HA_KEEP"):
            shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def formation():
    if not shutil.which("pg_autoctl"):
        pytest.fail("pg_autoctl is not on PATH: install postgresql-15-auto-failover (test/run does)")
    if not os.path.exists(os.path.join(
            subprocess.run([PG_CONFIG, "--sharedir"], capture_output=True, text=True).stdout.strip(),
            "extension", "pgautofailover.control")):
        pytest.fail(f"pg_auto_failover's extension is not installed for {PG_CONFIG}")
    if not LLM_URL:
        pytest.fail("TUVL_LLM_URL is not set: run the suite through test/run")
    f = Formation()
    try:
        f.build()
        yield f
    finally:
        f.stop()


class Client(threading.Thread):
    """Starts ha_five runs through the multi-host connection string, as an
    application would, reconnecting after errors; records every run whose
    start_run() returned (acknowledged: committed on the primary and, with
    synchronous replication, on the standby)."""

    def __init__(self, uri, first_n):
        super().__init__(daemon=True)
        self.uri = uri
        self.n = first_n
        self.acked = {}            # n -> run id
        self.errors = 0
        self.reconnects = 0
        self.stop_flag = threading.Event()

    def run(self):
        conn = None
        while not self.stop_flag.is_set():
            try:
                if conn is None:
                    conn = psycopg2.connect(self.uri)
                    conn.autocommit = True
                    self.reconnects += 1
                with conn.cursor() as cur:
                    cur.execute("SELECT tuvl.start_run('ha_five', jsonb_build_object('n', %s))", (self.n,))
                    self.acked[self.n] = cur.fetchone()[0]
                self.n += 1
                time.sleep(0.02)
            except psycopg2.Error:
                self.errors += 1
                self.n += 1        # a start without an answer: unknown, never reused
                try:
                    conn and conn.close()
                except psycopg2.Error:
                    pass
                conn = None
                time.sleep(0.2)
        if conn is not None:
            conn.close()


def rw(f):
    return psycopg2.connect(f.uri)


class Insight(InsightProcess):
    """insight/tuvl serve on a multi-host connection string (key=value form)."""

    def __init__(self, f):
        super().__init__(f"host=127.0.0.1,127.0.0.1 port={f.ports['node1']},{f.ports['node2']} "
                         "dbname=postgres user=ha_auth target_session_attrs=read-write connect_timeout=2",
                         env=f.env, start_timeout=120)

    def request(self, method, path, token, body=None, timeout=10):
        return super().request(method, path, token, body, timeout)


class Stream(threading.Thread):
    """An SSE stream of a run's events, read to its end."""

    def __init__(self, insight, token, run_id):
        super().__init__(daemon=True)
        self.events = []            # (seq, type)
        self.opened = threading.Event()
        self.error = None
        self.insight, self.token, self.run_id = insight, token, run_id

    def run(self):
        try:
            c = self.insight.connection(120)
            c.request("GET", f"/api/runs/{self.run_id}/events",
                      headers={"Authorization": f"Bearer {self.token}", "Accept": "text/event-stream"})
            r = c.getresponse()
            assert r.status == 200, r.status
            msg = {}
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.decode().rstrip("\n")
                if line == "":
                    if "id" in msg:
                        self.events.append((int(msg["id"]), msg.get("event")))
                        self.opened.set()
                    elif msg.get("event") == "stream_error":
                        self.error = msg
                    msg = {}
                elif not line.startswith(":"):
                    k, _, v = line.partition(":")
                    msg[k] = v.lstrip(" ")
            c.close()
        except Exception as e:      # reported by the test
            self.error = repr(e)
        finally:
            self.opened.set()


class Starter(threading.Thread):
    """POSTs a start through the Insight server every 0.2 s from the kill
    until one is accepted; records every answer."""

    def __init__(self, insight, token):
        super().__init__(daemon=True)
        self.insight, self.token = insight, token
        self.answers = []           # (time, status, retry-after, body)
        self.t_ok = None

    def run(self):
        deadline = time.monotonic() + FAILOVER_LIMIT + 15
        while time.monotonic() < deadline:
            try:
                st, h, body = self.insight.request("POST", "/api/workflows/ha_hello/runs", self.token, {})
            except OSError as e:
                st, h, body = None, {}, repr(e)
            self.answers.append((time.time(), st, h.get("Retry-After"), body))
            if st == 202:
                self.t_ok = time.time()
                return
            time.sleep(0.2)


def test_failover_keeps_every_run(formation, request):
    f = formation
    c = rw(f)
    c.autocommit = True
    cur = c.cursor()
    cur.execute("CREATE TABLE public.ha_effects (n integer NOT NULL, step text NOT NULL)")
    cur.execute("SELECT tuvl.register_llm(%s)",
                (f"name: ha_echo\nprovider: openai\nbase_url: {LLM_URL}\nmodel: echo\ntimeout: 10s\n",))
    cur.execute("SELECT tuvl.register_workflow(%s)", (FIVE,))
    # the Insight server's roles (docs/insight.md): an application role and
    # the authenticator that may act as it; the Human run is the app's
    cur.execute("CREATE ROLE ha_app")
    cur.execute("GRANT tuvl_user TO ha_app")
    cur.execute("CREATE ROLE ha_auth LOGIN NOINHERIT")
    cur.execute("GRANT ha_app TO ha_auth")
    cur.execute("SELECT tuvl.create_token('ha_app', '{runs:start,runs:read,people:answer}', '1 hour')")
    token = cur.fetchone()[0]
    cur.execute("SET ROLE ha_app")
    cur.execute("SELECT tuvl.register_workflow(%s)", (HELLO,))
    cur.execute("SELECT tuvl.register_workflow(%s)", (ASK,))
    cur.execute("SELECT tuvl.start_run('ha_ask')")
    ask_id = cur.fetchone()[0]
    cur.execute("RESET ROLE")
    deadline = time.monotonic() + 30
    while True:
        cur.execute("SELECT status FROM tuvl.runs WHERE id = %s", (ask_id,))
        if cur.fetchone()[0] == "waiting_human":
            break
        assert time.monotonic() < deadline, "the Human step never waited"
        time.sleep(0.1)
    # a backlog of timers and queued work at the moment of the kill
    cur.execute("SELECT count(tuvl.start_run('ha_five', jsonb_build_object('n', -g))) "
                "FROM generate_series(1, 300) g")
    backlog = {-g for g in range(1, 301)}
    c.close()

    insight = Insight(f)
    request.addfinalizer(insight.stop)
    st, _, body = insight.request("POST", "/api/workflows/ha_hello/runs", token, {})
    assert st == 202, body
    stream = Stream(insight, token, ask_id)
    stream.start()
    assert stream.opened.wait(20) and stream.events, f"the event stream did not open: {stream.error}"

    client = Client(f.uri, 1)
    client.start()
    time.sleep(2.0)
    acked_before = len(client.acked)
    assert acked_before > 10, f"the client started only {acked_before} runs in 2 s"

    # the standby falls behind for a moment (the primary's WAL sender
    # stopped), as on a busy network: synchronous commits wait for it,
    # asynchronous ones would not ... and then the primary's whole host dies
    n1 = f.connect("node1")
    n1.autocommit = True
    with n1.cursor() as k:
        k.execute("SELECT pid FROM pg_stat_replication")
        walsender = k.fetchone()[0]
    n1.close()
    os.kill(walsender, signal.SIGSTOP)
    time.sleep(1.0)
    t_kill = time.time()
    killed = f.kill_host("node1")
    assert walsender in killed and len(killed) > 3
    starter = Starter(insight, token)
    starter.start()

    # the formation fails over by itself: node2 becomes a read-write primary
    t_rw = None
    deadline = time.monotonic() + FAILOVER_LIMIT
    while time.monotonic() < deadline:
        try:
            n2 = f.connect("node2")
            try:
                with n2.cursor() as k:
                    k.execute("SELECT NOT pg_is_in_recovery() AND "
                              "current_setting('default_transaction_read_only') = 'off'")
                    if k.fetchone()[0]:
                        t_rw = time.time()
                        break
            finally:
                n2.close()
        except psycopg2.Error:
            pass
        time.sleep(0.05)
    assert t_rw is not None, f"node2 was not a read-write primary {FAILOVER_LIMIT} s after the kill"

    # the Insight server reconnects by itself: a start through it succeeds
    # on the new primary soon after node2 is read-write, and before that
    # every answer is a 503 with Retry-After, never a 500
    starter.join(FAILOVER_LIMIT + 20)
    bad = [(st, ra, body[:200]) for _, st, ra, body in starter.answers
           if st != 202 and not (st == 503 and ra and '"sqlstate":"08006"' in body)]
    assert not bad, (f"the server answered during the failover: {bad[:5]}\n"
                     "its log:\n" + "".join(insight.log[-40:]))
    assert starter.t_ok is not None, "no start through the Insight server succeeded after the failover"
    assert starter.t_ok - t_rw < 3.0, \
        f"a start through the Insight server succeeded {starter.t_ok - t_rw:.1f} s after node2 was read-write"
    assert not [line for line in insight.log if '"level":50' in line], \
        "the server logged errors:\n" + "".join(line for line in insight.log if '"level":50' in line)[:3000]

    # clients reconnect and go on starting runs on the new primary
    deadline = time.monotonic() + 20
    acked_at_rw = len(client.acked)
    while len(client.acked) < acked_at_rw + 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    client.stop_flag.set()
    client.join(30)
    assert len(client.acked) >= acked_at_rw + 20, "the client did not start runs on the new primary"

    c = rw(f)
    c.autocommit = True
    cur = c.cursor()
    cur.execute("SELECT inet_server_port()")
    assert cur.fetchone()[0] == f.ports["node2"]

    # the Human step waiting since before the kill is answered on the new primary
    cur.execute("SELECT status FROM tuvl.runs WHERE id = %s", (ask_id,))
    assert cur.fetchone()[0] == "waiting_human"
    st, _, body = insight.request("POST", f"/api/runs/{ask_id}/submit", token, {"data": {"ok": True}})
    assert st == 200, body

    # every acknowledged run completes
    acked = dict(client.acked)
    want = len(acked) + len(backlog)
    deadline = time.monotonic() + DRAIN_LIMIT
    while True:
        cur.execute("SELECT count(*) FILTER (WHERE status = 'completed'), "
                    "count(*) FILTER (WHERE status IN ('failed', 'aborted')), count(*) "
                    "FROM tuvl.runs WHERE workflow = 'ha_five'")
        done, bad, total = cur.fetchone()
        if bad:
            cur.execute("SELECT id, status, current_step, error FROM tuvl.runs "
                        "WHERE status IN ('failed', 'aborted') LIMIT 3")
            raise AssertionError(f"{bad} runs failed across the failover: {cur.fetchall()}")
        if done >= want or (done == total and time.monotonic() > deadline - DRAIN_LIMIT + 30):
            break           # all done, or all there are (the lost ones are reported below)
        assert time.monotonic() < deadline, f"{done} of {want} runs completed {DRAIN_LIMIT} s after the kill"
        time.sleep(0.2)
    cur.execute("SELECT tuvl.wait(%s, '10 seconds')", (ask_id,))
    assert cur.fetchone()[0] == "completed"

    # the event stream opened before the kill got the run's every event once
    stream.join(20)
    assert not stream.is_alive(), (f"the event stream did not end with its run: it got {stream.events}; "
                                   "the server's log:\n" + "".join(insight.log[-40:]))
    assert stream.error is None, f"the event stream failed: {stream.error}"
    cur.execute("SELECT array_agg(seq ORDER BY seq) FROM tuvl.events WHERE run_id = %s", (ask_id,))
    journal = cur.fetchone()[0]
    assert [seq for seq, _ in stream.events] == journal, \
        f"the stream sent {[seq for seq, _ in stream.events]}, the journal has {journal}"
    assert stream.events[-1][1] == "run_completed"

    # the command line, on the URI form of the multi-host string
    cli = subprocess.run([INSIGHT, "runs", "list", "--workflow", "ha_ask", "--db", f.uri], env=f.env,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert re.search(rf"^{ask_id}\s+ha_ask\s+\d+\s+completed", cli.stdout, re.M), cli.stdout

    # ... exactly once: each acknowledged run (and the backlog) is there once,
    # its three SQL effects once each, its journal gapless with one end
    cur.execute("SELECT (input->>'n')::int, id, status FROM tuvl.runs WHERE workflow = 'ha_five'")
    rows = cur.fetchall()
    by_n = {}
    for n, rid, st in rows:
        by_n.setdefault(n, []).append(rid)
    lost = [n for n in list(acked) + sorted(backlog) if n not in by_n]
    dup = [n for n, ids in by_n.items() if len(ids) > 1]
    assert not lost, f"acknowledged runs lost: {lost[:10]}"
    assert not dup, f"runs started twice: {dup[:10]}"
    for n, rid in acked.items():
        assert by_n[n] == [rid]
    cur.execute("SELECT n, count(*) FROM public.ha_effects GROUP BY n HAVING count(*) <> 3 "
                "OR count(DISTINCT step) <> 3")
    assert cur.fetchall() == [], "a run's SQL effects did not happen exactly once"
    cur.execute("SELECT count(DISTINCT n) FROM public.ha_effects")
    assert cur.fetchone()[0] == len(by_n)
    cur.execute("""SELECT r.id FROM tuvl.runs r JOIN tuvl.events e ON e.run_id = r.id
                   GROUP BY r.id
                   HAVING count(*) <> max(e.seq) OR min(e.seq) <> 1
                       OR count(*) FILTER (WHERE e.type = 'run_completed') <> 1""")
    assert cur.fetchall() == [], "a journal has a gap or not exactly one end"
    # the timers fired: every run slept and woke
    cur.execute("SELECT count(DISTINCT run_id) FROM tuvl.events e JOIN tuvl.runs r ON r.id = e.run_id "
                "WHERE r.workflow = 'ha_five' AND e.type = 'agent_completed' AND e.agent_id = 'nap'")
    assert cur.fetchone()[0] == len(by_n)

    # the measurements
    cur.execute("SELECT extract(epoch FROM min(ts)) FROM tuvl.events "
                "WHERE type = 'agent_started' AND ts > to_timestamp(%s)", (t_kill,))
    t_first = cur.fetchone()[0]
    cur.execute("SELECT extract(epoch FROM max(finished_at)) FROM tuvl.runs WHERE workflow = 'ha_five' "
                "AND (input->>'n')::int <= %s", (max(acked),))
    t_drain = cur.fetchone()[0]
    c.close()
    numbers = {
        "promoted_read_write_s": round(t_rw - t_kill, 2),
        "first_step_s": round(float(t_first) - t_kill, 2),
        "backlog_drained_s": round(float(t_drain) - t_kill, 2),
        "acknowledged_runs": len(acked) + len(backlog),
        "lost": len(lost), "duplicated": len(dup),
        "client_errors": client.errors, "client_reconnects": client.reconnects - 1,
        "insight_start_ok_s": round(starter.t_ok - t_kill, 2),
        "insight_503s": sum(1 for a in starter.answers if a[1] == 503),
    }
    print("ha: " + json.dumps(numbers))
    out = os.environ.get("TUVL_HA_NUMBERS")
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(numbers) + "\n")

    # the workers waited quietly while the promoted node was read-only
    log = f.log_text("node2")
    readonly = re.findall(r".*ERROR:.*read-only transaction.*", log)
    assert readonly == [], "errors while read-only:\n" + "\n".join(readonly[:5])
    assert "tuvl worker waits: default_transaction_read_only is on" in log
    assert "tuvl worker resumes: default_transaction_read_only is off" in log
