"""StoreRuntime: the pin store's life in the proxy — open, heartbeat, activity, sweeps, close.

Rules it keeps:
- The store is ``--set sessionpin_store=URL``, else ``$SESSIONPIN_STORE``, else the
  user state dir's file store. At start, a store that cannot be opened stops mitmdump
  with one line and exit status 2 (a store of a newer format is left untouched); a
  change while running that cannot be opened is refused and the old store stays.
- Every store call is the async facade's: nothing here touches a file on the event loop,
  but one: ``configure`` opens the store (mitmproxy applies options synchronously, and a
  store that cannot be opened must stop mitmdump at start or refuse the option while
  running). Opening a file store checks both its copies and, after a fault, rebuilds one,
  on the loop's thread — once at start, and when ``sessionpin_store`` changes.
- A store that says how it is (Redis: ``check()``) is checked as soon as the loop runs,
  so status and doctor show its durability at once. One that cannot be reached then
  does not stop the proxy: it serves, the router refuses the requests whose pin it
  cannot read or save (503 naming the store), and the store reconnects by itself.
- The store URL is shown only in its safe form (a password as ``***``): in log lines,
  errors and the heartbeat.
- Activity (last seen, requests per session) is counted in memory by the router and
  flushed every half second (so a ``kill -9`` loses at most a second of counts: the
  flush is one batched write off the request path); a heartbeat (``documents.Heartbeat``) lets the CLI find
  this proxy and tell it from a killed one; the pin index is swept every few minutes.
- The store's identity is checked before the first request is routed and every second
  (``StoreGuard``): a store that lost what it held is refused, never taken for new.
- Background failures are logged and retried next round: the loop never dies.
- At exit the last activity is flushed and the heartbeat removed (a few seconds at
  most), then the store is closed: a local one after its queued writes, from a thread of
  its own; a Redis one on mitmproxy's loop, whose connections its clients hold — ``done``
  returns that work as a task, which mitmproxy awaits at shutdown (and which runs on
  the loop when a script reload calls ``done`` synchronously).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional

from mitmproxy import ctx, exceptions

from .. import __version__
from ..records import pins
from ..records.documents import HEARTBEAT_TTL, Heartbeat, heartbeat_encoder, heartbeat_key
from ..store import Store, StoreError, StoreUnavailable, default_store_url, open_store, safe_url
from .storeguard import StoreGuard

log = logging.getLogger("sessionpin")

FLUSH_EVERY = 0.5      # activity: what a kill -9 can lose (issue 19: at most a second)
ROUND = 0.5            # the background loop's tick: the flush cannot come sooner than it
HEARTBEAT_EVERY = 10.0
SWEEP_EVERY = 600.0
EXIT_TIMEOUT = 5.0
WATCH_EVERY = 2.0       # a Redis store's durability and run_id are looked at again


class StoreRuntime:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = env if env is not None else os.environ
        self.store: Store | None = None
        self.url: str | None = None                      # the store's safe URL (no password)
        self._opened: str | None = None                  # the URL as given
        self.errors = 0                                  # background store calls that failed
        self.started = time.time()
        self.host = socket.gethostname()
        self.config_path: Callable[[], str | None] = lambda: None   # set by make_addons
        self.token = ""                                  # the status endpoint's, set by make_addons
        self._activity: dict[str, list] = {}             # session -> [agent, server, last seen, requests]
        self._task: asyncio.Task | None = None
        self._checking: tuple[Store, asyncio.Task] | None = None
        self._closing: set[asyncio.Task] = set()       # stores closed on the loop (kept referenced)
        self._failing = False                            # the background loop's store calls fail
        self._on_store: list[Callable[[Store], None]] = []
        self.guard = StoreGuard(self.env)                # a store that lost what it held routes nothing

    # ---- what other addons call --------------------------------------------------------
    def seen(self, session: str, agent: str, server: str | None, now: float, requests: int = 1) -> None:
        """Count activity: ``requests`` is 0 for a Codex socket's upgrade (its turns, each
        ``response.create``, are the requests counted)."""
        a = self._activity.get(session)
        if a is None:
            self._activity[session] = [agent, server, now, requests]
        else:
            a[1], a[2], a[3] = server, now, a[3] + requests

    def on_store(self, fn: Callable[[Store], None]) -> None:
        """Call ``fn(store)`` now and whenever the store changes (the pool keeps a handle)."""
        self._on_store.append(fn)
        if self.store is not None:
            fn(self.store)

    # ---- lifecycle ------------------------------------------------------------------------
    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_store", Optional[str], None,
            "sessionpin: the pin store URL: file:PATH, memory:, or redis://… "
            "(default: $SESSIONPIN_STORE, else the user state dir's file store).",
        )

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_store" not in updated and self.store is not None:
            return
        url = ctx.options.sessionpin_store or self.env.get("SESSIONPIN_STORE") or default_store_url()
        if url == self._opened and self.store is not None:
            return
        try:
            store = open_store(url)
        except (StoreError, OSError, ValueError) as e:
            message = f"sessionpin_store: cannot open {safe_url(url)}: {e}"
            if self.store is None:      # at start: one line (not also through the log), nothing served
                print(f"sessionpin: {message}", file=sys.stderr, flush=True)
                sys.exit(2)
            raise exceptions.OptionsError(message) from None
        old, self.store, self.url, self._opened = self.store, store, store.url, url
        self.guard.use(store, url)
        if old is not None:
            self._close(old)
        log.info("sessionpin: pins in %s", store.url)
        for fn in self._on_store:
            fn(store)
        self._check_soon()

    def running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._background())
        self._check_soon()

    def _check_soon(self) -> None:
        """Check the store now that a loop runs (once per store; a store without ``check``,
        a local one, has nothing to ask)."""
        store = self.store
        if store is None or not hasattr(store, "check"):
            return
        if self._checking is not None and self._checking[0] is store:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return                          # configure before the loop: running() does it
        self._checking = (store, loop.create_task(self._check(store)))

    async def _check(self, store: Store) -> None:
        try:
            info = await store.check()      # type: ignore[attr-defined]
        except StoreUnavailable as e:
            # e names the store (its safe URL) and the cause
            log.error("sessionpin: the store cannot be reached: %s. The proxy serves: a request whose pin "
                      "cannot be read or saved is refused with 503 naming the store, never sent by a guess; "
                      "it recovers by itself when the store is back.", e)
            return
        except StoreError as e:         # a server the store will not use (too old, a cluster node…)
            log.error("sessionpin: the store refuses this server: %s. Requests whose pin it cannot read are "
                      "refused with 503 until the URL or the server is fixed (`sessionpin doctor`).", e)
            return
        except Exception as e:   # a bug must not kill the proxy at start
            log.warning("sessionpin: checking store %s: %s: %s", store.url, type(e).__name__, e)
            return
        durability = info.get("durability") or {}
        said = f"{info.get('note')} (the server: {durability.get('server', '?')})"
        if info.get("durable") or durability.get("required") != "fsync-always":
            log.info("sessionpin: store %s: %s", store.url, said)
        else:
            log.warning("sessionpin: store %s: %s; new conversations the router would move get 503 until "
                        "it does (`sessionpin doctor` says how)", store.url, said)

    def done(self) -> "asyncio.Task | None":
        for task in (self._task, self._checking[1] if self._checking else None):
            if task is not None:
                task.cancel()
        self._task = self._checking = None
        store = self.store
        if store is None:
            return None
        self.store = None
        pending = self._take()
        key = heartbeat_key(self.host, os.getpid())

        async def last_words() -> None:
            await pins.record_seen(store, pending)
            await store.delete(key)
        if hasattr(store, "backend"):   # a local store: its calls work from another loop too
            _run_elsewhere(last_words, timeout=EXIT_TIMEOUT)
            _close(store)
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            _close(store)               # no loop: nothing can be said to the store any more
            return None

        async def finish() -> None:
            try:
                await asyncio.wait_for(last_words(), EXIT_TIMEOUT)
            except Exception as e:
                log.warning("sessionpin: at exit: store %s: %s: %s", store.url, type(e).__name__, e)
            finally:
                await store.close()
        return loop.create_task(finish())

    def _close(self, store: Store) -> None:
        """Close a store that was replaced while running: a Redis one on this loop."""
        if hasattr(store, "backend"):
            _close(store)
            return
        try:
            task = asyncio.get_running_loop().create_task(store.close())
        except RuntimeError:
            _close(store)
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # ---- background -----------------------------------------------------------------------
    async def _background(self) -> None:
        last_flush = last_beat = last_watch = 0.0
        last_sweep = time.monotonic()
        begun = time.monotonic()
        first = True
        while True:
            try:
                await asyncio.sleep(0.25 if first else ROUND)
                store = self.store
                if store is None:
                    continue
                try:
                    await self.guard.tick(store)    # a flushed or replaced store is seen within a second
                    if hasattr(store, "watch") and time.monotonic() - last_watch >= WATCH_EVERY:
                        last_watch = time.monotonic()
                        await store.watch()         # a CONFIG SET or a restarted Redis, within seconds
                except StoreError as e:             # requests meet the fault themselves
                    log.debug("sessionpin: store %s: identity check: %s", self.url, e)
                now = time.monotonic()
                wrote = False
                if now - last_flush >= FLUSH_EVERY:
                    last_flush = now
                    pending = self._take()
                    if pending:
                        wrote = True
                        await pins.record_seen(store, pending)
                # while the store fails, the heartbeat is tried every round: the CLI finds
                # this proxy as soon as the store is back
                if first or self._failing or now - last_beat >= HEARTBEAT_EVERY:
                    beat = self.heartbeat()
                    # the first beat waits (up to 2 s) for the listeners to come up
                    if beat.listen or not first or now - begun > 2.0:
                        first = False
                        wrote = True
                        await store.set(beat.key, heartbeat_encoder.encode(beat).decode(), HEARTBEAT_TTL)
                        last_beat = now
                if now - last_sweep >= SWEEP_EVERY:
                    last_sweep = now
                    wrote = True
                    await pins.sweep_index(store, time.time())
                if wrote and self._failing:
                    self._failing = False
                    log.info("sessionpin: store %s: background writes work again", self.url)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # never let the loop die; one line per outage, not per round
                self.errors += 1
                (log.debug if self._failing else log.warning)(
                    "sessionpin: store %s: %s: %s", self.url, type(e).__name__, e)
                self._failing = True

    def _take(self) -> list[tuple[str, str, str | None, float, int]]:
        pending, self._activity = self._activity, {}
        return [(s, a[0], a[1], a[2], a[3]) for s, a in pending.items()]

    def heartbeat(self) -> Heartbeat:
        listen: list[tuple[str, int]] = []
        modes: list[str] = []
        try:
            ps = ctx.master.addons.get("proxyserver")
            for server in ps.servers if ps else []:
                modes.append(server.mode.full_spec)
                for addr in server.listen_addrs:
                    listen.append((str(addr[0]), int(addr[1])))
        except Exception:
            pass
        return Heartbeat(pid=os.getpid(), host=self.host, started=self.started, beat=time.time(), listen=listen,
                         modes=modes, confdir=str(Path(ctx.options.confdir).expanduser()),
                         config=self.config_path(), store=self.url, version=__version__, token=self.token)


def _close(store: Store) -> None:
    try:
        close_now = getattr(store, "close_now", None)
        if close_now is not None:
            close_now()
        else:
            _run_elsewhere(store.close, timeout=5.0)
    except Exception as e:
        log.warning("sessionpin: closing store %s: %s", store.url, e)


def _run_elsewhere(fn: Callable[[], Awaitable[Any]], timeout: float) -> None:
    """Run a coroutine to its end from synchronous code that may sit inside a running loop
    (mitmproxy's ``done``): on a thread of its own, with its own loop."""
    def run() -> None:
        try:
            asyncio.run(fn())
        except Exception as e:
            log.warning("sessionpin: at exit: %s: %s", type(e).__name__, e)
    t = threading.Thread(target=run, name="sessionpin-exit", daemon=True)
    t.start()
    t.join(timeout)
