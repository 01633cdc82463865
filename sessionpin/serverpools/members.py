"""Server pools in the store: the allocation transaction, members' quota and drain state, records.

``allocate.py`` decides (pure); this module reads what it decides on and writes what it
decided, like ``pins.py`` for single pins. Keys:

    alloc:cursor:<pool>        string  allocate.Cursor JSON; no TTL (one per pool)
    alloc:rec:<pool>:<ms>:<id> string  an activity record (JSON: ids, pool, member, time, rule); 30 days
    alloc:drained:<member>     string  when it was drained (epoch seconds); no TTL
    quota:<member>             string  quota.Quota JSON; TTL: its exhaustion + 10 minutes

Rules it keeps:
- One allocation is ONE durable ``apply``: checks the session's pin is still what was
  read and the cursor is still the text read; writes the pin, its index entries, the
  cursor's advance and the allocation's record (and a record of the pool's definition
  changing, when the cursor was last advanced under another revision). Either all of it
  is in the store, or none.
- A lost compare-and-set is read back: a pin another proxy wrote first decides
  (``Lost``); otherwise the cursor moved, and the allocation is made again from the new
  cursor — at most ``MAX_CONFLICTS`` times, then ``Refused`` (503, retry-after). A retry
  first waits a random moment (up to 2 ms per conflict so far, at most 20 ms), so proxies
  that keep colliding spread out instead of colliding again.
- When every eligible member is exhausted the allocation waits (``allocate.wait``) up
  to the caller's deadline, then ``Refused`` (429 "pool exhausted", retry-after: the
  earliest reset).
- A move is the same transaction over the old pin (its index entry is removed in the
  same ``apply``); the record says from where and why: a soft pool's miss, or (any pool)
  an opening asked again after its member ran out of quota, which never began there.
- "Active conversations" per member are the pin index's live members (one ``zcount``
  per agent that has pinned there), never a walk; only ``by_pool`` (a drain's count of a
  pool's own conversations on a member, for the CLI) walks the member's pins.
- Quota state and drains are shared by every proxy through the store; quota writes are
  ordinary (an observation lost costs one stale reading), drains durable; an answer to a
  request sent before the stored exhaustion was observed never shortens it (``write_quota``). A member's
  exhaustion is read clamped to ``max_reset`` after it was observed, whoever wrote it;
  ``reset`` forgets a member's state (the operator's ``sessionpin pools reset``).
- Records hold ids, names, times and rules — never content.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import msgspec

from . import allocate as A
from ..records import pins
from . import quota
from ..config.config import Config, Pool
from ..store.base import Check, Set, Store, Write, ZRem

CURSOR_PREFIX = "alloc:cursor:"
RECORD_PREFIX = "alloc:rec:"
DRAINED_PREFIX = "alloc:drained:"
QUOTA_PREFIX = "quota:"
RECORD_TTL = pins.PIN_TTL
MAX_CONFLICTS = 20
CONTENTION_RETRY = 1          # seconds, the retry-after of a refusal for contention
BACKOFF = 0.002               # seconds per conflict so far, the most a retry waits (jittered), up to:
BACKOFF_MAX = 0.02
MISSED_RETRY = 5              # seconds: a soft pool whose every member was missed (unreachable) may be back


class Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    t: float
    kind: str                   # allocation | move | config | drain | undrain | reset
    pool: str = ""
    member: str = ""
    session: str = ""
    agent: str = ""
    rule: str = ""              # the ladder's rule, or the policy's words
    why: str = ""
    rev: str = ""
    previous: str = ""          # move: the member it left; config: the revision before
    n: int = -1                 # allocation, move: the cursor position it took (orders them exactly)


_rec_enc = msgspec.json.Encoder()
_rec_dec = msgspec.json.Decoder(Record)


def cursor_key(pool: str) -> str:
    return CURSOR_PREFIX + pool


def quota_key(member: str) -> str:
    return QUOTA_PREFIX + member


def record_key(pool: str, t: float, ident: str) -> str:
    return f"{RECORD_PREFIX}{pool}:{int(t * 1000):015d}:{ident}"


def _record(r: Record, ident: str) -> Set:
    return Set(record_key(r.pool or "-", r.t, ident), _rec_enc.encode(r).decode(), RECORD_TTL)


# ---- outcomes ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Allocated:
    member: str
    loaded: pins.Loaded         # the pin now in force (ours); Loaded(None, None) when not committed
    why: str
    conflicts: int = 0          # allocations of others that went first (each cost this one a retry)


@dataclass(frozen=True)
class Lost:
    loaded: pins.Loaded         # another writer's pin, which decides


@dataclass(frozen=True)
class Refused:
    status: int                 # 429 exhausted, 503 contention or no member
    kind: str
    message: str
    retry_after: int | None


# ---- what the allocator decides on ---------------------------------------------------

async def active_counts(store: Store, members: tuple[str, ...] | list[str], now: float) -> dict[str, int]:
    """Live pins per member, over every agent: one ``zcount`` per (agent, member) index."""
    out = dict.fromkeys(members, 0)
    for name in await store.hgetall(pins.INDEX_NAMES):
        _, server = pins.split_group(name)
        if server in out:
            out[server] += await store.zcount(pins.INDEX_PREFIX + name, now, float("inf"))
    return out


async def by_pool(store: Store, member: str, now: float) -> dict[str, int]:
    """The live pins on ``member`` per pool that allocated them (``""``: pinned there by no
    pool — ``use AGENT MEMBER``, a move): what a drain of the member concerns, per pool.

    A walk of the member's index groups (``pins.listing``: paged, one batch in memory), for
    the CLI's ``drain``, never the proxy: a pin records its pool, the index does not."""
    out: dict[str, int] = {}
    names = await pins.groups(store, server=member, any_server=False)
    async for rows in pins.listing(store, now, names):
        for _, loaded, _ in rows:
            pool = loaded.pin.pool if loaded.pin is not None else ""
            out[pool] = out.get(pool, 0) + 1
    return out


