"""The parts of a history item that identify it, as msgspec structs, and how a large body's
items are read one at a time.

Rules this module keeps:
- An item is decoded only for what says who made it and what identifies it: role and type,
  texts, tool-call ids, tool-result ids, and the server's opaque tokens (thinking signatures,
  redacted thinking, encrypted reasoning). Tool inputs, tool results, thinking text, images and
  every other field are skipped by msgspec without building objects; the texts are built (an
  assistant's must be compared with what the server streamed, and a string content must read
  like one text block holding it).
- A field of an unexpected type never raises out of here: the item is read field by field, and a
  field that still does not decode counts as absent.
- A large body's history is read item by item from the start of its array (``walk``), so a
  reader that needs only the first turns pays for those, not for the whole body. The array is
  proved top-level the way the large-body reader proves it (``largebody.head_members``: the
  members before the key walked one at a time from the opening brace), each item's end is where
  msgspec reports trailing characters. Work per byte is bounded (``wire.STEPS`` counts it):
  look-alike keys nested before or after the history cost no second scan.
- A walk may be given a budget (``Budget``: bytes of the array and items): an item that does
  not end within it is not scanned past it, and the walk raises ``OverBudget`` — the reader
  that needs only the first turns of a history (its root) never pays for a pathological one
  (a million tiny messages, or one of 60 MB, before the first answer), on any thread. Before
  it raises, the walk yields that item's role and type alone (``KindOnly``), read from its
  first ``KIND_PREFIX`` bytes at most (its members in order, until one does not end within
  them): what says whether it ends the model run before it (a 9 MB tool result right after the
  first answer: the first exchange is whole before it). A reader that needs more of it than
  its kind gets ``OverBudget`` by iterating on.
"""

from __future__ import annotations

import re
from typing import Iterator

import msgspec
from msgspec import Raw, Struct

from ..reader import largebody
from ..reader.scan import skip_ws
from ..reader.wire import count


class Part(Struct):
    """A content block or part (Anthropic, chat, Responses output_text/input_text)."""

    type: str | None = None
    text: str | None = None
    id: str | None = None              # Anthropic tool_use / server_tool_use
    tool_use_id: str | None = None     # Anthropic tool_result
    signature: str | None = None       # Anthropic thinking
    data: str | None = None            # Anthropic redacted_thinking


class ToolCall(Struct):
    id: str | None = None


class Item(Struct):
    """A chat message (Anthropic, chat/completions) or a Responses input item."""

    role: str | None = None
    type: str | None = None
    content: str | list[Part] | None = None
    tool_calls: list[ToolCall] | None = None   # chat: assistant tool calls
    tool_call_id: str | None = None    # chat: tool result
    call_id: str | None = None         # Responses: *_call and *_output items
    encrypted_content: str | None = None       # Responses: reasoning, compaction


class History(Struct):
    messages: list[Item] | None = None
    input: str | list[Item] | None = None      # Responses
    previous_response_id: str | None = None


_history = msgspec.json.Decoder(History)
_item = msgspec.json.Decoder(Item)
_part = msgspec.json.Decoder(Part)
_loose = msgspec.json.Decoder(dict[str, Raw])
_items = msgspec.json.Decoder(list[Raw])


class _Skip(Struct):
    """Any object, every member skipped: finds where an item ends."""


_skip = msgspec.json.Decoder(_Skip)
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")
_FIELD_TYPES = {name: msgspec.json.Decoder(t) for name, t in (
    ("role", str), ("type", str), ("tool_calls", list[ToolCall]),
    ("tool_call_id", str), ("call_id", str), ("encrypted_content", str))}
_content = msgspec.json.Decoder(str | list[Raw] | None)


def item(raw: bytes | memoryview) -> Item | None:
    """One item, leniently: a field of a wrong type is dropped, not fatal; None if not an object."""
    try:
        return _item.decode(raw)
    except msgspec.ValidationError:
        pass
    except (msgspec.DecodeError, RecursionError):
        return None
    try:
        fields = _loose.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    values: dict = {}
    for name, decoder in _FIELD_TYPES.items():
        if name in fields:
            try:
                values[name] = decoder.decode(fields[name])
            except (msgspec.DecodeError, RecursionError):
                pass
    if "content" in fields:
        try:
            content = _content.decode(fields["content"])
        except (msgspec.DecodeError, RecursionError):
            content = None
        if isinstance(content, list):  # one odd block (a list, a number, a bad field) spoils only itself
            blocks = []
            for raw_part in content:
                try:
                    blocks.append(_part.decode(raw_part))
                except (msgspec.DecodeError, RecursionError):
                    pass
            content = blocks
        values["content"] = content
    return Item(**values)


