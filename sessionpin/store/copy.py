"""Copy every live key of one store into another (file → Redis, Redis → file, any pair).

Rules it keeps:
- Only the ``Store`` contract is used, so any two stores work. A key's type is found by
  reading it as a string, then a hash, then a sorted set (``WrongType`` says "not this").
- Each key arrives whole, with the TTL it has left in the source (read after the value,
  less the time spent between that read and the write, so the copy never outlives the
  original): a string in one ``set``; a hash or sorted set
  as one ``apply`` (delete, then every field or member), then ``expire``. A key of another
  type in the destination is deleted first (``apply``'s writes cannot change a key's
  type in place).
- Idempotent: a key whose destination already holds the same value, and a TTL within
  ``TTL_SLACK`` of the source's (or no TTL on both), is left alone and counted as
  ``equal``; running the copy twice changes nothing the second time.
- ``skipped``: keys that were gone (expired, deleted) by the time they were read. Keys
  of the destination that the source does not have are left alone (a copy, not a sync).
  Keys under an ``exclude`` prefix are not copied (the CLI leaves proxies' heartbeats out).
- Writes are ordinary, not durable (one fsync per key would make a large copy slow);
  they reach stable storage as the destination promises for ordinary writes — within a
  couple of seconds and on ``close()``, which the caller does when the copy returns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from .base import Delete, HSet, Store, WrongType, ZAdd

TTL_SLACK = 2.0   # seconds: TTLs read at different moments of one copy differ by this much at most


@dataclass
class CopyCounts:
    copied: int = 0
    equal: int = 0
    skipped: int = 0
    skipped_keys: list[str] = field(default_factory=list)


async def read_key(store: Store, key: str) -> tuple[str, object] | None:
    """("string", str) | ("hash", dict) | ("zset", list of (member, score)) | None (absent)."""
    try:
        value = await store.get(key)
        return None if value is None else ("string", value)
    except WrongType:
        pass
    try:
        fields = await store.hgetall(key)
        return ("hash", fields) if fields else None
    except WrongType:
        pass
    members = await store.zrange(key, -math.inf, math.inf)
    return ("zset", members) if members else None


def _same_ttl(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= TTL_SLACK


async def copy_key(src: Store, dst: Store, key: str) -> str:
    """Copy one key; returns "copied", "equal" or "skipped"."""
    found = await read_key(src, key)
    if found is None:
        return "skipped"
    ttl = await src.ttl(key)
    read_at = time.monotonic()
    if ttl is None and await read_key(src, key) is None:     # expired between the two reads
        return "skipped"

    def left() -> float | None:                              # the TTL as it stands at the write
        return None if ttl is None else ttl - (time.monotonic() - read_at)
    kind, value = found
    try:
        there = await read_key(dst, key)
    except WrongType:                                         # pragma: no cover - read_key tries every type
        there = None
    if there == found and _same_ttl(await dst.ttl(key), ttl):
        return "equal"
    if kind == "string":
        await dst.set(key, value, left())                     # SET replaces any type, sets or clears the TTL
        return "copied"
    if there is not None and there[0] != kind:
        await dst.delete(key)
    writes = [Delete(key)]
    if kind == "hash":
        writes += [HSet(key, f, v) for f, v in sorted(value.items())]
    else:
        writes += [ZAdd(key, m, s) for m, s in value]
    await dst.apply([], writes)
    if ttl is not None:
        await dst.expire(key, left())
    return "copied"


async def copy(src: Store, dst: Store, prefix: str = "", exclude: Sequence[str] = ()) -> CopyCounts:
    """Copy every live key of ``src`` (under ``prefix``, not under an ``exclude`` prefix) into ``dst``."""
    counts = CopyCounts()
    for key in await src.keys(prefix):
        if key.startswith(tuple(exclude)):
            continue
        outcome = await copy_key(src, dst, key)
        setattr(counts, outcome, getattr(counts, outcome) + 1)
        if outcome == "skipped":
            counts.skipped_keys.append(key)
    return counts
