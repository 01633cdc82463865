"""A mitmproxy addon for benchmarks: where the event loop is when it is late.

    mitmdump -s sessionpin/mitmscript/route.py -s scripts/lagwatch.py   (SESSIONPIN_LAGWATCH=FILE)

A task beats every 5 ms on mitmproxy's event loop; a thread looks every 10 ms, and while the
beat is more than 100 ms old it appends one line to ``FILE``: the time, how late the loop is,
and the main thread's innermost frames. A long C call holding the GIL (a msgspec decode, an
``SSL_write``) keeps the thread from looking until it returns, so it shows as few lines but a
large lateness; a Python loop shows as many lines in its own frames. A garbage collection
holds the thread that triggered it (the frames it shows are where the allocation was, and it
lets the watcher look while it runs finalizers): every collection of 20 ms or more is written
too, ``gc gen N took T s on THREAD, collected C``, with the thread it ran on.
With ``SESSIONPIN_LAGWATCH_CENSUS=1`` each such collection of the oldest generation is followed
by a census of the objects the collector tracks, by type (the 12 commonest): what a full
collection has to walk. Benchmarks only: it writes frame names and counts, never data.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import sys
import threading
import time
import traceback

LATE = 0.1
LONG_GC = 0.02


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

        started: dict[int, float] = {}
        census = os.environ.get("SESSIONPIN_LAGWATCH_CENSUS") == "1"

        def collected(phase: str, info: dict) -> None:
            me = threading.get_ident()
            if phase == "start":
                started[me] = time.perf_counter()
                return
            took = time.perf_counter() - started.pop(me, time.perf_counter())
            if took >= LONG_GC:
                who = "main" if me == main else threading.current_thread().name
                line = (f"{time.time():.2f} gc gen {info['generation']} took {took:.3f} s on {who}, "
                        f"collected {info['collected']}")
                if census and info["generation"] == 2:
                    kinds = collections.Counter(type(o).__name__ for o in gc.get_objects())
                    line += f", tracked {sum(kinds.values())}: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common(12))
                with open(self.out, "a") as f:
                    f.write(line + "\n")

        gc.callbacks.append(collected)
        self._task = asyncio.get_running_loop().create_task(tick())
        threading.Thread(target=look, daemon=True, name="lagwatch").start()


addons = [LagWatch()]
