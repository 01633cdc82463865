"""Finding the running proxies: their heartbeats in the store, checked against what answers.

Rules it keeps:
- A heartbeat (``documents.Heartbeat``) names a process: host, pid, start time, where it
  listens and its status token. A proxy is **live** only when its address answers the
  status with that same pid and start time. After a ``kill -9`` and a restart on the same
  port, the killed proxy's heartbeat (alive for up to 30 s) is answered by the new
  process: it is shown as gone, never as the proxy that runs.
- On this host, a heartbeat whose pid no longer exists is gone at once.
- Several proxies on one store are all shown (``status``, ``doctor``, ``use``, ``env``);
  the first live one (the newest) is "the" proxy for commands that need one address
  (``env``, ``exec``), and ``env`` names the others with how to pick one.
- The status is asked with the heartbeat's token (any listener, reverse mode included)
  and a loopback Host; its answer is decoded strictly (``documents.Status``).
"""

from __future__ import annotations

import http.client
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import config as configmod
from ..records.documents import HEARTBEAT_PREFIX, STATUS_PATH, Heartbeat, Status, read_heartbeat, read_status
from ..store import Store, StoreError
from .common import iso
from .context import Ctx

DEFAULT_LISTEN = ("127.0.0.1", 8080)
TOKEN_HEADER = "x-sessionpin-token"


@dataclass
class Proxy:
    answering: bool
    beat: Heartbeat | None = None
    address: tuple[str, int] | None = None
    status: Status | None = None
    why: str = ""
    gone: bool = False             # its heartbeat outlived it

    @property
    def pid(self) -> int | None:
        return self.beat.pid if self.beat else (self.status.pid if self.status else None)

    @property
    def started(self) -> float | None:
        return self.beat.started if self.beat else (self.status.started if self.status else None)

    @property
    def confdir(self) -> str | None:
        return self.beat.confdir if self.beat else None

    @property
    def url(self) -> str | None:
        return f"http://{self.address[0]}:{self.address[1]}" if self.address else None

    def as_json(self) -> dict[str, Any]:
        return {"answering": self.answering, "pid": self.pid, "address": self.url, "confdir": self.confdir,
                "started": iso(self.started), "gone": self.gone, "why": self.why or None}


async def _heartbeats(store: Store) -> list[Heartbeat]:
    keys = await store.keys(HEARTBEAT_PREFIX)
    beats = [read_heartbeat(v) for v in (await store.mget(keys) if keys else [])]
    return sorted((b for b in beats if b is not None), key=lambda b: -b.started)


def heartbeats(ctx: Ctx) -> list[Heartbeat]:
    store = ctx.store()
    if store is None:
        return []
    try:
        return ctx.run(_heartbeats(store))
    except StoreError:
        return []


def addresses(beat: Heartbeat) -> list[tuple[str, int]]:
    found = []
    for host, port in beat.listen:
        host = str(host).strip("[]")
        if host in ("", "0.0.0.0", "::", "*"):
            host = "127.0.0.1"
        found.append((host, int(port)))
    return found


def probe(host: str, port: int, token: str | None = None, timeout: float = 1.0) -> Status | None:
    """The status of the proxy at host:port, or None if nothing (readable) answers.
    A regular-mode listener takes the absolute form; a reverse-mode one the plain path."""
    hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    headers = {"Host": hostport, "Accept": "application/json"}
    if token:
        headers[TOKEN_HEADER] = token
    for target in (f"http://{hostport}{STATUS_PATH}", STATUS_PATH):
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
            body = resp.read(1 << 20)
            if resp.status == 200:
                status = read_status(body)
                if status is not None:
                    return status
        except (OSError, ValueError, http.client.HTTPException):
            pass
        finally:
            conn.close()
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check(beat: Heartbeat) -> Proxy:
    """What a heartbeat's process is now: live, gone, or silent."""
    here = beat.host == socket.gethostname()
    if here and not _pid_alive(beat.pid):
        return Proxy(False, beat, gone=True, why=f"pid {beat.pid} is gone (its heartbeat outlived it)")
    answered_by_other = None
    for addr in addresses(beat):
        status = probe(*addr, token=beat.token or None)
        if status is None:
            continue
        if status.pid == beat.pid and status.host == beat.host and abs(status.started - beat.started) < 1e-3:
            return Proxy(True, beat, addr, status)
        answered_by_other = (addr, status)
    if answered_by_other is not None:
        (host, port), status = answered_by_other
        return Proxy(False, beat, gone=True, why=f"pid {beat.pid} is gone: {host}:{port} is answered by "
                                                 f"pid {status.pid} now")
    return Proxy(False, beat, why=f"pid {beat.pid} announced itself in the store but does not answer")


