"""``status`` and ``sessions``: where every conversation is. Read-only.

Counts come from the store's pin index (``pins.counts``: one ``zcount`` per agent and
server); ``sessions`` lists pins one row each (a walk, which is what it is for).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Iterator

from ..reader.facts import AGENTS
from ..store import identity
from ..reader.ids import short, shorts
from .common import Fail, JsonArray, ago, dump_json, err, line, out, table, where, why, widths_of
from .context import Ctx, Row, lost_pins, recorded_lost
from .ledgercmd import LEDGER_COLUMNS, ledger_cells, ledger_json
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
    # pins the store lost that the proxies recorded, and refuse (their index entries still
    # count as pinned above): said here too, not only when a conversation meets the refusal
    lost = [] if store is None or (ctx.settled is not None and ctx.settled.message) \
        else ctx.run(recorded_lost(store, now))
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
            "store": ctx.store_shown, "store_exists": store is not None, "store_unused": ctx.unused,
            "store_info": _described(store, ctx),
            "store_lost": ctx.settled.message if ctx.settled is not None and ctx.settled.message else None,
            "lost_pins": [{"session": r.session, "agent": r.pin.agent, "server": r.pin.server} for r in lost],
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
        if ctx.unused:
            note += f"\n        {UNUSED.format(store=ctx.store_shown)}"
    out(f"store   {ctx.store_shown}{note}")
    if store is None or ctx.unused:
        _say_elsewhere(ctx, now, indent="        ")
    if ctx.settled is not None and ctx.settled.message:
        out(f"        LOST: {ctx.settled.message}")
    if lost:
        named = ", ".join(f"{short(r.session)} ({r.pin.agent}, {where(r.pin.server)})" for r in lost[:5])
        more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
        out(f"        LOST PINS: the proxies refuse {len(lost)} conversation{'s' if len(lost) != 1 else ''} whose pin "
            f"the store lost: {named}{more}; `sessionpin sessions` lists each with its ways out")
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
        grid.append([m["name"], "(not configured: its requests get 424)", "-", str(m["pinned"]),
                     str(m["active_last_hour"])])
    grid.append(["(not routed)", "-", "-", str(nr_pinned), str(nr_active)])
    for row in table(grid):
        out(row)
    checked_in = sorted({s["key_checked_in"] for s in servers if s["key_checked_in"]})
    if checked_in:
        out(f"(keys checked in {' and '.join(checked_in)})")
    out()
    grid = [["AGENT", "NEW CONVERSATIONS GO TO"]]
    for a, s in agents.items():
        grid.append([a, where(s)])
    for row in table(grid):
        out(row)
    return 0


# Up to this many rows (as the pin index counts them), ``sessions`` reads them all and sorts
# them (most recently seen first, the table's widths fitted to every row); past it, it prints
# rows as the store walks its index (most recently renewed first, the widths of the first
# batch), so the first row comes after one batch and memory stays flat at a million pins.
SORTED_UP_TO = 5_000
LISTING_BATCH = 1_000       # pins per store round trip (three calls: index page, pins, activity)


# A store with no identity that this machine never used: nothing sessionpin made is there.
UNUSED = ("nothing sessionpin made is in {store} (no store identity, no pin index, and this machine never "
          "used it): no proxy has used it yet, or it was emptied — if a proxy runs, check the URL's database "
          "and prefix against the proxy's (--store, SESSIONPIN_STORE)")


def cmd_sessions(ctx: Ctx, args: argparse.Namespace) -> int:
    if args.agent and args.agent not in AGENTS:
        raise Fail(f"unknown agent {args.agent!r} (known: {', '.join(AGENTS)})")
    store = ctx.store()
    now = time.time()
    if args.server is not None:
        cfg = ctx.config()
        pinned = any(n for (a, server), (n, _) in ctx.counts().items()
                     if server == args.server and (not args.agent or a == args.agent))
        if args.server not in cfg.servers and not pinned:
            known = ", ".join(cfg.servers) or "none configured"
            raise Fail(f"no server named {args.server!r} and no conversation pinned to it (servers: {known})")
    # The filters pick index groups (<agent>:<server>): the store walks only those.
    if args.server is not None and args.not_routed:
        names: list[str] = []
    elif args.server is not None or args.not_routed:
        names = ctx.groups(args.agent or None, args.server, any_server=False)
    else:
        names = ctx.groups(args.agent or None)
    # The index says how many there are (one zcount per group): past SORTED_UP_TO the first
    # batch is printed as soon as it is read.
    many = ctx.indexed(names) > SORTED_UP_TO
    walk = ctx.listing(names, LISTING_BATCH)
    try:
        code = _print_sessions(ctx, args, walk, store is not None, now, many)
    finally:
        walk.close()            # a walk left early (a closed pipe) ends its store reads here
    if store is not None and names:
        _say_lost(ctx.run(lost_pins(store, now, names)))
    return code


def _say_elsewhere(ctx: Ctx, now: float, indent: str = "") -> None:
    """No store yet at this URL, while this machine remembers another holding live pins: the
    command may be looking at the wrong store (a shell without the proxy's SESSIONPIN_STORE,
    a wrong db or prefix). Said, not guessed: which one the proxy uses is the operator's."""
    for r in identity.others(identity.Memory(ctx.store_url), now)[:3]:
        err(f"{indent}this machine last used store {r.store} ({r.pins} pins, seen {ago(r.seen, now)}): "
            f"if the proxy uses that one, give it with --store (or SESSIONPIN_STORE)")


