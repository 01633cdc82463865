"""Pins: which server a session's requests go to, kept in the store.

Rules this module keeps (seeds/000, made stronger):
- One pin per session, under ``pin:<session>``; it records the agent that made it, so a
  pin of another agent is neither followed nor overwritten by the router.
- ``server`` None means "not routed": the session's requests are left alone.
- A pin lives 30 days from its last renewal and is renewed at most once a day, so a
  busy session does not write the store on every request.
- Every change is a compare-and-set against the text that was read (``Loaded.raw``):
  a new pin is written only if the key is absent (two proxies racing: the first pin
  wins, the second reads it back); renewal, move and forget only if the pin is still
  the one read — an operator's ``move`` committed meanwhile is never undone.
- New pins, moves and forgets are durable (the store raises ``NotDurable`` otherwise);
  renewals are not (a lost renewal costs a day of TTL, never a pin).
- The index: each pin's session is also a member of ``pinidx:<agent>:<server>`` (``-``
  for not routed) scored by the pin's expiry, written in the same ``apply``; ``pinidx``
  (a hash) names every index. Counting live pins per agent and server is one ``zcount``
  each — status, metrics and the CLI's "N stay where they are" never walk the pins.
- A pin whose index entry is live but whose key is gone was lost (``indexed``): the proxy
  refuses it rather than take it for a conversation never seen begin; ``drop_lost`` is the
  operator's acceptance of such losses.
- Every durable change of a pin (create, move, forget, a pool's allocation) also counts one
  in the store's pins made (``identity.MADE_KEY``, in the same ``apply``): a store rolled
  back to an older copy counts fewer than a machine saw (``identity.rolled_back``).
- ``forget`` leaves a tombstone (``forgot:<session>``, as long as a pin lives): when, and
  the pin it forgot (its ``since`` and expiry as read), so a proxy that served the pin tells
  the operator's decision from a loss (``served``, ``forgot_after``) by comparing pins, not
  clocks: the operator's machine may run behind the proxy's, or the clock step back between.
- A pin records where its server was (``at``, the origin): a server name re-pointed to
  another host since is not the server the conversation began on (``ladder.moved``).
- A stored value that is not a valid pin (bad JSON, wrong shape, no agent) reads as no pin.
- A pool's allocation adds ``pool``, ``models`` and ``why`` (defaults omitted, so other pins
  read and write as before; unknown fields are ignored by older readers).
- Activity (last seen, requests seen) is not part of the pin: it changes on every
  request, so the router counts it in memory and flushes it lazily (``record_seen``).
"""

from __future__ import annotations

import heapq
import time
from typing import AsyncIterator, Callable, Sequence

import msgspec

from ..store.base import Check, Delete, Expire, HIncr, HSet, Set, Store, Write, ZAdd, ZRem
from ..store.identity import made_writes

PIN_PREFIX = "pin:"
SEEN_PREFIX = "seen:"
INDEX_PREFIX = "pinidx:"
INDEX_NAMES = "pinidx"          # hash: "<agent>:<server or ->" -> "1"
ACTIVE_PREFIX = "active:"       # sorted set per agent and server: session -> last seen
FORGOT_PREFIX = "forgot:"       # the operator forgot this session's pin (when, which pin): not a loss
NOT_ROUTED = "-"
DAY = 86_400.0
PIN_TTL = 30 * DAY
RENEW_AFTER = DAY
SEEN_BATCH = 500                # sessions per activity write (one transaction, bounded)


class Pin(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    agent: str
    server: str | None          # None: not routed
    since: float                # when the pin was made (epoch seconds)
    renewed: float              # when its TTL was last renewed
    rule: str = ""              # the ladder rule that made it (or "operator")
    turn: str = ""              # the turn that made it
    source: str = ""            # the configured server the request that made it addressed ("" none)
    parent: str = ""            # the conversation this one forked or resumed under a new id ("" none)
    # Where ``server`` was when the pin was made (its origin, ``Server.origin``): a pin names a
    # server, and the name may be re-pointed to another host while the conversation runs
    # (``ladder.moved``). "" — not routed, or a pin made before this field — is not compared.
    at: str = ""
    v: int = 1
    # A pin made by a server pool's allocation (docs/serverpools.md) snapshots the concrete
    # member: ``server`` is the member, ``models`` its model map then (None: not a
    # snapshot; the server's current map applies), ``why`` the allocation's reason.
    pool: str = ""
    models: tuple[tuple[str, str], ...] | None = None
    why: str = ""


class Loaded(msgspec.Struct, frozen=True):
    """A pin as read, with the exact text it was read from (what compare-and-set compares)."""
    pin: Pin | None
    raw: str | None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Pin)


