"""Later: what a watch reads from a turn, done once the answer has left.

mitmproxy sends a buffered answer (and a streamed one's last bytes: the end of its chunks,
HTTP/2's end of stream) only once every ``response`` hook has returned. What the watches read
from a finished turn (the ledger's prompt shape, its verdict and counters; the lineage's
anchors) decides nothing about that answer, yet run in the hook it held each one back by its
time: ~60 µs a 10 KB turn, a tenth of what the router added to a request's latency (issue 22).

``Later.call(flow, fn, *args)`` runs ``fn`` once the flow's answer has left instead. Not at
the loop's next turn: mitmproxy runs a response hook inside an eager task, nested in the
handling of the event before it, and sends the answer only once that handling lets go of its
connection's lock — one turn of the loop later, behind anything the hook scheduled (measured:
a 5 ms ``call_soon`` from a response hook still held each answer 5 ms). So ``fn`` waits, a turn
at a time, while the flow is live (mitmproxy marks it done as it sends the answer's end), at
most ``MAX_TURNS`` turns (a flow that stays live: a socket, a client still sending). The loop
runs callbacks in the order they were scheduled, so two turns' work runs in the order their
answers ended, and before any later event of their connections (those come from the
sockets, after). With no running loop (a hook called from synchronous code) ``fn`` runs at
once, as before.

A failure is logged with the watch's name and goes no further (the answer has left).
``settled()`` waits until nothing scheduled is left (tests, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger("sessionpin")


MAX_TURNS = 8     # turns of the loop a call waits for its flow to be sent, at most


class Later:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0        # calls scheduled and not yet run

    def call(self, flow: Any, fn: Callable[..., Any], *args: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._call(fn, args)
            return
        self.pending += 1
        loop.call_soon(self._run, loop, flow, fn, args, 1)

    def _run(self, loop: asyncio.AbstractEventLoop, flow: Any, fn: Callable[..., Any], args: tuple,
             turns: int) -> None:
        if getattr(flow, "live", False) and turns < MAX_TURNS:
            loop.call_soon(self._run, loop, flow, fn, args, turns + 1)     # not sent yet
            return
        self.pending -= 1
        self._call(fn, args)

    def _call(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("sessionpin: %s: cannot read a finished turn", self.name)

    async def settled(self) -> None:
        while self.pending:
            await asyncio.sleep(0)


async def sent(flow: Any) -> None:
    """Return once the flow's answer has been sent (as ``Later.call`` waits: a turn of the loop
    at a time while the flow is live, at most ``MAX_TURNS``). For a coroutine that mitmproxy's
    eager task factory would otherwise run inside the hook, up to its first wait."""
    turns = 0
    while getattr(flow, "live", False) and turns < MAX_TURNS:
        await asyncio.sleep(0)
        turns += 1


async def after_hook() -> None:
    """Return once what the hook running now hands mitmproxy has been sent: two turns of the
    loop (mitmproxy sends it one turn after the hook returns, ``scripts/bench_after_answer.py``:
    work scheduled twice runs after the send). For a request, which has no mark that says it
    left: a coroutine that mitmproxy's eager task factory would otherwise run inside the hook."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def tell_view(flow: Any) -> None:
    """Tell mitmweb a flow changed after its hooks had returned (its comment and metadata
    gained a watch's figures). mitmdump has no view to tell; tests without a master neither."""
    try:
        from mitmproxy import ctx, hooks
        if ctx.master.addons.get("view") is not None:
            ctx.master.addons.trigger(hooks.UpdateHook([flow]))
    except Exception:
        pass
