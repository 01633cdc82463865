"""The parts of an inference request body that the facts need, as msgspec structs.

Rules this module keeps:
- Decode only what a fact needs: model, stream, system / instructions, tools (counted, not
  read), metadata.user_id, prompt_cache_key, previous_response_id, and for every message or
  input item only its ``role`` and ``type``. Message contents stay ``msgspec.Raw`` (skipped,
  not built), so a long conversation costs a scan, not a tree of Python objects.
- Unknown fields are ignored (msgspec's default), so new client fields never break a read.
- A field of the wrong type raises ``msgspec.ValidationError`` in the fast path; the reader
  then reads the top level as ``dict[str, Raw]`` and decodes each field on its own, so one bad field does not
  hide the others.
"""

from __future__ import annotations

import msgspec
from msgspec import Raw, Struct

# A Raw that was not in the body (a real JSON value is never empty).
ABSENT = Raw(b"")


class Block(Struct):
    """A content block or part: Anthropic ``{"type":"text","text":…}``, OpenAI chat
    ``{"type":"text"}``, Responses ``{"type":"input_text"}``. Other fields (cache_control,
    source, tool_use_id, nested content…) are skipped."""

    type: str | None = None
    text: str | None = None


# ``system`` / message content: a string, or a list of blocks.
Content = str | list[Block] | None


class Message(Struct):
    """A chat message or a Responses input item: only what says who spoke."""

    role: str | None = None
    type: str | None = None
    content: Raw = ABSENT


def is_history(m: Message) -> bool:
    """The item shows the conversation under way: an assistant message, or a Responses item
    only a model turn makes (a tool call, its output, reasoning, a compaction). Other typed
    items (Codex's ``additional_tools``, a developer ``message``) are part of any opening."""
    if m.role == "assistant":
        return True
    t = m.type
    if t is None or t == "message":
        return False
    return t == "reasoning" or t.startswith("compaction") or t.endswith(("_call", "_output"))


class Metadata(Struct):
    user_id: str | None = None


class Body(Struct):
    """The request body of every inference api (Anthropic Messages and count_tokens,
    OpenAI chat/completions and Responses) in one struct: absent fields stay at their default."""

    model: str | None = None
    stream: bool | None = None
    system: Content = None
    instructions: Content = None          # Responses: the system prompt
    messages: list[Message] | None = None
    input: str | list[Message] | None = None  # Responses
    tools: list[Raw] | None = None
    metadata: Metadata | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None


# The fields of Body and their types, for the field-by-field fallback.
FIELD_TYPES: dict[str, object] = {
    "model": str | None,
    "stream": bool | None,
    "system": Content,
    "instructions": Content,
    "messages": list[Message] | None,
    "input": str | list[Message] | None,
    "tools": list[Raw] | None,
    "metadata": Metadata | None,
    "prompt_cache_key": str | None,
    "previous_response_id": str | None,
}

body_decoder = msgspec.json.Decoder(Body)
loose_decoder = msgspec.json.Decoder(dict[str, Raw])
content_decoder = msgspec.json.Decoder(Content)
field_decoders = {name: msgspec.json.Decoder(t) for name, t in FIELD_TYPES.items()}


def decode_fields(fields: dict[str, msgspec.Raw]) -> tuple[dict[str, object], str]:
    """Each facts field on its own, so one of a wrong type spoils only itself: the
    values that decoded, and "" or which fields did not."""
    values: dict[str, object] = {}
    bad: list[str] = []
    for name, decoder in field_decoders.items():
        raw = fields.get(name)
        if raw is None:
            continue
        count(len(raw))
        try:
            values[name] = decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            bad.append(name)
    return values, ("wrong shape: " + ", ".join(bad)) if bad else ""


