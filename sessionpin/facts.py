"""What a request is: its api, agent, session and turn.

``read(method, url, headers, body)`` is a pure function (no mitmproxy, no I/O) and
never raises: bad input gives ``Facts`` with ``parsed=False`` and the reason, plus
whatever could still be read (e.g. the session from a header when the body is garbage).

Rules it keeps (sources: ../shared/reference/agent-traffic.md, the recordings in
tests/fixtures/traffic, seeds/000's turn rule; docs/facts.md lists each one):
- api from method and path only (reverse mode rewrites the host): a POST whose path ends
  with /v1/messages, /v1/messages/count_tokens, /v1/chat/completions or /v1/responses,
  exactly, and is not ambiguous (``paths.api_of_path``; the router, which knows the
  server's prefix, asks ``paths.scope``); anything else is "other", which has no session
  and no turn.
- agent from the User-Agent and the agents' own headers.
- session from the agent's own id (headers first, then the body), then a list of common
  session headers, then a fingerprint ``fp:<hash>`` of the conversation's opening (system
  prompt + first user message), normalised so every later turn gives the same one. A client
  id is never taken if it looks like a fingerprint, is empty, too long, or has control chars.
- turn: count_tokens is side; Claude Code by ``x-claude-code-request-class``, then the
  billing line of system[0]; opencode by ``x-parent-session-id`` and the title request;
  Codex by ``x-openai-subagent`` and ``x-codex-turn-metadata``; everyone else by history.
- The body is decoded (gzip, deflate, br, zstd; ``sessionpin.encodings``) up to MAX_BODY
  bytes and only the fields the facts need are built (``sessionpin.wire``): contents stay
  unparsed.
- Nothing from a prompt leaves this module but a hash.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable

import msgspec

from . import encodings, paths, wire
from .encodings import MAX_BODY, MAX_REQUEST_BODY, body_too_large, decode_body  # noqa: F401 (the reader's API)
from .paths import ANTHROPIC_COUNT_TOKENS, ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES, OTHER  # the apis

INFERENCE_APIS = frozenset({ANTHROPIC_MESSAGES, ANTHROPIC_COUNT_TOKENS, OPENAI_CHAT, OPENAI_RESPONSES})

# agent
CLAUDE_CODE = "claude-code"
OPENCODE = "opencode"
PI = "pi"
CODEX = "codex"
GEMINI_CLI = "gemini-cli"
UNKNOWN_AGENT = "unknown"
AGENTS = (CLAUDE_CODE, OPENCODE, PI, CODEX, GEMINI_CLI)

# turn
OPENING = "opening"
CONTINUATION = "continuation"
SIDE = "side"
SUBAGENT = "subagent"
UNKNOWN_TURN = "unknown"

# A fingerprint session id starts with this; no client id does (they are uuids, ses_…, …).
FINGERPRINT_PREFIX = "fp:"

# A client session id longer than this is not taken (it would become a store key).
MAX_ID = 256
# Claude Code's metadata.user_id longer than this is not read for a session.
MAX_USER_ID = 1024


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


# ---------------------------------------------------------------- the entry point


def read(
    method: str | bytes,
    url: str | bytes,
    headers: Iterable[tuple[str | bytes, str | bytes]] | Any,
    body: bytes | None,
    content_encoding: str | bytes | None = None,
) -> Facts:
    """The facts of one request. Never raises."""
    try:
        return _read(method, url, headers, body, content_encoding)
    except Exception as e:  # pragma: no cover - a last resort; the property tests look for it
        try:
            api, agent = api_of(_text(method), _text(url)), agent_of(header_map(headers))
        except Exception:
            api, agent = OTHER, UNKNOWN_AGENT
        return Facts(api=api, agent=agent, turn=None if api == OTHER else UNKNOWN_TURN, parsed=False,
                     reason=f"internal error: {type(e).__name__}")


def header_session(agent: str, headers: object) -> str | None:
    """The session a request names in its headers alone (no body read, no fingerprint):
    for requests that are not inference, like Codex's WebSocket upgrade, whose facts
    carry no session."""
    try:
        return session_of(agent, header_map(headers), wire.Body())[0]
    except Exception:
        return None


def _read(method, url, headers, body, content_encoding) -> Facts:
    h = header_map(headers)
    api = api_of(_text(method), _text(url))
    agent = agent_of(h)
    if api not in INFERENCE_APIS:
        return Facts(api=api, agent=agent, reason="not an inference request")

    if content_encoding is None:
        content_encoding = h.get("content-encoding", "")
    data, problem = decode_body(body, _text(content_encoding))
    parsed_body: wire.Body | None = None
    if not problem:
        # pi and Codex may name their session only in the body's prompt_cache_key (pi is
        # known by its prompt, so an unknown agent may be pi): only they need it looked for.
        parsed_body, problem = parse_body(data, api, cache_key=agent in (PI, CODEX, UNKNOWN_AGENT))
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
    )


# ---------------------------------------------------------------- headers, api, agent


def _text(value: object) -> str:
    """A header name/value, method or url as str; bytes that are not UTF-8 never raise."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:  # lone surrogates (e.g. from surrogateescape)
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return ""


