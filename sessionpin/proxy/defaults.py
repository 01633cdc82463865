"""Defaults: what the router needs from mitmproxy, and what an operator wants to read.

Rules it keeps:
- ``connection_strategy=lazy``: mitmproxy connects upstream only after the router chose
  the server (with "eager", reverse mode connects to the original target before any hook).
- ``stream_large_bodies`` is not ours to take here: ``BodyLimit`` (limits.py) sets it to
  the body limit, and refuses another value (it would send request bodies upstream before
  the router can read and route them).
- One line per decision: mitmproxy's connection chatter ("client connect", "server
  disconnect …", "Streaming response from …" for each streamed answer, and "Received
  WebSocket ping/pong from …" for each ping and pong it relays) is dropped
  unless ``sessionpin_connection_log`` is on; decision lines, timestamped as mitmproxy's own
  (``[15:37:40.960] sessionpin: …``, local time; a ``DecisionLog`` the addon's parts share), go to the terminal directly (``sessionpin_decision_log=terminal``, the
  default) — gathered and written once per turn of the event loop, not through Python's
  logging and mitmproxy's log event, which every addon receives: a cost paid per request
  (docs/benchmarks.md) — or into mitmweb's event log (``eventlog``), or nowhere (``off``).
  Refusals and faults are always logged through mitmproxy (warnings): a refusal is one
  warning line, in place of its decision line.
- What is alive once the proxy runs (mitmproxy's modules and sessionpin's, the addon's parts)
  is frozen out of Python's collector (``gc.freeze``, ``sessionpin_gc_freeze``, on by default):
  every full collection walked it all again — 59 ms each under a 10 KB load, 39 µs a request;
  frozen, 4 ms and 7 µs (docs/benchmarks.md, issue 22, twelfth round). Garbage made
  before is collected first; ``done`` unfreezes it (a script reload leaves the old parts to
  the collector).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import stat
import sys
import time

from mitmproxy import ctx

from ..config import redact

log = logging.getLogger("sessionpin")
decisions = logging.getLogger("sessionpin.decisions")

CHATTER = ("client connect", "client disconnect", "server connect ", "server disconnect ", "Streaming response from ",
           # one per WebSocket ping and pong relayed: two lines of ~90 bytes for a 6-byte ping, so a
           # peer's ping flood filled the operator's terminal or log file and buried the decisions
           "Received WebSocket ping from ", "Received WebSocket pong from ")
DECISION_LOGS = ("terminal", "eventlog", "off")


class _NoChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        return not (isinstance(msg, str) and (msg in CHATTER[:2] or msg.startswith(CHATTER[2:])))


class _Said(Exception):
    """An exception as a log may say it: its type's name, its frames, its text made safe."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _said(e: BaseException | None, depth: int = 0) -> BaseException | None:
    """``e`` as a ``_Said`` of the same name and frames, its text (and its notes) through
    ``redact.unquoted`` and ``redact.scrub``; its cause and context likewise."""
    if e is None or depth > 8:
        return None
    kind = type(e)               # (made per exception logged: rare, and no state kept)
    cls = type(kind.__name__, (_Said,), {"__module__": kind.__module__, "__qualname__": kind.__qualname__})
    try:
        text = str(e)
    except Exception:                               # noqa: BLE001 - a __str__ that fails says nothing
        text = ""
    out = cls(redact.scrub(redact.unquoted(text)))
    out.__traceback__ = e.__traceback__
    out.__cause__ = _said(e.__cause__, depth + 1)
    out.__context__ = _said(e.__context__, depth + 1)
    out.__suppress_context__ = e.__suppress_context__
    notes = getattr(e, "__notes__", None)
    if isinstance(notes, list):
        out.__notes__ = [redact.scrub(redact.unquoted(str(n))) for n in notes]
    return out