# ---------------------------------------------------------------- large bodies
#
# A long conversation is megabytes of message contents the facts never look at, and even
# skipping them costs a full scan. For a large body the reader instead decodes three small
# parts and leaves the middle alone:
#   1. the head: the top-level members before the messages array ("model", …), walked one
#      member at a time (msgspec finds where each value ends);
#   2. the first messages, one at a time, until an assistant turn (history) and the first
#      user message (fingerprint) are both known - or the array ends;
#   3. the tail: the top-level members after the messages array, found by key.
# Every part is proved top-level with msgspec, not guessed: the head is walked from the
# opening brace; in JSON a quote preceded by ``,`` is never inside a string, and a slice
# that decodes as one complete object (``{`` + the text after a comma) can only start at
# depth 1. What is not proved is the well-formedness of message contents after the last
# message read: a body corrupt deep inside them is the server's to reject.
#
# Work per byte is bounded for every input (a 0.9 MB body of nested look-alike keys once
# took 20 s): the head walk and the messages scan each byte once or twice; each tail key is
# searched backwards once; a look-alike found nested costs a decode up to the end of its
# own object, and once the failed tries add up to the body's size the reader stops and
# decodes the whole body instead (itself linear). ``STEPS`` counts the bytes every find,
# copy and decode scans, so tests can prove the bound without timing.
# Anything unexpected returns None and the caller decodes the whole body.

import re  # noqa: E402

FAST_MIN = 256 * 1024
_WS = b" \t\r\n"
_WS_RUN = re.compile(rb"[ \t\r\n]*")
# msgspec's message for a complete value followed by more text; its offset is one past the
# first byte after the value (checked by tests/test_wire.py against the installed msgspec).
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")
_AT_BYTE = re.compile(r"\(byte (\d+)\)")
# Keys of each api's body worth looking for after the messages array. A key that is absent
# costs one scan of the body, so only the ones that api has.
NEEDED = {
    "anthropic": ("model", "stream", "system", "tools", "metadata"),
    "chat": ("model", "stream", "tools"),
    "responses": ("model", "stream", "instructions", "tools", "prompt_cache_key", "previous_response_id"),
}
# prompt_cache_key is a session id for pi and Codex on any api; the caller asks for it
# (``cache_key=True``) when the request may be theirs, so others pay no scan for it.
CACHE_KEY = "prompt_cache_key"
# Real bodies have fewer than 20 top-level members before their messages, and find their
# first user and assistant turns within a few items: more falls back to the whole read
# (per-member overhead is Python's, so it is capped, not just linear).
HEAD_MEMBERS = 64
FIRST_ITEMS = 256
# Failed tail tries may scan this many times the body before the whole read takes over.
TAIL_BUDGET = 1

_message_decoder = msgspec.json.Decoder(Message)
_raw_decoder = msgspec.json.Decoder(Raw)
_key_decoder = msgspec.json.Decoder(str)


