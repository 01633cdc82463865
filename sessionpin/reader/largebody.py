"""The large-body reader: a long conversation's facts fields without reading its contents.

A long conversation is megabytes of message contents the facts never look at, and even
skipping them costs a full scan. For a large body the reader decodes three small parts
and leaves the middle alone:
  1. the head: the top-level members before the messages array ("model", …), walked one
     member at a time (msgspec finds where each value ends) — which also gives the byte
     span of each head member, so a model rename needs no second read of the body;
  2. the first messages, one at a time, each walked member by member (one scan of each
     byte), until an assistant turn (history) and the first user message (fingerprint)
     are both known - or the array ends;
  3. the tail: the top-level members after the messages array, decoded from the array's
     end when the walk reached it (a short conversation), else found by key.
Every part is proved top-level with msgspec, not guessed: the head is walked from the
opening brace; in JSON a quote preceded by ``,`` is never inside a string, and a slice
that decodes as one complete object (``{`` + the text after a comma) can only start at
depth 1. What is not proved is the well-formedness of message contents after the last
message read: a body corrupt deep inside them is the server's to reject.

Work per byte is bounded for every input (a 0.9 MB body of nested look-alike keys once
took 20 s): the head walk and the messages walk scan each byte once; each tail key is
searched backwards once; a look-alike found nested costs a decode up to the end of its
own object, and once the failed tries add up to the body's size the reader stops and
decodes the whole body instead (itself linear). ``wire.STEPS`` counts the bytes every
find, copy and decode scans, so tests can prove the bound without timing.
Anything unexpected returns None and the caller decodes the whole body.
"""

from __future__ import annotations

import msgspec
from msgspec import Raw

import re

from . import knownvalues, scan, searched
from .wire import ABSENT, STEPS, Body, Message, count, decode_fields, is_history, loose_decoder

FAST_MIN = 256 * 1024
_WS = scan.WS
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
# Items walked past the ones the facts need when those were most of the body (a long opening
# message), in case the array ends there: its tail is then read from its end, not searched for
# from the body's end (the long message scanned once, not twice). Not for a long history: its
# first items are a sliver of it, and walking more would cost ~20 µs an item for nothing.
MORE_ITEMS = 4
# Failed tail tries may scan this many times the body before the whole read takes over.
TAIL_BUDGET = 1
# And the searches may find at most this many look-alikes (a name's quoted text anywhere but
# as a top-level key: a value, a nested key): each costs a few µs of Python whatever it scans,
# and a body of few objects is read on the event loop (60,000 "model" strings in one array,
# 0.48 MB: 152 ms), where the whole read is one decode in C (~1 ms).
TAIL_HITS = 256
# Bytes past a failed decode's trailing offset taken as read by it (``searched``: a later body
# spared the decode must have the same bytes as far as it read; msgspec reads none past it).
READ_MARGIN = 16


class _Costly(Exception):
    """The tail search found more look-alikes than ``TAIL_HITS``."""

_raw_decoder = msgspec.json.Decoder(Raw)
_key_decoder = msgspec.json.Decoder(str)
_name_decoder = msgspec.json.Decoder(str | None)





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


def _decode_members(buf: bytes) -> tuple[dict[str, Raw] | None, int]:
    """``_decode(loose_decoder, buf)`` for a body's tail: a long member sent again (Claude
    Code's tool schemas, after the messages) compared instead of skimmed (``knownvalues``)."""
    members = knownvalues.passed_over(buf, items=False)     # (the messages are not in a tail)
    if members is not None:
        return members, -1
    members, k = _decode(loose_decoder, buf)
    if isinstance(members, dict):
        knownvalues.remember(members)
    return members, k


def _skip_ws(data: bytes, i: int) -> int:
    j = scan.skip_ws(data, i)
    count(j - i + 1)
    return j


def _skip_ws_back(data: bytes, i: int) -> int:
    """The index of the last non-space byte at or before i (-1 if none), found in C
    (``scan.back_over``: a long run of spaces is no Python loop per byte)."""
    j = scan.back_over(data, _WS, i + 1)
    count(2 * (i + 1 - j) + 1)        # the doubling windows read about twice the run
    return j - 1


def _find(data: bytes, needle: bytes, lo: int, hi: int, last: bool) -> int:
    p = data.rfind(needle, lo, hi) if last else data.find(needle, lo, hi)
    count((hi - p if last else p + len(needle) - lo) if p != -1 else hi - lo)
    return p