def header_map(headers: object) -> dict[str, str]:
    """Lower-case name -> first value. Pairs, a mapping, or garbage (read as far as it goes)."""
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
            key = _text(name).strip().lower()
            if key and key not in out:
                out[key] = _text(value).strip()
    except Exception:  # a broken iterable: keep what was read
        pass
    return out


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


def parse_body(data: bytes, api: str | None = None, cache_key: bool = True) -> tuple[wire.Body | None, str]:
    """The body's facts fields, and "" or why some could not be read. A large body of a
    known api is read in parts (``wire.fast_decode``); anything odd there reads it whole."""
    if not data.strip():
        return None, "empty body"
    if len(data) >= wire.FAST_MIN and api in _FLAVOUR:
        try:
            fast = wire.fast_decode(data, _FLAVOUR[api], cache_key)
        except Exception:  # pragma: no cover - the whole-body path below is the safe one
            fast = None
        if fast is not None:
            return fast
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
    return wire.Body(**values), problem


def has_history(b: wire.Body) -> bool:
    """The body carries an assistant turn (or a Responses item only a model makes)."""
    if b.previous_response_id:
        return True
    for m in b.messages or ():
        if m.role == "assistant":
            return True
    if isinstance(b.input, list):
        return any(wire.is_history(item) for item in b.input)
    return False


BILLING_PREFIX = "x-anthropic-billing-header:"


def billing_line(b: wire.Body) -> str | None:
    """Claude Code's ``x-anthropic-billing-header: …`` line in system[0], if any."""
    system = b.system
    first: str | None = None
    if isinstance(system, str):
        first = system
    elif system:
        first = system[0].text
    if first is not None and first.lstrip().startswith(BILLING_PREFIX):
        return first.strip().split("\n", 1)[0]
    return None


def has_tools(b: wire.Body) -> bool:
    return bool(b.tools)


# ---------------------------------------------------------------- session


GENERIC_SESSION_HEADERS = (
    "x-session-id",
    "session-id",
    "session_id",
    "x-session-affinity",
    "x-opencode-session",
    "x-claude-code-session-id",
    "x-conversation-id",
    "conversation-id",
    "conversation_id",
)
AGENT_SESSION_HEADERS = {
    CLAUDE_CODE: ("x-claude-code-session-id",),
    OPENCODE: ("x-opencode-session", "x-session-id", "x-session-affinity"),
    CODEX: ("session-id",),
    PI: ("session_id",),
}
_LEGACY_USER_ID = re.compile(r"_session_([0-9A-Za-z][0-9A-Za-z_-]*)\Z")


def clean_id(value: object) -> str | None:
    """A client id we may key a pin on, or None."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > MAX_ID or value.startswith(FINGERPRINT_PREFIX):
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return None
    return _text(value)


def user_id_session(user_id: str | None) -> tuple[str | None, str | None]:
    """Claude Code's metadata.user_id: JSON string today, ``user_…_session_<uuid>`` before."""
    if not user_id or len(user_id) > MAX_USER_ID:
        # Real ones are ~150 characters; a longer one would only make the legacy pattern's
        # search below quadratic (every "_session_" in it is a start).
        return None, None
    text = user_id.strip()
    if text.startswith("{"):
        try:
            obj = msgspec.json.decode(text)
        except (msgspec.DecodeError, RecursionError):
            return None, None
        if isinstance(obj, dict):
            sid = clean_id(obj.get("session_id"))
            if sid:
                return sid, "metadata.user_id"
        return None, None
    m = _LEGACY_USER_ID.search(text)
    if m:
        sid = clean_id(m.group(1))
        if sid:
            return sid, "metadata.user_id:legacy"
    return None, None


