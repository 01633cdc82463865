"""Later: a watch's work on a finished turn runs at the event loop's next turn, in the order it
was scheduled, after what the scheduling step still does (mitmproxy's write of the answer);
at once when no loop runs; a failure is logged and goes no further."""

from __future__ import annotations

import asyncio
import logging

from sessionpin.proxy.later import Later


async def test_work_runs_after_the_step_that_scheduled_it_in_order():
    later, done = Later("test"), []
    later.call(done.append, 1)
    later.call(done.append, 2)
    done.append("the step goes on")         # what mitmproxy does after the hook: the answer's write
    assert done == ["the step goes on"] and later.pending == 2
    await later.settled()
    assert done == ["the step goes on", 1, 2] and later.pending == 0


async def test_it_runs_before_an_event_that_comes_after_it():
    later, done = Later("test"), []
    loop = asyncio.get_running_loop()
    later.call(done.append, "turn")
    loop.call_soon(done.append, "next event")       # (a socket's data is scheduled after it)
    await asyncio.sleep(0)
    assert done == ["turn", "next event"]


def test_without_a_running_loop_it_runs_at_once():
    later, done = Later("test"), []
    later.call(done.append, 1)
    assert done == [1] and later.pending == 0


async def test_a_failure_is_logged_and_the_rest_still_runs(caplog):
    later, done = Later("ledger"), []

    def fails() -> None:
        raise ValueError("broken")
    later.call(fails)
    later.call(done.append, 1)
    with caplog.at_level(logging.ERROR, logger="sessionpin"):
        await later.settled()
    assert done == [1] and later.pending == 0
    assert "ledger: cannot read a finished turn" in caplog.text
