"""Several proxies, one truth: three real mitmdump routers on one real Redis (AOF,
``appendfsync always``, a password), then on a real 3-master, 3-replica Redis Cluster.

The three routers send new Claude Code conversations to three different servers (glm,
alt, anthropic — see redisrig.py), so a router that decides a running conversation by
itself instead of following its pin sends it somewhere else, and ``check`` sees it.
Shown here, with real processes and real faults (``kill -9``, Redis stopped):

1. concurrent openings of one conversation through all three → one pin, all follow it;
2. a pinned turn costs one GET in Redis (counted with MONITOR, through mitmdump);
3. 30 ``kill -9``s of random routers under load → no acknowledged pin lost, no misroute,
   no key to a wrong server;
4. ``kill -9`` of Redis under load, restart on its AOF → no acknowledged pin lost;
5. Redis stopped → in-scope requests get 424 naming the store (password masked; once the
   router rode out its budget for a blip, with nothing that makes a client retry), nothing
   is forwarded by a guess, a router started meanwhile serves too; Redis back → the same
   routers route again, unrestarted;
6. the password appears nowhere: the routers' output, Redis' keys, status, metrics, the
   CLI's status/doctor/sessions/use (text and --json);
7. the same on the cluster with ``?cluster=1&wait=1``, the master holding our slot
   killed (its replica takes over; the old master rejoins as its replica), after the
   routers were stopped with SIGTERM and exited cleanly (the store closed on their loop).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from functools import cache
from typing import Iterator

import pytest

from sessionpin.reader.ids import short
from redis_servers import RedisServer, redis_cli_binary, shared_cluster, unique_prefix, wait_for
from stores import raw_client

from .harness import toml_config
from .redisrig import CHOICES, Load, World, check, continue_all, served_by
from .test_router_e2e import ALT_ENV
from .test_cli_e2e import sessionpin_argv

SECRET = f"redis-pw-SENTINEL-{uuid.uuid4().hex[:10]}"
KILLS = 30


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("e2e-redis")
    (tmp / "redis").mkdir()
    redis = RedisServer(tmp / "redis", password=SECRET).start()
    prefix = unique_prefix()
    w = World(tmp, redis.url(prefix), redis.client)
    w.prefix, w.redis = prefix, redis          # type: ignore[attr-defined]
    try:
        w.start()
        yield w
    finally:
        for m in w.proxies:
            m.stop(signal.SIGKILL)
        for f in w.fakes.values():
            f.stop()
        redis.cleanup()


def race(world: World, sessions: int) -> None:
    """Each conversation's opening sent through all three routers at once: one server for all."""
    for _ in range(sessions):
        s = str(uuid.uuid4())
        barrier = threading.Barrier(3)
        replies: dict[int, object] = {}

        def send(i: int) -> None:
            barrier.wait(10)
            replies[i] = world.send(i, "opening", s)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        got = {i: (r.status, served_by(r)) for i, r in replies.items()}
        servers = {server for _, server in got.values()}
        assert len(got) == 3 and all(status == 200 for status, _ in got.values()), got
        assert len(servers) == 1, f"one conversation, three routers, several servers: {got}"
        (server,) = servers
        assert world.pin(s).server == server and world.where(s) == {server: 3}
        continue_all(world, {s: server})


def test_concurrent_openings_through_three_routers_make_one_pin(world: World) -> None:
    look = world.redis.client()
    look.config_resetstat()
    n = 12
    race(world, n)
    creates = look.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    # every create is one EVALSHA (the pin and its index in one script); more creates than
    # conversations means routers raced and the losers followed the winner's pin
    assert creates > n, f"{creates} pin creations for {n} conversations: no race was run"


