"""What the pool holds, for ``sessionpin pool``, ``/__sessionpin/status`` and ``/metrics``.

``await snapshot(store, now_ms, ttl_ms)`` reads the async store (no writes) and returns
plain data; the rest are pure: ``text``/``json_text`` render a snapshot; ``status`` and
``metrics`` render a service's in-memory counters (and a snapshot). Only ids, provider and model names and numbers appear:
never a credential, a URL or content.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Mapping

from . import state
from ..store.base import Store


async def snapshot(store: Store, now_ms: int, ttl_ms: int) -> dict[str, Any]:
    """Spares and bindings grouped by provider+model."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}

    def group(provider: str, model: str) -> dict[str, Any]:
        return groups.setdefault((provider, model), {"provider": provider, "model": model,
                                                     "spares": [], "bindings": []})

    for provider, model in await state.targets_in_store(store):
        for sid, s in (await state.spares(store, provider, model, drop_bad=False)).items():
            group(provider, model)["spares"].append({
                "id": sid, "upstream_ms": s.upstream_ms, "source": s.source,
                "verified_ago_s": max(0, now_ms - s.verified_at) // 1000,
                "fresh": state.is_fresh(s, now_ms, ttl_ms)})
    for key, b in (await state.bindings(store, drop_bad=False)).items():
        conversation = key.split(state.SEP)[0]
        group(b.provider, b.model)["bindings"].append({
            "conversation": conversation, "id": b.routed_id, "how": b.origin,
            "upstream_ms": b.upstream_ms, "failures": b.failures,
            "idle_s": max(0, now_ms - b.last_seen_at) // 1000,
            "bound_ago_s": max(0, now_ms - b.bound_at) // 1000})
    out = []
    for k in sorted(groups):
        g = groups[k]
        g["spares"].sort(key=lambda s: (not s["fresh"], s["upstream_ms"], s["id"]))
        g["bindings"].sort(key=lambda b: (b["idle_s"], b["conversation"]))
        g["fresh_spares"] = sum(1 for s in g["spares"] if s["fresh"])
        out.append(g)
    return {"groups": out, "retired": await state.retired_count(store)}


def json_text(snap: Mapping[str, Any]) -> str:
    return json.dumps(snap, indent=2, sort_keys=True)


def _ms(v: int | None) -> str:
    return "-" if v is None else f"{v} ms"


def text(snap: Mapping[str, Any]) -> str:
    lines: list[str] = []
    if not snap["groups"]:
        lines.append("pool: empty (no spares, no bindings)")
    for g in snap["groups"]:
        lines.append(f"{g['provider']} / {g['model']}: {g['fresh_spares']} fresh spare(s) of "
                     f"{len(g['spares'])}, {len(g['bindings'])} binding(s)")
        for s in g["spares"]:
            lines.append(f"  spare {s['id']}  {_ms(s['upstream_ms'])} ({s['source']})  "
                         f"verified {s['verified_ago_s']}s ago{'' if s['fresh'] else '  STALE'}")
        for b in g["bindings"]:
            lines.append(f"  bound {b['id']}  <- {b['conversation']}  {_ms(b['upstream_ms'])}  "
                         f"{b['how']}  failures {b['failures']}  idle {b['idle_s']}s")
    lines.append(f"retired ids remembered: {snap['retired']}")
    return "\n".join(lines)


# Counters a service keeps in memory, in the order status shows them.
COUNTERS = (
    "routed_binding", "routed_spare", "routed_stale", "routed_probe", "routed_fresh", "routed_client",
    "skipped", "routed_unresolved", "deduped", "takes", "take_races_lost", "bind_conflicts", "cooldowns",
    "probes", "probes_fast", "probes_slow", "probes_unauthorized", "probes_rejected",
    "probes_overloaded", "probes_timeout", "probes_failed",
    "spares_added", "spares_reverified", "spares_dropped",
    "observed", "strikes", "retired_quarantine", "retired_429", "retired_strikes", "retired_idle",
    "retired_cap", "cycles", "store_errors", "refused_store", "refused_lost", "errors",
)


def status(counters: Counter[str] | Mapping[str, int], *, running: bool, enabled: bool,
           loops: int = 0) -> dict[str, Any]:
    """The pool's part of /__sessionpin/status."""
    return {"enabled": enabled, "refresh_running": running, "refresh_loops": loops,
            "counters": {name: int(counters.get(name, 0)) for name in COUNTERS}}


def metrics(counters: Counter[str] | Mapping[str, int], snap: Mapping[str, Any] | None = None) -> str:
    """Prometheus text lines for /__sessionpin/metrics: each family one group (HELP, TYPE, samples)."""
    lines = ["# HELP sessionpin_pool_events_total OpenCode id pool events in this proxy, by kind.",
             "# TYPE sessionpin_pool_events_total counter"]
    lines += [f'sessionpin_pool_events_total{{event="{name}"}} {int(counters.get(name, 0))}' for name in COUNTERS]
    if snap is not None:
        groups = [(f'provider="{_esc(g["provider"])}",model="{_esc(g["model"])}"', g) for g in snap["groups"]]
        lines += ["# HELP sessionpin_pool_spares Fresh spare ids by provider and model.",
                  "# TYPE sessionpin_pool_spares gauge"]
        lines += [f"sessionpin_pool_spares{{{labels}}} {g['fresh_spares']}" for labels, g in groups]
        lines += ["# HELP sessionpin_pool_bindings Conversations bound to an id, by provider and model.",
                  "# TYPE sessionpin_pool_bindings gauge"]
        lines += [f"sessionpin_pool_bindings{{{labels}}} {len(g['bindings'])}" for labels, g in groups]
    return "\n".join(lines) + "\n"


def _esc(v: str) -> str:
    """A label value in the Prometheus text format (as sessionpin.proxy.exposition.label)."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
