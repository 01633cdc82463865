"""The Redis store's durability and failures, on real redis-servers of their own:

- a durable write needs AOF with ``appendfsync always`` (or ``durability=accept-weaker``),
  checked with CONFIG GET, and refused — with no effect — otherwise or when CONFIG is off;
- ``?wait=1`` against a real replica, and what a short count means;
- ``kill -9`` of Redis loses no acknowledged durable write;
- Redis stopped, hung, loading, read-only, out of memory: errors, never "absent"; then
  recovery without reopening the store;
- the password is never shown; ``rediss://`` verifies the server's certificate.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import signal
import socket
import time

import pytest

from redis_servers import DURABLE_ARGS, REPLICATION_ARGS, RedisServer, in_sync, wait_for
from sessionpin.store import NotDurable, StoreError, StoreUnavailable, open_store
from sessionpin.store.redisstore import NotReplicated

LOGGER = "sessionpin.store.redis"


@pytest.fixture
def servers():
    started: list[RedisServer] = []

    def start(args=DURABLE_ARGS, **kw) -> RedisServer:
        s = RedisServer(args=args, **kw).start()
        started.append(s)
        return s
    yield start
    for s in started:
        if s.alive and s.proc is not None:
            os.kill(s.proc.pid, signal.SIGCONT)
        s.cleanup()


def logged(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


# -- durability ------------------------------------------------------------------------------

@pytest.mark.parametrize("args, said", [
    (("--appendonly", "no", "--save", ""), "appendonly no"),
    (("--appendonly", "yes", "--appendfsync", "everysec", "--save", ""), "appendfsync everysec"),
    # a server that may evict keys under memory pressure forgets acknowledged pins (issue 18)
    (DURABLE_ARGS + ("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"), "maxmemory-policy allkeys-lru"),
    (DURABLE_ARGS + ("--maxmemory-policy", "volatile-lru"), "maxmemory-policy volatile-lru"),
])
async def test_durable_writes_need_aof_fsync_always(servers, args, said):
    server = servers(args)
    s = open_store(server.url())
    try:
        with pytest.raises(NotDurable, match=said):
            await s.set("pin", "x", durable=True)
        with pytest.raises(NotDurable):
            await s.hset("h", "f", "v", durable=True)
        assert await s.keys() == []                       # refused before anything was sent
        assert await s.set("plain", "1") is True          # ordinary writes are not refused
        d = s.describe()
        assert d["durable"] is False and said in d["durability"]["server"] and "refused" in d["note"]
    finally:
        await s.close()
    weaker = open_store(server.url(durability="accept-weaker"))
    try:
        assert await weaker.set("pin", "x", durable=True) is True
        d = weaker.describe()
        assert d["durable"] is False and d["durability"]["required"] == "accept-weaker"
        assert "NOT fsynced" in d["note"]
    finally:
        await weaker.close()


async def test_durability_is_checked_again(servers):
    server = servers()
    s = open_store(server.url(), recheck_interval=0)
    try:
        assert await s.set("a", "1", durable=True) is True
        server.client().config_set("appendfsync", "everysec")
        with pytest.raises(NotDurable, match="everysec"):
            await s.set("b", "1", durable=True)
        assert await s.get("b") is None
        server.client().config_set("appendfsync", "always")
        assert await s.set("b", "1", durable=True) is True
    finally:
        await s.close()


async def test_a_config_set_is_seen_by_watch_and_a_restart_by_its_run_id(servers, caplog):
    # what the proxy calls every 2 s: a CONFIG SET is seen at once, not a minute later (issue 18)
    server = servers()
    s = open_store(server.url())
    try:
        assert await s.set("a", "1", durable=True) is True
        server.client().config_set("appendonly", "no")
        await s.watch()
        with pytest.raises(NotDurable, match="appendonly no"):
            await s.set("b", "1", durable=True)
        assert await s.get("b") is None
        server.client().config_set("appendonly", "yes")
        server.client().config_set("maxmemory-policy", "allkeys-lru")
        await s.watch()                       # what the proxy calls every 2 s: status is not stale
        assert s.describe()["durable"] is False and "allkeys-lru" in s.describe()["durability"]["server"]
        server.client().config_set("maxmemory-policy", "noeviction")
        before = s.describe()["durability"]["run_id"]
        assert before
        server.restart()
        with caplog.at_level(logging.WARNING, "sessionpin.store.redis"):
            for _ in range(50):               # the first call after the restart may meet the old connection
                try:
                    await s.watch()
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
        assert s.describe()["durability"]["run_id"] != before
        assert any("restarted" in r.getMessage() for r in caplog.records)
    finally:
        await s.close()


async def test_config_disabled_means_durability_unknown(servers):
    server = servers(DURABLE_ARGS + ("--rename-command", "CONFIG", ""))
    s = open_store(server.url())
    try:
        with pytest.raises(NotDurable, match="unknown"):
            await s.set("pin", "x", durable=True)
        assert await s.get("pin") is None
        assert s.describe()["durable"] is False and "CONFIG GET refused" in s.describe()["durability"]["server"]
    finally:
        await s.close()
    weaker = open_store(server.url(durability="accept-weaker"))
    try:
        assert await weaker.set("pin", "x", durable=True) is True
    finally:
        await weaker.close()


# -- WAIT for a replica -------------------------------------------------------------------------

@pytest.fixture
def primary_and_replica(servers):
    primary = servers(DURABLE_ARGS + REPLICATION_ARGS)
    replica = servers(DURABLE_ARGS + ("--replicaof", "127.0.0.1", str(primary.port)))
    wait_for(lambda: in_sync(primary), 20, "the replica's first sync")
    return primary, replica


async def test_wait_for_one_replica(primary_and_replica):
    primary, replica = primary_and_replica
    s = open_store(primary.url(wait=1, wait_timeout_ms=1000))
    prefix = s.describe()["prefix"]
    try:
        for i in range(20):
            assert await s.set(f"pin{i}", "x", durable=True) is True
            assert replica.client().get(f"{prefix}pin{i}") == "x"      # there when the call returned
        assert s.describe()["durability"]["wait"] == 1

        os.kill(replica.proc.pid, signal.SIGSTOP)                       # connected, but acknowledges nothing
        try:
            t0 = time.monotonic()
            with pytest.raises(NotReplicated) as e:
                await s.set("late", "y", durable=True)
            assert 0.95 < time.monotonic() - t0 < 5           # it waited wait_timeout_ms
            assert e.value.applied and (e.value.acked, e.value.wanted) == (0, 1)
            assert isinstance(e.value, NotDurable) and "in effect" in str(e.value)
            assert await s.get("late") == "y"          # made on the primary (and fsynced there): see store.md
            t0 = time.monotonic()
            assert await s.set("ordinary", "z") is True        # ordinary writes do not wait
            assert time.monotonic() - t0 < 0.5                # far less than wait_timeout_ms
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        wait_for(lambda: replica.client().get(f"{prefix}late") == "y", 10, "the replica to catch up")
        assert await s.cas("late", "y", "w", durable=True) is True
    finally:
        await s.close()


async def test_a_read_only_replica_refuses_writes_and_serves_reads(primary_and_replica):
    primary, replica = primary_and_replica
    writer = open_store(primary.url(prefix="{ro}:"))
    await writer.set("k", "v", durable=True)
    wait_for(lambda: replica.client().get("{ro}:k") == "v", 10, "replication")
    s = open_store(replica.url(prefix="{ro}:"))
    try:
        assert await s.get("k") == "v"
        with pytest.raises(NotDurable, match="READONLY"):
            await s.set("k", "w", durable=True)
        with pytest.raises(StoreUnavailable, match="READONLY"):
            await s.hset("h", "f", "v")
        assert await s.get("k") == "v"
    finally:
        await s.close()
        await writer.close()


# -- crashes, outages -----------------------------------------------------------------------------

async def test_sigkill_loses_no_acknowledged_durable_write(servers):
    server = servers()
    s = open_store(server.url())
    acked: list[str] = []

    async def writer(w: int) -> None:
        for i in range(10_000):
            key = f"w{w}:{i}"
            try:
                await s.set(key, f"v{i}", 30 * 86_400, nx=True, durable=True)
                await s.hincr("seen", key)                          # ordinary writes between
            except StoreUnavailable:
                return
            acked.append(key)

    async def killer() -> None:
        while len(acked) < 300:
            await asyncio.sleep(0.005)
        server.kill()                                               # SIGKILL, writes in flight

    try:
        await asyncio.gather(killer(), *(writer(w) for w in range(8)))
        assert len(acked) >= 300
        server.start()                                              # same port, same directory
        values = await s.mget(acked)                                # the same store: no reopen
        assert [k for k, v in zip(acked, values) if v is None] == []
        assert all(v == "v" + k.split(":")[1] for k, v in zip(acked, values))
    finally:
        await s.close()


async def test_stopped_redis_fails_closed_then_recovers(servers, caplog):
    caplog.set_level(logging.WARNING, LOGGER)
    server = servers()
    s = open_store(server.url())
    try:
        await s.set("pin", "x", durable=True)
        server.stop()
        for _ in range(3):
            with pytest.raises(StoreUnavailable) as e:
                await s.get("pin")
            assert s.url in str(e.value) and "cannot read" in str(e.value)
            with pytest.raises(NotDurable):
                await s.set("other", "y", durable=True)
            with pytest.raises(StoreUnavailable):
                await s.hincr("seen", "n")
            with pytest.raises(StoreUnavailable):
                await s.keys()
        assert s.describe()["health"].startswith("unavailable")
        assert len(logged(caplog, logging.ERROR)) == 1
        server.start()
        assert await s.get("pin") == "x"
        assert await s.set("other", "y", durable=True) is True
        assert s.describe()["health"] == "ok"
        assert len(logged(caplog, logging.ERROR)) == 1 and len(logged(caplog, logging.WARNING)) == 1
        assert "recovered" in logged(caplog, logging.WARNING)[0]
    finally:
        await s.close()


async def test_a_restart_between_two_writes_costs_no_write(servers):
    """Redis restarted (SIGTERM, start) while the store was idle: the pooled connections
    the server closed are replaced before the next command, so the first write after the
    restart succeeds (writes are never retried; redis-py 8 skips that check when its
    "maintenance notifications" are on, so the store turns them off)."""
    server = servers()
    for url in (server.url(), server.url(durability="accept-weaker")):
        s = open_store(url)
        try:
            await s.set("k", "1", durable=True)
            await s.hincr("h", "n")
            await asyncio.to_thread(server.restart)      # the loop runs meanwhile, as in a proxy
            assert await s.set("k", "2", durable=True) is True
            assert await s.hincr("h", "n") == 2 and await s.get("k") == "2"
        finally:
            await s.close()


async def test_hung_redis_times_out(servers):
    server = servers()
    s = open_store(server.url(timeout=0.5))
    try:
        await s.set("pin", "x")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="[Tt]imeout"):
                await s.get("pin")
            assert time.monotonic() - t0 < 4               # 3 tries of 0.5 s, 0.1 s apart, on a busy machine
            t0 = time.monotonic()
            with pytest.raises(NotDurable):
                await s.set("pin", "y", durable=True)
            assert time.monotonic() - t0 < 1.3             # one try: a write is never retried (2 tries >= 1.5 s)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert await s.get("pin") in ("x", "y")            # "y" may have been applied: its reply was lost
    finally:
        await s.close()


async def test_loading_redis_is_unavailable_until_loaded(servers):
    server = servers()
    c = server.client()
    pipe = c.pipeline(transaction=False)
    for i in range(10_000):
        pipe.set(f"{{load}}:k{i}", "v")
    pipe.execute()
    c.bgrewriteaof()          # an RDB-format base: key-load-delay slows the loading of each key in it
    wait_for(lambda: c.info("persistence")["aof_rewrite_in_progress"] == 0 and
             c.info("persistence")["aof_rewrite_scheduled"] == 0, 10, "the AOF rewrite")
    server.stop()
    # 200 µs a key: seconds of LOADING; and answer clients every 1 KiB loaded (not 2 MiB)
    server.args = DURABLE_ARGS + ("--key-load-delay", "200", "--loading-process-events-interval-bytes", "1024")
    server.spawn()
    s = open_store(server.url(prefix="{load}:"))
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not seen or seen[-1] != "v":
            assert time.monotonic() < deadline
            try:
                seen.append(await s.get("k9999"))           # the last key loaded: never None
            except StoreUnavailable as e:
                seen.append(str(e))
                if "durable" not in " ".join(seen):
                    with pytest.raises(NotDurable, match="LOADING"):
                        await s.set("k1", "w", durable=True)
                    seen.append("durable refused")
            await asyncio.sleep(0.05)
        assert None not in seen
        assert any("LOADING" in x for x in seen[:-1]), seen
        assert await s.get("k1") == "v"
    finally:
        await s.close()


async def test_out_of_memory_refuses_writes_and_serves_reads(servers):
    server = servers()
    s = open_store(server.url())
    try:
        await s.set("pin", "x", durable=True)
        server.client().config_set("maxmemory", "1")
        with pytest.raises(NotDurable, match="OOM"):
            await s.set("new", "y", durable=True)
        with pytest.raises(StoreUnavailable, match="OOM"):
            await s.cas("pin", "x", "z")
        assert await s.get("pin") == "x"
        server.client().config_set("maxmemory", "0")
        assert await s.cas("pin", "x", "z", durable=True) is True
    finally:
        await s.close()


# -- secrets ----------------------------------------------------------------------------------------

async def test_the_password_is_never_shown(servers, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "correct-horse-battery"
    server = servers(password=secret)
    s = open_store(server.url())
    wrong = open_store(server.url().replace(secret, "wrong-staple-" + secret[:5] + "x"))
    shown: list[str] = []
    try:
        await s.set("pin", "x", durable=True)
        shown += [s.url, repr(s), str(s.describe())]
        with pytest.raises(StoreUnavailable) as e:
            await wrong.get("pin")
        shown += [str(e.value), wrong.url, str(wrong.describe())]
        server.stop()
        for call in (s.get("pin"), s.set("pin", "y", durable=True)):
            with pytest.raises(StoreUnavailable) as e:
                await call
            shown.append(str(e.value))
    finally:
        await s.close()
        await wrong.close()
    shown += [r.getMessage() for r in caplog.records]
    assert all(":***@" in x for x in (s.url, wrong.url))
    assert not [x for x in shown if secret in x or "wrong-staple" in x]


def _certificates(d):
    """A CA and a server certificate for "localhost" only, signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test ca")).issuer_name(name("test ca"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (d / "ca.pem").write_bytes(ca.public_bytes(pem))
    (d / "server.pem").write_bytes(cert.public_bytes(pem))
    (d / "server.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))


async def test_rediss_verifies_the_server_certificate(servers, tmp_path):
    from redis_servers import free_port

    _certificates(tmp_path)
    tls_port = free_port()
    server = servers(DURABLE_ARGS + ("--tls-port", str(tls_port), "--tls-cert-file", str(tmp_path / "server.pem"),
                                     "--tls-key-file", str(tmp_path / "server.key"),
                                     "--tls-ca-cert-file", str(tmp_path / "ca.pem"), "--tls-auth-clients", "no"))
    assert server.alive
    ca = tmp_path / "ca.pem"
    good = open_store(f"rediss://localhost:{tls_port}/0?ca={ca}")
    unknown_ca = open_store(f"rediss://localhost:{tls_port}/0")                  # the system's CAs
    wrong_name = open_store(f"rediss://127.0.0.1:{tls_port}/0?ca={ca}")          # the cert names localhost
    try:
        assert await good.set("pin", "x", durable=True) is True
        assert await good.get("pin") == "x"
        with pytest.raises(StoreUnavailable, match="(?i)certificate"):
            await unknown_ca.get("pin")
        with pytest.raises(StoreUnavailable, match="(?i)certificate|match|hostname"):
            await wrong_name.get("pin")
    finally:
        for s in (good, unknown_ca, wrong_name):
            await s.close()


async def test_other_errors_are_store_errors(servers):
    server = servers()
    s = open_store(server.url())
    try:
        await s.set("n", "12345678901234567890123")
        with pytest.raises(StoreError) as e:
            await s.incr("n")
        assert not isinstance(e.value, StoreUnavailable)
    finally:
        await s.close()


async def test_asyncio_losing_a_connection_mid_write_is_unavailable_not_a_crash():
    """python/cpython#136234: writelines on a transport asyncio has just lost raises a
    TypeError (AttributeError on some versions) from inside asyncio; redis-py lets it
    through. It happened in test_redis_e2e's cluster failover (a 502 "could not decide")."""
    from sessionpin.store.redisconn import asyncio_lost_it, translate
    from sessionpin.store.redisurl import parse

    a, b = socket.socketpair()
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=a)
    transport.close()
    await asyncio.sleep(0)                        # asyncio drops the transport's insides
    b.close()
    try:
        transport.writelines([b"PING\r\n"])
    except (TypeError, AttributeError) as e:
        lost = e
    else:
        pytest.skip("this Python's asyncio has python/cpython#136234 fixed: nothing to translate")
    assert asyncio_lost_it(lost)
    cfg = parse("redis://:hunter2@127.0.0.1:1/0")
    err = translate(lost, cfg, write=True, durable=True, key="pin:x")
    assert isinstance(err, NotDurable) and "connection lost while sending" in str(err)
    assert isinstance(translate(lost, cfg, write=False, durable=False), StoreUnavailable)
    with pytest.raises(TypeError):                # a TypeError of our own is a bug: not translated
        translate(TypeError("'NoneType' object is not callable"), cfg, write=False, durable=False)
