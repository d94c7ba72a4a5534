"""Helpers shared by the tuvl benchmark scripts (standard library + psycopg2).

Connections use the libpq environment (PGHOST, PGPORT, PGUSER) that
test/lib.sh's tuvl_start exports; only the database name is passed.
"""
import json
import math
import os
import ssl
import subprocess
import sys
import time
import urllib.request

import psycopg2


def connect(dbname, autocommit=True):
    conn = psycopg2.connect(dbname=dbname, application_name="tuvl bench")
    conn.autocommit = autocommit
    return conn


def log(msg):
    print("== %s %s" % (time.strftime("%H:%M:%S"), msg), file=sys.stderr, flush=True)


def percentile(sorted_values, p):
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize_ms(values):
    v = sorted(values)
    return {
        "n": len(v),
        "min": v[0],
        "median": percentile(v, 50),
        "p95": percentile(v, 95),
        "p99": percentile(v, 99),
        "max": v[-1],
        "mean": sum(v) / len(v),
    }


def register_workflow_once(cur, name, source):
    """Register a workflow unless its latest version has this source (a
    benchmark run again on the same database, against a server on another
    port, gets a new version)."""
    cur.execute("SELECT source FROM tuvl.workflows WHERE name = %s ORDER BY version DESC LIMIT 1", (name,))
    row = cur.fetchone()
    if row is None or row[0] != source:
        cur.execute("SELECT tuvl.register_workflow(%s)", (source,))


def wait_runs_done(cur, workflow=None, timeout=600.0, poll_s=0.02):
    """Poll until no run (of workflow, when given) is queued, running or
    compensating, through the runs in flight; raises after timeout seconds."""
    t0 = time.time()
    # workflow || '' is no index's column, so that a poll reads the index
    # entries of the runs in flight (by status): through runs_workflow_idx
    # it would read every run of the workflow, finished ones too, 50 to 100
    # times a second, CPU taken from the workers it measures.
    where = " AND workflow OPERATOR(pg_catalog.||) '' = %(w)s" if workflow else ""
    while True:
        cur.execute("SELECT EXISTS (SELECT 1 FROM tuvl.runs WHERE status = 'queued'" + where + ") "
                    "OR EXISTS (SELECT 1 FROM tuvl.runs WHERE status = ANY ('{running,compensating}')" + where + ")",
                    {"w": workflow})
        if not cur.fetchone()[0]:
            return
        if time.time() - t0 > timeout:
            raise SystemExit("%s: runs still unfinished after %d s" % (workflow or "the runs", timeout))
        time.sleep(poll_s)


def wait_for_workers(dbname, want=None, timeout=30.0):
    """Wait until the database's tuvl workers are connected (all of them by default)."""
    return len(settle_workers(dbname, want, quiet_s=0, timeout=timeout))


def settle_workers(dbname, want=None, quiet_s=1.5, timeout=20.0):
    """Wait until the database's tuvl workers are all there and have stayed
    the same processes for quiet_s; their pids.  An idle worker whose heap a
    burst of runs left fragmented exits at its next maintenance (every
    second) and the launcher starts another (worker.c): a measure of the
    workers' CPU or memory taken across that would compare two processes."""
    conn = connect("postgres")
    cur = conn.cursor()
    if want is None:
        cur.execute("SHOW tuvl.workers_per_database")
        want = int(cur.fetchone()[0])
    deadline = time.time() + timeout
    last, since = None, time.time()
    while time.time() < deadline:
        cur.execute("SELECT coalesce(array_agg(pid ORDER BY pid), '{}') FROM pg_stat_activity "
                    "WHERE datname = %s AND backend_type = 'tuvl worker'", (dbname,))
        pids = cur.fetchone()[0]
        if pids != last:
            last, since = pids, time.time()
        if len(pids) >= want and time.time() - since >= quiet_s:
            conn.close()
            return pids
        time.sleep(0.1)
    conn.close()
    raise SystemExit("%d of %d tuvl workers in database %s, not the same for %.1f s, after %.0f s"
                     % (len(last or []), want, dbname, quiet_s, timeout))


def write_json(path, data):
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)


class Loadgen:
    """bench/servers/loadgen.mjs, the load generator: the one at url, or one
    started here (with the machine's node, with the extra arguments args)
    and stopped by stop().  With --tls-dir DIR among args it serves HTTPS,
    and ca is DIR/ca.pem (the CA that signs its certificate)."""

    def __init__(self, url=None, args=(), ca=None):
        self.proc = None
        self.ca = ca
        args = list(args)
        if url is None:
            here = os.path.dirname(os.path.abspath(__file__))
            self.proc = subprocess.Popen(["node", os.path.join(here, "servers", "loadgen.mjs"), "--port", "0"] + args,
                                         stderr=subprocess.PIPE, text=True)
            line = self.proc.stderr.readline()
            if "load generator on" not in line:
                raise SystemExit("the load generator did not start: %s" % line.strip())
            tls = "--tls-dir" in args
            url = ("https://" if tls else "http://") + line.split()[-1]
            if tls:
                self.ca = os.path.join(args[args.index("--tls-dir") + 1], "ca.pem")
        self.url = url.rstrip("/")
        self.context = ssl.create_default_context(cafile=self.ca) if self.url.startswith("https:") else None

    def call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60, context=self.context) as r:
            return json.load(r)

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=10)
