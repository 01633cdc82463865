"""A fake inference server, as a mitmdump addon, for recording real agent traffic offline.

Run it with ``mitmdump -s scripts/record/fake_upstream.py -w out.flow`` and point a coding agent at the
proxy (``HTTPS_PROXY``, the mitmproxy CA, a fake key). Every request is answered here, in the
``request`` hook, so nothing leaves the machine and the flow file holds the client's exact request.

Rules it keeps:
- The wire format follows the path: ``.../messages/count_tokens`` -> ``{"input_tokens": N}``;
  ``.../messages`` -> Anthropic Messages (SSE when the body asks for a stream, JSON otherwise);
  ``.../chat/completions`` -> OpenAI chat; ``.../responses`` (POST) -> OpenAI Responses; a WebSocket
  upgrade (``GET .../responses``) -> 426 so the client falls back to HTTPS; ``.../models`` -> a small list;
  anything else -> 200 ``{}``.
- What the model "says" follows the last user prompt, so a scenario is driven by what you type:
  ``RUNTOOL`` -> a shell tool call (``echo hi``) when the request offers a shell tool; ``RUNTASK`` -> a
  subagent tool call (Claude Code Agent/Task, opencode task, Codex spawn_agent) when offered; after a tool
  result, or for anything else, plain text. A request whose last message is a tool result always gets
  text, so a tool loop ends after one round.
- Claude Code's auto-mode classifier (stop sequence ``</block>``) gets ``<block>no`` (allow).
- ``FAKE_LINEAGE=1`` (the lineage recordings): every text answer ends with ``(<run><n>)``, unique per
  response; a request that enables thinking (Anthropic) gets a signed thinking block first, one that
  includes ``reasoning.encrypted_content`` (Responses) a reasoning item first, and a chat request with
  ``reasoning_effort`` a ``reasoning_content`` delta: the server-made parts a fork carries.
- ``FAKE_WEBSOCKET=1``: a WebSocket upgrade on ``.../responses`` is relayed to a local Responses
  WebSocket server (fake_ws.py) instead of 426, so Codex speaks its WebSocket protocol.
- A request with no tools that asks for JSON output (Claude Code's title) gets ``{"title": ...}``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

from mitmproxy import http

sys.path.insert(0, str(Path(__file__).parent))
from fake_ws import FakeResponsesWebSocket  # noqa: E402

log = logging.getLogger(__name__)

_counter = itertools.count(1)
_RUN = uuid.uuid4().hex[:6]  # ids differ between proxy runs (Claude Code echoes them back in cc_prev_req)
# FAKE_LINEAGE=1: answers look more like a real model's where a conversation's lineage shows (see the
# module docstring). FAKE_WEBSOCKET=1: Codex's WebSocket upgrade is accepted (fake_ws.py), not 426.
LINEAGE = os.environ.get("FAKE_LINEAGE") == "1"
WEBSOCKET = os.environ.get("FAKE_WEBSOCKET") == "1"

SHELL_TOOLS = ("Bash", "bash", "shell", "shell_command", "exec_command", "local_shell")
TASK_TOOLS = ("Agent", "Task", "task", "spawn_agent")  # Codex: spawn_agent in the "collaboration" namespace
SUBAGENT_PROMPT = "Reply with the single word hi. Do not use any tool."


# ---------------------------------------------------------------- reading the request


def _text_of(content) -> str:
    """All text in a message content (string, or a list of blocks/parts)."""
    if isinstance(content, str):
        return content
    out = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                for key in ("text", "input_text"):
                    if isinstance(part.get(key), str):
                        out.append(part[key])
                if part.get("type") in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
                    pass
    return "\n".join(out)


def _last_turn(body: dict) -> tuple[str, bool]:
    """(text of the last user prompt, whether the last input item is a tool result)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        # Claude Code puts ``role: "system"`` entries after the user prompt: look past them.
        msgs = [m for m in msgs if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))]
    if isinstance(msgs, list) and msgs:
        last = msgs[-1]
        if isinstance(last, dict):
            if last.get("role") == "tool":
                return "", True
            content = last.get("content")
            if isinstance(content, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in content
            ):
                return "", True
            if last.get("role") == "user":
                return _text_of(content), False
            return "", False
    items = body.get("input")
    if isinstance(items, str):
        return items, False
    if isinstance(items, list) and items:
        items = [i for i in items if not (isinstance(i, dict) and i.get("role") in ("system", "developer"))]
        last = items[-1] if items else None
        if isinstance(last, dict):
            if last.get("type") in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
                return "", True
            if last.get("role") == "user":
                return _text_of(last.get("content")), False
    return "", False


