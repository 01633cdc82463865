"""The Store rules of sessionpin/store/base.py (redis semantics), for every store kind we ship.

Each test runs through the async ``Store`` (``open_store(url, clock=...)``) against every
kind in ``tests/stores.py`` with one injected clock, so TTLs are exact. A hypothesis test
then drives the memory and file backends with the same random operations and demands the
same answers, and another does the same with memory and Redis (a server and a cluster).
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_servers import shift_ttls, unique_prefix
from stores import (file_url, is_redis, memory_url, raw_client, redis_cluster_url, redis_target,  # noqa: F401
                    redis_url, store_options, store_url)

from sessionpin.store import (Check, Delete, Expire, HIncr, HSet, Set, Store, StoreError, WrongType, ZAdd, ZRem,
                              open_store, open_sync_store)
from sessionpin.store.memory import prefix_end

INF = math.inf


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(store_url, clock):
    s = open_store(store_url, **store_options(store_url, clock))
    yield s
    await s.close()


@pytest.fixture
def about(store_url):
    """A TTL as the kind keeps it: exact, or to 300 ms on Redis (whole ms; its time runs, and
    on a loaded machine running tests in parallel ~100 ms can pass between two calls)."""
    tolerance = 0.3 if is_redis(store_url) else None
    return lambda seconds: pytest.approx(seconds, abs=tolerance)


async def test_is_a_store(store, store_url):
    assert isinstance(store, Store)
    assert store.url == store_url
    d = store.describe()
    assert d["url"] == store_url and d["kind"] == store_url.split(":")[0]
    assert isinstance(d["durable"], bool)


# -- strings ---------------------------------------------------------------------------

async def test_get_set(store):
    assert await store.get("a") is None
    assert await store.set("a", "1") is True
    assert await store.get("a") == "1"
    assert await store.set("a", "2", durable=True) is True
    assert await store.get("a") == "2"
    assert await store.set("empty", "") is True
    assert await store.get("empty") == ""


async def test_mget(store, clock):
    await store.set("a", "1")
    await store.set("t", "x", 1)
    await store.hset("h", "f", "v")
    await store.zadd("z", "m", 1)
    assert await store.mget([]) == []
    assert await store.mget(["a", "nope", "h", "z", "t", "a"]) == ["1", None, None, None, "x", "1"]
    clock.advance(1)
    assert await store.mget(["t", "a"]) == [None, "1"]
    many = [f"k{i}" for i in range(1200)]          # more than one statement's parameters
    for k in many[::100]:
        await store.set(k, k)
    assert await store.mget(many) == [k if i % 100 == 0 else None for i, k in enumerate(many)]


async def test_set_nx(store, clock):
    assert await store.set("a", "1", nx=True) is True
    assert await store.set("a", "2", nx=True, durable=True) is False
    assert await store.get("a") == "1"
    await store.hset("h", "f", "v")
    assert await store.set("h", "x", nx=True) is False      # any type counts as present
    await store.set("t", "old", 5)
    clock.advance(5)
    assert await store.set("t", "new", nx=True) is True     # an expired key is absent
    assert await store.get("t") == "new"
    assert await store.ttl("t") is None


async def test_cas(store, clock, about):
    assert await store.cas("a", "x", "1") is False           # absent is not "x"
    assert await store.get("a") is None
    assert await store.cas("a", None, "1", durable=True) is True   # set-if-absent
    assert await store.cas("a", None, "2") is False
    assert await store.cas("a", "1", "2", 10) is True
    assert await store.get("a") == "2" and await store.ttl("a") == about(10)
    assert await store.cas("a", "1", "3") is False           # stale expectation
    assert await store.cas("a", "2", None) is True           # compare-and-delete
    assert await store.get("a") is None
    await store.set("b", "1", 5)
    clock.advance(5)
    assert await store.cas("b", "1", "2") is False           # expired: absent
    assert await store.cas("b", None, "2") is True
    await store.hset("h", "f", "v")
    assert await store.cas("h", None, "x") is False          # a hash is not absent
    assert await store.cas("h", "v", "x") is False
    assert await store.hgetall("h") == {"f": "v"}
    assert await store.cas("c", None, "x", 0) is True        # ttl <= 0: expires now
    assert await store.get("c") is None


async def test_ttl_and_expiry(store, clock, about):
    await store.set("a", "1", 10)
    assert await store.ttl("a") == about(10)
    clock.advance(9.5)
    assert await store.get("a") == "1"
    assert await store.ttl("a") == about(0.5)
    clock.advance(0.5)
    assert await store.get("a") is None
    assert await store.ttl("a") is None
    assert await store.keys() == []
    assert await store.delete("a") is False


async def test_set_without_ttl_clears_it(store):
    await store.set("a", "1", 10)
    await store.set("a", "2")
    assert await store.ttl("a") is None


async def test_ttl_of_missing_and_persistent(store):
    assert await store.ttl("nope") is None
    await store.set("a", "1")
    assert await store.ttl("a") is None


@pytest.mark.parametrize("ttl", [0, -1, -0.5])
async def test_expire_non_positive_deletes(store, ttl):
    await store.set("a", "1", 100)
    assert await store.expire("a", ttl) is True
    assert await store.get("a") is None
    assert await store.keys() == []
    await store.hset("h", "f", "v")
    assert await store.expire("h", ttl) is True
    assert await store.hgetall("h") == {}
    await store.zadd("z", "m", 1)
    assert await store.expire("z", ttl, durable=True) is True
    assert await store.zrange("z", -INF, INF) == []
    assert await store.set("s", "v", ttl) is True            # set with ttl <= 0: a delete
    assert await store.get("s") is None


async def test_expire(store, clock, about):
    assert await store.expire("missing", 10) is False
    await store.set("a", "1")
    assert await store.expire("a", 10) is True
    assert await store.ttl("a") == about(10)
    clock.advance(10)
    assert await store.get("a") is None
    assert await store.expire("a", 10) is False


async def test_delete(store):
    await store.set("a", "1")
    assert await store.delete("a", durable=True) is True
    assert await store.delete("a") is False
    await store.hset("h", "f", "v")
    assert await store.delete("h") is True
    await store.hset("h", "g", "w")
    assert await store.hgetall("h") == {"g": "w"}  # the old fields went with the key
    await store.zadd("z", "m", 1)
    assert await store.delete("z") is True
    await store.zadd("z", "n", 2)
    assert await store.zrange("z", -INF, INF) == [("n", 2.0)]   # and the old members


async def test_incr(store, clock, about):
    assert await store.incr("n") == 1
    assert await store.incr("n", 10, durable=True) == 11
    assert await store.incr("n", -20) == -9
    assert await store.get("n") == "-9"
    await store.expire("n", 30)
    clock.advance(10)
    assert await store.incr("n") == -8
    assert await store.ttl("n") == about(20)   # incr keeps the TTL
    clock.advance(20)
    assert await store.incr("n") == 1                  # expired: starts again from 0
    assert await store.ttl("n") is None


async def test_incr_not_an_integer(store):
    await store.set("a", "x")
    with pytest.raises(StoreError):
        await store.incr("a")
    assert await store.get("a") == "x"


# -- hashes ----------------------------------------------------------------------------

async def test_hash_basics(store):
    assert await store.hget("h", "f") is None
    assert await store.hgetall("h") == {}
    await store.hset("h", "f", "1")
    await store.hset("h", "g", "2", durable=True)
    await store.hset("h", "f", "3")
    assert await store.hget("h", "f") == "3"
    assert await store.hget("h", "zz") is None
    assert await store.hgetall("h") == {"f": "3", "g": "2"}


async def test_hsetnx(store):
    assert await store.hsetnx("h", "f", "1") is True
    assert await store.hsetnx("h", "f", "2", durable=True) is False
    assert await store.hget("h", "f") == "1"


async def test_hdel(store):
    await store.hset("h", "f", "1")
    await store.hset("h", "g", "2")
    assert await store.hdel("h", "f") is True
    assert await store.hdel("h", "f") is False
    assert await store.hdel("nope", "f") is False
    assert await store.hdel("h", "g", durable=True) is True
    assert await store.keys() == []                     # an empty hash is no key (redis)


async def test_hincr(store):
    assert await store.hincr("h", "n") == 1
    assert await store.hincr("h", "n", 5, durable=True) == 6
    assert await store.hincr("h", "m", -2) == -2
    assert await store.hgetall("h") == {"n": "6", "m": "-2"}
    await store.hset("h", "x", "abc")
    with pytest.raises(StoreError):
        await store.hincr("h", "x")
    assert await store.hget("h", "x") == "abc"


async def test_hash_writes_keep_ttl(store, clock, about):
    await store.hset("h", "f", "1")
    await store.expire("h", 10)
    await store.hset("h", "g", "2")
    await store.hincr("h", "n")
    await store.hsetnx("h", "z", "1")
    await store.hdel("h", "z")
    assert await store.ttl("h") == about(10)
    clock.advance(10)
    assert await store.hgetall("h") == {}
    assert await store.hget("h", "f") is None
    assert await store.hsetnx("h", "f", "new") is True   # the expired hash's fields are gone
    assert await store.hgetall("h") == {"f": "new"}
    assert await store.ttl("h") is None


# -- sorted sets -----------------------------------------------------------------------

async def test_zset_basics(store):
    assert await store.zcount("z", -INF, INF) == 0
    assert await store.zrange("z", -INF, INF) == []
    await store.zadd("z", "b", 2)
    await store.zadd("z", "a", 2, durable=True)        # same score: by member
    await store.zadd("z", "c", 1.5)
    await store.zadd("z", "low", -INF)
    await store.zadd("z", "high", INF)
    assert await store.zrange("z", -INF, INF) == [("low", -INF), ("c", 1.5), ("a", 2.0), ("b", 2.0), ("high", INF)]
    assert await store.zcount("z", 1.5, 2) == 3                 # inclusive both ends
    assert await store.zcount("z", 2, 1) == 0
    assert await store.zscore("z", "c") == 1.5 and await store.zscore("z", "high") == INF
    assert await store.zscore("z", "nope") is None and await store.zscore("nope", "c") is None
    assert await store.zrange("z", 1.5, 2, limit=2) == [("c", 1.5), ("a", 2.0)]
    assert await store.zrange("z", 1.5, 2, limit=0) == []
    await store.zadd("z", "c", 3)                                # update the score
    assert await store.zrange("z", 0, 10) == [("a", 2.0), ("b", 2.0), ("c", 3.0)]
    assert await store.zrem("z", "c", durable=True) is True
    assert await store.zrem("z", "c") is False
    assert await store.zrem("nope", "c") is False
    assert await store.zremrange("z", 2, 2) == 2
    assert await store.zremrange("z", 2, 2) == 0
    assert await store.zremrange("nope", 0, 1) == 0
    assert await store.zrange("z", -INF, INF) == [("low", -INF), ("high", INF)]
    await store.zrem("z", "low")
    await store.zrem("z", "high")
    assert await store.keys() == []                              # an empty sorted set is no key


async def walk(store, key, lo=-INF, hi=INF, limit=2, reverse=False):
    """Every page of a zpage walk, until a short page."""
    pages, after = [], None
    while True:
        page = await store.zpage(key, lo, hi, after, limit, reverse=reverse)
        pages.append(page)
        if len(page) < limit:
            return pages
        after = page[-1]


async def test_zpage_walks_a_sorted_set_in_pages(store):
    assert await store.zpage("z", -INF, INF) == []
    members = {"a": 2.0, "b": 2.0, "c": 2.0, "é": 2.0, "d": 1.5, "low": -INF, "high": INF, "x": 7.0, "y": -3.0}
    for m, score in members.items():
        await store.zadd("z", m, score)
    everything = await store.zrange("z", -INF, INF)
    pages = await walk(store, "z", limit=2)
    assert [len(p) for p in pages] == [2, 2, 2, 2, 1]
    assert [x for p in pages for x in p] == everything          # ties in byte order: a b c é
    assert [x for p in await walk(store, "z", limit=2, reverse=True) for x in p] == everything[::-1]
    assert [x for p in await walk(store, "z", limit=4) for x in p] == everything
    assert [x for p in await walk(store, "z", 1.5, 2, limit=1) for x in p] == await store.zrange("z", 1.5, 2)
    assert [x for p in await walk(store, "z", 1.5, 2, limit=3, reverse=True) for x in p] == \
        (await store.zrange("z", 1.5, 2))[::-1]
    # a page starts strictly after its mark, which may sit outside the range or be gone
    assert await store.zpage("z", -INF, INF, ("b", 2.0), 3) == [("c", 2.0), ("é", 2.0), ("x", 7.0)]
    assert await store.zpage("z", -INF, INF, ("b", 2.0), 3, reverse=True) == [("a", 2.0), ("d", 1.5), ("y", -3.0)]
    assert await store.zpage("z", 0, 10, ("y", -3.0), 2) == [("d", 1.5), ("a", 2.0)]
    assert await store.zpage("z", 0, 10, ("x", 7.0), 2) == []
    assert await store.zpage("z", 0, 2, ("x", 7.0), 2, reverse=True) == [("é", 2.0), ("c", 2.0)]
    await store.zrem("z", "b")
    assert await store.zpage("z", -INF, INF, ("b", 2.0), 1) == [("c", 2.0)]
    assert await store.zpage("z", -INF, INF, ("bb", 2.0), 1, reverse=True) == [("a", 2.0)]
    assert await store.zpage("z", -INF, INF, None, 0) == []
    assert await store.zpage("z", 5, 1) == []
    assert await store.zpage("z", -INF, INF, ("high", INF), 5) == []


async def test_zpage_skips_many_members_tied_with_the_mark(store):
    for i in range(7):
        await store.zadd("z", f"m{i}", 1.0)
    await store.zadd("z", "n", 2.0)
    assert await store.zpage("z", -INF, INF, ("m4", 1.0), 2) == [("m5", 1.0), ("m6", 1.0)]
    assert await store.zpage("z", -INF, INF, ("m6", 1.0), 2) == [("n", 2.0)]
    assert await store.zpage("z", -INF, INF, ("m2", 1.0), 3, reverse=True) == [("m1", 1.0), ("m0", 1.0)]
    assert [x for p in await walk(store, "z", limit=1) for x in p] == await store.zrange("z", -INF, INF)


async def test_zpage_and_hgetall_many_keep_types_and_ttls(store, clock):
    await store.set("s", "1")
    await store.zadd("z", "m", 1)
    await store.expire("z", 1)
    with pytest.raises(WrongType):
        await store.zpage("s", -INF, INF)
    with pytest.raises(WrongType):
        await store.zpage("s", -INF, INF, None, 0)
    with pytest.raises(WrongType):
        await store.zpage("s", -1, 0, ("m", 5.0), 2)       # a mark past the range: still the type first
    with pytest.raises(WrongType):
        await store.hgetall_many(["s"])
    assert await store.zpage("z", -INF, INF) == [("m", 1.0)]
    clock.advance(1)
    assert await store.zpage("z", -INF, INF) == []


async def test_hgetall_many(store, clock):
    assert await store.hgetall_many([]) == []
    await store.hset("h1", "f", "1")
    await store.hset("h1", "g", "2")
    await store.hset("h2", "f", "3")
    await store.hset("brief", "f", "4")
    await store.expire("brief", 1)
    keys = ["h1", "missing", "h2", "brief", "h1"]
    assert await store.hgetall_many(keys) == [{"f": "1", "g": "2"}, {}, {"f": "3"}, {"f": "4"}, {"f": "1", "g": "2"}]
    clock.advance(1)
    assert await store.hgetall_many(keys) == [await store.hgetall(k) for k in keys]
    assert await store.hgetall_many(keys) == [{"f": "1", "g": "2"}, {}, {"f": "3"}, {}, {"f": "1", "g": "2"}]
    many = [f"h{i}" for i in range(1200)]                          # more than one query's parameters
    await store.apply([], [HSet(k, "n", str(i)) for i, k in enumerate(many)])
    assert [h.get("n") for h in await store.hgetall_many(many)] == [str(i) for i in range(1200)]


async def test_zset_keeps_ttl_and_expires(store, clock, about):
    await store.zadd("z", "a", 1)
    await store.expire("z", 10)
    await store.zadd("z", "b", 2)
    await store.zrem("z", "a")
    assert await store.ttl("z") == about(10)
    clock.advance(10)
    assert await store.zcount("z", -INF, INF) == 0
    assert await store.zscore("z", "b") is None                  # expired: absent everywhere
    assert await store.zremrange("z", -INF, INF) == 0
    await store.zadd("z", "c", 3)
    assert await store.zrange("z", -INF, INF) == [("c", 3.0)]    # "b" went with the expired key
    assert await store.ttl("z") is None


async def test_zadd_nan_is_refused(store):
    with pytest.raises(StoreError):
        await store.zadd("z", "a", math.nan)
    assert await store.keys() == []


# -- apply -----------------------------------------------------------------------------

async def test_apply(store, clock, about):
    await store.set("pin", "old")
    ok = await store.apply([Check("pin", "old"), Check("lock", None)],
                           [Set("pin", "new", 30), Set("lock", "me"), HSet("h", "f", "1"), HIncr("h", "n", 2),
                            ZAdd("idx", "pin", 5), Delete("gone")], durable=True)
    assert ok is True
    assert await store.mget(["pin", "lock"]) == ["new", "me"]
    assert await store.ttl("pin") == about(30)
    assert await store.hgetall("h") == {"f": "1", "n": "2"}
    assert await store.zrange("idx", -INF, INF) == [("pin", 5.0)]
    # a failing check: nothing is written
    assert await store.apply([Check("pin", "new"), Check("lock", "other")],
                             [Set("pin", "x"), ZRem("idx", "pin")]) is False
    assert await store.get("pin") == "new" and await store.zcount("idx", -INF, INF) == 1
    # no checks: the writes alone, atomically
    assert await store.apply([], [ZRem("idx", "pin"), Delete("lock")]) is True
    assert await store.keys() == ["h", "pin"]
    # an expired key passes a check for absence
    await store.set("t", "1", 1)
    clock.advance(1)
    assert await store.apply([Check("t", None)], [Set("t", "2")]) is True
    assert await store.get("t") == "2"
    # a check on a key of another type fails (it is neither absent nor that string)
    assert await store.apply([Check("h", None)], [Set("x", "1")]) is False
    assert await store.apply([Check("h", "1")], [Set("x", "1")]) is False
    assert await store.get("x") is None


async def test_apply_expire(store, clock, about):
    """``Expire`` in an apply: the TTL of whatever the key holds then, absent keys untouched."""
    await store.hset("h", "f", "1")
    await store.zadd("z", "m", 1.0)
    assert await store.apply([], [HIncr("h", "n", 2), Expire("h", 30), Expire("z", 10), Expire("none", 5),
                                  Set("s", "v"), Expire("s", 20)]) is True
    assert await store.hgetall("h") == {"f": "1", "n": "2"}
    assert await store.ttl("h") == about(30) and await store.ttl("z") == about(10)
    assert await store.ttl("s") == about(20)
    assert await store.keys() == ["h", "s", "z"]
    clock.advance(15)
    assert await store.keys() == ["h", "s"]
    with pytest.raises(StoreError):
        Expire("h", 0)


@pytest.mark.parametrize("bad", [
    [Set("a", "2"), HSet("a", "f", "v")],          # a's type is wrong from the start
    [Set("n", "1"), HSet("n", "f", "v")],          # n becomes a string, then is used as a hash
    [HSet("h", "f", "2"), HIncr("h", "x", 1)],     # not an integer
    [ZAdd("z", "m", 9), HSet("s", "f", "v")],      # wrong type of another key
    [Delete("s"), ZAdd("h", "m", 1)],
    [Set("n", "1"), ZAdd("z", "m", math.nan)],
])
async def test_apply_rolls_everything_back_on_an_error(store, bad):
    await store.set("a", "1")
    await store.set("s", "str")
    await store.hset("h", "x", "abc")
    await store.zadd("z", "m", 1)
    before = {k: await _state(store, k) for k in ("a", "s", "h", "z", "n")}
    with pytest.raises(StoreError):
        await store.apply([Check("a", "1")], bad, durable=True)
    assert {k: await _state(store, k) for k in ("a", "s", "h", "z", "n")} == before
    assert sorted(await store.keys()) == ["a", "h", "s", "z"]


async def _state(store, key):
    for read in (lambda: store.get(key), lambda: store.hgetall(key), lambda: store.zrange(key, -INF, INF)):
        try:
            return await read()
        except WrongType:
            pass


# -- types -----------------------------------------------------------------------------

async def test_wrong_type(store):
    await store.set("s", "1")
    await store.hset("h", "f", "1")
    await store.zadd("z", "m", 1)
    for call in (
        lambda: store.get("h"), lambda: store.get("z"),
        lambda: store.incr("h"),
        lambda: store.hget("s", "f"), lambda: store.hgetall("z"),
        lambda: store.hset("s", "f", "v"), lambda: store.hsetnx("z", "f", "v"),
        lambda: store.hdel("s", "f"), lambda: store.hincr("z", "f"),
        lambda: store.zadd("s", "m", 1), lambda: store.zadd("h", "m", 1),
        lambda: store.zrem("h", "m"), lambda: store.zcount("s", 0, 1),
        lambda: store.zrange("h", 0, 1), lambda: store.zremrange("s", 0, 1), lambda: store.zscore("s", "m"),
    ):
        with pytest.raises(WrongType):
            await call()
    assert await store.get("s") == "1"
    assert await store.hgetall("h") == {"f": "1"}
    assert await store.zrange("z", -INF, INF) == [("m", 1.0)]
    assert issubclass(WrongType, StoreError)


async def test_set_replaces_a_hash_or_a_zset(store):
    await store.hset("k", "f", "1")
    await store.set("k", "v")                      # redis SET overwrites any type
    assert await store.get("k") == "v"
    await store.delete("k")
    await store.hset("k", "g", "2")
    assert await store.hgetall("k") == {"g": "2"}  # no field of the first hash came back
    await store.zadd("y", "m", 1)
    await store.set("y", "v")
    await store.delete("y")
    await store.zadd("y", "n", 2)
    assert await store.zrange("y", -INF, INF) == [("n", 2.0)]


async def test_expired_key_of_other_type_is_absent(store, clock):
    await store.set("k", "v", 1)
    clock.advance(1)
    await store.hset("k", "f", "1")                # no WrongType: the string is gone
    assert await store.hgetall("k") == {"f": "1"}


# -- keys ------------------------------------------------------------------------------

async def test_keys_prefix(store, clock):
    for k in ("pin:a", "pin:b", "pin", "pio", "seen:a", "pin:\U0010ffff", "pin:é"):
        await store.set(k, "1")
    await store.hset("pin:h", "f", "v")
    await store.zadd("pin:z", "m", 1)
    await store.set("pin:gone", "1", 1)
    assert await store.keys("pin:") == ["pin:a", "pin:b", "pin:gone", "pin:h", "pin:z", "pin:é", "pin:\U0010ffff"]
    clock.advance(1)
    assert await store.keys("pin:") == ["pin:a", "pin:b", "pin:h", "pin:z", "pin:é", "pin:\U0010ffff"]
    assert await store.keys("pi") == ["pin", "pin:a", "pin:b", "pin:h", "pin:z", "pin:é", "pin:\U0010ffff", "pio"]
    assert await store.keys("") == sorted(await store.keys(""))
    assert len(await store.keys()) == 9
    assert await store.keys("zzz") == []


@pytest.mark.parametrize("prefix, end", [
    ("", None), ("a", "b"), ("pin:", "pin;"), ("a\U0010ffff", "b"), ("\U0010ffff", None), ("\ud7ff", "\ue000"),
])
def test_prefix_end(prefix, end):
    assert prefix_end(prefix) == end


# -- concurrency -----------------------------------------------------------------------

async def test_concurrent_callers_lose_no_update(store):
    async def work(i):
        for _ in range(50):
            await store.incr("n")
            await store.hincr("h", "shared")
            await store.hincr("h", f"t{i}")
            await store.zadd("z", f"t{i}", await store.zcount("z", -INF, INF))

    await asyncio.gather(*(work(i) for i in range(4)))
    assert await store.get("n") == "200"
    assert await store.hgetall("h") == {"shared": "200", **{f"t{i}": "50" for i in range(4)}}
    assert await store.zcount("z", -INF, INF) == 4


async def test_cas_and_nx_have_one_winner(store):
    async def claim(i):
        return (await store.set("lock", f"c{i}", nx=True),
                await store.cas("token", None, f"c{i}"),
                await store.apply([Check("pair", None)], [Set("pair", f"c{i}"), Set(f"pair:{i}", "won")]))

    results = await asyncio.gather(*(claim(i) for i in range(8)))
    for column, key in enumerate(("lock", "token", "pair")):
        winners = [i for i, r in enumerate(results) if r[column]]
        assert len(winners) == 1 and await store.get(key) == f"c{winners[0]}"
    assert len(await store.keys("pair:")) == 1


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_threads_lose_no_update_on_the_sync_backend(kind, tmp_path):
    s = open_sync_store("memory:" if kind == "memory" else f"file:{tmp_path}/s.db")
    s.hset("claims", "x", "1")
    wins = []
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        wins.append(s.hdel("claims", "x"))
        for _ in range(100):
            s.incr("n")
            s.hincr("h", "shared")
            s.hincr("h", f"t{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert s.get("n") == "400"
        assert s.hgetall("h") == {"shared": "400", **{f"t{i}": "100" for i in range(4)}}
        assert sorted(wins) == [False, False, False, True]
    finally:
        s.close()


# -- memory and file agree on any sequence of operations --------------------------------

KEYS = st.sampled_from(["a", "b", "h", "z"])
FIELDS = st.sampled_from(["f", "g"])
VALUES = st.sampled_from(["0", "1", "-3", "x", ""])
MAYBE = st.one_of(st.none(), VALUES)
TTLS = st.one_of(st.none(), st.sampled_from([-1.0, 0.0, 1.0, 2.5]))
SCORES = st.sampled_from([-INF, -1.0, 0.0, 0.5, 2.0, INF])
WRITES = st.one_of(
    st.builds(Set, KEYS, VALUES, TTLS),
    st.builds(Delete, KEYS),
    st.builds(HSet, KEYS, FIELDS, VALUES),
    st.builds(HIncr, KEYS, FIELDS, st.integers(-2, 2)),
    st.builds(ZAdd, KEYS, FIELDS, SCORES),
    st.builds(ZRem, KEYS, FIELDS),
    st.builds(Expire, KEYS, st.sampled_from([1.0, 2.5])),
)
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES, TTLS, st.booleans()),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("mget"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("cas"), KEYS, MAYBE, MAYBE, TTLS),
    st.tuples(st.just("delete"), KEYS),
    st.tuples(st.just("expire"), KEYS, st.sampled_from([-1.0, 0.0, 1.0, 3.0])),
    st.tuples(st.just("ttl"), KEYS),
    st.tuples(st.just("incr"), KEYS, st.integers(-3, 3)),
    st.tuples(st.just("hget"), KEYS, FIELDS),
    st.tuples(st.just("hgetall"), KEYS),
    st.tuples(st.just("hset"), KEYS, FIELDS, VALUES),
    st.tuples(st.just("hsetnx"), KEYS, FIELDS, VALUES),
    st.tuples(st.just("hdel"), KEYS, FIELDS),
    st.tuples(st.just("hincr"), KEYS, FIELDS, st.integers(-3, 3)),
    st.tuples(st.just("zadd"), KEYS, FIELDS, SCORES),
    st.tuples(st.just("zrem"), KEYS, FIELDS),
    st.tuples(st.just("zcount"), KEYS, SCORES, SCORES),
    st.tuples(st.just("zrange"), KEYS, SCORES, SCORES, st.one_of(st.none(), st.integers(-1, 3))),
    st.tuples(st.just("zremrange"), KEYS, SCORES, SCORES),
    st.tuples(st.just("zpage"), KEYS, SCORES, SCORES, st.one_of(st.none(), st.tuples(FIELDS, SCORES)),
              st.integers(0, 3), st.booleans()),
    st.tuples(st.just("hgetall_many"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("apply"), st.lists(st.builds(Check, KEYS, MAYBE), max_size=2), st.lists(WRITES, max_size=4)),
    st.tuples(st.just("keys"), st.sampled_from(["", "a", "h"])),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.0])),
)


def run(store, clock, op):
    name, *args = op
    if name == "tick":
        clock.advance(args[0])
        return None
    if name == "set":
        key, value, ttl, nx = args
        return store.set(key, value, ttl, nx=nx)
    if name == "zpage":
        *args, reverse = args
        return store.zpage(*args, reverse=reverse)
    return getattr(store, name)(*args)


def outcome(store, clock, op):
    try:
        result = run(store, clock, op)
    except WrongType:
        return "WrongType"
    except StoreError:
        return "StoreError"
    if isinstance(result, float):
        return round(result, 6)
    return result


def everything(store, keys=("a", "b", "h", "z")):
    """Each key's whole state, whatever its type."""
    out = {}
    for k in keys:
        for read in (store.get, store.hgetall, lambda k: store.zrange(k, -INF, INF)):
            try:
                out[k] = read(k)
                break
            except WrongType:
                pass
        out[k, "ttl"] = None if store.ttl(k) is None else round(store.ttl(k), 6)
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=40))
def test_memory_and_file_agree(tmp_path_factory, ops):
    clock = Clock()
    memory = open_sync_store("memory:", clock=clock)
    path = tmp_path_factory.mktemp("agree") / "s.db"
    file = open_sync_store(f"file:{path}", clock=clock)
    try:
        for op in ops:
            assert outcome(memory, clock, op) == outcome(file, clock, op), op
            assert everything(memory) == everything(file), op
        assert memory.keys() == file.keys()
    finally:
        file.close()


