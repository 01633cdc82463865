"""``status`` and ``sessions``: where every conversation is. Read-only.

Counts come from the store's pin index (``pins.counts``: one ``zcount`` per agent and
server); ``sessions`` lists pins one row each (a walk, which is what it is for).
"""

from __future__ import annotations

import argparse
import json
import time

from ..facts import AGENTS
from ..ids import short
from .common import Fail, ago, dump_json, out, table, where, why
from .context import Ctx
from .proxies import config_mismatch, find_proxies, find_proxy, key_state, proxy_keys


def cmd_status(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    store = ctx.store()
    now = time.time()
    counts: dict[str | None, tuple[int, int]] = {}
    for (_, server), (n, active) in ctx.counts().items():
        a, b = counts.get(server, (0, 0))
        counts[server] = (a + n, b + active)
    proxies = find_proxies(ctx)
    proxy = find_proxy(ctx, proxies)
    penv = proxy_keys(proxy)
    servers = []
    for s in cfg.servers.values():
        pinned, active = counts.get(s.name, (0, 0))
        is_set, checked = key_state(s, penv)
        servers.append({"name": s.name, "url": s.url, "key_env": s.key_env, "key_set": is_set,
                        "key_checked_in": checked or None, "pinned": pinned, "active_last_hour": active})
    gone = sorted(s for s in counts if s is not None and s not in cfg.servers)
    missing = [{"name": g, "pinned": counts[g][0], "active_last_hour": counts[g][1]} for g in gone]
    nr_pinned, nr_active = counts.get(None, (0, 0))
    agents = {a: cfg.current(a) for a in AGENTS}
    if args.json:
        dump_json({
            "config": str(ctx.config_path), "config_exists": ctx.config_path.exists(),
            "store": ctx.store_shown, "store_exists": store is not None,
            "store_info": _described(store, ctx),
            "store_lost": ctx.settled.message if ctx.settled is not None and ctx.settled.message else None,
            "proxy": proxy.as_json(), "proxies": [p.as_json() for p in proxies], "servers": servers,
            "not_routed": {"pinned": nr_pinned, "active_last_hour": nr_active},
            "unconfigured_servers_with_pins": missing, "agents": agents,
        })
        return 0

    out(f"config  {ctx.config_path}" + ("" if ctx.config_path.exists() else "  (no file: nothing is routed)"))
    note = "  (no file yet: nothing pinned)" if store is None else ""
    info = _described(store)
    if info.get("kind") == "redis":
        note = f"  ({info.get('health')}; {info.get('note')})"
    out(f"store   {ctx.store_shown}{note}")
    if ctx.settled is not None and ctx.settled.message:
        out(f"        LOST: {ctx.settled.message}")
    live = [p for p in proxies if p.answering]
    for p in live:
        up = f", up {ago(p.started, now).removesuffix(' ago')}" if p.started else ""
        out(f"proxy   answering at {p.url} (pid {p.pid}{up})")
        mismatch = config_mismatch(p, ctx.config_path)
        if mismatch:
            out(f"        {mismatch}")
    if not live:
        out(f"proxy   not answering: {proxy.why}; start one with `sessionpin run`")
    for p in proxies:
        if not p.answering and p is not proxy:
            out(f"        ({p.why})")
    out()
    grid = [["SERVER", "URL", "KEY", "PINNED", "ACTIVE 1H"]]
    for s in servers:
        key = (f"${s['key_env']} " + ("set" if s["key_set"] else "NOT SET")) if s["key_env"] else "the agent's own"
        grid.append([s["name"], s["url"], key, str(s["pinned"]), str(s["active_last_hour"])])
    for m in missing:
        grid.append([m["name"], "(not configured: its requests get 503)", "-", str(m["pinned"]),
                     str(m["active_last_hour"])])
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
    selected = ctx.rows()
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
    forks = any(r.pin.parent for r in selected)     # the PARENT column, when a listed one is a fork
    grid = [["SESSION", "AGENT", "SERVER", "WHY", *(["PARENT"] if forks else []), "PINNED", "LAST SEEN", "REQUESTS"]]
    for r in selected:
        parent = [short(r.pin.parent) if r.pin.parent else "-"] if forks else []
        grid.append([short(r.session), r.pin.agent, where(r.pin.server), why(r.pin), *parent, ago(r.pin.since, now),
                     ago(r.seen.last, now), str(r.seen.requests)])
    for line in table(grid):
        out(line)
    return 0


def _described(store, ctx: Ctx | None = None) -> dict:
    """What the store says of itself (its safe URL, durability, health), as JSON."""
    if store is None:
        return {}
    try:
        info = json.loads(json.dumps(store.describe(), default=str))
    except Exception as e:   # a description is best effort
        return {"error": str(e)}
    if ctx is not None and ctx.settled is not None:
        s = ctx.settled
        info["identity"] = {"id": s.identity.id if s.identity else None, "verdict": s.kind,
                            "lost": s.message or None}
    return info
