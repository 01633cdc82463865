"""The mitmproxy shell: the only module that imports mitmproxy. Glue, no rules.

One request: ``facts.read`` → ``pins.load`` → ``ladder.decide`` → ``rewrite.plan`` →
``pins.create`` (durable, before the request leaves) → apply → comment, 📌, metadata,
one log line. The rules live in those modules; this one keeps these:

- Only inference requests addressed to a configured server are in scope; everything
  else passes untouched (mitmproxy's own behaviour).
- An in-scope request either leaves decided and rewritten as a whole, or is answered
  here: 503 for a session pinned to a server that is gone, 502 for anything that could
  not be decided or rewritten (the pin store unreadable, a key missing, an exception).
  An exception never drops a flow and never lets an in-scope request leave half-done.
- Refusals are in the agent's API error format, say what to do, and carry
  ``x-should-retry: false`` (the Anthropic and OpenAI SDKs then do not retry them).
- Streamed responses (SSE, NDJSON, and any in-scope response without a length) are
  passed through as they arrive: ``responseheaders`` turns streaming on.
- Store writes run on one worker thread, so a durable (fsync'd) pin write delays only
  the request that needs it, never the event loop; a pin read is inline when that
  thread is idle (cheap), else queued behind its writes.
- The config file is re-read every ``sessionpin_reload_ms``; a new text is applied once
  two looks in a row find it (never a half-written file); a text that fails validation
  is logged (file:line: key: problem) and the previous config stays.
- Activity (last seen, requests per session) is counted in memory and flushed every
  few seconds and at exit; a heartbeat ``proxy:<pid>`` lets the CLI find this proxy.
- ``/__sessionpin/status`` (JSON) and ``/__sessionpin/metrics`` (Prometheus text) are
  answered here, for loopback clients only.
- ``load``/``configure``/``running``/``done`` are synchronous (mitmproxy.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from mitmproxy import ctx, exceptions, http

from . import __version__
from . import config as configmod
from . import facts as F
from . import ladder, pins, rewrite
from .config import Config, ConfigError, Server
from .ladder import Decision
from .store.base import Store

log = logging.getLogger(__name__)

INTERNAL_PREFIX = "/__sessionpin/"
HEARTBEAT_PREFIX = "proxy:"
HEARTBEAT_TTL = 30.0
HEARTBEAT_EVERY = 10.0
FLUSH_EVERY = 5.0
SIDE_MEMORY = 3600.0          # how long a session's unpinned side request is remembered
SIDE_MEMORY_MAX = 10_000
PROBE_TIMEOUT = 10.0          # a routed server that does not accept TCP within this is unreachable
PROBE_FRESH = 1.0             # an early connect check (of the same client connection) this recent stands
STREAM_TYPES = ("text/event-stream", "application/x-ndjson", "application/ndjson", "application/jsonl",
                "application/stream+json")


# Process-wide (this module outlives a reload of the -s script): has the proxy started?
_state: dict[str, Any] = {"running": False, "config": None}


class RouterError(Exception):
    """A request that must not leave: answered with 502 and this message."""

    def __init__(self, message: str, reason: str = "error"):
        super().__init__(message)
        self.reason = reason


def short(session: str | None) -> str:
    if not session:
        return "-"
    s = session
    for p in (F.FINGERPRINT_PREFIX, "ses_", "user_"):
        if s.startswith(p):
            s = s[len(p):]
            break
    return s[:8]


def is_loopback(peer: Any) -> bool:
    try:
        host = peer[0]
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except (TypeError, ValueError, IndexError):
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def api_error(api: str, status: int, message: str, kind: str) -> tuple[bytes, dict[str, str]]:
    """A body in the agent's API error format."""
    if api in (F.ANTHROPIC_MESSAGES, F.ANTHROPIC_COUNT_TOKENS):
        etype = "overloaded_error" if status == 529 else "api_error"
        body = {"type": "error", "error": {"type": etype, "message": message}}
    else:
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": kind}}
    headers = {"content-type": "application/json", "x-should-retry": "false", "x-sessionpin-refused": kind}
    return json.dumps(body).encode(), headers


def api_of_path(path: str) -> str:
    return F.api_of("POST", path)