def _say_lost(rows: list[Row]) -> None:
    """The pins of these groups the store lost, which the proxies refuse (standard error: the
    table and the JSON array list the pins there are): each with its ways out, the commands
    the proxies' refusal names. Before, they were simply not listed, while ``status`` counted them."""
    shown = shorts([r.session for r in rows])      # unique among them, as the table's
    for r in rows:
        sid, pin = shown[r.session], r.pin
        back = f"sessionpin move {sid} {pin.server}" if pin.server else f"sessionpin move {sid} --not-routed"
        err(f"LOST {sid} ({pin.agent}, pinned {where(pin.server)}): the store no longer has its pin ({r.lost}); "
            f"proxies refuse it until you decide: `{back}` puts it back, `sessionpin forget {sid}` lets it be "
            f"decided afresh (or restore the store, or `sessionpin store accept-loss` for every loss)")


def _print_sessions(ctx: Ctx, args: argparse.Namespace, batches: Iterator[list[Row]], have_store: bool,
                    now: float, many: bool) -> int:
    head: list[Row] = []
    for batch in batches:
        head.extend(batch)
        if many or len(head) > SORTED_UP_TO:    # (more than the index said: pins made meanwhile)
            break
    else:
        head.sort(key=lambda r: (-(r.seen.last or r.pin.since), r.session))
        many = False
    streamed = many or len(head) > SORTED_UP_TO
    if args.json:
        array = JsonArray()
        for rows in itertools.chain([head], _flushed(batches)):
            # the ledger's summary of each row: one store call per batch of rows, streamed too
            spent = ledger_json(ctx, [r.session for r in rows])
            for r in rows:
                array.add(r.as_json() | ({"ledger": spent[r.session]} if spent.get(r.session) else {}))
        array.close()
        if streamed:
            _say_streamed(array.n)
        return 0
    if not head:
        what = "no pinned conversations" + ("" if have_store else f" (no store file yet at {ctx.store_file()})")
        if ctx.unused:
            what += f" ({UNUSED.format(store=ctx.store_shown)})"
        out(what + (" match" if (args.agent or args.server or args.not_routed) and have_store else ""))
        if not have_store or ctx.unused:
            _say_elsewhere(ctx, now)
        return 0
    # the PARENT column, when a listed one is a fork (always, when rows stream: a fork may come later)
    forks = streamed or any(r.pin.parent for r in head)
    # the ledger's columns (a store call per 500 rows): when the rows are few (the header is
    # printed before later rows are read) and one of them has a ledger
    spent = {} if streamed else ledger_cells(ctx, [r.session for r in head])
    grid = [["SESSION", "AGENT", "SERVER", "WHY", *(["PARENT"] if forks else []), "PINNED", "LAST SEEN", "REQUESTS",
             *(LEDGER_COLUMNS if spent else ())]]
    # short ids unique among the rows shown (those of the first batch, when rows stream)
    shown = shorts([r.session for r in head] + [r.pin.parent for r in head if r.pin.parent])

    def cells(r: Row) -> list[str]:
        parent = [shown.get(r.pin.parent, short(r.pin.parent)) if r.pin.parent else "-"] if forks else []
        return [shown.get(r.session, short(r.session)), r.pin.agent, where(r.pin.server), why(r.pin), *parent,
                ago(r.pin.since, now), ago(r.seen.last, now), str(r.seen.requests),
                *(spent.get(r.session, ["-"] * len(LEDGER_COLUMNS)) if spent else ())]
    grid += [cells(r) for r in head]
    widths = widths_of(grid)
    n = 0
    for rows in itertools.chain([grid], _flushed(batches)):
        for cell in (rows if rows is grid else map(cells, rows)):
            out(line(cell, widths))
            n += 1
    if streamed:
        _say_streamed(n - 1)
    return 0


def _flushed(batches: Iterator[list[Row]]) -> Iterator[list[Row]]:
    """The batches, standard output flushed before each is read (a reader sees rows as they come)."""
    for batch in batches:
        sys.stdout.flush()
        yield batch


def _say_streamed(n: int) -> None:
    err(f"({n} conversations, more than {SORTED_UP_TO}: listed as the store walks its index, most recently "
        "renewed first, not sorted by last seen)")


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