def _key_before(data: bytes, key: bytes, lo: int, hi: int, hits: list[int] | None = None,
                memo: searched.Memo | None = None) -> tuple[int, int]:
    """The last ``"key"`` in data[lo:hi] that is a member name: preceded by ``,`` or ``{``
    and followed by ``:``. Returns (position of that ``,``/``{``, position after the ``:``),
    or (-1, -1). ``hits``: what is left of the caller's count of finds (``_Costly`` once spent).
    ``memo`` (its searches all from ``lo``): the bytes from ``lo`` whose every ``"key"`` is
    known turned down (the last turn's, the same again) are not searched; what this search
    turns down, and finds empty, is told to it."""
    needle = b'"' + key + b'"'
    start = memo.start(needle) if memo is not None else lo
    while start < hi:
        p = _find(data, needle, start, hi, last=True)
        if p == -1:
            break
        if hits is not None:
            hits[0] -= 1
            if hits[0] < 0:
                raise _Costly
        before = _skip_ws_back(data, p - 1)
        after = _skip_ws(data, p + len(needle))
        if before >= 0 and data[before] in b",{" and after < len(data) and data[after] == ord(":"):
            return before, after + 1
        if memo is not None:
            memo.rejected(needle, after + 1)    # by its neighbours: the bytes up to ``after``
        hi = p
    if memo is not None:
        memo.clean(needle, hi)
    return -1, -1


def _value_end(view: memoryview, i: int) -> int:
    """The index of the first non-space byte after the JSON value at ``i``, or -1 when the
    value is not followed by one (it runs to the end, or is not JSON)."""
    _, k = _decode(_raw_decoder, view[i:])
    return i + k - 1 if k > 0 else -1


def _head(data: bytes, start: int, array_key: str,
          spans: dict[str, tuple[int, int]] | None = None) -> tuple[dict[str, Raw], int] | None:
    """The top-level members before ``array_key`` and the position of its value, walked
    from the opening brace one member at a time: each byte is scanned once. Each member's
    byte span goes into ``spans``; a member written twice makes the whole read decide."""
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
        if key in head:
            return None   # a duplicate member: which one counts is the whole read's call
        head[key] = Raw(data[v:end])
        if spans is not None:
            spans[key] = (v, _end_of_value(data, v, end))
        if data[end] != ord(","):
            return None   # "}": the object ended without the messages
        i = _skip_ws(data, end + 1)
    return None


def _end_of_value(data: bytes, v: int, after: int) -> int:
    """One past the value's last byte, given the first non-space byte after it (back over the
    spaces between in doubling windows: megabytes of them cost C-speed copies, not a Python
    step per byte)."""
    return max(v, _skip_ws_back(data, after - 1) + 1)


ITEM_MEMBERS = 64


def _item(data: bytes, view: memoryview, s: int) -> tuple[Message, int] | None:
    """The message or input item whose ``{`` is at ``s``, walked member by member (each
    byte scanned once: no skip pass before a decode), and the index of the first
    non-space byte after it. Only ``role``, ``type`` and ``content`` are kept; a member
    of the wrong type, a duplicate, or anything odd makes the whole read decide."""
    i = _skip_ws(data, s + 1)
    found: dict[str, object] = {}
    if i < len(data) and data[i] == ord("}"):
        return Message(), _skip_ws(data, i + 1)
    for _ in range(ITEM_MEMBERS):
        if i >= len(data) or data[i] != ord('"'):
            return None
        colon = _value_end(view, i)
        if colon == -1 or data[colon] != ord(":"):
            return None
        key, _ = _decode(_key_decoder, view[i:colon])
        if not isinstance(key, str):
            return None
        v = _skip_ws(data, colon + 1)
        end = _value_end(view, v)
        if end == -1:
            return None
        if key in ("role", "type", "content"):
            if key in found:
                return None
            if key == "content":
                found[key] = Raw(view[v:_end_of_value(data, v, end)])
            else:
                value, k = _decode(_name_decoder, view[v:end])
                if k != -1:
                    return None   # not a string or null: the whole read names the field
                found[key] = value
        if data[end] == ord("}"):
            return Message(**found), _skip_ws(data, end + 1)   # type: ignore[arg-type]
        if data[end] != ord(","):
            return None
        i = _skip_ws(data, end + 1)
    return None


def _as_object(buf: bytearray, lo: int, at: int, char: int) -> tuple[dict[str, Raw] | None, int, int]:
    """buf[lo:] decoded as one object with the byte at ``at`` read as ``char`` (the ``,``
    before a member read as ``{``): (members or None, bytes scanned, ``_decode``'s trailing
    offset). No copy of the rest of the body per try: a key found nested costs only the
    decode up to the end of its own object, where msgspec stops."""
    saved = buf[at]
    buf[at] = char
    before = STEPS.n
    try:
        members, k = _decode(loose_decoder, memoryview(buf)[lo:])
        return members, STEPS.n - before, k   # type: ignore[return-value]
    finally:
        buf[at] = saved


