"""A body's top level as raw members, a long value sent again passed over instead of skimmed.

A client sends the same long member on every turn of its process — Claude Code's ``tools``,
92 KB of schemas in a 115 KB continuation — and reading the top level (``dict[str, Raw]``)
skims it in C every time: 70 of the 90 µs that decode costs. ``members(data)`` is that decode,
with a remembered value (``remember``: one a decode of this kind took from a body it accepted)
found by its first bytes and compared whole (memcmp: a few µs), then stood in for by a token
while the rest is decoded, and put back.

Why the answer is the decode's, byte for byte:
- the token is a JSON string made of 128 random bits drawn when the process starts (never
  written anywhere): a body cannot hold it unless it was put there;
- JSON is context-free at a value: where one complete value stood, another can stand, and the
  text around it parses the same. So when the body with the token parses and a top-level
  member's whole value is the token, the body itself parses with that member's value the
  remembered one — valid JSON already (a body accepted by the same decoder held it);
- where the remembered bytes were found anywhere else (inside a message, astride a string's
  end), the token is not a top-level member's whole value, or the text no longer parses: the
  body is decoded whole, as before — and so is anything odd (a duplicate key whose last value
  is not the token, a body that is not JSON: its own decode says what is wrong).
Memory only: a handful of values, the most recent first, each bounded in size. A body holding
none of them costs at most ``TRIES`` finds over it (memchr speed: a tenth of the decode's).

A conversation's messages array is not sent unchanged but grown: its earlier messages again,
byte for byte, and a few more. Those (``knownarrays``' arrays: all of a kept array's items, or
all but its last) are stood in for by one item, a second token, when they begin the value of the
body's ``"messages"`` member (found within ``ITEMS_WINDOW`` bytes of the start): where a
non-empty list of an array's items stood, one item can stand, and the text around it parses
the same. The member whose value begins ``[`` and that token gets back its real bytes: the
body's, from the same place, as long as the stand-in's value and the items it stood in for.
"""

from __future__ import annotations

import os

import msgspec

from . import knownarrays, wire
from .arrays import repeats
from .scan import skip_ws

MIN_SIZE = 16 * 1024          # a value this long is worth remembering (the search costs ~µs a body)
MAX_SIZE = 1024 * 1024        # (four of them: 4 MB at most, whatever a client sends)
COUNT = 4                     # remembered values (a proxy serves a few client versions at a time)
NAMES = frozenset({"tools"})  # members sent unchanged turn after turn (the system prompt is not:
                              # Claude Code's carries a billing line new on every request)
TRIES = 2                     # searches a body at most (a miss costs a find over it: ~0.1 ms per MB)
_HEAD = 64                    # bytes searched for: the rest is compared where they are found
ITEMS_WINDOW = 32 * 1024     # bytes searched for the messages member's name (clients put it first)
NAME_HITS = 4                # "messages" found at most this many times there (a value of that text first)
_TOKEN = b'"sessionpin-known-' + os.urandom(16).hex().encode() + b'"'
_ITEMS = b'"sessionpin-items-' + os.urandom(16).hex().encode() + b'"'
_MESSAGES = b'"messages"'
_known: list[bytes] = []      # most recent first


def members(data: bytes, arrays: list[tuple[bytes, list[int]]] | None = None) -> dict[str, msgspec.Raw]:
    """``wire.loose_decoder.decode(data)``, the same answer and the same errors. ``arrays``:
    the messages arrays (each with where its items end) whose items may be stood in for,
    instead of ``knownarrays``' (the body reader's process passes the prompt shape's)."""
    fields = passed_over(data, arrays=arrays)
    if fields is None:
        wire.count(len(data))
        fields = wire.loose_decoder.decode(data)
        remember(fields)
    return fields


def passed_over(data: bytes, items: bool = True,
                arrays: list[tuple[bytes, list[int]]] | None = None) -> dict[str, msgspec.Raw] | None:
    """``data``'s top level read with a remembered value passed over, and (``items``) the
    messages it repeats; None when nothing remembered is in it where a member's value (or the
    messages' first items) stands, or the text does not parse: the caller decodes it whole.
    ``arrays``: as ``members``'."""
    cuts: list[tuple[int, int, bytes]] = []       # (start, end, token): data[start:end] stood in for
    repeated = _found_items(data, arrays) if items else None
    if repeated is not None:
        cuts.append(repeated)
    value = _found_value(data, repeated[1] if repeated else 0)
    if value is not None and (repeated is None or repeated[1] <= value[0] or value[1] <= repeated[0]):
        cuts.append(value)
    if not cuts:
        return None
    return _stood_in(data, sorted(cuts))


