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
#   1. the head: the top-level members before the messages array ("model", …);
#   2. the first messages, one at a time, until an assistant turn (history) and the first
#      user message (fingerprint) are both known - or the array ends;
#   3. the tail: the top-level members after the messages array, found by key.
# Every part is proved top-level with msgspec, not guessed: in JSON a quote preceded by
# ``,`` or ``{`` is never inside a string, and a slice that decodes as one complete object
# (``{`` + the text after a comma, or the text before one + ``}``) can only start or end at
# depth 1. What is not proved is the well-formedness of message contents after the last
# message read: a body corrupt deep inside them is the server's to reject.
# Anything unexpected returns None and the caller decodes the whole body.

import re  # noqa: E402

FAST_MIN = 256 * 1024
_WS = b" \t\r\n"
# msgspec's message for a complete value followed by more text; its offset is one past the
# first byte after the value (checked by tests/test_wire.py against the installed msgspec).
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")
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

_message_decoder = msgspec.json.Decoder(Message)


class _Skip(Struct):
    """Any object, every member skipped: finds where an element ends."""


_skip_decoder = msgspec.json.Decoder(_Skip)


def _skip_ws(data: bytes, i: int) -> int:
    n = len(data)
    while i < n and data[i] in _WS:
        i += 1
    return i


def _skip_ws_back(data: bytes, i: int) -> int:
    """The index of the last non-space byte at or before i (-1 if none)."""
    while i >= 0 and data[i] in _WS:
        i -= 1
    return i


def _key_at(data: bytes, key: bytes, lo: int, hi: int, last: bool) -> tuple[int, int]:
    """The next (first or last) ``"key"`` in data[lo:hi] that is a member name: preceded by
    ``,`` or ``{`` and followed by ``:``. Returns (position of that ``,``/``{``, position
    after the ``:``), or (-1, -1)."""
    needle = b'"' + key + b'"'
    while lo < hi:
        p = data.rfind(needle, lo, hi) if last else data.find(needle, lo, hi)
        if p == -1:
            return -1, -1
        before = _skip_ws_back(data, p - 1)
        after = _skip_ws(data, p + len(needle))
        if before >= 0 and data[before] in b",{" and after < len(data) and data[after] == ord(":"):
            return before, after + 1
        if last:
            hi = p
        else:
            lo = p + 1
    return -1, -1


def _as_object(buf: bytearray, lo: int, hi: int, at: int, char: int) -> dict[str, Raw] | None:
    """buf[lo:hi] decoded as one object with the byte at ``at`` read as ``char`` (the ``,``
    before a member read as ``{``), or None. No copy of the rest of the body per try: a key
    found nested costs only the decode up to the end of its own object, where msgspec stops,
    so thousands of look-alikes in a body stay linear."""
    saved = buf[at]
    buf[at] = char
    try:
        return loose_decoder.decode(memoryview(buf)[lo:hi])
    except msgspec.DecodeError:
        return None
    finally:
        buf[at] = saved


def fast_decode(data: bytes, flavour: str, cache_key: bool = True) -> tuple[Body, str] | None:
    """A large body's facts fields without reading its message contents; None to fall back."""
    array_key = b"input" if flavour == "responses" else b"messages"
    # 1. the head
    start = _skip_ws(data, 0)
    last = _skip_ws_back(data, len(data) - 1)
    if start >= len(data) or data[start] != ord("{") or data[last] != ord("}"):
        return None  # not one object: let the whole-body read say what is wrong
    lo = start
    while True:
        before, value = _key_at(data, array_key, lo, min(len(data), start + 1024 * 1024), last=False)
        if before == -1:
            return None
        try:   # the head is small: a copy of it costs nothing
            head = loose_decoder.decode(b"{}" if before == start else data[start:before] + b"}")
            break
        except msgspec.DecodeError:
            lo = value
    buf: bytearray | None = None   # made on the first nested look-alike in the tail search
    array_start = _skip_ws(data, value)
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
        if s >= len(data) or data[s] != ord("{"):
            return None
        try:
            _skip_decoder.decode(view[s:])
            return None  # the element runs to the end of the body: not inside an array
        except msgspec.ValidationError:
            return None
        except msgspec.DecodeError as err:
            m = _TRAILING.search(str(err))
            if m is None:
                return None
            after = s + int(m.group(1)) - 1  # msgspec counts the offending byte in
        try:
            msg = _message_decoder.decode(view[s:after])
        except msgspec.DecodeError:
            return None  # a wrong type: the whole-body read names the field
        messages.append(msg)
        # the same test the facts apply: Responses items by type, messages by role
        history = history or (is_history(msg) if flavour == "responses" else msg.role == "assistant")
        first_user = first_user or msg.role == "user"
        if data[after] == ord("]"):
            ended = True
        elif data[after] == ord(","):
            s = _skip_ws(data, after + 1)
        else:
            return None
    # 3. the tail: each needed key not in the head, found from the end and proved top-level
    tail: dict[str, Raw] = {}
    tail_from = len(data)
    needed = NEEDED[flavour]
    if cache_key and CACHE_KEY not in needed:
        needed += (CACHE_KEY,)
    for name in needed:
        if name in head or name in tail:
            continue
        hi = len(data)
        while True:
            comma, _ = _key_at(data, name.encode(), array_start, hi, last=True)
            if comma == -1 or data[comma] != ord(","):
                if comma != -1:  # ``{"name"``: the first member of a nested object
                    hi = comma
                    continue
                break
            if comma > tail_from:  # inside the tail already decoded, so nested there
                hi = comma
                continue
            if buf is None:
                try:   # usually the first try is the real tail: copying just it is cheapest
                    members = loose_decoder.decode(b"{" + data[comma + 1:])
                except msgspec.DecodeError:
                    members, buf = None, bytearray(data)
            else:
                members = _as_object(buf, comma, len(data), comma, 0x7B)  # {
            if members is None:
                hi = comma
                continue
            tail, tail_from = members, comma
            break
    if tail.keys() & head.keys():
        # a key both before and after the messages: which one counts is the whole read's call
        return None
    values, problem = decode_fields({**tail, **head})
    values["input" if flavour == "responses" else "messages"] = messages
    return Body(**values), problem
