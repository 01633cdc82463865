"""``show`` and ``costs``: what each conversation's turns cost and read from cache (the ledger,
docs/ledger.md), and the ledger's columns of ``sessions``. Read-only.

Costs use the prices in the config (``[servers.NAME.prices."GLOB"]``); a figure whose tokens
have no price written is shown as ``-`` (``--json``: null, with the kinds missing a price),
never guessed.
"""

from __future__ import annotations

import argparse
import time

from ..accounting import ledger, prices
from ..config.config import Config
from ..reader.ids import matches, short, typed
from ..accounting.usage import FIELDS, Usage
from .common import Fail, ago, dump_json, out, table
from .context import Ctx


def _cost(cfg: Config, by: dict[tuple[str, str], Usage]) -> tuple[float | None, list[str]]:
    """The cost of a ledger's tokens per (server, model) at the config's prices."""
    total, missing = 0.0, []
    for (server, model), usage in sorted(by.items()):
        s = cfg.servers.get(server)
        got, lacks = prices.cost(usage, prices.price_for(s.prices, model) if s is not None else None)
        if got is None:
            missing += [f"{server}/{model}: {', '.join(lacks)}"]
        else:
            total += got
    return (None if missing else total), missing


def money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if value < 1 else f"{value:.2f}"


def tokens(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1_000_000:.1f}M"
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _usage_json(u: Usage) -> dict:
    return {f: getattr(u, f) for f in FIELDS} | {"uncached": u.uncached}


LEDGER_COLUMNS = ("TOKENS", "CACHE READ", "COST")


def ledger_cells(ctx: Ctx, sessions: list[str]) -> dict[str, list[str]]:
    """The ledger's columns of ``sessions`` (TOKENS, CACHE READ, COST) of the sessions that have a
    ledger: one store call per 500."""
    store = ctx.store()
    if store is None:
        return {}
    cfg = ctx.config()
    got = ctx.run(_summaries(store, sessions))
    cells = {}
    for session, s in got.items():
        if s is None:
            continue
        u = s.usage
        cells[session] = [tokens(u.input + u.output), share(u.cache_read, u.input), money(_cost(cfg, s.by)[0])]
    return cells


def ledger_json(ctx: Ctx, sessions: list[str]) -> dict[str, dict | None]:
    store = ctx.store()
    if store is None:
        return {}
    cfg = ctx.config()
    return {session: _summary_json(cfg, s) for session, s in ctx.run(_summaries(store, sessions)).items()
            if s is not None}


async def _summaries(store, sessions: list[str]) -> dict[str, ledger.Summary | None]:
    return await ledger.load_many(store, sessions)


def _summary_json(cfg: Config, s: ledger.Summary) -> dict:
    cost, missing = _cost(cfg, s.by)
    return {"turns": s.turns, "misses": s.misses, "miss_reasons": s.reasons, "tokens": _usage_json(s.usage),
            "cache_efficiency": s.efficiency, "cost": cost, "unpriced": missing,
            "by_server_model": [{"server": server, "model": model, "turns": s.turns_by.get((server, model), 0),
                                 "tokens": _usage_json(u), "cost": _cost(cfg, {(server, model): u})[0]}
                                for (server, model), u in sorted(s.by.items())]}


def _resolve(ctx: Ctx, given: str) -> str:
    """A conversation with a ledger: its id, a unique prefix, or the short form shown."""
    given = typed(given)
    if not given:
        raise Fail("give a session id, or its first characters (see `sessionpin sessions`)")
    store = ctx.store()
    if store is None:
        raise Fail(f"no store file yet at {ctx.store_file()}: nothing recorded")
    names = [k[len(ledger.PREFIX):] for k in ctx.run(store.keys(ledger.PREFIX))
             if not k.startswith(ledger.TURNS_PREFIX)]
    if given in names:
        return given
    found = [n for n in names if matches(n, given)]
    if not found:
        raise Fail(f"no conversation with a ledger matches {given!r}; list them with `sessionpin costs --by session`")
    if len(found) > 1:
        raise Fail(f"{given!r} matches {len(found)} conversations: {', '.join(found[:6])}; give more characters")
    return found[0]


