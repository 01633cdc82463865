#!/usr/bin/env python3
"""What one ``/__sessionpin/metrics`` scrape costs: our text format against prometheus_client's.

usage: python scripts/bench_metrics.py [--servers 50] [--agents 4] [--pools 5] [--members 10]
                                       [--groups 8] [--number 200] [--repeat 7]

One proxy's addons (``make_addons``, a memory store) with many label values: SERVERS servers,
pins of AGENTS agents on every one of them (one index per agent and server, as ``pins.counts``
reads them), router decisions for every agent x turn x outcome, rules and refusals, POOLS server
pools of MEMBERS members each (allocations, moves, quota, drains), and the OpenCode id pool's
counters with GROUPS provider/model groups. In the same run, best of REPEAT rounds of NUMBER
scrapes each, ours and the library's rounds taking turns:

  render    the text from numbers already read (what the format itself costs):
            ours      ``status.metrics_text`` + ``allocations.pool_metrics_text`` + ``pool.report.metrics``
            library   a ``prometheus_client`` Collector yielding the same families from the same
                      numbers, in a registry of its own, through ``generate_latest``
  reads     the store reads alone (the same for both)
  scrape    the whole answer: the store reads (one ``zcount`` per index, the members' state)
            and the render, ours (``StatusEndpoints.render_metrics``) against the same reads
            followed by the library's render.

Both renders are read back with prometheus_client's parser and must hold the same samples.
Prints microseconds per scrape and the ratio library / ours.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mitmproxy import hooks  # noqa: E402
from mitmproxy.test import taddons  # noqa: E402

from sessionpin.reader import facts as F  # noqa: E402
from sessionpin.decision import ladder  # noqa: E402
from sessionpin.serverpools import members, quota  # noqa: E402
from sessionpin.records import pins  # noqa: E402
from sessionpin.opencode_ids import report  # noqa: E402
from sessionpin.proxy import make_addons  # noqa: E402
from sessionpin.proxy.participants import Participant  # noqa: E402
from sessionpin.proxy.allocations import Allocations, pool_metrics_text  # noqa: E402
from sessionpin.proxy.router import Router  # noqa: E402
from sessionpin.proxy.status import StatusEndpoints, metrics_text  # noqa: E402

try:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    sys.exit("bench_metrics: needs prometheus_client (pip install -e '.[test]')")

TURNS = ("opening", "continuation", "side", "subagent", "unknown")
OUTCOMES = (ladder.ROUTED, ladder.LEFT_ALONE, ladder.REFUSED)
RULES = ("opening", "pinned", "fork", "side-current", "continuation-after-title", "out-of-scope", "unknown-agent",
         "no-session", "not-routed", "continuation-unseen", "subagent-unseen", "pinned-server-gone")
REFUSALS = ("pinned-server-gone", "pool-exhausted", "not-saved", "body-too-large", "redirect", "key-missing",
            "server-unreachable", "fork-of-gone")


def config_text(servers: int, agents: list[str], pools: int, size: int) -> str:
    out = [f'[servers.s{i:02d}]\nurl = "https://s{i:02d}.example"\n' for i in range(servers)]
    for p in range(pools):
        names = ", ".join(f'"s{(p * size + j) % servers:02d}"' for j in range(size))
        out.append(f'[pools.p{p}]\nmembers = [{names}]\naffinity = "{"soft" if p % 2 else "hard"}"\n')
    for i, a in enumerate(agents):
        out.append(f'[agents.{a}]\nserver = "{f"p{i % pools}" if pools else "s00"}"\n')
    return "\n".join(out)


class OpenCodePool(Participant):
    """The OpenCode id pool's part of the scrape, from numbers it holds (its snapshot read aside)."""
    name = "pool"

    def __init__(self, groups: int) -> None:
        rng = random.Random(2)
        self.counters = Counter({name: rng.randrange(10_000) for name in report.COUNTERS})
        self.snap = {"groups": [{"provider": f"provider-{g % 3}", "model": f"model-{g}", "fresh_spares": g,
                                 "bindings": [{}] * (g * 3)} for g in range(groups)]}

    def metrics(self) -> str:
        return report.metrics(self.counters, self.snap)


class Read:
    """What one scrape reads, before it renders."""

    def __init__(self, status: StatusEndpoints, alloc: Allocations, pool: OpenCodePool) -> None:
        self.status, self.alloc, self.pool = status, alloc, pool

    async def __call__(self) -> dict[str, Any]:
        counts, _ = await self.status.counts()
        cfg = self.alloc.config.config
        everyone = sorted({m for p in cfg.pools.values() for m in p.members})
        store, now = self.alloc.runtime.store, time.time()
        return {"counts": counts, "everyone": everyone, "now": now,
                "active": await members.active_counts(store, everyone, now),
                "quotas": await members.quotas(store, everyone), "drained": await members.drained(store, everyone)}


