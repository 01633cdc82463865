"""Later: a watch's work on a finished turn runs once its flow's answer has been sent (the flow no
longer live), after what the scheduling step still does, in the order it was scheduled; at most
``MAX_TURNS`` turns of the loop late; at once when no loop runs; a failure is logged and goes
no further."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from sessionpin.proxy import later as L
from sessionpin.proxy.later import Later

SENT = SimpleNamespace(live=False)


async def test_work_runs_after_the_step_that_scheduled_it_in_order():
    later, done = Later("test"), []
    later.call(SENT, done.append, 1)
    later.call(SENT, done.append, 2)
    done.append("the step goes on")
    assert done == ["the step goes on"] and later.pending == 2
    await later.settled()
    assert done == ["the step goes on", 1, 2] and later.pending == 0


async def test_it_waits_until_the_answer_has_been_sent():
    """mitmproxy sends a response hook's answer a turn of the loop after the hook returned (its
    connection's lock, held by the event the eager hook task ran inside): the work waits for it."""
    later, done = Later("test"), []
    flow = SimpleNamespace(live=True)
    loop = asyncio.get_running_loop()

    def send() -> None:                 # what mitmproxy does at the next turn: the answer goes
        done.append("sent")
        flow.live = False
    later.call(flow, done.append, "turn read")
    loop.call_soon(send)
    await later.settled()
    assert done == ["sent", "turn read"]


async def test_a_flow_that_stays_live_is_waited_for_a_bounded_number_of_turns():
    later, done = Later("test"), []
    turns = []
    loop = asyncio.get_running_loop()

    def tick() -> None:
        turns.append(1)
        if len(turns) < 50:
            loop.call_soon(tick)
    loop.call_soon(tick)
    later.call(SimpleNamespace(live=True), done.append, "read")     # a socket: live until it ends
    await asyncio.wait_for(later.settled(), 5)
    assert done == ["read"] and len(turns) <= L.MAX_TURNS + 1


async def test_it_runs_before_an_event_that_comes_after_the_answer():
    later, done = Later("test"), []
    later.call(SENT, done.append, "turn")
    asyncio.get_running_loop().call_soon(done.append, "next event")
    await asyncio.sleep(0)
    assert done == ["turn", "next event"]


def test_without_a_running_loop_it_runs_at_once():
    later, done = Later("test"), []
    later.call(SimpleNamespace(live=True), done.append, 1)
    assert done == [1] and later.pending == 0


async def test_a_failure_is_logged_and_the_rest_still_runs(caplog):
    later, done = Later("ledger"), []

    def fails() -> None:
        raise ValueError("broken")
    later.call(SENT, fails)
    later.call(SENT, done.append, 1)
    with caplog.at_level(logging.ERROR, logger="sessionpin"):
        await later.settled()
    assert done == [1] and later.pending == 0
    assert "ledger: cannot read a finished turn" in caplog.text


async def test_sent_returns_once_the_flow_is_no_longer_live_or_after_the_bound():
    flow, done = SimpleNamespace(live=True), []
    loop = asyncio.get_running_loop()

    async def waits() -> None:
        await L.sent(flow)
        done.append("after")
    task = loop.create_task(waits())
    for _ in range(3):
        await asyncio.sleep(0)
    assert done == []
    flow.live = False
    await task
    assert done == ["after"]
    await asyncio.wait_for(L.sent(SimpleNamespace(live=True)), 5)      # a flow that stays live: bounded
