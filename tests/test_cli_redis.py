"""The sessionpin command on a Redis store (a real redis-server with a password): every
command says exactly what it says on a file store; doctor checks reachability,
persistence, replicas and latency; ``store copy`` moves the state file → Redis and back;
the password is never printed.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import uuid

import pytest

from redis_servers import RedisServer, unique_prefix
from sessionpin import cli
from sessionpin.records.documents import Heartbeat, heartbeat_encoder
from sessionpin.store import open_store
from test_cli import env, put_pins, read_pin  # noqa: F401 - the fixture is used by name

SECRET = f"cli-pw-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def server():
    s = RedisServer(password=SECRET).start()
    yield s
    s.cleanup()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    o, e = capsys.readouterr()
    assert SECRET not in o + e, f"the password was printed: {(o + e)[:500]}"
    return code, o, e


def same_run(capsys, monkeypatch, url: str) -> list[str]:
    """One operator session against the store at ``url``; its output, the URL made neutral."""
    monkeypatch.setenv("SESSIONPIN_STORE", url)
    put_pins(url, [("aaaa1111-0000-4000-8000-000000000001", "claude-code", "anthropic", 300, 200, 4),
                   ("bbbb2222-0000-4000-8000-000000000002", "claude-code", "anthropic", 300, None, 0),
                   ("cccc3333-0000-4000-8000-000000000003", "claude-code", None, 300, 250, 1),
                   ("dddd4444-0000-4000-8000-000000000004", "opencode", "glm", 300, 100, 2)])
    said = []
    for argv in (["sessions"], ["sessions", "--server", "anthropic", "--json"], ["use", "claude-code", "glm"],
                 ["move", "aaaa11", "glm", "--yes"], ["forget", "cccc33"], ["forget", "bbbb22", "--yes"],
                 ["sessions"], ["status"], ["pool"], ["use", "claude-code", "anthropic"]):
        code, o, e = run(capsys, *argv)
        said.append(f"$ {' '.join(argv)} [exit {code}]\n{o}{e}")
    shown = open_store(url).url
    text = "\n".join(said).replace(shown, "<store>")
    text = re.sub(r'"(since|last_seen)_epoch": [0-9.]+', r'"\1_epoch": <t>', text)
    text = re.sub(r"\(pid \d+\)|\d{4}-\d\d-\d\dT[0-9:]+Z", "<t>", text)
    return text.splitlines()


def test_every_command_says_on_redis_what_it_says_on_a_file(env, server, capsys, monkeypatch):
    on_file = same_run(capsys, monkeypatch, env.url)
    on_redis = same_run(capsys, monkeypatch, server.url(unique_prefix()))
    # the one difference: status says how a Redis store is doing (a file's faults show in doctor)
    redis_says = "store   <store>  (ok; durable writes are fsynced by Redis before they return)"
    assert on_redis.count(redis_says) == 1 and "store   <store>" in on_file
    on_redis[on_redis.index(redis_says)] = "store   <store>"
    assert on_redis == on_file
    text = "\n".join(on_redis)
    assert "3 running conversations stay where they are: 2 on anthropic, 1 not routed." in text
    assert "Moved aaaa1111 (claude-code) from anthropic to glm." in text
    assert "Forgot cccc3333 (claude-code, was not routed)." in text
    assert "store   <store>" in text and "pool: empty" in text


def test_status_json_shows_the_store_masked_and_how_durable(env, server, capsys, monkeypatch):
    url = server.url(unique_prefix())
    monkeypatch.setenv("SESSIONPIN_STORE", url)
    code, o, _ = run(capsys, "status", "--json")
    got = json.loads(o)
    assert code == 0 and got["store"] == url.replace(SECRET, "***") and got["store_exists"] is True
    assert got["store_info"]["durable"] is True and got["store_info"]["health"] == "ok"
    code, o, _ = run(capsys, "status")
    assert "(ok; durable writes are fsynced by Redis before they return)" in o.splitlines()[1]


def test_a_redis_store_nothing_made_is_said_so_not_made_by_a_read(env, server, capsys, monkeypatch, tmp_path):
    """A Redis URL no proxy used (a wrong database or prefix): `sessions` said "no pinned
    conversations" as of a store in use, and a read command made the store's identity there
    and remembered it. Now nothing is written and each read command says nothing sessionpin
    made is there (as "no file yet" for a file); the first proxy or pool command makes it."""
    prefix = unique_prefix()
    url = server.url(prefix)
    monkeypatch.setenv("SESSIONPIN_STORE", url)
    monkeypatch.setenv("SESSIONPIN_STORE_MEMORY", str(tmp_path / "memory"))
    shown = open_store(url).url
    code, o, _ = run(capsys, "sessions")
    assert code == 0 and "no pinned conversations (nothing sessionpin made is in " in o and shown in o, o
    assert "check the URL's database and prefix" in o
    code, o, _ = run(capsys, "status")
    assert "nothing sessionpin made is in" in o.splitlines()[2], o
    code, o, _ = run(capsys, "status", "--json")
    assert json.loads(o)["store_unused"] is True
    code, o, _ = run(capsys, "doctor")
    assert lines(o)["store identity"][0] == "warn", o
    assert server.client().keys(prefix + "*") == []           # nothing written
    assert not (tmp_path / "memory").exists() or not any((tmp_path / "memory").iterdir())
    put_pins(url, [("aaaa1111-0000-4000-8000-000000000001", "claude-code", "anthropic", 300, 200, 4)])
    code, o, _ = run(capsys, "status", "--json")     # pins with no identity (an older release): made, as before
    assert json.loads(o)["store_unused"] is False


def lines(out: str) -> dict[str, tuple[str, str]]:
    got = {}
    for line in out.splitlines():
        m = re.match(r"^(ok|warn|FAIL)\s+(store[a-z ]*?)\s{2,}(.*)$", line)
        if m:
            got[m.group(2)] = (m.group(1), m.group(3))
    return got


def test_doctor_checks_reachability_persistence_replicas_and_latency(env, capsys, monkeypatch):
    redis = RedisServer(password=SECRET).start()
    base = redis.url(unique_prefix())
    try:
        monkeypatch.setenv("SESSIONPIN_STORE", base)
        _, o, _ = run(capsys, "doctor")
        got = lines(o)
        assert got["store"][0] == "ok" and got["store"][1].startswith(f"{base.replace(SECRET, '***')}: reachable "
                                                                   "(Redis 7.")
        assert got["store durability"] == ("ok", "durable writes are fsynced by Redis before they return "
                                                 "(appendonly yes, appendfsync always, "
                                                 "maxmemory-policy noeviction)")
        assert got["store latency"][0] == "ok" and re.search(r"round trip: \d+\.\d ms", got["store latency"][1])
        assert "store replicas" not in got                     # no wait=: nothing to say
        assert redis.client().keys("*doctor*") == []           # the probe is removed

        monkeypatch.setenv("SESSIONPIN_STORE", base + "&wait=1&wait_timeout_ms=100")
        got = lines(run(capsys, "doctor")[1])
        assert got["store replicas"][0] == "FAIL" and "wait=1, but the primary has 0 replica(s) online" in \
            got["store replicas"][1]

        redis.client().config_set("appendfsync", "everysec")
        monkeypatch.setenv("SESSIONPIN_STORE", base)
        code, o, _ = run(capsys, "doctor")
        got = lines(o)
        assert code == 1 and got["store durability"][0] == "FAIL"
        assert "durable writes are refused: the server says appendonly yes, appendfsync everysec" in \
            got["store durability"][1]
        # the fix that lasts: the server's configuration file, not a CONFIG SET the next restart forgets
        assert "in the server's configuration file (redis.conf" in got["store durability"][1]
        assert "maxmemory-policy noeviction" in got["store durability"][1]
        assert "not CONFIG SET" in got["store durability"][1]
        monkeypatch.setenv("SESSIONPIN_STORE", base + "&durability=accept-weaker")
        got = lines(run(capsys, "doctor")[1])
        assert got["store durability"][0] == "warn" and "NOT fsynced before they return" in got["store durability"][1]
        assert got["store latency"][0] == "ok"

        redis.stop()
        code, o, _ = run(capsys, "doctor")
        got = lines(o)
        assert code == 1 and got["store"][0] == "FAIL" and "Error 111" in got["store"][1]
        assert got["store"][1].startswith(f"redis://:***@127.0.0.1:{redis.port}/0")
        code, _, e = run(capsys, "sessions")
        assert code == 1 and e.count("\n") == 1 and "cannot read" in e and "redis://:***@" in e
    finally:
        redis.cleanup()


def heartbeat_in(url: str) -> None:
    async def put() -> None:
        s = open_store(url)
        beat = Heartbeat(pid=4242, host="elsewhere", started=1.0, beat=1.0)
        await s.set(beat.key, heartbeat_encoder.encode(beat).decode(), 30)
        await s.close()
    asyncio.run(put())


def ttls(url: str) -> dict[str, float | None]:
    async def look() -> dict[str, float | None]:
        s = open_store(url)
        try:
            return {k: await s.ttl(k) for k in await s.keys()}
        finally:
            await s.close()
    return asyncio.run(look())


def test_store_copy_file_to_redis_and_back(env, server, capsys):
    redis_url = server.url(unique_prefix())
    back = f"file:{env.dir / 'back.db'}"
    put_pins(env.url, [("s1", "claude-code", "glm", 100, 50, 3), ("s2", "opencode", None, 100, None, 0)])
    heartbeat_in(env.url)                                  # a proxy runs on the file store
    code, o, _ = run(capsys, "store", "copy", env.url, redis_url)
    copied = int(re.match(r"Copied (\d+) keys", o).group(1))
    assert code == 0 and copied >= 2 + 2 + 1              # pins, their indexes, the index names, activity
    assert "Left out 1 proxy heartbeat" in o and redis_url.replace(SECRET, "***") in o
    want = {k: t for k, t in ttls(env.url).items() if not k.startswith("proxy:")}
    got = ttls(redis_url)
    assert set(got) == set(want)
    assert all((got[k] is None) == (want[k] is None) and (want[k] is None or abs(got[k] - want[k]) < 5)
               for k in want)
    code, o, _ = run(capsys, "store", "copy", env.url, redis_url, "--json")
    assert json.loads(o) | {"from": "", "to": ""} == {"from": "", "to": "", "copied": 0, "equal": copied,
                                                       "skipped": 0, "heartbeats_left_out": 1}
    code, o, _ = run(capsys, "store", "copy", redis_url, back)
    assert code == 0 and o.startswith(f"Copied {copied} keys") and "Left out" not in o
    assert read_pin(back, "s1").server == "glm" and read_pin(back, "s2").server is None

    # onto a store a proxy uses: refused, nothing written, unless --force
    assert read_pin(env.url, "s1").server == "glm"
    put_pins(redis_url, [("s3", "claude-code", "anthropic", 10, None, 0)])
    code, _, e = run(capsys, "store", "copy", redis_url, env.url)
    assert code == 1 and "a proxy uses" in e and "pid 4242 on elsewhere" in e and "--force" in e
    assert read_pin(env.url, "s3") is None
    code, o, _ = run(capsys, "store", "copy", redis_url, env.url, "--force")
    assert code == 0 and read_pin(env.url, "s3").server == "anthropic"

    code, _, e = run(capsys, "store", "copy", env.url, env.url.replace("state.db", "./state.db"))
    assert code == 1 and "the same store" in e


def test_run_hands_a_password_to_mitmdump_in_its_environment_only(env, server, capsys, monkeypatch):
    url = server.url(unique_prefix())
    monkeypatch.setenv("SESSIONPIN_STORE", url)
    code, o, _ = run(capsys, "run", "--dry-run")
    words = shlex.split(o)
    assert code == 0 and words[0] == "SESSIONPIN_STORE=" + url.replace(SECRET, "***")
    assert not any(w.startswith("sessionpin_store=") for w in words)


def test_keys_redis_evicted_fail_commands_until_accept_loss(env, capsys, monkeypatch, tmp_path):
    """Issue 18: Redis says how many keys it evicted, not which; the CLI remembers the count
    and, once it grew, fails like for any lost store until the operator decides."""
    from redis_servers import evict

    (tmp_path / "redis").mkdir()
    s = RedisServer(tmp_path / "redis").start()
    try:
        url = s.url(unique_prefix())
        monkeypatch.setenv("SESSIONPIN_STORE", url)
        put_pins(url, [("aaaa1111-0000-4000-8000-000000000001", "claude-code", "glm", 300, 200, 4)])
        assert run(capsys, "sessions")[0] == 0                     # seen whole: its count remembered
        n = evict(s)
        code, o, e = run(capsys, "sessions")
        assert code != 0 and f"may have lost pins: Redis evicted {n} keys since" in e, o + e
        code, o, e = run(capsys, "status")
        assert "LOST: store" in o and "Redis evicted" in o, o + e
        code, o, e = run(capsys, "store", "accept-loss", "--json")
        assert code == 0 and json.loads(o)["evicted_keys"] == n, o + e
        assert run(capsys, "sessions")[0] == 0
        evict(s, 1)                                                 # after the acceptance: a loss again
        code, o, e = run(capsys, "sessions")
        assert code != 0 and "Redis evicted" in e
        code, o, e = run(capsys, "store", "accept-loss")
        assert code == 0 and "Redis evicted" in o, o + e
    finally:
        s.cleanup()