def key(session: str) -> str:
    return PIN_PREFIX + session


def group(agent: str, server: str | None) -> str:
    """The index group of a pin: ``<agent>:<server>`` (server names hold no colon)."""
    return f"{agent}:{server or NOT_ROUTED}"


def split_group(name: str) -> tuple[str, str | None]:
    agent, _, server = name.partition(":")
    return agent, (None if server == NOT_ROUTED else server)


def index_key(agent: str, server: str | None) -> str:
    return INDEX_PREFIX + group(agent, server)


def active_key(agent: str, server: str | None) -> str:
    return ACTIVE_PREFIX + group(agent, server)


def encode(pin: Pin) -> str:
    return _encoder.encode(pin).decode()


def decode(text: str | None) -> Pin | None:
    if not text:
        return None
    try:
        pin = _decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not pin.agent:
        return None
    return pin


def expiry(pin: Pin) -> float:
    return pin.renewed + PIN_TTL


async def load(store: Store, session: str) -> Loaded:
    """The session's pin. A store fault raises (``StoreUnavailable``): never "no pin"."""
    raw = await store.get(key(session))
    return Loaded(decode(raw), raw)


def _indexed(session: str, pin: Pin) -> list[Write]:
    return [ZAdd(index_key(pin.agent, pin.server), session, expiry(pin)),
            HSet(INDEX_NAMES, group(pin.agent, pin.server), "1")]


def index_writes(session: str, pin: Pin) -> list[Write]:
    """The index entries of a new pin, and its count in the pins made (``made_writes``), for
    a caller writing it in a durable transaction of its own (a pool's allocation)."""
    return [*_indexed(session, pin), *made_writes()]


def _unindexed(session: str, pin: Pin | None) -> list[Write]:
    return [] if pin is None else [ZRem(index_key(pin.agent, pin.server), session)]


async def create(store: Store, session: str, pin: Pin, seen: Loaded | None = None) -> Loaded:
    """Write a new pin durably unless one is there; return the pin now in force.

    ``seen`` is what the caller read (default: absent). A value that is not a valid pin
    reads as no pin, so it is replaced — by compare-and-set on its text. Raises
    ``NotDurable`` when the pin cannot be made durable (then nothing was written)."""
    expected = seen.raw if seen is not None else None
    for _ in range(3):
        text = encode(pin)
        writes = [Set(key(session), text, PIN_TTL), *_indexed(session, pin), *made_writes()]
        if await store.apply([Check(key(session), expected)], writes, durable=True):
            return Loaded(pin, text)
        now = await load(store, session)
        if now.pin is not None:
            return now               # another writer won: its pin decides
        expected = now.raw           # garbage (or it vanished): try once more over it
    return await load(store, session)


class Tombstone(msgspec.Struct, frozen=True, omit_defaults=True):
    """What ``forget`` leaves: when (the forgetting machine's clock), and the pin it forgot —
    its ``since`` (0: not known, a lost pin forgotten as the index named it) and its expiry."""
    at: float
    since: float = 0.0
    expires: float = 0.0


_tomb_encoder = msgspec.json.Encoder()
_tomb_decoder = msgspec.json.Decoder(Tombstone)