def _tools(body: dict) -> dict[str, dict]:
    """Tool name -> {"schema", "type", "namespace"}, from Anthropic and OpenAI tool lists, including
    Responses namespaces and Codex's ``additional_tools`` input item (responses-lite)."""
    out: dict[str, dict] = {}

    def add(tool, namespace=None):
        if not isinstance(tool, dict):
            return
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                add(inner, tool.get("name"))
        elif isinstance(tool.get("function"), dict):  # OpenAI chat
            fn = tool["function"]
            out[fn.get("name", "")] = {"schema": fn.get("parameters") or {}, "type": "function", "namespace": None}
        elif "name" in tool:  # Anthropic, OpenAI responses
            out[tool["name"]] = {"schema": tool.get("input_schema") or tool.get("parameters") or {},
                                 "type": tool.get("type") or "function", "namespace": namespace}

    for tool in body.get("tools") or []:
        add(tool)
    items = body.get("input")
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                for tool in item.get("tools") or []:
                    add(tool)
    return out


def _fill(schema: dict, name: str, kind: str) -> dict:
    """Arguments for a tool call: the required properties, filled with harmless values."""
    props = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    args: dict = {}
    for prop in required or list(props):
        spec = props.get(prop) or {}
        typ = spec.get("type")
        if prop in ("command", "cmd"):
            args[prop] = ["bash", "-lc", "echo hi"] if typ == "array" else "echo hi"
        elif prop == "description":
            args[prop] = "Print hi" if kind == "shell" else "Say hi"
        elif prop == "task_name":
            args[prop] = "say_hi"
        elif prop in ("prompt", "message", "task", "instructions"):
            args[prop] = SUBAGENT_PROMPT
        elif prop == "subagent_type":
            enum = spec.get("enum")
            args[prop] = enum[0] if enum else ("general-purpose" if name in ("Agent", "Task") else "general")
        elif prop == "agent_type":
            enum = spec.get("enum")
            args[prop] = enum[0] if enum else "default"
        elif "enum" in spec:
            args[prop] = spec["enum"][0]
        elif typ == "string":
            args[prop] = "hi"
        elif typ in ("integer", "number"):
            args[prop] = 1
        elif typ == "boolean":
            args[prop] = False
        elif typ == "array":
            args[prop] = []
        elif typ == "object":
            args[prop] = {}
        if not required and prop not in ("command", "cmd", "description"):
            args.pop(prop, None)
    return args


def decide(body: dict) -> dict:
    """What to answer: {"text": str} or {"tool": name, "args": dict}."""
    prompt, after_tool = _last_turn(body)
    tools = _tools(body)
    if not after_tool:
        wanted = None
        if "RUNTASK" in prompt:
            wanted = next((t for t in TASK_TOOLS if t in tools), None)
            kind = "task"
        elif "RUNTOOL" in prompt:
            wanted = next((t for t in SHELL_TOOLS if t in tools), None)
            kind = "shell"
        if wanted:
            return {"tool": wanted, "args": _fill(tools[wanted]["schema"], wanted, kind),
                    "namespace": tools[wanted]["namespace"]}
        if "RUNTOOL" in prompt and tools.get("exec", {}).get("type") == "custom":
            # Codex (responses-lite): the only direct tool is ``exec``, a custom tool taking JavaScript.
            return {"tool": "exec", "custom_input": 'text("hi")', "namespace": tools["exec"]["namespace"]}
    if "</block>" in (body.get("stop_sequences") or []):  # Claude Code's auto-mode classifier: allow
        return {"text": "<block>no"}
    if not tools and ("json_schema" in json.dumps(body.get("output_format") or body.get("output_config") or "")):
        return {"text": json.dumps({"title": "Echo hi in the shell"})}
    if not tools and "title" in json.dumps(body.get("system") or "")[:4000].lower():
        return {"text": "Echo hi in the shell"}
    return {"text": "hi" if not after_tool else "Done: the command printed hi."}


