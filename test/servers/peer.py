"""Start and stop a scripted Python server of test/servers as a subprocess,
for the servers' self-tests (test_llm_server.py, test_mcp_stateless_server.py).

start(script, banner, *args) runs `script --port 0 *args` and waits for its
first stderr line, "<banner><port>"; stop(srv) ends it and returns the
lines it wrote to stderr after that banner.
"""
import os
import subprocess
import sys
import tempfile
import time


class Running:
    def __init__(self, proc, port, errfile):
        self.proc, self.port, self.errfile = proc, port, errfile
        self.base = f"http://127.0.0.1:{port}"


def start(script, banner, *args):
    name = os.path.splitext(os.path.basename(script))[0]
    errfile = tempfile.NamedTemporaryFile(prefix=name + ".", suffix=".err", delete=False)
    proc = subprocess.Popen([sys.executable, script, "--port", "0", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errfile)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with open(errfile.name) as f:
            line = f.readline()
        if line.startswith(banner) and line.endswith("\n"):
            return Running(proc, int(line.rsplit(":", 1)[1]), errfile)
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    stop(Running(proc, 0, errfile))
    with open(errfile.name) as f:
        raise RuntimeError("the server did not start: " + f.read())


def stop(srv):
    srv.proc.terminate()
    try:
        srv.proc.wait(5)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait(5)
    srv.errfile.close()
    with open(srv.errfile.name) as f:
        errors = f.read().splitlines()[1:]
    os.unlink(srv.errfile.name)
    return errors