def find_proxies(ctx: Ctx) -> list[Proxy]:
    """Every proxy with a heartbeat in the store, live ones first."""
    found = [check(b) for b in heartbeats(ctx)]
    return sorted(found, key=lambda p: (not p.answering, p.gone))


def find_proxy(ctx: Ctx, proxies: list[Proxy] | None = None) -> Proxy:
    """The first live proxy on this store, or why there is none."""
    proxies = find_proxies(ctx) if proxies is None else proxies
    live = [p for p in proxies if p.answering]
    if live:
        return live[0]
    silent = [p for p in proxies if not p.gone]
    if silent:
        return silent[0]
    # No live heartbeat: a proxy may still run with another store; say so if one answers on the default port.
    status = probe(*DEFAULT_LISTEN, timeout=0.5)
    if status is not None:
        other = status.store or "another store"
        return Proxy(False, None, DEFAULT_LISTEN, None,
                     f"a sessionpin proxy answers at {DEFAULT_LISTEN[0]}:{DEFAULT_LISTEN[1]} but uses {other}, "
                     f"not {ctx.store_shown}")
    gone = ", ".join(str(p.pid) for p in proxies if p.gone)
    return Proxy(False, why=f"no live proxy heartbeat in the store {ctx.store_shown}"
                 + (f" (pid {gone} is gone)" if gone else ""))


def proxy_keys(proxy: Proxy) -> dict[str, bool] | None:
    """Whether each server's key variable is set, as the running proxy sees it (its status)."""
    if not proxy.answering or proxy.status is None:
        return None
    return {name: s.key_set for name, s in proxy.status.servers.items() if s.key_env}


def key_state(server: configmod.Server, keys: dict[str, bool] | None) -> tuple[bool | None, str]:
    """(is the key set, where that was checked) for a server with a key_env.

    The proxy reads keys from its own environment, so its answer wins; a server the
    proxy has not loaded yet (or no proxy) is checked in this shell, and says so."""
    if not server.key_env:
        return None, ""
    if keys is not None and server.name in keys:
        return keys[server.name], "the running proxy's environment"
    return bool(os.environ.get(server.key_env)), "this shell"


def confdir_of(proxy: Proxy | None, given: str | None = None) -> Path:
    if given:
        return Path(given).expanduser()
    if proxy is not None and proxy.confdir:
        return Path(proxy.confdir).expanduser()
    return Path("~/.mitmproxy").expanduser()


def config_mismatch(proxy: Proxy, config_path: Path) -> str | None:
    """A warning when the answering proxy reads another config file than this command."""
    if not proxy.answering:
        return None
    theirs = (proxy.status.config if proxy.status else None) or (proxy.beat.config if proxy.beat else None)
    if theirs and Path(theirs).expanduser().absolute() != config_path.expanduser().absolute():
        return (f"Warning: the proxy at {proxy.url} (pid {proxy.pid}) reads {theirs}, not {config_path}: "
                f"this change does not reach it; use --config {theirs}")
    return None


def live(proxies: list[Proxy]) -> list[Proxy]:
    return [p for p in proxies if p.answering]


def proxy_lines(ctx: Ctx, config_path: Path, proxies: list[Proxy] | None = None) -> list[str]:
    """What a config change does on each live proxy of the store (one line each), or why none
    applies it yet: every proxy reading this store reads its own config file."""
    proxies = find_proxies(ctx) if proxies is None else proxies
    running = live(proxies)
    if not running:
        return [proxy_line(find_proxy(ctx, proxies), config_path)]
    return [proxy_line(p, config_path) for p in running]


def proxy_line(proxy: Proxy, config_path: Path) -> str:
    if not proxy.answering:
        return f"No proxy is answering ({proxy.why}): this applies when one starts."
    return config_mismatch(proxy, config_path) or \
        f"The proxy at {proxy.url} (pid {proxy.pid}) applies this within 1 s."
