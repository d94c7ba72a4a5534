"""insight/tuvl serve as a child process of a test (test/ha, test/router).

    server = InsightProcess(conninfo, env=None)
    status, headers, text = server.request("POST", "/api/...", token, body)
    server.log      # every line it printed, read as it prints them
    server.stop()   # SIGTERM, then SIGKILL after 10 s

The server listens on a free port of 127.0.0.1; its output is read by a
thread so that it never blocks on a full pipe.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time

INSIGHT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "insight", "tuvl")


class InsightProcess:
    def __init__(self, conninfo, env=None, start_timeout=180):
        self.log = []
        self.proc = subprocess.Popen([INSIGHT, "serve", "--db", conninfo, "--port", "0"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + start_timeout
        self.port = None
        while self.port is None:
            line = self.proc.stdout.readline()
            assert line or self.proc.poll() is None, "insight/tuvl serve ended:\n" + "".join(self.log[-20:])
            self.log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
            assert time.monotonic() < deadline, "insight/tuvl serve did not start"
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def connection(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, token, body=None, timeout=60):
        """The answer: its status, headers and text."""
        c = self.connection(timeout)
        try:
            headers = {"Authorization": f"Bearer {token}"}
            if body is not None:
                headers["Content-Type"] = "application/json"
            c.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            r = c.getresponse()
            return r.status, r.headers, r.read().decode()
        finally:
            c.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