def _found_value(data: bytes, after: int = 0) -> tuple[int, int, bytes] | None:
    """Where a remembered value is in ``data`` (searched for at most ``TRIES`` times), searched
    for from ``after`` first (past the messages stood in for: clients send the tools after them)."""
    tries = TRIES
    for i, value in enumerate(_known):
        if len(value) < len(data):
            at = data.find(value[:_HEAD], after)
            if at < 0 and after:
                at = data.find(value[:_HEAD], 0, after)
            if at >= 0 and data.startswith(value, at):       # (memcmp; a memoryview's != is per byte)
                if i:
                    _first(value)
                return at, at + len(value), _TOKEN
            tries -= 1
            if not tries:
                break
    return None


def _found_items(data: bytes, arrays: list[tuple[bytes, list[int]]] | None = None) -> tuple[int, int, bytes] | None:
    """The items a kept messages array (``arrays``, else ``knownarrays``') gives at the start of
    the messages member's value: the bytes from just past its ``[`` through the last of them."""
    if arrays is None:
        arrays = knownarrays.kept()
    p = data.find(_MESSAGES, 0, ITEMS_WINDOW) if arrays else -1
    for _ in range(NAME_HITS):
        if p < 0:
            return None
        c = skip_ws(data, p + len(_MESSAGES))
        if c < len(data) and data[c] == 0x3A:          # ":": a member's name
            q = skip_ws(data, c + 1)
            if q < len(data) and data[q] == 0x5B:      # [
                for old, ends in arrays:
                    k = repeats(old, ends, data, q)
                    if k:
                        return q + 1, q + ends[k - 1], _ITEMS
            return None
        p = data.find(_MESSAGES, p + 1, ITEMS_WINDOW)   # a value "messages" before the member
    return None


def _stood_in(data: bytes, cuts: list[tuple[int, int, bytes]]) -> dict[str, msgspec.Raw] | None:
    """The top level of ``data`` with each cut stood in for by its token, then each token's
    member given its real bytes back; None when a token is not where a member's value (a value's
    token) or its first item (the items' token) stands, or is there twice."""
    view = memoryview(data)
    pieces, done = [], 0
    for start, end, token in cuts:
        pieces += [view[done:start], token]
        done = end
    pieces.append(view[done:])
    stand_in = b"".join(pieces)
    wire.count(len(stand_in) + _HEAD)
    try:
        fields = wire.loose_decoder.decode(stand_in)
    except (msgspec.DecodeError, RecursionError):
        return None
    for start, end, token in cuts:
        where = None
        for name, raw in fields.items():
            if _holds(raw, token):
                if where is not None:
                    return None
                where = name
        if where is None:
            return None
        if token is _TOKEN:
            fields[where] = msgspec.Raw(view[start:end])      # (a view of the body: nothing copied)
        else:       # the array from its [: as long as the stand-in's, less the token, plus the items
            fields[where] = msgspec.Raw(view[start - 1:start - 1 + len(fields[where]) - len(token) + end - start])
    return fields


def _holds(raw: msgspec.Raw, token: bytes) -> bool:
    """Whether a member's value is where ``token`` stood in: the whole value (a remembered
    value's token) or the first item of an array (the repeated items' token)."""
    if token is _TOKEN:
        return len(raw) == len(token) and bytes(raw) == token
    return bytes(memoryview(raw)[:1 + len(token)]) == b"[" + token


def remember(fields: dict[str, msgspec.Raw]) -> None:
    """Keep the long values of ``NAMES`` a decode took (views of the body, kept as bytes)."""
    for name in NAMES:
        raw = fields.get(name)
        if raw is None:
            continue
        view = memoryview(raw)
        if not MIN_SIZE <= len(view) <= MAX_SIZE:
            continue
        value = view.tobytes()
        if value not in _known:      # (a compare of equal lengths only)
            _known.insert(0, value)
            del _known[COUNT:]


def _first(value: bytes) -> None:
    # Readers on other threads (a large body's) may move or add one at the same time: each
    # list operation is atomic, and a value gone meanwhile is simply not moved.
    try:
        _known.remove(value)
    except ValueError:
        return
    _known.insert(0, value)
