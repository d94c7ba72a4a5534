#!/usr/bin/env python3
"""A scripted LLM server for tuvl's tests, benchmarks and offline demo.

It speaks the OpenAI Chat Completions, OpenAI Responses and Anthropic
Messages wire formats on 127.0.0.1 and answers from scripts instead of a
model.  Standard library
only.

    python3 test/servers/llm_server.py --port N [--scripts FILE] [--latency-ms N]
                                       [--no-validate] [--log-max N]

--port 0 picks a free port; the one line on stderr names the port bound.

Model endpoints (POST):

  /v1/chat/completions, /chat/completions     OpenAI format
  /v1/messages, /messages                     Anthropic format
  /v1/responses, /responses                   OpenAI Responses format: the
                                              request is checked and read as
                                              the Chat Completions request it
                                              amounts to, and answered with
                                              output items (message,
                                              function_call, reasoning)
  /lat/<ms>/<any of the above>                the same, with a default latency
                                              of <ms> milliseconds (for a
                                              base_url such as
                                              http://127.0.0.1:PORT/lat/200/v1)
  ...?latency_ms=N                            the same, as a query parameter

Control endpoints:

  POST   /_script          {"name": "s1", "turns": [...]}: register (or
                           replace) a script; resets its fault counters
  GET    /_script          {"scripts": {name: number of turns}}
  GET    /_script/<name>   {"name": ..., "turns": [...]}
  DELETE /_script/<name>   remove a script (404 if there is none)
  GET    /_log[?model=s1]  {"requests": [...], "peak_concurrent": n}: with
                           ?model=, the most of that model's logged
                           requests in flight at once (t to t_end); each
                           request: {t, path, format, model, headers (lower
                           case), body (parsed JSON, or the raw text when it
                           is not JSON), turn, status, script, and when they
                           apply: fault, error, note, disconnected}, and
                           t_end: when its answer began (after its latency)
                           or its handler ended.  status
                           is null while a request is in flight, and for one
                           that was never answered (hang, client gone).
                           The newest --log-max requests (100000) are kept
  DELETE /_log             clear the log and every fault counter; the peak
                           restarts from the requests in flight now
  GET    /_health          {"ok": true}

Scripts.  The request's `model` selects the script: "s1" or "scripted/s1"
plays script s1; a model that names no script plays the built-in "echo".
The turn that answers is the number of assistant messages in the request's
history (0 for a fresh conversation); past the last turn the last turn
repeats.  So concurrent conversations play the same script independently.
A turn is an object with these keys (all optional):

  text          the answer's text.  "{{last_user}}" becomes the text of the
                last user message, or the content of the last tool result when
                that came last; "{{turn}}" becomes the turn number
  tool_calls    [{"name": "lookup", "arguments": {...}}, ...]: ask for tools.
                Ids are call_<turn>_<i> (OpenAI) and toolu_<turn>_<i>
                (Anthropic).  Templates also work inside string arguments.
                "arguments_raw": "not json" instead of "arguments" sends that
                string verbatim as the OpenAI arguments; Anthropic cannot carry
                it (input is an object), so it sends input {} and the log entry
                gets a "note"
  finish        "length": finish_reason "length" (Anthropic stop_reason
                "max_tokens") instead of "stop"/"end_turn"
  usage         {"prompt_tokens": n, "completion_tokens": m} (or
                input_tokens/output_tokens); default: about one token per four
                characters of the request's messages and of the answer
  latency_ms    sleep this long before answering; default: the /lat/<ms>
                prefix, then ?latency_ms=, then --latency-ms (0)
  fault         "429", "500", "529" (Anthropic 529 overloaded_error; OpenAI
                503), "408", "quota" (OpenAI 429 insufficient_quota; Anthropic
                400 billing_error), "bad_request" (400 invalid_request_error),
                "malformed" (200, application/json, a body that is not JSON),
                "truncated" (200, Content-Length larger than the body sent,
                then the connection closes), "hang" (no answer until the client
                disconnects, at most an hour), "empty" (200 with an empty
                choices / content list), or any other HTTP status as a string
                ("401", "503", ...) for an error of that status
  times         the fault hits only the first k requests that arrive for this
                turn of this conversation (identity: a hash of the model, the
                system prompt and the messages; a retry resends identical
                messages), then the turn answers normally.  Without it the
                fault is permanent.  Identical conversations share the counter
  no_ids        true: the tool calls come without ids (as some OpenAI-compatible
                servers send them)
  thinking      text: an Anthropic answer opens with a thinking block holding it
                (and a signature); a request with thinking enabled must send
                it back, unchanged, first in the assistant message of the
                tool calls it came with, as Anthropic requires.  A Responses
                answer opens with a reasoning item (its summary the text,
                encrypted_content the signature), which must come back
                before the function_call items it led to
  cached_tokens, reasoning_tokens
                n: the usage reports that many cached prompt tokens
                (prompt_tokens_details.cached_tokens; Anthropic
                cache_read_input_tokens) and reasoning tokens
                (completion_tokens_details.reasoning_tokens; OpenAI only)
  retry_after   seconds, sent as Retry-After (and, for Anthropic, as
                retry-after-ms) with an error fault.  Integers give standard
                headers; a fraction is sent as written ("0.5")
  message       the error message of an error fault
  comment       ignored

Built-in script "echo" (unless a script of that name is registered): one
turn answering "Summary: " followed by the first 120 characters of the last
user message (or tool result), whitespace collapsed to single spaces.  When
the system prompt mentions an "outcome" key and JSON, and lists the allowed
values near the word outcome (a JSON array of strings, "one of: a, b",
"<one of "a", "b">" as tuvl's Agent step writes it, "a | b", or "allowed
values: a, b"; values quoted or bare words), or when an OpenAI
response_format schema has properties.outcome.enum, the answer is instead the
JSON text {"outcome": <first allowed value>, "result": <the summary>}.

Requests are checked like the real services do (a request the real service
would reject gets 400 invalid_request_error, with the reason in the log's
"error"): the model and messages are present, the roles are allowed (a
"system" role in Anthropic messages is an error), every tool call is answered
by a tool result right after it and no tool result answers nothing, the tools
are well formed; Anthropic also needs max_tokens and the anthropic-version
header.  --no-validate turns the checks off.

Scripts load at startup with --scripts FILE, a JSON object mapping each name
to its turns (a list, or an object with a "turns" list).
"""
import _thread
import argparse
import collections
import hashlib
import itertools
import json
import os
import re
import resource
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

