"""The OpenCode session-id pool (seeds/002), adapted to a proxy. See docs/opencode_ids.md.

Modules, each with the rules it keeps in its docstring:
``options`` (knobs as plain data), ``signals`` (server-timing, Retry-After, classification),
``state`` (spares, bindings, retirement over the Store), ``acquire`` (the acquisition
algorithm), ``observe`` (real responses), ``refresh`` (one background cycle), ``prober``
(the only network code), ``service`` (what the addon calls), ``report`` (CLI/status views).

A ``Manager`` is the one pool of a proxy. It is kept on mitmproxy's master
(``manager_of``, called by ``PoolOptions.load``), not in a module global nor in the addon
script, so an edited ``addons/route.py`` that mitmproxy re-executes (new addons, the same
master) finds the same service: the old addon's ``done()`` detaches (the refresh loop is
cancelled, an in-flight probe puts its claimed spare back), the new addon's
``load/configure`` attach and its ``running()`` starts one loop again, which first waits
for the old one to finish. Spares live in the store and credentials and schedules on the
service, so nothing is lost. Two proxies in one process (tests) have two pools.

The pool keeps its own handle on the router's store (``Threaded.share`` for a ``file:``
store: the same backend and threads, closed with the last handle): the router closes its
handle in ``done()``, before a cancelled probe has had the chance to put its spare back; the
pool's handle stays open across reloads and is closed at exit.
"""

from __future__ import annotations

import atexit

from .options import OPTIONS, PoolConfig, parse
from .service import PoolService, Route
from ..store.base import Store

__all__ = ["Manager", "OPTIONS", "PoolConfig", "PoolService", "Route", "manager_of", "parse"]

MASTER_ATTR = "sessionpin_pool_manager"   # where a proxy's Manager is kept on mitmproxy's master


class Manager:
    """Owns the process's PoolService across addon instances (refcount by owner identity)."""

    def __init__(self) -> None:
        self.service: PoolService | None = None
        self.owners: set[int] = set()
        self.generation = 0      # bumped on every attach; an attach after a detach-to-zero is a reload
        self.store_url: str | None = None

    @staticmethod
    def _own(store: Store) -> Store:
        url = getattr(store, "url", "")
        share = getattr(store, "share", None)
        if not url.startswith("file:") or share is None:
            return store                       # memory: one object per process, nothing to reopen
        try:
            own = share()                      # not a second open: one writer and one file check per process
        except Exception:
            return store
        close = getattr(own, "close_now", None)   # the facades' synchronous close (atexit has no loop)
        if close is not None:
            atexit.register(close)
        return own

    def attach(self, owner: object, cfg: PoolConfig, store: Store, **kw) -> PoolService:
        """Called from the addon's configure: create the service or hand over the existing one."""
        url = getattr(store, "url", "")
        if self.service is not None and url and url == self.store_url:
            store = self.service._store        # the pool's own handle, kept across reloads
        else:
            store = self._own(store)
            self.store_url = url
        if self.service is None:
            self.service = PoolService(cfg, store, **kw)
        else:
            self.service.configure(cfg, store)
        self.owners.add(id(owner))
        self.generation += 1
        return self.service

    def start(self, owner: object) -> None:
        """Called from the addon's running (sync, inside the event loop)."""
        if self.service is not None and id(owner) in self.owners and self.service.cfg.enabled:
            self.service.start()

    def detach(self, owner: object) -> None:
        """Called from the addon's done: the last owner out stops the loop (the service stays)."""
        self.owners.discard(id(owner))
        if not self.owners and self.service is not None:
            self.service.stop()

    def reset(self) -> None:
        """Forget everything (tests)."""
        if self.service is not None:
            self.service.stop()
        self.__init__()


def manager_of(master: object) -> Manager:
    """The pool manager of the proxy ``master`` runs (made on first use): the master
    outlives a script reload, the addons do not."""
    manager = getattr(master, MASTER_ATTR, None)
    if manager is None:
        manager = Manager()
        setattr(master, MASTER_ATTR, manager)
    return manager
