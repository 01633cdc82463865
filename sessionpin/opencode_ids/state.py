"""The pool's state in the store: spares, bindings, id records (seeds/002 §3, §4, §6).

Every function here is a transition over the async ``Store`` with the time passed in
(epoch milliseconds); no network, no clock. Layout (ids, provider and model names only;
no secret, no URL, no content ever):

    pool:spare:<provider>:<model>  hash    id -> Spare json           verified, unowned ids
    pool:bind:<conversation>::<provider>::<model>
                                   string  Binding json               one conversation's id
    pool:id:<id>                   string  the binding key it was bound to, while bound;
                                           "retired:<ms>" (expires after KEEP_RETIRED_S)

Invariants, and how they hold across processes sharing one store:
1. spares hold only unowned ids: an id leaves its spare hash by ``hdel`` *before* it is
   bound or probed, and ``hdel`` returning True is the atomic claim, so exactly one
   process owns a claimed id; new spares are fresh random UUIDs; ``add_spare`` writes
   only an id with no id record (never bound, not retired) — one ``apply``.
2. a bound id is never a spare: an id is written back to spares only by the process that
   claimed it and only when it did not bind it; a spare that a crash brought back (its
   claim lost, its durable binding kept) is dropped by ``prune``.
3. an id is never handed to a second conversation and retired ids never return:
   ``bind`` writes the binding and the id record in one ``apply`` that checks both are
   absent; ``retire`` deletes the binding and marks the id retired in one ``apply`` that
   checks the binding is still the one read; every later change of a binding is a
   compare-and-set on the text it read, so it cannot resurrect a retired binding.

Durability: a new binding is durable (a conversation keeps its id across a crash), and
counts one pin made (``identity.made_writes``, in the same ``apply``), as every pin
creation does: a store put back as an older copy of itself counts fewer and is refused as
rolled back (docs/store.md), rather than its bindings made since read as never made — their
ids, spares again in the old copy, would go to other conversations.
Retirement and updates need not be: tombstone and deletion are one ``apply``, so a lost
retirement brings back the binding as it was, and prune or the next observation retires
it again. Observation's retirements ask for durability anyway (a slow id should not
come back); prune's do not (up to ``max_bindings`` writes with no fsync each).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable

import msgspec

from ..store.base import Check, Delete, HSet, Set, Store, WrongType
from ..store.identity import made_writes

SPARE_PREFIX = "pool:spare:"
BIND_PREFIX = "pool:bind:"
ID_PREFIX = "pool:id:"
RETIRED = "retired:"
SEP = "::"
# A retired id's record only guards against a late write racing its retirement.
KEEP_RETIRED_S = 3600.0
# The layout of the synchronous pool (two hashes); ``prune`` moves what it finds.
LEGACY_BINDINGS = "pool:bind"
LEGACY_RETIRED = "pool:retired"
_TRIES = 3   # compare-and-set attempts against concurrent writers before giving up


class Spare(msgspec.Struct, frozen=True, kw_only=True):
    upstream_ms: int
    verified_at: int
    created_at: int
    source: str = "upstream"        # how upstream_ms was measured: upstream | wall


class Binding(msgspec.Struct, frozen=True, kw_only=True):
    routed_id: str
    provider: str
    model: str
    bound_at: int
    last_seen_at: int
    upstream_ms: int | None = None
    verified_at: int | None = None
    failures: int = 0
    origin: str = ""                # spare | probe | fresh | stale  (how the id was obtained)


_enc = msgspec.json.Encoder()
_spare_dec = msgspec.json.Decoder(Spare)
_binding_dec = msgspec.json.Decoder(Binding)


def new_id() -> str:
    return str(uuid.uuid4())


def spare_key(provider: str, model: str) -> str:
    return f"{SPARE_PREFIX}{provider}:{model}"


def binding_key(conversation: str, provider: str, model: str) -> str:
    return f"{conversation}{SEP}{provider}{SEP}{model}"


def bind_key(key: str) -> str:
    return BIND_PREFIX + key


def id_key(sid: str) -> str:
    return ID_PREFIX + sid


def split_spare_key(key: str) -> tuple[str, str] | None:
    if not key.startswith(SPARE_PREFIX):
        return None
    provider, _, model = key[len(SPARE_PREFIX):].partition(":")
    return (provider, model) if provider and model else None


def encode(record: Spare | Binding) -> str:
    return _enc.encode(record).decode()


def decode_spare(text: str | None) -> Spare | None:
    try:
        return _spare_dec.decode(text) if text else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_binding(text: str | None) -> Binding | None:
    try:
        return _binding_dec.decode(text) if text else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


# ---- spares ----------------------------------------------------------------------------

async def spares(store: Store, provider: str, model: str, *, drop_bad: bool = True) -> dict[str, Spare]:
    """Valid spares of one provider+model (an unreadable one is dropped on sight, unless read-only)."""
    key = spare_key(provider, model)
    out = {}
    for sid, text in (await store.hgetall(key)).items():
        s = decode_spare(text)
        if s is not None:
            out[sid] = s
        elif drop_bad:
            await store.hdel(key, sid)
    return out


def is_fresh(spare: Spare, now: int, ttl_ms: int) -> bool:
    return now - spare.verified_at <= ttl_ms


def ranked(pool: dict[str, Spare], now: int, ttl_ms: int, *, fresh: bool) -> list[tuple[str, Spare]]:
    """Fresh (or stale) spares, best first: lowest upstream ms, then most recently verified."""
    picked = [(i, s) for i, s in pool.items() if is_fresh(s, now, ttl_ms) == fresh]
    return sorted(picked, key=lambda p: (p[1].upstream_ms, -p[1].verified_at, p[0]))


async def add_spare(store: Store, provider: str, model: str, sid: str, spare: Spare) -> bool:
    """Put a verified id among the spares unless it was ever bound or retired (atomically)."""
    return await store.apply([Check(id_key(sid), None)], [HSet(spare_key(provider, model), sid, encode(spare))])


async def claim(store: Store, provider: str, model: str, sid: str) -> bool:
    """Atomically remove a spare; True means this caller alone now owns the id."""
    return await store.hdel(spare_key(provider, model), sid)


# ---- bindings --------------------------------------------------------------------------

async def _read(store: Store, key: str) -> tuple[str | None, Binding | None]:
    raw = await store.get(bind_key(key))
    return raw, decode_binding(raw)


async def binding(store: Store, key: str) -> Binding | None:
    return (await _read(store, key))[1]


async def bindings(store: Store, *, drop_bad: bool = True) -> dict[str, Binding]:
    """Every readable binding by key (an unreadable one is dropped on sight, unless read-only)."""
    keys = await store.keys(BIND_PREFIX)
    out = {}
    for k, raw in zip(keys, await store.mget(keys) if keys else []):
        b = decode_binding(raw)
        if b is not None:
            out[k[len(BIND_PREFIX):]] = b
        elif drop_bad and raw is not None:
            await store.cas(k, raw, None)
    return out


def alive(b: Binding, now: int, lease_ttl_ms: int, quarantine_failures: int) -> bool:
    return now - b.last_seen_at <= lease_ttl_ms and b.failures < quarantine_failures


async def bind(store: Store, key: str, b: Binding) -> Binding | None:
    """Bind ``b.routed_id`` to ``key`` unless the key is bound; return the binding now in force.

    The caller owns ``b.routed_id`` (claimed or freshly generated). If another process
    bound the key first, its binding wins and the caller keeps its id (to put back).
    None: the key is unbound and our id cannot be bound — it was bound or retired before
    (a spare a crash brought back); the caller drops it."""
    for _ in range(_TRIES):
        raw, existing = await _read(store, key)
        if existing is not None:
            return existing
        # ``raw`` may be an unreadable value: it reads as no binding and is replaced.
        if await store.apply([Check(bind_key(key), raw), Check(id_key(b.routed_id), None)],
                             [Set(bind_key(key), encode(b)), Set(id_key(b.routed_id), key), *made_writes()],
                             durable=True):
            return b
        if await store.get(id_key(b.routed_id)) is not None:
            return await binding(store, key)
    return await binding(store, key)


class BindingLost(Exception):
    """A binding this proxy routed is gone from the store, and nothing says it was retired."""

    def __init__(self, key: str, routed_id: str, record: str | None) -> None:
        super().__init__(key, routed_id, record)
        self.key, self.routed_id, self.record = key, routed_id, record


async def witness(store: Store, key: str, routed_id: str, *, recent: bool) -> None:
    """The binding of ``key`` is missing, and this proxy routed ``routed_id`` for it: raise
    ``BindingLost`` unless the id's record says it was retired. The record still naming the key
    is a binding deleted (a cleanup, a partial loss); no record at all, when the proxy routed it
    within ``KEEP_RETIRED_S`` (``recent``), is both deleted — a retirement since would have left
    its tombstone. An older one may have been retired and its tombstone expired: not a loss."""
    record = await store.get(id_key(routed_id))
    if record == key or (record is None and recent):
        raise BindingLost(key, routed_id, record)


async def change(store: Store, key: str, routed_id: str, fn: Callable[[Binding], Binding]) -> Binding | None:
    """Replace the binding of ``key`` by ``fn(binding)`` if it still routes ``routed_id``.

    A compare-and-set on the text read, re-read on a concurrent write: a retirement in
    between wins. None: the key no longer routes that id (retired, re-bound)."""
    for _ in range(_TRIES):
        raw, b = await _read(store, key)
        if b is None or b.routed_id != routed_id:
            return None
        new = fn(b)
        if new == b or await store.cas(bind_key(key), raw, encode(new)):
            return new
    return None


async def retire(store: Store, key: str, routed_id: str, now: int, *, durable: bool = False,
                 still: Callable[[Binding], bool] | None = None) -> bool:
    """Retire a bound id for good; True when this call removed the binding.

    ``still`` is re-checked on the binding as read at the moment of retiring (e.g. "still
    idle"): a binding another process touched meanwhile is left alone."""
    for _ in range(_TRIES):
        raw, b = await _read(store, key)
        if b is None or b.routed_id != routed_id or (still is not None and not still(b)):
            return False
        if await store.apply([Check(bind_key(key), raw)],
                             [Delete(bind_key(key)), Set(id_key(routed_id), f"{RETIRED}{now}", KEEP_RETIRED_S)],
                             durable=durable):
            return True
    return False


async def is_retired(store: Store, sid: str) -> bool:
    return (await store.get(id_key(sid)) or "").startswith(RETIRED)


# ---- pruning (seeds/002 §6, §8 step 1) -----------------------------------------------

@dataclass(frozen=True)
class Pruned:
    idle: int = 0
    capped: int = 0
    stray: int = 0       # spares that were bound or retired already (a claim a crash lost)
    migrated: int = 0    # bindings moved from the synchronous pool's layout


async def prune(store: Store, now: int, *, lease_ttl_ms: int, quarantine_failures: int,
                max_bindings: int) -> Pruned:
    """Retire idle or struck-out bindings, cap the table (oldest idle first), drop stray spares."""
    migrated = await migrate_legacy(store, now)

    def dead(b: Binding) -> bool:
        return not alive(b, now, lease_ttl_ms, quarantine_failures)

    idle = capped = 0
    live: list[tuple[int, str, Binding]] = []
    for k, b in (await bindings(store)).items():
        if not dead(b):
            live.append((b.last_seen_at, k, b))
        elif await retire(store, k, b.routed_id, now, still=dead):
            idle += 1
    if len(live) > max_bindings:
        live.sort(key=lambda t: (t[0], t[1]))
        for seen, k, b in live[: len(live) - max_bindings]:
            if await retire(store, k, b.routed_id, now, still=lambda x, seen=seen: x.last_seen_at == seen):
                capped += 1
    return Pruned(idle, capped, await drop_stray_spares(store), migrated)


async def drop_stray_spares(store: Store) -> int:
    """Spares with an id record (bound or retired): a claim lost in a crash while its
    durable binding survived. They go, so no bound id stays a spare (invariant 2)."""
    dropped = 0
    for key in await store.keys(SPARE_PREFIX):
        ids = list(await store.hgetall(key))
        for sid, record in zip(ids, await store.mget([id_key(i) for i in ids]) if ids else []):
            if record is not None and await store.hdel(key, sid):
                dropped += 1
    return dropped


async def migrate_legacy(store: Store, now: int) -> int:
    """Move the synchronous pool's bindings (one hash) to their own keys; forget its tombstones
    (they were an hour long at most: new ids are random, so none can come back)."""
    try:
        old = await store.hgetall(LEGACY_BINDINGS)
        tombstones = await store.hgetall(LEGACY_RETIRED)
    except WrongType:
        return 0
    moved = 0
    for key, text in old.items():
        b = decode_binding(text)
        if b is not None and await bind(store, key, b) == b:
            moved += 1
        await store.hdel(LEGACY_BINDINGS, key)
    for sid in tombstones:
        await store.hdel(LEGACY_RETIRED, sid)
    return moved


async def targets_in_store(store: Store) -> list[tuple[str, str]]:
    return [pm for pm in map(split_spare_key, await store.keys(SPARE_PREFIX)) if pm]


async def retired_count(store: Store) -> int:
    keys = await store.keys(ID_PREFIX)
    return sum(1 for v in (await store.mget(keys) if keys else []) if (v or "").startswith(RETIRED))