def drained_key(member: str) -> str:
    return DRAINED_PREFIX + member


def _since(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return 0.0


async def drained(store: Store, members: tuple[str, ...] | list[str]) -> dict[str, float]:
    """The drained ones among ``members``, with when they were drained."""
    raws = await store.mget([drained_key(m) for m in members])
    return {m: t for m, raw in zip(members, raws) if (t := _since(raw)) is not None}


async def quotas(store: Store, members: tuple[str, ...] | list[str], now: float | None = None,
                 max_reset: float = quota.MAX_RESET) -> dict[str, quota.Quota]:
    """Members' quota states; with ``now``, each exhaustion clamped to ``max_reset`` after
    it was observed (``quota.clamped``); without, as stored (the operator's view)."""
    raws = await store.mget([quota_key(m) for m in members])
    got = ((m, quota.decode(raw)) for m, raw in zip(members, raws))
    return {m: q if now is None else quota.clamped(q, now, max_reset) for m, q in got if q is not None}


async def read_quota(store: Store, member: str, now: float, max_reset: float = quota.MAX_RESET) -> quota.Quota | None:
    """One member's quota state, its exhaustion clamped (``quota.clamped``)."""
    return quota.clamped(quota.decode(await store.get(quota_key(member))), now, max_reset)


async def reset(store: Store, member: str, now: float) -> bool:
    """Forget ``member``'s quota state (durable; every proxy reads it from the store at its
    next allocation or pinned turn); False when there was none. Recorded."""
    if not await store.delete(quota_key(member), durable=True):
        return False
    await store.set(*_record_args(Record(t=now, kind="reset", member=member), f"reset-{member}"))
    return True


async def state(store: Store, pool: Pool, now: float,
                max_reset: float = quota.MAX_RESET) -> tuple[str | None, dict[str, A.Health]]:
    """The cursor's text and each member's health: one ``mget`` (plus the index's counts
    for least-active). Exhaustions are clamped to ``max_reset`` (``quota.clamped``)."""
    ms = pool.members
    raws = await store.mget([cursor_key(pool.name), *(quota_key(m) for m in ms), *(drained_key(m) for m in ms)])
    q = [quota.clamped(quota.decode(r), now, max_reset) for r in raws[1:1 + len(ms)]]
    gone = raws[1 + len(ms):]
    active = await active_counts(store, ms, now) if pool.policy == A.LEAST_ACTIVE else {}
    return raws[0], {m: A.Health(active=active.get(m, 0), headroom=q[i].headroom if q[i] else None,
                                 exhausted_until=q[i].exhausted_until if q[i] else 0.0, drained=gone[i] is not None)
                     for i, m in enumerate(ms)}


# ---- the transaction --------------------------------------------------------------------

async def allocate(store: Store, config: Config, pool: Pool, session: str, pin: pins.Pin, seen: pins.Loaded, *,
                   exclude: frozenset[str] = frozenset(), commit: bool = True, deadline: float | None = None,
                   move_reason: str = "", max_reset: float = quota.MAX_RESET, clock: Callable[[], float] = time.time,
                   sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> Allocated | Lost | Refused:
    """Choose a member for ``session`` and pin it there (``commit``), in one ``apply``.

    ``pin`` is the pin to write, its server to be filled in; ``seen`` the pin as read
    (a move: the old pin, whose index entry goes). ``commit=False`` only chooses (a side
    request with no pin: where the opening is likely to go), writing nothing."""
    deadline = clock() if deadline is None else deadline
    conflicts = 0
    while True:
        now = clock()
        raw, health = await state(store, pool, now, max_reset)
        cursor = A.decode_cursor(raw)
        got = A.choose(pool, cursor, health, now, exclude)
        if isinstance(got, A.Exhausted):
            pause = A.wait(got, now, deadline)
            if pause is None:
                return Refused(429, "pool-exhausted", (
                    f"sessionpin: every member of pool {pool.name} is out of quota ({', '.join(got.members)}) "
                    f"until {time.strftime('%H:%M:%S', time.localtime(got.until))}; the new {pin.agent} "
                    f"conversation {session} was not sent anywhere. Retry then, or add a member to the pool."),
                    A.retry_after(got.until, now))
            await sleep(pause)
            continue
        if isinstance(got, A.NoMember):
            return Refused(503, "pool-no-member", f"sessionpin: {got.why}; the {pin.agent} conversation {session} "
                           f"was not sent anywhere. `sessionpin undrain MEMBER` or check the members "
                           f"(`sessionpin pools`).", MISSED_RETRY if exclude else None)
        moved = seen.pin is not None and seen.pin.server is not None
        why = (f"{pool.affinity}: {seen.pin.server} {move_reason or 'missed'} → {got.member}"
               if moved and seen.pin else got.why)
        if not commit:
            return Allocated(got.member, pins.Loaded(None, None), why)
        server = config.servers[got.member]
        new = msgspec.structs.replace(pin, server=got.member, pool=pool.name, models=server.models, why=why,
                                      at=server.origin)
        text = pins.encode(new)
        writes: list[Write] = [Set(pins.key(session), text, pins.PIN_TTL), *pins.index_writes(session, new),
                               Set(cursor_key(pool.name), A.encode_cursor(got.cursor))]
        if moved and seen.pin is not None and (seen.pin.agent, seen.pin.server) != (new.agent, new.server):
            writes.append(ZRem(pins.index_key(seen.pin.agent, seen.pin.server), session))
        writes.append(_record(Record(t=now, kind="move" if moved else "allocation", pool=pool.name,
                                     member=got.member, session=session, agent=pin.agent, rule=pin.rule, why=why,
                                     rev=pool.revision, previous=seen.pin.server if moved and seen.pin else "",
                                     n=got.cursor.n - 1),
                              session))
        if cursor.rev != pool.revision:
            writes.append(_record(Record(t=now, kind="config", pool=pool.name, rev=pool.revision,
                                         previous=cursor.rev,
                                         why=f"{pool.policy}, {pool.affinity}: {', '.join(pool.members)}"),
                                  f"config-{pool.revision}"))
        if await store.apply([Check(pins.key(session), seen.raw), Check(cursor_key(pool.name), raw)], writes,
                             durable=True):
            return Allocated(got.member, pins.Loaded(new, text), why, conflicts)
        now_pin = await pins.load(store, session)
        if now_pin.raw != seen.raw:
            if now_pin.pin is not None:
                return Lost(now_pin)
            seen = now_pin            # garbage (or it vanished): allocate over it
            continue
        conflicts += 1                # the cursor moved: another allocation went first
        if conflicts < MAX_CONFLICTS:
            await sleep(random.uniform(0, min(BACKOFF * conflicts, BACKOFF_MAX)))
        else:
            return Refused(503, "pool-contention", (
                f"sessionpin: pool {pool.name} was allocated by others {conflicts} times while this "
                f"{pin.agent} conversation {session} waited for its turn; it was not sent anywhere. Retry."),
                CONTENTION_RETRY)


# ---- quota, drains, records ---------------------------------------------------------------

async def write_quota(store: Store, member: str, q: quota.Quota, sent: float | None = None) -> bool:
    """Store ``q``, the answer to a request sent at ``sent``: unless the state stored now is
    a later exhaustion it would shorten (``quota.supersedes``), compare-and-set on the text
    read, so two proxies' answers cannot land in the wrong order. False: not written."""
    key = quota_key(member)
    if sent is None:
        return bool(await store.set(key, quota.encode(q), quota.ttl(q, q.observed)))
    for _ in range(3):
        raw = await store.get(key)
        if not quota.supersedes(q, sent, quota.decode(raw)):
            return False
        if await store.apply([Check(key, raw)], [Set(key, quota.encode(q), quota.ttl(q, q.observed))]):
            return True
    return False        # the state keeps changing under it: others' newer answers hold


async def drain(store: Store, member: str, now: float) -> bool:
    """Drain ``member`` (durable); False when it already was."""
    if not await store.set(drained_key(member), repr(now), nx=True, durable=True):
        return False
    await store.set(*_record_args(Record(t=now, kind="drain", member=member), f"drain-{member}"))
    return True


async def undrain(store: Store, member: str, now: float) -> bool:
    if not await store.delete(drained_key(member), durable=True):
        return False
    await store.set(*_record_args(Record(t=now, kind="undrain", member=member), f"undrain-{member}"))
    return True


def _record_args(r: Record, ident: str) -> tuple[str, str, float]:
    s = _record(r, ident)
    return s.key, s.value, RECORD_TTL


async def history(store: Store, pool: str | None = None, limit: int = 50) -> list[Record]:
    """The newest ``limit`` records (of ``pool``, with the operator's drains), oldest first.
    A walk of the record keys: for the CLI, never the request path."""
    keys = await store.keys(RECORD_PREFIX)
    if pool is not None:
        keys = [k for k in keys if k.startswith(f"{RECORD_PREFIX}{pool}:") or k.startswith(f"{RECORD_PREFIX}-:")]
    keys.sort(key=lambda k: (k[len(RECORD_PREFIX):].split(":", 2)[1:2], k))
    keys = keys[-limit:] if limit else keys
    out = []
    for raw in await store.mget(keys) if keys else []:
        if raw:
            try:
                out.append(_rec_dec.decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
    return out


async def cursor(store: Store, pool: str) -> A.Cursor:
    return A.decode_cursor(await store.get(cursor_key(pool)))
