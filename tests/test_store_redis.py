"""The Redis store answers exactly as the memory store (the reference) does, on a real
redis-server and on a real 3-master cluster, and keeps the rules only Redis has to keep:
its URLs, one hash tag, SCAN, atomic scripts that change nothing when they fail.

Time: Redis keeps its own clock, so "time passes" is played by shortening every TTL of
the test's prefix (``shift_ttls``) while the memory store's injected clock moves on.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_servers import shared_cluster, shared_server, shift_ttls, unique_prefix
from sessionpin.store import (Check, Delete, Expire, HIncr, HSet, Set, Store, StoreError, WrongType, ZAdd, ZRem,
                              open_store, open_sync_store)
from sessionpin.store.redisstore import RedisStore
from sessionpin.store.redisurl import parse


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- URLs -------------------------------------------------------------------------------

@pytest.mark.parametrize("url, safe, check", [
    ("redis://localhost", "redis://localhost:6379", dict(host="localhost", port=6379, db=0, tls=False)),
    ("redis://:s3cret@h:7000/2", "redis://:***@h:7000/2", dict(password="s3cret", db=2, username=None)),
    ("redis://bob:p%40ss@h/0?prefix={x}:", "redis://bob:***@h:6379/0?prefix={x}:",
     dict(username="bob", password="p@ss", prefix="{x}:")),
    ("rediss://h:6380?ca=/etc/ca.pem", "rediss://h:6380?ca=/etc/ca.pem", dict(tls=True, ca="/etc/ca.pem")),
    ("unix:///run/redis.sock?db=3", "unix:///run/redis.sock?db=3", dict(path="/run/redis.sock", db=3)),
    ("unix://:pw@/run/r.sock", "unix://:***@/run/r.sock", dict(password="pw", path="/run/r.sock")),
    ("redis://h?cluster=1&wait=1&wait_timeout_ms=50&durability=accept-weaker&timeout=0.5",
     "redis://h:6379?cluster=1&wait=1&wait_timeout_ms=50&durability=accept-weaker&timeout=0.5",
     dict(cluster=True, wait=1, wait_timeout_ms=50, durability="accept-weaker", timeout=0.5)),
    ("redis://[::1]:7000", "redis://[::1]:7000", dict(host="::1")),
])
def test_urls(url, safe, check):
    cfg = parse(url)
    assert cfg.safe == safe
    for name, value in check.items():
        assert getattr(cfg, name) == value, name
    assert "s3cret" not in repr(cfg) and "p@ss" not in repr(cfg)


@pytest.mark.parametrize("url, words", [
    ("redis://h?password=hunter2", "unknown option 'password'"),
    ("redis://:hunter2@h?prefix=plain:", "no hash tag"),
    ("redis://:hunter2@h?prefix={}:", "no hash tag"),
    ("redis://:hunter2@h?durability=maybe", "durability"),
    ("redis://:hunter2@h/1?cluster=1", "only database 0"),
    ("redis://:hunter2@h?ca=/x", "rediss"),
    ("redis://:hunter2@h?wait=-1", "wait"),
    ("redis://:hunter2@h?timeout=0", "timeout"),
    ("redis://:hunter2@h?wait=1&wait=2", "given twice"),
    ("redis://:hunter2@/0", "names no host"),
    ("unix://:hunter2@host/x", "socket path"),
])
def test_bad_urls_are_refused_without_the_password(url, words):
    with pytest.raises(StoreError, match=words) as e:
        open_store(url)
    assert "hunter2" not in str(e.value)


def test_open_store_gives_a_redis_store():
    s = open_store("rediss://:pw@example.invalid:6380/0")
    assert isinstance(s, RedisStore) and isinstance(s, Store)
    assert s.url == "rediss://:***@example.invalid:6380/0"
    assert "pw" not in repr(s) and s.describe()["durable"] is False
    with pytest.raises(StoreError, match="no synchronous backend") as e:
        open_sync_store("redis://:hunter2@example.invalid:6380/0")
    assert "hunter2" not in str(e.value)


# -- the two targets ---------------------------------------------------------------------

@pytest.fixture(params=["server", "cluster"])
def target(request):
    return shared_server() if request.param == "server" else shared_cluster()


def sync_client(target):
    import redis

    if hasattr(target, "nodes"):
        node = next(n for n in target.nodes if n.alive)
        return redis.RedisCluster(host="127.0.0.1", port=node.port, decode_responses=True)
    return target.client()


async def test_basics_and_prefix(target):
    prefix = unique_prefix()
    s = open_store(target.url(prefix))
    try:
        assert await s.set("a", "1", 10, durable=True) is True
        await s.hset("h", "f", "v")
        await s.zadd("z", "m", 1.0)
        raw = sync_client(target)
        assert sorted(raw.scan_iter(match=prefix.replace("[", "\\[") + "*")) == [prefix + k for k in ("a", "h", "z")]
        assert await s.keys() == ["a", "h", "z"]            # callers never see the prefix
        other = open_store(target.url(unique_prefix()))
        assert await other.keys() == [] and await other.get("a") is None
        await other.close()
        assert s.describe()["durable"] is True and s.describe()["health"] == "ok"
    finally:
        await s.close()


async def test_what_redis_evicted_is_read_per_node_by_run_id(target):
    """Issue 18: ``evicted_keys`` of the server, or of every node of a cluster, by run_id
    (read by the first call and by ``watch``; the store identity judges it)."""
    s = open_store(target.url(unique_prefix()))
    try:
        await s.get("a")                                    # the first call reads it with the version
        first = s.describe()["durability"]["evicted_keys"]
        nodes = 3 if hasattr(target, "nodes") else 1         # every primary (and the replicas it knows)
        assert isinstance(first, dict) and len(first) >= nodes and all(
            isinstance(k, str) and len(k) == 40 and isinstance(v, int) and v >= 0 for k, v in first.items())
        await s.watch()
        assert s.evicted == first == await s.evictions()
        if not hasattr(target, "nodes"):
            assert list(first) == [s.describe()["durability"]["run_id"]]
    finally:
        await s.close()


async def test_keys_scans_past_one_page_and_escapes_glob_characters():
    s = open_store(shared_server().url())
    try:
        for i in range(2500):                          # more than one SCAN page (COUNT 1000)
            await s.set(f"p:{i:05d}", "1")
        for k in ("a*b", "a?b", "a[b]", "a\\b", "ab"):
            await s.set(k, "1")
        assert len(await s.keys("p:")) == 2500
        assert await s.keys("a*") == ["a*b"]
        assert await s.keys("a[") == ["a[b]"]
        assert await s.keys("a\\") == ["a\\b"]
        assert await s.keys("a") == sorted(["a*b", "a?b", "a[b]", "a\\b", "ab"])
    finally:
        await s.close()


async def test_sorted_sets(target):
    s = open_store(target.url())
    try:
        for member, score in (("b", 1.0), ("a", 1.0), ("c", 0.5), ("d", 3.0), ("e", float("inf"))):
            await s.zadd("z", member, score)
        await s.zadd("z", "d", 2.0)                                     # an update, not a second member
        everything = [("c", 0.5), ("a", 1.0), ("b", 1.0), ("d", 2.0), ("e", float("inf"))]
        assert await s.zrange("z", float("-inf"), float("inf")) == everything   # by score, then member
        assert await s.zrange("z", 1.0, 2.0) == everything[1:4]                 # inclusive bounds
        assert await s.zrange("z", 0, 10, limit=2) == everything[:2]
        assert await s.zrange("z", 0, 10, limit=0) == []
        assert await s.zcount("z", 1.0, 1.0) == 2 and await s.zcount("z", 5, 1) == 0
        assert await s.zrem("z", "a") is True and await s.zrem("z", "a") is False
        assert await s.zremrange("z", 0, 2.0) == 3
        assert await s.zrange("z", float("-inf"), float("inf")) == [("e", float("inf"))]
        assert await s.zrem("z", "e") is True and await s.keys() == []          # empty: no key
    finally:
        await s.close()


async def test_keys_never_lists_a_key_redis_has_not_reclaimed_yet():
    from redis_servers import DURABLE_ARGS, RedisServer

    server = RedisServer(args=DURABLE_ARGS + ("--enable-debug-command", "yes")).start()
    s = open_store(server.url(prefix="{scan}:"))
    try:
        server.client().execute_command("DEBUG", "SET-ACTIVE-EXPIRE", 0)   # expired keys stay in memory
        await s.set("a", "x", 0.02)
        await s.set("b", "x")
        await asyncio.sleep(0.1)
        assert server.client().dbsize() == 2
        assert await s.keys() == ["b"]
    finally:
        await s.close()
        server.cleanup()


async def test_unix_socket(tmp_path):
    from redis_servers import DURABLE_ARGS, RedisServer

    sock = tmp_path / "redis.sock"
    server = RedisServer(args=DURABLE_ARGS + ("--unixsocket", str(sock), "--unixsocketperm", "700")).start()
    s = open_store(f"unix://{sock}?db=2&prefix={{u}}:")
    try:
        assert await s.set("pin", "x", durable=True) is True
        assert server.client(db=2).get("{u}:pin") == "x"
        assert s.describe()["durable"] is True and s.url == f"unix://{sock}?db=2&prefix={{u}}:"
    finally:
        await s.close()
        server.cleanup()


async def test_a_standalone_url_to_a_cluster_node_is_refused():
    s = open_store(shared_cluster().url().replace("&cluster=1", ""))
    try:
        with pytest.raises(StoreError, match=r"\?cluster=1"):
            await s.get("a")
    finally:
        await s.close()


# -- apply: atomic, and a failing one changes nothing -----------------------------------------

async def test_a_failing_apply_changes_nothing(target):
    s = open_store(target.url())
    try:
        await s.set("s", "1")
        await s.hset("h", "f", "x")
        before = {k: await s.get(k) for k in ("s", "n")}, await s.hgetall("h")
        failing = [
            ([Set("n", "new"), HSet("s", "f", "v")], WrongType),            # the type before the apply
            ([Set("n", "new"), Set("k", "v"), HSet("k", "f", "v")], WrongType),   # the type the apply leaves
            ([Set("n", "new"), HIncr("h", "f")], StoreError),               # "x" is not an integer
            ([Set("n", "new"), HSet("h", "g", "y"), HIncr("h", "g")], StoreError),
            ([Set("n", "new"), ZAdd("s", "m", 1.0)], WrongType),
            ([Set("n", "new"), ZRem("h", "m")], WrongType),
        ]
        for writes, error in failing:
            with pytest.raises(error):
                await s.apply([Check("s", "1")], writes, durable=True)
            assert ({k: await s.get(k) for k in ("s", "n")}, await s.hgetall("h")) == before, writes
            assert await s.get("k") is None
        assert await s.apply([Check("s", "2")], [Set("n", "new")]) is False
        assert await s.apply([Check("h", None)], [Set("n", "new")]) is False    # a hash is not absent
        assert await s.get("n") is None
        assert await s.apply([Check("s", "1"), Check("n", None)],
                             [Delete("s"), HSet("s2", "f", "1"), HIncr("s2", "f", 2), ZAdd("z", "m", 2.5),
                              Set("t", "v", 5)]) is True
        assert await s.get("s") is None and await s.hgetall("s2") == {"f": "3"}
        assert await s.zrange("z", 0, 10) == [("m", 2.5)] and 4.9 < await s.ttl("t") <= 5
    finally:
        await s.close()


async def test_text_redis_cannot_hold_is_refused():
    s = open_store(shared_server().url())
    try:
        with pytest.raises(StoreError):
            await s.set("bad\ud800", "1")
        with pytest.raises(StoreError):
            await s.zadd("z", "m", float("nan"))
        await s.set("k", "é\U0010ffff")
        assert await s.get("k") == "é\U0010ffff"
        await s.set("tiny", "1", 0.0004)                 # rounds up to 1 ms, never to "no TTL"
        left = await s.ttl("tiny")                     # once: it may expire between two calls
        assert left is None or left <= 0.001
    finally:
        await s.close()


# -- Redis and memory agree on any sequence of operations -----------------------------------

# Each family mostly uses its own keys (so state builds up), sometimes another's (WrongType).
KEYS = st.sampled_from(["a", "a", "b", "h", "z"])
HKEYS = st.sampled_from(["h", "h", "g", "a"])
ZKEYS = st.sampled_from(["z", "z", "y", "h"])
ANY = st.sampled_from(["a", "b", "g", "h", "y", "z"])
FIELDS = st.sampled_from(["f", "g"])
VALUES = st.sampled_from(["0", "1", "-3", "x", ""])
MAYBE = st.one_of(st.none(), VALUES)
TTLS = st.one_of(st.none(), st.sampled_from([-1.0, 0.0, 1.0, 2.5]))
SCORES = st.sampled_from([-1.0, 0.0, 0.5, 2.0])
MEMBERS = st.sampled_from(["m", "n", "o"])
DURABLE = st.booleans()
WRITE = st.one_of(
    st.builds(Set, KEYS, VALUES, TTLS), st.builds(Delete, ANY), st.builds(HSet, HKEYS, FIELDS, VALUES),
    st.builds(HIncr, HKEYS, FIELDS, st.integers(-3, 3)), st.builds(ZAdd, ZKEYS, MEMBERS, SCORES),
    st.builds(ZRem, ZKEYS, MEMBERS), st.builds(Expire, ANY, st.sampled_from([1.0, 2.5])))
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES, TTLS, st.booleans(), DURABLE),
    st.tuples(st.just("get"), ANY),
    st.tuples(st.just("mget"), st.lists(ANY, max_size=3)),
    st.tuples(st.just("cas"), KEYS, MAYBE, MAYBE, TTLS, DURABLE),
    st.tuples(st.just("delete"), ANY),
    st.tuples(st.just("expire"), ANY, st.sampled_from([-1.0, 0.0, 1.0, 3.0])),
    st.tuples(st.just("ttl"), ANY),
    st.tuples(st.just("incr"), KEYS, st.integers(-3, 3)),
    st.tuples(st.just("hget"), HKEYS, FIELDS),
    st.tuples(st.just("hgetall"), HKEYS),
    st.tuples(st.just("hset"), HKEYS, FIELDS, VALUES),
    st.tuples(st.just("hsetnx"), HKEYS, FIELDS, VALUES),
    st.tuples(st.just("hdel"), HKEYS, FIELDS),
    st.tuples(st.just("hincr"), HKEYS, FIELDS, st.integers(-3, 3)),
    st.tuples(st.just("zadd"), ZKEYS, MEMBERS, SCORES),
    st.tuples(st.just("zadd"), ZKEYS, MEMBERS, SCORES),
    st.tuples(st.just("zrem"), ZKEYS, MEMBERS),
    st.tuples(st.just("zcount"), ZKEYS, SCORES, SCORES),
    st.tuples(st.just("zrange"), ZKEYS, st.just(-1.0), SCORES, st.one_of(st.none(), st.integers(0, 2))),
    st.tuples(st.just("zrange"), ZKEYS, SCORES, SCORES, st.none()),
    st.tuples(st.just("zremrange"), ZKEYS, SCORES, SCORES),
    st.tuples(st.just("apply"), st.lists(st.builds(Check, KEYS, MAYBE), max_size=2),
              st.lists(WRITE, max_size=4), DURABLE),
    st.tuples(st.just("keys"), st.sampled_from(["", "a", "h"])),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.0])),
)


async def run(store, op):
    name, *args = op
    if name == "set":
        key, value, ttl, nx, durable = args
        return await store.set(key, value, ttl, nx=nx, durable=durable)
    if name == "cas":
        key, expected, value, ttl, durable = args
        return await store.cas(key, expected, value, ttl, durable=durable)
    if name == "apply":
        checks, writes, durable = args
        return await store.apply(checks, writes, durable=durable)
    return await getattr(store, name)(*args)


async def outcome(store, op):
    try:
        result = await run(store, op)
    except WrongType:
        return "WrongType"
    except StoreError:
        return "StoreError"
    if isinstance(result, float):
        return round(result, 1)       # Redis' TTLs are whole ms and real time passes (a few ms)
    return result


async def agree(target, ops) -> None:
    clock = Clock()
    memory = open_store("memory:", clock=clock)
    prefix = unique_prefix()
    store = open_store(target.url(prefix))
    raw = sync_client(target)
    try:
        for op in ops:
            if op[0] == "tick":
                clock.t += op[1]
                shift_ttls(raw, prefix, op[1])
                continue
            same_outcome(op, await outcome(memory, op), await outcome(store, op))
        assert await memory.keys() == await store.keys()
    finally:
        await store.close()
        raw.close()


def same_outcome(op, ours, theirs) -> None:
    """The same answer; a TTL on Redis may be less by the real time the test took since the
    key was set (the memory store's clock stands still between ticks; a loaded machine's
    workers take tens of ms an operation): rounding both to 0.1 s failed at 1.0 against 0.9."""
    if op[0] == "ttl" and isinstance(ours, float) and isinstance(theirs, float):
        assert ours - 2.0 <= theirs <= ours + 0.05, (op, ours, theirs)
    else:
        assert ours == theirs, op


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=10, max_size=60))
def test_redis_and_memory_agree(ops):
    asyncio.run(agree(shared_server(), ops))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=10, max_size=60))
def test_redis_cluster_and_memory_agree(ops):
    asyncio.run(agree(shared_cluster(), ops))
