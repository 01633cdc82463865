"""What a request is: its api, agent, session and turn.

``read(method, url, headers, body)`` is a pure function (no mitmproxy, no I/O) and
never raises: bad input gives ``Facts`` with ``parsed=False`` and the reason, plus
whatever could still be read (e.g. the session from a header when the body is garbage).

Rules it keeps (sources: ../shared/reference/agent-traffic.md, the recordings in
tests/fixtures/traffic, seeds/000's turn rule; docs/facts.md lists each one):
- api from method and path only (reverse mode rewrites the host): a POST whose path ends
  with /v1/messages, /v1/messages/count_tokens, /v1/chat/completions or /v1/responses,
  exactly, after a plain prefix, and is not ambiguous (``paths.api_of_path``; the router,
  which knows the server's base, asks ``paths.scope`` and passes its api in); anything
  else is "other", which has no session and no turn.
- agent from the User-Agent and the agents' own headers.
- session from the agent's own id (headers first, then the body), then a list of common
  session headers, then a fingerprint ``fp:<hash>`` of the conversation's opening (system
  prompt + first user message), normalised so every later turn gives the same one. A client
  id is never taken if it looks like a fingerprint, is empty, too long, or has control chars.
- conflict: the header that named the session, sent again with another value, or one of the
  agent's own session headers holding no usable id (``conflict``): the router refuses such a
  request, which names two conversations, or names one it cannot read.
- turn: count_tokens is side; Claude Code by ``x-claude-code-request-class``, then the
  billing line of system[0]; opencode by ``x-parent-session-id`` and the title request;
  Codex by ``x-openai-subagent`` and ``x-codex-turn-metadata``; everyone else by history.
- The body is decoded (gzip, deflate, br, zstd; ``sessionpin.reader.encodings``) up to MAX_BODY
  bytes and only the fields the facts need are built (``sessionpin.reader.wire``): contents stay
  unparsed.
- Nothing from a prompt leaves this module but a hash.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import msgspec

from . import encodings, knownarrays, knownvalues, largebody, modelspan, paths, wire
from .encodings import MAX_BODY, MAX_REQUEST_BODY, body_too_large, decode_body  # noqa: F401 (the reader's API)
# The names, session and turn rules live in their own modules; facts re-exports them.
from .kinds import (AGENTS, ANTHROPIC_COUNT_TOKENS, ANTHROPIC_MESSAGES, BILLING_PREFIX, CLAUDE_CODE,  # noqa: F401
                    CODEX, CONTINUATION, FINGERPRINT_PREFIX, GEMINI_CLI, INFERENCE_APIS, MAX_ID, MAX_USER_ID,
                    OPENAI_CHAT, OPENAI_RESPONSES, OPENCODE, OPENING, OTHER, PI, SIDE, SUBAGENT, UNKNOWN_AGENT,
                    UNKNOWN_TURN)
from .kinds import text as _text
from .sessions import (AGENT_SESSION_HEADERS, clean_id, codex_turn_metadata, fingerprint, opening,  # noqa: F401
                       session_of, user_id_session)
from .turns import billing_line, has_history, has_tools, turn_of, upgrade_turn  # noqa: F401

class Facts(msgspec.Struct, frozen=True, kw_only=True):
    api: str                      # one of the api constants
    agent: str                    # one of AGENTS or "unknown"
    session: str | None = None    # the conversation whose pin this request follows
    session_source: str | None = None  # where it came from: "header:x-claude-code-session-id", "metadata.user_id", "fingerprint", ...
    turn: str | None = None       # opening | continuation | side | subagent | unknown; None when api is "other"
    model: str | None = None      # top-level body model
    stream: bool | None = None    # the client asked for a stream
    has_history: bool = False     # the body carries assistant turns (a conversation already under way)
    has_tools: bool = False       # the body offers tools (an agent's main turns do; titles do not)
    parsed: bool = True           # False: the body could not be read (see reason)
    reason: str = ""              # which rule decided the turn, or why the body was unparsed
    model_span: tuple[int, int] | None = None  # where the top-level model's value lies in the
                                  # decoded body, when the large-body reader found it (the
                                  # rewrite then renames it without reading the body again)
    conflict: str = ""            # the header that named the session, sent twice with different
                                  # values: which conversation it is cannot be told (refused)


# ---------------------------------------------------------------- the entry point


def read(
    method: str | bytes,
    url: str | bytes,
    headers: Iterable[tuple[str | bytes, str | bytes]] | Any,
    body: bytes | None,
    content_encoding: str | bytes | None = None,
    *,
    api: str | None = None,
    locate_model: bool = False,
    members: list[dict[str, msgspec.Raw]] | None = None,
) -> Facts:
    """The facts of one request. Never raises. ``api``: what the router's ``paths.scope``
    said, which knows the server's base (``/api/paas/v4/chat/completions`` is chat at a
    server written ``…/api/paas/v4``); by default the api of the path alone.
    ``locate_model``: the model may be renamed (the config has a model map), so say where it
    lies (``Facts.model_span``) from the one decode of the body. ``members`` (a list the caller
    owns): receives the body's top level as raw members when the read made them (a Claude Code
    or OpenCode body), for later readers of the same body (the prompt shape)."""
    try:
        return _read(method, url, headers, body, content_encoding, api, locate_model, members)
    except Exception as e:  # pragma: no cover - a last resort; the property tests look for it
        try:
            api, agent = api_of(_text(method), _text(url)), agent_of(header_map(headers))
        except Exception:
            api, agent = OTHER, UNKNOWN_AGENT
        return Facts(api=api, agent=agent, turn=None if api == OTHER else UNKNOWN_TURN, parsed=False,
                     reason=f"internal error: {type(e).__name__}")


class _WholeNeeded(Exception):
    """Only a whole read of the body can tell its facts (``read_parts``)."""


def read_parts(
    method: str | bytes,
    url: str | bytes,
    headers: Iterable[tuple[str | bytes, str | bytes]] | Any,
    body: bytes,
    *,
    api: str | None = None,
    objects: int,
) -> Facts | None:
    """The facts of a large body (from ``largebody.FAST_MIN``, not compressed) when its parts
    tell them (``largebody.fast_decode``: the members before the messages, the first messages,
    the members after them), building at most ``objects`` JSON objects; None when only a whole
    read can tell them — the caller decides where that read runs. The parts' read does a
    bounded number of Python steps and scans each byte a bounded number of times in C, whatever
    the body holds: what it costs does not grow with the number of objects in the body, which
    is what holds a whole read's event loop. Never raises (None)."""
    try:
        return _read(method, url, headers, body, "", api, True, None, parts_only=objects)
    except Exception:       # _WholeNeeded, or anything odd: the whole read says what it says
        return None


