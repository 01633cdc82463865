"""A JSON array's items by their places: where each ends, and how many a newer array repeats.

A conversation's next request sends its messages array again with a few items more. Kept with
where its items end, an array tells how many of its items a newer one begins with by one
compare (memcmp) — what lets the prompt shape (``promptshape.Runs``) and the facts read
(``knownarrays``) take those items' work back instead of doing it again.
"""

from __future__ import annotations

import itertools

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
