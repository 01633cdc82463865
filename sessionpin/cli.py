"""The ``sessionpin`` command: see where every conversation is, and switch servers safely.

Rules this module keeps:
- It works whether or not a proxy runs. It reads and writes the config file and the
  shared store, never the proxy: the running router reloads the config within 1 s and
  reads pins from the store, so ``use``, ``move`` and ``forget`` need no signal.
- A config edit changes only the setting asked for (``configedit``), is checked by
  parsing the new text (the result must say what was asked and nothing else may
  change), and is written in one rename. A choice already in force writes nothing.
- "Running conversations" are the conversations with a pin in the store: every
  conversation the proxy saw in the last 29 to 30 days (a pin lives 30 days from its
  last renewal, renewed at most once a day). Side requests never make a pin, so they
  are never counted as conversations. Pins survive proxy restarts, so the counts do not
  depend on a proxy answering. "Active" means a request in the last hour, as the proxy
  last flushed it (every few seconds).
- Moving a running conversation (``move``, and ``forget`` of a routed one) needs
  ``--yes`` or an answer at a terminal; without either it is refused.
- Every user error is one line on stderr, ``sessionpin: <what>; <what to do>``, and a
  non-zero exit (1; 2 for a usage error). No tracebacks for user errors.
- Read commands take ``--json``. Nothing here shows or stores prompt content: the store
  holds ids, server names, times and counts only.
- It imports the core, never mitmproxy (``run`` starts mitmdump as a program).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

from . import config as configmod
from . import configedit, pins
from .facts import AGENTS
from .store import StoreError, default_store_url, open_store
from .store.base import Store

HOUR = 3600.0
DEFAULT_LISTEN = ("127.0.0.1", 8080)
PROXY_PREFIX = "proxy:"
STATUS_PATH = "/__sessionpin/status"
CA_FILE = "mitmproxy-ca-cert.pem"
WEB_COLUMNS = ["icon", "method", "path", "status", "size", "time", "comment"]

# One wording, used everywhere, for what happens to a conversation the proxy has no pin for.
NOT_SEEN_BEGIN = "the proxy leaves a conversation it did not see begin alone (not routed)"

# How each agent's runtime is told to trust the mitmproxy CA.
NODE_AGENTS = ("claude-code", "opencode", "pi", "gemini-cli")
# Reverse mode: the variable that moves the agent's base URL, and the origin it replaces.
REVERSE = {
    "claude-code": ("ANTHROPIC_BASE_URL", "https://api.anthropic.com", ""),
    "codex": ("OPENAI_BASE_URL", "https://api.openai.com", "/v1"),
}
# A command name -> the agent it is (for ``exec``).
COMMAND_AGENT = {"claude": "claude-code", "opencode": "opencode", "pi": "pi", "codex": "codex",
                 "gemini": "gemini-cli"}


class Fail(Exception):
    """A user error: one line, and the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# --- small helpers -------------------------------------------------------------------


def out(line: str = "") -> None:
    print(line)


def err(line: str) -> None:
    print(line, file=sys.stderr)


def dump_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def short(session: str) -> str:
    """The short id shown in tables: 8 characters after a known kind prefix."""
    for prefix in ("ses_", "fp:", "thread_"):
        if session.startswith(prefix):
            return session[: len(prefix) + 8]
    return session[:8]


def ago(then: float | None, now: float) -> str:
    if not then:
        return "-"
    d = max(0.0, now - then)
    if d < 60:
        return f"{int(d)}s ago"
    if d < HOUR:
        return f"{int(d // 60)}m ago"
    if d < 48 * HOUR:
        return f"{int(d // HOUR)}h ago"
    return f"{int(d // 86400)}d ago"


# Why a pin says what it says: the ladder rule that made it (ladder.py), in words.
PIN_WHY = {
    "opening": "began here",
    "unknown-turn": "turn unknown",
    "not-routed": "agent not routed",
    "continuation-unseen": "not seen begin",
    "operator": "moved",
}


def why(pin: pins.Pin) -> str:
    return PIN_WHY.get(pin.rule, pin.rule or "-")


def iso(t: float | None) -> str | None:
    if not t:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def where(server: str | None) -> str:
    return server if server is not None else "not routed"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def table(rows: list[list[str]], indent: str = "") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# --- context: where the config and the store are -------------------------------------


@dataclass
class Ctx:
    config_path: Path
    store_url: str
    _store: Store | None = None

    # config
    def config(self) -> configmod.Config:
        try:
            return configmod.load(self.config_path)
        except configmod.ConfigError as e:
            raise Fail(f"{e}; fix {self.config_path} first (`sessionpin doctor` checks it)") from None

    def config_text(self) -> str:
        try:
            return self.config_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""
        except OSError as e:
            raise Fail(f"cannot read {self.config_path}: {e.strerror or e}") from None

    # store
    def store_file(self) -> Path | None:
        return store_file(self.store_url)

    def store_exists(self) -> bool:
        f = self.store_file()
        return f is None or f.exists()

    def store(self, create: bool = False) -> Store | None:
        """The store; None when it is a file that does not exist yet and ``create`` is False."""
        if self._store is not None:
            return self._store
        if not create and not self.store_exists():
            return None
        try:
            self._store = open_store(self.store_url)
        except StoreError as e:
            raise Fail(f"cannot open the store {self.store_url}: {e}; check --store or SESSIONPIN_STORE") from None
        except OSError as e:
            raise Fail(f"cannot open the store {self.store_url}: {e.strerror or e}; "
                       "check --store or SESSIONPIN_STORE") from None
        return self._store

    def need_store(self) -> Store:
        s = self.store()
        if s is None:
            raise Fail(f"no store at {self.store_file()} yet: no proxy has pinned a conversation with it; "
                       "check --store or SESSIONPIN_STORE (a proxy started with `sessionpin run` creates it)")
        return s

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def store_file(url: str) -> Path | None:
    scheme, sep, rest = url.partition(":")
    if scheme.lower() != "file" or not sep:
        return None
    path = rest[2:] if rest.startswith("//") else rest
    return Path(path).expanduser().absolute() if path else None


def check_written(store: Store) -> None:
    """A file store that could not reach its disk keeps writes in memory: for a CLI that is lost."""
    if getattr(store, "degraded", False):
        raise Fail(f"the store {store.url} could not write to its file ({getattr(store, '_fault', '') or 'disk error'}); "
                   "nothing was saved: check the disk and the file's permissions (`sessionpin doctor`)")