def _lenient(raws: list[Raw]) -> Iterator[Item]:
    for raw in raws:
        one = item(raw)
        if one is not None:
            yield one


# ---------------------------------------------------------------- the items of a body


FAST_MIN = 256 * 1024


def array_start(data: bytes, key: bytes) -> int:
    """The position just after the ``[`` of the top-level ``"key": [``, or -1. The members
    before it are walked one at a time from the opening brace (``largebody.head_members``:
    each byte scanned once), so look-alike keys nested before it cost nothing extra."""
    found = largebody.head_members(data, key.decode())
    return -1 if found is None else found[1] + 1


class OverBudget(Exception):
    """The items asked for do not fit in the walk's budget."""


class KindOnly(Item):
    """An item past the walk's budget: its ``role`` and ``type`` alone, from its first bytes."""


KIND_PREFIX = 64 * 1024     # bytes of an item past the budget read for its role and type, at most
_raw = msgspec.json.Decoder(Raw)
_name = msgspec.json.Decoder(str | None)


def _end_within(view: memoryview, i: int, lim: int) -> int:
    """The index of the first non-space byte after the JSON value at ``i``, when the value
    ends before ``lim`` (and something follows it there); else -1."""
    try:
        _raw.decode(view[i:lim])
        return -1
    except (msgspec.ValidationError, RecursionError):
        return -1
    except msgspec.DecodeError as err:
        m = _TRAILING.search(str(err))
        return -1 if m is None else i + int(m.group(1)) - 1


def kind_of_prefix(data: bytes, i: int, size: int = KIND_PREFIX) -> KindOnly | None:
    """The ``role`` and ``type`` of the object whose ``{`` is at ``i``, from at most ``size`` of
    its bytes: its members are read in order until one does not end within them (a member of
    another type counts as absent, as ``item`` reads it). None: neither was read."""
    lim = min(len(data), i + size)
    if i >= lim or data[i] != ord("{"):
        return None
    view = memoryview(data)
    found: dict[str, str | None] = {}
    j = skip_ws(data, i + 1)
    while j < lim and data[j] == ord('"'):
        colon = _end_within(view, j, lim)
        if colon == -1 or data[colon] != ord(":"):
            break
        v = skip_ws(data, colon + 1)
        end = _end_within(view, v, lim)
        if end == -1:
            break
        count(end - j)
        try:
            key = msgspec.json.decode(view[j:colon], type=str)
        except (msgspec.DecodeError, RecursionError):
            break
        if key in ("role", "type"):
            try:
                found[key] = _name.decode(view[v:end])
            except (msgspec.DecodeError, RecursionError):
                found.pop(key, None)
        if data[end] != ord(","):
            break
        j = skip_ws(data, end + 1)
    if found.get("role") is None and found.get("type") is None:
        return None
    return KindOnly(role=found.get("role"), type=found.get("type"))


class Budget(Struct, frozen=True):
    size: int            # bytes of the array walked, from its opening bracket
    items: int           # items read


def walk(data: bytes, key: bytes, budget: Budget | None = None, ends: list[int] | None = None) -> Iterator[Item] | None:
    """The items of the top-level array ``key`` one by one, reading only as far as the caller
    iterates; None when the body does not look like ``{..., "key": [...], ...}``. A body that
    turns out malformed further on ends the iteration early (the caller sees fewer items).
    With a ``budget``, iterating past it raises ``OverBudget``, once the item that crosses it has
    been yielded as its kind alone (``KindOnly``, when its first bytes say it). ``ends``:
    receives, before each item is yielded, the offset just past it (the bytes from
    ``array_start`` to there are what the items read so far were parsed from); -1 for a
    ``KindOnly`` one (it was not read to its end)."""
    s = array_start(data, key)
    if s == -1:
        return None
    stop = len(data) if budget is None else min(len(data), s + budget.size)
    most = None if budget is None else budget.items

    def items() -> Iterator[Item]:
        view = memoryview(data)
        i = skip_ws(data, s)
        if i < len(data) and data[i] == ord("]"):
            return
        n = 0
        while i < len(data):
            over = most is not None and n >= most
            if not over:
                try:
                    _skip.decode(view[i:stop])
                    if stop < len(data):
                        end = stop           # the item ends exactly at the budget's edge
                    else:
                        return  # an item running to the end of the body: not inside an array
                except (msgspec.ValidationError, RecursionError):
                    return  # not an object, or nested deeper than msgspec reads
                except msgspec.DecodeError as err:
                    m = _TRAILING.search(str(err))
                    if m is None and stop >= len(data):
                        return
                    over = m is None             # it does not end within the budget
                    end = -1 if over else i + int(m.group(1)) - 1
            if over:
                kind = kind_of_prefix(data, i)   # what it is, from its first bytes only
                if kind is not None:
                    if ends is not None:
                        ends.append(-1)
                    yield kind
                raise OverBudget
            count(2 * (end - i))   # the skip, then the item's decode
            one = item(view[i:end])
            n += 1
            if one is not None:
                if ends is not None:
                    ends.append(end)
                yield one
            j = skip_ws(data, end)
            if j >= len(data) or data[j] != ord(","):
                return
            i = skip_ws(data, j + 1)

    return items()