def tombstone(raw: str) -> Tombstone | None:
    """A tombstone as written; an older one is its time alone (``repr(when)``); None: one
    that cannot be read (the caller takes it for the operator's, to be safe)."""
    try:
        return Tombstone(at=float(raw))
    except ValueError:
        pass
    try:
        return _tomb_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def forgot_after(raw: str | None, since: float, expires: float, at: float) -> bool:
    """Did the operator's ``forget`` (tombstone ``raw``) come after the pin known as
    (``since``, ``expires``: 0 when not known), seen or recorded at ``at``? By the pins when
    both name one — the same pin or a later one was forgotten (a pin made after a forget has a
    later ``since``, and a later expiry) — and by the clocks only for a tombstone that names
    none (written before it did). Clocks of two machines, or one stepped back, would take the
    operator's decision for a loss. An unreadable tombstone is the operator's."""
    if raw is None:
        return False
    t = tombstone(raw)
    if t is None:
        return True
    if t.since and since:
        return t.since >= since
    if t.expires and expires:
        return t.expires >= expires
    return t.at >= at


def renew_due(pin: Pin, now: float) -> bool:
    return now - pin.renewed >= RENEW_AFTER


async def renew(store: Store, session: str, seen: Loaded, now: float) -> bool:
    """Renew the pin that was read, only if it is still that pin (compare-and-set)."""
    if seen.pin is None or seen.raw is None:
        return False
    fresh = msgspec.structs.replace(seen.pin, renewed=now)
    writes = [Set(key(session), encode(fresh), PIN_TTL), *_indexed(session, fresh)]
    return await store.apply([Check(key(session), seen.raw)], writes)


async def move(store: Store, session: str, seen: Loaded, new: Pin) -> bool:
    """The operator's explicit move (or a first pin): durable, only over the pin that was read."""
    writes = [Set(key(session), encode(new), PIN_TTL), *_unindexed(session, seen.pin), *_indexed(session, new),
              *made_writes()]
    return await store.apply([Check(key(session), seen.raw)], writes, durable=True)


async def forget(store: Store, session: str, seen: Loaded, now: float | None = None) -> bool:
    """Delete the pin that was read (durable), with its index entry and its activity; a
    tombstone says when (a proxy that served the pin does not take it for a loss)."""
    if seen.raw is None and seen.pin is None:
        return False                # nothing read: nothing to forget
    # (``seen.raw`` None with a pin: a lost pin, as the index or a proxy's record names it
    # (``lost``) — forgotten only while its key is still absent, so the proxies that refuse
    # it decide it afresh by the tombstone)
    when = time.time() if now is None else now
    tomb = Tombstone(at=when, since=seen.pin.since if seen.pin else 0.0, expires=expiry(seen.pin) if seen.pin else 0.0)
    writes: list[Write] = [Delete(key(session)), *_unindexed(session, seen.pin), Delete(SEEN_PREFIX + session),
                           Set(FORGOT_PREFIX + session, _tomb_encoder.encode(tomb).decode(), PIN_TTL),
                           *made_writes()]
    if seen.pin is not None:
        writes.append(ZRem(active_key(seen.pin.agent, seen.pin.server), session))
    return await store.apply([Check(key(session), seen.raw)], writes, durable=True)


async def index_entry(store: Store, agent: str, session: str, now: float) -> tuple[str | None, float] | None:
    """(server, expiry) of the live pin the index says ``session`` of ``agent`` has — the
    index entry is written with the pin and removed by ``forget``, so an entry whose pin is
    missing is a pin lost (issue 18). None: the index knows no live pin of it."""
    for name in sorted(await store.hgetall(INDEX_NAMES)):
        a, server = split_group(name)
        if a != agent:
            continue
        score = await store.zscore(INDEX_PREFIX + name, session)
        if score is not None and score > now:
            return server, score
    return None


async def drop_lost(store: Store, now: float, batch: int = 500) -> int:
    """Remove the index entries whose pins are gone (the operator accepted their loss: their
    conversations are decided afresh). A walk of the index: for the CLI, never the proxy."""
    dropped = 0
    for name in sorted(await store.hgetall(INDEX_NAMES)):
        members = [m for m, _ in await store.zrange(INDEX_PREFIX + name, now, float("inf"))]
        for i in range(0, len(members), batch):
            chunk = members[i:i + batch]
            for session, raw in zip(chunk, await store.mget([key(s) for s in chunk])):
                if raw is None and await store.zrem(INDEX_PREFIX + name, session):
                    dropped += 1
    return dropped


