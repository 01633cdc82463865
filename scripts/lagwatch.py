"""A mitmproxy addon for benchmarks: where the event loop is when it is late.

    mitmdump -s sessionpin/mitmscript/route.py -s scripts/lagwatch.py   (SESSIONPIN_LAGWATCH=FILE)

A task beats every 5 ms on mitmproxy's event loop; a thread looks every 10 ms, and while the
beat is more than 100 ms old it appends one line to ``FILE``: the time, how late the loop is,
and the main thread's innermost frames. A long C call holding the GIL (a msgspec decode, an
``SSL_write``) keeps the thread from looking until it returns, so it shows as few lines but a
large lateness; a Python loop shows as many lines in its own frames. Benchmarks only: it
writes frame names, never data.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback

LATE = 0.1


class LagWatch:
    def __init__(self) -> None:
        self.out = os.environ.get("SESSIONPIN_LAGWATCH", "lagwatch.txt")
        self.beat = time.monotonic()
        self._task: asyncio.Task | None = None

    def running(self) -> None:
        main = threading.main_thread().ident

        async def tick() -> None:
            while True:
                self.beat = time.monotonic()
                await asyncio.sleep(0.005)

        def look() -> None:
            while True:
                time.sleep(0.01)
                late = time.monotonic() - self.beat
                if late > LATE:
                    frame = sys._current_frames().get(main)
                    stack = traceback.extract_stack(frame)[-8:] if frame else []
                    where = " <- ".join(f"{s.filename.rsplit('/', 2)[-1]}:{s.lineno}:{s.name}" for s in reversed(stack))
                    with open(self.out, "a") as f:
                        f.write(f"{time.time():.2f} late {late:.2f} {where}\n")

        self._task = asyncio.get_running_loop().create_task(tick())
        threading.Thread(target=look, daemon=True, name="lagwatch").start()


addons = [LagWatch()]
