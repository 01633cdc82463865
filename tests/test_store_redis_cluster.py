"""The Redis store on a real Redis Cluster (3 masters, 3 replicas on loopback): a failover —
manual (``CLUSTER FAILOVER`` on the replica) and by ``kill -9`` of the master that owns
our slot — loses no acknowledged durable write (``?wait=1``), and the same store object
recovers by itself.

Semantics on the cluster are checked in test_store_redis.py (the random-operations test
and the unit tests run against the cluster too).
"""

from __future__ import annotations

import asyncio
import time

from redis_servers import shared_cluster, unique_prefix, wait_for
from sessionpin.store import StoreUnavailable, open_store


async def write_until(store, acked: list[str], stem: str, count: int, timeout: float = 30.0) -> int:
    """Durable writes until ``count`` of them succeeded; returns how many failed meanwhile."""
    failed, deadline, i = 0, time.monotonic() + timeout, 0
    while sum(1 for k in acked if k.startswith(stem)) < count:
        assert time.monotonic() < deadline, f"{stem}: no recovery within {timeout} s ({failed} failed)"
        key = f"{stem}{i}"
        i += 1
        try:
            await store.set(key, "v", 86_400, durable=True)
        except StoreUnavailable:             # NotDurable, NotReplicated included: not acknowledged
            failed += 1
            await asyncio.sleep(0.05)
            continue
        acked.append(key)
    return failed


def manual_failover(replica, timeout: float = 30.0) -> None:
    """Wait until ``replica`` (sent ``CLUSTER FAILOVER``) is a master. Redis drops a manual
    failover the master did not answer within 5 s (on a loaded machine it happens): it is
    asked again every 6 s until the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            wait_for(lambda: replica.client().info("replication")["role"] == "master", 6, "the manual failover")
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
            replica.client().execute_command("CLUSTER", "FAILOVER")


async def all_there(store, acked: list[str], timeout: float = 10.0) -> list[str]:
    """The acknowledged keys that are not there. Right after a failover a read may be refused
    (StoreUnavailable: a node still names the dead master for our slot) until the cluster
    settles: it is asked again until it answers (the data is what is checked here)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return [k for k, v in zip(acked, await store.mget(acked)) if v != "v"]
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_failover_keeps_every_acknowledged_durable_write():
    cluster = shared_cluster()
    prefix = unique_prefix()
    s = open_store(cluster.url(prefix, wait=1, wait_timeout_ms=500))
    acked: list[str] = []
    try:
        await write_until(s, acked, "before:", 50)
        assert s.describe()["cluster"] is True and s.describe()["durable"] is True

        # 1. manual failover: the replica takes over once it has everything
        master = cluster.master_of(prefix)
        replica = cluster.replica_of(master)
        replica.client().execute_command("CLUSTER", "FAILOVER")
        writing = asyncio.create_task(write_until(s, acked, "manual:", 100))
        await asyncio.to_thread(manual_failover, replica)
        await writing
        await asyncio.to_thread(wait_for, lambda: cluster.master_of(prefix) is replica, 10,
                                "the other nodes to name the new master")   # gossip takes a moment
        assert await all_there(s, acked) == []

        # 2. the master dies (kill -9): its replica is elected after the node timeout (1 s).
        # It then has no replica of its own, so durable writes (wait=1) fail until the dead
        # node, restarted, rejoins as its replica.
        victim = replica
        heir = cluster.replica_of(victim)
        cluster.wait_healthy()
        writing = asyncio.create_task(write_until(s, acked, "killed:", 100))
        while sum(k.startswith("killed:") for k in acked) < 5:   # writes going on (not a fixed sleep:
            assert not writing.done()                            # on an idle machine 100 writes took
            await asyncio.sleep(0.001)                           # less than one), then the kill, which
        victim.kill()                                            # blocks the loop: no write slips past it
        await asyncio.to_thread(wait_for, lambda: heir.client().info("replication")["role"] == "master", 20,
                                "the heir's election")
        assert await all_there(s, acked) == []             # WAIT 1: every acked write was on the heir
        victim.start()                                     # same port and directory: rejoins as a replica
        failed = await writing
        assert failed > 0                                  # the store did see the outage
        await asyncio.to_thread(wait_for, lambda: cluster.master_of(prefix) is heir, 10,
                                "the other nodes to name the heir")
        await asyncio.to_thread(cluster.wait_healthy)
        assert await all_there(s, acked) == []
        await write_until(s, acked, "after:", 20)
        assert await s.keys("after:") != []
    finally:
        await s.close()
