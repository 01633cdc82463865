"""``sessionpin show``, ``costs`` and the ledger's columns of ``sessions``, against a real config file
and a real file store holding ledger records as the proxy writes them."""

import asyncio
import json
import time

import pytest

from sessionpin import cli
from sessionpin.accounting import ledger
from sessionpin.records import pins
from sessionpin.store import open_store
from sessionpin.accounting.usage import Usage
from test_cli import env, run  # noqa: F401 (fixtures and helpers of the CLI's tests)

PRICES = '''
[servers.anthropic.prices."claude-opus-*"]
input = 5
output = 25
cache_read = 0.5
cache_write_5m = 6.25
cache_write_1h = 10
'''
A = "aaaa1111-0000-4000-8000-000000000001"
B = "bbbb2222-0000-4000-8000-000000000002"


def turn(t, server="anthropic", model="claude-opus-5-5", **u) -> ledger.Turn:
    return ledger.Turn(t=t, api="anthropic-messages", server=server, model=model, usage=Usage(**u))


def put(url: str) -> list[ledger.Turn]:
    now = time.time()
    a = [ledger.assess(turn(now - 300, input=10_000, output=500, cache_write_5m=9_000), now - 310, None, None),
         turn(now - 200, input=12_000, output=300, cache_read=10_000, cache_write_5m=1_500)]
    a[1] = ledger.assess(a[1], now - 210, None, ledger.prior_of(a[0], None, None))
    a.append(ledger.assess(turn(now - 100, server="glm", model="glm-4.6", input=13_000, output=100), now - 110,
                           None, ledger.prior_of(a[1], None, None)))
    b = [ledger.assess(turn(now - 50, input=1_000_000, output=10_000), now - 60, None, None)]

    async def go():
        store = open_store(url)
        try:
            for session, agent, turns in ((A, "claude-code", a), (B, "opencode", b)):
                await pins.create(store, session, pins.Pin(agent=agent, server="anthropic", since=now, renewed=now))
                prior = None
                for t in turns:
                    prior = ledger.prior_of(t, None, prior)
                    await store.apply([], ledger.writes(session, agent, t, prior))
        finally:
            await store.close()
    asyncio.run(go())
    return a


def test_show_lists_the_turns_with_hits_misses_and_reasons(env, capsys):  # noqa: F811
    env.cfg.write_text(env.cfg.read_text() + PRICES)
    put(env.url)
    code, o, e = run(capsys, "show", A[:8])
    assert code == 0, e
    lines = o.splitlines()
    assert lines[0] == f"session  {A} (claude-code)"
    assert lines[1] == "turns    3, 1 cache misses (server_changed 1)"
    assert "cache read 10.0k = 29%" in lines[2] and "output 900" in lines[2]
    assert lines[3] == "cache    read 100% of its limit"    # 10,000 of 10,000 (the first prompt); a move has none
    assert lines[4].startswith("cost     -  (no price for glm/glm-4.6: input, output)")
    rows = [line.split() for line in lines[7:]]
    assert rows[0][-2:] == ["first", "turn"] and rows[1][-1] == "hit"
    assert "miss: server_changed (from anthropic)" in lines[-1]
    code, o, _ = run(capsys, "show", A, "--json")
    got = json.loads(o)
    assert [t["reason"] for t in got["turns"]] == ["first_turn", None, "server_changed"]
    assert got["tokens"]["input"] == 35_000 and got["cache_efficiency"] == 1.0
    assert got["by_server_model"][0]["cost"] == pytest.approx(
        (1_500 * 5 + 800 * 25 + 10_000 * 0.5 + 10_500 * 6.25) / 1e6)   # uncached = 22,000 - 10,000 - 10,500
    code, _, e = run(capsys, "show", "zzzz")
    assert code == 1 and "no conversation with a ledger matches 'zzzz'" in e


def test_costs_per_server_agent_and_session(env, capsys):  # noqa: F811
    env.cfg.write_text(env.cfg.read_text() + PRICES)
    put(env.url)
    code, o, _ = run(capsys, "costs", "--by", "agent", "--json")
    got = {r["agent"]: r for r in json.loads(o)}
    assert got["opencode"]["cost"] == pytest.approx(1_000_000 * 5 / 1e6 + 10_000 * 25 / 1e6)
    assert got["claude-code"]["cost"] is None and got["claude-code"]["turns"] == 3
    code, o, _ = run(capsys, "costs")
    lines = o.splitlines()
    assert lines[0].split() == ["SERVER", "TURNS", "INPUT", "CACHE", "READ", "WRITTEN", "OUTPUT", "COST"]
    assert lines[1].split()[0] == "anthropic" and lines[1].split()[-1] == "5.35"
    assert lines[2].split()[0] == "glm" and lines[2].split()[-1] == "-" and "no price" in lines[-1]
    code, o, _ = run(capsys, "costs", "--by", "session")
    assert o.splitlines()[1].split()[0] == "bbbb2222"


def test_sessions_gains_the_ledgers_columns_when_there_is_a_ledger(env, capsys):  # noqa: F811
    put(env.url)
    code, o, _ = run(capsys, "sessions")
    assert code == 0
    assert o.splitlines()[0].split()[-4:] == ["TOKENS", "CACHE", "READ", "COST"]
    row = next(line for line in o.splitlines() if line.startswith("aaaa1111"))
    assert row.split()[-3:] == ["35.9k", "29%", "-"]
    code, o, _ = run(capsys, "sessions", "--json")
    rows = {r["session"]: r for r in json.loads(o)}
    assert rows[A]["ledger"]["turns"] == 3 and rows[A]["ledger"]["misses"] == 1


def test_no_ledger_no_columns(env, capsys):  # noqa: F811
    code, o, _ = run(capsys, "costs")
    assert code == 0 and o.startswith("no turns recorded")
    assert cli.main(["show", "x"]) == 1


def test_streamed_json_rows_carry_their_ledgers_read_a_batch_at_a_time(env, capsys, monkeypatch):  # noqa: F811
    from sessionpin.cli import look
    put(env.url)
    monkeypatch.setattr(look, "SORTED_UP_TO", 1)          # two pins: the rows stream
    calls = []
    load_many = ledger.load_many

    async def counted(store, sessions, batch=500):
        calls.append(len(sessions))
        return await load_many(store, sessions, batch)
    monkeypatch.setattr(ledger, "load_many", counted)
    code, o, _ = run(capsys, "sessions", "--json")
    rows = {r["session"]: r for r in json.loads(o)}
    assert code == 0 and rows[A]["ledger"]["turns"] == 3 and rows[B]["ledger"]["turns"] == 1
    assert sum(calls) == 2 and len(calls) <= 2            # one call per batch of rows, not one per row


def test_load_many_is_load_of_each(env):  # noqa: F811
    put(env.url)

    async def go():
        store = open_store(env.url)
        try:
            many = await ledger.load_many(store, [A, B, "nope"], batch=2)
            assert many == {A: await ledger.load(store, A), B: await ledger.load(store, B), "nope": None}
        finally:
            await store.close()
    asyncio.run(go())