def ours(status: StatusEndpoints, alloc: Allocations, pool: OpenCodePool, d: dict[str, Any]) -> str:
    return (metrics_text(d["counts"], status.metrics, status.metrics.store_errors, status.config.reloads,
                         status.config.rejected)
            + pool.metrics()
            + pool_metrics_text(alloc.config.config.pools.values(), alloc.allocated, alloc.moved, d["everyone"],
                                d["active"], d["quotas"], d["drained"], d["now"]))


class Families:
    """The same families as a prometheus_client Collector: O(1) counters in, metric families out."""

    def __init__(self, status: StatusEndpoints, alloc: Allocations, pool: OpenCodePool) -> None:
        self.status, self.alloc, self.pool = status, alloc, pool
        self.data: dict[str, Any] = {}
        self.registry = CollectorRegistry(auto_describe=False)       # one per addon instance, not the global one
        self.registry.register(self)

    def render(self, data: dict[str, Any]) -> str:
        self.data = data          # collect() is synchronous: the async reads come first
        return generate_latest(self.registry).decode()

    def collect(self):
        d, m = self.data, self.status.metrics
        counts = sorted((d["counts"] or {}).items())
        g = GaugeMetricFamily("sessionpin_pins", 'Live pins by server ("-" = not routed); -1 when the store cannot '
                              "be read.", labels=["server"])
        for s, n in counts:
            g.add_metric([s], n.pins)
        yield g
        g = GaugeMetricFamily("sessionpin_active_sessions", "Pinned sessions seen in the last hour, by server.",
                              labels=["server"])
        for s, n in counts:
            g.add_metric([s], n.active)
        yield g
        c = CounterMetricFamily("sessionpin_decisions", "Decisions on inference requests by agent, turn and outcome.",
                                labels=["agent", "turn", "outcome"])
        for k, n in sorted(m.decisions.items()):
            c.add_metric(list(k), n)
        yield c
        for name, help, label, counter in (
                ("sessionpin_decisions_by_rule", "Decisions by the ladder rule that made them.", "rule", m.rules),
                ("sessionpin_refusals", "Requests answered by the router with an error, by reason.", "reason",
                 m.refusals)):
            c = CounterMetricFamily(name, help, labels=[label])
            for k, n in sorted(counter.items()):
                c.add_metric([k], n)
            yield c
        yield CounterMetricFamily("sessionpin_store_errors", "Store calls that failed.", value=m.store_errors)
        yield CounterMetricFamily("sessionpin_config_reloads", "Config files reloaded while running.",
                                  value=self.status.config.reloads)
        yield CounterMetricFamily("sessionpin_config_rejected", "Config texts refused by validation while running.",
                                  value=self.status.config.rejected)
        a = self.alloc
        c = CounterMetricFamily("sessionpin_pool_allocations", "New conversations allocated to a pool member by this "
                                "proxy.", labels=["pool", "member"])
        for p in a.config.config.pools.values():
            for mem in p.members:
                c.add_metric([p.name, mem], a.allocated.get((p.name, mem), 0))
        yield c
        c = CounterMetricFamily("sessionpin_pool_moves", "Pool conversations moved to a member by this proxy "
                                "(soft misses, openings off an exhausted member).", labels=["pool", "member"])
        for (p, mem), n in sorted(a.moved.items()):
            c.add_metric([p, mem], n)
        yield c
        everyone, now, q = d["everyone"], d["now"], d["quotas"]
        for name, help, value in (
                ("sessionpin_pool_member_active", "Live pinned conversations per pool member.",
                 lambda mem: d["active"].get(mem, 0)),
                ("sessionpin_pool_member_exhausted", "1 while a member is known out of quota.",
                 lambda mem: int(mem in q and q[mem].exhausted_until > now)),
                ("sessionpin_pool_member_drained", "1 while a member is drained.",
                 lambda mem: int(mem in d["drained"]))):
            g = GaugeMetricFamily(name, help, labels=["member"])
            for mem in everyone:
                g.add_metric([mem], value(mem))
            yield g
        c = CounterMetricFamily("sessionpin_pool_events", "OpenCode id pool events in this proxy, by kind.",
                                labels=["event"])
        for name in report.COUNTERS:
            c.add_metric([name], int(self.pool.counters.get(name, 0)))
        yield c
        for name, help, value in (("sessionpin_pool_spares", "Fresh spare ids by provider and model.",
                                   lambda g: g["fresh_spares"]),
                                  ("sessionpin_pool_bindings", "Conversations bound to an id, by provider and model.",
                                   lambda g: len(g["bindings"]))):
            f = GaugeMetricFamily(name, help, labels=["provider", "model"])
            for grp in self.pool.snap["groups"]:
                f.add_metric([grp["provider"], grp["model"]], value(grp))
            yield f


