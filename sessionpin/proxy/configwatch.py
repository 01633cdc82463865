"""ConfigWatch: the router's configuration file, read at start and watched while running.

Rules it keeps:
- The file is ``--set sessionpin_config``, else ``$SESSIONPIN_CONFIG``, else config.toml
  in the user config dir. A missing file is an empty configuration (nothing routed).
- At start, a config that fails validation stops mitmdump with one line naming the
  file, the line and the problem — before the proxy serves anything.
- While running, the file is looked at every ``sessionpin_reload_ms``; a new text is
  applied once two looks in a row find it (never a half-written file); a text that fails
  validation is logged (file:line: key: problem) and the previous config stays in force.
- Only a regular file of a config's size is read (``config.read_trusted``): a FIFO, a
  directory, a device or a huge file at the path is refused, said once, the config kept —
  never waited on or read whole on the loop. So is a path that cannot be read (permissions,
  a link loop): an error line and ``config_error``, not a debug line.
- A file that vanished keeps the config in force (an editor's save-by-rename, a
  mistaken delete). An emptied file is a valid, empty config: it routes no new
  conversation, and pinned ones still follow their pins (the router consults pins for
  every inference request).
- A reload that points a server's name at another origin says so (a WARNING naming the
  server and both origins): the conversations pinned to it are refused from then on.
- ``load``/``configure``/``running``/``done`` are synchronous (mitmproxy.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Mapping, NoReturn, Optional

from mitmproxy import ctx, exceptions

from ..config import config as configmod
from ..config.config import Config, ConfigError

log = logging.getLogger("sessionpin")


class ConfigWatch:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = env if env is not None else os.environ
        self.config: Config = Config()
        self.path: Path | None = None
        self.text: bytes | None = None
        self.problem: str | None = None        # the last refused text's error
        self.reloads = 0
        self.rejected = 0
        self._pending: bytes | None = None     # a new text seen once, not yet applied
        self._task: asyncio.Task | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_config", Optional[str], None,
            "sessionpin: the config file (default: $SESSIONPIN_CONFIG, else config.toml in the user config dir).",
        )
        loader.add_option(
            "sessionpin_reload_ms", int, 250,
            "sessionpin: how often the config file is checked for edits, in milliseconds.",
        )

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_reload_ms" in updated and ctx.options.sessionpin_reload_ms < 10:
            raise exceptions.OptionsError("sessionpin_reload_ms: at least 10")
        if "sessionpin_config" not in updated:
            return
        path = Path(ctx.options.sessionpin_config or self.env.get("SESSIONPIN_CONFIG") or configmod.default_path())
        path = path.expanduser()
        try:
            text = _read(path)
            cfg = configmod.parse(text.decode("utf-8"), str(path)) if text is not None else Config(path=str(path))
        except UnicodeDecodeError as e:
            self._failed(path, f"{path.name}: not UTF-8 text ({e.reason})")
        except ConfigError as e:
            self._failed(path, str(e))
        except OSError as e:
            self._failed(path, f"{path}: cannot read: {e.strerror or e}")
        self.config, self.path, self.text, self.problem = cfg, path, text, None
        log.info("sessionpin: config %s: %s", path, self.describe())

    def _failed(self, path: Path, message: str) -> NoReturn:
        """At start, stop with the message; while running, refuse the new value.

        mitmdump loads ``-s`` scripts concurrently with bringing up its listeners, so an
        OptionsError alone lets it print "listening" before it exits. At start we exit
        the way its error check does, before the proxy serves anything."""
        if not _proxy_running():
            log.error("sessionpin: %s", message)
            print(f"sessionpin: {message}", file=sys.stderr, flush=True)
            sys.exit(1)
        self.problem = message
        raise exceptions.OptionsError(message)

    def running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def done(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.sleep(max(ctx.options.sessionpin_reload_ms, 10) / 1000)
                self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:   # never let the loop die
                log.warning("sessionpin: watching the config: %s: %s", type(e).__name__, e)

    def check(self) -> None:
        """One look at the file (the watch loop's step; tests call it directly)."""
        path = self.path
        if path is None:
            return
        try:
            text = _read(path)
        except (ConfigError, OSError) as e:
            # Untrusted now (chmod, chown), no config file (a FIFO, a directory) or unreadable
            # (permissions, a link loop): said once, kept out. (A missing file is no error: an
            # editor's rename.) Unreadable was a debug line: the proxy stopped taking edits
            # with nothing in its log or status saying so.
            problem = str(e) if isinstance(e, ConfigError) else f"{path.name}: cannot read: {e.strerror or e}"
            if self.problem != problem:
                self.problem = problem
                self.rejected += 1
                log.error("sessionpin: config rejected, keeping the previous one: %s", self.problem)
            self._pending = None
            return
        if text is not None and text == self.text and self.problem is not None:
            self.problem = None                 # trusted again, and what is in force is what it says
            log.info("sessionpin: config %s accepted again", path)
        if text is None or text == self.text:
            self._pending = None
            return
        if text != self._pending:
            self._pending = text     # seen once: apply it when the next look finds the same
            return
        self._pending = None
        try:
            cfg = configmod.parse(text.decode("utf-8"), str(path))
        except (ConfigError, UnicodeDecodeError) as e:
            self.text, self.problem = text, str(e) if isinstance(e, ConfigError) else f"{path.name}: not UTF-8 text"
            self.rejected += 1
            log.error("sessionpin: config rejected, keeping the previous one: %s", self.problem)
            return
        old, self.config, self.text, self.problem = self.config, cfg, text, None
        self.reloads += 1
        log.info("sessionpin: config reloaded from %s: %s", path, self.describe())
        for name, was, now in configmod.repointed(old, cfg):
            log.warning("sessionpin: server %s now at %s, was %s: conversations pinned to it at %s are refused "
                        "(pinned-server-moved), never sent to %s; point its url back to carry them on, or "
                        "`sessionpin move SESSION %s` each. To send new conversations to %s while the running "
                        "ones end where they began: give it a name of its own (`sessionpin servers add NAME %s`, "
                        "`sessionpin use AGENT NAME`) and point %s back at %s", name, now, was, was, now, name,
                        now, now, name, was)

    def describe(self) -> str:
        c = self.config
        agents = ", ".join(f"{a.name} → {a.server or 'not routed'}" for a in c.agents.values()) or "no agent routed"
        pools = "".join(f"; pool {p.name}: {', '.join(p.members)} ({p.policy}"
                        f"{', soft' if p.affinity == 'soft' else ''})" for p in c.pools.values())
        return f"servers: {', '.join(c.servers) or 'none'}{pools}; {agents}"


def _read(path: Path) -> bytes | None:
    return configmod.read_trusted(path)      # a file others may write or own: ConfigError


def _proxy_running() -> bool:
    """Whether the proxy already serves (a change while running), or is still starting."""
    try:
        server = ctx.master.addons.get("proxyserver")
    except Exception:
        return True
    return bool(getattr(server, "is_running", True)) if server is not None else True
