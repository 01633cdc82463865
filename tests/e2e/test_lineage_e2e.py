"""A conversation is its lineage, end to end: recorded forks and resumes of every client,
replayed through a real mitmdump across a switch of the agent's server and a ``kill -9``.

Each scenario (tests/fixtures/traffic/<agent>/<scenario>-*, recorded with scripts/record,
docs/traffic.md "Lineage") holds a conversation A (its opening, a tool round, a resume) and a
fork of A under a new id; pi's also a conversation B that begins with the same prompt as A.
The fakes answer each request with the response recorded for it, so the lineage the proxy
learns from A's answers is the one the fork's history carries. Between A's first turns and
the rest, the agent is switched to the other server and the proxy is killed (-9) and
restarted. Then every request must land on its conversation's server: A and its fork where
A began, B where B began — never the server the agent is switched to, for A's lineage.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

from sessionpin.store import open_store

from .harness import FakeServer, TestCA, running_rig
from .replay import FIXTURES, Replay, load
from .test_replay_e2e import CURRENT, RUN, Rig

# (agent, scenario, requests of A before the switch)
SCENARIOS = [
    ("claude-code", "lineage", 2),
    ("opencode", "lineage", 3),
    ("opencode", "lineage-gpt", 3),
    ("codex", "exec-lineage", 3),
    ("pi", "lineage-chat", 1),
    ("pi", "lineage-messages", 1),
    ("pi", "lineage-responses", 1),
]
OTHER = {"glm": "alt", "alt": "glm"}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    def fakes(ca: TestCA) -> dict[str, FakeServer]:
        return {n: FakeServer(n, ca, prefix="/api/anthropic" if n == "glm" else "")
                for n in ("anthropic", "opencode", "openai", "glm", "alt", "elsewhere")}
    with running_rig(tmp_path_factory.mktemp("e2e-lineage"), fakes, Rig) as r:
        yield r


def recorded_response(path: Path, replay: Replay) -> tuple[int, list[tuple[str, str]], bytes] | None:
    resp = json.loads(path.read_text()).get("response")
    if not resp or resp.get("status") == 101 or resp.get("body") is None:
        return None
    body = resp["body"] if isinstance(resp["body"], str) else json.dumps(resp["body"])
    return resp["status"], [(k, replay._swap(v)) for k, v in resp["headers"]], replay._swap(body).encode()


def lineage_keys(rig: Rig) -> int:
    async def count() -> int:
        store = open_store(f"file:{rig.store_path}")
        try:
            return len(await store.keys("lin:"))
        finally:
            await store.close()
    return asyncio.run(count())


def conversation(rec) -> str:
    return rec.expect["lineage"]["conversation"]


@pytest.mark.parametrize("agent, scenario, before_switch", SCENARIOS,
                         ids=[f"{a}/{s}" for a, s, _ in SCENARIOS])
def test_forks_and_resumes_reach_their_conversations_server(rig: Rig, agent, scenario, before_switch):
    rig.set_current(without=(), **{k.replace("-", "_"): v for k, v in CURRENT.items()})
    first = CURRENT[agent]
    recs = load(agent, scenario)
    replay = Replay(RUN)
    files = {r.nn: next((FIXTURES / agent).glob(f"{scenario}-{r.nn:02d}-*.json")) for r in recs}
    home: dict[str, str] = {}
    landed: list[tuple[str, str, str | None]] = []
    a_count = 0
    for rec in recs:
        conv = conversation(rec)
        if conv == "A" and a_count == before_switch or conv != "A" and "switched" not in home:
            # A's first turns are on ``first``; the rest happens after a switch and a kill -9
            deadline = time.monotonic() + 5
            while lineage_keys(rig) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)   # the last answer's lineage is written after it (not durable: settle)
            rig.set_current(**{agent.replace("-", "_"): OTHER[first]})
            rig.mitm.restart(sig=signal.SIGKILL)
            home["switched"] = OTHER[first]
        if conv == "A":
            a_count += 1
        p = replay.prepare(rec)
        canned = recorded_response(files[rec.nn], replay)
        for f in rig.fakes.values():
            f.canned = (lambda _r, c=canned: c) if canned else None
        try:
            sent = rig.send(p)
        finally:
            for f in rig.fakes.values():
                f.canned = None
        root = conv.removesuffix("-fork")
        home.setdefault(root, sent.landed or "?")
        landed.append((rec.name, conv, sent.landed))
        if conv == "A-fork" and "fork killed" not in home:
            home["fork killed"] = "yes"
            rig.mitm.restart(sig=signal.SIGKILL)   # right after the fork's first request: its pin holds
    assert home["A"] == first, landed
    wrong = [(name, conv, where) for name, conv, where in landed
             if where != home[conv.removesuffix("-fork")]]
    assert any(conv == "A-fork" for _, conv, _ in landed)
    assert not wrong, f"off their conversation's server: {wrong}\nall: {landed}"
    if "B" in home:   # pi: two conversations that begin alike are two conversations
        assert home["B"] == OTHER[first], landed
