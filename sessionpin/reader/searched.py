"""A large body's searches from its end, not run again over bytes the last turn had searched.

``largebody.tail_members`` finds each needed top-level name of a large body from its end. A
name that is not there — the second top-level ``"model"`` that must not be there, checked on
every body, or the ``prompt_cache_key`` of a client that sends none — is looked for through the
whole history: ``bytes.rfind`` of a short needle, ~1.8 instructions a byte, 0.15-0.27 ms per
MB, on the event loop, every turn (issue 22: 1.8 M of the 5.9 M instructions the router without
its watches adds to a 1 MB turn). A name that is there only nested (Codex's ``"tools"``, inside
its first input item) costs that scan and, for each look-alike, a decode to prove it nested and
a copy of the body. Yet a turn's history is the last turn's again, byte for byte, with a few
messages more: those bytes were searched a moment ago.

``Memo`` keeps, for the bodies searched lately and for each name a search went through to the
start of the messages (``[``) without finding it, two facts about the bytes from there:
- ``none``: the bytes up to here hold no occurrence of the name's needle (``"name"``);
- ``rejected``: every occurrence within the bytes up to here was turned down by the bytes
  before ``reach`` alone — its neighbours (not a member's name: no ``,`` or ``{`` before it, no
  ``:`` after it), the ``{`` before it (a nested object's first member), or a decode from the
  comma before it that failed at a byte before ``reach``. An occurrence turned down for what
  the search had found before it (inside the tail already decoded) ends this range.
A new body whose bytes are the same as a kept one's up to some point (memcmp: its first 4 KB,
then where the two part, by halving; ~60 µs per MB at worst) has the same occurrences there,
turned down by the same bytes (a decode is read left to right: the same bytes, the same error
at the same byte). So its search begins where those facts end, capped where the bodies part,
less the needle's length but one (an occurrence astride the end is found); ``rejected`` only
when ``reach`` is within the shared bytes, else ``none``. It finds what it finds without the
memo, without the work. Nothing about JSON is assumed that the search did not itself check.
Only ``bytes`` are kept (never a buffer that could change).

Memory only: ``COUNT`` bodies at most, ``BUDGET`` bytes in all, the most recent first. Readers
on other threads (the lineage's) may use it at the same time: each list operation is atomic,
and each entry is a tuple never changed.
"""

from __future__ import annotations

from typing import NamedTuple

from . import arrays
from .wire import count          # (the bytes compared, with every other scan of a body: wire.STEPS)

COUNT = 8                      # conversations whose last large body is kept (a proxy's busy few)
BUDGET = 32 * 1024 * 1024      # bytes kept in all (bodies under largebody's 8 MiB inline bound)
PROBE = 4096                   # bytes compared first: another conversation's body fails here


class Known(NamedTuple):
    """What a body's search for one needle, from ``lo`` to its end, left known."""
    none: int          # data[lo:none] holds no occurrence
    rejected: int      # every occurrence within data[lo:rejected] is turned down by data[:reach]
    reach: int


# (body, where its searches begin, {needle: Known})
_kept: list[tuple[bytes, int, dict[bytes, Known]]] = []


class Memo:
    """One body's searches from its end, all from ``lo``: where each may start (``start``),
    what each turned down and why (``rejected``, ``stopped``), what each found empty
    (``clean``), kept for the next body by ``keep``."""

    def __init__(self, data: bytes, lo: int) -> None:
        self.data, self.lo = data, lo
        self._old: tuple[bytes, int, dict[bytes, Known]] | None = None
        self._shared = -1          # bytes the kept body and this one begin with (-1: not compared)
        self._from: dict[bytes, Known] = {}     # what a search here starts from (``start``)
        self._reach: dict[bytes, int] = {}      # per needle: the bytes its turn-downs here read
        self._stop: dict[bytes, int] = {}       # per needle: the lowest turned down for the search's state
        self.known: dict[bytes, Known] = {}     # what this body's completed searches left known
        for kept in list(_kept) if type(data) is bytes else ():
            old, old_lo, _ = kept
            if old_lo == lo and data.startswith(memoryview(old)[:min(PROBE, len(old))]):
                self._old = kept
                break

    def start(self, needle: bytes) -> int:
        """Where a search for ``needle`` may begin: every occurrence before it (wholly within
        ``data[lo:start + len(needle) - 1]``) is known turned down (or there is none)."""
        got = self._from.get(needle)
        if got is None:
            got = self._from[needle] = self._inherited(needle)
        return max(self.lo, got.rejected - len(needle) + 1)

    def _inherited(self, needle: bytes) -> Known:
        nothing = Known(self.lo, self.lo, 0)
        if self._old is None or needle not in self._old[2]:
            return nothing
        old, _, known = self._old
        k = known[needle]
        if self._shared < 0:
            self._shared = shared(old, self.data, max(max(x.rejected, x.reach) for x in known.values()))
        none = min(k.none, self._shared)
        if k.reach <= self._shared:
            return Known(none, max(none, min(k.rejected, self._shared)), k.reach)
        return Known(none, none, 0)

    def rejected(self, needle: bytes, reach: int) -> None:
        """An occurrence of ``needle`` was turned down by ``data[:reach]`` alone."""
        if reach > self._reach.get(needle, 0):
            self._reach[needle] = reach

    def stopped(self, needle: bytes, at: int) -> None:
        """An occurrence of ``needle`` after ``at`` was turned down for what the search had
        found before it: what is known turned down ends at ``at``."""
        if at < self._stop.get(needle, len(self.data)):
            self._stop[needle] = at

    def clean(self, needle: bytes, hi: int) -> None:
        """The search for ``needle`` ended without finding it: none in ``data[start:hi]``,
        every occurrence from ``hi`` to the body's end turned down."""
        inherited = self._from.get(needle) or Known(self.lo, self.lo, 0)
        # none below ``hi`` when the bytes below the start held none either; else as known
        none = max(hi, inherited.none) if inherited.none >= inherited.rejected else inherited.none
        rejected = self._stop.get(needle, len(self.data))
        reach = max(self._reach.get(needle, 0), inherited.reach)
        self.known[needle] = Known(none, max(none, rejected), reach)

    def keep(self) -> None:
        """This body's findings, kept for the next in place of the kept body it began with, and
        with what that one's held of keys not searched here, as far as the two share their
        bytes (the facts' reader and the lineage's look for other keys in the same body)."""
        if type(self.data) is not bytes or len(self.data) > BUDGET:
            return
        known = dict(self.known)
        for needle in self._old[2] if self._old is not None else ():
            if needle not in known:
                got = self._inherited(needle)
                if got.rejected > self.lo:
                    known[needle] = got
        if not known:
            return
        entry = (self.data, self.lo, known)
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
    compare (memcmp) when all of them are, else halving (``arrays.halving``: each compare from
    the last byte known alike). Each compare's bytes are counted as scanned."""
    hi = min(len(old), len(data), upto)
    if old is data:
        return hi
    view = memoryview(old)
    count(hi)
    if data.startswith(view[:hi]):
        return hi

    def same(lo: int, mid: int) -> bool:
        count(mid - lo)
        return data.startswith(view[lo:mid], lo)
    return arrays.halving(hi, same)


def forget() -> None:
    """Drop every kept body (tests)."""
    _kept.clear()