class _ContentFree(logging.Filter):
    """A traceback sessionpin logs says where, never what: the exception's text (its cause's
    and context's too) goes through ``redact.unquoted`` (a quoted value → its size) and
    ``redact.scrub`` (a key-looking word → ``[redacted]``); its type's name and its frames stay.
    An exception's text can quote what it failed on — a header's value, a piece of a body —
    and ``log.exception`` wrote it as it was. mitmproxy's formatter reads ``exc_info`` itself,
    so the record's exception is replaced by one that says only that."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = record.exc_info
        if info and info[1] is not None and not isinstance(info[1], _Said):
            said = _said(info[1])
            record.exc_info, record.exc_text = (type(said), said, info[2]), None
        return True


_content_free = _ContentFree()


# Every logger sessionpin's modules write to (a filter is a logger's own: its children's records
# pass by it), made here if their module is not imported yet (the store's, at configure).
LOGGERS = ("sessionpin", "sessionpin.decisions", "sessionpin.store.file", "sessionpin.store.redis",
           "sessionpin.opencode_ids.service", "sessionpin.opencode_ids.participant")


def _our_loggers() -> list[logging.Logger]:
    made = [n for n in list(logging.root.manager.loggerDict) if n.startswith("sessionpin.")]
    return [logging.getLogger(n) for n in dict.fromkeys((*LOGGERS, *made))]


class DecisionLog:
    """Where decision lines go (``sessionpin_decision_log``)."""

    def __init__(self) -> None:
        self.mode = "terminal"
        self._lines: list[str] = []
        self._flushing = False

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def write(self, line: str) -> None:
        if self.mode == "eventlog":
            decisions.info(line)
        elif self.mode == "terminal":
            self._lines.append(stamp(time.time()) + line)
            if not self._flushing:
                self._flushing = True
                try:
                    asyncio.get_running_loop().call_soon(self.flush)
                except RuntimeError:      # no loop (a synchronous caller): now
                    self.flush()

    def flush(self) -> None:
        self._flushing = False
        lines, self._lines = self._lines, []
        if lines:
            try:
                sys.stdout.write("\n".join(lines) + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass


def stamp(t: float) -> str:
    """``[15:37:40.960] ``: mitmproxy's own log time (local, milliseconds), so a decision line
    reads in line with the refusals and faults logged around it. The clock part is formatted
    once per second (``localtime`` and ``strftime`` cost more than the rest of a line)."""
    global _second
    s = t // 1                 # localtime's second (it rounds down)
    if _second[0] != s:
        _second = (s, f"[{time.strftime('%H:%M:%S', time.localtime(t))}.")
    return f"{_second[1]}{int(t * 1000) % 1000:03d}] "


_second: tuple[float | None, str] = (None, "")


_no_chatter = _NoChatter()


CA_FILES = "mitmproxy-"     # the confdir's files mitmproxy makes: the CA, its key, dhparam


def private_confdir(confdir: str) -> list[str]:
    """mitmproxy's confdir 0700 and its CA files 0600, whatever the umask it was made under.

    A hand-started mitmdump makes its confdir before any script loads, under the caller's
    umask: mitmproxy writes the private key under a private umask, but the directory and the
    certificates get the caller's (0777 and 0666 under ``umask 000``: anyone could put another
    CA in place, or replace the directory's files). Only bits are taken away; nothing is
    followed through a symlink (the directory and each file are opened ``O_NOFOLLOW`` and
    changed through that descriptor); what another user owns is left alone and said. Returns
    what was changed (names), for the log line. Never raises."""
    changed: list[str] = []
    try:
        fd = os.open(os.path.expanduser(confdir), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return changed          # absent, not a directory, or a symlink: not ours to change
    try:
        if _private(fd, 0o700, "."):
            changed.append(".")
        for name in os.listdir(fd):
            if not name.startswith(CA_FILES):
                continue
            try:
                f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=fd)
            except OSError:
                continue        # a symlink or unreadable: left as it is
            try:
                if stat.S_ISREG(os.fstat(f).st_mode) and _private(f, 0o600, name):
                    changed.append(name)
            finally:
                os.close(f)
    except OSError as e:
        log.warning("sessionpin: could not make mitmproxy's confdir %s private: %s", confdir, e)
    finally:
        os.close(fd)
    return changed


def _private(fd: int, mode: int, name: str) -> bool:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        log.warning("sessionpin: %s in mitmproxy's confdir belongs to another user (uid %d); left as it is",
                    name, st.st_uid)
        return False
    now = stat.S_IMODE(st.st_mode)
    if now & ~mode == 0:
        return False
    os.fchmod(fd, now & mode)
    return True


class Defaults:
    def __init__(self, decisions: DecisionLog | None = None) -> None:
        self.decisions = decisions if decisions is not None else DecisionLog()   # the router writes to it
        self.frozen = 0      # objects this part froze out of the collector (``running``)

    def load(self, loader) -> None:
        # (the process's umask is left as it is: ``sessionpin run`` sets a private one before
        # ``exec``; here it would change every later file of the process, a test run's too, and
        # what mitmproxy makes before this loads is fixed up below)
        try:
            confdir = ctx.options.confdir
        except (AttributeError, KeyError):   # pragma: no cover - options not there (a bare test)
            confdir = None
        if confdir and (changed := private_confdir(confdir)):
            log.info("sessionpin: mitmproxy's confdir %s made private (0700, its files 0600): %s",
                     confdir, ", ".join(changed))
        loader.add_option(
            "sessionpin_connection_log", bool, False,
            "sessionpin: show mitmproxy's client/server connect and disconnect lines.",
        )
        loader.add_option(
            "sessionpin_decision_log", str, "terminal",
            "sessionpin: where the one line per decision goes: terminal (stdout, cheap), "
            "eventlog (mitmproxy's log, shown in mitmweb's event log) or off.",
            choices=DECISION_LOGS,
        )
        loader.add_option(
            "sessionpin_gc_freeze", bool, True,
            "sessionpin: once the proxy runs, keep what is alive then (mitmproxy's and sessionpin's "
            "modules) out of Python's garbage collector's full collections (gc.freeze): they then "
            "walk only what was made since.",
        )

        for logger in _our_loggers():
            logger.addFilter(_content_free)

    def running(self) -> None:
        if _option("sessionpin_gc_freeze", True):
            gc.collect()
            gc.freeze()
            self.frozen = gc.get_freeze_count()

    def configure(self, updated: set[str]) -> None:
        if "connection_strategy" in updated and ctx.options.connection_strategy != "lazy":
            log.info("sessionpin: setting connection_strategy=lazy (the router chooses the upstream)")
            ctx.options.connection_strategy = "lazy"
        if "sessionpin_connection_log" in updated:
            server_log = logging.getLogger("mitmproxy.proxy.server")
            if ctx.options.sessionpin_connection_log:
                server_log.removeFilter(_no_chatter)
            else:
                server_log.addFilter(_no_chatter)
        if "sessionpin_decision_log" in updated:
            self.decisions.flush()
            self.decisions.mode = ctx.options.sessionpin_decision_log

    def done(self) -> None:
        if self.frozen:
            gc.unfreeze()       # a reload's old parts are the collector's again
            self.frozen = 0
        self.decisions.flush()
        logging.getLogger("mitmproxy.proxy.server").removeFilter(_no_chatter)
        for logger in _our_loggers():
            logger.removeFilter(_content_free)


def _option(name: str, default):
    try:
        return getattr(ctx.options, name)
    except (AttributeError, KeyError):   # not loaded (a test's bare part)
        return default
