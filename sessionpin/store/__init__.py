"""Choosing a store by URL.

- ``memory:``            a MemoryStore: this process only, gone when it exits.
- ``file:PATH``          a FileStore (SQLite, shared by processes); PATH may be relative
  (to the working directory when opened) or start with ``~``; ``file:///abs`` works too.
- ``redis://…``, ``rediss://…``, ``unix://…``  a RedisStore (``redisstore``; the URL's
  options in ``redisurl``). Any other scheme is refused with a StoreError.

``open_store(url)`` gives the async ``Store`` every caller uses; ``open_sync_store(url)``
the synchronous backend of a local URL (memory, file), for tests and tools that own it.
``default_store_url()`` is ``file:<user state dir>/sessionpin/state.db`` (platformdirs).
"""

from __future__ import annotations

from pathlib import Path

import platformdirs

from .base import (Check, Delete, Expire, HIncr, HSet, NotDurable, Set, Store, StoreError, StoreUnavailable,
                   StoreVersionError, SyncStore, WrongType, ZAdd, ZRem)

__all__ = ["Check", "Delete", "Expire", "HIncr", "HSet", "NotDurable", "Set", "Store", "StoreError", "StoreUnavailable",
           "StoreVersionError", "SyncStore", "WrongType", "ZAdd", "ZRem", "open_store", "open_sync_store",
           "default_store_url", "safe_url"]

STATE_FILE = "state.db"


def default_store_url() -> str:
    return "file:" + str(Path(platformdirs.user_state_dir("sessionpin")) / STATE_FILE)


def safe_url(url: str) -> str:
    """The URL as it may be shown: a password in it replaced by ``***`` (the form a
    store's own ``url`` has; for a URL no store was opened with)."""
    from .redisurl import mask

    return mask(url)


_safe = safe_url


def _scheme(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.partition(":")
    if not sep:
        raise StoreError(f"store URL {_safe(url)!r} has no scheme; use memory:, file:PATH or redis://HOST")
    return scheme.lower(), rest


def open_sync_store(url: str, **options) -> SyncStore:
    """The synchronous backend ``url`` names (memory: or file:). ``options`` go to it (e.g. ``clock``)."""
    scheme, rest = _scheme(url)
    if scheme == "memory":
        if rest not in ("", "//"):
            raise StoreError(f"store URL {url!r}: memory: takes no path")
        from .memory import MemoryStore

        return MemoryStore(url, **options)
    if scheme == "file":
        path = rest[2:] if rest.startswith("//") else rest
        if not path:
            raise StoreError(f"store URL {url!r} names no file; use file:PATH")
        from .file import FileStore

        return FileStore(path, url=url, **options)
    if scheme in ("redis", "rediss", "unix"):
        raise StoreError(f"store URL {_safe(url)!r}: a Redis store has no synchronous backend; use open_store")
    raise StoreError(f"store URL {_safe(url)!r}: unknown scheme {scheme!r}; use memory:, file:PATH or redis://HOST")


def open_store(url: str, **options) -> Store:
    """The async Store ``url`` names. Opening a file store may touch the disk: call it off
    the event loop when one runs (the proxy opens its store in ``configure``)."""
    scheme, _ = _scheme(url)
    if scheme in ("redis", "rediss", "unix"):
        # nothing connects here: the first call checks the server (see redisstore)
        from .redisstore import RedisStore

        return RedisStore(url, **options)
    from .aio import Inline, Threaded

    backend = open_sync_store(url, **options)
    return Inline(backend) if scheme == "memory" else Threaded(backend)
