"""The documents a proxy publishes and the CLI reads: its heartbeat and its status.

One definition for both sides (msgspec structs), so the CLI never guesses at keys:
the proxy encodes these, the CLI decodes them strictly and reports a document it cannot
read as such ("an older or newer sessionpin answered").

- ``Heartbeat``: written by each running proxy under ``proxy:<host>:<pid>`` every few
  seconds with a short TTL. It names the process (host, pid, start time) and where it
  listens, so the CLI can tell a live proxy from the heartbeat of one that was killed:
  it asks that address for its status and compares pid and start time.
- ``Status``: what ``/__sessionpin/status`` answers (loopback only). Pin counts come
  from the store's per-server index (one ``zcount`` per server), never a walk. No key
  value is ever in it: only whether each server's variable is set.
"""

from __future__ import annotations

from typing import Any

import msgspec

HEARTBEAT_PREFIX = "proxy:"
HEARTBEAT_TTL = 30.0
STATUS_PATH = "/__sessionpin/status"
METRICS_PATH = "/__sessionpin/metrics"


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    host: str                                  # socket.gethostname(): a pid means nothing elsewhere
    started: float                             # epoch seconds
    beat: float                                # when this heartbeat was written
    listen: list[tuple[str, int]] = []
    modes: list[str] = []
    confdir: str | None = None
    config: str | None = None
    store: str | None = None                   # the store's safe URL
    version: str = ""
    token: str = ""                            # asks its status on any listener (x-sessionpin-token)

    @property
    def key(self) -> str:
        return heartbeat_key(self.host, self.pid)


def heartbeat_key(host: str, pid: int) -> str:
    return f"{HEARTBEAT_PREFIX}{host}:{pid}"


class ServerStatus(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    origin: str
    prefix: str = ""
    key_env: str | None = None
    key_set: bool = False
    auth: str | None = None
    models: dict[str, str] = {}


class PinCount(msgspec.Struct, frozen=True, kw_only=True):
    pins: int                                  # live pins
    active: int = 0                            # of which seen in the last hour


class Unrouted(msgspec.Struct, frozen=True, kw_only=True):
    """Requests to a configured server's origin that looked like inference and were left
    alone (``paths.unrouted``), by origin and the path before the endpoint."""
    origin: str
    prefix: str                                # the path before the endpoint ("/api/paas/v4")
    endpoint: str                              # the endpoint it named ("/chat/completions")
    server: str                                # the configured server at that origin
    count: int
    first: float
    last: float
    url: str | None = None                     # a server URL that would route them; None: none would


class Status(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    pid: int
    host: str
    started: float
    config: str | None = None
    config_error: str | None = None
    store: str | None = None
    store_info: dict[str, Any] = {}
    servers: dict[str, ServerStatus] = {}
    agents: dict[str, str | None] = {}
    pins: dict[str, PinCount] | None = None    # by server ("-": not routed); None: the store cannot be read
    pins_error: str | None = None
    unreachable: dict[str, str] = {}           # server -> the last connect error
    participants: dict[str, Any] = {}
    unrouted: list[Unrouted] = []              # looked like inference, left alone (issue 19)


heartbeat_encoder = msgspec.json.Encoder()
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
status_decoder = msgspec.json.Decoder(Status)


def read_heartbeat(text: str | bytes | None) -> Heartbeat | None:
    if not text:
        return None
    try:
        return heartbeat_decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def read_status(body: bytes) -> Status | None:
    try:
        return status_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