# --- pins, activity, proxies -----------------------------------------------------------


@dataclass(frozen=True)
class Row:
    session: str
    pin: pins.Pin
    seen: pins.Seen

    def as_json(self) -> dict[str, Any]:
        return {
            "session": self.session, "short": short(self.session), "agent": self.pin.agent,
            "server": self.pin.server, "pinned_since": iso(self.pin.since), "last_seen": iso(self.seen.last),
            "requests": self.seen.requests, "rule": self.pin.rule or None, "why": why(self.pin),
            "turn": self.pin.turn or None,
            "since_epoch": self.pin.since, "last_seen_epoch": self.seen.last or None,
        }


def rows(store: Store | None) -> list[Row]:
    if store is None:
        return []
    out = [Row(s, p, pins.seen(store, s)) for s, p in pins.sessions(store)]
    out.sort(key=lambda r: (-(r.seen.last or r.pin.since), r.session))
    return out


def resolve(store: Store, given: str) -> Row:
    """A pinned conversation by its id or a unique prefix of it."""
    given = given.strip()
    if not given:
        raise Fail("give a session id, or its first characters (see `sessionpin sessions`)")
    candidates = [r for r in rows(store) if r.session.startswith(given)]
    exact = [r for r in candidates if r.session == given]
    if exact:
        return exact[0]
    if not candidates:
        raise Fail(f"no pinned conversation starts with {given!r}; list them with `sessionpin sessions`")
    if len(candidates) > 1:
        shown = ", ".join(f"{r.session} ({r.pin.agent}, {where(r.pin.server)})" for r in candidates[:6])
        more = f" and {len(candidates) - 6} more" if len(candidates) > 6 else ""
        raise Fail(f"{given!r} matches {len(candidates)} conversations: {shown}{more}; give more characters")
    return candidates[0]


def heartbeats(store: Store | None) -> list[dict[str, Any]]:
    """The proxies that announced themselves in the store (each renews its key every few seconds)."""
    if store is None:
        return []
    found = []
    for k in store.keys(PROXY_PREFIX):
        try:
            beat = json.loads(store.get(k) or "")
        except (ValueError, StoreError):
            continue
        if isinstance(beat, dict):
            found.append(beat)
    return found


def listen_addresses(beat: dict[str, Any]) -> list[tuple[str, int]]:
    raw = beat.get("listen") or beat.get("listen_addresses") or beat.get("addresses") or []
    if isinstance(raw, (str, dict)):
        raw = [raw]
    found = []
    for a in raw:
        host, port = None, None
        if isinstance(a, dict):
            host, port = a.get("host"), a.get("port")
        elif isinstance(a, (list, tuple)) and len(a) >= 2:
            host, port = a[0], a[1]
        elif isinstance(a, str):
            text = a.split("@")[-1].split("://")[-1]
            host, _, port = text.rpartition(":")
        try:
            port = int(port)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        host = str(host or "127.0.0.1").strip("[]")
        if host in ("", "0.0.0.0", "::", "*"):
            host = "127.0.0.1"
        found.append((host, port))
    return found


def probe(host: str, port: int, timeout: float = 1.0) -> dict[str, Any] | None:
    """The router's status JSON from the proxy at host:port, or None if nothing answers it.

    A regular-mode proxy takes an absolute-form request; a reverse-mode one the plain path.
    """
    for target in (f"http://sessionpin.invalid{STATUS_PATH}", STATUS_PATH):
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", target, headers={"Host": "sessionpin.invalid", "Accept": "application/json"})
            resp = conn.getresponse()
            body = resp.read(1 << 20)
            if resp.status == 200:
                value = json.loads(body)
                if isinstance(value, dict):
                    return value
        except (OSError, ValueError, http.client.HTTPException):
            pass
        finally:
            conn.close()
    return None


@dataclass
class Proxy:
    answering: bool
    pid: int | None = None
    address: tuple[str, int] | None = None
    confdir: str | None = None
    started: float | None = None
    beat: dict[str, Any] | None = None
    why: str = ""
    status: dict[str, Any] | None = None     # the router's /__sessionpin/status answer

    @property
    def url(self) -> str | None:
        return f"http://{self.address[0]}:{self.address[1]}" if self.address else None

    def as_json(self) -> dict[str, Any]:
        return {"answering": self.answering, "pid": self.pid, "address": self.url, "confdir": self.confdir,
                "started": iso(self.started), "why": self.why or None}


def find_proxy(store: Store | None, store_url: str) -> Proxy:
    beats = heartbeats(store)
    for beat in beats:
        for addr in listen_addresses(beat):
            status = probe(*addr)
            if status is not None:
                return Proxy(True, _int(beat.get("pid")), addr, beat.get("confdir"), _float(beat.get("started")),
                             beat, status=status)
    if beats:
        pids = ", ".join(str(b.get("pid", "?")) for b in beats)
        return Proxy(False, _int(beats[0].get("pid")), None, beats[0].get("confdir"), None, beats[0],
                     f"proxy {pids} announced itself in the store but does not answer")
    # No heartbeat: a proxy may still run with another store; say so if one answers on the default port.
    status = probe(*DEFAULT_LISTEN, timeout=0.5)
    if status is not None:
        other = status.get("store") or status.get("store_url") or "another store"
        return Proxy(False, None, DEFAULT_LISTEN, None, None, None,
                     f"a sessionpin proxy answers at {DEFAULT_LISTEN[0]}:{DEFAULT_LISTEN[1]} but uses {other}, "
                     f"not {store_url}")
    return Proxy(False, why=f"no proxy heartbeat in the store {store_url}")


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def proxy_keys(proxy: Proxy) -> dict[str, bool] | None:
    """Whether each server's key variable is set, as the running proxy sees it (its status)."""
    if not proxy.answering or not proxy.status:
        return None
    servers = proxy.status.get("servers")
    if not isinstance(servers, dict):
        return None
    return {name: bool(s.get("key_set")) for name, s in servers.items()
            if isinstance(s, dict) and s.get("key_env")}


def key_state(server: configmod.Server, keys: dict[str, bool] | None) -> tuple[bool | None, str]:
    """(is the key set, where that was checked) for a server with a key_env.

    The proxy reads keys from its own environment, so its answer wins; a server the
    proxy has not loaded yet (or no proxy) is checked in this shell, and says so.
    """
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