def history(data: bytes, flavour: str, whole: bool, budget: Budget | None = None,
            members: dict[str, Raw] | None = None,
            ends: list[int] | None = None, walk_from: int = FAST_MIN) -> tuple[Iterator[Item] | str | None, str | None]:
    """(the items, or a Responses string input; the body's previous_response_id). ``whole``:
    decode the body at once (contents skipped); else a body of ``walk_from`` bytes or more is
    walked item by item (its previous_response_id is then not looked for: the facts reader has
    it). With a ``budget`` (not whole), a body larger than it that cannot be walked raises
    ``OverBudget`` rather than be decoded at once. ``members``: the body's top level as raw
    members, decoded already: a body read at once is read from them (its history's bytes only),
    not decoded again. ``ends``: a walked body's item ends (``walk``); left empty when the body
    is read at once."""
    key = b"input" if flavour == "responses" else b"messages"
    if not whole and len(data) >= walk_from:
        items = walk(data, key, budget, ends)
        if items is not None:
            return items, None
        if budget is not None and len(data) > budget.size:
            raise OverBudget
    try:
        h = _history_of(members) if members is not None else _history.decode(data)
    except msgspec.ValidationError:
        h = _lenient_history(data, key.decode(), members)
    except (msgspec.DecodeError, RecursionError):
        return None, None
    if h is None:
        return None, None
    prev = h.previous_response_id
    items = h.input if flavour == "responses" else h.messages
    if isinstance(items, str):
        return items, prev
    return (iter(items) if items is not None else None), prev


_history_members = {"messages": msgspec.json.Decoder(list[Item] | None),
                    "input": msgspec.json.Decoder(str | list[Item] | None),
                    "previous_response_id": msgspec.json.Decoder(str | None)}


def _history_of(members: dict[str, Raw]) -> History:
    """``_history.decode(data)`` from the body's raw members: the same fields, of the same types
    (one of a wrong type raises ``ValidationError``, as the whole decode does)."""
    h = History()
    for name, decoder in _history_members.items():
        raw = members.get(name)
        if raw is not None:
            setattr(h, name, decoder.decode(raw))
    return h


def _lenient_history(data: bytes, key: str, fields: dict[str, Raw] | None = None) -> History | None:
    if fields is None:
        try:
            fields = _loose.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return None
    h = History()
    try:
        h.previous_response_id = msgspec.json.decode(fields.get("previous_response_id", b"null"), type=str | None)
    except (msgspec.DecodeError, RecursionError):
        pass
    raw = fields.get(key)
    if raw is None:
        return h
    try:
        value = msgspec.json.decode(raw, type=str | list[Raw])
    except (msgspec.DecodeError, RecursionError):
        return h
    if isinstance(value, str):
        if key == "input":
            h.input = value
    elif key == "input":
        h.input = list(_lenient(value))
    else:
        h.messages = list(_lenient(value))
    return h


def top_fields(data: bytes, names: tuple[str, ...], array_key: bytes) -> dict[str, Raw] | None:
    """The top-level members ``names`` of a large body without reading its history: those before
    the array ``array_key`` from the head (walked member by member), the others from the tail,
    found from the end and proved top-level (``largebody.tail_members``: a slice that decodes as
    ``{`` + the text after a comma can only start at depth 1). None when the body is not shaped
    so, or when look-alikes in it would cost more than reading it whole (the caller then decodes
    it whole)."""
    found = largebody.head_members(data, array_key.decode())
    if found is None:
        return None
    head, value = found
    tail = largebody.tail_members(data, [n for n in names if n not in head], value)
    if tail is None:
        return None
    return {**tail, **head}