async def lost(store: Store, now: float, names: Sequence[str], batch: int = 500,
               keep: Callable[[str], bool] | None = None) -> list[tuple[str, str, str | None, float]]:
    """(session, agent, server, expiry) of each live entry of the index groups ``names``
    whose pin is gone: what a proxy refuses as lost (``index_entry``), as the CLI lists it
    and lets the operator decide one by one (``keep``: only the sessions it keeps, chosen
    before any pin is read). A walk: for the CLI, never the proxy."""
    out = []
    for name in names:
        agent, server = split_group(name)
        members = await store.zrange(INDEX_PREFIX + name, now, float("inf"))
        if keep is not None:
            members = [m for m in members if keep(m[0])]
        for i in range(0, len(members), batch):
            chunk = members[i:i + batch]
            for (session, score), raw in zip(chunk, await store.mget([key(s) for s, _ in chunk])):
                if raw is None:
                    out.append((session, agent, server, score))
    return out


async def reindex(store: Store, batch: int = 500) -> int:
    """Put every live pin's index entry back (after a ``store copy``, whose sorted sets
    arrive whole: the destination's index would lose the entries of its own pins, and
    with them a lost pin's only trace). A walk: for the CLI, never the proxy. Returns the
    pins indexed."""
    writes: list[Write] = []
    n = 0
    async for session, pin in sessions(store, batch):
        writes += _indexed(session, pin)
        n += 1
        if len(writes) >= 2 * batch:
            await store.apply([], writes)
            writes = []
    if writes:
        await store.apply([], writes)
    return n


async def sessions(store: Store, batch: int = 500) -> AsyncIterator[tuple[str, Pin]]:
    """Every valid pin in the store, as (session, pin). A walk: for the CLI, never the proxy."""
    names = await store.keys(PIN_PREFIX)
    for i in range(0, len(names), batch):
        chunk = names[i:i + batch]
        for k, raw in zip(chunk, await store.mget(chunk)):
            pin = decode(raw)
            if pin is not None:
                yield k[len(PIN_PREFIX):], pin


async def groups(store: Store, agent: str | None = None, server: str | None = None, *,
                 any_server: bool = True) -> list[str]:
    """The index groups (``<agent>:<server>``) that hold the pins of ``agent`` (None: any)
    and ``server`` (``any_server`` True: any; else that one, None meaning not routed)."""
    out = []
    for name in sorted(await store.hgetall(INDEX_NAMES)):
        a, srv = split_group(name)
        if (agent is None or a == agent) and (any_server or srv == server):
            out.append(name)
    return out


async def indexed(store: Store, now: float, names: Sequence[str]) -> int:
    """How many live pins the index groups ``names`` hold (one ``zcount`` each): what
    ``listing`` of them walks, counted before walking."""
    return sum([await store.zcount(INDEX_PREFIX + n, now, float("inf")) for n in names])