def header_session(agent: str, headers: object) -> str | None:
    """The session a request names in its headers alone (no body read, no fingerprint):
    for requests that are not inference, like Codex's WebSocket upgrade, whose facts
    carry no session."""
    try:
        return session_of(agent, header_map(headers), wire.Body())[0]
    except Exception:
        return None


def read_upgrade(url: str | bytes, headers: object) -> Facts:
    """The facts of a WebSocket upgrade to a Responses endpoint (Codex opens its turns on
    one): the headers say the agent, the session and the turn (``turns.upgrade_turn``);
    the model is the one the turn metadata names, renamed per message. Never raises."""
    try:
        h = header_map(headers)
        agent = agent_of(h)
        session, source, _ = session_of(agent, h, wire.Body())
        turn, why, history = upgrade_turn(h)
        model = codex_turn_metadata(h).get("model")
        return Facts(api=OPENAI_RESPONSES, agent=agent, session=session, session_source=source, turn=turn,
                     model=model, stream=True, has_history=history, has_tools=True, reason=why,
                     conflict=conflict(headers, h, source, agent))
    except Exception as e:  # pragma: no cover - a last resort
        return Facts(api=OPENAI_RESPONSES, agent=UNKNOWN_AGENT, turn=UNKNOWN_TURN, parsed=False,
                     reason=f"internal error: {type(e).__name__}")