def samples(text: str) -> set[tuple[str, tuple, float]]:
    return {(s.name, tuple(sorted(s.labels.items())), float(s.value))
            for f in text_string_to_metric_families(text) for s in f.samples}


async def setup(args, path: Path):
    agents = list(F.AGENTS[:args.agents])
    path.write_text(config_text(args.servers, agents, args.pools, args.members))
    pool = OpenCodePool(args.groups)
    addons = make_addons(participants=[pool], env={"SESSIONPIN_CONFIG": str(path), "SESSIONPIN_STORE": "memory:"})
    tctx = taddons.context(*addons)
    tctx.options.update(sessionpin_config=str(path), sessionpin_store="memory:", sessionpin_connect_check=False)
    every = set(tctx.options.keys())
    for a in addons:
        tctx.master.addons.invoke_addon_sync(a, hooks.ConfigureHook(every))
    by = {type(a): a for a in addons[0].parts}      # the one addon's parts
    status, alloc = by[StatusEndpoints], by[Router].allocations
    store, rng, now = alloc.runtime.store, random.Random(1), time.time()
    for i in range(args.servers):
        for a in agents:
            for k in range(2):
                await pins.create(store, f"{a}-s{i:02d}-{k}", pins.Pin(agent=a, server=f"s{i:02d}", since=now,
                                                                       renewed=now))
    m = status.metrics
    for a in agents:
        for t in TURNS:
            for o in OUTCOMES:
                m.decisions[(a, t, o)] = rng.randrange(1, 10**6)
    m.rules.update({r: rng.randrange(1, 10**6) for r in RULES})
    m.refusals.update({r: rng.randrange(1, 1000) for r in REFUSALS})
    cfg = alloc.config.config
    for p in cfg.pools.values():
        for mem in p.members:
            alloc.allocated[(p.name, mem)] = rng.randrange(1, 10**4)
            if p.affinity == "soft" and rng.random() < 0.5:
                alloc.moved[(p.name, mem)] = rng.randrange(1, 100)
    everyone = sorted({mem for p in cfg.pools.values() for mem in p.members})
    for mem in everyone[::4]:
        q = quota.Quota(observed=now, status=429, exhausted_until=now + 600, why="429")
        await members.write_quota(store, mem, q)
    return addons, status, alloc, pool


async def per_call(fn, number: int) -> float:
    t = time.perf_counter()
    for _ in range(number):
        await fn()
    return (time.perf_counter() - t) / number


async def best(fns, number: int, repeat: int) -> list[float]:
    """Seconds per call of each of ``fns``, best of ``repeat`` rounds; the rounds take turns
    (a, b, a, b, ...), so load from other jobs falls on each alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            times[i].append(await per_call(fn, number))
    return [min(t) for t in times]


async def main(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        addons, status, alloc, pool = await setup(args, Path(tmp) / "config.toml")
        read = Read(status, alloc, pool)
        lib = Families(status, alloc, pool)
        data = await read()
        text_ours, text_lib = ours(status, alloc, pool, data), lib.render(data)
        assert samples(text_ours) == samples(text_lib), "the two renders differ"
        whole = await status.render_metrics()
        assert whole == text_ours, "render_metrics is not the three renders"
        n_samples = len(samples(text_ours))

        async def r_ours():
            ours(status, alloc, pool, data)

        async def r_lib():
            lib.render(data)

        async def s_ours():
            await status.render_metrics()

        async def s_lib():
            lib.render(await read())

        rows = [("reads", (await best([read], args.number, args.repeat))[0], None)]
        for what, a, b in (("render", r_ours, r_lib), ("scrape", s_ours, s_lib)):
            rows.append((what, *await best([a, b], args.number, args.repeat)))
        for a in addons:
            a.done()
    print(f"{args.servers} servers x {args.agents} agents, {args.pools} pools of {args.members} members, "
          f"{args.groups} OpenCode pool groups: {n_samples} samples, {len(text_ours)} bytes (ours), "
          f"{len(text_lib)} bytes (prometheus_client {version('prometheus_client')})")
    print(f"{'':8} {'ours':>12} {'library':>12} {'library/ours':>14}")
    for what, t_ours, t_lib in rows:
        if t_lib is None:
            print(f"{what:8} {t_ours * 1e6:9.0f} us   (the store reads alone, the same for both)")
        else:
            print(f"{what:8} {t_ours * 1e6:9.0f} us {t_lib * 1e6:9.0f} us {t_lib / t_ours:14.2f}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=50)
    ap.add_argument("--agents", type=int, default=4, help=f"at most {len(F.AGENTS)}")
    ap.add_argument("--pools", type=int, default=5)
    ap.add_argument("--members", type=int, default=10)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=7)
    sys.exit(asyncio.run(main(ap.parse_args())))
