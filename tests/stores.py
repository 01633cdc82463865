"""The store kinds the conformance tests run against, listed in one place.

``KINDS`` names each kind; ``<kind>_url`` is a fixture giving a fresh, empty store's URL
(it may skip, saying why, where the kind cannot run). Adding a kind — Redis, say — is one
line in ``KINDS`` plus its ``redis_url`` fixture here. Import the fixtures a test module
uses (``from stores import store_url, memory_url, file_url``).

Redis (one shared redis-server, and one shared 3-master cluster, per test run; see
``redis_servers``): a fresh store is a fresh key prefix. Redis keeps its own time, so it
takes no ``clock`` (``store_options``); when a test moves its ``clock`` on, the fixture
makes the same time pass for the prefix's keys (every TTL shortened, ``shift_ttls``).
"""

from __future__ import annotations

import pytest

from redis_servers import shared_cluster, shared_server, shift_ttls, unique_prefix

KINDS = ["memory", "file", "redis", "redis_cluster"]


def is_redis(url: str) -> bool:
    return url.split(":")[0] in ("redis", "rediss", "unix")


def store_options(url: str, clock) -> dict:
    """What ``open_store`` takes besides the URL for this kind."""
    return {} if is_redis(url) else {"clock": clock}


@pytest.fixture
def memory_url() -> str:
    return "memory:"


@pytest.fixture
def file_url(tmp_path) -> str:
    return f"file:{tmp_path}/store.db"


def redis_target(kind: str):
    """The shared server (``redis``) or cluster (``redis_cluster``)."""
    return shared_cluster() if kind == "redis_cluster" else shared_server()


def raw_client(target):
    """A synchronous redis-py client of the server or cluster (for the tests' own look)."""
    import redis

    if hasattr(target, "nodes"):
        node = next(n for n in target.nodes if n.alive)
        return redis.RedisCluster(host="127.0.0.1", port=node.port, decode_responses=True)
    return target.client()


def _redis(request, target) -> str:
    prefix = unique_prefix()
    if "clock" in request.fixturenames:
        clock = request.getfixturevalue("clock")
        raw = raw_client(target)
        request.addfinalizer(raw.close)
        advance = clock.advance

        def advance_both(seconds: float) -> None:
            advance(seconds)
            shift_ttls(raw, prefix, seconds)
        clock.advance = advance_both
    return target.url(prefix)


@pytest.fixture
def redis_url(request) -> str:
    return _redis(request, shared_server())


@pytest.fixture
def redis_cluster_url(request) -> str:
    return _redis(request, shared_cluster())


@pytest.fixture(params=KINDS)
def store_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")