def codex_turn_metadata(h: dict[str, str]) -> dict[str, str]:
    """``x-codex-turn-metadata`` as a dict of its string fields ({} when absent or bad)."""
    raw = h.get("x-codex-turn-metadata")
    if not raw:
        return {}
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return {}
    if not isinstance(obj, dict):
        return {}
    return {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, str)}


def session_of(agent: str, h: dict[str, str], b: wire.Body) -> tuple[str | None, str | None, str | None]:
    """(session, where it came from, the rule if a parent header named it)."""
    if agent not in (CLAUDE_CODE, CODEX):
        parent = clean_id(h.get("x-parent-session-id"))
        if parent:
            return parent, "header:x-parent-session-id", "x-parent-session-id"
    for name in AGENT_SESSION_HEADERS.get(agent, ()):
        sid = clean_id(h.get(name))
        if sid:
            return sid, f"header:{name}", None
    if agent == CLAUDE_CODE and b.metadata is not None:
        sid, source = user_id_session(b.metadata.user_id)
        if sid:
            return sid, source, None
    if agent == CODEX:
        sid = clean_id(codex_turn_metadata(h).get("session_id"))
        if sid:
            return sid, "header:x-codex-turn-metadata", None
    for name in GENERIC_SESSION_HEADERS:
        sid = clean_id(h.get(name))
        if sid:
            return sid, f"header:{name}", None
    if agent in (CODEX, PI):
        sid = clean_id(b.prompt_cache_key)
        if sid:
            return sid, "body:prompt_cache_key", None
    fp = fingerprint(b)  # only now: a first message can be megabytes
    if fp:
        return fp, "fingerprint", None
    return None, None, None


# ---------------------------------------------------------------- fingerprint


def _texts(content: wire.Content) -> list[str]:
    """The text of a string or of the text-bearing blocks, stripped, empties and
    Claude Code's per-request billing line dropped."""
    if isinstance(content, str):
        parts = [content]
    elif content:
        parts = [block.text for block in content if block.text is not None]
    else:
        return []
    out = []
    for text in parts:
        text = text.strip()
        if text.startswith(BILLING_PREFIX):
            # The billing line changes per request (cc_prev_req, …); a string system
            # may carry it as its first line.
            text = text.split("\n", 1)[1].strip() if "\n" in text else ""
        if text:
            out.append(text)
    return out


def _content_texts(raw: msgspec.Raw) -> list[str]:
    if not len(raw):
        return []
    try:
        return _texts(wire.content_decoder.decode(raw))
    except (msgspec.DecodeError, RecursionError):
        return []


def opening(b: wire.Body, with_user: bool = True) -> tuple[list[str], list[str]]:
    """(system prompt texts, first user message texts), normalised: the system prompt is
    ``system`` or ``instructions`` plus the system/developer messages before the first user
    message (later ones are mid-conversation notes)."""
    system = _texts(b.system) + _texts(b.instructions)
    user: list[str] = []
    items = b.messages if b.messages is not None else b.input
    if isinstance(items, str):
        user = _texts(items) if with_user else []
    elif items:
        for m in items:
            if m.role in ("system", "developer"):
                system.extend(_content_texts(m.content))
            elif m.role == "user":
                user = _content_texts(m.content) if with_user else []
                break
    return system, user


# Clients rebuild their system prompt when a process starts, with the day in it (pi ends
# it with "Current date: YYYY-MM-DD"): a conversation continued tomorrow must keep its
# fingerprint, so dates and times in the system prompt do not count.
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DATE_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
    r"|\b\d{1,2}:\d{2}(?::\d{2})?\s*(?:[AaPp][Mm])?\b"
    r"|\b\d{1,2}/\d{1,2}/\d{2,4}\b"
    r"|\b(?:Mon|Tue|Tues|Wed|Wednes|Thu|Thur|Thurs|Fri|Sat|Satur|Sun)(?:day)?\b\.?"   # older pi: "Monday, November 30, 2026, 02:10:48 AM UTC"
    rf"|\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?\b"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}(?:,?\s+\d{{4}})?\b",
    re.IGNORECASE,
)