def _read(method, url, headers, body, content_encoding, api=None, locate_model=False, members=None,
          parts_only: int | None = None) -> Facts:
    h = header_map(headers)
    if api is None:
        api = api_of(_text(method), _text(url))
    agent = agent_of(h)
    if api not in INFERENCE_APIS:
        return Facts(api=api, agent=agent, reason="not an inference request")

    if content_encoding is None:
        content_encoding = h.get("content-encoding", "")
    data, problem = decode_body(body, _text(content_encoding))
    parsed_body: wire.Body | None = None
    spans: dict[str, tuple[int, int]] = {}
    if not problem:
        # pi and Codex may name their session only in the body's prompt_cache_key (pi is
        # known by its prompt, so an unknown agent may be pi): only they need it looked for.
        # Claude Code's and OpenCode's bodies are mostly what the facts do not read (tool
        # schemas): read as raw members, skimmed once, they give the model's span and the members
        # the prompt shape reads later without a decode of its own. Codex's and pi's are mostly
        # their history, which that read would decode twice: read typed (issue 22).
        by_members = agent in (CLAUDE_CODE, OPENCODE)
        parsed_body, problem = parse_body(data, api, cache_key=agent in (PI, CODEX, UNKNOWN_AGENT), spans=spans,
                                          locate_model=locate_model and by_members,
                                          members=members if by_members else None, parts_only=parts_only)
    b = parsed_body if parsed_body is not None else wire.Body()
    ok = not problem

    history = has_history(b)
    if agent == UNKNOWN_AGENT and any(PI_MARKER.search(text) for text in opening(b, with_user=False)[0]):
        agent = PI
    session, source, parent_rule = session_of(agent, h, b)
    turn, why = turn_of(api, agent, h, b, history, ok, parent_rule)
    if ok:
        reason = why
    else:
        reason = problem if turn == UNKNOWN_TURN else f"{problem}; {why}"
    return Facts(
        api=api,
        agent=agent,
        session=session,
        session_source=source,
        turn=turn,
        model=b.model,
        stream=(b.stream is True) if ok else b.stream,
        has_history=history,
        has_tools=has_tools(b),
        parsed=ok,
        reason=reason,
        model_span=spans.get("model") if b.model is not None else None,
        conflict=conflict(headers, h, source, agent),
    )


# ---------------------------------------------------------------- headers, api, agent


def header_map(headers: object) -> dict[str, str]:
    """Lower-case name -> first value. Pairs, a mapping, or garbage (read as far as it goes)."""
    if type(headers) is tuple:
        # mitmproxy's fields, UTF-8 throughout (the usual case): one comprehension, the pairs
        # taken last to first so a name's first value is the one kept (2.9 -> 1.7 µs for six
        # headers). Anything else (str, not UTF-8, not pairs) is read by the loop below.
        try:
            fast = {n.decode().strip().lower(): v.decode().strip() for n, v in reversed(headers)}
        except (AttributeError, TypeError, ValueError):      # (UnicodeDecodeError is a ValueError)
            pass
        else:
            fast.pop("", None)
            return fast
    out: dict[str, str] = {}
    if headers is None or isinstance(headers, (str, bytes)):
        return out
    try:
        items = headers.items() if hasattr(headers, "items") else headers
        for pair in items:  # type: ignore[union-attr]
            try:
                name, value = pair
            except (TypeError, ValueError):
                continue
            if type(name) is bytes and type(value) is bytes:   # mitmproxy's fields: _text's usual case
                try:
                    key = name.decode().strip().lower()
                    if key and key not in out:
                        out[key] = value.decode().strip()
                    continue
                except UnicodeDecodeError:
                    pass
            key = _text(name).strip().lower()
            if key and key not in out:
                out[key] = _text(value).strip()
    except Exception:  # a broken iterable: keep what was read
        pass
    return out