class Steps:
    """Bytes scanned by the reader: every find, copy and decode adds what it scanned.
    Tests reset ``n`` and assert it stays within k × the body's size (never timing)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


STEPS = Steps()


def count(n: int) -> None:
    STEPS.n += n


class _Skip(Struct):
    """Any object, every member skipped: finds where an element ends."""


_skip_decoder = msgspec.json.Decoder(_Skip)


def _decode(decoder: msgspec.json.Decoder, buf) -> tuple[object, int]:
    """``decoder.decode(buf)``, counted. (value, -1) when it decoded; (None, k) when msgspec
    met trailing characters at byte k (one past the first byte after the value); (None, 0)
    on any other error."""
    try:
        value = decoder.decode(buf)
    except msgspec.ValidationError:
        count(len(buf))
        return None, 0
    except msgspec.DecodeError as err:
        text = str(err)
        at = _AT_BYTE.search(text)
        count(int(at.group(1)) if at else len(buf))
        trailing = _TRAILING.search(text)
        return None, int(trailing.group(1)) if trailing else 0
    except RecursionError:   # msgspec's guard against deep nesting: the caller falls back
        count(len(buf))
        raise
    count(len(buf))
    return value, -1


def _skip_ws(data: bytes, i: int) -> int:
    j = _WS_RUN.match(data, i).end()
    count(j - i + 1)
    return j


def _skip_ws_back(data: bytes, i: int) -> int:
    """The index of the last non-space byte at or before i (-1 if none). Windows that double,
    so a long run of spaces costs C-speed copies, not a Python loop per byte."""
    width = 16
    while i >= 0:
        lo = max(0, i + 1 - width)
        kept = data[lo:i + 1].rstrip(_WS)
        count(i + 1 - lo)
        if kept:
            return lo + len(kept) - 1
        i, width = lo - 1, width * 2
    return -1


def _find(data: bytes, needle: bytes, lo: int, hi: int, last: bool) -> int:
    p = data.rfind(needle, lo, hi) if last else data.find(needle, lo, hi)
    count((hi - p if last else p + len(needle) - lo) if p != -1 else hi - lo)
    return p


def _key_before(data: bytes, key: bytes, lo: int, hi: int) -> tuple[int, int]:
    """The last ``"key"`` in data[lo:hi] that is a member name: preceded by ``,`` or ``{``
    and followed by ``:``. Returns (position of that ``,``/``{``, position after the ``:``),
    or (-1, -1)."""
    needle = b'"' + key + b'"'
    while lo < hi:
        p = _find(data, needle, lo, hi, last=True)
        if p == -1:
            return -1, -1
        before = _skip_ws_back(data, p - 1)
        after = _skip_ws(data, p + len(needle))
        if before >= 0 and data[before] in b",{" and after < len(data) and data[after] == ord(":"):
            return before, after + 1
        hi = p
    return -1, -1


def _value_end(view: memoryview, i: int) -> int:
    """The index of the first non-space byte after the JSON value at ``i``, or -1 when the
    value is not followed by one (it runs to the end, or is not JSON)."""
    _, k = _decode(_raw_decoder, view[i:])
    return i + k - 1 if k > 0 else -1


def _head(data: bytes, start: int, array_key: str) -> tuple[dict[str, Raw], int] | None:
    """The top-level members before ``array_key`` and the position of its value, walked
    from the opening brace one member at a time: each byte is scanned once."""
    view = memoryview(data)
    head: dict[str, Raw] = {}
    i = _skip_ws(data, start + 1)
    for _ in range(HEAD_MEMBERS):
        if i >= len(data) or data[i] != ord('"'):
            return None   # "}" (no messages at the top level), or not JSON
        colon = _value_end(view, i)
        if colon == -1 or data[colon] != ord(":"):
            return None
        key, _ = _decode(_key_decoder, view[i:colon])
        if not isinstance(key, str):
            return None
        v = _skip_ws(data, colon + 1)
        if key == array_key:
            return head, v
        end = _value_end(view, v)
        if end == -1:
            return None
        count(end - v)
        head[key] = Raw(data[v:end])
        if data[end] != ord(","):
            return None   # "}": the object ended without the messages
        i = _skip_ws(data, end + 1)
    return None


def _as_object(buf: bytearray, lo: int, at: int, char: int) -> tuple[dict[str, Raw] | None, int]:
    """buf[lo:] decoded as one object with the byte at ``at`` read as ``char`` (the ``,``
    before a member read as ``{``): (members or None, bytes scanned). No copy of the rest of
    the body per try: a key found nested costs only the decode up to the end of its own
    object, where msgspec stops."""
    saved = buf[at]
    buf[at] = char
    before = STEPS.n
    try:
        members, _ = _decode(loose_decoder, memoryview(buf)[lo:])
        return members, STEPS.n - before   # type: ignore[return-value]
    finally:
        buf[at] = saved


def fast_decode(data: bytes, flavour: str, cache_key: bool = True) -> tuple[Body, str] | None:
    """A large body's facts fields without reading its message contents; None to fall back."""
    try:
        return _fast_decode(data, flavour, cache_key)
    except RecursionError:   # msgspec's guard against deep nesting: the whole read says so
        return None


def _fast_decode(data: bytes, flavour: str, cache_key: bool) -> tuple[Body, str] | None:
    array_key = "input" if flavour == "responses" else "messages"
    # 1. the head
    start = _skip_ws(data, 0)
    last = _skip_ws_back(data, len(data) - 1)
    if start >= len(data) or data[start] != ord("{") or data[last] != ord("}"):
        return None  # not one object: let the whole-body read say what is wrong
    found = _head(data, start, array_key)
    if found is None:
        return None
    head, array_start = found
    if array_start >= len(data) or data[array_start] != ord("["):
        return None
    # 2. the first messages. An element's end is where msgspec, decoding from its start,
    # meets "trailing characters": one scan of the element, whatever its text holds.
    messages: list[Message] = []
    s = _skip_ws(data, array_start + 1)
    ended = s < len(data) and data[s] == ord("]")
    history = first_user = False
    view = memoryview(data)
    while not ended and not (history and first_user):
        if s >= len(data) or data[s] != ord("{") or len(messages) >= FIRST_ITEMS:
            return None
        _, k = _decode(_skip_decoder, view[s:])
        if k <= 0:
            return None  # runs to the end of the body (not inside an array), or a wrong type
        after = s + k - 1  # msgspec counts the offending byte in
        msg, _ = _decode(_message_decoder, view[s:after])
        if msg is None:
            return None  # a wrong type: the whole-body read names the field
        messages.append(msg)  # type: ignore[arg-type]
        # the same test the facts apply: Responses items by type, messages by role
        history = history or (is_history(msg) if flavour == "responses" else msg.role == "assistant")  # type: ignore[union-attr]
        first_user = first_user or msg.role == "user"  # type: ignore[union-attr]
        if data[after] == ord("]"):
            ended = True
        elif data[after] == ord(","):
            s = _skip_ws(data, after + 1)
        else:
            return None
    # 3. the tail: each needed key not in the head, found from the end and proved top-level
    tail: dict[str, Raw] = {}
    tail_from = len(data)
    buf: bytearray | None = None   # made on the first nested look-alike in the tail search
    failed = 0                     # bytes scanned by tries that found a nested look-alike
    needed = NEEDED[flavour]
    if cache_key and CACHE_KEY not in needed:
        needed += (CACHE_KEY,)
    for name in needed:
        if name in head or name in tail:
            continue
        hi = len(data)
        while True:
            comma, _ = _key_before(data, name.encode(), array_start, hi)
            if comma == -1 or data[comma] != ord(","):
                if comma != -1:  # ``{"name"``: the first member of a nested object
                    hi = comma
                    continue
                break
            if comma > tail_from:  # inside the tail already decoded, so nested there
                hi = comma
                continue
            if failed > TAIL_BUDGET * len(data):
                return None   # look-alikes cost more than the whole read: let it decide
            if buf is None:
                # usually the first try is the real tail: copying just it is cheapest
                count(len(data) - comma)
                before = STEPS.n
                members, _ = _decode(loose_decoder, b"{" + data[comma + 1:])
                if members is None:
                    failed += STEPS.n - before
                    count(len(data))
                    buf = bytearray(data)
            else:
                members, scanned = _as_object(buf, comma, comma, 0x7B)  # {
                if members is None:
                    failed += scanned
            if members is None:
                hi = comma
                continue
            tail, tail_from = members, comma  # type: ignore[assignment]
            break
    if tail.keys() & head.keys():
        # a key both before and after the messages: which one counts is the whole read's call
        return None
    values, problem = decode_fields({**tail, **head})
    values["input" if flavour == "responses" else "messages"] = messages
    return Body(**values), problem