def fingerprint(b: wire.Body) -> str | None:
    """``fp:`` + blake2b-128 of the normalised opening (system prompt and first user
    message). None when the body has neither."""
    system, user = opening(b)
    if not system and not user:
        return None
    system = [_DATE_TIME.sub("<date>", text) for text in system]
    payload = "\x1e".join(system) + "\x1d" + "\x1e".join(user)
    digest = hashlib.blake2b(payload.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return FINGERPRINT_PREFIX + digest


# ---------------------------------------------------------------- turn


def _by_history(history: bool, ok: bool, who: str) -> tuple[str, str]:
    if not ok:
        return UNKNOWN_TURN, f"{who}: body unreadable"
    if history:
        return CONTINUATION, f"{who}: assistant message in history"
    return OPENING, f"{who}: no assistant message"


def turn_of(
    api: str, agent: str, h: dict[str, str], b: wire.Body, history: bool, ok: bool, parent_rule: str | None
) -> tuple[str, str]:
    """(turn, the rule that decided it)."""
    if api == ANTHROPIC_COUNT_TOKENS:
        return SIDE, "count_tokens"
    if agent == CLAUDE_CODE:
        return _claude_turn(h, b, history, ok)
    if agent == CODEX:
        return _codex_turn(h, history, ok)
    if parent_rule:
        return SUBAGENT, f"{agent}: {parent_rule}"
    if agent == OPENCODE and ok and not has_tools(b) and not history:
        return SIDE, "opencode: no tools, no history (title)"
    return _by_history(history, ok, agent if agent != UNKNOWN_AGENT else "unknown agent")


_SIDE_1P_CLASSES = frozenset({"summary-extraction", "followup-generation"})   # title, prompt suggestion
_REQUEST_CLASS = {
    "subagent": (SUBAGENT, "request-class subagent"),
    "auxiliary": (SIDE, "request-class auxiliary"),
    "compaction": (CONTINUATION, "request-class compaction"),
}


def _claude_turn(h: dict[str, str], b: wire.Body, history: bool, ok: bool) -> tuple[str, str]:
    cls = h.get("x-claude-code-request-class", "").strip().lower()
    if cls == "main":
        return _by_history(history, ok, "request-class main")
    if cls in _REQUEST_CLASS:
        return _REQUEST_CLASS[cls]
    if not cls:
        # x-claude-1p-request-class says "main" for the auto-mode classifier and for
        # compaction, so only its specific values are taken (a client that sends it
        # without the request-class header).
        p1 = h.get("x-claude-1p-request-class", "").strip().lower()
        if "subagent" in p1:
            return SUBAGENT, f"1p request-class {p1[:24]}"
        if p1 in _SIDE_1P_CLASSES:
            return SIDE, f"1p request-class {p1}"
    # Older clients (or an unknown class): the billing line of system[0] (seeds/000).
    prefix = f"request-class {cls[:24]!r} unknown; " if cls else ""
    if not ok:
        return UNKNOWN_TURN, prefix + "body unreadable"
    line = billing_line(b)
    if line is None:
        return UNKNOWN_TURN, prefix + "no request class, no billing line: role not stated"
    if "cc_is_subagent=true" in line.replace(" ", ""):
        return SUBAGENT, prefix + "billing line: cc_is_subagent"
    if not has_tools(b):
        return SIDE, prefix + "billing line, no tools"
    if history:
        return CONTINUATION, prefix + "billing line, tools, assistant message in history"
    return OPENING, prefix + "billing line, tools, no assistant message"


def _codex_turn(h: dict[str, str], history: bool, ok: bool) -> tuple[str, str]:
    sub = h.get("x-openai-subagent", "").strip().lower()
    if sub == "compact":
        # Codex runs its compaction as a "compact" subagent of the main conversation.
        return CONTINUATION, "codex: x-openai-subagent compact"
    if sub:
        return SUBAGENT, "codex: x-openai-subagent"
    meta = codex_turn_metadata(h)
    if meta.get("thread_source") == "subagent":
        return SUBAGENT, "codex: turn-metadata thread_source subagent"
    source = meta.get("thread_source")
    if isinstance(source, str) and source not in ("", "user"):
        # The TUI names a thread from a separate thread (thread_source "thread_title") with
        # its own session id and no parent link: a one-shot side request. Any other
        # non-user source is treated alike, so it never decides a pin.
        return SIDE, f"codex: turn-metadata thread_source {source[:24]}"
    if meta.get("request_kind") == "prewarm":
        return SIDE, "codex: turn-metadata request_kind prewarm"
    if meta.get("history_initialization") in ("cold_resume", "cold_fork"):
        return CONTINUATION, f"codex: turn-metadata history_initialization {meta['history_initialization']}"
    return _by_history(history, ok, "codex")