ROUTES = {
    "/v1/chat/completions": "openai",
    "/chat/completions": "openai",
    "/v1/messages": "anthropic",
    "/messages": "anthropic",
    "/v1/responses": "responses",
    "/responses": "responses",
}
NAMED_FAULTS = {"429", "500", "529", "408", "quota", "bad_request", "malformed",
                "truncated", "hang", "empty"}
TURN_KEYS = {"text", "tool_calls", "finish", "usage", "latency_ms", "fault", "times",
             "retry_after", "message", "comment", "no_ids", "cached_tokens", "reasoning_tokens",
             "thinking"}
CALL_KEYS = {"name", "arguments", "arguments_raw"}
HANG_SECONDS = 3600
SWITCH_INTERVAL = 0.05
LOG_MAX = 100000
ECHO_CHARS = 120
ECHO_TURNS = [{"text": "Summary: {{last_user}}"}]  # for GET /_script only

# Error statuses: (OpenAI type, OpenAI code, Anthropic type, message).
STATUS_ERRORS = {
    400: ("invalid_request_error", None, "invalid_request_error", "Bad request."),
    401: ("invalid_request_error", "invalid_api_key", "authentication_error",
          "Incorrect API key provided."),
    403: ("permission_error", None, "permission_error",
          "Your API key does not have permission to use the specified resource."),
    404: ("invalid_request_error", "model_not_found", "not_found_error",
          "The requested resource was not found."),
    408: ("timeout", None, "timeout_error", "Request timed out."),
    413: ("invalid_request_error", None, "request_too_large", "Request exceeds the maximum size."),
    429: ("requests", "rate_limit_exceeded", "rate_limit_error",
          "Rate limit reached for requests. Please try again later."),
    500: ("server_error", None, "api_error",
          "The server had an error while processing your request."),
    503: ("server_error", None, "overloaded_error",
          "The engine is currently overloaded, please try again later."),
    529: ("server_error", None, "overloaded_error", "Overloaded"),
}


class ScriptError(ValueError):
    pass


class RequestError(ValueError):
    pass


# ---------------------------------------------------------------- scripts

def overlap_peak(rows):
    """The most of rows in flight at once: each from t to t_end (none yet:
    still in flight)."""
    marks = []
    for e in rows:
        marks.append((e["t"], 1))
        if e.get("t_end") is not None:
            marks.append((e["t_end"], -1))
    peak = now = 0
    for _, d in sorted(marks, key=lambda m: (m[0], m[1])):
        now += d
        peak = max(peak, now)
    return peak


