"""The store contract: the one interface everything that remembers goes through.

Two faces of one set of rules:

- ``Store`` (async) is what every caller uses — the router, the pool, the CLI. Nothing a
  caller awaits touches a file or the network on the event loop: a file store runs its
  work on an executor it owns (``sessionpin.store.aio``), a Redis store talks through the
  client library's asyncio API.
- ``SyncStore`` is what a local backend implements (memory, file); the facade in
  ``aio`` turns one into a ``Store``.

It is redis-like on purpose (a Redis store is the same semantics over the wire). Rules
every implementation keeps:

- Keys and values are ``str``. A key holds a string, a hash or a sorted set; using it as
  another type raises ``WrongType`` (redis' WRONGTYPE).
- A TTL is in seconds (float). An expired key reads as absent everywhere (get, hash and
  sorted-set reads, ``keys``), swept or not.
- ``set`` without a TTL clears any TTL (redis SET); ``incr``/``hset``/``hincr``/``zadd``
  keep it. ``expire(key, ttl)`` with ``ttl <= 0`` deletes the key.
- **Durable or raise.** ``durable=True`` on a write means: on stable storage when the
  call returns; if that cannot be done the call raises ``NotDurable``: not acknowledged.
  A local store's (memory, file) has no effect anywhere — no memory copy that a later
  read would see. A Redis store's may have been applied when its reply was lost (a
  timeout, a dropped connection: writes are never sent twice), and ``NotReplicated``
  (``applied`` True) was: it is on the primary's disk, too few replicas said so in time.
  A caller never reports such a write as saved, nor counts on it being absent. Other writes reach
  stable storage within a couple of seconds and on ``close``; when the backend fails
  they raise ``StoreUnavailable`` (also without effect).
- **A read fault is an error, never "absent".** A read that cannot reach the data
  raises ``StoreUnavailable``; ``None``/``{}``/``0`` always mean the data says so.
- **Reads never wait for a writer** of this or another process (a file store reads on
  connections of its own under SQLite's WAL; Redis reads are single commands).
- **Compare-and-set**: ``cas(key, expected, value)`` writes only if the key's string
  value is still ``expected`` (``None``: absent — set-if-absent; ``value=None``:
  delete). ``set(..., nx=True)`` is set-if-absent (first writer wins). ``apply`` is the
  multi-key form: every check holds, then every write is made, atomically — or nothing.
  On Redis Cluster the keys of one ``apply`` share a slot (the Redis store puts every
  key under one hash tag).
- ``hdel`` returns whether the field existed, atomically across processes: the
  primitive for "claim" (of two processes deleting one field, exactly one sees True).
  ``hsetnx`` sets only an absent field and returns whether it set.
- Sorted sets: ``zadd`` sets a member's score (adds or updates), ``zcount``/``zrange``
  take an inclusive score range, ``zrange`` answers by score then member; ``zscore`` is
  one member's score (None: not a member).
- Walking what is large in pages (the CLI at a million pins; never the proxy's request
  path): ``zpage`` is ``zrange`` one page at a time, each page starting strictly after the
  (member, score) the previous one ended on (``reverse``: highest score first), so a walk
  costs one call per page whatever the set's size and never holds the whole set (a member
  added, removed or given another score meanwhile may be missed, or seen again at its new
  score: a walk is not a snapshot). ``hgetall_many`` is
  ``hgetall`` of several keys in one call (one query, one pipelined round trip).
  Members of equal score come in the order of their UTF-8 bytes (Redis' order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable


class StoreError(Exception):
    """A store could not be opened or used as asked (the caller's mistake or the data's)."""


class WrongType(StoreError):
    """A key holding one type was used as another."""


class StoreVersionError(StoreError):
    """The store was written by a newer format version; it is left untouched."""


class StoreUnavailable(StoreError):
    """The backend cannot be read or written right now (disk, lock, network): retry later.

    Never means "absent". The message names the store (its safe URL) and the cause."""


class NotDurable(StoreUnavailable):
    """A durable write that is not acknowledged as durable. A local store's has no effect
    anywhere; a Redis store's may have been applied (its reply lost), and its subclass
    ``NotReplicated`` was (``applied``): see "Durable or raise" above."""


class WouldBlock(Exception):
    """A read a backend will not answer at once on the caller's thread (``read_now``): it
    would have to wait (a lock), so the caller asks again on a thread that may wait. Not a
    ``StoreError``: it never reaches a caller of the ``Store`` contract."""


# ---- the vocabulary of ``apply`` ---------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """The string at ``key`` is ``value`` (``None``: the key is absent)."""
    key: str
    value: str | None


@dataclass(frozen=True)
class Set:
    key: str
    value: str
    ttl: float | None = None


@dataclass(frozen=True)
class Delete:
    key: str


@dataclass(frozen=True)
class HSet:
    key: str
    field: str
    value: str


@dataclass(frozen=True)
class HIncr:
    key: str
    field: str
    by: int = 1


@dataclass(frozen=True)
class ZAdd:
    key: str
    member: str
    score: float


@dataclass(frozen=True)
class ZRem:
    key: str
    member: str


@dataclass(frozen=True)
class Expire:
    """The key's TTL, whatever it holds (``expire``); an absent key stays absent. A
    positive TTL only: a key that should go is a ``Delete``."""
    key: str
    ttl: float

    def __post_init__(self) -> None:
        if not self.ttl > 0:        # (NaN too)
            raise StoreError(f"Expire({self.key!r}): the TTL must be positive (a key that goes is a Delete)")


Write = Set | Delete | HSet | HIncr | ZAdd | ZRem | Expire


@runtime_checkable
class Store(Protocol):
    """The async contract every caller uses (see the module's rules)."""

    url: str    # safe to show: a password in it is masked

    # strings
    async def get(self, key: str) -> str | None: ...
    async def mget(self, keys: Sequence[str]) -> list[str | None]: ...
    async def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False,
                  durable: bool = False) -> bool: ...
    async def cas(self, key: str, expected: str | None, value: str | None, ttl: float | None = None, *,
                  durable: bool = False) -> bool: ...
    async def delete(self, key: str, *, durable: bool = False) -> bool: ...
    async def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool: ...
    async def ttl(self, key: str) -> float | None: ...
    async def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int: ...

    # hashes
    async def hget(self, key: str, field: str) -> str | None: ...
    async def hgetall(self, key: str) -> dict[str, str]: ...
    async def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None: ...
    async def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool: ...
    async def hdel(self, key: str, field: str, *, durable: bool = False) -> bool: ...
    async def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int: ...

    # sorted sets
    async def zadd(self, key: str, member: str, score: float, *, durable: bool = False) -> None: ...
    async def zrem(self, key: str, member: str, *, durable: bool = False) -> bool: ...
    async def zcount(self, key: str, lo: float, hi: float) -> int: ...
    async def zscore(self, key: str, member: str) -> float | None: ...
    async def zrange(self, key: str, lo: float, hi: float, limit: int | None = None) -> list[tuple[str, float]]: ...
    async def zremrange(self, key: str, lo: float, hi: float) -> int: ...
    async def zpage(self, key: str, lo: float, hi: float, after: tuple[str, float] | None = None,
                    limit: int = 1000, *, reverse: bool = False) -> list[tuple[str, float]]: ...

    # several keys at once
    async def hgetall_many(self, keys: Sequence[str]) -> list[dict[str, str]]: ...
    async def apply(self, checks: Sequence[Check], writes: Sequence[Write], *, durable: bool = False) -> bool: ...
    async def keys(self, prefix: str = "") -> list[str]: ...

    # the store itself
    def describe(self) -> dict[str, Any]: ...      # kind, safe url, durability, health: for status/doctor
    async def close(self) -> None: ...


