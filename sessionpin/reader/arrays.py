"""A JSON array's items by their places: where each ends, and how many a newer array repeats.

A conversation's next request sends its messages array again with a few items more. Kept with
where its items end, an array tells how many of its items a newer one begins with by one
compare (memcmp) — what lets the prompt shape (``promptshape.Runs``) and the facts read
(``knownarrays``) take those items' work back instead of doing it again.
"""

from __future__ import annotations

import itertools
from typing import Callable

from msgspec import Raw

from .scan import skip_ws


def item_ends(array: bytes, items: list[Raw], start: int) -> list[int]:
    """Where each of ``items`` ends in ``array``: the array's items from ``start`` on (just
    past its ``[`` or a comma), decoded. Compact (one comma between each two and the ``]``
    right after the last, not a byte more: what every client sends), the lengths say it at
    once; otherwise each item is found past the white space and the comma before it (a
    hand-made body, ``json.dumps``' default)."""
    if sum(map(len, items)) + len(items) == len(array) - start:
        return list(itertools.accumulate((len(raw) + 1 for raw in items), initial=start - 1))[1:]
    ends = []
    for raw in items:
        start = skip_ws(array, start) + len(raw)
        ends.append(start)
        start = skip_ws(array, start) + 1
    return ends


def repeats(old: bytes, ends: list[int], array: bytes, at: int = 0) -> int:
    """How many of ``old``'s items (ending at ``ends``) ``array`` begins with (from ``at``) byte
    for byte, when it is all of them or all but the last (a client moves its cache mark to the
    newest message each turn); 0 otherwise. One compare each."""
    view = memoryview(old)
    if ends and array.startswith(view[:ends[-1]], at):
        return len(ends)
    if len(ends) > 1 and array.startswith(view[:ends[-2]], at):
        return len(ends) - 1
    return 0


def halving(most: int, same: Callable[[int, int], bool]) -> int:
    """The length of a shared prefix of at most ``most`` items, found by halving: ``same(lo,
    mid)`` says whether items ``lo`` to ``mid`` are shared, those before ``lo`` being so (one
    compare in C each: digests, bytes)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if same(lo, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix(a: bytes, b: bytes, most: int | None = None) -> int:
    """How many bytes ``a`` and ``b`` begin with alike (at most ``most``), by halving: each
    step one ``startswith`` of a view (memcmp from the last byte known alike, nothing copied)."""
    view = memoryview(a)
    n = min(len(a), len(b)) if most is None else min(len(a), len(b), most)
    return halving(n, lambda lo, mid: b.startswith(view[lo:mid], lo))
