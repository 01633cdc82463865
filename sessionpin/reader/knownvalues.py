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
"""

from __future__ import annotations

import os

import msgspec

from . import wire

MIN_SIZE = 16 * 1024          # a value this long is worth remembering (the search costs ~µs a body)
MAX_SIZE = 1024 * 1024        # (four of them: 4 MB at most, whatever a client sends)
COUNT = 4                     # remembered values (a proxy serves a few client versions at a time)
NAMES = frozenset({"tools"})  # members sent unchanged turn after turn (the system prompt is not:
                              # Claude Code's carries a billing line new on every request)
TRIES = 2                     # searches a body at most (a miss costs a find over it: ~0.1 ms per MB)
_HEAD = 64                    # bytes searched for: the rest is compared where they are found
_TOKEN = b'"sessionpin-known-' + os.urandom(16).hex().encode() + b'"'
_known: list[bytes] = []      # most recent first


def members(data: bytes) -> dict[str, msgspec.Raw]:
    """``wire.loose_decoder.decode(data)``, the same answer and the same errors."""
    fields = passed_over(data)
    if fields is None:
        wire.count(len(data))
        fields = wire.loose_decoder.decode(data)
        remember(fields)
    return fields


def passed_over(data: bytes) -> dict[str, msgspec.Raw] | None:
    """``data``'s top level read with a remembered value passed over; None when none is in it
    where a member's value stands (or the text does not parse): the caller decodes it whole."""
    tries = TRIES
    for i, value in enumerate(_known):
        if len(value) < len(data):
            got = _passed_over(data, value)
            if got is not None:
                if i:
                    _first(value)
                return got
            tries -= 1
            if not tries:
                break
    return None


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


def _passed_over(data: bytes, value: bytes) -> dict[str, msgspec.Raw] | None:
    at = data.find(value[:_HEAD])
    if at < 0 or not data.startswith(value, at):    # (memcmp; a memoryview's != is per byte)
        return None
    view = memoryview(data)
    stand_in = b"".join((view[:at], _TOKEN, view[at + len(value):]))
    wire.count(len(stand_in) + _HEAD)
    try:
        fields = wire.loose_decoder.decode(stand_in)
    except (msgspec.DecodeError, RecursionError):
        return None
    where = None
    for name, raw in fields.items():
        if len(raw) == len(_TOKEN) and bytes(raw) == _TOKEN:
            if where is not None:
                return None
            where = name
    if where is None:
        return None
    fields[where] = msgspec.Raw(value)
    return fields
