"""Choosing a store by URL.

- ``memory:``            a MemoryStore: this process only, gone when it exits.
- ``file:PATH``          a FileStore (SQLite, shared by processes); PATH may be relative
  (to the working directory when opened) or start with ``~``; ``file:///abs`` works too.
- ``redis://...``        reserved for a later adapter; refused today with a clear error,
  as is any other scheme.

``default_store_url()`` is ``file:<user state dir>/sessionpin/state.db`` (platformdirs).
"""

from __future__ import annotations

from pathlib import Path

import platformdirs

from .base import Store, StoreError, StoreVersionError, WrongType

__all__ = ["Store", "StoreError", "StoreVersionError", "WrongType", "open_store", "default_store_url"]

STATE_FILE = "state.db"


def default_store_url() -> str:
    return "file:" + str(Path(platformdirs.user_state_dir("sessionpin")) / STATE_FILE)


def open_store(url: str, **options) -> Store:
    """Open the store ``url`` names. ``options`` go to the store (e.g. ``clock``)."""
    scheme, sep, rest = url.partition(":")
    if not sep:
        raise StoreError(f"store URL {url!r} has no scheme; use memory: or file:PATH")
    scheme = scheme.lower()
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
        raise StoreError(f"store URL {url!r}: redis stores are not available yet; use memory: or file:PATH")
    raise StoreError(f"store URL {url!r}: unknown scheme {scheme!r}; use memory: or file:PATH")