def head_members(data: bytes, array_key: str) -> tuple[dict[str, Raw], int] | None:
    """The top-level members before the array ``array_key`` and the index of that array's
    ``[``, walked from the opening brace (each byte scanned once); None when the body is
    not ``{..., "array_key": [`` with at most ``HEAD_MEMBERS`` distinct members before it."""
    start = _skip_ws(data, 0)
    if start >= len(data) or data[start] != ord("{"):
        return None
    try:
        found = _head(data, start, array_key)
    except RecursionError:
        return None
    if found is None or found[1] >= len(data) or data[found[1]] != ord("["):
        return None
    return found


def tail_members(data: bytes, names, array_start: int) -> dict[str, Raw] | None:
    """The top-level members after the array that starts at ``array_start``, found from the
    end by any of ``names`` and proved top-level (``{`` + the text after the comma before a
    name decodes as one object). {} when none is there; None when failed tries (look-alikes
    nested in the body) scanned more than ``TAIL_BUDGET`` times the body, or the searches
    found more than ``TAIL_HITS`` look-alikes: the caller then decodes the whole body, which
    is linear and in C."""
    tail: dict[str, Raw] = {}
    tail_from = len(data)
    buf: bytearray | None = None   # made on the first nested look-alike in the tail search
    failed = 0                     # bytes scanned by tries that found a nested look-alike
    hits = [TAIL_HITS]             # look-alikes found by the searches, left before the whole read
    memo = searched.Memo(data, array_start)    # what the last turn's searches turned down
    try:
        for name in names:
            if name in tail:
                continue
            hi = len(data)
            needle = b'"' + name.encode() + b'"'
            while True:
                comma, colon = _key_before(data, name.encode(), array_start, hi, hits, memo)
                if comma == -1 or data[comma] != ord(","):
                    if comma != -1:  # ``{"name"``: the first member of a nested object
                        memo.rejected(needle, colon)
                        hi = comma
                        continue
                    break
                if comma > tail_from:  # inside the tail already decoded, so nested there
                    memo.stopped(needle, comma)
                    hi = comma
                    continue
                if failed > TAIL_BUDGET * len(data):
                    return None
                if buf is None:
                    # usually the first try is the real tail: copying just it is cheapest
                    count(len(data) - comma)
                    before = STEPS.n
                    members, k = _decode_members(b"{" + data[comma + 1:])
                    if members is None:
                        failed += STEPS.n - before
                        count(len(data))
                        buf = bytearray(data)
                else:
                    members, scanned, k = _as_object(buf, comma, comma, 0x7B)  # {
                    if members is None:
                        failed += scanned
                if members is None:
                    # the decode read up to its trailing byte (from the comma); any other
                    # error is not placed: no later body is spared this one
                    memo.rejected(needle, comma + k + READ_MARGIN if k > 0 else len(data) + 1)
                    hi = comma
                    continue
                tail, tail_from = members, comma  # type: ignore[assignment]
                break
    except (RecursionError, _Costly):
        return None
    memo.keep()
    return tail


def _after_array(data: bytes, end: int, names) -> dict[str, Raw] | None:
    """The members ``names`` of those after the array whose ``]`` is at ``end`` (the walk
    reached it, so this is the top level: no search, no proof needed); None when the text
    after it is not ``}`` or ``, members}`` (the search from the end then decides, as before)."""
    i = _skip_ws(data, end + 1)
    if i >= len(data):
        return None
    if data[i] == ord("}"):
        return {} if _skip_ws(data, i + 1) == len(data) else None
    if data[i] != ord(","):
        return None
    count(len(data) - i)
    members, _ = _decode_members(b"{" + data[i + 1:])
    if not isinstance(members, dict):
        return None
    return {k: v for k, v in members.items() if k in names}


def fast_decode(data: bytes, flavour: str, cache_key: bool = True, spans: dict[str, tuple[int, int]] | None = None,
                objects: int | None = None) -> tuple[Body, str] | None:
    """A large body's facts fields without reading its message contents; None to fall back.
    ``spans`` (when given) receives the byte span of each top-level member read in the head.
    ``objects`` (when given): None as well when what the facts would decode of it (the system
    prompt, the metadata, the contents of the messages walked) holds more JSON objects than
    that — the router's bound on what a read on its event loop may build (``typed_objects``)."""
    try:
        return _fast_decode(data, flavour, cache_key, spans, objects)
    except RecursionError:   # msgspec's guard against deep nesting: the whole read says so
        return None


# The top-level members the facts decode into Python values (the rest are kept raw, or are a
# scalar): with the walked messages' contents, what a read of the parts builds objects from.
TYPED = ("system", "instructions", "metadata")


