"""``doctor``: check the config, store, CA, proxy and keys, and say what to fix.

Each check is one line: ok, warn or FAIL, and what to do. The store is checked by what it
does (a durable write read back and removed, through the same async facade the proxy
uses) and by what it says of itself (``describe()``: its durability, its copy, a
fault it is in). A Redis store gets a line each for reachability, persistence (AOF
``appendfsync always``, or the weaker durability its URL accepts, said plainly), replicas
(when ``?wait=`` asks for them) and latency (a durable write's round trip). Exit 1 when
anything FAILs. The store URL is only ever shown masked.
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from dataclasses import dataclass
from typing import Any

from ..config import config as configmod
from ..store import NotDurable, StoreError
from ..reader.ids import short
from .common import Fail, dump_json, out, plural, where
from .context import Ctx, recorded_lost
from .look import UNUSED
from .launch import CA_FILE
from .proxies import config_mismatch, confdir_of, find_proxies, find_proxy, key_state, proxy_keys


@dataclass
class Check:
    what: str
    state: str        # "ok" | "warn" | "FAIL"
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"check": self.what, "state": self.state.lower(), "detail": self.detail}


def cmd_doctor(ctx: Ctx, args: argparse.Namespace) -> int:
    checks: list[Check] = []

    def add(what: str, state: str, detail: str) -> None:
        checks.append(Check(what, state, detail))

    cfg = _config(ctx, add)
    store_ok = _store(ctx, add)
    if store_ok:
        _lost_pins(ctx, add)
    proxies = find_proxies(ctx) if store_ok else []
    proxy = find_proxy(ctx, proxies)
    ca = confdir_of(proxy, args.confdir) / CA_FILE
    if ca.exists():
        add("CA", "ok", f"{ca}")
    else:
        add("CA", "FAIL", f"{ca} is missing: start the proxy once (`sessionpin run`) to create it, "
            "then point agents at it (`sessionpin env AGENT`)")
    live = [p for p in proxies if p.answering]
    for p in live:
        mismatch = config_mismatch(p, ctx.config_path)
        if mismatch:
            add("proxy", "FAIL", mismatch.removeprefix("Warning: "))
        else:
            add("proxy", "ok", f"answering at {p.url} (pid {p.pid})")
    if not live and not store_ok:
        add("proxy", "warn", "not looked for: proxies announce themselves in the store, which cannot be read "
            "(a proxy that runs refuses in-scope requests with 424 until it can)")
    elif not live:
        add("proxy", "FAIL", f"not answering: {proxy.why}; start it with `sessionpin run`"
            + (f" --store {ctx.store_shown}" if "uses" in proxy.why else ""))
    for p in proxies:
        if p.gone:
            add("proxy", "warn", f"{p.why}; its heartbeat expires within 30 s")

    if cfg is not None:
        _keys(ctx, cfg, proxy, add)
    for p in live:
        _unrouted(p, add)

    failed = [c for c in checks if c.state == "FAIL"]
    if args.json:
        dump_json({"ok": not failed, "checks": [c.as_json() for c in checks]})
    else:
        width = max(len(c.what) for c in checks)
        for c in checks:
            out(f"{c.state:<4}  {c.what:<{width}}  {c.detail}")
        out(f"{plural(len(failed), 'problem')} to fix." if failed else "All good.")
    return 1 if failed else 0


def _config(ctx: Ctx, add) -> configmod.Config | None:
    try:
        cfg = configmod.load(ctx.config_path)
    except configmod.ConfigError as e:
        add("config", "FAIL", f"{e}; fix that line in {ctx.config_path} (a running proxy refuses this "
            "text and keeps the config it had; a starting one stops)")
        return None
    if not ctx.config_path.exists():
        add("config", "warn", f"no file at {ctx.config_path}: nothing is routed; "
            "add a server with `sessionpin servers add NAME URL`")
    else:
        routed = sorted(a for a, x in cfg.agents.items() if x.server)
        add("config", "ok", f"{ctx.config_path}: {plural(len(cfg.servers), 'server')}, "
            f"routed: {', '.join(routed) or 'no agent'}")
    return cfg


# A CONFIG SET is forgotten at the server's next restart (unless someone runs CONFIG
# REWRITE): the fix that lasts is the server's configuration file.
REDIS_CONF = ("set `appendonly yes`, `appendfsync always` and `maxmemory-policy noeviction` in the server's "
              "configuration file (redis.conf, or your managed Redis' parameter group) and restart it — "
              "not CONFIG SET, which the next restart forgets")


def _store(ctx: Ctx, add) -> bool:
    f = ctx.store_file()
    # Modes before opening: opening a file store tightens a loose file mode by itself.
    modes_before = None
    if f is not None and f.exists():
        modes_before = (stat.S_IMODE(f.stat().st_mode), stat.S_IMODE(f.parent.stat().st_mode))
    try:
        store = ctx.store(create=False)
    except Fail as e:
        add("store", "FAIL", str(e))
        return False
    if ctx.settled is not None and ctx.settled.message:     # it lost what it held (store.identity)
        add("store identity", "FAIL", ctx.settled.message)
    if store is not None and hasattr(store, "check"):
        ok = _redis(ctx, store, add)
        if ok and ctx.unused:
            add("store identity", "warn", UNUSED.format(store=ctx.store_shown) + "; a proxy makes it at its first use")
        return ok
    if store is None:
        parent = next((p for p in [f.parent, *f.parent.parents] if p.exists()), None) if f else None
        if parent is not None and os.access(parent, os.W_OK | os.X_OK):
            add("store", "warn", f"no file yet at {f}: the proxy creates it at its first pin")
            return True
        add("store", "FAIL", f"no file at {f} and {parent} is not writable: "
            "choose a writable place with --store file:PATH (and the same for the proxy)")
        return False
    problems: list[str] = []
    probe_key = f"doctor:{os.getpid()}"

    async def exercise() -> float:
        await store.get(probe_key)
        started = time.monotonic()
        await store.set(probe_key, "1", 60, durable=True)
        took = time.monotonic() - started
        if await store.get(probe_key) != "1":
            problems.append("a durable write did not read back")
        await store.delete(probe_key, durable=True)
        return took
    took = None
    try:
        took = ctx.run(exercise())
    except StoreError as e:
        problems.append(str(e))
    info: dict[str, Any] = {}
    try:
        info = store.describe()
    except Exception as e:   # a description is best effort
        info = {"error": str(e)}
    for note in info.get("problems", []) or []:
        problems.append(str(note))
    for note in info.get("warnings", []) or []:
        add("store", "warn", str(note))
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
        add("store", "FAIL", f"{store.url}: " + "; ".join(problems))
        return False
    detail = f"{store.url}: readable, durable writes"
    if took is not None:
        detail += f" ({took * 1000:.1f} ms)"
    if f is not None:
        detail += (f", mode {stat.S_IMODE(f.stat().st_mode):04o} in a "
                   f"{stat.S_IMODE(f.parent.stat().st_mode):04o} directory")
    copy = info.get("copy")
    if isinstance(copy, dict) and copy:
        detail += f"; its copy {copy.get('path', '')}"
    add("store", "ok", detail)
    _repairs(info, add)
    return True


REPAIRS_SHOWN = 3


def _repairs(info: dict[str, Any], add) -> None:
    """The store's latest repairs (kept in the store by whichever process made them: the
    proxy's at its start or while it ran), newest first: what was damaged or lost, and what
    was rebuilt from what, with counts."""
    repairs = [r for r in info.get("repairs") or [] if isinstance(r, dict) and r.get("what")]
    if not repairs:
        return
    for r in reversed(repairs[-REPAIRS_SHOWN:]):
        at = r.get("at")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else "?"
        add("store repair", "warn", f"{when}: {r['what']}")
    if len(repairs) > REPAIRS_SHOWN:
        add("store repair", "warn", f"and {len(repairs) - REPAIRS_SHOWN} earlier (`sessionpin status --json` "
            "lists them under store_info.repairs); a file moved aside is kept beside the store for you to inspect "
            "or delete")


def _keys(ctx: Ctx, cfg: configmod.Config, proxy, add) -> None:
    penv = proxy_keys(proxy)
    counts: dict[str | None, int] = {}
    try:
        for (_, server), (n, _) in ctx.counts().items():
            counts[server] = counts.get(server, 0) + n
    except (Fail, StoreError):
        pass
    # Servers requests go to: each agent's current one (every member of a pool), and each one
    # conversations are pinned to.
    pinned_to = {s for s, n in counts.items() if s in cfg.servers and n}
    current: set[str] = set()
    for x in cfg.agents.values():
        if x.server in cfg.pools:
            current.update(cfg.pools[x.server].members)
        elif x.server in cfg.servers:
            current.add(x.server)
    for name in sorted(current | pinned_to):
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
    for name, n in sorted((s, n) for s, n in counts.items() if s is not None and s not in cfg.servers and n):
        add(f"pins {name}", "warn", f"{plural(n, 'conversation')} pinned to {name}, which is not configured: "
            f"their requests get 424; move or forget them (`sessionpin sessions --server {name}`)")


def _unrouted(proxy, add) -> None:
    """What a running proxy left alone at a configured origin though it looked like inference
    (its status's ``unrouted``: issue 19, nothing in scope is left alone silently)."""
    for u in (proxy.status.unrouted if proxy.status is not None else []):
        seen = time.strftime("%H:%M:%S", time.localtime(u.last))
        fix = (f'add a server with url = "{u.url}" to route them (`sessionpin servers add NAME {u.url} --key-env VAR`)'
               if u.url else "no server URL routes a path without an API version (/v1) before its endpoint")
        add("not routed", "warn", f"{plural(u.count, 'request')} to {u.origin}{u.prefix}{u.endpoint} (server "
            f"{u.server}'s origin, last {seen}) looked like inference and passed untouched: {fix}")


SLOW_DURABLE_WRITE = 0.05    # seconds: a new routed conversation's first request waits this long


def _lost_pins(ctx: Ctx, add) -> None:
    """Pins the store lost that the proxies refuse, as they recorded them in the store (one
    read: no walk of the index). Before, doctor said nothing of them: every check was ok
    while those conversations were refused."""
    store = ctx.store(create=False)
    if store is None or (ctx.settled is not None and ctx.settled.message):
        return                      # no store yet, or the whole store lost (said above)
    try:
        rows = ctx.run(recorded_lost(store, time.time()))
    except StoreError as e:
        add("lost pins", "FAIL", f"cannot read what the proxies recorded lost: {e}")
        return
    if not rows:
        return
    named = ", ".join(f"{short(r.session)} ({r.pin.agent}, {where(r.pin.server)})" for r in rows[:5])
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    add("lost pins", "FAIL", f"the proxies refuse {plural(len(rows), 'conversation')} whose pin the store lost: "
        f"{named}{more}; `sessionpin sessions` lists each with its ways out (`sessionpin move SESSION SERVER` "
        f"puts one back, `sessionpin forget SESSION` lets it be decided afresh, `sessionpin store accept-loss` "
        f"decides every loss)")


def _redis(ctx: Ctx, store, add) -> bool:
    """Reachability, persistence, replicas, latency of a Redis store (one line each).
    True when it can be read (its other problems are FAIL lines of their own)."""
    try:
        info = ctx.run(store.check())
    except StoreError as e:   # names the store (masked) and the cause
        add("store", "FAIL", f"{str(e).rstrip('.')}; start Redis or fix the URL (--store, and the proxy's "
            "sessionpin_store)")
        return False
    rep = info.get("replication") or {}
    shape = "cluster" if info.get("cluster") else "standalone"
    add("store", "ok", f"{store.url}: reachable (Redis {info.get('version', '?')}, {shape})")
    durability = info["durability"]
    server = durability["server"]
    if info["durable"]:
        add("store durability", "ok", f"durable writes are fsynced by Redis before they return ({server})")
    elif durability["required"] == "accept-weaker":
        add("store durability", "warn", f"durable writes are NOT fsynced before they return: the server says "
            f"{server}, and the URL accepts that (durability=accept-weaker). A pin Redis acknowledged can be lost "
            f"if Redis or its host crashes, or evicted under memory pressure; for pins it keeps, {REDIS_CONF}"
            "; then drop durability=accept-weaker")
    else:
        add("store durability", "FAIL", f"durable writes are refused: the server says {server}, and a pin must "
            "be on disk, and stay there, before a request leaves. New conversations the proxy moves get 503 "
            f"until you fix every primary: {REDIS_CONF}; or accept weaker durability with "
            "?durability=accept-weaker in the store URL")
    if rep.get("role") not in (None, "master"):
        add("store replicas", "FAIL", f"the URL reaches a {rep.get('role')}, not the primary: writes are refused "
            "(READONLY); point it at the primary")
    wait = durability["wait"]
    replicas = rep.get("replicas")
    if wait:
        if replicas is None:
            add("store replicas", "warn", f"wait={wait}, and the server does not say how many replicas it has")
        elif replicas < wait:
            add("store replicas", "FAIL", f"wait={wait}, but the primary has {replicas} replica(s) online: every "
                "durable write raises NotReplicated, so new conversations the proxy moves get 503; bring "
                f"replicas back or lower ?wait=")
        else:
            add("store replicas", "ok", f"{replicas} replica(s) online; a durable write waits for {wait} of them "
                f"(up to {durability['wait_timeout_ms']} ms)")
    if wait and replicas is not None and replicas < wait:
        return True                    # a durable write cannot succeed: said above, once
    took, problem = _durable_round_trip(ctx, store)
    if problem:
        add("store latency", "FAIL", problem)
    elif took is not None:
        level = "warn" if took > SLOW_DURABLE_WRITE else "ok"
        add("store latency", level, f"a durable write's round trip: {took * 1000:.1f} ms (a new conversation the "
            "proxy moves waits for one before its first request leaves)")
    return True


def _durable_round_trip(ctx: Ctx, store) -> tuple[float | None, str | None]:
    """(seconds a durable write took, None) or (None, what went wrong); the probe key is removed."""
    key = f"doctor:{os.getpid()}"

    async def exercise() -> float:
        started = time.monotonic()
        await store.set(key, "1", 60, durable=True)
        took = time.monotonic() - started
        try:
            if await store.get(key) != "1":
                raise StoreError(f"{store.url}: a durable write did not read back")
        finally:
            await store.delete(key)
        return took
    try:
        return ctx.run(exercise()), None
    except NotDurable as e:
        if not getattr(e, "applied", False):
            return None, None          # refused before anything was sent: the durability line says why
        try:
            ctx.run(store.delete(key))
        except StoreError:
            pass
        return None, str(e)
    except StoreError as e:
        return None, str(e)
