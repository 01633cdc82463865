"""sessionpin.store.copy between every pair of kinds we ship (memory, file, Redis): every
live key arrives whole with the TTL it has left, keys of another type in the
destination are replaced, a second run changes nothing, and the counts say so."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from redis_servers import shared_server
from sessionpin.store import open_store
from sessionpin.store.copy import copy

INF = math.inf


def url(kind: str, tmp_path, name: str) -> str:
    if kind == "memory":
        return "memory:"
    if kind == "file":
        return f"file:{tmp_path}/{name}.db"
    return shared_server().url()


class Ghost:
    """A store whose listing names one key more than it holds (gone by the time it is read)."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def keys(self, prefix: str = "") -> list[str]:
        return sorted(await self.store.keys(prefix) + ["ghost"])


async def state(store) -> dict:
    from sessionpin.store.copy import read_key

    return {k: (await read_key(store, k), await store.ttl(k)) for k in await store.keys()}


@pytest.mark.parametrize("src_kind, dst_kind", [
    ("memory", "redis"), ("redis", "file"), ("file", "redis"), ("file", "memory"), ("redis", "memory"),
])
async def test_copy(src_kind, dst_kind, tmp_path):
    src = open_store(url(src_kind, tmp_path, "src"))
    dst = open_store(url(dst_kind, tmp_path, "dst"))
    try:
        await src.set("pin:a", "1")
        await src.set("pin:b", '{"server": "glm"}', 3600)
        await src.hset("seen:a", "requests", "3")
        await src.hset("seen:a", "last", "1700000000.5")
        await src.expire("seen:a", 600)
        for member, score in (("a", 1.5), ("b", -INF), ("c", 1e12)):
            await src.zadd("idx", member, score)
        await src.set("gone", "x", 0.001)                       # expired before the copy lists it
        await asyncio.sleep(0.02)

        await dst.set("pin:a", "other", 5)                       # different value and TTL
        await dst.set("seen:a", "a string")                      # another type
        await dst.hset("idx", "f", "v")                          # another type
        await dst.set("dst-only", "stays")

        began = time.monotonic()
        counts = await copy(Ghost(src), dst)
        # a TTL is read, then written: the copy's expiry may be later by the time between
        # (a scheduling delay on a loaded machine), never by more
        took = time.monotonic() - began
        assert (counts.copied, counts.equal, counts.skipped) == (4, 0, 1)
        assert counts.skipped_keys == ["ghost"]

        theirs, ours = await state(src), await state(dst)
        assert ours.pop("dst-only") == (("string", "stays"), None)
        assert ours.keys() == theirs.keys() == {"pin:a", "pin:b", "seen:a", "idx"}
        for k in theirs:
            (value, ttl), (copied, copied_ttl) = theirs[k], ours[k]
            assert copied == value, k
            assert (ttl is None) == (copied_ttl is None), k
            if ttl is not None:
                assert abs(ttl - copied_ttl) < 1.0 and copied_ttl <= ttl + took + 0.01, k

        again = await copy(src, dst)                             # idempotent
        assert (again.copied, again.equal, again.skipped) == (0, 4, 0)
        assert {k: v for k, (v, _) in (await state(dst)).items()} == {
            **{k: v for k, (v, _) in theirs.items()}, "dst-only": ("string", "stays")}

        await dst.expire("pin:a", 100)                           # the TTL alone differs: copied again
        assert (await copy(src, dst)).copied == 1
        assert await dst.ttl("pin:a") is None
    finally:
        await src.close()
        await dst.close()
