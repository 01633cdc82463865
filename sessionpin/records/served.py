"""The pins this proxy served, remembered in bounded memory: a pin the store no longer has
is a loss, not a new conversation (issue 18, partial loss).

Rules it keeps:
- One entry per session whose pin this proxy read or wrote: the server it named, when it
  expires (its renewal plus the pin TTL, as this proxy last saw it) and when it was served. At most ``bound``
  entries (``BOUND``, 50,000: a few MB); the least recently served falls out first, and
  a session that fell out is not watched any more (its loss is not seen by this proxy).
- ``expected``: the session's pin should be in the store — remembered, and not expired
  by the expiry this proxy knows (another proxy may have renewed it since: then a loss
  after that expiry is missed, never invented).
- The operator's decisions are not losses: a forgotten pin leaves a tombstone the caller
  checks (``pins.FORGOT_PREFIX``); when the operator accepts the store's losses, the caller
  drops the sessions whose pins are missing then (``drop``), and keeps watching the rest; a
  tombstone of an older pin than the one served is not this pin's (``forgotten``: by the
  pins it names, not by clocks — the operator's machine may run behind ours).
  Each lost session is reported once (``report``).
"""

from __future__ import annotations

from collections import OrderedDict

from . import pins

BOUND = 50_000


class Served:
    def __init__(self, bound: int = BOUND) -> None:
        self.bound = bound
        self._pins: OrderedDict[str, tuple[str | None, float, float]] = OrderedDict()
        self._reported: set[str] = set()

    def __len__(self) -> int:
        return len(self._pins)

    def saw(self, session: str, server: str | None, expires: float, now: float, since: float = 0.0) -> None:
        self._pins[session] = (server, expires, now, since)
        self._pins.move_to_end(session)
        self._reported.discard(session)
        while len(self._pins) > self.bound:
            old, _ = self._pins.popitem(last=False)
            self._reported.discard(old)

    def expected(self, session: str, now: float) -> tuple[str | None, float, float] | None:
        """(server, expiry, served at) of a pin that should still be in the store, else None."""
        got = self._pins.get(session)
        if got is None:
            return None
        if got[1] <= now:
            self.drop(session)
            return None
        return got[:3]

    def forgotten(self, session: str, tombstone: str | None) -> bool:
        """Did the operator forget the pin served (or a later one)? By the pin the tombstone
        names (``pins.forgot_after``), not by comparing the operator's clock with ours."""
        got = self._pins.get(session)
        if got is None or tombstone is None:
            return False
        if pins.forgot_after(tombstone, got[3], got[1], got[2]):
            self.drop(session)
            return True
        return False

    def drop(self, session: str) -> None:
        self._pins.pop(session, None)
        self._reported.discard(session)

    def report(self, session: str) -> bool:
        """True the first time a session's loss is reported (one ERROR line per loss)."""
        if session in self._reported:
            return False
        if len(self._reported) >= self.bound:
            self._reported.clear()          # bounded too: a loss reported long ago may be said again
        self._reported.add(session)
        return True

    def sessions(self) -> list[str]:
        return list(self._pins)

    def clear(self) -> None:
        self._pins.clear()
        self._reported.clear()