def test_a_pinned_turn_costs_one_get(world: World) -> None:
    s = str(uuid.uuid4())
    r = world.send(0, "opening", s)
    assert (r.status, served_by(r)) == (200, "glm")
    redis = world.redis
    # redis-cli's stdout is a pipe: line-buffered (stdbuf), or a SIGTERM would lose what its
    # stdio still held (seen: 7 of the 10 GETs)
    monitor = subprocess.Popen(["stdbuf", "-oL", redis_cli_binary(), "-p", str(redis.port), "monitor"],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "REDISCLI_AUTH": SECRET})
    lines: list[str] = []
    try:
        assert monitor.stdout.readline().strip() == "OK"
        n = 10
        for _ in range(n):
            r = world.send(0, "continuation", s)
            assert (r.status, served_by(r)) == (200, "glm")
        last = str(uuid.uuid4())
        world.send(0, "opening", last)                   # a last command: its pin's SET ends the watch
        reader = threading.Thread(target=lambda: lines.extend(iter(monitor.stdout.readline, "")), daemon=True)
        reader.start()
        wait_for(lambda: any('"SET"' in ln and f"pin:{last}" in ln for ln in list(lines)), 10,
                 "the last opening's pin in the monitor's output")
    finally:
        monitor.terminate()
    lines = list(lines)
    commands = [re.findall(r'"((?:[^"\\]|\\.)*)"', line) for line in lines if "] " in line]
    p = world.prefix
    # heartbeats, the activity flush (every 5 s, batched), the lineage index written once a
    # response has completed (its request-id, so a resumed Claude Code names its parent), and
    # the store guard's look at the store's identity (every second) and pin count (every 30 s,
    # from the index) and at the pins made in it (``made:``, with the losses other proxies
    # recorded), the ledger's turn records (read and written after the answer, batched): none
    # is on a turn's path; nor is a script's load (once, before its first use)
    background = tuple(p + b for b in ("proxy:", "seen:", "active:", "lin:", "store:", "pinidx", "ledger:", "made:"))
    turn = [c for c in commands if c and c[0].upper() not in ("PING", "INFO", "CONFIG", "HELLO", "CLIENT", "SCRIPT")
            and not any(a.startswith(background) for a in c[1:4])]
    pin_gets = [c for c in turn if c == ["GET", p + "pin:" + s]]
    others = [c for c in turn if c != ["GET", p + "pin:" + s]]
    assert len(pin_gets) == n and all(c[1] != p + "pin:" + s for c in others), turn
    # what follows the n turns is the last opening's GET and create, nothing in between
    assert others[:1] and others[0][0] == "GET" and "pin:" in others[0][1], others[:3]


@pytest.mark.timeout(900)      # 30 mitmdump starts: ~1.5 min idle, 5 min seen on a loaded machine
def test_a_router_whose_config_points_a_pinned_server_elsewhere_refuses_its_conversations(world: World) -> None:
    """Two proxies on one store, their configs apart: router 1's 'glm' names another host (here
    alt's, with alt's key) than the 'glm' router 0 pinned a conversation to. Router 1 must not
    send that conversation to the host its config calls glm: 424 naming the session, the server
    and both addresses; router 0 still serves it where it began."""
    s = str(uuid.uuid4())
    assert world.send(0, "opening", s).status == 200 and world.where(s) == {"glm": 1}
    f, m = world.fakes, world.proxies[1]
    apart = toml_config({"anthropic": {"url": f["anthropic"].url},
                         "glm": {"url": f["alt"].url, "key_env": ALT_ENV}}, {"claude-code": "glm"})
    before = m.config_path.read_text()
    mark = m.line_count
    m.write_config(apart)
    try:
        assert m.wait_output(r"config reloaded from", timeout=5.0, since=mark), m.tail()
        r = world.send(1, "continuation", s)
        assert r.status == 424, (r.status, r.body[:300])
        msg = r.body.decode()
        assert short(s) in msg and "'glm'" in msg and f["glm"].origin in msg and f["alt"].origin in msg, msg
        assert world.where(s) == {"glm": 1}, "never sent to the host router 1 calls glm"
        assert world.send(0, "continuation", s).status == 200 and world.where(s) == {"glm": 2}
    finally:
        mark = m.line_count
        m.write_config(before)
        assert m.wait_output(r"config reloaded from", timeout=5.0, since=mark), m.tail()


