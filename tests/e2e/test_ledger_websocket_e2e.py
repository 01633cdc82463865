"""Codex's Responses WebSocket through a real mitmdump: one ledger turn per ``response.completed``,
summed as the server stated (the socket rig of test_websocket_e2e: a recorded thread's messages,
a fake Responses socket server)."""

from __future__ import annotations

import asyncio
import json
import time

from sessionpin.accounting import ledger
from sessionpin.store import open_store
from sessionpin.accounting.usage import Usage

from .replay import Replay
from .test_websocket_e2e import (RUN, WsRig, _alive_and_clean, client_messages, converse, rig,  # noqa: F401
                                 session_of, upgrade)


def read(rig: WsRig, session: str) -> tuple[ledger.Summary | None, list[ledger.Turn]]:
    async def go():
        store = open_store(f"file:{rig.store_path}")
        try:
            return await ledger.load(store, session), await ledger.turns(store, session)
        finally:
            await store.close()
    return asyncio.run(go())


def test_a_codex_socket_gives_a_ledger_turn_per_completed_response(rig: WsRig):  # noqa: F811
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, _ = rig.open(p)
    with ws:
        converse(ws, r, client_messages(1))
    done = [json.loads(e)["response"] for e in ws.received if '"response.completed"' in e]
    want = Usage()
    for resp in done:
        u = resp["usage"]
        want = want + Usage(input=u["input_tokens"], output=u["output_tokens"])
    session = session_of(r, upgrade(1))
    deadline = time.monotonic() + 15
    while True:
        summary, turns = read(rig, session)
        if summary is not None and summary.turns == len(done) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert summary is not None and summary.turns == len(done) == 3
    assert summary.usage == want
    assert [t.id for t in turns] == [resp["id"] for resp in done]
    assert {t.server for t in turns} == {landed} and turns[0].lane.startswith("thread:")