class _Walk:
    """One index group walked newest expiry first, a page at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.page: list[tuple[str, float]] = []
        self.at = 0
        self.after: tuple[str, float] | None = None
        self.done = False

    async def head(self, store: Store, now: float, batch: int) -> tuple[str, float] | None:
        if self.at == len(self.page) and not self.done:
            self.page = await store.zpage(INDEX_PREFIX + self.name, now, float("inf"), self.after, batch,
                                          reverse=True)
            self.at = 0
            self.done = len(self.page) < batch
            if self.page:
                self.after = self.page[-1]
        return self.page[self.at] if self.at < len(self.page) else None


async def listing(store: Store, now: float, names: Sequence[str], batch: int = 1000
                  ) -> AsyncIterator[list[tuple[str, Loaded, "Seen"]]]:
    """The live pins of the index groups ``names`` with their activity, a batch at a time,
    the most recently renewed first across the groups: (session, pin as read, seen).

    A walk for the CLI, never the proxy: three store calls per batch (a page of each group's
    index as it empties, the pins, the activity records), memory for one batch per group
    whatever the store holds. Only what the index names is listed — what ``counts`` counts;
    an index member whose pin is gone, garbage, or now in another group is skipped (a pin
    moved while the walk runs may be listed in neither group or in both)."""
    walks = [_Walk(n) for n in names]
    heap: list[tuple[float, str, int]] = []
    for i, w in enumerate(walks):
        h = await w.head(store, now, batch)
        if h is not None:
            heap.append((-h[1], h[0], i))
    heapq.heapify(heap)
    while heap:
        picked: list[tuple[str, str]] = []
        while heap and len(picked) < batch:
            _, member, i = heap[0]
            w = walks[i]
            picked.append((w.name, member))
            w.at += 1
            h = await w.head(store, now, batch)
            if h is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (-h[1], h[0], i))
        raws = await store.mget([key(m) for _, m in picked])
        seens = await store.hgetall_many([SEEN_PREFIX + m for _, m in picked])
        rows = []
        for (name, session), raw, h in zip(picked, raws, seens):
            pin = decode(raw)
            if pin is not None and group(pin.agent, pin.server) == name:
                rows.append((session, Loaded(pin, raw), seen_of(h)))
        yield rows


async def counts(store: Store, now: float, active_since: float | None = None
                 ) -> dict[tuple[str, str | None], tuple[int, int]]:
    """Live pins per (agent, server) (server None: not routed) and how many of them were
    seen since ``active_since``: one ``zcount`` per index."""
    out: dict[tuple[str, str | None], tuple[int, int]] = {}
    for name in sorted(await store.hgetall(INDEX_NAMES)):
        n = await store.zcount(INDEX_PREFIX + name, now, float("inf"))
        active = 0
        if active_since is not None:
            active = await store.zcount(ACTIVE_PREFIX + name, active_since, float("inf"))
        if n or active:
            out[split_group(name)] = (n, active)
    return out


def by_server(counts: dict[tuple[str, str | None], tuple[int, int]]) -> dict[str | None, tuple[int, int]]:
    """``counts`` summed over agents."""
    out: dict[str | None, tuple[int, int]] = {}
    for (_, server), (n, active) in counts.items():
        a, b = out.get(server, (0, 0))
        out[server] = (a + n, b + active)
    return out


async def sweep_index(store: Store, now: float) -> int:
    """Drop expired index and activity members (the pins themselves expire by TTL)."""
    dropped = 0
    for name in await store.hgetall(INDEX_NAMES):
        dropped += await store.zremrange(INDEX_PREFIX + name, float("-inf"), now)
        dropped += await store.zremrange(ACTIVE_PREFIX + name, float("-inf"), now - PIN_TTL)
    return dropped


class Seen(msgspec.Struct, frozen=True):
    last: float = 0.0
    requests: int = 0


async def seen(store: Store, session: str) -> Seen:
    return seen_of(await store.hgetall(SEEN_PREFIX + session))


def seen_of(h: dict[str, str]) -> Seen:
    """A session's activity from its record (``seen:<session>`` as read)."""
    try:
        return Seen(float(h.get("last", 0) or 0), int(h.get("requests", 0) or 0))
    except ValueError:
        return Seen()


async def record_seen(store: Store, activity: Sequence[tuple[str, str, str | None, float, int]]) -> None:
    """Flush activity counted in memory: (session, agent, pinned server, last seen, requests).
    Non-durable writes, TTL as a pin's. One read (each record's last seen: another proxy's
    may be later, and is kept) and one ``apply`` per ``SEEN_BATCH`` sessions, not a store
    call per field: a flush every half second of a few hundred sessions was the writer
    thread's busiest work."""
    for i in range(0, len(activity), SEEN_BATCH):
        batch = activity[i:i + SEEN_BATCH]
        had = await store.hgetall_many([SEEN_PREFIX + a[0] for a in batch])
        writes: list[Write] = []
        for (session, agent, server, last, requests), h in zip(batch, had):
            k = SEEN_PREFIX + session
            writes.append(HIncr(k, "requests", requests))
            if seen_of(h).last < last:
                writes.append(HSet(k, "last", repr(last)))
            writes += [Expire(k, PIN_TTL), ZAdd(active_key(agent, server), session, last)]
        await store.apply([], writes)
