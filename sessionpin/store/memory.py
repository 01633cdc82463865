"""The in-memory store: the Store rules of ``base`` with redis semantics, in one process.

Rules it keeps (beyond those of ``base``):
- One lock guards every call, so threads see each call as atomic.
- Time comes from ``clock`` (``time.time`` unless a test injects one); a key whose
  ``expires_at <= clock()`` is absent to every read and is dropped when next touched
  or by ``sweep``.
- ``incr``/``hincr`` on a value that is not an integer raise ``StoreError`` (redis'
  "value is not an integer"); the hash loses its last field → the key is gone (redis).
- ``durable`` is accepted and means nothing here: nothing is ever on disk.
- ``cas`` and ``apply`` check and write under the one lock: atomic for every thread; an
  ``apply`` whose write fails (wrong type, not an integer) puts every key back as it was.
- A score must be a number: NaN raises ``StoreError`` (redis refuses it too).
- A sorted set is a dict member -> score; reads sort it (sets here are small: the pin
  index per server, read by status in one ``zcount``).
- Expired keys do not pile up: a write sweeps them all when ``SWEEP_EVERY`` seconds have
  passed since the last sweep (amortised: one pass over the keys per interval).

"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Callable

from typing import Any, Sequence

from .base import Check, Delete, Expire, HIncr, HSet, Set, StoreError, WrongType, Write, ZAdd, ZRem

STRING = "s"
HASH = "h"
ZSET = "z"
_KIND_NAME = {STRING: "string", HASH: "hash", ZSET: "sorted set"}


def as_int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise StoreError(f"value is not an integer: {value[:40]!r}") from None


def _score(score: float) -> float:
    s = float(score)
    if s != s:
        raise StoreError("score is not a number (NaN)")   # redis: "not a valid float"
    return s


def prefix_end(prefix: str) -> str | None:
    """The least string greater than every string starting with ``prefix`` (None: no bound)."""
    chars = list(prefix)
    while chars:
        c = ord(chars.pop())
        if c < 0x10FFFF:
            c += 1
            if 0xD800 <= c <= 0xDFFF:  # surrogates do not encode; UTF-8 order skips them
                c = 0xE000
            return "".join(chars) + chr(c)
    return None


class _Entry:
    __slots__ = ("kind", "value", "expires_at")

    def __init__(self, kind: str, value, expires_at: float | None) -> None:
        self.kind = kind
        self.value = value          # str for a string, dict[str, str] for a hash
        self.expires_at = expires_at


SWEEP_EVERY = 10.0


class MemoryStore:
    def __init__(self, url: str = "memory:", *, clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._last_sweep = clock()

    def _maybe_sweep(self) -> None:
        if self._clock() - self._last_sweep >= SWEEP_EVERY:
            self.sweep()

    # -- helpers (call with the lock held) -------------------------------------------
    def _live(self, key: str) -> _Entry | None:
        entry = self._data.get(key)
        if entry is not None and entry.expires_at is not None and entry.expires_at <= self._clock():
            del self._data[key]
            return None
        return entry

    def _typed(self, key: str, kind: str) -> _Entry | None:
        entry = self._live(key)
        if entry is not None and entry.kind != kind:
            raise WrongType(f"{key!r} holds a {_KIND_NAME[entry.kind]}")
        return entry

    def _hash_for_write(self, key: str) -> dict[str, str]:
        return self._for_write(key, HASH)

    def _for_write(self, key: str, kind: str) -> dict:
        self._maybe_sweep()
        entry = self._typed(key, kind)
        if entry is None:
            entry = self._data[key] = _Entry(kind, {}, None)
        return entry.value

    # -- strings ---------------------------------------------------------------------
    def get(self, key: str) -> str | None:
        with self._lock:
            entry = self._typed(key, STRING)
            return None if entry is None else entry.value

    def mget(self, keys: Sequence[str]) -> list[str | None]:
        with self._lock:
            out: list[str | None] = []
            for key in keys:
                entry = self._live(key)
                out.append(entry.value if entry is not None and entry.kind == STRING else None)
            return out

    def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False, durable: bool = False) -> bool:
        with self._lock:
            self._maybe_sweep()
            if nx and self._live(key) is not None:
                return False
            self._set(key, value, ttl)
            return True

    def _set(self, key: str, value: str, ttl: float | None) -> None:
        if ttl is not None and ttl <= 0:
            # redis refuses a non-positive EX; a key that expires now is a delete.
            self._data.pop(key, None)
            return
        expires = None if ttl is None else self._clock() + ttl
        self._data[key] = _Entry(STRING, value, expires)

    def _string_is(self, key: str, expected: str | None) -> bool:
        entry = self._live(key)
        if entry is None:
            return expected is None
        return entry.kind == STRING and entry.value == expected

    def cas(self, key: str, expected: str | None, value: str | None, ttl: float | None = None, *,
            durable: bool = False) -> bool:
        with self._lock:
            self._maybe_sweep()
            if not self._string_is(key, expected):
                return False
            if value is None:
                self._data.pop(key, None)
            else:
                self._set(key, value, ttl)
            return True

    def apply(self, checks: Sequence[Check], writes: Sequence[Write], *, durable: bool = False) -> bool:
        with self._lock:
            self._maybe_sweep()
            if not all(self._string_is(c.key, c.value) for c in checks):
                return False
            # all or nothing: a write that fails (wrong type, not an integer) puts back
            # every key the writes before it changed
            saved = {w.key: self._copy(w.key) for w in writes}
            try:
                for w in writes:
                    self._apply_one(w)
            except BaseException:
                for key, entry in saved.items():
                    if entry is None:
                        self._data.pop(key, None)
                    else:
                        self._data[key] = entry
                raise
            return True

    def _copy(self, key: str) -> _Entry | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        value = dict(entry.value) if isinstance(entry.value, dict) else entry.value
        return _Entry(entry.kind, value, entry.expires_at)

    def _apply_one(self, w: Write) -> None:
        if isinstance(w, Set):
            self._set(w.key, w.value, w.ttl)
        elif isinstance(w, Delete):
            self._data.pop(w.key, None)
        elif isinstance(w, HSet):
            self._for_write(w.key, HASH)[w.field] = w.value
        elif isinstance(w, HIncr):
            fields = self._for_write(w.key, HASH)
            fields[w.field] = str(as_int(fields.get(w.field, "0")) + w.by)
        elif isinstance(w, ZAdd):
            score = _score(w.score)
            self._for_write(w.key, ZSET)[w.member] = score
        elif isinstance(w, ZRem):
            self._zrem(w.key, w.member)
        elif isinstance(w, Expire):
            entry = self._live(w.key)
            if entry is not None:
                entry.expires_at = self._clock() + w.ttl
        else:  # pragma: no cover - the vocabulary is closed
            raise StoreError(f"unknown write {w!r}")

    def delete(self, key: str, *, durable: bool = False) -> bool:
        with self._lock:
            found = self._live(key) is not None
            self._data.pop(key, None)
            return found

    def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool:
        with self._lock:
            entry = self._live(key)
            if entry is None:
                return False
            if ttl <= 0:
                del self._data[key]
            else:
                entry.expires_at = self._clock() + ttl
            return True

    def ttl(self, key: str) -> float | None:
        with self._lock:
            entry = self._live(key)
            if entry is None or entry.expires_at is None:
                return None
            return entry.expires_at - self._clock()

    def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int:
        with self._lock:
            self._maybe_sweep()
            entry = self._typed(key, STRING)
            if entry is None:
                entry = self._data[key] = _Entry(STRING, "0", None)
            n = as_int(entry.value) + by
            entry.value = str(n)
            return n

    # -- hashes ----------------------------------------------------------------------
    def hget(self, key: str, field: str) -> str | None:
        with self._lock:
            entry = self._typed(key, HASH)
            return None if entry is None else entry.value.get(field)

    def hgetall(self, key: str) -> dict[str, str]:
        with self._lock:
            entry = self._typed(key, HASH)
            return {} if entry is None else dict(entry.value)

    def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None:
        with self._lock:
            self._hash_for_write(key)[field] = value

    def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool:
        with self._lock:
            fields = self._hash_for_write(key)
            if field in fields:
                return False
            fields[field] = value
            return True

    def hdel(self, key: str, field: str, *, durable: bool = False) -> bool:
        with self._lock:
            entry = self._typed(key, HASH)
            if entry is None or field not in entry.value:
                return False
            del entry.value[field]
            if not entry.value:
                del self._data[key]
            return True

    def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int:
        with self._lock:
            fields = self._hash_for_write(key)
            n = as_int(fields.get(field, "0")) + by
            fields[field] = str(n)
            return n

    # -- sorted sets -------------------------------------------------------------------
    def zadd(self, key: str, member: str, score: float, *, durable: bool = False) -> None:
        score = _score(score)
        with self._lock:
            self._for_write(key, ZSET)[member] = score

    def _zrem(self, key: str, member: str) -> bool:
        entry = self._typed(key, ZSET)
        if entry is None or member not in entry.value:
            return False
        del entry.value[member]
        if not entry.value:
            del self._data[key]
        return True

    def zrem(self, key: str, member: str, *, durable: bool = False) -> bool:
        with self._lock:
            return self._zrem(key, member)

    def zcount(self, key: str, lo: float, hi: float) -> int:
        with self._lock:
            entry = self._typed(key, ZSET)
            return 0 if entry is None else sum(1 for s in entry.value.values() if lo <= s <= hi)

    def zscore(self, key: str, member: str) -> float | None:
        with self._lock:
            entry = self._typed(key, ZSET)
            return None if entry is None else entry.value.get(member)

    def zrange(self, key: str, lo: float, hi: float, limit: int | None = None) -> list[tuple[str, float]]:
        with self._lock:
            entry = self._typed(key, ZSET)
            if entry is None:
                return []
            found = sorted(((m, s) for m, s in entry.value.items() if lo <= s <= hi), key=lambda p: (p[1], p[0]))
            return found if limit is None else found[:max(limit, 0)]

    def zpage(self, key: str, lo: float, hi: float, after: tuple[str, float] | None = None,
              limit: int = 1000, *, reverse: bool = False) -> list[tuple[str, float]]:
        with self._lock:
            entry = self._typed(key, ZSET)
            if entry is None or limit <= 0:
                return []
            found = ((m, s) for m, s in entry.value.items() if lo <= s <= hi)
            if after is not None:
                mark = (float(after[1]), after[0])
                found = (p for p in found if ((p[1], p[0]) < mark if reverse else (p[1], p[0]) > mark))
            pick = heapq.nlargest if reverse else heapq.nsmallest
            return pick(limit, found, key=lambda p: (p[1], p[0]))

    def hgetall_many(self, keys: Sequence[str]) -> list[dict[str, str]]:
        with self._lock:
            out = []
            for key in keys:
                entry = self._typed(key, HASH)
                out.append({} if entry is None else dict(entry.value))
            return out

    def zremrange(self, key: str, lo: float, hi: float) -> int:
        with self._lock:
            entry = self._typed(key, ZSET)
            if entry is None:
                return 0
            dead = [m for m, s in entry.value.items() if lo <= s <= hi]
            for m in dead:
                del entry.value[m]
            if not entry.value:
                del self._data[key]
            return len(dead)

    # -- keys ------------------------------------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in list(self._data) if k.startswith(prefix) and self._live(k) is not None)

    def sweep(self, limit: int | None = None) -> int:
        """Drop expired keys (at most ``limit``); return how many were dropped."""
        with self._lock:
            now = self._last_sweep = self._clock()
            dead = [k for k, e in self._data.items() if e.expires_at is not None and e.expires_at <= now]
            for k in dead[:limit]:
                del self._data[k]
            return len(dead[:limit])

    def describe(self) -> dict[str, Any]:
        return {"kind": "memory", "url": self.url, "durable": False,
                "note": "this process only: pins are gone when it exits"}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<MemoryStore {self.url} keys={len(self._data)}>"
