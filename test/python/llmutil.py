"""The scripted LLM server (test/servers/llm_server.py), as the tests drive it.

test/run exports TUVL_LLM_URL (its OpenAI-style base URL, ending in /v1).
Each test registers scripts under names of its own, so that the server's
request log for that model name holds exactly the test's requests.
"""
import json
import os
import urllib.request

LLM_URL = os.environ.get("TUVL_LLM_URL")
LLM_ROOT = LLM_URL[: -len("/v1")] if LLM_URL and LLM_URL.endswith("/v1") else LLM_URL

# Never let an http_proxy variable send the tests' own requests elsewhere.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def llm_server(method, path, body=None):
    """Call a control endpoint of the scripted server; its JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(LLM_ROOT + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with OPENER.open(req, timeout=10) as resp:
        return json.loads(resp.read().decode())


def script(name, turns):
    """Register (or replace) script `name`; a model of that name plays it."""
    got = llm_server("POST", "/_script", {"name": name, "turns": turns})
    assert got["ok"], got
    return name


def sent(model):
    """Every request the server received for model, oldest first."""
    return llm_server("GET", f"/_log?model={model}")["requests"]