def check_turns(turns):
    """Validate a script's turns; return them (raises ScriptError)."""
    if isinstance(turns, dict) and "turns" in turns:
        turns = turns["turns"]
    if not isinstance(turns, list) or not turns:
        raise ScriptError("turns must be a non-empty array")
    for i, turn in enumerate(turns):
        where = f"turn {i}"
        if not isinstance(turn, dict):
            raise ScriptError(f"{where}: a turn is an object")
        unknown = sorted(set(turn) - TURN_KEYS)
        if unknown:
            raise ScriptError(f"{where}: unknown keys {unknown} (known: {sorted(TURN_KEYS)})")
        for key in ("text", "message", "comment"):
            if key in turn and not isinstance(turn[key], str):
                raise ScriptError(f"{where}: {key} must be a string")
        if "finish" in turn and turn["finish"] not in ("stop", "length"):
            raise ScriptError(f"{where}: finish must be \"stop\" or \"length\"")
        for key in ("latency_ms", "retry_after"):
            if key in turn and not _is_number(turn[key]):
                raise ScriptError(f"{where}: {key} must be a non-negative number")
        if "times" in turn and not (isinstance(turn["times"], int)
                                    and not isinstance(turn["times"], bool)
                                    and turn["times"] >= 0):
            raise ScriptError(f"{where}: times must be a non-negative integer")
        if "fault" in turn:
            fault = turn["fault"]
            if isinstance(fault, int) and not isinstance(fault, bool):
                fault = turn["fault"] = str(fault)
            if not isinstance(fault, str) or not (
                    fault in NAMED_FAULTS or re.fullmatch(r"[45][0-9][0-9]", fault)):
                raise ScriptError(f"{where}: fault must be an HTTP error status or one of "
                                  f"{sorted(NAMED_FAULTS)}")
        if "usage" in turn:
            usage = turn["usage"]
            if not isinstance(usage, dict) or not all(
                    k in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
                    and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for k, v in usage.items()):
                raise ScriptError(f"{where}: usage maps prompt_tokens/completion_tokens "
                                  "(or input_tokens/output_tokens) to non-negative integers")
        if "tool_calls" in turn:
            calls = turn["tool_calls"]
            if not isinstance(calls, list):
                raise ScriptError(f"{where}: tool_calls must be an array")
            for j, call in enumerate(calls):
                if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                        or not call["name"]:
                    raise ScriptError(f"{where}: tool call {j} needs a name")
                unknown = sorted(set(call) - CALL_KEYS)
                if unknown:
                    raise ScriptError(f"{where}: tool call {j}: unknown keys {unknown}")
                if "arguments" in call and not isinstance(call["arguments"], dict):
                    raise ScriptError(f"{where}: tool call {j}: arguments must be an object")
                if "arguments_raw" in call and not isinstance(call["arguments_raw"], str):
                    raise ScriptError(f"{where}: tool call {j}: arguments_raw must be a string")
    return turns


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def load_scripts(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ScriptError(f"{path}: a JSON object mapping script names to turns")
    out = {}
    for name, turns in data.items():
        try:
            out[name] = check_turns(turns)
        except ScriptError as e:
            raise ScriptError(f"{path}: script {name}: {e}") from None
    return out


# ---------------------------------------------------------------- reading requests

def text_of(content):
    """The text of a message content: a string, or a list of parts/blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                if isinstance(block.get("text"), str):
                    parts.append(block["text"])
                elif block.get("type") == "tool_result":
                    parts.append(text_of(block.get("content")))
        return "\n".join(parts)
    return json.dumps(content)


def system_text(fmt, body):
    if fmt == "anthropic":
        return text_of(body.get("system"))
    return "\n".join(text_of(m.get("content")) for m in body.get("messages") or []
                     if isinstance(m, dict) and m.get("role") in ("system", "developer"))


def last_user_text(fmt, messages):
    """The last user message's text, or the last tool result's content."""
    for m in reversed(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if fmt == "openai" and role in ("user", "tool"):
            return text_of(m.get("content"))
        if fmt == "anthropic" and role == "user":
            content = m.get("content")
            if isinstance(content, list):
                results = [b for b in content
                           if isinstance(b, dict) and b.get("type") == "tool_result"]
                if results:
                    return text_of(results[-1].get("content"))
            return text_of(content)
    return ""


def assistant_count(messages):
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def conversation_key(script, fmt, body):
    canon = json.dumps([fmt, body.get("model"), body.get("system"), body.get("messages")],
                       sort_keys=True, separators=(",", ":"))
    return (script, hashlib.sha256(canon.encode()).hexdigest())


def validate(fmt, body, headers):
    """Reject what the real service would reject (raises RequestError)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError("model: field required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty array is required")
    if body.get("stream"):
        raise RequestError("stream: the scripted server does not stream; send stream false")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools: must be an array")
    if fmt == "openai":
        _validate_openai(messages, tools or [])
    else:
        if "anthropic-version" not in headers:
            raise RequestError("anthropic-version: header is required")
        mt = body.get("max_tokens")
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise RequestError("max_tokens: field required (a positive integer)")
        _validate_anthropic(messages, tools or [])
        if isinstance(body.get("thinking"), dict) and body["thinking"].get("type") == "enabled":
            _validate_thinking(messages)


def _validate_openai(messages, tools):
    pending = None  # tool_call ids that still need a tool message
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]: must be an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}].role: invalid value {role!r}")
        if role == "tool":
            if not pending or m.get("tool_call_id") not in pending:
                raise RequestError(
                    f"messages[{i}]: messages with role 'tool' must be a response to a "
                    f"preceding message with 'tool_calls' (tool_call_id "
                    f"{m.get('tool_call_id')!r})")
            pending.discard(m["tool_call_id"])
            continue
        if pending:
            raise RequestError(
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                "response messages: " + ", ".join(sorted(pending)))
        pending = None
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(f"messages[{i}].tool_calls: must be an array")
            pending = set()
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(c, dict) or not isinstance(c.get("id"), str) \
                        or c.get("type") != "function" or not isinstance(fn, dict) \
                        or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments"), str):
                    raise RequestError(
                        f"messages[{i}].tool_calls[{j}]: needs id, type \"function\" and "
                        "function {name, arguments (a string)}")
                pending.add(c["id"])
        elif role != "assistant" and "content" not in m:
            raise RequestError(f"messages[{i}].content: field required")
    if pending:
        raise RequestError(
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            "response messages: " + ", ".join(sorted(pending)))
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{k}]: needs type \"function\" and function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{k}].function.parameters: must be an object")


