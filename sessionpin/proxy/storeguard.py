"""StoreGuard: the proxy refuses to take a store that lost what it held for a new one (issue 18).

Rules it keeps:
- Before the first request it routes with a store, the guard settles the store's identity
  (``store.identity``) against what this machine remembers of the URL; a store that came
  back empty or with another identity is *lost*: every routed request is refused with 503
  naming the store, what was lost and the command that decides (``gate``). The store is
  looked at again every ``CHECK_EVERY`` (1 s, one read of one key) and on every request
  whose pin is missing, so a FLUSHALL while running is seen at once by the request that
  would have met it, and within a second otherwise.
- A store this machine never saw is taken as it is (a new one gets its identity), and the
  log says so; it is remembered from then on, with its live pin count (every
  ``COUNT_EVERY``) so a later loss can say how much was lost.
- Partial loss: a pin this proxy served (``served.Served``, bounded), or one the pin
  index still holds (made by any proxy: the index entry is written with the pin and
  removed by ``forget``), that the store no longer has, not forgotten by the operator
  (tombstone) and not expired, is a refusal and one ERROR line per session. Asked for
  every request whose pin is missing, with history or without: a subagent's request, or a
  Codex socket reconnecting after a restart (it says ``history_initialization: new``),
  carries none, and must not be sent where the agent addresses nor pinned anew over the
  loss. A truly new session has no index entry: nothing is invented; an opening pays two
  more reads (the identity, the index) beside the durable write it makes anyway. When the operator accepts the losses (the identity's
  ``accepted`` time moves on; a restore does not move it), the served pins missing then are forgotten (their conversations are decided
  afresh) and the others are still watched.
- Recorded: a loss a proxy (or the CLI) recorded in the store itself (``store:losses``)
  that still waits for the operator is a loss to every proxy, whatever its machine
  remembers (``identity.pending_loss``): a router on another machine, or one that took an
  emptied store for new before the loss was recorded, refuses too. So is a pin a proxy
  recorded lost (of that agent, not expired, not forgotten since), for the request whose
  pin is missing and which neither this proxy served nor the index holds.
- Rolled back: the store counts the pins made in it (``identity.MADE_KEY``, with each
  durable pin change); the count is remembered with the identity at every check, and a
  store with the remembered identity, under the same decision of the operator, that counts
  fewer is an older copy of itself (a directory restored from a backup while the proxy was
  stopped, a Redis restarted on an older snapshot): a loss, refused until a copy at least
  that recent is restored or the operator accepts it. Pins made in the last seconds before
  every proxy that would remember them stopped may
  not be counted in any machine's memory: the count remembered is the one read at least
  ``MADE_SETTLE`` (2 s) before (a count read of a write in flight when a Redis primary
  died may never reach the replica that takes over; its pin was not acknowledged).
- Evicted: on Redis, the server's count of evicted keys (``evicted_keys`` per ``run_id``,
  read by the store's ``watch`` every 2 s, and at once on a request whose pin is
  missing) grown since this machine last saw the store whole is a loss like the others:
  Redis cannot say which keys went, and a pin evicted with its index entry reads as never
  made. The count is remembered in the memory file, so a proxy started later catches it
  too; ``accept-loss`` or a restore settles it (``identity.judge_evictions``).
- The memory file is read and written off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any, Mapping

import msgspec

from ..records import pins
from ..records.served import Served
from ..store import Store, StoreError
from ..store import identity as ident

log = logging.getLogger("sessionpin")

CHECK_EVERY = 1.0
COUNT_EVERY = 30.0
MADE_SETTLE = 2.0       # a count of pins made is remembered once it was read this long ago (below)


class StoreGuard:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = env if env is not None else os.environ
        self.served = Served()
        self.lost: str | None = None          # why every routed request is refused
        self.kind: str | None = None          # the last verdict (identity.OK, LOST…)
        self.partial = 0                      # sessions whose served pin the store lost
        self.others: list[ident.Remembered] = []  # other stores with live pins, when this one was new
        self._store: Store | None = None
        self._url = ""                        # as given (the memory is keyed by its location)
        self._memory: ident.Memory | None = None
        self._remembered: ident.Remembered | None = None
        self._raw: str | None = None          # the identity's text last read
        self._settled = False
        self._lock = asyncio.Lock()
        self._checked = 0.0
        self._counted = 0.0
        self._made = 0
        self._accepted_at: float | None = None   # the identity's ``accepted`` when last read
        self._whole_at = 0.0                  # when a check last found the store whole (wall clock)
        self._made_seen: list[tuple[float, int]] = []   # (monotonic, the store's count of pins made) read
        self.who = f"{socket.gethostname()}:{os.getpid()}"

    def use(self, store: Store, url: str) -> None:
        """A store was opened (or replaced): nothing of the old one applies to it."""
        self._store, self._url = store, url
        self._memory = ident.Memory(url, self.env)
        self._remembered, self._raw, self._settled, self._made = None, None, False, 0
        self._accepted_at, self._whole_at = None, 0.0
        self._made_seen = []
        self.lost, self.kind = None, None
        self.others = []
        self.served.clear()

    # ---- what the router asks ---------------------------------------------------------------
    async def gate(self, store: Store) -> str | None:
        """None: route. Else the refusal's message (the store is lost). Raises
        ``StoreUnavailable`` when it cannot tell (the caller refuses as for any read fault)."""
        if store is not self._store:
            return None                         # (a store the runtime does not know: tests)
        if not self._settled:
            await self.check(store)
        return self.lost

    def saw(self, session: str, pin: pins.Pin | None, now: float, made: bool = False) -> None:
        if pin is not None:
            self.served.saw(session, pin.server, pins.expiry(pin), now, pin.since)
            self._made += made              # pins made since the last count (what a loss says it held)

    async def missed(self, store: Store, session: str, agent: str, now: float) -> str | None:
        """A pin read as absent: a loss (the message) or truly none (None). A loss is a pin
        this proxy served, or one the pin index still holds (any proxy made it); neither
        forgotten by the operator nor expired. Asked for every request whose pin is missing,
        whether it carries history or not: a subagent's request, or a Codex socket that
        reconnects (``history_initialization: new``), reads as an opening, and a truly new
        session has no index entry (nothing is invented)."""
        expected = self.served.expected(session, now)
        if expected is not None and self.served.forgotten(session, await store.get(pins.FORGOT_PREFIX + session)):
            expected = None
        if store is self._store:
            await self.check(store, fresh=True)     # a flushed store is seen by the request that meets it
        if self.lost:
            return self.lost
        if expected is not None and self.served.expected(session, now) is None:
            expected = None                 # the operator accepted the losses meanwhile
        how = "which this proxy served"
        if expected is None:
            found = await pins.index_entry(store, agent, session, now)
            if found is not None:
                expected, how = (found[0], found[1], 0.0), "which its pin index still holds"
            else:
                rec = await self._recorded(store, session, agent, now)
                if rec is None:
                    return None             # truly never pinned (or forgotten, or expired)
                expected = (rec.server, rec.expires, 0.0)
                how = f"which {rec.by or 'a proxy'} recorded lost in the store"
        if await store.get(pins.key(session)) is not None:
            return None                     # made meanwhile (another proxy's opening won the race): its pin decides
        server = expected[0] or "not routed"
        # the ways out for this conversation alone come first: the CLI finds a lost pin as the
        # proxy does (by the index or the record), so the operator need not decide every loss at once
        back = f"sessionpin move {session} {expected[0]}" if expected[0] else f"sessionpin move {session} --not-routed"
        message = (f"store {store.url} no longer has the pin of session {session} (pinned to {server}), {how}; "
                   f"no `sessionpin forget` of it is recorded and it had not expired. It is not taken for a new "
                   f"conversation: put it back (`{back}`) or let it be decided afresh (`sessionpin forget "
                   f"{session}`), restore the store (`sessionpin store copy BACKUP {store.url}`) or accept the "
                   f"loss (`sessionpin store accept-loss --store {store.url}`)")
        if self.served.report(session):
            self.partial += 1
            log.error("sessionpin: %s", message)
            try:
                await ident.record_partial(store, session, ident.PartialLoss(
                    expected[0], agent, expected[1] or 0.0, self.who, time.time()))
            except StoreError as e:
                log.warning("sessionpin: could not record the lost pin in %s: %s", store.url, e)
        return message

    async def _recorded(self, store: Store, session: str, agent: str, now: float) -> ident.PartialLoss | None:
        """The session's pin as a proxy recorded it lost in the store (``store:losses``), if
        that record still stands: of this agent, not expired, not forgotten by the operator
        since (a tombstone made after the record: the pin was restored, then forgotten)."""
        rec = await ident.partial_loss(store, session)
        if rec is None or (rec.agent and rec.agent != agent) or (rec.expires and rec.expires <= now):
            return None
        if pins.forgot_after(await store.get(pins.FORGOT_PREFIX + session), 0.0, rec.expires, rec.at):
            return None
        return rec

    # ---- looking at the store ---------------------------------------------------------------
    async def tick(self, store: Store) -> None:
        """The background loop's look (every round; it checks every CHECK_EVERY, and counts
        the pins every COUNT_EVERY right after a check found the store whole)."""
        now = time.monotonic()
        if store is not self._store or now - self._checked < CHECK_EVERY:
            return
        await self.check(store)
        if self.kind in ident.LOSSES or self._remembered is None or now - self._counted < COUNT_EVERY:
            return
        self._counted = now
        made, self._made = self._made, 0
        try:
            n = sum(c[0] for c in (await pins.counts(store, time.time())).values())
            # a count of a store emptied meanwhile is not what it held: only one whose
            # identity is still the one just checked is remembered
            still = (await ident.read(store))[1] == self._raw
        except BaseException:
            self._made += made
            raise
        if not still:
            self._made += made
            return
        r = self._remembered
        if n != r.pins or time.time() - r.seen >= 3600:
            await self._remember(msgspec.structs.replace(r, pins=n, seen=time.time()))

    async def check(self, store: Store, fresh: bool = False) -> None:
        """Judge the store now (``fresh``: read Redis' eviction count first, not the last
        ``watch``'s)."""
        async with self._lock:
            if store is not self._store:
                return
            self._checked = time.monotonic()
            if not self._settled:
                self._remembered = await asyncio.to_thread(self._memory.load)
            r = self._remembered
            if r is not None and self._made:
                r = msgspec.structs.replace(r, pins=r.pins + self._made)
            if fresh and hasattr(store, "evictions"):
                await store.evictions()     # a missing pin: what Redis evicted until now, not 2 s ago
            said = await ident.losses(store)    # what proxies recorded lost (read first: nothing is made over it)
            s = await ident.settle(store, store.url, r, time.time(), said)
            evicted = r.evicted if r is not None else {}
            if s.kind not in ident.LOSSES:
                grown, evicted, message = ident.judge_evictions(store.url, s.kind, r, s.identity,
                                                                getattr(store, "evicted", None), self._whole_at)
                if grown:                   # Redis evicted keys since: which, nobody can say
                    s = ident.Settled(ident.EVICTED, s.identity, s.raw, message)
            made = await ident.made(store)
            settled_made = self._settled_made(made)
            if ident.rolled_back(r, s.kind, s.identity, made):     # an older copy of itself
                s = ident.Settled(ident.ROLLED_BACK, s.identity, s.raw, ident.describe_rollback(store.url, r, made))
            recorded = False
            if s.kind not in ident.LOSSES:  # a loss another proxy recorded, still waiting for the operator
                pending = ident.pending_loss(said, s.identity, made)
                if pending is not None:
                    kind = pending[1].get("kind")
                    s = ident.Settled(kind if kind in ident.LOSSES else ident.LOST, s.identity, s.raw,
                                      ident.describe_recorded(store.url, *pending))
                    recorded = True
            accepted = s.identity.accepted if s.identity is not None and s.kind not in ident.LOSSES else None
            decided = s.kind == ident.ACCEPTED
            if self._settled and accepted is not None and self._accepted_at is not None \
                    and accepted > self._accepted_at:
                await self._accepted(store)  # the operator accepted the losses (accept-loss)
                decided = True
            if accepted is not None:
                self._accepted_at = accepted
            self._raw, self.kind = s.raw, s.kind
            self._settled = True
            if s.kind in ident.LOSSES:
                if self.lost != s.message:
                    log.error("sessionpin: %s", s.message)
                    try:
                        if not recorded:
                            await ident.record_loss(store, r, self.who, time.time(), s.kind, s.identity)
                    except StoreError as e:
                        log.warning("sessionpin: could not record the loss in %s: %s", store.url, e)
                self.lost = s.message
                return
            if self.lost is not None:
                log.warning("sessionpin: store %s: %s; routing resumes", store.url,
                            "the operator accepted its loss" if decided else "it is whole again")
            self.lost = None
            if s.kind == ident.NEW:
                log.info("sessionpin: store %s is new: its identity %s was made now", store.url, s.identity.id)
                await self._say_others(store)
            elif s.kind == ident.FIRST:
                log.warning("sessionpin: this machine has not used store %s before: it is taken as it is "
                            "(identity %s)", store.url, s.identity.id)
            self._whole_at = time.time()
            if s.kind != ident.OK or s.identity.accepted != self._remembered.accepted:
                # taken as it is, or under a new decision of the operator: its count of pins made
                # is remembered from now on (once settled)
                self._made_seen = [(time.monotonic(), made)]
                r = self._remembered
                if s.kind != ident.OK:
                    r = ident.Remembered(store.url, s.identity.id, 0, time.time(), evicted)
                    self._counted = 0.0     # count its pins at the next tick
                await self._remember(msgspec.structs.replace(r, evicted=evicted, made=0, accepted=s.identity.accepted))
            elif evicted != self._remembered.evicted or (settled_made or 0) > self._remembered.made:
                await self._remember(msgspec.structs.replace(
                    self._remembered, evicted=evicted, made=max(settled_made or 0, self._remembered.made)))

    async def _say_others(self, store: Store) -> None:
        """A new store, while this machine remembers another holding live pins: the likely
        mistake (a wrong ``db``, ``prefix`` or path; an environment without
        ``SESSIONPIN_STORE``) reads every conversation pinned there as never pinned — left
        alone here, sent where its agent addresses it. Said once, loudly, naming the other
        store (status ``store_info.identity.other_stores``); nobody can tell a mistake from
        a second setup, so the proxy routes on."""
        self.others = await asyncio.to_thread(ident.others, self._memory, time.time())
        if self.others:
            named = "; ".join(f"{r.store} ({r.pins} pins, seen whole {time.strftime('%Y-%m-%d %H:%M', time.localtime(r.seen))})"
                              for r in self.others[:3])
            log.warning("sessionpin: store %s is new, but this machine last used another store holding live pins: "
                        "%s. If this proxy should use that store, stop it and set sessionpin_store (or "
                        "SESSIONPIN_STORE) to it: here, every conversation pinned there is taken for one never seen "
                        "begin (left alone, sent where its agent addresses it) and new ones are pinned in %s",
                        store.url, named, store.url)

    def _settled_made(self, made: int) -> int | None:
        """The count of pins made to remember: the last one read at least ``MADE_SETTLE`` ago
        (None: none yet). Not the one read now: on a Redis without ``wait=``, or a write in
        flight when its primary died, a count may be read that the replica taking over never
        had (the pin not acknowledged); a rollback is a loss of what was there for longer."""
        now = time.monotonic()
        self._made_seen.append((now, made))
        old = [i for i, (t, _) in enumerate(self._made_seen) if t <= now - MADE_SETTLE]
        if not old:
            return None
        del self._made_seen[:old[-1]]
        return self._made_seen[0][1]

    async def _accepted(self, store: Store) -> None:
        """The store's identity changed by the operator's hand: the pins missing now are the
        losses accepted (forgotten here); the others are still watched."""
        sessions = self.served.sessions()
        for n in range(0, len(sessions), 500):
            batch = sessions[n:n + 500]
            for session, raw in zip(batch, await store.mget([pins.key(x) for x in batch])):
                if raw is None:
                    self.served.drop(session)

    async def _remember(self, r: ident.Remembered) -> None:
        self._remembered = r
        try:
            await asyncio.to_thread(self._memory.save, r)
        except OSError as e:
            log.warning("sessionpin: cannot write what this machine remembers of store %s (%s): %s",
                        r.store, self._memory.path, e.strerror or e)

    def describe(self) -> dict[str, Any]:
        r = self._remembered
        return {"identity": r.id if r else None, "verdict": self.kind, "lost": self.lost,
                "remembered_pins": r.pins if r else None, "evicted_keys_seen": r.evicted if r else None,
                "remembered_made": r.made if r else None,
                "served_pins": len(self.served),
                "served_bound": self.served.bound, "partial_losses": self.partial,
                "other_stores": [{"store": o.store, "pins": o.pins, "seen": o.seen} for o in self.others],
                "memory": str(self._memory.path) if self._memory and self._memory.path else None}

