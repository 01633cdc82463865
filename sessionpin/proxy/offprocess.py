"""BodyProcess: a large request's facts (the router's) and its prompt's shape (the ledger's,
after the answer) read by ``sessionpin.decision.bodyreader`` in a process of its own, so that no body
holds mitmproxy's event loop (issue 20: no body costs other clients more than ~100 ms). The
router and the ledger have one each: a request's facts never wait behind a turn's shape.

Why not a thread (``offloop.OffLoop``): the long parts of reading a body are single C calls
holding the GIL (a whole-body msgspec decode, freeing two million objects); a thread running
them stalls the event loop as much as the loop running them itself.

Rules it keeps:
- One child process, started on first use, with no environment but where to import
  sessionpin from (the servers' keys are not its business). Requests to it take turns (a
  lock); the caller waits, the event loop does not. The body goes in a memory file shared
  with the child (Linux ``memfd``, kept for the next child; written ``SHARED_CHUNK`` at a
  time, the loop let go between; shrunk back after a body over ``SHARED_KEEP``): one copy,
  where the pipe cost the loop ~1 ms per MB (sixteen writes a MB, a wakeup each, asyncio's
  buffer moved behind them). Elsewhere, or if the file cannot be made, down the pipe a chunk
  at a time, each write awaited.
- A child that fails, answers garbage or takes longer than ``timeout`` is killed (a new one
  is started for the next body) and the request gets facts read without its body
  (``parsed=False``, the reason saying why): the router answers an unreadable body as it
  always does; a shape is None (the turn is recorded, compared with nothing). Said in the log
  once per failure, never with the body.
- ``close`` ends the child (the router's ``done``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec

from ..decision import bodyreader
from ..reader import promptshape
from ..reader import facts as F

log = logging.getLogger("sessionpin")

CHUNK = 256 * 1024          # bytes written to the pipe per await
SHARED_CHUNK = 4 * 1024 * 1024   # bytes copied into the shared file per turn of the loop
SHARED_KEEP = 8 * 1024 * 1024    # bytes the shared file keeps between bodies (larger: given back)
TIMEOUT = 60.0              # seconds one body may take (45 MiB of tiny messages: 3-10 s on a loaded 2-core machine)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
T = TypeVar("T")


class _Failed:
    """Why the child gave no answer."""
    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class BodyProcess:
    def __init__(self, timeout: float = TIMEOUT, command: tuple[str, ...] | None = None) -> None:
        self.timeout = timeout
        self.command = command or (sys.executable, "-m", "sessionpin.decision.bodyreader")
        self.reads = 0          # bodies read by the child
        self.failures = 0       # bodies the child did not read (killed, timed out, garbage)
        self.started = 0        # children started
        self._proc: asyncio.subprocess.Process | None = None
        self._lock: asyncio.Lock | None = None
        self._shared: int | None = None      # the memory file the bodies go in (None: the pipe)
        self._shared_tried = False

    async def facts(self, method: str, url: str, headers: Any, raw: bytes, encoding: str | None,
                    api: str | None) -> F.Facts:
        """The request's facts, read in the child. Never raises but for cancellation."""
        encoding = encoding or ""
        got = await self._read(bodyreader.FACTS, method, url, headers, raw, encoding, api, bodyreader.decode_answer)
        if isinstance(got, _Failed):
            return _unread(method, url, headers, encoding, api, f"body not read: the reader process failed ({got.why})")
        return got

    async def shape(self, raw: bytes, api: str, encoding: str | None) -> promptshape.Shape | None:
        """The request's prompt shape (``bodyreader.shape_of``), read in the child; None when it
        failed. Never raises but for cancellation."""
        got = await self._read(bodyreader.SHAPE, "", "", (), raw, encoding or "", api, bodyreader.decode_shape)
        return None if isinstance(got, _Failed) else got

    async def _read(self, task: str, method: str, url: str, headers: Any, raw: bytes, encoding: str,
                    api: str | None, decode: Callable[[bytes], T]) -> T | _Failed:
        """The child's answer, decoded; or why there is none (the child is then replaced)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                answer = await asyncio.wait_for(self._ask(task, method, url, headers, raw, encoding, api), self.timeout)
                got = decode(answer)        # garbage from the child fails here, in the try
                self.reads += 1
                return got
            except asyncio.CancelledError:
                self._kill()          # the pipe is mid-request: a new child for the next body
                raise
            except Exception as e:  # noqa: BLE001 - any failure: the body is taken as unread
                why = "it took longer than %g s" % self.timeout if isinstance(e, TimeoutError) else type(e).__name__
                self._kill()
                self.failures += 1
                log.warning("sessionpin: the body reader process did not read a %d-byte body (%s)", len(raw), why)
                return _Failed(why)

    async def _ask(self, task: str, method: str, url: str, headers: Any, raw: bytes, encoding: str,
                   api: str | None) -> bytes:
        proc = await self._process()
        w, r = proc.stdin, proc.stdout
        assert w is not None and r is not None
        view = memoryview(raw)
        shared = self._shared
        if shared is not None:
            for i in range(0, len(view), SHARED_CHUNK):
                if i:
                    await asyncio.sleep(0)          # the loop's other clients between copies
                try:
                    os.pwrite(shared, view[i:i + SHARED_CHUNK], i)
                except OSError:
                    self._drop_shared()     # (no memory for it): the pipe from the next child on
                    raise
            w.write(bodyreader.request_head(method, url, headers, encoding, api, len(raw), task))
        else:
            w.write(bodyreader.request_head(method, url, headers, encoding, api, len(raw), task))
            for i in range(0, len(view), CHUNK):
                w.write(view[i:i + CHUNK])
                await w.drain()
        await w.drain()
        size = int.from_bytes(await r.readexactly(bodyreader.HEAD_LEN), "big")
        answer = await r.readexactly(size)
        if shared is not None and len(raw) > SHARED_KEEP:
            os.ftruncate(shared, 0)                 # a large body's pages given back
        return answer

    def _shared_file(self) -> int | None:
        """The memory file shared with the child, made once; None where it cannot be."""
        if not self._shared_tried:
            self._shared_tried = True
            try:
                self._shared = os.memfd_create("sessionpin-body")     # close-on-exec: only the child gets it
            except (AttributeError, OSError) as e:
                log.info("sessionpin: bodies go to the body reader down its pipe (no shared memory: %s)", e)
        return self._shared

    async def _process(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            shared = self._shared_file()
            self._proc = await asyncio.create_subprocess_exec(
                *self.command, *(("--shared", str(shared)) if shared is not None else ()),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env={"PYTHONPATH": _PACKAGE_ROOT, "PYTHONDONTWRITEBYTECODE": "1"},
                pass_fds=(shared,) if shared is not None else (),
            )
            self.started += 1
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)

    def _drop_shared(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            os.close(shared)

    def close(self) -> None:
        self._kill()
        self._drop_shared()


def _end(proc: asyncio.subprocess.Process) -> None:
    """Kill the child and close its pipes (the transport's ``close`` does both; without it
    asyncio warns of an unclosed transport when the process object goes)."""
    transport = getattr(proc, "_transport", None)
    try:
        if transport is not None:
            transport.close()
        elif proc.returncode is None:   # pragma: no cover - asyncio always sets _transport
            proc.kill()
    except (ProcessLookupError, RuntimeError):   # gone already, or its loop closed
        pass


def _unread(method: str, url: str, headers: Any, encoding: str, api: str | None, why: str) -> F.Facts:
    """The facts a request has without its body (agent, session by header, api), marked unread."""
    facts = F.read(method, url, headers, b"", encoding, api=api)
    if facts.api not in F.INFERENCE_APIS:
        return facts
    # an empty body is unreadable to the turn rules: a turn that needs the history is unknown
    return msgspec.structs.replace(facts, parsed=False, reason=f"{why}; {facts.reason}")