def _validate_anthropic(messages, tools):
    previous_uses = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages.{i}: must be an object")
        role = m.get("role")
        if role == "system":
            raise RequestError(
                f"messages.{i}: Unexpected role \"system\". The Messages API accepts a "
                "top-level `system` parameter, not \"system\" as an input message role.")
        if role not in ("user", "assistant"):
            raise RequestError(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = m.get("content")
        if not isinstance(content, (str, list)):
            raise RequestError(f"messages.{i}.content: a string or an array of blocks")
        blocks = content if isinstance(content, list) else []
        for j, b in enumerate(blocks):
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                raise RequestError(f"messages.{i}.content.{j}: a block with a type")
            if b["type"] == "tool_use":
                if role != "assistant" or not isinstance(b.get("id"), str) \
                        or not isinstance(b.get("name"), str) \
                        or not isinstance(b.get("input"), dict):
                    raise RequestError(f"messages.{i}.content.{j}: a tool_use block needs "
                                       "id, name and an object input, in an assistant message")
            if b["type"] == "tool_result":
                if role != "user" or not isinstance(b.get("tool_use_id"), str):
                    raise RequestError(f"messages.{i}.content.{j}: a tool_result block needs "
                                       "tool_use_id, in a user message")
            if b["type"] == "text" and not isinstance(b.get("text"), str):
                raise RequestError(f"messages.{i}.content.{j}.text: field required")
        uses = {b["id"] for b in blocks if b["type"] == "tool_use"}
        results = {b["tool_use_id"] for b in blocks if b["type"] == "tool_result"}
        unexpected = results - previous_uses
        if unexpected:
            raise RequestError(
                f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` "
                f"blocks: {', '.join(sorted(unexpected))}. Each `tool_result` block must have "
                "a corresponding `tool_use` block in the previous message.")
        if previous_uses and not previous_uses <= results:
            raise RequestError(
                f"messages.{i - 1}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(sorted(previous_uses - results))}. Each "
                "`tool_use` block must have a corresponding `tool_result` block in the next "
                "message.")
        previous_uses = uses
    if previous_uses:
        raise RequestError(
            f"messages.{len(messages) - 1}: `tool_use` ids were found without `tool_result` "
            f"blocks immediately after: {', '.join(sorted(previous_uses))}.")
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise RequestError(f"tools.{k}.name: field required")
        if "type" in t and t["type"] not in (None, "custom"):
            continue  # server tools (web_search, ...) carry no input_schema
        if not isinstance(t.get("input_schema"), dict):
            raise RequestError(f"tools.{k}.input_schema: field required")


def thinking_signature(text):
    """The signature the scripted server gives a thinking block (and checks)."""
    return "sig-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _check_reasoning_returned(srv, chat, check):
    """A function call that came with a reasoning item must be sent back
    right after it (as the Responses API requires of reasoning models)."""
    for i, m in enumerate(chat["messages"]):
        for tc in m.get("tool_calls") or []:
            with srv.lock:
                want = srv.reasoned_calls.get((chat.get("model"), tc["id"]))
            if check and want is not None and m.get("_reasoning") != want:
                raise RequestError(f"Item of type 'function_call' with call_id '{tc['id']}' was provided "
                                   "without its required 'reasoning' item.")
        m.pop("_reasoning", None)


def _validate_thinking(messages):
    """With extended thinking on, Anthropic requires the assistant message that
    holds tool_use blocks (the one the tool results answer) to start with the
    thinking block it came with, unchanged."""
    for i, m in enumerate(messages):
        blocks = m.get("content") if isinstance(m.get("content"), list) else []
        if m.get("role") != "assistant" or not any(b.get("type") == "tool_use" for b in blocks):
            continue
        first = blocks[0]
        if first.get("type") not in ("thinking", "redacted_thinking"):
            raise RequestError(
                f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
                f"`{first.get('type')}`. When `thinking` is enabled, a final `assistant` message must "
                "start with a thinking block (preceeding the lastmost set of `tool_use` and "
                "`tool_result` blocks).")
        if first["type"] == "thinking" and first.get("signature") != thinking_signature(first.get("thinking", "")):
            raise RequestError(f"messages.{i}.content.0: Invalid `signature` in `thinking` block")


def _responses_text(content, where):
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: a string or a list of content parts")
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{k}]: an input_text or output_text part with text")
        parts.append(part["text"])
    return "".join(parts)


def responses_to_chat(body):
    """The Chat Completions request a Responses request amounts to (checked
    as the Responses API checks it); raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key in ("messages", "functions", "response_format"):
        if key in body:
            raise RequestError(f"Unknown parameter: '{key}'.")
    if not isinstance(body.get("model"), str):
        raise RequestError("Missing required parameter: 'model'.")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise RequestError("Missing required parameter: 'input'.")
    messages = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    reasoning_before = None  # the encrypted_content of the reasoning item just before
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise RequestError(f"{where}: must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role: one of user, assistant, system, developer")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _responses_text(it.get("content"), where)})
            if role == "assistant":
                continue  # a reasoning item before the text counts for the calls after it
        elif kind == "reasoning":
            if not isinstance(it.get("summary"), list):
                raise RequestError(f"{where}.summary: required")
            text = "".join(p.get("text", "") for p in it["summary"] if isinstance(p, dict))
            if it.get("encrypted_content") != thinking_signature(text):
                raise RequestError(f"{where}: the encrypted content of the reasoning item could not be verified")
            reasoning_before = it["encrypted_content"]
            continue
        elif kind == "function_call":
            for f in ("call_id", "name", "arguments"):
                if not isinstance(it.get(f), str):
                    raise RequestError(f"{where}.{f}: required (a string)")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant":
                # the calls of one answer follow its text (and one another)
                last.setdefault("tool_calls", []).append(call)
                if reasoning_before is not None:
                    last["_reasoning"] = reasoning_before
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 "_reasoning": reasoning_before})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("output"), str):
                raise RequestError(f"{where}: a function_call_output needs call_id and output (strings)")
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        else:
            raise RequestError(f"{where}.type: '{kind}' is not an input item this server knows")
        reasoning_before = None
    tools = []
    for k, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{k}]: a function tool needs type \"function\" and name "
                               "(at the top level, not under function)")
        tools.append({"type": "function", "function": {k2: t[k2] for k2 in ("name", "description", "parameters")
                                                      if k2 in t}})
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools", "text")}
    chat["messages"] = messages
    if tools:
        chat["tools"] = tools
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return chat


def chat_to_responses(payload, turn):
    """A Chat Completions answer as the Responses API gives it."""
    out = []
    choices = payload.get("choices") or []
    if turn.get("thinking") and choices:
        out.append({"type": "reasoning", "id": "rs_" + new_id(),
                    "summary": [{"type": "summary_text", "text": turn["thinking"]}],
                    "encrypted_content": thinking_signature(turn["thinking"])})
    status, details = "completed", None
    for c in choices:
        msg = c["message"]
        if msg.get("content") is not None and (msg["content"] or not msg.get("tool_calls")):
            out.append({"type": "message", "id": "msg_" + new_id(), "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": msg["content"], "annotations": []}]})
        for tc in msg.get("tool_calls") or []:
            item = {"type": "function_call", "id": "fc_" + new_id(), "status": "completed",
                    "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            if "id" in tc:
                item["call_id"] = tc["id"]
            out.append(item)
        if c.get("finish_reason") == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
    u = payload.get("usage") or {}
    usage = {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
             "total_tokens": u.get("total_tokens", 0),
             "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
             "output_tokens_details": {"reasoning_tokens":
                                       (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}
    return {"id": "resp_" + new_id(), "object": "response", "created_at": int(time.time()),
            "status": status, "incomplete_details": details, "model": payload.get("model"),
            "output": out, "usage": usage}


# ---------------------------------------------------------------- answers

def render(value, last_user, turn):
    if isinstance(value, str):
        return value.replace("{{last_user}}", last_user).replace("{{turn}}", str(turn))
    if isinstance(value, list):
        return [render(v, last_user, turn) for v in value]
    if isinstance(value, dict):
        return {k: render(v, last_user, turn) for k, v in value.items()}
    return value


def one_line(text):
    return " ".join(text.split())


def allowed_outcomes(system, body):
    """The allowed outcome values the request asks for, or None."""
    rf = body.get("response_format")
    if isinstance(rf, dict):
        schema = (rf.get("json_schema") or {}).get("schema") if isinstance(
            rf.get("json_schema"), dict) else None
        props = schema.get("properties") if isinstance(schema, dict) else None
        outcome = props.get("outcome") if isinstance(props, dict) else None
        enum = outcome.get("enum") if isinstance(outcome, dict) else None
        if isinstance(enum, list) and enum:
            return enum
    low = system.lower()
    at = low.find("outcome")
    if at < 0 or "json" not in low:
        return None
    tail = system[max(0, at - 40):at + 600]
    # A value: quoted (anything up to the closing quote) or a bare word.
    value = r"(?:\"([^\"\n]+)\"|'([^'\n]+)'|`([^`\n]+)`|([A-Za-z0-9_][A-Za-z0-9_.\-]*))"
    patterns = [
        r"\[\s*" + value,  # a JSON array
        r"(?i:one of)\s*[:\-]?\s*" + value,
        r"(?i:(?:allowed|possible|valid) values?(?: (?:for|of) (?:the )?[\"'`]?outcome[\"'`]?"
        r"(?: key)?)?)\s*(?:are|is)?\s*[:\-]?\s*" + value,
        value + r"\s*\|\s*[\"'`]?[A-Za-z0-9_]",  # a | b
    ]
    best = None
    for p in patterns:
        m = re.search(p, tail)
        if m and (best is None or m.start() < best.start()):
            best = m
    if best is None:
        return None
    return [next(g for g in best.groups() if g is not None)]


def echo_answer(fmt, body, last_user):
    summary = "Summary: " + (one_line(last_user)[:ECHO_CHARS] or "(empty)")
    outcomes = allowed_outcomes(system_text(fmt, body), body)
    if outcomes:
        return json.dumps({"outcome": outcomes[0], "result": summary})
    return summary


def error_payload(fmt, etype, message, code=None):
    if fmt != "anthropic":
        return {"error": {"message": message, "type": etype, "param": None, "code": code}}
    return {"type": "error", "error": {"type": etype, "message": message}}


def status_error(fmt, status, message=None):
    otype, ocode, atype, default = STATUS_ERRORS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None,
                 "api_error" if status >= 500 else "invalid_request_error",
                 f"Error {status}."))
    if fmt != "anthropic":
        return error_payload(fmt, otype, message or default, ocode)
    return error_payload(fmt, atype, message or default)


def fault_error(fmt, fault, message=None):
    """(status, payload) of an error fault."""
    if fault == "529":
        if fmt != "anthropic":
            return 503, status_error(fmt, 503, message)
        return 529, status_error(fmt, 529, message)
    if fault == "quota":
        if fmt != "anthropic":
            return 429, error_payload(fmt, "insufficient_quota", message or (
                "You exceeded your current quota, please check your plan and billing "
                "details."), "insufficient_quota")
        return 400, error_payload(fmt, "billing_error", message or (
            "Your credit balance is too low to access the Anthropic API."))
    if fault == "bad_request":
        return 400, error_payload(fmt, "invalid_request_error",
                                  message or "Invalid request (scripted bad_request).")
    status = int(fault)
    return status, status_error(fmt, status, message)


_IDS = itertools.count(1)
_ID_PREFIX = os.urandom(4).hex()


def new_id():
    """A unique id (a random prefix per process, then a counter)."""
    return f"{_ID_PREFIX}{next(_IDS):016x}"


def format_seconds(s):
    return str(int(s)) if float(s).is_integer() else repr(float(s))


# ---------------------------------------------------------------- server

class Headers:
    """Request headers: case-insensitive get(), items() as received."""

    def __init__(self):
        self._map = {}

    def add(self, name, value):
        self._map[name.lower()] = (name, value)

    def get(self, name, default=None):
        found = self._map.get(name.lower())
        return found[1] if found else default

    def __getitem__(self, name):
        return self.get(name)

    def __contains__(self, name):
        return name.lower() in self._map

    def __len__(self):
        return len(self._map)

    def items(self):
        return list(self._map.values())


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "scripted-llm/1"
    sys_version = ""
    wbufsize = 1 << 16  # headers and body leave in one send

    def log_message(self, fmt, *args):
        pass

    def version_string(self):
        return self.server_version

    def parse_request(self):
        """BaseHTTPRequestHandler.parse_request without the email package.

        The standard one parses headers with email.feedparser, which is half
        the cost of a request here; bursts of a thousand requests need it
        cheaper.  HTTP/1.x only.
        """
        self.command = None
        self.request_version = self.default_request_version
        self.close_connection = True
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = line
        words = line.split()
        if len(words) != 3 or not re.fullmatch(r"HTTP/1\.[0-9]", words[2]):
            self.send_error(400, f"Bad request line {line!r}")
            return False
        self.command, self.path, self.request_version = words
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        headers = Headers()
        while True:
            raw = self.rfile.readline(65537)
            if len(raw) > 65536 or len(headers) > 200:
                self.send_error(431, "Request header fields too large")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            name, sep, value = raw.decode("iso-8859-1").partition(":")
            if not sep or not name.strip():
                self.send_error(400, "Bad header line")
                return False
            headers.add(name.strip(), value.strip())
        self.headers = headers
        if self.request_version >= "HTTP/1.1":
            self.close_connection = False
        connection = (headers.get("Connection") or "").lower()
        if connection == "close":
            self.close_connection = True
        elif connection == "keep-alive":
            self.close_connection = False
        if (headers.get("Expect") or "").lower() == "100-continue" \
                and self.request_version >= "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def handle_expect_100(self):
        ok = super().handle_expect_100()
        self.wfile.flush()  # wfile is buffered: send the 100 Continue now
        return ok

    # -- plumbing

    def _read_body(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _send(self, status, payload, headers=None, ctype="application/json", entry=None):
        if isinstance(payload, (bytes, bytearray)):
            data = bytes(payload)
        elif isinstance(payload, str):
            data = payload.encode()
        else:
            data = json.dumps(payload).encode()
        if entry is not None:
            self.server.set_status(entry, status)
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _wait_for_disconnect(self, seconds):
        """Sleep up to `seconds`; return True as soon as the client has gone."""
        deadline = time.monotonic() + seconds
        poller = select.poll()  # not select(): descriptors may exceed FD_SETSIZE
        poller.register(self.connection, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not poller.poll(left * 1000):
                return False
            try:
                peek = self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                return True
            if not peek:
                return True
            # The client sent more (a pipelined request): just sleep it out.
            time.sleep(max(0.0, deadline - time.monotonic()))
            return False

    def do_any(self):
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            raw = self._read_body()
        except (OSError, ValueError):
            self.close_connection = True
            return
        path = url.path
        if path.startswith("/_"):
            return self._control(path, query, raw)
        latency = None
        m = re.fullmatch(r"/lat/([0-9]+(?:\.[0-9]+)?)(/.*)", path)
        if m:
            latency, path = float(m.group(1)), m.group(2)
        if "latency_ms" in query:
            try:
                latency = float(query["latency_ms"])
            except ValueError:
                pass
        fmt = ROUTES.get(path.rstrip("/") or "/")
        if fmt is None:
            return self._send(404, {"error": {"message": f"no endpoint {url.path}",
                                              "type": "invalid_request_error",
                                              "param": None, "code": "unknown_url"}})
        if self.command != "POST":
            return self._send(405, error_payload(fmt, "invalid_request_error",
                                                 f"{self.command} is not allowed; use POST"))
        entry = {"t": time.time(), "path": self.path, "format": fmt, "model": None,
                 "headers": {k.lower(): v for k, v in self.headers.items()},
                 "body": None, "turn": None, "status": None, "script": None}
        self.server.begin(entry)
        try:
            self._model_request(fmt, raw, latency, entry)
        finally:
            self.server.end(entry)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_any

    # -- control endpoints

    def _control(self, path, query, raw):
        srv = self.server
        if path == "/_health":
            return self._send(200, {"ok": True})
        if path == "/_log":
            if self.command == "DELETE":
                srv.clear_log()
                return self._send(200, {"ok": True})
            if self.command == "GET":
                return self._send(200, srv.log_json(query.get("model")), ctype="application/json")
        if path == "/_script" and self.command == "POST":
            try:
                body = json.loads(raw or b"null")
                if not isinstance(body, dict) or not isinstance(body.get("name"), str) \
                        or not body["name"]:
                    raise ScriptError("the body is {\"name\": ..., \"turns\": [...]}")
                turns = check_turns(body.get("turns"))
            except (ValueError, ScriptError) as e:
                return self._send(400, {"ok": False, "error": str(e)})
            srv.set_script(body["name"], turns)
            return self._send(200, {"ok": True, "name": body["name"], "turns": len(turns)})
        if path == "/_script" and self.command == "GET":
            with srv.lock:
                names = {n: len(t) for n, t in srv.scripts.items()}
            names.setdefault("echo", len(ECHO_TURNS))
            return self._send(200, {"scripts": names})
        if path.startswith("/_script/"):
            name = unquote(path[len("/_script/"):])
            if self.command == "DELETE":
                if srv.delete_script(name):
                    return self._send(200, {"ok": True})
                return self._send(404, {"ok": False, "error": f"no script {name}"})
            if self.command == "GET":
                with srv.lock:
                    turns = srv.scripts.get(name)
                if turns is None and name == "echo":
                    turns = ECHO_TURNS
                if turns is None:
                    return self._send(404, {"ok": False, "error": f"no script {name}"})
                return self._send(200, {"name": name, "turns": turns})
        return self._send(404, {"ok": False,
                                "error": f"no control endpoint {self.command} {path}"})

    # -- model requests

    def _model_request(self, fmt, raw, latency, entry):
        srv = self.server
        try:
            body = json.loads(raw)
        except ValueError:
            srv.update(entry, body=raw.decode("utf-8", "replace"), error="the body is not JSON")
            return self._send(400, error_payload(
                fmt, "invalid_request_error",
                "We could not parse the JSON body of your request."), entry=entry)
        srv.update(entry, body=body)
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            srv.update(entry, model=body["model"])
        wire = fmt
        if fmt == "responses":
            # read as the Chat Completions request it amounts to; errors look alike
            fmt = "openai"
            try:
                body = responses_to_chat(body)
                _check_reasoning_returned(srv, body, srv.validate)
            except RequestError as e:
                srv.update(entry, error=str(e))
                return self._send(400, error_payload(fmt, "invalid_request_error", str(e)), entry=entry)
        if srv.validate:
            try:
                validate(fmt, body, entry["headers"])
            except RequestError as e:
                srv.update(entry, error=str(e))
                return self._send(400, error_payload(fmt, "invalid_request_error", str(e)),
                                  entry=entry)
        elif not isinstance(body, dict):
            body = {}
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        name = model[len("scripted/"):] if model.startswith("scripted/") else model
        with srv.lock:
            turns = srv.scripts.get(name)
        if turns is None:
            name, turns = "echo", None
        number = assistant_count(messages)
        turn = turns[min(number, len(turns) - 1)] if turns else {}
        srv.update(entry, script=name, turn=number)

        fault = turn.get("fault")
        if fault is not None and "times" in turn:
            count = srv.bump(conversation_key(name, fmt, body))
            if count > turn["times"]:
                fault = None
        if fault is not None:
            srv.update(entry, fault=fault)

        delay = turn.get("latency_ms")
        if delay is None:
            delay = latency if latency is not None else srv.latency_ms
        if delay and self._wait_for_disconnect(delay / 1000.0):
            srv.update(entry, disconnected=True)
            self.close_connection = True
            return None

        # the answer leaves from now on: the request is no longer in flight
        # for the peak of its model (a client may send the next one as soon
        # as it has read this one)
        srv.update(entry, t_end=time.time())
        last_user = last_user_text(fmt, messages)
        if fault in ("hang",):
            if self._wait_for_disconnect(HANG_SECONDS):
                srv.update(entry, disconnected=True)
            self.close_connection = True
            return None
        if fault is not None and fault not in ("malformed", "truncated", "empty"):
            status, payload = fault_error(fmt, fault, turn.get("message"))
            headers = {}
            if "retry_after" in turn:
                headers["Retry-After"] = format_seconds(turn["retry_after"])
                if fmt == "anthropic":
                    headers["retry-after-ms"] = str(int(round(turn["retry_after"] * 1000)))
            headers.update(self._id_header(fmt))
            return self._send(status, payload, headers, entry=entry)
        if fault == "malformed":
            broken = (b'{"id": "chatcmpl-malformed", "object": "chat.completion", "choices": [{'
                      if fmt == "openai" else
                      b'{"id": "msg_malformed", "type": "message", "content": [{"type": "te')
            return self._send(200, broken, self._id_header(fmt), entry=entry)

        if turns is None:
            text, calls = echo_answer(fmt, body, last_user), []
        else:
            text = render(turn["text"], last_user, number) if "text" in turn else None
            calls = render(turn.get("tool_calls") or [], last_user, number)
        payload = self._reply(fmt, body, len(raw), turn, number, text, calls, entry,
                              empty=(fault == "empty"))
        if wire == "responses":
            payload = chat_to_responses(payload, turn)
            with srv.lock:
                for item in payload["output"]:
                    if item["type"] == "function_call" and turn.get("thinking"):
                        srv.reasoned_calls[(body.get("model"), item.get("call_id"))] = \
                            thinking_signature(turn["thinking"])
        if fault == "truncated":
            return self._send_truncated(payload, entry)
        return self._send(200, payload, self._id_header(fmt), entry=entry)

    def _id_header(self, fmt):
        rid = "req_" + new_id()
        return {"x-request-id": rid} if fmt == "openai" else {"request-id": rid}

    def _reply(self, fmt, body, raw_length, turn, number, text, calls, entry, empty):
        usage = turn.get("usage") or {}
        prompt_chars = raw_length
        answer_chars = len(text or "") + sum(
            len(c.get("arguments_raw", json.dumps(c.get("arguments", {})))) + len(c["name"])
            for c in calls)
        prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens",
                                                             max(1, prompt_chars // 4)))
        completion_tokens = usage.get("completion_tokens", usage.get("output_tokens",
                                                                     max(1, answer_chars // 4)))
        length = turn.get("finish") == "length"
        if fmt == "openai":
            message = {"role": "assistant",
                       "content": text if text is not None else (None if calls else "")}
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{number}_{i}", "type": "function",
                     "function": {"name": c["name"],
                                  "arguments": c["arguments_raw"] if "arguments_raw" in c
                                  else json.dumps(c.get("arguments", {}))}}
                    for i, c in enumerate(calls)]
                if turn.get("no_ids"):
                    for tc in message["tool_calls"]:
                        del tc["id"]
            finish = "tool_calls" if calls else ("length" if length else "stop")
            choices = [] if empty else [{"index": 0, "message": message,
                                         "finish_reason": finish}]
            usage_out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
            if "cached_tokens" in turn:
                usage_out["prompt_tokens_details"] = {"cached_tokens": turn["cached_tokens"]}
            if "reasoning_tokens" in turn:
                usage_out["completion_tokens_details"] = {"reasoning_tokens": turn["reasoning_tokens"]}
            return {"id": "chatcmpl-" + new_id(), "object": "chat.completion",
                    "created": int(time.time()), "model": body.get("model"),
                    "choices": choices, "usage": usage_out}
        content = []
        if turn.get("thinking"):
            content.append({"type": "thinking", "thinking": turn["thinking"],
                            "signature": thinking_signature(turn["thinking"])})
        if text or not calls:
            content.append({"type": "text", "text": text or ""})
        for i, c in enumerate(calls):
            if "arguments_raw" in c:
                self.server.update(entry, note="arguments_raw cannot be sent in the Anthropic "
                                   "format (input is an object); sent input {}")
            content.append({"type": "tool_use", "id": f"toolu_{number}_{i}", "name": c["name"],
                            "input": {} if "arguments_raw" in c else c.get("arguments", {})})
            if turn.get("no_ids"):
                del content[-1]["id"]
        stop = "tool_use" if calls else ("max_tokens" if length else "end_turn")
        return {"id": "msg_" + new_id(), "type": "message", "role": "assistant",
                "model": body.get("model"), "content": [] if empty else content,
                "stop_reason": stop if not empty else "end_turn", "stop_sequence": None,
                "usage": dict({"input_tokens": prompt_tokens, "output_tokens": completion_tokens},
                              **({"cache_read_input_tokens": turn["cached_tokens"]}
                                 if "cached_tokens" in turn else {}))}

    def _send_truncated(self, payload, entry):
        data = json.dumps(payload).encode()
        self.server.set_status(entry, 200)
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096
    allow_reuse_address = True

    def __init__(self, address, scripts=None, latency_ms=0.0, validate_requests=True,
                 log_max=LOG_MAX):
        self.lock = threading.Lock()
        self.scripts = dict(scripts or {})
        self.latency_ms = latency_ms
        self.validate = validate_requests
        self.log = collections.deque(maxlen=log_max)
        self.counters = {}
        self.reasoned_calls = {}  # Responses: (model, call_id) -> the reasoning item's encrypted_content
        self.in_flight = 0
        self.peak = 0
        super().__init__(address, Handler)

    def process_request(self, request, client_address):
        """A thread per connection, as ThreadingMixIn does, without waiting.

        Thread.start() waits until the new thread runs, a GIL hand-off per
        connection that throttles the accept loop when a burst of clients
        connect at once; a bare thread does not wait.
        """
        _thread.start_new_thread(self.process_request_thread, (request, client_address))

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    def begin(self, entry):
        with self.lock:
            self.log.append(entry)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def end(self, entry):
        with self.lock:
            self.in_flight -= 1
            entry.setdefault("t_end", time.time())

    def set_status(self, entry, status):
        self.update(entry, status=status)

    def update(self, entry, **fields):
        """Change a log entry (under the lock: GET /_log may be reading it)."""
        with self.lock:
            entry.update(fields)

    def bump(self, key):
        with self.lock:
            self.counters[key] = self.counters.get(key, 0) + 1
            return self.counters[key]

    def clear_log(self):
        with self.lock:
            self.log.clear()
            self.counters.clear()
            self.reasoned_calls.clear()
            self.peak = self.in_flight

    def log_json(self, model=None):
        with self.lock:
            rows = [e for e in list(self.log)
                    if model is None or e.get("model") == model or e.get("script") == model]
            peak = self.peak if model is None else overlap_peak(rows)
            return json.dumps({"requests": rows, "peak_concurrent": peak})

    def set_script(self, name, turns):
        with self.lock:
            self.scripts[name] = turns
            for key in [k for k in self.counters if k[0] == name]:
                del self.counters[key]

    def delete_script(self, name):
        with self.lock:
            return self.scripts.pop(name, None) is not None


def raise_nofile_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def main():
    ap = argparse.ArgumentParser(description="scripted LLM server (OpenAI and Anthropic formats)")
    ap.add_argument("--port", type=int, required=True, help="0 picks a free port")
    ap.add_argument("--scripts", help="JSON file: an object mapping script names to turns")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="default latency of every answer")
    ap.add_argument("--no-validate", action="store_true",
                    help="do not reject requests the real services would reject")
    ap.add_argument("--log-max", type=int, default=LOG_MAX,
                    help="keep only the newest N requests in the log")
    args = ap.parse_args()
    raise_nofile_limit()
    # Requests are short bursts of Python between socket calls.  With the
    # default 5 ms interval, a thousand threads woken at once by a burst of
    # requests spend most of the CPU waking up to ask for the GIL.
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        scripts = load_scripts(args.scripts) if args.scripts else {}
    except (OSError, ValueError) as e:
        print(f"llm_server: {e}", file=sys.stderr)
        sys.exit(2)
    srv = Server(("127.0.0.1", args.port), scripts, args.latency_ms, not args.no_validate,
                 max(1, args.log_max))
    print(f"scripted LLM server on 127.0.0.1:{srv.server_address[1]}", file=sys.stderr, flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
