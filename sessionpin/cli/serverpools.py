"""``pools``, ``pools reset``, ``drain``, ``undrain``: server pools as the operator sees and steers them
(docs/serverpools.md).

Rules it keeps:
- Everything comes from the config and the shared store, so it works with or without a
  proxy, and every proxy on the store sees a drain at its next allocation.
- Active conversations per member are the pin index's counts (``members.active_counts``),
  never a walk; ``drain`` counts the pool's own conversations on the member (a pin records
  its pool: ``members.by_pool`` walks the member's pins, paged); ``--history`` walks the activity records (ids, names, times, rules).
- A drain is durable and only stops new allocations: running conversations stay (a soft
  pool's move its pinned conversations at their next request — said so when draining).
- ``pools reset MEMBER`` deletes the member's quota state (durable, recorded): a member that
  claimed a far reset is trusted again by every proxy, which read that state from the store.
- The state is shown as stored (each proxy bounded it when it wrote it); a time no clock
  can show is shown as such, never an exception.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..serverpools import members, quota
from .common import Fail, ago, dump_json, iso, out, table
from .context import Ctx


def _member_of(ctx: Ctx, name: str):
    cfg = ctx.config()
    if name not in cfg.servers:
        known = ", ".join(sorted({m for p in cfg.pools.values() for m in p.members})) or "no pool configured"
        raise Fail(f"no server named {name!r} in {ctx.config_path} (pool members: {known})")
    pools = cfg.pools_of(name)
    if not pools:
        raise Fail(f"{name} is in no pool; drains are for pool members (`sessionpin pools`)")
    return cfg, pools


def cmd_pools(ctx: Ctx, args: argparse.Namespace) -> int:
    if args.member is not None:
        if args.pool != "reset":
            raise Fail(f"unexpected {args.member!r}: `sessionpin pools [POOL]`, or `sessionpin pools reset MEMBER`")
        return cmd_reset(ctx, args.member)
    cfg = ctx.config()
    store = ctx.store()
    now = time.time()
    if args.history:
        records = [] if store is None else ctx.run(members.history(store, args.pool, args.limit))
        if args.json:
            dump_json([{k: v for k, v in _asdict(r).items() if v not in ("", -1)} for r in records])
            return 0
        if not records:
            out("No pool activity recorded" + (f" for {args.pool}." if args.pool else "."))
            return 0
        grid = [["TIME", "KIND", "POOL", "MEMBER", "SESSION", "AGENT", "WHY"]]
        for r in records:
            grid.append([iso(r.t) or "-", r.kind, r.pool or "-", r.member or "-", r.session[:8] or "-",
                         r.agent or "-", r.why or (f"rev {r.previous or '-'} → {r.rev}" if r.kind == "config" else "")])
        for line in table(grid):
            out(line)
        return 0
    pools = [p for p in cfg.pools.values() if args.pool in (None, p.name)]
    if args.pool and not pools:
        raise Fail(f"no pool named {args.pool!r} in {ctx.config_path} (pools: {', '.join(cfg.pools) or 'none'})")
    everyone = sorted({m for p in pools for m in p.members})
    active: dict[str, int] = {}
    q: dict[str, quota.Quota] = {}
    drained: dict[str, float] = {}
    cursors: dict[str, Any] = {}
    if store is not None and pools:
        active = ctx.run(members.active_counts(store, everyone, now))
        q = ctx.run(members.quotas(store, everyone))
        drained = ctx.run(members.drained(store, everyone))
        cursors = {p.name: ctx.run(members.cursor(store, p.name)) for p in pools}
    report = []
    for p in pools:
        c = cursors.get(p.name)
        rows = []
        for m in p.members:
            mq = q.get(m)
            rows.append({"member": m, "active": active.get(m, 0),
                         "exhausted_until": iso(mq.exhausted_until) if mq and mq.exhausted_until > now else None,
                         "exhausted_why": mq.why if mq and mq.exhausted_until > now else None,
                         "headroom": mq.headroom if mq else None, "drained_since": iso(drained.get(m)),
                         "weight": p.weight(m) if p.policy == "weighted" else None})
        report.append({"pool": p.name, "policy": p.policy, "affinity": p.affinity, "revision": p.revision,
                       "agents": [a for a, x in cfg.agents.items() if x.server == p.name],
                       "cursor": c.n if c else 0, "cursor_revision": (c.rev or None) if c else None,
                       "members": rows})
    if args.json:
        dump_json(report)
        return 0
    if not report:
        out(f"No pools in {ctx.config_path}; add a [pools.NAME] table with members = [...] (docs/serverpools.md).")
        return 0
    for i, p in enumerate(report):
        if i:
            out()
        agents = ", ".join(p["agents"]) or "no agent"
        stale = "" if p["cursor_revision"] in (None, p["revision"]) else " (last allocation under an older definition)"
        out(f"pool {p['pool']}: {p['policy']}, {p['affinity']} affinity; new conversations of {agents}; "
            f"cursor {p['cursor']}{stale}")
        grid = [["MEMBER", "ACTIVE", "HEADROOM", "EXHAUSTED UNTIL", "DRAINED"]]
        for r in p["members"]:
            grid.append([r["member"] + (f" (weight {r['weight']})" if r["weight"] else ""), str(r["active"]),
                         "-" if r["headroom"] is None else f"{r['headroom']:.0%}",
                         f"{r['exhausted_until']} ({r['exhausted_why']})" if r["exhausted_until"] else "-",
                         f"since {ago(drained.get(r['member']), now)}" if r["drained_since"] else "-"])
        for line in table(grid, "  "):
            out(line)
    return 0


def cmd_drain(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg, pools = _member_of(ctx, args.member)
    store = ctx.store(create=True)
    assert store is not None
    now = time.time()
    done = ctx.run(members.drain(store, args.member, now) if not args.undo else members.undrain(store, args.member, now))
    names = ", ".join(p.name for p in pools)
    if args.undo:
        out(f"{args.member} takes new conversations of pool {names} again." if done
            else f"{args.member} was not drained; nothing written.")
        return 0
    if not done:
        out(f"{args.member} is already drained; nothing written.")
        return 0
    out(f"Drained {args.member}: no new conversations of pool {names} go to it (every proxy on this store, "
        f"from its next allocation).")
    # each pool's own conversations: a drain concerns only what that pool allocated
    # (a pin made by `use AGENT MEMBER` or a move is no pool's, and stays)
    own = ctx.run(members.by_pool(store, args.member, now))
    for p in pools:
        n = own.get(p.name, 0)
        convs = f"{n} running conversation{'s' if n != 1 else ''} of pool {p.name}"
        if p.affinity == "hard":
            out(f"{convs} on it stay{'s' if n == 1 else ''} there (hard affinity).")
        else:
            out(f"{convs} on it move{'s' if n == 1 else ''} to a fresh member at {'its' if n == 1 else 'their'} "
                f"next request (soft affinity). Undo: `sessionpin undrain {args.member}`.")
    others = sum(n for pool, n in own.items() if pool not in {p.name for p in pools})
    if others:
        out(f"{others} other conversation{'s' if others != 1 else ''} pinned to it (by no pool of it) "
            f"stay{'s' if others == 1 else ''} there: a drain only stops the pool's allocations.")
    return 0


def cmd_reset(ctx: Ctx, member: str) -> int:
    """Forget a member's quota state in the store: every proxy on it allocates to the member
    and sends its pinned turns again from its next look (they read the state there)."""
    _, pools = _member_of(ctx, member)
    store = ctx.store(create=True)
    assert store is not None
    now = time.time()
    had = ctx.run(members.quotas(store, [member])).get(member)
    if not ctx.run(members.reset(store, member, now)):
        out(f"{member} has no quota state; nothing written.")
        return 0
    was = ""
    if had is not None and had.exhausted_until > now:
        was = f" (it was out of quota until {iso(had.exhausted_until)}: {had.why})"
    elif had is not None and had.headroom is not None:
        was = f" (headroom {had.headroom:.0%})"
    out(f"Forgot {member}'s quota state{was}: every proxy on this store takes it as fresh for new "
        f"conversations of pool {', '.join(p.name for p in pools)} and sends its pinned turns again, until "
        f"its next answer says otherwise.")
    return 0


def _asdict(r: members.Record) -> dict[str, Any]:
    return {f: getattr(r, f) for f in r.__struct_fields__}
