"""Real Redis servers for the tests (never a fake): started on free loopback ports in
temporary directories, stopped when the test process exits.

- ``redis_server_binary()`` finds ``redis-server`` ($SESSIONPIN_REDIS_SERVER, which
  scripts/test sets, then PATH, /usr/sbin, /usr/bin) and fails, saying how to get it,
  when there is none: Redis tests are never skipped.
- ``RedisServer`` is one redis-server with AOF on and ``appendfsync always`` unless told
  otherwise; it can be SIGKILLed, stopped and started again on the same port and data.
- ``shared_server()`` and ``shared_cluster()`` are started once per test process and
  shared by every test; each test keeps to its own key prefix (``unique_prefix()``) so
  none sees another's keys and no test needs to flush.
- ``shift_ttls`` makes time pass for a prefix's keys (every TTL shortened, expired keys
  deleted) so that TTL rules can be checked against an injected clock: Redis keeps its
  own time and cannot be told another.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import ports  # tests/ports.py
from pathlib import Path

import redis

DURABLE_ARGS = ("--appendonly", "yes", "--appendfsync", "always", "--save", "")
# a replica's first sync starts at once (the default waits 5 s for more replicas to come)
REPLICATION_ARGS = ("--repl-diskless-sync-delay", "0")
_counter = itertools.count(1)


def _find(name: str, env: str) -> str:
    candidates = [os.environ.get(env, ""), shutil.which(name) or "", f"/usr/sbin/{name}", f"/usr/bin/{name}"]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise RuntimeError(f"{name} not found (looked at ${env}, PATH, /usr/sbin, /usr/bin): the Redis store tests "
                       f"run real servers. Install it (Debian/Ubuntu: apt-get install -y redis-server; "
                       f"scripts/test does this when run as root) or set {env}.")


def redis_server_binary() -> str:
    return _find("redis-server", "SESSIONPIN_REDIS_SERVER")


def redis_cli_binary() -> str:
    server = redis_server_binary()
    beside = Path(server).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    return _find("redis-cli", "SESSIONPIN_REDIS_CLI")


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the test process dies, however it dies
    (atexit does not run when pytest is killed, e.g. by SIGPIPE)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                                         # not Linux: atexit only


def free_port() -> int:
    return ports.free_port()      # below the ephemeral range: free again at a restart


def unique_prefix() -> str:
    return f"{{t{os.getpid()}-{next(_counter)}}}:"


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while True:
        try:
            if cond():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class RedisServer:
    """One redis-server process in ``dir`` on a loopback port."""

    def __init__(self, dir: Path | None = None, *, args: tuple[str, ...] = DURABLE_ARGS,
                 password: str | None = None, port: int | None = None) -> None:
        self.dir = Path(dir or tempfile.mkdtemp(prefix="sessionpin-redis-"))
        self.args = tuple(args)
        self.password = password
        self.port = port
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        """Start redis-server on ``port`` (a free one if None) without waiting for it."""
        self.port = self.port or free_port()
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               "--daemonize", "no", "--logfile", "redis.log", "--protected-mode", "no", *self.args]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)

    def start(self) -> "RedisServer":
        """Start and wait until it answers PING (loaded). A port taken meanwhile: another one,
        unless this is a restart on the port it had."""
        fixed = self.port
        for _ in range(5):
            self.port = fixed
            self.spawn()
            try:
                wait_for(lambda: self.proc.poll() is not None or self.client().ping(), 20, "redis-server to start")
            except TimeoutError:
                self.proc.kill()
                raise
            if self.proc.poll() is None:
                return self
            if fixed:
                time.sleep(0.2)
        raise RuntimeError(f"redis-server did not start; see {self.dir / 'redis.log'}")

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, decode_responses=True,
                           socket_timeout=5, **kw)

    def url(self, prefix: str | None = None, scheme: str = "redis", **options: object) -> str:
        auth = f":{self.password}@" if self.password else ""
        query = {"prefix": prefix or unique_prefix(), **{k: str(v) for k, v in options.items()}}
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0?" + "&".join(f"{k}={v}" for k, v in query.items())

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last save."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> "RedisServer":
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def in_sync(master: RedisServer, replicas: int = 1) -> bool:
    """``replicas`` replicas of ``master`` are online (their first sync done)."""
    info = master.client().info("replication")
    online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"]
    return len(online) >= replicas


class LocalCluster:
    """A Redis Cluster of 3 masters and 3 replicas on loopback, made by redis-cli."""

    NODE_ARGS = DURABLE_ARGS + REPLICATION_ARGS + ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0")

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sessionpin-cluster-"))
        self.nodes: list[RedisServer] = []

    def start(self) -> "LocalCluster":
        for i in range(6):
            d = self.root / f"n{i}"
            d.mkdir()
            self.nodes.append(RedisServer(d, args=self.NODE_ARGS).start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([redis_cli_binary(), "--cluster", "create", *addrs, "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30) -> None:
        """Every live node says the cluster is ok, and each master has a replica in sync."""
        def ok() -> bool:
            live = [n for n in self.nodes if n.alive]
            if any(n.client().cluster("info").get("cluster_state") != "ok" for n in live):
                return False
            masters = [n for n in live if n.client().info("replication")["role"] == "master"]
            return len(masters) == 3 and all(in_sync(n) for n in masters)
        wait_for(ok, timeout, "the cluster to be healthy")

    def url(self, prefix: str | None = None, **options: object) -> str:
        node = next(n for n in self.nodes if n.alive)
        return node.url(prefix, cluster=1, **options)

    def master_of(self, key: str) -> RedisServer:
        """The live master that owns ``key``'s slot (as the cluster says now)."""
        asker = next(n for n in self.nodes if n.alive)
        slot = asker.client().cluster("keyslot", key)
        for start, end, master, *_ in asker.client().execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise RuntimeError(f"no master owns slot {slot}")

    def replica_of(self, master: RedisServer) -> RedisServer:
        for n in self.nodes:
            if n.alive and n is not master:
                info = n.client().info("replication")
                if info["role"] == "slave" and int(info["master_port"]) == master.port:
                    return n
        raise RuntimeError(f"no live replica of the master on port {master.port}")

    def cleanup(self) -> None:
        for n in self.nodes:
            n.kill()
        shutil.rmtree(self.root, ignore_errors=True)


