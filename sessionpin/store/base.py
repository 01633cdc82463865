"""The one store interface everything that remembers goes through.

It is redis-like on purpose: a later ``redis://`` store is a thin adapter, and the
semantics below are the ones redis has, so nothing built on them needs to change.

Rules every implementation keeps:
- Keys and values are ``str``. A key holds either a string or a hash; using it as the
  other type raises ``WrongType`` (redis' WRONGTYPE).
- A TTL is in seconds (float). An expired key reads as absent everywhere (get, hash
  reads, ``keys``), whether or not it has been swept yet.
- ``set`` without a TTL clears any TTL (redis SET); ``incr``/``hset``/``hincr`` keep it.
- ``expire(key, ttl)`` with ``ttl <= 0`` deletes the key.
- ``durable=True`` on a write means: on stable storage (fsync'd) before the call
  returns. Other writes reach stable storage within 2 s and on ``close``.
- ``hdel`` returns whether the field existed, atomically across processes: it is the
  primitive for "claim" (of two processes deleting one field, exactly one sees True).
- ``hsetnx`` sets only when the field is absent and returns whether it set; likewise
  ``set(..., nx=True)`` (redis SET NX). ``set`` returns whether it wrote.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class StoreError(Exception):
    """A store could not be opened or used as asked."""


class WrongType(StoreError):
    """A key holding one type (string or hash) was used as the other."""


class StoreVersionError(StoreError):
    """The store's file was written by a newer format version; it is left untouched."""


@runtime_checkable
class Store(Protocol):
    url: str

    # strings
    def get(self, key: str) -> str | None: ...
    def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False, durable: bool = False) -> bool: ...
    def delete(self, key: str, *, durable: bool = False) -> bool: ...
    def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool: ...
    def ttl(self, key: str) -> float | None: ...
    def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int: ...

    # hashes
    def hget(self, key: str, field: str) -> str | None: ...
    def hgetall(self, key: str) -> dict[str, str]: ...
    def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None: ...
    def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool: ...
    def hdel(self, key: str, field: str, *, durable: bool = False) -> bool: ...
    def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int: ...

    # keys
    def keys(self, prefix: str = "") -> list[str]: ...
    def close(self) -> None: ...