def test_thirty_kill_9s_of_routers_under_load_lose_nothing(world: World) -> None:
    rng = random.Random(30)
    errors: list[BaseException] = []
    restarts: list[threading.Thread] = []

    def restart(i: int) -> None:
        try:
            world.start([i])
        except BaseException as e:               # noqa: BLE001 - reported below
            errors.append(e)
    # the clients pause between requests: 30 mitmdump starts (~1 s of CPU each) share 2 cores
    started = time.monotonic()
    with Load(world, threads=3, seed=1, new_share=0.3, pause=0.1) as load:
        load.wait_acks(10)
        for _ in range(KILLS):
            wait_for(lambda: len(world.ready) >= 2, 30, "a second router to be ready")
            i = rng.choice(sorted(world.ready))
            world.stop(i, signal.SIGKILL)
            t = threading.Thread(target=restart, args=(i,))
            t.start()
            restarts.append(t)
            time.sleep(rng.uniform(0.15, 0.5))
        for t in restarts:
            t.join(60)
        assert not errors, errors
        load.wait_acks(5)                          # all three back, still acknowledging
    print(f"{KILLS} kills in {time.monotonic() - started:.1f} s: {sum(load.statuses.values())} answers, "
          f"{len(load.acked)} openings acknowledged, {load.lost} requests cut")
    assert set(load.statuses) == {200}, load.statuses
    assert load.lost > 0, "no request was cut by a kill: the kills hit nothing"
    check(world, load)
    continue_all(world, load.acked)


def test_kill_9_of_redis_loses_no_acknowledged_pin(world: World) -> None:
    with Load(world, threads=3, seed=2, new_share=0.7) as load:
        load.wait_acks(15)
        world.redis.kill()
        # a pin read rides out sessionpin_store_retry_ms (2 s) before it is refused (424);
        # a pin write is refused at once (503)
        wait_for(lambda: load.statuses[424] + load.statuses[503] > 0, 15, "a refusal while Redis is down")
        refused = load.statuses[424] + load.statuses[503]
        world.redis.start()                        # the same port and directory: the AOF is loaded
        load.wait_acks(10)                         # the same routers, unrestarted
    assert refused > 0 and set(load.statuses) <= {200, 424, 503}, load.statuses
    check(world, load)
    continue_all(world, load.acked)


def test_a_stopped_redis_gets_503_naming_it_then_the_same_routers_route_again(world: World) -> None:
    pinned = {}
    for i in range(3):
        s = str(uuid.uuid4())
        r = world.send(i, "opening", s)
        assert (r.status, served_by(r)) == (200, CHOICES[i])
        pinned[s] = CHOICES[i]
    pids = [m.proc.pid for m in world.proxies]
    redis = world.redis
    shown = f"redis://:***@127.0.0.1:{redis.port}/0?prefix={world.prefix}"
    redis.stop()
    fresh = [str(uuid.uuid4()) for _ in range(3)]
    before = {name: len(f.received()) for name, f in world.fakes.items()}
    # a router started while Redis is down serves (and refuses) like the others
    assert world.stop(2, signal.SIGTERM) == 0
    world.start([2])
    for i in range(3):
        for kind, s in (("opening", fresh[i]), ("continuation", list(pinned)[i])):
            r = world.send(i, kind, s)
            assert r.status == 424 and r.header("retry-after") is None, (i, kind, r.status, r.text[:300])
            assert r.header("x-should-retry") == "false"
            message = r.json()["error"]["message"]
            assert shown in message and short(s) in message and SECRET not in r.text, message
    status = world.status(0).json()
    assert status["pins"] is None and status["store_info"]["health"].startswith("unavailable")
    assert {name: len(f.received()) for name, f in world.fakes.items()} == before, "forwarded by a guess"

    redis.start()
    for i in range(3):
        r = world.send(i, "opening", fresh[i])
        assert (r.status, served_by(r)) == (200, CHOICES[i]), (i, r.status, r.text[:300])
    continue_all(world, pinned)
    assert [m.proc.pid for m in world.proxies][:2] == pids[:2]
    beat = f"{world.prefix}proxy:{os.uname().nodename}:{world.proxies[2].proc.pid}"
    wait_for(lambda: redis.client().exists(beat), 5, "the heartbeat of the router started during the outage")


