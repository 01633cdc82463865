"""A conversation's messages array sent again: the items it repeats taken back decoded.

Every turn of a conversation sends its whole history again with a few messages more, and the
facts read decodes every message of it (its role and type: ``wire.Message``) — ~90 ns a
message, 0.2 ms a turn for a history of 2,300 small steps in 100 KB, on the event loop.
``decode(raw, decoder)`` is ``decoder.decode(raw)`` for an array (``wire.decode_fields``'
messages) with the arrays decoded lately remembered: when an array begins with all the items
of one of them, or all but its last (a client moves its cache mark to the newest message each
turn), byte for byte, those items decode as they did — the same bytes, the same value — so
they are taken back and only the items after them are decoded.

Why the answer is the decode's:
- a kept array's items end where its own decode put them (``arrays.item_ends``: from the
  items' raw lengths and the white space between them), so a prefix of bytes that holds its
  first k items whole holds the same k items in the new array, at the same places;
- what follows them must be a comma and the rest of an array: ``[`` + that rest decodes as the
  remaining items, or raises as the whole decode raises on it (a wrong type, bad JSON). The
  whole array is a value the top-level read of the body already took whole (``Raw``).
Taken only by one compare (``arrays.repeats``): a conversation whose history was edited or cut
is decoded whole, as before. Arrays under ``MIN_SIZE`` are decoded whole (the compare would
cost what it saves), and so are arrays of more than ``MAX_ITEMS`` (not kept). A body costs at
most two compares (memcmp) with each kept array here, and as many in ``knownvalues``. Memory
only: ``COUNT`` arrays, each at most ``MAX_SIZE``, with the values decoded from them (for
messages: each one's role and type and a view of its content).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Raw

from .arrays import item_ends, repeats
from .scan import skip_ws

MIN_SIZE = 16 * 1024
MAX_SIZE = 256 * 1024       # (the facts read a larger body in parts: largebody)
COUNT = 16
# An array of more items is not kept: its places would cost a second decode and a list as long
# (a real history has hundreds of messages in 256 KB; 40,000 ``{}`` fit, which no client sends).
MAX_ITEMS = 10_000

_items = msgspec.json.Decoder(list[Raw])
# (decoder, array, where each item ends in it, the items decoded), most recent first. Readers on
# other threads (a large body's) may use it at the same time: each list operation is atomic,
# and each entry is a tuple never changed.
_kept: list[tuple[msgspec.json.Decoder, bytes, list[int], list[Any]]] = []


def decode(raw: Raw, decoder: msgspec.json.Decoder) -> tuple[Any, int]:
    """``decoder.decode(raw)`` — the same value, the same errors — for a decoder of a list (or
    None), and the bytes it copied and decoded (``wire.count``'s; the compares, each stopping
    at its first difference, are memcmp over at most ``COUNT`` kept arrays)."""
    view = memoryview(raw)
    if not MIN_SIZE <= len(view) <= MAX_SIZE or view[0] != 0x5B:      # [
        return decoder.decode(raw), len(view)
    array = view.tobytes()
    for kept in list(_kept):
        used, old, ends, items = kept
        known = repeats(old, ends, array) if used is decoder else 0
        if not known:
            continue
        at = skip_ws(array, ends[known - 1])
        if at == len(array) - 1 and array[at] == 0x5D:     # ]: nothing new
            got = items[:known]
            _keep((decoder, array, ends[:known], got), kept)
            return got, len(array)
        if at < len(array) and array[at] == 0x2C:           # ,
            rest = b"[" + array[at + 1:]
            got = items[:known] + decoder.decode(rest)
            _keep((decoder, array, ends[:known] + item_ends(array, _items.decode(rest), at + 1), got), kept)
            return got, len(array) + 2 * len(rest)
    got = decoder.decode(array)
    if got is None or len(got) > MAX_ITEMS:
        return got, len(array)
    _keep((decoder, array, item_ends(array, _items.decode(array), 1), got), None)
    return got, 3 * len(array)


def kept() -> list[tuple[bytes, list[int]]]:
    """The arrays kept, each with where its items end (``knownvalues`` stands in for the items
    a body repeats), most recent first."""
    return [(old, ends) for _, old, ends, _ in list(_kept)]


def _keep(entry: tuple, replaced: tuple | None) -> None:
    """``entry`` first; the kept one it continues goes (it gives nothing this one does not)."""
    if replaced is not None:
        try:
            _kept.remove(replaced)
        except ValueError:          # another thread's read took it meanwhile
            pass
    _kept.insert(0, entry)
    del _kept[COUNT:]
