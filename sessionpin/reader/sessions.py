"""Which conversation a request belongs to: the agent's own id, or a fingerprint of its opening.

Rules it keeps (docs/facts.md):
- session from the agent's own id (headers first, then the body), then a list of common
  session headers, then a fingerprint ``fp:<hash>`` of the conversation's opening (system
  prompt + first user message), normalised so every later turn gives the same one. A
  client id is never taken if it looks like a fingerprint, is empty, too long, or has
  control characters.
- Dates and times in the system prompt do not count in a fingerprint (a conversation
  continued tomorrow keeps it); Claude Code's billing line does not either.
- Nothing from a prompt leaves this module but a hash.
"""

from __future__ import annotations

import functools
import hashlib
import re

import msgspec

from . import wire
from .kinds import BILLING_PREFIX, CLAUDE_CODE, CODEX, FINGERPRINT_PREFIX, MAX_ID, MAX_USER_ID, OPENCODE, PI
from .kinds import text as _text



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
    if _CONTROL.search(value):
        return None
    return _text(value)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


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


# A client sends the same system prompt on every request of a process: its dates are taken out
# once (the regex tries six alternatives at every character: ~0.4 ms for pi's 5 KB prompt, on
# every request). The last few prompts are remembered, only those of up to 128 Ki characters
# (what a hostile client's prompts can hold in memory: 16 × 2 × 128 Ki).
UNDATED_MEMO, UNDATED_MEMO_CHARS = 16, 128 * 1024


@functools.lru_cache(maxsize=UNDATED_MEMO)
def _undated(text: str) -> str:
    return _DATE_TIME.sub("<date>", text)


def fingerprint(b: wire.Body) -> str | None:
    """``fp:`` + blake2b-128 of the normalised opening (system prompt and first user
    message). None when the body has neither."""
    system, user = opening(b)
    if not system and not user:
        return None
    system = [_undated(text) if len(text) <= UNDATED_MEMO_CHARS else _DATE_TIME.sub("<date>", text)
              for text in system]
    payload = "\x1e".join(system) + "\x1d" + "\x1e".join(user)
    digest = hashlib.blake2b(payload.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return FINGERPRINT_PREFIX + digest


