"""The Redis store: the ``Store`` contract of ``base`` on a Redis server or a Redis Cluster.

Rules it keeps (beyond those of ``base``; the URL's in ``redisurl``, the clients' and
errors' in ``redisconn``, the scripts' in ``redislua``):
- Every key is stored as ``prefix + key`` (default prefix ``{sessionpin}:``): one hash
  tag, so every key is in one slot and every multi-key script runs on one node of a
  cluster. Callers never see the prefix; ``keys()`` finds ours with SCAN, never KEYS.
- One command per call where Redis has it (SET PX NX, INCRBY, HSETNX, HDEL…): each is
  atomic on the server. ``cas`` and ``apply`` are Lua scripts (``register_script``).
- **Durable or raise.** The first call checks the server (``INFO``: Redis >= 7.0, cluster
  mode as the URL says) and its durability (``CONFIG GET append* maxmemory-policy`` on
  every primary). A durable write goes ahead only when every primary has ``appendonly
  yes``, ``appendfsync always`` — Redis then writes and fsyncs the AOF before it replies,
  so the reply means "on disk" — and ``maxmemory-policy noeviction`` (any other policy
  lets Redis drop an acknowledged pin under memory pressure), or the URL says
  ``durability=accept-weaker``. Otherwise (weaker settings, or CONFIG refused so nobody
  can tell) it raises ``NotDurable`` before sending anything. The check is repeated
  before a durable write once it is ``recheck_interval`` (60 s) old, after any failure (a
  failover may have put another node in charge), and by ``watch``, which the proxy calls
  every 2 s and which also sees a restarted server (a new ``run_id``): in a proxy, a
  ``CONFIG SET`` that weakens the server is seen within seconds, not a minute.
- What Redis evicted: ``evicted_keys`` (``INFO stats``) of every node, by ``run_id`` (a
  restart starts the count again under a new one), read with the server's own ``INFO`` at
  the first call, by ``watch`` and by ``evictions()``. Redis cannot say *which* keys it
  evicted; whether a count that grew is a loss is the store identity's to judge
  (``identity.evictions``).
- With ``wait=n`` a durable write also waits (``WAIT n wait_timeout_ms``, on the same
  connection, pipelined) for n replicas. Fewer in time → ``NotReplicated``, a
  ``NotDurable`` that says the write *was* made: it is on the primary's disk and may be
  on some replicas, and undoing it would race with every reader that has seen it.
- Fail closed: a read that cannot reach the data raises ``StoreUnavailable``, a write
  ``StoreUnavailable``/``NotDurable``; the first failure is logged once (ERROR) and the
  recovery once (WARNING). redis-py reconnects by itself; nothing needs reopening.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from .base import Check, NotDurable, StoreError, StoreUnavailable, Write
from .redisconn import make_clients, reason, translate
from .redisinfo import glob_escape, is_refusal, replication
from .redislua import APPLY, CAS, HGETALL_MANY, apply_args, cas_args, ttl_ms
from .redislua import score as score_arg
from .redisurl import ACCEPT_WEAKER, FSYNC_ALWAYS, parse

log = logging.getLogger("sessionpin.store.redis")

RECHECK_INTERVAL = 60.0
SCAN_COUNT = 1000
MIN_VERSION = (7, 0)


class NotReplicated(NotDurable):
    """A durable write Redis made (fsynced on the primary) that fewer replicas than
    ``wait`` acknowledged in time. Unlike every other ``NotDurable``, the write is in
    effect: ``applied`` is True."""

    applied = True

    def __init__(self, message: str, acked: int, wanted: int) -> None:
        super().__init__(message)
        self.acked = acked
        self.wanted = wanted


class RedisStore:
    def __init__(self, url: str, *, recheck_interval: float = RECHECK_INTERVAL) -> None:
        self._cfg = parse(url)
        self.url = self._cfg.safe
        self._prefix = self._cfg.prefix
        self._reads, self._writes = make_clients(self._cfg)
        self._cas = self._writes.register_script(CAS)
        self._apply = self._writes.register_script(APPLY)
        self._hgetall_many = self._reads.register_script(HGETALL_MANY)
        self._recheck_interval = recheck_interval
        self._checked = False                     # version and mode
        self._lock = asyncio.Lock()
        self._durability: bool | None = None      # every primary fsyncs always; None: unknown
        self._server = "not checked yet"          # what the nodes said about their AOF
        self._checked_at: float | None = None
        self._recheck = True
        self._down: str | None = None             # the cause while failing, for describe/logs
        self._closed = False
        self._version = "?"                       # the server's, once checked
        self._replication: dict[str, Any] | None = None   # the primary's role and replicas, by check()
        self._run_id: str | None = None           # the server's (a restart makes a new one)
        self.evicted: dict[str, int] | None = None  # run_id -> evicted_keys, every node; None: not read

    # -- checking the server -----------------------------------------------------------
    async def _ready(self, key: str | None, *, write: bool, durable: bool) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: the store is closed")
        if not self._checked:
            async with self._lock:
                if not self._checked:
                    try:
                        await self._check()
                    except StoreError:
                        raise
                    except Exception as e:   # translate re-raises what is not the server's
                        raise self._fail(e, write=write, durable=durable, key=key) from None

    async def _check(self) -> None:
        info = await self._reads.info("server")     # one section: an old server says its version
        version = str(info.get("redis_version", "0"))
        try:
            major_minor = tuple(int(p) for p in version.split(".")[:2])
        except ValueError:
            major_minor = (0, 0)
        if major_minor < MIN_VERSION:
            raise StoreError(f"{self.url}: Redis {version} is too old: the store needs Redis >= 7.0")
        self._version = version
        self._run_id = str(info.get("run_id") or "") or None
        mode = info.get("redis_mode", "standalone")
        if mode == "cluster" and not self._cfg.cluster:
            raise StoreError(f"{self.url}: this server is a node of a Redis Cluster; add ?cluster=1 to the URL")
        await self._read_evictions()
        await self._check_durability()
        self._checked = True

    async def _check_durability(self) -> None:
        # asked through the writing client: one try (a durable write waits for this), and in
        # a cluster the primaries it knows are the ones it writes to
        try:
            if self._cfg.cluster:
                per_node = await self._writes.config_get("append*", "maxmemory-policy",
                                                         target_nodes=RedisCluster.ALL_NODES)
                configs = list(per_node.values()) if isinstance(per_node, dict) and all(
                    isinstance(v, dict) for v in per_node.values()) else [per_node]
            else:
                configs = [await self._writes.config_get("append*", "maxmemory-policy")]
        except RedisError as e:
            if not is_refusal(e):
                raise
            self._durability, self._server = None, f"unknown: CONFIG GET refused ({reason(e, self._cfg.password)})"
        else:
            said = sorted({f"appendonly {c.get('appendonly', '?')}, appendfsync {c.get('appendfsync', '?')}, "
                           f"maxmemory-policy {c.get('maxmemory-policy', '?')}" for c in configs})
            was = self._durability
            self._durability = all(c.get("appendonly") == "yes" and c.get("appendfsync") == "always"
                                   and c.get("maxmemory-policy") == "noeviction" for c in configs)
            if was and not self._durability:
                log.warning("%s: the server is no longer durable (%s): durable writes are %s", self.url,
                            " / ".join(said), "accepted weaker (durability=accept-weaker)"
                            if self._cfg.durability == ACCEPT_WEAKER else "refused until it is")
            self._server = " / ".join(said) + (f" (on all {len(configs)} primaries)" if len(configs) > 1 else "")
        self._checked_at = time.monotonic()
        self._recheck = False

    async def _durable_gate(self, key: str) -> None:
        stale = self._checked_at is None or time.monotonic() - self._checked_at >= self._recheck_interval
        if stale or self._recheck:
            try:
                await self._check_durability()
            except Exception as e:   # translate re-raises what is not the server's
                raise self._fail(e, write=True, durable=True, key=key) from None
        if self._durability or self._cfg.durability == ACCEPT_WEAKER:
            return
        raise NotDurable(f"{self.url} ({key!r}): durable write refused: the server's AOF is {self._server}; "
                         "a durable write needs appendonly yes and appendfsync always on every primary, "
                         f"or durability={ACCEPT_WEAKER} in the store URL")

    # -- running commands ----------------------------------------------------------------
    def _fail(self, e: BaseException, *, write: bool, durable: bool, key: str | None = None) -> StoreError:
        err = translate(e, self._cfg, write=write, durable=durable, key=key)
        if isinstance(err, StoreUnavailable):
            self._recheck = True
            if self._down is None:
                log.error("%s: Redis unavailable: %s", self.url, reason(e, self._cfg.password))
            self._down = reason(e, self._cfg.password)
        return err

    def _ok(self) -> None:
        if self._down is not None:
            self._down = None
            log.warning("%s: Redis reachable again: recovered", self.url)

    async def _read(self, key: str | None, fn, *args: Any, **kw: Any) -> Any:
        await self._ready(key, write=False, durable=False)
        try:
            result = await fn(*args, **kw)
        except Exception as e:
            raise self._fail(e, write=False, durable=False, key=key) from None
        self._ok()
        return result

    async def _write(self, key: str, durable: bool, *command: Any, script=None, keys: Sequence[str] = (),
                     args: Sequence[str] = ()) -> Any:
        """One write: ``command`` (raw), or ``script`` with ``keys``/``args`` (prefixed)."""
        await self._ready(key, write=True, durable=durable)
        if durable:
            await self._durable_gate(key)
        try:
            if durable and self._cfg.wait:
                result = await self._write_and_wait(key, command, script, keys, args)
            elif script is not None:
                result = await script(keys=list(keys), args=list(args), client=self._writes)
            else:
                result = await self._writes.execute_command(*command)
        except NotReplicated:
            self._ok()
            raise
        except Exception as e:
            raise self._fail(e, write=True, durable=durable, key=key) from None
        self._ok()
        return result

    async def _write_and_wait(self, key: str, command: Sequence[Any], script, keys: Sequence[str],
                              args: Sequence[str]) -> Any:
        """The write and ``WAIT`` pipelined on one connection (WAIT counts the replicas that
        have this connection's writes)."""
        wait, timeout_ms = self._cfg.wait, self._cfg.wait_timeout_ms
        for attempt in (1, 2):
            if script is not None:
                command = ("EVALSHA", script.sha, len(keys), *keys, *args)
            if self._cfg.cluster:
                await self._writes.initialize()
                node = self._writes.get_node_from_key(self._prefix + key)
                pipe = self._writes.pipeline()
                pipe.execute_command(*command, target_nodes=node)
                pipe.execute_command("WAIT", wait, timeout_ms, target_nodes=node)
                try:
                    result, acked = await pipe.execute(raise_on_error=False, allow_redirections=False)
                except Exception:
                    await self._refresh_cluster()
                    raise
                if isinstance(result, Exception):
                    await self._refresh_cluster()
            else:
                pipe = self._writes.pipeline(transaction=False)
                pipe.execute_command(*command)
                pipe.execute_command("WAIT", wait, timeout_ms)
                result, acked = await pipe.execute(raise_on_error=False)
            if isinstance(result, NoScriptError) and attempt == 1:
                # NOSCRIPT: nothing ran; load the script and send both again.
                await self._writes.script_load(script.script)
                continue
            if isinstance(result, Exception):
                raise result
            if isinstance(acked, Exception) or int(acked) < wait:
                got = 0 if isinstance(acked, Exception) else int(acked)
                raise NotReplicated(
                    f"{self.url} ({key!r}): durable write made and fsynced on the primary, but {got} of {wait} "
                    f"replicas acknowledged it within {timeout_ms} ms; it is in effect and may be lost on a "
                    "failover", got, wait)
            return result
        raise AssertionError("unreachable")

    async def _refresh_cluster(self) -> None:
        """After a failed pipelined write: reread the cluster's slots (a failover or a moved
        slot), so the next write goes to the node that owns ours now."""
        try:
            await self._writes.nodes_manager.initialize()
        except Exception:  # noqa: BLE001 - the next write tries again
            pass

    def _k(self, key: str) -> str:
        return self._prefix + key

    # -- strings ---------------------------------------------------------------------------
    async def get(self, key: str) -> str | None:
        return await self._read(key, self._reads.get, self._k(key))

    async def mget(self, keys: Sequence[str]) -> list[str | None]:
        if not keys:
            return []
        return list(await self._read(None, self._reads.execute_command, "MGET", *map(self._k, keys)))

    async def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False,
                  durable: bool = False) -> bool:
        k = self._k(key)
        if ttl is not None and ttl <= 0:
            # "expires now": nothing is stored; without nx whatever was there is deleted.
            if nx:
                return not await self._read(key, self._reads.exists, k)
            await self._write(key, durable, "DEL", k)
            return True
        command: list[Any] = ["SET", k, value]
        if ttl is not None:
            command += ["PX", ttl_ms(ttl)]
        if nx:
            command.append("NX")
        return bool(await self._write(key, durable, *command))

    async def cas(self, key: str, expected: str | None, value: str | None, ttl: float | None = None, *,
                  durable: bool = False) -> bool:
        return bool(await self._write(key, durable, script=self._cas, keys=[self._k(key)],
                                      args=cas_args(expected, value, ttl)))

    async def delete(self, key: str, *, durable: bool = False) -> bool:
        return bool(await self._write(key, durable, "DEL", self._k(key)))

    async def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool:
        if ttl <= 0:
            return bool(await self._write(key, durable, "DEL", self._k(key)))
        return bool(await self._write(key, durable, "PEXPIRE", self._k(key), ttl_ms(ttl)))

    async def ttl(self, key: str) -> float | None:
        ms = await self._read(key, self._reads.pttl, self._k(key))
        return None if ms is None or ms < 0 else ms / 1000

    async def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int:
        return int(await self._write(key, durable, "INCRBY", self._k(key), int(by)))

    # -- hashes ----------------------------------------------------------------------------
    async def hget(self, key: str, field: str) -> str | None:
        return await self._read(key, self._reads.hget, self._k(key), field)

    async def hgetall(self, key: str) -> dict[str, str]:
        return dict(await self._read(key, self._reads.hgetall, self._k(key)))

    async def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None:
        await self._write(key, durable, "HSET", self._k(key), field, value)

    async def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool:
        return bool(await self._write(key, durable, "HSETNX", self._k(key), field, value))

    async def hdel(self, key: str, field: str, *, durable: bool = False) -> bool:
        return bool(await self._write(key, durable, "HDEL", self._k(key), field))

    async def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int:
        return int(await self._write(key, durable, "HINCRBY", self._k(key), field, int(by)))

    # -- sorted sets -------------------------------------------------------------------------
    async def zadd(self, key: str, member: str, score: float, *, durable: bool = False) -> None:
        await self._write(key, durable, "ZADD", self._k(key), score_arg(score), member)

    async def zrem(self, key: str, member: str, *, durable: bool = False) -> bool:
        return bool(await self._write(key, durable, "ZREM", self._k(key), member))

    async def zcount(self, key: str, lo: float, hi: float) -> int:
        return int(await self._read(key, self._reads.execute_command, "ZCOUNT", self._k(key), score_arg(lo),
                                    score_arg(hi)))

    async def zscore(self, key: str, member: str) -> float | None:
        got = await self._read(key, self._reads.zscore, self._k(key), member)
        return None if got is None else float(got)

    async def zrange(self, key: str, lo: float, hi: float, limit: int | None = None) -> list[tuple[str, float]]:
        paged = {} if limit is None else {"offset": 0, "num": max(int(limit), 0)}   # LIMIT 0 0: none
        found = await self._read(key, self._reads.zrange, self._k(key), score_arg(lo), score_arg(hi), byscore=True,
                                 withscores=True, **paged)
        return [(member, float(s)) for member, s in found]

    async def zpage(self, key: str, lo: float, hi: float, after: tuple[str, float] | None = None,
                    limit: int = 1000, *, reverse: bool = False) -> list[tuple[str, float]]:
        # Keyset paging: from the mark's score (inclusive), the members tied with the mark at
        # or before it skipped here (ZRANGE cannot start "after a member"); usually only the
        # mark itself, hence one more than a page is asked for.
        limit = max(int(limit), 0)
        start, end = (hi, lo) if reverse else (lo, hi)
        mark: tuple[float, str] | None = None
        if after is not None:
            score = float(after[1])
            if (score < lo) if reverse else (score > hi):
                await self._read(key, self._reads.execute_command, "ZCARD", self._k(key))   # WRONGTYPE, as the others
                return []
            if lo <= score <= hi:
                start, mark = score, (score, after[0])
        k, out, offset = self._k(key), [], 0
        while True:
            want = limit + (1 if mark is not None else 0)
            page = await self._read(key, self._reads.zrange, k, score_arg(start), score_arg(end), desc=reverse,
                                    byscore=True, withscores=True, offset=offset, num=want)
            for member, s in page:
                p = (float(s), member)
                if mark is None or ((p < mark) if reverse else (p > mark)):
                    out.append((member, p[0]))
            if len(out) >= limit or len(page) < want:
                return out[:limit]
            offset += len(page)

    async def hgetall_many(self, keys: Sequence[str]) -> list[dict[str, str]]:
        if not keys:
            return []

        # one read-only script, one round trip: every key is under the store's one hash tag
        found = await self._read(keys[0], self._hgetall_many, keys=[self._k(k) for k in keys], args=[],
                                 client=self._reads)
        return [dict(zip(flat[::2], flat[1::2])) for flat in found]

    async def zremrange(self, key: str, lo: float, hi: float) -> int:
        return int(await self._write(key, False, "ZREMRANGEBYSCORE", self._k(key), score_arg(lo), score_arg(hi)))

    # -- several keys --------------------------------------------------------------------------
    async def apply(self, checks: Sequence[Check], writes: Sequence[Write], *, durable: bool = False) -> bool:
        keys, args = apply_args(self._prefix, checks, writes)
        if not keys:
            return True
        first = (list(checks) + list(writes))[0].key
        return bool(await self._write(first, durable, script=self._apply, keys=keys, args=args))

    async def keys(self, prefix: str = "") -> list[str]:
        pattern = glob_escape(self._prefix + prefix) + "*"

        async def scan() -> list[str]:
            found = set()
            async for k in self._reads.scan_iter(match=pattern, count=SCAN_COUNT):
                if k.startswith(self._prefix + prefix):
                    found.add(k[len(self._prefix):])
            return sorted(found)
        return await self._read(None, scan)

    # -- the store itself ----------------------------------------------------------------------
    async def check(self) -> dict[str, Any]:
        """Check the server now (reachable, version, durability, the primary's replicas)
        and describe the store."""
        await self._ready(None, write=False, durable=False)
        try:
            await self._check_durability()
            try:
                self._replication = await replication(self._writes, self._cfg.cluster, self._prefix)
            except RedisError as e:
                if not is_refusal(e):
                    raise
                self._replication = None
        except Exception as e:   # translate re-raises what is not the server's
            raise self._fail(e, write=False, durable=False) from None
        self._ok()
        return self.describe()

    async def _read_evictions(self) -> dict[str, int]:
        """``run_id -> evicted_keys`` of the server, or of every node of a cluster (a key
        may have been evicted by a primary that is a replica now)."""
        if self._cfg.cluster:
            # node by node: one that does not answer (down, elsewhere in the cluster) is left
            # out of this reading, not a failure of the store; its count is read when it is back
            await self._reads.initialize()
            nodes = self._reads.get_nodes()
            got = await asyncio.gather(*(self._reads.info("server", "stats", target_nodes=n) for n in nodes),
                                       return_exceptions=True)
            infos = [g for g in got if isinstance(g, dict)]
            if not infos:
                raise next(g for g in got if isinstance(g, BaseException))
        else:
            infos = [await self._reads.info("server", "stats")]
        self.evicted = _evicted(infos)
        return self.evicted

    async def evictions(self) -> dict[str, int]:
        """What Redis evicted, read now (``run_id -> evicted_keys``)."""
        await self._ready(None, write=False, durable=False)
        try:
            got = await self._read_evictions()
        except Exception as e:   # translate re-raises what is not the server's
            raise self._fail(e, write=False, durable=False) from None
        self._ok()
        return got

    async def watch(self) -> None:
        """The server's durability again, and whether it is the server it was (its
        ``run_id``): cheap (INFO server, one CONFIG GET), for a caller that looks every few
        seconds. A restarted server is said once (its data may be gone: the caller's
        identity check tells)."""
        await self._ready(None, write=False, durable=False)
        try:
            info = await self._reads.info("server", "stats")
            run_id = str(info.get("run_id") or "") or None
            if run_id and self._run_id and run_id != self._run_id:
                log.warning("%s: the Redis server restarted (a new run_id): its durability is checked again",
                            self.url)
            self._run_id = run_id or self._run_id
            if self._cfg.cluster:
                await self._read_evictions()
            else:
                self.evicted = _evicted([info])
            await self._check_durability()
        except Exception as e:   # translate re-raises what is not the server's
            raise self._fail(e, write=False, durable=False) from None
        self._ok()

    def describe(self) -> dict[str, Any]:
        cfg = self._cfg
        # durable: True only once the servers said they fsync every write
        durable = bool(self._durability)
        if self._checked_at is None:
            note = "not checked yet: the first call checks the server's durability"
        elif durable:
            note = "durable writes are fsynced by Redis before they return"
        elif cfg.durability == FSYNC_ALWAYS:
            note = "durable writes are refused: the server does not (or may not) fsync every write"
        else:
            note = "durable writes are NOT fsynced before they return (durability=accept-weaker)"
        if durable and cfg.wait:
            note += f", and wait for {cfg.wait} replica(s) (up to {cfg.wait_timeout_ms} ms)"
        return {
            "kind": "redis",
            "cluster": cfg.cluster,
            "url": self.url,
            "version": self._version,
            "prefix": self._prefix,
            "durable": durable,
            "durability": {"required": cfg.durability, "server": self._server, "wait": cfg.wait,
                           "wait_timeout_ms": cfg.wait_timeout_ms, "run_id": self._run_id,
                           "evicted_keys": self.evicted},
            "replication": self._replication,        # None until check() asked
            "health": "ok" if self._down is None and self._checked else (
                f"unavailable: {self._down}" if self._down else "not connected yet"),
            "note": note,
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in (self._reads, self._writes):
            try:
                await client.aclose()
            except Exception:  # noqa: BLE001 - closing a client whose server is gone
                pass

    def close_now(self) -> None:
        """Close from synchronous code with no event loop running: there is nothing to
        flush (every acknowledged write is in Redis); the sockets close with the process.
        Where the loop the store was used on still runs, await ``close()`` on it instead
        (the proxy does, in ``done``): the clients' connections belong to that loop."""
        self._closed = True

    def __repr__(self) -> str:
        return f"<RedisStore {self.url}>"


def _evicted(infos: list[dict[str, Any]]) -> dict[str, int] | None:
    """``run_id -> evicted_keys`` of the nodes that said both (None: none did)."""
    out = {}
    for info in infos:
        run_id, n = info.get("run_id"), info.get("evicted_keys")
        if run_id and n is not None:
            try:
                out[str(run_id)] = int(n)
            except (TypeError, ValueError):
                continue
    return out or None