def conflict(headers: object, h: dict[str, str], source: str | None, agent: str = "") -> str:
    """"" — or what is wrong with the headers that name the request's session, when which
    conversation it belongs to cannot be told (no client sends either):
    - one of the agent's own session headers (``AGENT_SESSION_HEADERS``, and a parent's) holds
      a value that is not a usable id (``clean_id``: longer than ``MAX_ID``, a control
      character, a fingerprint's ``fp:``): the session was read elsewhere — the body, another
      header, the fingerprint — and a pinned conversation's turn, read as another, went where
      that other one goes;
    - the header it came from (``source`` ``header:NAME``) is sent more than once with
      different values (``header_map`` keeps the first, a server may keep the last or both).
      Only pairs are looked at again, only when ``h`` holds fewer names than ``headers`` has
      fields (a name sent twice): one comparison for every other request."""
    own = AGENT_SESSION_HEADERS.get(agent, ())
    if agent not in (CLAUDE_CODE, CODEX):
        own = ("x-parent-session-id", *own)
    for name in own:
        value = h.get(name)
        if value and clean_id(value) is None:
            why = (f"longer than {MAX_ID} characters" if len(value) > MAX_ID
                   else "it looks like sessionpin's fingerprint" if value.startswith(FINGERPRINT_PREFIX)
                   else "a control character")
            return f"the {name} header is not a usable session id ({why})"
    if not source or not source.startswith("header:") or not isinstance(headers, (tuple, list)) \
            or len(headers) == len(h):
        return ""
    name = source[len("header:"):]
    values: set[str] = set()
    for pair in headers:
        try:
            k, v = pair
        except (TypeError, ValueError):
            continue
        if _text(k).strip().lower() == name and (value := _text(v).strip()):
            values.add(value)           # (an empty one names nothing)
    if len(values) < 2:
        return ""
    return f"the {name} header is sent {len(values)} times with different values"


def api_of(method: str, url: str) -> str:
    """The api of a request by its method and URL (or path), the server's prefix unknown:
    ``paths.api_of_path``. The router asks ``paths.scope`` with the prefix."""
    path = url
    scheme = path.find("://")
    if scheme != -1:
        slash = path.find("/", scheme + 3)
        path = path[slash:] if slash != -1 else "/"
    return paths.api_of_path(method, path)


# pi sends its SDK's User-Agent (OpenAI/JS, Anthropic/JS) and no header of its own: only its
# default system prompt names it (recordings of pi 0.73.1: "…operating inside pi, a coding
# agent harness."). Matched loosely, so a reworded prompt of another version still names it.
PI_MARKER = re.compile(r"\binside pi\b|\bpi, a coding agent\b|\bpi[- ]coding[- ]agent\b", re.IGNORECASE)


def agent_of(h: dict[str, str]) -> str:
    """The agent by its headers; pi, which has none, is recognised later by its system prompt."""
    ua = h.get("user-agent", "").lower()
    if (
        ua.startswith(("claude-cli/", "claude-code/"))
        or "x-claude-code-session-id" in h
        or h.get("x-service-name", "").lower() == "claude-code"  # its telemetry (UA Bun/…)
    ):
        return CLAUDE_CODE
    if ua.startswith("opencode/") or "x-opencode-session" in h or "x-opencode-client" in h:
        return OPENCODE
    if (
        ua.startswith(("codex_", "codex/", "codex-"))
        or h.get("originator", "").lower().startswith("codex")
        or "x-codex-turn-metadata" in h
    ):
        return CODEX
    if "geminicli/" in ua or "gemini-cli/" in ua:
        return GEMINI_CLI
    if ua.startswith(("pi/", "pi-coding-agent/", "pi-ai/")) or "pi-coding-agent" in ua:
        return PI
    return UNKNOWN_AGENT


# ---------------------------------------------------------------- the body


_FLAVOUR = {
    ANTHROPIC_MESSAGES: "anthropic",
    ANTHROPIC_COUNT_TOKENS: "anthropic",
    OPENAI_CHAT: "chat",
    OPENAI_RESPONSES: "responses",
}