_shared: dict[str, object] = {}


def shared_server() -> RedisServer:
    """One durable redis-server for the whole test process."""
    if "server" not in _shared:
        server = RedisServer().start()
        atexit.register(server.cleanup)
        _shared["server"] = server
    return _shared["server"]  # type: ignore[return-value]


# Set by tests/conftest.py for each test: only a test of the slow tier may start a cluster.
CLUSTER_ALLOWED = True


def shared_cluster() -> LocalCluster:
    if "cluster" not in _shared:
        if not CLUSTER_ALLOWED:
            raise RuntimeError("this test starts a Redis Cluster: name it in tests/conftest.py SLOW "
                               "(the default tier starts none)")
        cluster = LocalCluster()
        atexit.register(cluster.cleanup)
        _shared["cluster"] = cluster.start()
    return _shared["cluster"]  # type: ignore[return-value]


SHIFT = """
local ms = tonumber(ARGV[1])
for _, k in ipairs(KEYS) do
  local left = redis.call('PTTL', k)
  if left > 0 then
    if left - ms <= 0 then redis.call('DEL', k) else redis.call('PEXPIRE', k, left - ms) end
  end
end
return #KEYS
"""


def shift_ttls(client, prefix: str, seconds: float) -> None:
    """As if ``seconds`` passed for the keys under ``prefix`` (one slot: one script).

    ``client`` is a redis.Redis or redis.RedisCluster (sync)."""
    if isinstance(client, redis.RedisCluster):
        keys = list(client.scan_iter(match=prefix.replace("[", "\\[") + "*", count=1000,
                                     target_nodes=redis.RedisCluster.PRIMARIES))
    else:
        keys = list(client.scan_iter(match=prefix.replace("[", "\\[") + "*", count=1000))
    if keys:
        client.eval(SHIFT, len(keys), *keys, round(seconds * 1000))


def evict(server, at_least: int = 3) -> int:
    """Memory pressure until Redis evicted ``at_least`` keys: under ``volatile-random`` only
    keys with a TTL go (the fillers made here), so what the store holds stays whole — Redis
    cannot say so, and neither can sessionpin. Returns how many it evicted."""
    r = server.client()
    before = int(r.info("stats")["evicted_keys"])
    r.config_set("maxmemory-policy", "volatile-random")
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 256 * 1024))
    n = 0
    while int(r.info("stats")["evicted_keys"]) - before < at_least:
        r.set(f"filler:{n}", "x" * 8192, ex=600)
        n += 1
        assert n < 10_000, "Redis evicted nothing"
    r.config_set("maxmemory", "0")
    r.config_set("maxmemory-policy", "noeviction")
    return int(r.info("stats")["evicted_keys"]) - before