def typed_objects(fields: dict[str, Raw], messages: list[Message]) -> int:
    """The JSON objects (``{``) in what the facts decode of a body read in parts: the members
    ``TYPED`` and the contents of the messages walked. Counted as the router counts a whole
    body's (``read_apart``): a proxy for the Python objects a decode builds — but a value that
    is a string decodes to one ``str`` whatever braces its text holds, so it counts none
    (an opening of one long text was counted byte by byte: half of its hook's time at 1 MB)."""
    n = 0
    for name in TYPED:
        raw = fields.get(name)
        if raw is not None:
            n += _objects_in(raw)
    for m in messages:
        if m.content is not ABSENT:
            n += _objects_in(m.content)
    return n


def _objects_in(raw: Raw) -> int:
    """``{`` in a raw value (its first byte is the value's own: msgspec's and the walk's raw
    values begin there); none in a string. Counted at memchr's speed (``scan.count``: Claude
    Code's system prompt of 126 KB: 49 µs copied and counted by ``bytes.count``, 10 by it)."""
    view = memoryview(raw)
    if not len(view) or view[0] == 0x22:        # "
        return 0
    return scan.count(view, b"{")


def _fast_decode(data: bytes, flavour: str, cache_key: bool,
                 spans: dict[str, tuple[int, int]] | None, objects: int | None = None) -> tuple[Body, str] | None:
    array_key = "input" if flavour == "responses" else "messages"
    # 1. the head
    start = _skip_ws(data, 0)
    last = _skip_ws_back(data, len(data) - 1)
    if start >= len(data) or data[start] != ord("{") or data[last] != ord("}"):
        return None  # not one object: let the whole-body read say what is wrong
    found = _head(data, start, array_key, spans)
    if found is None:
        return None
    head, array_start = found
    if array_start >= len(data) or data[array_start] != ord("["):
        return None
    # 2. the first messages, each walked member by member (``_item``): one scan of the
    # element, whatever its text holds. Past the ones the facts need, up to ``MORE_ITEMS``
    # more: a short conversation's array (an opening of one long message, its first answer)
    # then ends in the walk, and its tail is read from where the array ends (step 3).
    messages: list[Message] = []
    s = _skip_ws(data, array_start + 1)
    end = s if s < len(data) and data[s] == ord("]") else -1     # the array's "]", once walked to it
    history = first_user = False
    view = memoryview(data)
    more = MORE_ITEMS
    while end == -1:
        extra = history and first_user     # an item past those the facts need
        if extra:
            # on only while the items walked are most of the array's bytes and beyond: then
            # what is left is a few short items and the tail (a long history's first items are
            # a sliver of it, and walking more of them would cost more than the search)
            if more == 0 or 2 * (s - array_start) < len(data) - array_start:
                break
            more -= 1
        got = None
        if s < len(data) and data[s] == ord("{") and len(messages) < FIRST_ITEMS:
            got = _item(data, view, s)
        if got is None or got[1] >= len(data) or data[got[1]] not in b",]":
            if extra:
                break     # an item the facts need not read: left unread, as it always was
            return None   # odd, or a wrong type: the whole-body read names the field
        msg, after = got
        messages.append(msg)  # type: ignore[arg-type]
        # the same test the facts apply: Responses items by type, messages by role
        history = history or (is_history(msg) if flavour == "responses" else msg.role == "assistant")  # type: ignore[union-attr]
        first_user = first_user or msg.role == "user"  # type: ignore[union-attr]
        if data[after] == ord("]"):
            end = after
        else:
            s = _skip_ws(data, after + 1)
    # 3. the tail: each needed key not in the head. "model" is looked for even when the head
    # has it: a second top-level model after the messages (the whole read takes the last)
    # must send the body to the whole read, since a model rename trusts the head's span
    # (facts.model_span).
    needed = NEEDED[flavour]
    if cache_key and CACHE_KEY not in needed:
        needed += (CACHE_KEY,)
    # "model" is looked for last: by then the tail found for the other keys is decoded whole,
    # and a "model" nested in it (Claude Code's Agent tool schema has one) is passed over
    # without a decode that fails, or a copy of the body for the tries after it.
    names = [n for n in needed if n not in head and n != "model"] + ["model"]
    tail = _after_array(data, end, names) if end != -1 else None
    if tail is None:
        # where the array ends is not known: each key found from the end, proved top-level
        tail = tail_members(data, names, array_start)
    if tail is None:
        return None   # look-alikes cost more than the whole read: let it decide
    if tail.keys() & head.keys():
        # a key both before and after the messages: which one counts is the whole read's call
        return None
    fields = {**tail, **head}
    if objects is not None and typed_objects(fields, messages) > objects:
        return None   # more to build than the caller's bound: it decides where the read runs
    values, problem = decode_fields(fields)
    values["input" if flavour == "responses" else "messages"] = messages
    return Body(**values), problem