def parse_body(data: bytes, api: str | None = None, cache_key: bool = True,
               spans: dict[str, tuple[int, int]] | None = None,
               locate_model: bool = False,
               members: list[dict[str, msgspec.Raw]] | None = None,
               parts_only: int | None = None) -> tuple[wire.Body | None, str]:
    """The body's facts fields, and "" or why some could not be read. A large body of a
    known api is read in parts (``largebody.fast_decode``, which fills ``spans`` with the
    byte spans of the top-level members it read first); anything odd reads it whole — as raw
    members, then each field, when ``locate_model`` asks where the model lies or ``members``
    wants them (``_members``)."""
    if not data.strip():
        return None, "empty body"
    if len(data) >= largebody.FAST_MIN and api in _FLAVOUR:
        try:
            fast = largebody.fast_decode(data, _FLAVOUR[api], cache_key, spans, parts_only)
        except Exception:  # pragma: no cover - the whole-body path below is the safe one
            fast = None
        if fast is not None:
            return fast
    if parts_only is not None:
        raise _WholeNeeded("the parts do not tell")     # ``read_parts``: no whole read here
    if spans:
        spans.clear()           # what the parts' read found before it gave up is not this read's
    if locate_model or members is not None or (len(data) >= knownarrays.MIN_SIZE and api != OPENAI_RESPONSES):
        # A typed read's body this long is mostly its history. A chat's (pi's: a thousand
        # messages in 94 KB) is read as members, so the messages it sent before are compared,
        # not decoded again (``knownarrays``, ``knownvalues``): 200-380 -> 65-105 µs a turn
        # (``scripts/bench_histories.py``). Not a Responses input: Codex's items are few and
        # long, decoded as fast as they are compared.
        got = _members(data, spans if locate_model else None, members)
        if got is not None:
            return got
    return _whole(data, spans)


def _members(data: bytes, spans: dict[str, tuple[int, int]] | None,
             out: list[dict[str, msgspec.Raw]] | None) -> tuple[wire.Body, str] | None:
    """The body as raw top-level members, then each facts field: the fields, where the model
    lies (``spans``: the rename then reads the body no more; from scratch that costs as much as
    this whole read), and the members themselves (``out``: the prompt shape reads them instead
    of the body). For bodies mostly made of what the facts do not read (tool schemas); a
    typed decode of the whole is cheaper for one mostly made of history, decoded once instead
    of skimmed then decoded (Codex's 75 KB ``input``: 30 µs vs 58). None (anything odd: a
    field that does not decode, not an object…): ``_whole`` reads it and says what is wrong
    as it always did."""
    try:
        fields = knownvalues.members(data)      # the tool schemas sent again: compared, not skimmed
    except (msgspec.DecodeError, RecursionError):
        return None
    values, problem = wire.decode_fields(fields)
    if problem:
        return None
    if out is not None:
        out.append(fields)
    if spans is not None and isinstance(values.get("model"), str):
        try:
            spans["model"] = modelspan.model_span(data, fields)
        except modelspan.ModelNotFound:
            pass                # the rewrite looks again, and refuses what it cannot locate
    return wire.Body(**values), ""


def _whole(data: bytes, spans: dict[str, tuple[int, int]] | None) -> tuple[wire.Body | None, str]:
    """The whole body typed in one decode (msgspec skips what no fact needs); a field of the
    wrong type sends it to the top level as raw members, each field then decoded on its own,
    so one bad field spoils only itself — and that decode also says where the model lies.

    (Measured, issue 22: the raw members first and each field after, for every body, cost more
    than this typed decode on input-heavy bodies — Codex's 75 KB ``input`` decoded twice, +28 µs
    — for a span the rename needs only on a move: docs/benchmarks.md.)"""
    wire.count(len(data))
    try:
        return wire.body_decoder.decode(data), ""
    except msgspec.ValidationError:
        pass  # some field has an unexpected type: read field by field below
    except msgspec.DecodeError as e:
        return None, "not JSON: truncated" if "truncated" in str(e) else "not JSON"
    except RecursionError:  # msgspec's guard against deep nesting
        return None, "not JSON: nested too deeply"
    wire.count(len(data))
    try:
        fields = wire.loose_decoder.decode(data)
    except msgspec.ValidationError:
        return None, "body is not a JSON object"
    except RecursionError:  # a deep value the typed pass never reached
        return None, "not JSON: nested too deeply"
    except msgspec.DecodeError:  # pragma: no cover - the typed pass saw the same bytes
        return None, "not JSON"
    values, problem = wire.decode_fields(fields)
    if spans is not None and isinstance(values.get("model"), str):
        try:
            spans["model"] = modelspan.model_span(data, fields)
        except modelspan.ModelNotFound:
            pass                # the rewrite looks again, and refuses what it cannot locate
    return wire.Body(**values), problem


