"""The pool's state in the store: spares, bindings, retired ids (seeds/002 §3, §4, §6).

Every function here is a synchronous transition over a ``Store`` with the time passed in
(epoch milliseconds); no network, no clock. Layout (ids, provider and model names only;
no secret, no URL, no content ever):

    pool:spare:<provider>:<model>  hash  id -> Spare json        verified, unowned ids
    pool:bind                      hash  <conversation>::<provider>::<model> -> Binding json
    pool:retired                   hash  id -> retired-at ms     ids that never come back

Invariants, and how they hold across processes sharing one store:
1. spares hold only unowned ids: an id leaves its spare hash by ``hdel`` *before* it is
   bound or probed, and ``hdel`` returning True is the atomic claim, so exactly one
   process owns a claimed id; new spares are fresh random UUIDs.
2. a bound id is never a spare: an id is written back to spares only by the process that
   claimed it and only when it did not bind it.
3. an id is never handed to a second conversation and retired ids never return: a
   binding is created with ``hsetnx``; retiring writes ``pool:retired`` *then* deletes the
   binding, and every binding update re-checks ``pool:retired`` after writing and undoes
   itself, so a late update can never resurrect a retired binding.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterator

import msgspec

from ..store.base import Store

SPARE_PREFIX = "pool:spare:"
BINDINGS = "pool:bind"
RETIRED = "pool:retired"
SEP = "::"


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
    origin: str = ""                # spare | probe | fresh  (how the id was obtained)


_enc = msgspec.json.Encoder()
_spare_dec = msgspec.json.Decoder(Spare)
_binding_dec = msgspec.json.Decoder(Binding)


def new_id() -> str:
    return str(uuid.uuid4())


def spare_key(provider: str, model: str) -> str:
    return f"{SPARE_PREFIX}{provider}:{model}"


def binding_key(conversation: str, provider: str, model: str) -> str:
    return f"{conversation}{SEP}{provider}{SEP}{model}"


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

def spares(store: Store, provider: str, model: str, *, drop_bad: bool = True) -> dict[str, Spare]:
    """Valid spares of one provider+model (an unreadable one is dropped on sight, unless read-only)."""
    return _valid(store, spare_key(provider, model), decode_spare, drop_bad)


def is_fresh(spare: Spare, now: int, ttl_ms: int) -> bool:
    return now - spare.verified_at <= ttl_ms


def ranked(pool: dict[str, Spare], now: int, ttl_ms: int, *, fresh: bool) -> list[tuple[str, Spare]]:
    """Fresh (or stale) spares, best first: lowest upstream ms, then most recently verified."""
    picked = [(i, s) for i, s in pool.items() if is_fresh(s, now, ttl_ms) == fresh]
    return sorted(picked, key=lambda p: (p[1].upstream_ms, -p[1].verified_at, p[0]))


def add_spare(store: Store, provider: str, model: str, sid: str, spare: Spare) -> bool:
    """Put a verified id among the spares unless it was retired meanwhile."""
    if store.hget(RETIRED, sid) is not None:
        return False
    store.hset(spare_key(provider, model), sid, encode(spare))
    return True


def claim(store: Store, provider: str, model: str, sid: str) -> bool:
    """Atomically remove a spare; True means this caller alone now owns the id."""
    return store.hdel(spare_key(provider, model), sid)


# ---- bindings --------------------------------------------------------------------------

def binding(store: Store, key: str) -> Binding | None:
    return decode_binding(store.hget(BINDINGS, key))


def bindings(store: Store, *, drop_bad: bool = True) -> dict[str, Binding]:
    return _valid(store, BINDINGS, decode_binding, drop_bad)


def _valid(store: Store, key: str, decode, drop_bad: bool) -> dict:
    """The hash's fields that decode; an unreadable one is dropped on sight (unless read-only)."""
    out = {}
    for field, text in store.hgetall(key).items():
        value = decode(text)
        if value is not None:
            out[field] = value
        elif drop_bad:
            store.hdel(key, field)
    return out


def alive(b: Binding, now: int, lease_ttl_ms: int, quarantine_failures: int) -> bool:
    return now - b.last_seen_at <= lease_ttl_ms and b.failures < quarantine_failures


def bind(store: Store, key: str, b: Binding) -> Binding:
    """Write a new binding unless the key has one; return the binding now in force.

    The caller owns ``b.routed_id`` (claimed or freshly generated). If another process
    bound the key first, its binding wins and the caller keeps its id (to put back)."""
    if store.hsetnx(BINDINGS, key, encode(b), durable=True):
        return b
    existing = binding(store, key)
    if existing is None:  # unreadable value: it reads as no binding
        store.hset(BINDINGS, key, encode(b), durable=True)
        return b
    return existing


def update(store: Store, key: str, b: Binding) -> bool:
    """Write a changed binding; undone at once if its id was retired meanwhile."""
    if store.hget(RETIRED, b.routed_id) is not None:
        return False
    store.hset(BINDINGS, key, encode(b))
    if store.hget(RETIRED, b.routed_id) is not None:
        current = binding(store, key)
        if current is not None and current.routed_id == b.routed_id:
            store.hdel(BINDINGS, key)
        return False
    return True


def retire(store: Store, key: str, routed_id: str, now: int) -> bool:
    """Retire a bound id for good; True when this call removed the binding."""
    store.hset(RETIRED, routed_id, str(now), durable=True)
    current = binding(store, key)
    if current is not None and current.routed_id != routed_id:
        return False  # the key was re-bound to another id: leave that one alone
    return store.hdel(BINDINGS, key, durable=True)


def is_retired(store: Store, sid: str) -> bool:
    return store.hget(RETIRED, sid) is not None


# ---- pruning (seeds/002 §6, §8 step 1) -----------------------------------------------

@dataclass(frozen=True)
class Pruned:
    idle: int = 0
    capped: int = 0
    forgotten: int = 0   # retired-id tombstones old enough to drop


def prune(store: Store, now: int, *, lease_ttl_ms: int, quarantine_failures: int, max_bindings: int,
          keep_retired_ms: int) -> Pruned:
    """Retire idle or struck-out bindings, cap the table (oldest idle first), forget old tombstones.

    A tombstone only guards against a late update racing a retirement, so it can go after
    ``keep_retired_ms``; retired ids cannot come back anyway: spares only ever receive new
    random ids or ids their claimer owned."""
    idle = capped = forgotten = 0
    live: list[tuple[int, str, Binding]] = []
    for k, b in bindings(store).items():
        if alive(b, now, lease_ttl_ms, quarantine_failures):
            live.append((b.last_seen_at, k, b))
        elif retire(store, k, b.routed_id, now):
            idle += 1
    if len(live) > max_bindings:
        live.sort(key=lambda t: (t[0], t[1]))
        for _, k, b in live[: len(live) - max_bindings]:
            if retire(store, k, b.routed_id, now):
                capped += 1
    for sid, at in store.hgetall(RETIRED).items():
        try:
            old = now - int(at) > keep_retired_ms
        except ValueError:
            old = True
        if old:
            store.hdel(RETIRED, sid)
            forgotten += 1
    return Pruned(idle, capped, forgotten)


def targets_in_store(store: Store) -> Iterator[tuple[str, str]]:
    for key in store.keys(SPARE_PREFIX):
        pm = split_spare_key(key)
        if pm:
            yield pm