# --- commands ------------------------------------------------------------------------


def cmd_status(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    store = ctx.store()
    now = time.time()
    all_rows = rows(store)
    proxy = find_proxy(store, ctx.store_url)
    penv = proxy_keys(proxy)

    def counts(server: str | None) -> tuple[int, int]:
        mine = [r for r in all_rows if r.pin.server == server]
        return len(mine), sum(1 for r in mine if r.seen.last >= now - HOUR)

    servers = []
    for s in cfg.servers.values():
        pinned, active = counts(s.name)
        is_set, checked = key_state(s, penv)
        servers.append({"name": s.name, "url": s.url, "key_env": s.key_env, "key_set": is_set,
                        "key_checked_in": checked or None, "pinned": pinned, "active_last_hour": active})
    gone = sorted({r.pin.server for r in all_rows if r.pin.server is not None and r.pin.server not in cfg.servers})
    missing = [{"name": g, "pinned": counts(g)[0], "active_last_hour": counts(g)[1]} for g in gone]
    nr_pinned, nr_active = counts(None)
    agents = {a: cfg.current(a) for a in AGENTS}
    if args.json:
        dump_json({
            "config": str(ctx.config_path), "config_exists": ctx.config_path.exists(),
            "store": ctx.store_url, "store_exists": store is not None,
            "proxy": proxy.as_json(), "servers": servers,
            "not_routed": {"pinned": nr_pinned, "active_last_hour": nr_active},
            "unconfigured_servers_with_pins": missing, "agents": agents,
        })
        return 0

    out(f"config  {ctx.config_path}" + ("" if ctx.config_path.exists() else "  (no file: nothing is routed)"))
    out(f"store   {ctx.store_url}" + ("" if store is not None else "  (no file yet: nothing pinned)"))
    if proxy.answering:
        up = f", up {ago(proxy.started, now).removesuffix(' ago')}" if proxy.started else ""
        out(f"proxy   answering at {proxy.url} (pid {proxy.pid}{up})")
        mismatch = config_mismatch(proxy, ctx.config_path)
        if mismatch:
            out(f"        {mismatch}")
    else:
        out(f"proxy   not answering: {proxy.why}; start one with `sessionpin run`")
    out()
    grid = [["SERVER", "URL", "KEY", "PINNED", "ACTIVE 1H"]]
    for s in servers:
        if s["key_env"]:
            key = f"${s['key_env']} " + ("set" if s["key_set"] else "NOT SET")
        else:
            key = "the agent's own"
        grid.append([s["name"], s["url"], key, str(s["pinned"]), str(s["active_last_hour"])])
    for m in missing:
        grid.append([m["name"], "(not configured: its requests get 503)", "-", str(m["pinned"]), str(m["active_last_hour"])])
    grid.append(["(not routed)", "-", "-", str(nr_pinned), str(nr_active)])
    for line in table(grid):
        out(line)
    checked_in = sorted({s["key_checked_in"] for s in servers if s["key_checked_in"]})
    if checked_in:
        out(f"(keys checked in {' and '.join(checked_in)})")
    out()
    grid = [["AGENT", "NEW CONVERSATIONS GO TO"]]
    for a, s in agents.items():
        grid.append([a, where(s)])
    for line in table(grid):
        out(line)
    return 0


def cmd_sessions(ctx: Ctx, args: argparse.Namespace) -> int:
    if args.agent and args.agent not in AGENTS:
        raise Fail(f"unknown agent {args.agent!r} (known: {', '.join(AGENTS)})")
    store = ctx.store()
    now = time.time()
    selected = rows(store)
    if args.agent:
        selected = [r for r in selected if r.pin.agent == args.agent]
    if args.server is not None:
        cfg = ctx.config()
        if args.server not in cfg.servers and not any(r.pin.server == args.server for r in selected):
            known = ", ".join(cfg.servers) or "none configured"
            raise Fail(f"no server named {args.server!r} and no conversation pinned to it (servers: {known})")
        selected = [r for r in selected if r.pin.server == args.server]
    if args.not_routed:
        selected = [r for r in selected if r.pin.server is None]
    if args.json:
        dump_json([r.as_json() for r in selected])
        return 0
    if not selected:
        what = "no pinned conversations" + ("" if store is not None else f" (no store file yet at {ctx.store_file()})")
        out(what + (" match" if (args.agent or args.server or args.not_routed) and store is not None else ""))
        return 0
    grid = [["SESSION", "AGENT", "SERVER", "WHY", "PINNED", "LAST SEEN", "REQUESTS"]]
    for r in selected:
        grid.append([short(r.session), r.pin.agent, where(r.pin.server), why(r.pin), ago(r.pin.since, now),
                     ago(r.seen.last, now), str(r.seen.requests)])
    for line in table(grid):
        out(line)
    return 0


def describe_running(store: Store | None, agent: str, now: float) -> str:
    agent_rows = [r for r in rows(store) if r.pin.agent == agent]
    if not agent_rows:
        return (f"No running {agent} conversation is pinned. One the proxy has not seen yet stays where "
                f"it is: {NOT_SEEN_BEGIN}.")
    by: dict[str | None, int] = {}
    for r in agent_rows:
        by[r.pin.server] = by.get(r.pin.server, 0) + 1
    order = sorted(by, key=lambda s: (s is None, -by[s], s or ""))
    parts = ", ".join(f"{by[s]} on {s}" if s is not None else f"{by[s]} not routed" for s in order)
    n = len(agent_rows)
    active = sum(1 for r in agent_rows if r.seen.last >= now - HOUR)
    verb = "stays where it is" if n == 1 else "stay where they are"
    return (f"{plural(n, 'running conversation')} {verb}: {parts}.\n"
            f"  (running = {agent} conversations with a pin, i.e. seen by the proxy in the last 29 to 30 days; "
            f"{active} active in the last hour. One it has not seen yet stays where it is too: {NOT_SEEN_BEGIN}.)")


def config_mismatch(proxy: Proxy, config_path: Path) -> str | None:
    """A warning when the answering proxy reads another config file than this command."""
    if not proxy.answering:
        return None
    theirs = (proxy.status or {}).get("config") or (proxy.beat or {}).get("config")
    if theirs and Path(theirs).expanduser().absolute() != config_path.expanduser().absolute():
        return (f"Warning: the proxy at {proxy.url} (pid {proxy.pid}) reads {theirs}, not {config_path}: "
                f"this change does not reach it; use --config {theirs}")
    return None


def proxy_line(proxy: Proxy, config_path: Path) -> str:
    if not proxy.answering:
        return f"No proxy is answering ({proxy.why}): this applies when one starts."
    return config_mismatch(proxy, config_path) or \
        f"The proxy at {proxy.url} (pid {proxy.pid}) applies this within 1 s."


def cmd_use(ctx: Ctx, args: argparse.Namespace) -> int:
    agent = args.agent
    if agent not in AGENTS:
        raise Fail(f"unknown agent {agent!r} (known: {', '.join(AGENTS)})")
    if args.not_routed and args.server:
        raise Fail("give a SERVER or --not-routed, not both")
    if not args.not_routed and not args.server:
        raise Fail(f"give the server for new {agent} conversations, or --not-routed "
                   f"(e.g. `sessionpin use {agent} glm`)", 2)
    target = None if args.not_routed else args.server
    cfg = ctx.config()
    if target is not None and target not in cfg.servers:
        known = ", ".join(cfg.servers) or "none configured"
        raise Fail(f"no server named {target!r} in {ctx.config_path} (servers: {known}); "
                   f"add it with `sessionpin servers add {target} URL`")
    current = cfg.current(agent)
    if current == target:
        state = f"already go to {target}" if target else "are already not routed"
        out(f"New {agent} conversations {state}; nothing written.")
        mismatch = config_mismatch(find_proxy(ctx.store(), ctx.store_url), ctx.config_path)
        if mismatch:
            err(mismatch)
        return 0
    text = ctx.config_text()
    new_text = configedit.set_agent_server(text, agent, target)
    check(ctx, new_text, f"agents.{agent}.server",
          lambda c: c.current(agent) == target and c.servers == cfg.servers
          and {a: x.server for a, x in c.agents.items() if a != agent}
          == {a: x.server for a, x in cfg.agents.items() if a != agent},
          f'[agents.{agent}] server = "{target or ""}"')
    write_config(ctx, new_text)
    arrow = f"New {agent} conversations → {where(target)}"
    if target is None:
        arrow += f" (left alone: they go where {agent} sends them)"
    out(f"{arrow}. (was: {where(current)})")
    try:
        store = ctx.store()
    except Fail as e:  # the change is made; only the report of what stays is missing
        err(f"sessionpin: warning: could not count the running conversations: {e}")
        return 0
    out(describe_running(store, agent, time.time()))
    proxy = find_proxy(store, ctx.store_url)
    out(proxy_line(proxy, ctx.config_path))
    warn_key(cfg, target, proxy)
    return 0


def write_config(ctx: Ctx, text: str) -> None:
    try:
        configedit.write_atomic(ctx.config_path, text)
    except OSError as e:
        raise Fail(f"cannot write {ctx.config_path}: {e.strerror or e}; nothing changed") from None


def warn_key(cfg: configmod.Config, target: str | None, proxy: Proxy) -> None:
    if target is None:
        return
    server = cfg.servers[target]
    if not server.key_env:
        err(f"Note: {target} has no key_env, so only requests addressed to {server.origin} can go there "
            f"(with the agent's own key); the proxy refuses the others rather than send a key to the wrong server.")
        return
    is_set, checked = key_state(server, proxy_keys(proxy))
    if is_set is False:
        err(f"Warning: ${server.key_env} is not set in {checked}; the proxy needs it to send requests to {target}.")


def check(ctx: Ctx, new_text: str, setting: str, ok, by_hand: str) -> configmod.Config:
    """Parse the edited text; refuse (nothing written) unless it says exactly what was asked."""
    try:
        new_cfg = configmod.parse(new_text, str(ctx.config_path))
    except configmod.ConfigError as e:
        raise Fail(f"could not change {setting} in {ctx.config_path} safely ({e}); nothing written; "
                   f"edit it by hand: {by_hand}") from None
    if not ok(new_cfg):
        raise Fail(f"could not change {setting} in {ctx.config_path} safely (it is written in a form "
                   f"sessionpin does not edit, e.g. an inline table); nothing written; edit it by hand: {by_hand}")
    return new_cfg


MOVE_RISKS = """\
Its next request carries the whole conversation so far to {to}, which may refuse it:
  - the history may be longer than {to}'s context window (400, "maximum context length");
  - thinking blocks signed by {frm} do not verify on {to} (400, invalid signature);
  - {to} may not take this conversation's model or key (403/404).
A conversation stays on the server it began on for these reasons; move it only if it cannot continue there."""


def confirm(args: argparse.Namespace, question: str, refusal: str) -> None:
    if args.yes:
        return
    if not sys.stdin or not sys.stdin.isatty():
        raise Fail(f"{refusal}: confirm with --yes (stdin is not a terminal, so sessionpin cannot ask)")
    sys.stderr.write(question + " [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if answer.strip().lower() not in ("y", "yes"):
        raise Fail(f"{refusal}: not confirmed")


def cmd_move(ctx: Ctx, args: argparse.Namespace) -> int:
    if args.not_routed and args.server:
        raise Fail("give a SERVER or --not-routed, not both")
    if not args.not_routed and not args.server:
        raise Fail("give the server to move the conversation to, or --not-routed", 2)
    target = None if args.not_routed else args.server
    cfg = ctx.config()
    if target is not None and target not in cfg.servers:
        known = ", ".join(cfg.servers) or "none configured"
        raise Fail(f"no server named {target!r} in {ctx.config_path} (servers: {known})")
    store = ctx.need_store()
    row = resolve(store, args.session)
    sid, pin = row.session, row.pin
    if pin.server == target:
        out(f"{short(sid)} ({pin.agent}) is already {'on ' + target if target else 'not routed'}; nothing written.")
        return 0
    frm = where(pin.server)
    to = where(target)
    err(f"Moving running conversation {short(sid)} ({pin.agent}, last seen {ago(row.seen.last, time.time())}) "
        f"from {frm} to {to}.")
    err(MOVE_RISKS.format(frm=frm if pin.server else "the server it began on",
                          to=to if target else "the server the agent addresses"))
    confirm(args, "Move it?", f"{short(sid)} not moved")
    now = time.time()
    pins.put(store, sid, pins.Pin(agent=pin.agent, server=target, since=now, renewed=now,
                                  rule="operator", turn=pin.turn))
    check_written(store)
    out(f"Moved {short(sid)} ({pin.agent}) from {frm} to {to}. Its next request goes to {to}"
        + (f" (left alone: where {pin.agent} sends it)." if target is None else "."))
    warn_key(cfg, target, find_proxy(store, ctx.store_url))
    return 0


def cmd_forget(ctx: Ctx, args: argparse.Namespace) -> int:
    store = ctx.need_store()
    row = resolve(store, args.session)
    sid, pin = row.session, row.pin
    if pin.server is not None:
        err(f"Forgetting {short(sid)} ({pin.agent}, on {pin.server}) moves it: its next request is decided "
            f"afresh, and {NOT_SEEN_BEGIN}, so it leaves {pin.server} for the server {pin.agent} addresses.")
        err(MOVE_RISKS.format(frm=pin.server, to="that server"))
        confirm(args, "Forget it?", f"{short(sid)} not forgotten")
    pins.forget(store, sid)
    check_written(store)
    out(f"Forgot {short(sid)} ({pin.agent}, was {where(pin.server)}). Its next request is decided afresh: "
        f"{NOT_SEEN_BEGIN}.")
    return 0


def cmd_servers(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    if args.json:
        dump_json([{"name": s.name, "url": s.url, "key_env": s.key_env, "auth": s.auth,
                    "models": dict(s.models)} for s in cfg.servers.values()])
        return 0
    if not cfg.servers:
        out(f"No servers in {ctx.config_path}; add one with `sessionpin servers add NAME URL --key-env VAR`.")
        return 0
    grid = [["SERVER", "URL", "KEY FROM", "AUTH"]]
    for s in cfg.servers.values():
        grid.append([s.name, s.url, f"${s.key_env}" if s.key_env else "the agent", s.auth or "as the agent sent it"])
    for line in table(grid):
        out(line)
    return 0


def cmd_servers_add(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    name = args.name
    if name in cfg.servers:
        raise Fail(f"a server named {name!r} exists ({cfg.servers[name].url}); "
                   f"remove it first (`sessionpin servers remove {name}`) or edit {ctx.config_path}")
    new_text = configedit.add_server(ctx.config_text(), name, args.url, args.key_env, args.auth)
    try:
        new_cfg = configmod.parse(new_text, str(ctx.config_path))
    except configmod.ConfigError as e:
        raise Fail(f"cannot add server {name!r}: {e}; nothing written") from None
    if new_cfg.agents != cfg.agents or {k: v for k, v in new_cfg.servers.items() if k != name} != cfg.servers \
            or name not in new_cfg.servers:
        raise Fail(f"could not add server {name!r} to {ctx.config_path} safely; nothing written; "
                   f"add a [servers.{name}] table by hand")
    write_config(ctx, new_text)
    server = new_cfg.servers[name]
    out(f"Added server {name}: {server.url}.")
    if server.key_env:
        where_set = "set" if os.environ.get(server.key_env) else "not set"
        out(f"Its key comes from ${server.key_env} ({where_set} in this shell; the proxy reads its own environment).")
    else:
        out(f"It has no key_env: only requests addressed to {server.origin} can go there, with the agent's own key.")
    out(f"No agent sends new conversations there yet: `sessionpin use AGENT {name}`.")
    return 0


def cmd_servers_remove(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    name = args.name
    if name not in cfg.servers:
        known = ", ".join(cfg.servers) or "none configured"
        raise Fail(f"no server named {name!r} in {ctx.config_path} (servers: {known})")
    users = [a for a, x in cfg.agents.items() if x.server == name]
    if users:
        raise Fail(f"new {', '.join(users)} conversations go to {name}; first send them elsewhere: "
                   f"`sessionpin use {users[0]} OTHER` (or --not-routed)")
    store = ctx.store()
    now = time.time()
    pinned = [r for r in rows(store) if r.pin.server == name]
    if pinned and not args.force:
        by: dict[str, int] = {}
        for r in pinned:
            by[r.pin.agent] = by.get(r.pin.agent, 0) + 1
        detail = ", ".join(f"{n} {a}" for a, n in sorted(by.items()))
        active = sum(1 for r in pinned if r.seen.last >= now - HOUR)
        err(f"{plural(len(pinned), 'running conversation')} {'is' if len(pinned) == 1 else 'are'} pinned to "
            f"{name} ({detail}; {active} active in the last hour).")
        err(f"Once {name} is removed the proxy refuses their requests with 503, naming {name}, until each is "
            f"moved (`sessionpin move SESSION SERVER`) or forgotten (`sessionpin forget SESSION`). "
            f"They are never moved by themselves. List them: `sessionpin sessions --server {name}`.")
        raise Fail(f"{name} not removed: run again with --force to remove it anyway")
    new_text = configedit.remove_server(ctx.config_text(), name)
    check(ctx, new_text, f"servers.{name}",
          lambda c: name not in c.servers and c.agents == cfg.agents
          and c.servers == {k: v for k, v in cfg.servers.items() if k != name},
          f"delete the [servers.{name}] table")
    write_config(ctx, new_text)
    out(f"Removed server {name} from {ctx.config_path}.")
    if pinned:
        out(f"{plural(len(pinned), 'conversation')} pinned to {name} now get 503 until moved or forgotten: "
            f"`sessionpin sessions --server {name}`.")
    return 0


# --- env, exec, run ------------------------------------------------------------------


def agent_env(agent: str | None, proxy_url: str, ca: Path) -> dict[str, str]:
    env = {"HTTPS_PROXY": proxy_url, "HTTP_PROXY": proxy_url}
    if agent is None or agent in NODE_AGENTS:
        env["NODE_EXTRA_CA_CERTS"] = str(ca)
    if agent is None or agent == "codex":
        env["SSL_CERT_FILE"] = str(ca)
        env["CODEX_CA_CERTIFICATE"] = str(ca)
    return env


def proxy_target(ctx: Ctx, args: argparse.Namespace) -> tuple[str, Path, Proxy]:
    proxy = find_proxy(ctx.store(), ctx.store_url)
    if args.proxy:
        url = args.proxy if "://" in args.proxy else f"http://{args.proxy}"
    elif proxy.answering and proxy.url:
        url = proxy.url
    else:
        url = f"http://{DEFAULT_LISTEN[0]}:{DEFAULT_LISTEN[1]}"
    return url, confdir_of(proxy, args.confdir) / CA_FILE, proxy


def cmd_env(ctx: Ctx, args: argparse.Namespace) -> int:
    agent = args.agent
    if agent not in AGENTS:
        raise Fail(f"unknown agent {agent!r} (known: {', '.join(AGENTS)})")
    url, ca, proxy = proxy_target(ctx, args)
    if args.reverse is not None:
        if agent not in REVERSE:
            raise Fail(f"{agent} has no base-URL variable sessionpin knows; set its provider's base URL to "
                       f"http://127.0.0.1:{args.reverse} in its own config, or use proxy mode (drop --reverse)")
        var, origin, path = REVERSE[agent]
        env = {var: f"http://127.0.0.1:{args.reverse}{path}"}
        if args.json:
            dump_json({"agent": agent, "mode": "reverse", "env": env,
                       "proxy_command": f"sessionpin run --mode reverse:{origin}@{args.reverse}"})
            return 0
        out(f"# {agent} in reverse mode: plain HTTP to the proxy on loopback, no CA to trust.")
        out(f"# The proxy must listen in reverse mode: sessionpin run --mode reverse:{origin}@{args.reverse}")
        for k, v in env.items():
            out(f"export {k}={shlex.quote(v)}")
        return 0
    env = agent_env(agent, url, ca)
    if args.json:
        dump_json({"agent": agent, "mode": "proxy", "env": env, "ca_exists": ca.exists(),
                   "proxy_answering": proxy.answering})
        return 0
    out(f"# {agent} through the sessionpin proxy at {url}: eval \"$(sessionpin env {agent})\"")
    if not proxy.answering:
        out(f"# no proxy is answering yet ({proxy.why}); start one: sessionpin run")
    if not ca.exists():
        out(f"# {ca} does not exist yet: the proxy creates it when it first starts")
    for k, v in env.items():
        out(f"export {k}={shlex.quote(v)}")
    if agent in REVERSE:
        var, origin, path = REVERSE[agent]
        out(f"# or reverse mode, no CA: `sessionpin env {agent} --reverse 8081` ({var})")
    return 0


def cmd_exec(ctx: Ctx, args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise Fail("give the command to run after --, e.g. `sessionpin exec -- claude`", 2)
    agent = args.agent
    if agent is not None and agent not in AGENTS:
        raise Fail(f"unknown agent {agent!r} (known: {', '.join(AGENTS)})")
    if agent is None:
        agent = COMMAND_AGENT.get(Path(command[0]).name)
    url, ca, proxy = proxy_target(ctx, args)
    ctx.close()
    if not proxy.answering and not args.proxy:
        err(f"sessionpin: warning: no proxy is answering ({proxy.why}); {command[0]} may fail to connect")
    env = {**os.environ, **agent_env(agent, url, ca)}
    exe = shutil.which(command[0], path=env.get("PATH"))
    if exe is None:
        raise Fail(f"command not found: {command[0]}", 127)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(exe, command, env)
    except OSError as e:
        raise Fail(f"cannot run {command[0]}: {e.strerror or e}", 126) from None
    return 0  # not reached


def route_script() -> Path:
    """The mitmdump script that loads the router, shipped inside the package."""
    return Path(__file__).resolve().parent / "mitmscript" / "route.py"


def find_tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise Fail(f"{name} not found next to {sys.executable} or on PATH; install mitmproxy 12 (pip install 'mitmproxy>=12,<13')")


def _has(extra: Sequence[str], *flags: str) -> bool:
    return any(a in flags or any(a.startswith(f + "=") for f in flags if f.startswith("--")) for a in extra)


def run_command(ctx: Ctx, web: bool, extra: Sequence[str]) -> list[str]:
    tool = "mitmweb" if web else "mitmdump"
    cmd = [find_tool(tool)]
    if not _has(extra, "--listen-host"):
        cmd += ["--listen-host", DEFAULT_LISTEN[0]]
    if not _has(extra, "-p", "--listen-port"):
        cmd += ["--listen-port", str(DEFAULT_LISTEN[1])]
    cmd += ["-s", str(route_script()),
            "--set", "connection_strategy=lazy",
            "--set", f"sessionpin_config={ctx.config_path}",
            "--set", f"sessionpin_store={ctx.store_url}"]
    if web and not any(a.startswith("web_columns=") for a in extra):
        cmd += ["--set", "web_columns=" + ",".join(WEB_COLUMNS)]
    return cmd + list(extra)


def cmd_run(ctx: Ctx, args: argparse.Namespace, extra: Sequence[str]) -> int:
    ctx.config()  # a broken config stops here, with its one line
    extra = [a for a in extra if a != "--"] if extra[:1] == ["--"] else list(extra)
    cmd = run_command(ctx, args.web, extra)
    if args.dry_run:
        out(shlex.join(cmd))
        return 0
    err(f"sessionpin: {shlex.join(cmd)}")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        raise Fail(f"cannot start {cmd[0]}: {e.strerror or e}", 126) from None
    return 0  # not reached


# --- doctor --------------------------------------------------------------------------


@dataclass
class Check:
    what: str
    state: str        # "ok" | "warn" | "FAIL"
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"check": self.what, "state": self.state.lower(), "detail": self.detail}


def cmd_doctor(ctx: Ctx, args: argparse.Namespace) -> int:
    checks: list[Check] = []
    add = lambda what, state, detail: checks.append(Check(what, state, detail))  # noqa: E731

    cfg: configmod.Config | None = None
    try:
        cfg = configmod.load(ctx.config_path)
        if not ctx.config_path.exists():
            add("config", "warn", f"no file at {ctx.config_path}: nothing is routed; "
                "add a server with `sessionpin servers add NAME URL`")
        else:
            routed = sorted(a for a, x in cfg.agents.items() if x.server)
            add("config", "ok", f"{ctx.config_path}: {plural(len(cfg.servers), 'server')}, "
                f"routed: {', '.join(routed) or 'no agent'}")
    except configmod.ConfigError as e:
        add("config", "FAIL", f"{e}; fix that line in {ctx.config_path} (a running proxy refuses this "
            "text and keeps the config it had; a starting one stops)")

    store = None
    f = ctx.store_file()
    # Modes before opening: opening a file store tightens a loose file mode by itself.
    modes_before = None
    if f is not None and f.exists():
        modes_before = (stat.S_IMODE(f.stat().st_mode), stat.S_IMODE(f.parent.stat().st_mode))
    try:
        store = ctx.store(create=False)
    except Fail as e:
        add("store", "FAIL", str(e))
    if store is None and f is not None and not f.exists() and not any(c.what == "store" for c in checks):
        parent = next((p for p in [f.parent, *f.parent.parents] if p.exists()), None)
        if parent is not None and os.access(parent, os.W_OK | os.X_OK):
            add("store", "warn", f"no file yet at {f}: the proxy creates it at its first pin")
        else:
            add("store", "FAIL", f"no file at {f} and {parent} is not writable: "
                "choose a writable place with --store file:PATH (and the same for the proxy)")
    if store is not None:
        problems = []
        try:
            store.keys(pins.PIN_PREFIX)
        except StoreError as e:
            problems.append(f"not readable ({e})")
        probe_key = f"doctor:{os.getpid()}"
        try:
            store.set(probe_key, "1", 60, durable=True)
            if store.get(probe_key) != "1" or getattr(store, "degraded", False):
                problems.append("not writable (writes stay in memory: " + str(getattr(store, "_fault", "") or "?") + ")")
            store.delete(probe_key, durable=True)
        except StoreError as e:
            problems.append(f"not writable ({e})")
        if f is not None and f.exists():
            mode, dmode = stat.S_IMODE(f.stat().st_mode), stat.S_IMODE(f.parent.stat().st_mode)
            if modes_before and modes_before[0] & 0o077 and not mode & 0o077:
                add("store mode", "warn", f"{f} was mode {modes_before[0]:04o} (others could read it); "
                    f"the store made it {mode:04o}")
            if mode & 0o077:
                problems.append(f"file mode {mode:04o}, others can read it: chmod 600 {f}")
            if dmode & 0o077:
                add("store dir", "warn", f"{f.parent} is mode {dmode:04o}: others can see the store's name; "
                    f"chmod 700 {f.parent} to hide it")
        if problems:
            add("store", "FAIL", f"{ctx.store_url}: " + "; ".join(problems))
        else:
            add("store", "ok", f"{ctx.store_url}: readable, writable"
                + (f", mode {stat.S_IMODE(f.stat().st_mode):04o} in a {stat.S_IMODE(f.parent.stat().st_mode):04o} directory" if f else ""))

    proxy = find_proxy(store, ctx.store_url)
    ca = confdir_of(proxy, args.confdir) / CA_FILE
    if ca.exists():
        add("CA", "ok", f"{ca}")
    else:
        add("CA", "FAIL", f"{ca} is missing: start the proxy once (`sessionpin run`) to create it, "
            "then point agents at it (`sessionpin env AGENT`)")
    if proxy.answering:
        mismatch = config_mismatch(proxy, ctx.config_path)
        if mismatch:
            add("proxy", "FAIL", mismatch.removeprefix("Warning: "))
        else:
            add("proxy", "ok", f"answering at {proxy.url} (pid {proxy.pid})")
    else:
        add("proxy", "FAIL", f"not answering: {proxy.why}; start it with `sessionpin run`"
            + (f" --store {ctx.store_url}" if "uses" in proxy.why else ""))

    if cfg is not None:
        penv = proxy_keys(proxy)
        # Servers requests go to: each agent's current one, and each one conversations are pinned to.
        pinned_to = {r.pin.server for r in rows(store) if r.pin.server in cfg.servers}
        routed = sorted({x.server for x in cfg.agents.values() if x.server} | pinned_to)
        for name in routed:
            s = cfg.servers[name]
            is_set, checked = key_state(s, penv)
            if is_set is None:
                add(f"key {name}", "ok", f"{name} takes the agent's own key (no key_env): only requests "
                    f"addressed to {s.origin} can go there")
            elif is_set:
                add(f"key {name}", "ok", f"${s.key_env} is set in {checked}")
            else:
                add(f"key {name}", "FAIL", f"${s.key_env} is not set in {checked}: export it where the proxy "
                    "starts, then restart the proxy")
        gone: dict[str, int] = {}
        for r in rows(store):
            if r.pin.server is not None and r.pin.server not in cfg.servers:
                gone[r.pin.server] = gone.get(r.pin.server, 0) + 1
        for name, n in sorted(gone.items()):
            add(f"pins {name}", "warn", f"{plural(n, 'conversation')} pinned to {name}, which is not configured: "
                f"their requests get 503; move or forget them (`sessionpin sessions --server {name}`)")

    failed = [c for c in checks if c.state == "FAIL"]
    if args.json:
        dump_json({"ok": not failed, "checks": [c.as_json() for c in checks]})
    else:
        width = max(len(c.what) for c in checks)
        for c in checks:
            out(f"{c.state:<4}  {c.what:<{width}}  {c.detail}")
        out(f"{plural(len(failed), 'problem')} to fix." if failed else "All good.")
    return 1 if failed else 0


# --- classify, pool: commands of other modules ---------------------------------------


def cmd_delegate(module: str, argv: list[str]) -> int:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise Fail(f"`sessionpin {module.rsplit('.', 1)[-1]}` is not available in this installation") from None
    return int(mod.main(argv) or 0)


def cmd_pool(ctx: Ctx, args: argparse.Namespace) -> int:
    """The pool engineer's report (sessionpin.pool.report), read from the shared store."""
    try:
        from .pool import report
        from .pool.options import PoolConfig
    except ImportError:
        raise Fail("`sessionpin pool` is not available in this installation") from None
    ttl_ms = args.ttl_ms if args.ttl_ms is not None else PoolConfig().ttl_ms
    store = ctx.store()
    if store is None:
        snap = {"groups": [], "retired": 0}
    else:
        snap = report.snapshot(store, int(time.time() * 1000), ttl_ms)
    out(report.json_text(snap) if args.json else report.text(snap))
    return 0


# --- argument parsing ----------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse, with one-line errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def parser() -> Parser:
    common = Parser(add_help=False, allow_abbrev=False)
    common.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="the config file (default: $SESSIONPIN_CONFIG, else the user config dir)")
    common.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,
                        help="the store URL (default: $SESSIONPIN_STORE, else file:<user state dir>/state.db)")
    p = Parser(prog="sessionpin", parents=[common], allow_abbrev=False,
               description="Keep each running coding-agent conversation on the server it began on: "
                           "see where every conversation is, and switch servers safely.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    def cmd(name: str, help: str, **kw) -> Parser:
        return sub.add_parser(name, help=help, description=kw.pop("description", help), parents=[common],
                              allow_abbrev=False, **kw)

    c = cmd("run", "start mitmdump (or mitmweb) with the router; other arguments go to mitmdump",
            description="Start mitmdump with the sessionpin router, listening on 127.0.0.1:8080 unless "
                        "the arguments say otherwise. Unknown arguments go to mitmdump.")
    c.add_argument("--web", action="store_true", help="start mitmweb instead, with the comment column shown")
    c.add_argument("--dry-run", action="store_true", help="print the command instead of running it")

    c = cmd("env", "print the shell lines that point an agent at the proxy")
    c.add_argument("agent", metavar="AGENT", help=", ".join(AGENTS))
    c.add_argument("--reverse", metavar="PORT", type=int, help="reverse mode: the base-URL variable instead")
    c.add_argument("--proxy", metavar="URL", help="the proxy URL (default: the running proxy's, else http://127.0.0.1:8080)")
    c.add_argument("--confdir", metavar="DIR", help="mitmproxy's confdir holding the CA (default: the running proxy's, else ~/.mitmproxy)")
    c.add_argument("--json", action="store_true")

    c = cmd("exec", "run a command with the proxy's environment (sessionpin exec -- claude)")
    c.add_argument("--agent", metavar="AGENT", help="whose variables to set (default: from the command name; else all)")
    c.add_argument("--proxy", metavar="URL")
    c.add_argument("--confdir", metavar="DIR")
    c.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...")

    c = cmd("status", "config, store, servers, agents, pins per server, and whether a proxy answers")
    c.add_argument("--json", action="store_true")

    c = cmd("use", "send an agent's NEW conversations to a server (running ones stay where they are)")
    c.add_argument("agent", metavar="AGENT", help=", ".join(AGENTS))
    c.add_argument("server", metavar="SERVER", nargs="?")
    c.add_argument("--not-routed", action="store_true", help="leave the agent's new conversations alone")

    c = cmd("sessions", "one row per pinned conversation")
    c.add_argument("--agent", metavar="AGENT")
    c.add_argument("--server", metavar="SERVER")
    c.add_argument("--not-routed", action="store_true", help="only conversations pinned 'not routed'")
    c.add_argument("--json", action="store_true")

    c = cmd("move", "move one running conversation to another server (after a warning)")
    c.add_argument("session", metavar="SESSION", help="its id or a unique prefix")
    c.add_argument("server", metavar="SERVER", nargs="?")
    c.add_argument("--not-routed", action="store_true", help="leave its requests alone from now on")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask")

    c = cmd("forget", "drop one conversation's pin (its next request is decided afresh)")
    c.add_argument("session", metavar="SESSION", help="its id or a unique prefix")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask")

    c = cmd("servers", "list, add or remove servers")
    c.add_argument("--json", action="store_true")
    ss = c.add_subparsers(dest="servers_command", metavar="add|remove", parser_class=Parser)
    a = ss.add_parser("add", help="add a server", parents=[common], allow_abbrev=False)
    a.add_argument("name", metavar="NAME")
    a.add_argument("url", metavar="URL", help="an origin plus an optional path prefix")
    a.add_argument("--key-env", metavar="VAR", help="the environment variable holding its key")
    a.add_argument("--auth", choices=configmod.AUTH_STYLES, help="how it takes its key (default: as the agent sent it)")
    r = ss.add_parser("remove", help="remove a server", parents=[common], allow_abbrev=False)
    r.add_argument("name", metavar="NAME")
    r.add_argument("--force", action="store_true", help="remove it even if conversations are pinned to it")

    c = cmd("doctor", "check the config, store, CA, proxy and keys; say what to fix")
    c.add_argument("--confdir", metavar="DIR")
    c.add_argument("--json", action="store_true")

    c = cmd("classify", "read recorded requests and say what each one is (FILE...)", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c = cmd("pool", "the OpenCode session-id pool: spares and bindings per provider and model")
    c.add_argument("--ttl-ms", type=int, metavar="MS",
                   help="a spare verified within this is fresh (default: the pool's default)")
    c.add_argument("--json", action="store_true")
    return p


def make_ctx(args: argparse.Namespace) -> Ctx:
    cfg = getattr(args, "config", None) or os.environ.get("SESSIONPIN_CONFIG") or str(configmod.default_path())
    store = getattr(args, "store", None) or os.environ.get("SESSIONPIN_STORE") or default_store_url()
    return Ctx(Path(cfg).expanduser(), store)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    try:
        args, extra = p.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    command = args.command
    if command == "classify":
        try:
            return cmd_delegate("sessionpin.classify", [*extra, *args.rest])
        except Fail as e:
            err(f"sessionpin: {e}")
            return e.code
    if extra and command != "run":
        p.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2
    if command is None:
        p.print_help(sys.stderr)
        return 2
    ctx = make_ctx(args)
    try:
        if command == "run":
            return cmd_run(ctx, args, extra)
        if command == "servers":
            if args.servers_command == "add":
                return cmd_servers_add(ctx, args)
            if args.servers_command == "remove":
                return cmd_servers_remove(ctx, args)
            return cmd_servers(ctx, args)
        return COMMANDS[command](ctx, args)
    except Fail as e:
        err(f"sessionpin: {e}")
        return e.code
    except configedit.EditError as e:
        err(f"sessionpin: {e}")
        return 1
    except StoreError as e:
        err(f"sessionpin: store {ctx.store_url}: {e}; check --store or SESSIONPIN_STORE")
        return 1
    except KeyboardInterrupt:
        err("sessionpin: interrupted")
        return 130
    except BrokenPipeError:
        # `sessionpin sessions | head`: stop quietly.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    finally:
        ctx.close()


COMMANDS = {
    "pool": cmd_pool,
    "status": cmd_status,
    "sessions": cmd_sessions,
    "use": cmd_use,
    "move": cmd_move,
    "forget": cmd_forget,
    "env": cmd_env,
    "exec": cmd_exec,
    "doctor": cmd_doctor,
}


if __name__ == "__main__":
    sys.exit(main())