def cli(world: World, *argv: str, router: int = 0) -> subprocess.CompletedProcess[str]:
    """The command as an operator runs it, with the store URL in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_") or k == "SESSIONPIN_STORE_MEMORY"}
    env["SESSIONPIN_STORE"] = world.redis.url(world.prefix)
    return subprocess.run([*sessionpin_argv(), "--config", str(world.proxies[router].config_path), *argv],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)


def test_the_password_is_nowhere(world: World) -> None:
    for _ in range(2):          # running conversations for `use` to count (the tests above leave more)
        assert world.send(0, "opening", str(uuid.uuid4())).status == 200
    said: list[str] = []
    for argv in (["status"], ["status", "--json"], ["sessions", "--json"], ["doctor"], ["doctor", "--json"]):
        p = cli(world, *argv)
        said.append(p.stdout + p.stderr)
        if argv[0] != "doctor":                       # doctor: no CA in this HOME
            assert p.returncode == 0, (argv, p.stderr)
    status = json.loads(said[1])
    assert sum(1 for x in status["proxies"] if x["answering"]) == 3
    assert status["store"] == world.redis.url(world.prefix).replace(SECRET, "***")
    # `use` on the config of the proxy the command reports to (the first that answers)
    first = status["proxy"]["pid"]
    i = next(i for i, m in enumerate(world.proxies) if m.proc.pid == first)
    other = next(c for c in CHOICES if c != CHOICES[i])
    for server in (other, CHOICES[i]):
        p = cli(world, "use", "claude-code", server, router=i)
        assert p.returncode == 0, p.stderr
        said.append(p.stdout + p.stderr)
    assert re.search(r"\n\d+ running conversations stay where they are: \d+ on ", said[-2]), said[-2]
    assert f"The proxy at http://127.0.0.1:{world.proxies[i].port} (pid {first}) applies this within 1 s" in said[-2]
    checks = {c["check"]: c["state"] for c in json.loads(said[4])["checks"]}
    assert checks["store"] == checks["store durability"] == checks["store latency"] == "ok"
    for i in range(3):
        said += [world.status(i).text, Client_get(world, i, "/__sessionpin/metrics")]
    said += [m.output for m in world.proxies]
    raw = world.redis.client()
    for key in raw.scan_iter(count=1000):
        kind = raw.type(key)
        said.append(key + json.dumps(raw.get(key) if kind == "string" else raw.hgetall(key) if kind == "hash"
                                     else raw.zrange(key, 0, -1) if kind == "zset" else kind))
    leaks = [text[:200] for text in said if SECRET in text]
    assert not leaks, leaks
    assert any(world.prefix + "proxy:" in text for text in said)   # the heartbeats were looked at


def Client_get(world: World, i: int, path: str) -> str:      # noqa: N802 - reads as a request
    from .harness import Client
    m = world.proxies[i]
    r = Client.via_proxy(m.port, m.mitm_ca, timeout=10).request("GET", world.fakes["anthropic"].origin + path)
    assert r.status == 200
    return r.text


def test_the_same_on_a_cluster_with_a_master_failed_over(world: World) -> None:
    cluster = shared_cluster()
    cluster.wait_healthy()
    prefix = unique_prefix()
    world.use_store(cluster.url(prefix, wait=1, wait_timeout_ms=500), prefix)
    world.raw = cache(lambda: raw_client(cluster))
    # SIGTERM: each router flushes, drops its heartbeat and closes the Redis clients on its loop
    for i in range(3):
        lines = world.proxies[i].line_count
        assert world.stop(i, signal.SIGTERM) == 0
        tail = world.proxies[i].output.splitlines()[lines:]
        assert not [x for x in tail if re.search(r"Traceback|Unclosed|was destroyed|Error", x)], tail
    world.start()
    race(world, 4)
    with Load(world, threads=3, seed=3, new_share=0.7) as load:
        load.wait_acks(10)
        victim = cluster.master_of(prefix)
        heir = cluster.replica_of(victim)
        victim.kill()
        wait_for(lambda: heir.client().info("replication")["role"] == "master", 20, "the replica's election")
        victim.start()                             # rejoins, as the heir's replica
        cluster.wait_healthy()
        load.wait_acks(10, timeout=40)
    assert cluster.master_of(prefix) is heir
    assert set(load.statuses) <= {200, 424, 503}, load.statuses
    check(world, load)
    continue_all(world, load.acked)
