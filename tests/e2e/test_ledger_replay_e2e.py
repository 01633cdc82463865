"""Recorded conversations of every client, replayed through a real mitmdump with their recorded
answers: the ledger in the store equals the sums of the usage those answers state.

The scenarios are the lineage recordings (tests/fixtures/traffic/<agent>/<scenario>-*): Claude
Code, opencode (Anthropic messages and Responses), Codex (Responses), pi (chat, messages,
Responses); each request is answered with the response recorded for it (the fake server of the
recording wrote their usage objects: the real shapes, not real numbers). Every answer reaches
the client byte-identical.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Iterator

import pytest

from sessionpin.accounting import ledger
from sessionpin.store import open_store
from sessionpin.accounting.usage import Usage

from .harness import FakeServer, TestCA
from .replay import FIXTURES, Replay, load
from .test_lineage_e2e import recorded_response
from .test_replay_e2e import RUN, Rig

SCENARIOS = [("claude-code", "lineage"), ("opencode", "lineage"), ("opencode", "lineage-gpt"),
             ("codex", "exec-lineage"), ("pi", "lineage-chat"), ("pi", "lineage-messages"),
             ("pi", "lineage-responses")]
INFERENCE = ("/v1/messages", "/v1/chat/completions", "/v1/responses")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("e2e-ledger-replay")
    ca = TestCA(tmp / "ca")
    fakes = {n: FakeServer(n, ca, prefix="/api/anthropic" if n == "glm" else "")
             for n in ("anthropic", "opencode", "openai", "glm", "alt", "elsewhere")}
    for f in fakes.values():
        f.start()
    r = Rig(tmp, ca, fakes)
    try:
        r.mitm.start()
        yield r
    finally:
        r.mitm.stop()
        for f in fakes.values():
            f.stop()


def stated(path: str, body: str) -> Usage | None:
    """The usage a recorded answer states, read the plain way (every event parsed)."""
    if '"usage"' not in body:
        return None
    if body.lstrip().startswith("{"):
        events = [json.loads(body)]
    else:
        events = [json.loads(line[5:]) for line in body.splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    if path.endswith("/messages"):
        u: dict = {}
        for ev in events:
            if ev.get("type") == "message_start":
                u.update(ev["message"]["usage"])
            elif ev.get("type") == "message_delta" or "content" in ev:
                u.update(ev["usage"])
        read, write = u.get("cache_read_input_tokens") or 0, u.get("cache_creation_input_tokens") or 0
        return Usage(input=u["input_tokens"] + read + write, output=u["output_tokens"], cache_read=read,
                     cache_write_5m=write)
    if path.endswith("/chat/completions"):
        u = [ev["usage"] for ev in events if ev.get("usage")][-1]
        return Usage(input=u["prompt_tokens"], output=u["completion_tokens"],
                     cache_read=(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    u = [(ev.get("response") or ev)["usage"] for ev in events
         if ev.get("type") == "response.completed" or "output" in ev and ev.get("usage")][-1]
    return Usage(input=u["input_tokens"], output=u["output_tokens"],
                 cache_read=(u.get("input_tokens_details") or {}).get("cached_tokens", 0),
                 reasoning=(u.get("output_tokens_details") or {}).get("reasoning_tokens", 0))


def ledgers(rig: Rig) -> tuple[Usage, int]:
    """Every conversation's ledger in the store, summed: tokens and turns."""
    async def read() -> tuple[Usage, int]:
        store = open_store(f"file:{rig.store_path}")
        try:
            total, turns = Usage(), 0
            for k in await store.keys(ledger.PREFIX):
                if k.startswith(ledger.TURNS_PREFIX):
                    continue
                s = await ledger.load(store, k[len(ledger.PREFIX):])
                if s is not None:
                    total, turns = total + s.usage, turns + s.turns
            return total, turns
        finally:
            await store.close()
    return asyncio.run(read())


@pytest.mark.parametrize("agent, scenario", SCENARIOS, ids=[f"{a}/{s}" for a, s in SCENARIOS])
def test_the_ledger_equals_the_recorded_usage(rig: Rig, agent, scenario):
    before, turns_before = ledgers(rig)
    replay = Replay(RUN)
    want, answered = Usage(), 0
    for rec in load(agent, scenario):
        path = next((FIXTURES / agent).glob(f"{scenario}-{rec.nn:02d}-*.json"))
        p = replay.prepare(rec)
        canned = recorded_response(path, replay)
        for f in rig.fakes.values():
            f.canned = (lambda _r, c=canned: c) if canned else None
        try:
            sent = rig.send(p)
        finally:
            for f in rig.fakes.values():
                f.canned = None
        if canned is None or not any(rec.path.split("?")[0].endswith(e) for e in INFERENCE):
            continue
        assert sent.reply.body == canned[2], f"{rec.name}: the answer was changed on its way"
        u = stated(rec.path.split("?")[0], canned[2].decode())
        if u is not None and 200 <= canned[0] < 300:
            want, answered = want + u, answered + 1
    assert answered >= 2
    deadline = time.monotonic() + 15
    while True:
        total, turns = ledgers(rig)
        got = Usage(**{f: getattr(total, f) - getattr(before, f) for f in ("input", "output", "cache_read",
                                                                            "cache_write_5m", "cache_write_1h",
                                                                            "reasoning")})
        if (got == want and turns - turns_before == answered) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (got, turns - turns_before) == (want, answered)