def cmd_show(ctx: Ctx, args: argparse.Namespace) -> int:
    session = _resolve(ctx, args.session)
    store = ctx.need_store()
    s = ctx.run(ledger.load(store, session))
    turns = ctx.run(ledger.turns(store, session))
    if args.limit:
        turns = turns[-args.limit:]
    cfg = ctx.config()
    if s is None:
        raise Fail(f"conversation {session} has no ledger (its records expired or were never written)")
    if args.json:
        dump_json({"session": session, "agent": s.agent, **_summary_json(cfg, s),
                   "turns": [{"t": t.t, "lane": t.lane, "kind": t.kind, "server": t.server, "model": t.model,
                              "id": t.id, "tokens": _usage_json(t.usage), "limit": t.limit,
                              "cache_efficiency": t.efficiency, "miss": t.miss, "reason": t.reason or None,
                              "detail": t.detail or None, "cut": t.cut} for t in turns]})
        return 0
    u = s.usage
    cost, missing = _cost(cfg, s.by)
    eff = f"{100 * s.efficiency:.0f}% of its limit" if s.efficiency is not None else "no limit yet"
    out(f"session  {session} ({s.agent})")
    out(f"turns    {s.turns}, {s.misses} cache misses" +
        (f" ({', '.join(f'{r} {n}' for r, n in sorted(s.reasons.items()))})" if s.reasons else ""))
    out(f"tokens   input {tokens(u.input)} (cache read {tokens(u.cache_read)} = {share(u.cache_read, u.input)}, "
        f"written {tokens(u.cache_write_5m)} 5m + {tokens(u.cache_write_1h)} 1h, uncached {tokens(u.uncached)}), "
        f"output {tokens(u.output)} (reasoning {tokens(u.reasoning)})")
    out(f"cache    read {eff}")
    out(f"cost     {money(cost)}" + (f"  (no price for {'; '.join(missing)})" if missing else ""))
    out()
    now = time.time()
    grid = [["WHEN", "LANE", "SERVER", "MODEL", "INPUT", "READ", "WRITE", "OUTPUT", "OF LIMIT", "CACHE"]]
    for t in turns:
        if t.miss:
            verdict = f"miss: {t.reason}" + (f" ({t.detail})" if t.detail else "")
        elif t.limit is None:
            verdict = "first turn"
        else:
            verdict = "hit"
        if t.cut:
            verdict += ", cut short"
        grid.append([ago(t.t, now), t.lane, t.server, t.model, tokens(t.usage.input), tokens(t.usage.cache_read),
                     tokens(t.usage.cache_write), tokens(t.usage.output),
                     f"{100 * t.efficiency:.0f}%" if t.efficiency is not None else "-", verdict])
    for line in table(grid):
        out(line)
    return 0


def cmd_costs(ctx: Ctx, args: argparse.Namespace) -> int:
    store = ctx.store()
    cfg = ctx.config()
    summaries: dict[str, ledger.Summary] = {}
    if store is not None:
        names = [k[len(ledger.PREFIX):] for k in ctx.run(store.keys(ledger.PREFIX))
                 if not k.startswith(ledger.TURNS_PREFIX)]
        summaries = {n: s for n, s in ctx.run(_summaries(store, names)).items() if s is not None}
    groups: dict[str, dict[tuple[str, str], Usage]] = {}
    turns: dict[str, int] = {}
    for session, s in summaries.items():
        for (server, model), u in s.by.items():
            key = {"session": session, "server": server, "agent": s.agent or "-", "model": f"{server}/{model}"}[args.by]
            g = groups.setdefault(key, {})
            g[(server, model)] = g.get((server, model), Usage()) + u
            turns[key] = turns.get(key, 0) + s.turns_by.get((server, model), 0)
    rows = []
    for key, by in groups.items():
        u = sum(by.values(), Usage())
        cost, missing = _cost(cfg, by)
        rows.append((key, u, cost, missing))
    rows.sort(key=lambda r: (-(r[2] or 0), -r[1].input, r[0]))
    if args.json:
        dump_json([{args.by: key, "turns": turns.get(key, 0), "tokens": _usage_json(u), "cost": cost,
                    "unpriced": missing} for key, u, cost, missing in rows])
        return 0
    if not rows:
        out("no turns recorded" + ("" if store is not None else f" (no store file yet at {ctx.store_file()})"))
        return 0
    grid = [[args.by.upper(), "TURNS", "INPUT", "CACHE READ", "WRITTEN", "OUTPUT", "COST"]]
    unpriced = False
    for key, u, cost, missing in rows:
        unpriced |= bool(missing)
        grid.append([short(key) if args.by == "session" else key, str(turns.get(key, 0)), tokens(u.input),
                     share(u.cache_read, u.input), tokens(u.cache_write), tokens(u.output), money(cost)])
    for line in table(grid):
        out(line)
    if unpriced:
        out("(- : no price in the config for some of these tokens; add [servers.NAME.prices.\"MODEL\"], "
            "see docs/ledger.md)")
    return 0