# ---------------------------------------------------------------- wire formats


def _sse(events: list[tuple[str | None, dict | str]]) -> bytes:
    out = []
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        out.append((f"event: {name}\n" if name else "") + f"data: {payload}\n\n")
    return "".join(out).encode()


def _said(answer: dict, n: int) -> str:
    """The answer's text; in lineage mode made unique per response (a real model's two answers to
    one prompt differ too, which is what tells two same-prompt conversations apart)."""
    return f"{answer['text']} ({_RUN}{n:06d})" if LINEAGE else answer["text"]


def _thinking(body: dict) -> bool:
    """Lineage mode answers a request that enables thinking with a signed thinking block first."""
    thinking = body.get("thinking")
    return LINEAGE and isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def anthropic(body: dict, answer: dict, n: int) -> tuple[bytes, str]:
    model = body.get("model") or "claude-fake"
    msg_id = f"msg_fake{_RUN}{n:06d}"
    usage = {"input_tokens": 100, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 5}
    if "tool" in answer:
        block = {"type": "tool_use", "id": f"toolu_fake{_RUN}{n:06d}", "name": answer["tool"], "input": answer["args"]}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": _said(answer, n)}
        stop = "end_turn"
    blocks = [block]
    omitted = (body.get("thinking") or {}).get("display") == "omitted" if _thinking(body) else True
    if _thinking(body):
        thought = {"type": "thinking", "thinking": "" if omitted else "The user wants a short answer.",
                   "signature": f"sigfake{_RUN}{n:06d}" + "Q" * 40}
        blocks = [thought, block]
    if not body.get("stream"):
        return json.dumps({
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop, "stop_sequence": None, "usage": usage,
        }).encode(), "application/json"
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": dict(usage, output_tokens=1)}}),
    ]
    for index, b in enumerate(blocks):
        if b["type"] == "thinking":
            start = dict(b, thinking="", signature="")
            deltas = ([] if omitted else [{"type": "thinking_delta", "thinking": b["thinking"]}]) + [
                {"type": "signature_delta", "signature": b["signature"]}]
        elif b["type"] == "tool_use":
            start = dict(b, input={})
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(answer["args"])}]
        else:
            start = dict(b, text="")
            deltas = [{"type": "text_delta", "text": b["text"]}]
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
        if index == 0:
            events.append(("ping", {"type": "ping"}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events += [
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": dict(usage, output_tokens=5)}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return _sse(events), "text/event-stream; charset=utf-8"


def openai_chat(body: dict, answer: dict, n: int) -> tuple[bytes, str]:
    model = body.get("model") or "gpt-fake"
    cid, created = f"chatcmpl-fake{_RUN}{n:06d}", int(time.time())
    usage = {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}
    if "tool" in answer:
        call = {"id": f"call_fake{_RUN}{n:06d}", "type": "function",
                "function": {"name": answer["tool"], "arguments": json.dumps(answer["args"])}}
        message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": _said(answer, n)}, "stop"
    if not body.get("stream"):
        return json.dumps({"id": cid, "object": "chat.completion", "created": created, "model": model,
                           "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                           "usage": usage}).encode(), "application/json"

    def chunk(delta, finish_reason=None, **extra):
        return (None, dict({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}, **extra))

    events = [chunk({"role": "assistant", "content": ""})]
    if LINEAGE and body.get("reasoning_effort"):
        # GLM/Kimi-style gateways stream the model's reasoning as reasoning_content first.
        events.append(chunk({"reasoning_content": "The user wants a short answer."}))
    if "tool" in answer:
        events.append(chunk({"tool_calls": [dict(call, index=0)]}))
    else:
        events.append(chunk({"content": message["content"]}))
    events.append(chunk({}, finish, usage=usage))
    events.append((None, "[DONE]"))
    return _sse(events), "text/event-stream; charset=utf-8"


def responses_events(body: dict, answer: dict | None, n: int) -> tuple[dict, list[tuple[str, dict]]]:
    """(the completed response, its stream events). ``answer`` None: an empty response (Codex's
    WebSocket warm-up, ``generate: false``)."""
    model = body.get("model") or "gpt-fake"
    rid, created = f"resp_fake{_RUN}{n:06d}", int(time.time())
    usage = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 105}
    items: list[dict] = []
    if answer is not None and LINEAGE and "reasoning.encrypted_content" in (body.get("include") or []):
        items.append({"id": f"rs_fake{_RUN}{n:06d}", "type": "reasoning", "summary": [],
                      "encrypted_content": f"encfake{_RUN}{n:06d}" + "Q" * 40})
    if answer is None:
        pass
    elif "custom_input" in answer:
        items.append({"id": f"ctc_fake{_RUN}{n:06d}", "type": "custom_tool_call", "status": "completed",
                      "call_id": f"call_fake{_RUN}{n:06d}", "name": answer["tool"], "input": answer["custom_input"]})
    elif "tool" in answer:
        items.append({"id": f"fc_fake{_RUN}{n:06d}", "type": "function_call", "status": "completed",
                      "call_id": f"call_fake{_RUN}{n:06d}", "name": answer["tool"],
                      "arguments": json.dumps(answer["args"])})
    else:
        items.append({"id": f"msg_fake{_RUN}{n:06d}", "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": _said(answer, n), "annotations": []}]})
    if answer is not None and "tool" in answer and answer.get("namespace"):
        items[-1]["namespace"] = answer["namespace"]
    base = {"id": rid, "object": "response", "created_at": created, "model": model, "error": None,
            "incomplete_details": None, "instructions": None, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": []}
    done = dict(base, status="completed", output=items, usage=usage)
    seq = itertools.count()
    ev = lambda name, **data: (name, dict({"type": name, "sequence_number": next(seq)}, **data))  # noqa: E731
    events = [ev("response.created", response=dict(base, status="in_progress", output=[], usage=None)),
              ev("response.in_progress", response=dict(base, status="in_progress", output=[], usage=None))]
    for i, item in enumerate(items):
        pending = dict(item, status="in_progress")
        if item["type"] == "reasoning":
            events.append(ev("response.output_item.added", output_index=i, item=dict(item, encrypted_content=None)))
        elif item["type"] == "custom_tool_call":
            events += [
                ev("response.output_item.added", output_index=i, item=dict(pending, input="")),
                ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=i, delta=item["input"]),
                ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=i, input=item["input"]),
            ]
        elif item["type"] == "function_call":
            events += [
                ev("response.output_item.added", output_index=i, item=dict(pending, arguments="")),
                ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                   delta=item["arguments"]),
                ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                   arguments=item["arguments"]),
            ]
        else:
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [
                ev("response.output_item.added", output_index=i, item=dict(pending, content=[])),
                ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part),
                ev("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text),
                ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text),
                ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                   part=dict(part, text=text)),
            ]
        events.append(ev("response.output_item.done", output_index=i, item=item))
    events.append(ev("response.completed", response=done))
    return done, events