class Metrics:
    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str, str]] = Counter()   # (agent, turn, outcome)
        self.rules: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.store_errors = 0
        self.config_reloads = 0
        self.config_rejected = 0

    def render(self, pins_by_server: dict[str, int] | None) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help: str) -> None:
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")

        family("sessionpin_pins", "gauge", "Pinned sessions by server (\"\" = not routed); -1 when the store cannot be read.")
        if pins_by_server is None:
            out.append("sessionpin_pins -1")
        for server, n in sorted((pins_by_server or {}).items()):
            out.append(f'sessionpin_pins{{server="{_label(server)}"}} {n}')
        family("sessionpin_decisions_total", "counter", "Decisions on in-scope requests by agent, turn and outcome.")
        for (agent, turn, outcome), n in sorted(self.decisions.items()):
            out.append(f'sessionpin_decisions_total{{agent="{_label(agent)}",turn="{_label(turn)}",'
                       f'outcome="{_label(outcome)}"}} {n}')
        family("sessionpin_decisions_by_rule_total", "counter", "Decisions by the ladder rule that made them.")
        for rule, n in sorted(self.rules.items()):
            out.append(f'sessionpin_decisions_by_rule_total{{rule="{_label(rule)}"}} {n}')
        family("sessionpin_refusals_total", "counter", "Requests answered by the router with an error, by reason.")
        for reason, n in sorted(self.refusals.items()):
            out.append(f'sessionpin_refusals_total{{reason="{_label(reason)}"}} {n}')
        family("sessionpin_store_errors_total", "counter", "Store calls that failed.")
        out.append(f"sessionpin_store_errors_total {self.store_errors}")
        family("sessionpin_config_reloads_total", "counter", "Config files reloaded while running.")
        out.append(f"sessionpin_config_reloads_total {self.config_reloads}")
        family("sessionpin_config_rejected_total", "counter", "Config texts refused by validation while running.")
        out.append(f"sessionpin_config_rejected_total {self.config_rejected}")
        return "\n".join(out) + "\n"


