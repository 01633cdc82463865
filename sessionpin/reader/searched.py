"""A large body's searches from its end, not run again over bytes the last turn had searched.

``largebody.tail_members`` finds each needed top-level name of a large body from its end. A
name that is not there — the second top-level ``"model"`` that must not be there, checked on
every body, or the ``prompt_cache_key`` of a client that sends none — is looked for through the
whole history: ``bytes.rfind`` of a short needle, ~1.8 instructions a byte, 0.15-0.27 ms per
MB, on the event loop, every turn (issue 22: 1.8 M of the 5.9 M instructions the router without
its watches adds to a 1 MB turn). Yet a turn's history is the last turn's again, byte for byte,
with a few messages more: those bytes were searched a moment ago.

``Memo`` remembers, for the bodies searched lately, the bytes from where the search begins
(the messages array's ``[``) up to where a needle was found nowhere. A new body whose bytes are
the same up to some point (memcmp, found by halving: ~60 µs per MB at worst) holds no such
needle there either, so its search begins where the shared bytes end, less the needle's length
but one (an occurrence astride the end is found).

Why the answer is the search's: whether a needle occurs within some bytes depends on those
bytes alone. Nothing about JSON is assumed: what a found occurrence is (a top-level member,
a nested one) is decided as before. Only ``bytes`` are kept (never a buffer that could change).

Memory only: ``COUNT`` bodies at most, ``BUDGET`` bytes in all, the most recent first. Readers
on other threads (the lineage's) may use it at the same time: each list operation is atomic,
and each entry is a tuple never changed.
"""

from __future__ import annotations

COUNT = 8                      # conversations whose last large body is kept (a proxy's busy few)
BUDGET = 32 * 1024 * 1024      # bytes kept in all (bodies under largebody's 8 MiB inline bound)
PROBE = 4096                   # bytes compared first: another conversation's body fails here

# (body, where its searches begin, {needle: the end of the bytes from there holding none of it})
_kept: list[tuple[bytes, int, dict[bytes, int]]] = []


class Memo:
    """One body's searches from its end, all beginning at ``lo``: where each may start, and
    (``clean``) what each found empty, kept for the next body by ``keep``."""

    def __init__(self, data: bytes, lo: int) -> None:
        self.data, self.lo = data, lo
        self._old: tuple[bytes, int, dict[bytes, int]] | None = None
        self._shared = -1          # bytes the kept body and this one begin with (-1: not compared)
        self.free: dict[bytes, int] = {}    # what this body's searches found empty
        for kept in list(_kept) if type(data) is bytes else ():
            old, old_lo, _ = kept
            if old_lo == lo and data.startswith(memoryview(old)[:min(PROBE, len(old))]):
                self._old = kept
                break

    def start(self, needle: bytes) -> int:
        """Where a search for ``needle`` may begin: ``data[lo:start + len(needle) - 1]`` is
        known to hold none (``lo`` when nothing is known)."""
        if self._old is None:
            return self.lo
        old, _, frees = self._old
        free = frees.get(needle, self.lo)
        if free <= self.lo:
            return self.lo
        if self._shared < 0:
            self._shared = shared(old, self.data, max(frees.values()))
        return max(self.lo, min(free, self._shared) - len(needle) + 1)

    def clean(self, needle: bytes, hi: int) -> None:
        """``data[lo:hi]`` holds no ``needle`` (a search over it found none)."""
        if hi > self.free.get(needle, self.lo):
            self.free[needle] = hi

    def keep(self) -> None:
        """This body's findings, kept for the next (in place of the kept body it began with)."""
        if not self.free or type(self.data) is not bytes or len(self.data) > BUDGET:
            return
        entry = (self.data, self.lo, dict(self.free))
        if self._old is not None:
            try:
                _kept.remove(self._old)
            except ValueError:
                pass                # (another thread's body replaced it first)
        _kept.insert(0, entry)
        total = 0
        for i, (body, _, _) in enumerate(list(_kept)):
            total += len(body)
            if i >= COUNT or total > BUDGET:
                del _kept[i:]
                break


def shared(old: bytes, data: bytes, upto: int) -> int:
    """How many bytes ``old`` and ``data`` begin with alike, counted up to ``upto``: one
    compare (memcmp) when all of them are, else halving (each compare from the last known
    alike byte: about twice the bytes in all)."""
    hi = min(len(old), len(data), upto)
    view = memoryview(old)
    if data.startswith(view[:hi]):
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data.startswith(view[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


def forget() -> None:
    """Drop every kept body (tests)."""
    _kept.clear()