def openai_responses(body: dict, answer: dict, n: int) -> tuple[bytes, str]:
    done, events = responses_events(body, answer, n)
    if not body.get("stream"):
        return json.dumps(done).encode(), "application/json"
    return _sse(events), "text/event-stream; charset=utf-8"


def websocket_answer(body: dict) -> list[dict]:
    """The messages answering one ``response.create`` on Codex's WebSocket."""
    n = next(_counter)
    answer = None if body.get("generate") is False else decide(body)
    log.info("fake: websocket response.create -> %s", "warm-up" if answer is None else "answer")
    return [data for _, data in responses_events(body, answer, n)[1]]


MODELS = {"object": "list", "data": [
    {"id": m, "object": "model", "created": 0, "owned_by": "fake"}
    for m in ("claude-sonnet-4-5", "claude-haiku-4-5", "gpt-5-nano", "gpt-5.1-codex", "qwen3-coder")]}


class FakeUpstream:
    def __init__(self) -> None:
        self.ws = FakeResponsesWebSocket(websocket_answer, lambda: [(b"x-request-id", f"req_fake{_RUN}ws".encode())])

    async def running(self) -> None:
        if WEBSOCKET:
            port = await self.ws.start()
            log.info("fake: Responses WebSocket server on 127.0.0.1:%d", port)

    def done(self) -> None:
        self.ws.close()

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:  # an addon loaded before this one already answered
            return
        req = flow.request
        path = req.path.split("?", 1)[0].rstrip("/")
        if req.method == "GET" and req.headers.get("upgrade", "").lower() == "websocket":
            if WEBSOCKET and path.endswith("/responses") and self.ws.port:
                # Relay it to the local WebSocket server; the converter reads the client's URL back
                # from the metadata (the flow's request now names the local server).
                flow.metadata["fake_original_url"] = req.pretty_url
                host_header = req.host_header
                req.scheme, req.host, req.port = "http", "127.0.0.1", self.ws.port
                req.host_header = host_header  # the recorded headers stay the client's
                return
        n = next(_counter)
        headers = {"request-id": f"req_fake{_RUN}{n:06d}", "x-request-id": f"req_fake{_RUN}{n:06d}"}
        if req.method == "GET" and req.headers.get("upgrade", "").lower() == "websocket":
            flow.response = http.Response.make(426, b"websocket not offered by the fake", headers)
            return
        body = None
        if req.method == "POST":
            try:
                body = json.loads(req.get_content(strict=False) or b"null")
            except ValueError:
                body = None
        if isinstance(body, dict) and path.endswith("/messages/count_tokens"):
            content, ctype = json.dumps({"input_tokens": 1234}).encode(), "application/json"
        elif isinstance(body, dict) and path.endswith("/messages"):
            content, ctype = anthropic(body, decide(body), n)
        elif isinstance(body, dict) and path.endswith("/chat/completions"):
            content, ctype = openai_chat(body, decide(body), n)
        elif isinstance(body, dict) and path.endswith("/responses"):
            content, ctype = openai_responses(body, decide(body), n)
        elif req.method == "GET" and path.endswith("/accounts/check"):
            # Codex signed in with (fake) ChatGPT tokens discovers its workspace here before any turn.
            # Not enough yet: 0.171.0 still stops with "workspace routing discovery ..." (docs/traffic.md).
            acct = "00000000-0000-0000-0000-000000000000"
            content, ctype = json.dumps({"accounts": {acct: {"account": {
                "account_id": acct, "structure": "personal", "plan_type": "plus", "is_deactivated": False,
                "name": None, "profile_picture_url": None, "workspace_backend_origin": "https://chatgpt.com",
                "backend_origin": "https://chatgpt.com",
                }, "workspace_backend_origin": "https://chatgpt.com", "backend_origin": "https://chatgpt.com"}},
                "account_ordering": [acct], "workspace_backend_origin": "https://chatgpt.com"}).encode(), "application/json"
        elif req.method == "GET" and path.endswith("/codex/models"):
            content, ctype = json.dumps({"models": []}).encode(), "application/json"
        elif req.method == "GET" and path.endswith("/models"):
            content, ctype = json.dumps(MODELS).encode(), "application/json"
        else:
            content, ctype = b"{}", "application/json"
        headers["content-type"] = ctype
        flow.response = http.Response.make(200, content, headers)
        log.info("fake: %s %s -> %s", req.method, req.pretty_url[:120], ctype)


addons = [FakeUpstream()]