@runtime_checkable
class SyncStore(Protocol):
    """The same operations, synchronous: what a local backend implements (thread-safe)."""

    url: str

    def get(self, key: str) -> str | None: ...
    def mget(self, keys: Sequence[str]) -> list[str | None]: ...
    def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False, durable: bool = False) -> bool: ...
    def cas(self, key: str, expected: str | None, value: str | None, ttl: float | None = None, *,
            durable: bool = False) -> bool: ...
    def delete(self, key: str, *, durable: bool = False) -> bool: ...
    def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool: ...
    def ttl(self, key: str) -> float | None: ...
    def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int: ...
    def hget(self, key: str, field: str) -> str | None: ...
    def hgetall(self, key: str) -> dict[str, str]: ...
    def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None: ...
    def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool: ...
    def hdel(self, key: str, field: str, *, durable: bool = False) -> bool: ...
    def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int: ...
    def zadd(self, key: str, member: str, score: float, *, durable: bool = False) -> None: ...
    def zrem(self, key: str, member: str, *, durable: bool = False) -> bool: ...
    def zcount(self, key: str, lo: float, hi: float) -> int: ...
    def zscore(self, key: str, member: str) -> float | None: ...
    def zrange(self, key: str, lo: float, hi: float, limit: int | None = None) -> list[tuple[str, float]]: ...
    def zremrange(self, key: str, lo: float, hi: float) -> int: ...
    def zpage(self, key: str, lo: float, hi: float, after: tuple[str, float] | None = None,
              limit: int = 1000, *, reverse: bool = False) -> list[tuple[str, float]]: ...
    def hgetall_many(self, keys: Sequence[str]) -> list[dict[str, str]]: ...
    def apply(self, checks: Sequence[Check], writes: Sequence[Write], *, durable: bool = False) -> bool: ...
    def keys(self, prefix: str = "") -> list[str]: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


# The operations that only read (the facade runs them on reader threads; a backend may
# serve them on connections of their own).
READS = frozenset({"get", "mget", "ttl", "hget", "hgetall", "zcount", "zscore", "zrange", "keys", "zpage", "hgetall_many"})
WRITES = frozenset({"set", "cas", "delete", "expire", "incr", "hset", "hsetnx", "hdel", "hincr",
                    "zadd", "zrem", "zremrange", "apply"})
