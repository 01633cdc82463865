"""Unrouted: nothing in scope is left alone silently.

A POST to a configured server's origin whose path ends with an inference endpoint but that
``paths.scope`` does not take (``/api/paas/v4/chat/completions`` at a server written as a bare
origin; not a look-alike such as ``/v1/threads/x/messages``: ``paths.unrouted``) passes
untouched, as every request out of scope does — but not silently. Rules it keeps:

- The log says so once per (origin, path before the endpoint), at warning level, with the
  config line that would route it (a server whose URL is that base, when the path holds an
  API version before its endpoint), or that no server URL would.
- ``/__sessionpin/status`` lists them (``documents.Unrouted``: count, first and last seen),
  and ``sessionpin doctor`` shows each; an entry the current config now routes is not listed.
- At most ``LIMIT`` distinct entries are kept (a client probing random paths cannot grow
  the proxy's memory); later ones are counted in ``dropped``.
- Only ids, origins and paths up to the endpoint: never a body, a query or a header.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..config.redact import scrub
from ..reader import paths
from ..config.config import Config, Server
from ..records.documents import Unrouted as UnroutedDoc

log = logging.getLogger("sessionpin")
LIMIT = 64


@dataclass
class _Entry:
    source: Server
    prefix: str
    endpoint: str
    first: float
    last: float
    count: int = 1


def route_url(origin: str, prefix: str) -> str | None:
    """A server URL that would route requests to ``origin + prefix + endpoint``: the base
    itself, when its last segment is an API version (a server's base is then its URL)."""
    return origin + prefix if prefix and paths.is_version(prefix.rpartition("/")[2]) else None


class Unrouted:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], _Entry] = {}
        self.dropped = 0

    def note(self, source: Server, method: str, path: str, now: float | None = None) -> None:
        """A request to ``source``'s origin that ``paths.scope`` did not take as inference."""
        before = paths.unrouted(method, path, source.prefix)
        if before is None:
            return
        now = time.time() if now is None else now
        key = (source.origin, before)
        entry = self.entries.get(key)
        if entry is not None:
            entry.count += 1
            entry.last = now
            return
        if len(self.entries) >= LIMIT:
            self.dropped += 1
            return
        endpoint = path.partition("?")[0][len(before):]
        self.entries[key] = _Entry(source, before, endpoint, now, now)
        url = route_url(source.origin, before)
        fix = (f'a server with url = "{url}" would route it (`sessionpin servers add NAME {url} --key-env VAR`)'
               if url else "no server URL would route it: sessionpin routes an endpoint after an API version "
                           "(…/v1/<endpoint>, or a server's own base)")
        log.warning("sessionpin: left alone: POST %s%s%s looks like inference but is not in scope "
                    "(server %s is written %s); %s. Said once per origin and path prefix; `sessionpin doctor` "
                    "lists it.", source.origin, scrub(before), endpoint, source.name, source.url, scrub(fix))

    def listed(self, config: Config) -> list[UnroutedDoc]:
        """The entries the current config still leaves alone."""
        out = []
        for e in self.entries.values():
            s = e.source
            now = config.server_for(s.scheme, s.host, s.port, e.prefix + e.endpoint)
            if now is None or paths.scope("POST", e.prefix + e.endpoint, now.prefix).inference:
                continue        # the origin is no longer configured, or a server now routes it
            url = route_url(s.origin, e.prefix)
            out.append(UnroutedDoc(origin=s.origin, prefix=scrub(e.prefix), endpoint=e.endpoint, server=now.name,
                                   count=e.count, first=e.first, last=e.last, url=scrub(url) if url else url))
        return out
