"""The operator's commands for server pools: use AGENT POOL, pools (and --history), drain, undrain."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import sys
import time

import pytest

from sessionpin import cli
from sessionpin.config import config
from sessionpin.serverpools import members, quota
from sessionpin.records import pins
from sessionpin.cli import launch, proxies
from sessionpin.store import open_store
import ports  # tests/ports.py: a port that is free again at a restart

CONFIG = '''\
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.glm-a]
url = "https://a.example"
key_env = "SP_TEST_A_KEY"

[servers.glm-b]
url = "https://b.example"
key_env = "SP_TEST_B_KEY"

# the two accounts share new conversations
[pools.glm]
members = ["glm-a", "glm-b"]
policy = "round-robin"

[agents.claude-code]
server = "anthropic"   # for now
'''


def free_port() -> int:
    return ports.free_port()      # below the ephemeral range: free again at a restart


@pytest.fixture
def env(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG)
    url = f"file:{tmp_path / 'state.db'}"
    monkeypatch.setenv("SESSIONPIN_CONFIG", str(cfg))
    monkeypatch.setenv("SESSIONPIN_STORE", url)
    nowhere = ("127.0.0.1", free_port())
    monkeypatch.setattr(proxies, "DEFAULT_LISTEN", nowhere)
    monkeypatch.setattr(launch, "DEFAULT_LISTEN", nowhere)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    return type("Env", (), {"cfg": cfg, "url": url})


def run(capsys, *argv):
    code = cli.main(list(argv))
    o, e = capsys.readouterr()
    return code, o, e


def in_store(url, fn):
    async def go():
        store = open_store(url)
        try:
            return await fn(store)
        finally:
            await store.close()
    return asyncio.run(go())


def allocate(url, session):
    cfg = config.parse(CONFIG)
    t = time.time()
    pin = pins.Pin(agent="claude-code", server=None, since=t, renewed=t, rule="opening", turn="opening")
    return in_store(url, lambda s: members.allocate(s, cfg, cfg.pools["glm"], session, pin, pins.Loaded(None, None)))


def test_use_agent_pool_changes_only_that_line(env, capsys):
    code, o, e = run(capsys, "use", "claude-code", "glm")
    assert code == 0, e
    assert o.splitlines()[0] == ("New claude-code conversations → glm (pool: glm-a, glm-b; round-robin, hard affinity). "
                                 "(was: anthropic)")
    assert env.cfg.read_text() == CONFIG.replace('server = "anthropic"   # for now', 'server = "glm"   # for now')
    assert config.load(env.cfg).current("claude-code") == "glm"
    code, o, e = run(capsys, "use", "claude-code", "glmm")
    assert code == 1 and "no server or pool named 'glmm'" in e and "pools: glm" in e


def test_pools_shows_members_cursor_active_exhausted_and_drained(env, capsys):
    for s in ("s-1", "s-2", "s-3"):
        assert isinstance(allocate(env.url, s), members.Allocated)
    q = quota.observe(429, [("retry-after", "600")], time.time())
    in_store(env.url, lambda s: members.write_quota(s, "glm-b", q))
    code, o, e = run(capsys, "drain", "glm-a")
    assert code == 0, e
    assert "Drained glm-a: no new conversations of pool glm go to it" in o
    assert "2 running conversations of pool glm on it stay there (hard affinity)." in o
    code, o, e = run(capsys, "pools", "--json")
    assert code == 0, e
    [p] = json.loads(o)
    assert (p["pool"], p["policy"], p["affinity"], p["cursor"]) == ("glm", "round-robin", "hard", 3)
    rows = {r["member"]: r for r in p["members"]}
    assert rows["glm-a"]["active"] == 2 and rows["glm-a"]["drained_since"] and not rows["glm-a"]["exhausted_until"]
    assert rows["glm-b"]["active"] == 1 and rows["glm-b"]["exhausted_until"] and rows["glm-b"]["headroom"] == 0.0
    code, o, e = run(capsys, "pools")
    assert "pool glm: round-robin, hard affinity; new conversations of no agent; cursor 3" in o
    assert "429, retry-after 600s" in o
    code, o, e = run(capsys, "undrain", "glm-a")
    assert code == 0 and "takes new conversations of pool glm again" in o
    code, o, e = run(capsys, "undrain", "glm-a")
    assert code == 0 and "was not drained" in o


def test_history_lists_allocations_and_drains_without_content(env, capsys):
    allocate(env.url, "sess-aaaaaaaa-1")
    run(capsys, "drain", "glm-b")
    code, o, e = run(capsys, "pools", "--history", "--json")
    assert code == 0, e
    kinds = [(r["kind"], r.get("member"), r.get("session")) for r in json.loads(o)]
    assert ("allocation", "glm-a", "sess-aaaaaaaa-1") in kinds and ("drain", "glm-b", None) in kinds
    code, o, e = run(capsys, "pools", "--history")
    assert "pool glm: round-robin → glm-a" in o


def test_sessions_says_why_a_pin_went_where_it_did(env, capsys):
    allocate(env.url, "sess-bbbbbbbb-2")
    code, o, e = run(capsys, "sessions")
    assert code == 0, e
    assert "pool glm: round-robin → glm-a" in o


def test_drain_needs_a_pool_member_and_remove_refuses_a_member(env, capsys):
    code, o, e = run(capsys, "drain", "anthropic")
    assert code == 1 and "in no pool" in e
    code, o, e = run(capsys, "drain", "nope")
    assert code == 1 and "no server named 'nope'" in e and "glm-a, glm-b" in e
    code, o, e = run(capsys, "servers", "remove", "glm-a", "--force")
    assert code == 1 and "member of pool glm" in e
    assert env.cfg.read_text() == CONFIG


def test_pools_shows_a_far_claim_without_dying_and_reset_forgets_it(env, capsys):
    """Issue 20: a 429 with ``retry-after: 1e300`` stored by a proxy without the bound made
    ``sessionpin pools`` die (OverflowError); ``pools reset MEMBER`` clears it for every proxy."""
    t = time.time()
    far = quota.Quota(observed=t, status=429, headroom=0.0, exhausted_until=1e300, why="429, retry-after 1e+300s")
    in_store(env.url, lambda s: s.set(members.quota_key("glm-b"), quota.encode(far), 600))
    for argv in (("pools",), ("pools", "--json"), ("pools", "glm")):
        code, o, e = run(capsys, *argv)
        assert code == 0, e
    code, o, e = run(capsys, "pools")
    assert "beyond 9999 (429, retry-after 1e+300s)" in o
    code, o, e = run(capsys, "pools", "reset", "glm-b")
    assert code == 0, e
    assert o.startswith("Forgot glm-b's quota state (it was out of quota until beyond 9999: 429, retry-after 1e+300s)")
    assert in_store(env.url, lambda s: s.get(members.quota_key("glm-b"))) is None
    code, o, e = run(capsys, "pools", "--json")
    assert {r["member"]: r["exhausted_until"] for r in json.loads(o)[0]["members"]} == {"glm-a": None, "glm-b": None}
    code, o, e = run(capsys, "pools", "reset", "glm-b")
    assert code == 0 and "glm-b has no quota state; nothing written." in o
    code, o, e = run(capsys, "pools", "--history", "--json")
    assert ("reset", "glm-b") in [(r["kind"], r.get("member")) for r in json.loads(o)]


def test_pools_reset_needs_a_pool_member(env, capsys):
    code, o, e = run(capsys, "pools", "reset", "anthropic")
    assert code == 1 and "in no pool" in e
    code, o, e = run(capsys, "pools", "reset", "nope")
    assert code == 1 and "no server named 'nope'" in e
    code, o, e = run(capsys, "pools", "glm", "glm-a")
    assert code == 1 and "sessionpin pools reset MEMBER" in e


def test_drain_counts_the_pool_s_own_conversations_on_the_member(env, capsys):
    for s in ("s-1", "s-2", "s-3"):
        assert isinstance(allocate(env.url, s), members.Allocated)      # glm-a, glm-b, glm-a
    t = time.time()
    # pinned to glm-a by no pool (`use claude-code glm-a`, or a move): not the pool's
    for s in ("by-hand-1", "by-hand-2", "by-hand-3"):
        in_store(env.url, lambda st, s=s: pins.create(st, s, pins.Pin(agent="claude-code", server="glm-a", since=t,
                                                                      renewed=t, rule="opening", turn="opening")))
    code, o, e = run(capsys, "drain", "glm-a")
    assert code == 0, e
    assert "2 running conversations of pool glm on it stay there (hard affinity)." in o
    assert "3 other conversations pinned to it (by no pool of it) stay there" in o
    soft = env.cfg.read_text().replace('policy = "round-robin"', 'policy = "round-robin"\naffinity = "soft"')
    env.cfg.write_text(soft)
    run(capsys, "undrain", "glm-b")
    code, o, e = run(capsys, "drain", "glm-b")
    assert code == 0, e
    assert "1 running conversation of pool glm on it moves to a fresh member at its next request (soft affinity)." in o
    assert "other conversation" not in o