# -- memory and Redis agree on any sequence of operations --------------------------------

async def _outcome(store, op):
    name, *args = op
    try:
        if name == "set":
            key, value, ttl, nx = args
            result = await store.set(key, value, ttl, nx=nx)
        elif name == "zpage":
            *args, reverse = args
            result = await store.zpage(*args, reverse=reverse)
        else:
            result = await getattr(store, name)(*args)
    except WrongType:
        return "WrongType"
    except StoreError:
        return "StoreError"
    # Redis keeps TTLs in whole ms, and its time runs (a few ms here) while the clock stands
    return round(result, 1) if isinstance(result, float) else result


async def _everything(store, keys=("a", "b", "h", "z")):
    out = {}
    for k in keys:
        for read in (store.get, store.hgetall, lambda k: store.zrange(k, -INF, INF)):
            try:
                out[k] = await read(k)
                break
            except WrongType:
                pass
        ttl = await store.ttl(k)
        out[k, "ttl"] = None if ttl is None else round(ttl, 1)
    return out


def _alike(ours: dict, theirs: dict, op) -> None:
    """The same data; a TTL on Redis may be less by the real time the test took since it
    was set (the memory store's clock stands still between ticks)."""
    assert ours.keys() == theirs.keys(), op
    for k, v in ours.items():
        w = theirs[k]
        if isinstance(k, tuple) and k[1] == "ttl" and v is not None and w is not None:
            assert v - 2.0 <= w <= v, (op, k, v, w)
        else:
            assert v == w, (op, k, v, w)


async def _agree_with_redis(kind, ops):
    clock = Clock()
    memory = open_store("memory:", clock=clock)
    target = redis_target(kind)
    prefix = unique_prefix()
    redis_store = open_store(target.url(prefix))
    raw = raw_client(target)
    try:
        for op in ops:
            if op[0] == "tick":
                clock.advance(op[1])
                shift_ttls(raw, prefix, op[1])       # the same time passes for Redis' keys
                continue
            ours, theirs = await _outcome(memory, op), await _outcome(redis_store, op)
            if op[0] == "ttl" and isinstance(ours, float) and isinstance(theirs, float):
                assert ours - 2.0 <= theirs <= ours + 0.05, (op, ours, theirs)   # as _alike's TTLs
            else:
                assert ours == theirs, op
            _alike(await _everything(memory), await _everything(redis_store), op)
        assert await memory.keys() == await redis_store.keys()
    finally:
        await redis_store.close()
        raw.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=40))
def test_memory_and_redis_agree(ops):
    asyncio.run(_agree_with_redis("redis", ops))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=40))
def test_memory_and_redis_cluster_agree(ops):
    asyncio.run(_agree_with_redis("redis_cluster", ops))
