"""Later: what a watch reads from a turn, done once the answer has left.

mitmproxy sends a buffered answer (and a streamed one's last bytes: the end of its chunks,
HTTP/2's end of stream) only once every ``response`` hook has returned. What the watches read
from a finished turn (the ledger's prompt shape, its verdict and counters; the lineage's
anchors) decides nothing about that answer, yet run in the hook it held each one back by its
time: ~60 µs a 10 KB turn, a tenth of what the router added to a request's latency (issue 22).

``Later.call(fn, *args)`` runs ``fn`` at the event loop's next turn instead. mitmproxy wrote
the answer in this one: the hook's return, its layer's next commands and the write to the
client's socket run without yielding to the loop. The loop runs callbacks in the order they
were scheduled, so two turns' work runs in the order their answers ended, and before any
later event of their connections (those come from the sockets, after). With no running loop
(a hook called from synchronous code) ``fn`` runs at once, as before.

A failure is logged with the watch's name and goes no further (the answer has left).
``settled()`` waits until nothing scheduled is left (tests, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger("sessionpin")


class Later:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0        # calls scheduled and not yet run

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._run(fn, args, scheduled=False)
            return
        self.pending += 1
        loop.call_soon(self._run, fn, args)

    def _run(self, fn: Callable[..., Any], args: tuple, scheduled: bool = True) -> None:
        if scheduled:
            self.pending -= 1
        try:
            fn(*args)
        except Exception:
            log.exception("sessionpin: %s: cannot read a finished turn", self.name)

    async def settled(self) -> None:
        while self.pending:
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