def _label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Router:
    """The sessionpin router addon.

    ``participants`` is the seam for other request handlers (the OpenCode id pool): each
    may define ``async request(flow, facts, decision)`` (called after the router decided
    and rewrote a request that is still going upstream; ``facts``/``decision`` are None
    out of scope) and ``responseheaders(flow)`` (called after streaming was decided;
    keep it fast, it is on the first byte's path), ``configure_store(store)``,
    ``running()`` and ``done()``. A participant's exception is logged, never raised.
    """

    def __init__(self, participants: list[Any] | None = None, env: dict[str, str] | None = None):
        self.participants: list[Any] = list(participants or [])
        self.env = env if env is not None else os.environ
        self.config: Config = Config()
        self.config_path: Path | None = None
        self.config_text: bytes | None = None
        self.config_problem: str | None = None      # the last refused text's error
        self._pending: bytes | None = None          # a new config text seen once, not yet applied
        self.store: Store | None = None
        self.store_url: str | None = None
        self.metrics = Metrics()
        self.activity: dict[str, list] = {}          # session -> [last seen, requests since flush]
        self.unreachable: dict[tuple[str, int], tuple[str, str, float]] = {}  # addr -> (server, error, when)
        self.side_sent: dict[str, tuple[str, float]] = {}   # session -> (server, monotonic): ladder rule 2
        self.moved_to: dict[tuple[str, int], str] = {}  # addresses requests were moved to -> server name
        self.open_conns: Counter[tuple[str, int]] = Counter()  # upstream connections open now, by address
        # (client connection id, server address) -> (started, early connect check)
        self._probes: dict[tuple[str, tuple[str, int]], tuple[float, asyncio.Task]] = {}
        self.started = time.time()
        self._executor: ThreadPoolExecutor | None = None
        self._store_busy = 0                         # store calls queued on or running in the executor
        self._task: asyncio.Task | None = None
        self._old_stores: list[Store] = []

    # ------------------------------------------------------------------ lifecycle

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_config", Optional[str], None,
            "sessionpin: the config file (default: $SESSIONPIN_CONFIG, else config.toml in the user config dir).",
        )
        loader.add_option(
            "sessionpin_store", Optional[str], None,
            "sessionpin: the pin store URL, memory: or file:PATH (default: $SESSIONPIN_STORE, else the user state dir's file store).",
        )
        loader.add_option(
            "sessionpin_connect_check", bool, True,
            "sessionpin: before a new connection to a server requests were moved to (and none to it is open), "
            "try a TCP connect, so that an unreachable server is named in the agent's error.",
        )
        loader.add_option(
            "sessionpin_reload_ms", int, 250,
            "sessionpin: how often the config file is checked for edits, in milliseconds.",
        )

    def configure(self, updated: set[str]) -> None:
        if "stream_large_bodies" in updated and ctx.options.stream_large_bodies:
            raise exceptions.OptionsError(
                "sessionpin: stream_large_bodies must stay unset: it sends request bodies upstream before "
                "the router can read and route them"
            )
        if "sessionpin_reload_ms" in updated and ctx.options.sessionpin_reload_ms < 10:
            raise exceptions.OptionsError("sessionpin_reload_ms: at least 10")
        if "sessionpin_config" in updated:
            path = Path(ctx.options.sessionpin_config or self.env.get("SESSIONPIN_CONFIG") or configmod.default_path())
            path = path.expanduser()
            try:
                text = _read(path)
                cfg = configmod.parse(text.decode("utf-8"), str(path)) if text is not None else Config(path=str(path))
            except UnicodeDecodeError as e:
                self._config_failed(path, f"{path.name}: not UTF-8 text ({e.reason})")
            except ConfigError as e:
                self._config_failed(path, str(e))
            except OSError as e:
                self._config_failed(path, f"{path}: cannot read: {e.strerror or e}")
            self._use_config(cfg, path, text)
            log.info("sessionpin: config %s: %s", path, self._describe_config())
        if "sessionpin_store" in updated or self.store is None:
            from .store import default_store_url, open_store
            from .store.base import StoreError

            url = ctx.options.sessionpin_store or self.env.get("SESSIONPIN_STORE") or default_store_url()
            if url != self.store_url or self.store is None:
                try:
                    store = open_store(url)
                except (StoreError, OSError, ValueError) as e:
                    raise exceptions.OptionsError(f"sessionpin_store: cannot open {url}: {e}") from None
                old, self.store, self.store_url = self.store, store, url
                if old is not None:
                    self._old_stores.append(old)   # closed on the worker thread after calls in flight
                    self._close_later(old)
                log.info("sessionpin: pins in %s", url)
                for p in self.participants:
                    self._call(p, "configure_store", store)

    def _use_config(self, cfg: Config, path: Path, text: bytes | None) -> None:
        self.config, self.config_path, self.config_text, self.config_problem = cfg, path, text, None
        _state["config"] = (path, cfg, text)

    def _config_failed(self, path: Path, message: str) -> NoReturn:
        """A bad config: refused while running; at start, mitmdump stops with the message.

        mitmdump loads ``-s`` scripts concurrently with bringing up its listeners, so an
        OptionsError alone lets it print "listening" and accept connections before its
        error check exits. At start we exit the way that check does (SystemExit), before
        the proxy serves anything.
        """
        if not _state["running"] and ctx.master.addons.get("errorcheck") is not None:
            log.error("sessionpin: %s", message)
            print(f"sessionpin: {message}", file=sys.stderr, flush=True)
            sys.exit(1)
        last = _state.get("config")
        if last is not None and last[0] == path and self.config_path != path:
            # A reload of the -s script while the file is bad: this new router keeps the
            # config the process was running with (an empty one would route nothing and
            # let pinned sessions leave their servers), and takes the file once it is fixed.
            self.config, self.config_path, self.config_text = last[1], path, last[2]
            self.config_problem = message
        raise exceptions.OptionsError(message)

    def running(self) -> None:
        _state["running"] = True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sessionpin-store")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._background())
        for p in self.participants:
            self._call(p, "running")

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for _, probe in self._probes.values():
            probe.cancel()
        self._probes.clear()
        for p in self.participants:
            self._call(p, "done")
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        store = self.store
        if store is not None:
            try:
                self._flush_activity(store, self._take_activity())
                store.delete(HEARTBEAT_PREFIX + str(os.getpid()))
            except Exception as e:
                self.metrics.store_errors += 1
                log.warning("sessionpin: at exit, store %s: %s", self.store_url, e)
            try:
                store.close()
            except Exception as e:
                log.warning("sessionpin: closing store %s: %s", self.store_url, e)
            self.store = None
            self.store_url = None

    # ------------------------------------------------------------------ background

    async def _background(self) -> None:
        """Config watch every reload_ms; activity flush every 5 s; heartbeat every 10 s."""
        last_flush = last_beat = 0.0
        first = True
        begun = time.monotonic()
        while True:
            try:
                await asyncio.sleep(max(ctx.options.sessionpin_reload_ms, 10) / 1000)
                self._check_config()
                now = time.monotonic()
                store = self.store
                if store is None:
                    continue
                if now - last_flush >= FLUSH_EVERY:
                    last_flush = now
                    pending = self._take_activity()
                    if pending:
                        await self._in_store(self._flush_activity, store, pending)
                if first or now - last_beat >= HEARTBEAT_EVERY:
                    beat = self._heartbeat()
                    # the first beat waits (up to 2 s) for the listeners to come up
                    if beat["listen"] or not first or now - begun > 2.0:
                        first = False
                        last_beat = now
                        await self._in_store(store.set, HEARTBEAT_PREFIX + str(os.getpid()),
                                             json.dumps(beat), HEARTBEAT_TTL)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # never let the loop die
                self.metrics.store_errors += 1
                log.warning("sessionpin: background: %s: %s", type(e).__name__, e)

    def _check_config(self) -> None:
        path = self.config_path
        if path is None:
            return
        try:
            text = _read(path)
        except OSError as e:
            text = None
            log.debug("sessionpin: config %s unreadable: %s", path, e)
        if text is None or text == self.config_text:
            # A vanished file keeps the config in force (an editor's save-by-rename, a
            # mistaken delete): dropping every server would refuse every pinned session.
            self._pending = None
            return
        if text != self._pending:
            # Seen once: apply it when the next look finds the same text. A file being
            # written in place can be read half-written (empty, or with servers missing),
            # and a half config would refuse or unroute sessions for a moment.
            self._pending = text
            return
        self._pending = None
        try:
            cfg = configmod.parse(text.decode("utf-8"), str(path))
        except (ConfigError, UnicodeDecodeError) as e:
            problem = str(e) if isinstance(e, ConfigError) else f"{path.name}: not UTF-8 text"
            self.config_text = text
            self.config_problem = problem
            self.metrics.config_rejected += 1
            log.error("sessionpin: config rejected, keeping the previous one: %s", problem)
            return
        self._use_config(cfg, path, text)
        self.metrics.config_reloads += 1
        log.info("sessionpin: config reloaded from %s: %s", path, self._describe_config())

    def _describe_config(self) -> str:
        c = self.config
        agents = ", ".join(f"{a.name} → {a.server or 'not routed'}" for a in c.agents.values()) or "no agent routed"
        return f"servers: {', '.join(c.servers) or 'none'}; {agents}"

    def _take_activity(self) -> dict[str, list]:
        """Swap the counts out on the event loop's thread (the hooks count into the new dict)."""
        pending, self.activity = self.activity, {}
        return pending

    @staticmethod
    def _flush_activity(store: Store, pending: dict[str, list]) -> None:
        for session, (last, n) in pending.items():
            pins.record_seen(store, session, last, n)

    def _heartbeat(self) -> dict[str, Any]:
        listen: list[list[Any]] = []
        modes: list[str] = []
        try:
            ps = ctx.master.addons.get("proxyserver")
            for server in ps.servers if ps else []:
                modes.append(server.mode.full_spec)
                for addr in server.listen_addrs:
                    listen.append([addr[0], addr[1]])
        except Exception:
            pass
        return {
            "pid": os.getpid(), "listen": listen, "modes": modes,
            "confdir": str(Path(ctx.options.confdir).expanduser()),
            "config": str(self.config_path) if self.config_path else None,
            "store": self.store_url, "started": self.started, "version": __version__,
        }

    async def _in_store(self, fn: Callable, *args: Any) -> Any:
        """Run a store call on the store thread (a durable write's fsync must not block the loop)."""
        if self._executor is None:
            return fn(*args)
        self._store_busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._store_busy -= 1

    async def _read_store(self, fn: Callable, *args: Any) -> Any:
        """A quick read: inline when the store thread is idle, else queued behind its work.

        Reads never wait for an fsync (the file store fsyncs outside its lock, SQLite's WAL
        readers do not wait for writers), and a hop to the thread costs far more than the
        read under load (the loop thread and the store thread trade the GIL).
        """
        if self._store_busy:
            return await self._in_store(fn, *args)
        return fn(*args)

    def _close_later(self, store: Store) -> None:
        def close() -> None:
            try:
                store.close()
            except Exception as e:
                log.warning("sessionpin: closing store %s: %s", getattr(store, "url", "?"), e)
            if store in self._old_stores:
                self._old_stores.remove(store)
        if self._executor is not None:
            self._executor.submit(close)
        else:
            close()

    # ------------------------------------------------------------------ hooks

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        req = flow.request
        if req.path.startswith(INTERNAL_PREFIX):
            await self._internal(flow)
            return
        cfg = self.config
        source: Server | None = None
        facts: F.Facts | None = None
        decision: Decision | None = None
        try:
            source = cfg.server_for(req.scheme, req.host, req.port, req.path)
            if source is not None or any(_wants(p, req) for p in self.participants):
                facts = F.read(req.method, req.url, req.headers.fields, req.raw_content,
                               req.headers.get("content-encoding"))
            if source is not None and facts is not None:
                decision = await self._route(flow, cfg, source, facts)
        except Exception as e:
            if source is None and not _on_configured_origin(cfg, req):
                log.exception("sessionpin: passing %s through after an error", req.pretty_host)
            else:
                reason = e.reason if isinstance(e, RouterError) else "error"
                if not isinstance(e, RouterError):
                    log.exception("sessionpin: cannot decide %s %s", req.method, req.path.split("?")[0])
                msg = str(e) if isinstance(e, RouterError) else f"sessionpin could not decide this request ({type(e).__name__}: {e}); it was not sent"
                self._refuse(flow, facts, 502, msg, reason)
                return
        if flow.response is None:
            for p in self.participants:
                if hasattr(p, "request"):
                    try:
                        await p.request(flow, facts, decision)
                    except Exception:
                        log.exception("sessionpin: participant %s failed", type(p).__name__)

    async def _route(self, flow: http.HTTPFlow, cfg: Config, source: Server, facts: F.Facts) -> Decision | None:
        req = flow.request
        if facts.api not in F.INFERENCE_APIS:
            if _is_websocket(req) and req.path.split("?")[0].rstrip("/").endswith("/responses") \
                    and (cfg.current(facts.agent) is not None or await self._routed_session(facts.agent, req)):
                # Codex tries a WebSocket first, then falls back to HTTPS POST: refuse the
                # socket so its turns come as requests the router can see and route — when
                # the agent is routed, or when this socket's session is pinned to a server
                # (a subagent's socket of a conversation that began routed).
                self._refuse(flow, facts, 404, "sessionpin routes this agent; use HTTPS requests, not a WebSocket",
                             "websocket", api=F.OPENAI_RESPONSES, log_it=False)
            return None

        store = self.store
        pin = None
        if facts.session and facts.agent in F.AGENTS:
            if store is None:
                raise RouterError("sessionpin has no pin store open", "store")
            try:
                pin = await self._read_store(pins.load, store, facts.session)
            except Exception as e:
                self.metrics.store_errors += 1
                raise RouterError(f"sessionpin cannot read its pin store {self.store_url}: {e}; the request was not sent", "store")

        side_went = self._side_went(facts.session) if pin is None and facts.turn in (F.SIDE, F.CONTINUATION) else None
        decision = ladder.decide(facts, pin, cfg, source, side_went)
        if decision.rule == "side-current" and facts.session:
            self._remember_side(facts.session, decision.target)
        now = time.time()
        answered, changes = self._plan_or_refuse(flow, cfg, source, facts, decision, pin)
        if answered:
            return decision

        if decision.pin_action == ladder.CREATE and facts.session and store is not None:
            # The store holds writes in memory while its file fails (disk full, read-only,
            # locked by another process): a pin made then could be lost by a restart, and the
            # conversation's next turn, never seen begin, would stay on the server the agent
            # addresses — moved. So a conversation is only sent away from that server once its
            # pin is on disk: checked before the write, and after it (the write itself may be
            # the one that found the file failing).
            moves = decision.target not in (None, source.name)
            if moves and getattr(store, "degraded", False):
                raise self._pin_not_safe(facts, decision)
            new = pins.Pin(agent=facts.agent, server=decision.target, since=now, renewed=now,
                           rule=decision.rule, turn=facts.turn or "")
            try:
                in_force = await self._in_store(pins.create, store, facts.session, new)
            except Exception as e:
                self.metrics.store_errors += 1
                if decision.target is not None:
                    raise RouterError(f"sessionpin cannot record the pin for session {facts.session} durably "
                                      f"in {self.store_url}: {e}; the request was not sent", "store")
                log.warning("sessionpin: cannot record 'not routed' for %s: %s", short(facts.session), e)
                in_force = new
            if moves and in_force == new and getattr(store, "degraded", False):
                raise self._pin_not_safe(facts, decision)
            if in_force != new:
                # Another proxy pinned this session first: its pin decides.
                pin = in_force
                decision = ladder.decide(facts, pin, cfg, source)
                answered, changes = self._plan_or_refuse(flow, cfg, source, facts, decision, pin)
                if answered:
                    return decision
        elif decision.pin_action == ladder.RENEW and pin is not None and pins.renew_due(pin, now) and store is not None:
            try:
                await self._in_store(pins.renew, store, facts.session, pin, now)
            except Exception as e:
                self.metrics.store_errors += 1
                log.warning("sessionpin: cannot renew the pin of %s: %s", short(facts.session), e)

        if changes is not None:
            if (changes.host, changes.port) != (req.host, req.port) and decision.target:
                self.moved_to[(changes.host, changes.port)] = decision.target
            _apply(req, changes)
        self._decided(flow, facts, decision, source, pin, changes)
        return decision

    def _plan_or_refuse(self, flow: http.HTTPFlow, cfg: Config, source: Server, facts: F.Facts,
                        decision: Decision, pin: pins.Pin | None) -> tuple[bool, rewrite.Changes | None]:
        """(answered here, the rewrite to apply): a refused decision is answered; a routed one
        is planned, and answered 502 when its rewrite cannot be made (no key, model not found)."""
        if decision.refuse:
            self._decided(flow, facts, decision, source, pin, None)
            self._refuse(flow, facts, decision.refuse, self._gone_message(facts, pin), decision.rule)
            return True, None
        if decision.target is None:
            return False, None
        changes = self._plan(flow, cfg, source, facts, decision)
        if changes.refuse:
            self._decided(flow, facts, decision, source, pin, changes)
            self._refuse(flow, facts, 502, f"sessionpin: {changes.refuse}; the request was not sent", "rewrite")
            return True, changes
        return False, changes

    def _pin_not_safe(self, facts: F.Facts, decision: Decision) -> RouterError:
        self.metrics.store_errors += 1
        return RouterError(
            f"sessionpin cannot save pins to {self.store_url} right now (see the proxy's log), so new "
            f"{facts.agent} session {facts.session} was not sent to {decision.target}: a restart could "
            f"otherwise move it. Free space, fix the store's permissions or stop the process holding it, "
            f"and retry; or run 'sessionpin use {facts.agent} --not-routed'.", "store")

    def _side_went(self, session: str | None) -> str | None:
        hit = self.side_sent.get(session or "")
        return hit[0] if hit is not None and time.monotonic() - hit[1] < SIDE_MEMORY else None

    def _remember_side(self, session: str, server: str | None) -> None:
        """Where a session's side request with no pin went (memory only, an hour, bounded):
        its later side rounds follow (ladder rule 2)."""
        if server is None:
            return
        self.side_sent.pop(session, None)
        if len(self.side_sent) >= SIDE_MEMORY_MAX:
            self.side_sent.pop(next(iter(self.side_sent)))   # the oldest
        self.side_sent[session] = (server, time.monotonic())

    async def _routed_session(self, agent: str, req: http.Request) -> bool:
        session = F.header_session(agent, req.headers.fields)
        store = self.store
        if not session or store is None or agent not in F.AGENTS:
            return False
        try:
            pin = await self._in_store(pins.load, store, session)
        except Exception as e:
            self.metrics.store_errors += 1
            log.warning("sessionpin: cannot read the pin of %s: %s", short(session), e)
            return True   # unknown: keep the socket's turns where the router can see them
        return pin is not None and pin.agent == agent and pin.server is not None

    def _plan(self, flow: http.HTTPFlow, cfg: Config, source: Server, facts: F.Facts, decision: Decision) -> rewrite.Changes:
        req = flow.request
        target = cfg.servers.get(decision.target or "")
        body = None
        if target is not None and facts.model is not None and target.map_model(facts.model) != facts.model:
            body = req.get_content(strict=False)
        view = rewrite.RequestView(
            scheme=req.scheme, host=req.host, port=req.port, path=req.path,
            headers=tuple(req.headers.items(multi=True)), body=body, api=facts.api, model=facts.model,
        )
        return rewrite.plan(decision, view, source, cfg, self.env)

    def _gone_message(self, facts: F.Facts, pin: pins.Pin | None) -> str:
        server = pin.server if pin else "?"
        where = str(self.config_path) if self.config_path else "the sessionpin config"
        return (f"sessionpin: session {facts.session} is pinned to server '{server}', which is no longer configured. "
                f"It is not moved to another server. Add [servers.{server}] back to {where}, or move the "
                f"conversation yourself with `sessionpin move {facts.session} SERVER` "
                f"(or start a new conversation).")

    def _refuse(self, flow: http.HTTPFlow, facts: F.Facts | None, status: int, message: str, kind: str,
                api: str | None = None, log_it: bool = True, count: bool = True) -> None:
        api = api or (facts.api if facts and facts.api in F.INFERENCE_APIS else api_of_path(flow.request.path))
        body, headers = api_error(api, status, message, kind)
        flow.response = http.Response.make(status, body, headers)
        if count:
            self.metrics.refusals[kind] += 1
        meta = flow.metadata.setdefault("sessionpin", {})
        meta.update({"refused": status, "refusal": kind, "message": message})
        if not flow.comment:
            flow.comment = f"refused {status}: {kind}"
        if log_it:
            log.warning("sessionpin: refused %d (%s) %s %s: %s", status, kind,
                        facts.agent if facts else "-", short(facts.session if facts else None), message)

    def _decided(self, flow: http.HTTPFlow, facts: F.Facts, decision: Decision, source: Server,
                 pin: pins.Pin | None, changes: rewrite.Changes | None) -> None:
        turn = facts.turn or "-"
        sid = short(facts.session)
        if decision.refuse:
            where = f"refused {decision.refuse}"
        elif changes is not None and changes.refuse:
            where = f"{decision.target} refused 502"
        else:
            where = decision.target or "left alone"
        why = changes.refuse if changes is not None and changes.refuse else decision.why
        flow.comment = f"{turn} {sid} → {where} ({why})"
        if decision.target is not None and not decision.refuse and not (changes and changes.refuse):
            flow.marked = ":pushpin:"
        meta: dict[str, Any] = {
            "agent": facts.agent, "session": facts.session, "session_source": facts.session_source,
            "turn": facts.turn, "api": facts.api, "rule": decision.rule, "why": decision.why,
            "outcome": decision.outcome if not (changes and changes.refuse) else ladder.REFUSED,
            "target": decision.target, "source": source.name, "pin_action": decision.pin_action,
            "pinned": pin.server if pin else None, "reason": facts.reason,
        }
        if changes is not None and changes.model:
            meta["model"] = list(changes.model)
        flow.metadata.setdefault("sessionpin", {}).update(meta)
        outcome = meta["outcome"]
        self.metrics.decisions[(facts.agent, facts.turn or "none", outcome)] += 1
        self.metrics.rules[decision.rule] += 1
        if facts.session:
            a = self.activity.get(facts.session)
            if a is None:
                self.activity[facts.session] = [time.time(), 1]
            else:
                a[0] = time.time()
                a[1] += 1
        model = f" model {changes.model[0]}→{changes.model[1]}" if changes is not None and changes.model else ""
        log.info("sessionpin: %s %s %s %s → %s [%s: %s]%s", facts.agent, turn, sid, source.name, where,
                 decision.rule, decision.why, model)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        if resp is None:
            return
        if not resp.stream:
            ctype = resp.headers.get("content-type", "").lower()
            if any(t in ctype for t in STREAM_TYPES):
                resp.stream = True
            elif "sessionpin" in flow.metadata and "content-length" not in resp.headers \
                    and not flow.metadata["sessionpin"].get("refused"):
                resp.stream = True
        for p in self.participants:
            if hasattr(p, "responseheaders"):
                try:
                    p.responseheaders(flow)
                except Exception:
                    log.exception("sessionpin: participant %s failed", type(p).__name__)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        # A client opens a tunnel to a configured server: check early (see server_connect).
        # (A CONNECT request has no scheme: host and port say which server.)
        req = flow.request
        if self.moved_to and any((s.host, s.port) == (req.host.lower().rstrip("."), req.port)
                                 for s in self.config.servers.values()):
            self._check_early(flow.client_conn.id)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # A model request to a configured server: its body is still on the way (see server_connect).
        req = flow.request
        if self.moved_to and F.api_of(req.method, req.path) in F.INFERENCE_APIS \
                and _on_configured_origin(self.config, req):
            self._check_early(flow.client_conn.id)

    def _check_early(self, client: str) -> None:
        """Start the connect check of each server requests were moved to that has no open
        connection, for this client connection (unless it has one from the last PROBE_FRESH
        seconds): it runs while the client finishes its handshake and sends its request,
        instead of between the request and the upstream connect."""
        if not self.moved_to or not ctx.options.sessionpin_connect_check:
            return
        now = time.monotonic()
        for key in [k for k, (t, task) in self._probes.items() if now - t > PROBE_FRESH and task.done()]:
            del self._probes[key]
        for addr in list(self.moved_to):
            if self.open_conns[addr] > 0:
                continue
            early = self._probes.get((client, addr))
            if early is not None and (now - early[0] < PROBE_FRESH or not early[1].done()):
                continue
            self._probes[(client, addr)] = (now, asyncio.get_running_loop().create_task(_connect_check(addr)))

    async def server_connect(self, data) -> None:
        """Before connecting to a server requests were moved to: check it accepts connections.

        mitmproxy answers a failed connect with a 502 naming only the address (and no hook
        can change that answer); a server the agent never addressed must be named (``alt``,
        not ``127.0.0.1:4433``), so the router tries a TCP connect first and, when it fails,
        ends the attempt with its own message. Only for servers the router moved requests
        to, only when no connection to it is open (connections are reused across requests).
        The check is started early, when a client opens a tunnel to a configured server or
        sends a model request's headers to one (``_check_early``): that client's check,
        started after it asked and less than PROBE_FRESH seconds ago, stands (once) when it
        succeeded, so its handshake is not on the request's path.
        Otherwise (none started, or too old) it runs here, and so does a second check
        when the early one had already failed before this connection was asked for.
        """
        server = data.server
        if not server.address or server.error or not ctx.options.sessionpin_connect_check:
            return
        addr = (str(server.address[0]).lower(), server.address[1])
        name = self.moved_to.get(addr)
        if name is None or self.open_conns[addr] > 0:
            # Another connection to it is open right now: it is up (a server that went
            # down closes its connections), so this one needs no check.
            return
        early = self._probes.pop((data.client.id, addr), None)
        if early is not None and time.monotonic() - early[0] < PROBE_FRESH:
            finished = early[1].done()
            err = await early[1]
            if err is not None and finished:
                # it failed before this connection was asked for: the server may be back
                err = await _connect_check(server.address[:2])
        else:
            err = await _connect_check(server.address[:2])
        if err is None:
            self.unreachable.pop(addr, None)
        else:
            cfg_server = self.config.servers.get(name)
            origin = cfg_server.origin if cfg_server else f"{server.address[0]}:{server.address[1]}"
            server.error = (f"sessionpin: server {name} ({origin}) cannot be reached: {err}. "
                            f"The conversation stays on {name}; try again when it is back.")
            self.metrics.refusals["unreachable"] += 1

    def server_connected(self, data) -> None:
        if data.server.address:
            self.open_conns[(str(data.server.address[0]).lower(), data.server.address[1])] += 1

    def server_disconnected(self, data) -> None:
        if data.server.address:
            addr = (str(data.server.address[0]).lower(), data.server.address[1])
            if self.open_conns[addr] <= 1:
                self.open_conns.pop(addr, None)
            else:
                self.open_conns[addr] -= 1

    def server_connect_error(self, data) -> None:
        addr = data.server.address
        if not addr:
            return
        for s in self.config.servers.values():
            if (s.host, s.port) == (str(addr[0]).lower(), addr[1]):
                self.unreachable[(s.host, s.port)] = (s.name, data.server.error or "", time.monotonic())
                log.warning("sessionpin: server %s (%s) cannot be reached: %s", s.name, s.origin, data.server.error)
                return

    def error(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get("sessionpin")
        if not meta or not meta.get("target") or flow.response is not None:
            return
        log.warning("sessionpin: %s %s → %s failed: %s (the conversation stays on %s)", meta.get("turn"),
                    short(meta.get("session")), meta.get("target"), flow.error.msg if flow.error else "?",
                    meta.get("target"))

    # ------------------------------------------------------------------ status endpoints

    async def _internal(self, flow: http.HTTPFlow) -> None:
        if not is_loopback(flow.client_conn.peername):
            flow.response = http.Response.make(403, b"sessionpin: loopback clients only\n",
                                               {"content-type": "text/plain"})
            return
        site = flow.request.headers.get("sec-fetch-site", "none").strip().lower()
        if site != "none":
            # A script on a web page (DNS rebinding makes any site "loopback" through the
            # proxy) must not read the operator's setup; a URL typed in the browser says "none".
            flow.response = http.Response.make(403, b"sessionpin: not for web pages\n",
                                               {"content-type": "text/plain"})
            return
        path = flow.request.path.split("?", 1)[0].rstrip("/")
        if path == "/__sessionpin/status":
            counts = await self._pin_counts()
            status = self.status(counts)
            for p in self.participants:
                if hasattr(p, "status"):
                    try:
                        status.setdefault("participants", {})[_name(p)] = p.status()
                    except Exception as e:
                        log.warning("sessionpin: participant %s status: %s", _name(p), e)
            body = json.dumps(status, indent=2, default=str).encode()
            flow.response = http.Response.make(200, body, {"content-type": "application/json"})
        elif path == "/__sessionpin/metrics":
            counts = await self._pin_counts()
            text = self.metrics.render(counts)
            for p in self.participants:
                if hasattr(p, "metrics"):
                    try:
                        more = await self._in_store(p.metrics)   # may read a store: off the event loop
                    except Exception as e:
                        log.warning("sessionpin: participant %s metrics: %s", _name(p), e)
                        continue
                    if more:
                        text += more if more.endswith("\n") else more + "\n"
            flow.response = http.Response.make(200, text.encode(), {"content-type": "text/plain; version=0.0.4"})
        else:
            flow.response = http.Response.make(404, b"sessionpin: /__sessionpin/status or /__sessionpin/metrics\n",
                                               {"content-type": "text/plain"})

    async def _pin_counts(self) -> dict[str, int] | None:
        store = self.store
        if store is None:
            return None

        def count() -> dict[str, int]:
            c: Counter[str] = Counter()
            for _, pin in pins.sessions(store):
                c[pin.server or ""] += 1
            return dict(c)
        try:
            return await self._in_store(count)
        except Exception as e:
            self.metrics.store_errors += 1
            log.warning("sessionpin: counting pins in %s: %s", self.store_url, e)
            return None

    def status(self, pin_counts: dict[str, int] | None) -> dict[str, Any]:
        c = self.config
        return {
            "version": __version__,
            "pid": os.getpid(),
            "started": self.started,
            "config": str(self.config_path) if self.config_path else None,
            "config_error": self.config_problem,
            "store": self.store_url,
            "servers": {
                s.name: {"url": s.url, "origin": s.origin, "prefix": s.prefix, "key_env": s.key_env,
                         "key_set": bool(s.key_env and self.env.get(s.key_env, "").strip()),
                         "auth": s.auth, "models": dict(s.models)}
                for s in c.servers.values()
            },
            "agents": {a: c.current(a) for a in F.AGENTS},
            "pins": pin_counts,
            "unreachable": {name: err for (name, err, _) in self.unreachable.values()},
        }

    # ------------------------------------------------------------------ helpers

    def _call(self, p: Any, name: str, *args: Any) -> None:
        fn = getattr(p, name, None)
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:
            log.exception("sessionpin: participant %s.%s failed", type(p).__name__, name)


def _name(p: Any) -> str:
    return str(getattr(p, "name", None) or type(p).__name__)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _is_websocket(req: http.Request) -> bool:
    return req.method == "GET" and "websocket" in req.headers.get("upgrade", "").lower()


def _on_configured_origin(cfg: Config, req: http.Request) -> bool:
    try:
        return cfg.addresses_origin(req.scheme, req.host, req.port)
    except Exception:
        return True


def _apply(req: http.Request, c: rewrite.Changes) -> None:
    """Apply a plan: scheme first, then host, then port (the setters keep Host in step)."""
    if (c.scheme, c.host, c.port) != (req.scheme, req.host, req.port):
        req.scheme = c.scheme
        req.host = c.host
        req.port = c.port
    if c.path != req.path:
        req.path = c.path
    for name in c.drop_headers:
        req.headers.pop(name, None)
    for name, value in c.set_headers:
        req.headers[name] = value
    if c.body is not None:
        req.content = c.body


async def _connect_check(address: tuple[str, int]) -> str | None:
    """None when ``address`` accepts a TCP connection (closed at once), else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*address), PROBE_TIMEOUT)
        writer.close()
        return None
    except (OSError, asyncio.TimeoutError) as e:
        return str(e) or type(e).__name__


def _wants(participant: Any, req: http.Request) -> bool:
    """Does a participant want this pass-through request's facts? (Reading them costs
    ~1 ms on a large body: only pay it for requests someone acts on.)"""
    wants = getattr(participant, "wants", None)
    if wants is None:
        return True
    try:
        return bool(wants(req.method, req.url))
    except Exception:
        log.exception("sessionpin: participant %s failed", type(participant).__name__)
        return False


class RouterDefaults:
    """Sets what the router needs from mitmproxy, so ``-s addons/route.py`` alone is a
    correct start: connection_strategy=lazy (connect upstream only after the router chose
    the server; with "eager", reverse mode connects to the original target before any hook)."""

    def configure(self, updated: set[str]) -> None:
        if "connection_strategy" in updated and ctx.options.connection_strategy != "lazy":
            log.info("sessionpin: setting connection_strategy=lazy (the router chooses the upstream)")
            ctx.options.connection_strategy = "lazy"


def make_addons(participants: list[Any] | None = None) -> list[object]:
    if participants is None:
        # The OpenCode session-id pool (issue 6, sessionpin/pool, docs/pool.md): a participant
        # of the router, plus a small addon that owns its options. Pass participants to leave it out.
        from .pool.participant import PoolOptions, PoolParticipant

        pool = PoolParticipant()
        return [RouterDefaults(), Router([pool]), PoolOptions(pool, exceptions.OptionsError)]
    return [RouterDefaults(), Router(participants)]
