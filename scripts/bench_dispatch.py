#!/usr/bin/env python3
"""What mitmproxy's hook dispatch costs per request: the parts as separate addons (as
``make_addons`` returned them before issue 21) against the one addon (``bundle.Sessionpin``).

    .venv/bin/python scripts/bench_dispatch.py [--requests N] [--rounds R]

Each part is replaced by a stand-in with the same hook methods, doing nothing, so only the
dispatch is measured: mitmproxy's ``trigger_event`` (a ``traverse`` of the script's tree, a
``getattr`` per addon, ``safecall``) for the hooks of one HTTP request — ``requestheaders``,
``request``, ``responseheaders``, ``response`` — on a master holding nothing else (and an
empty script beside them: what dispatching to no addon costs). They alternate round by round; reported: the median CPU time per request of each
(``time.process_time``) and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mitmproxy import hooks  # noqa: E402
from mitmproxy.proxy.layers.http import (HttpRequestHeadersHook, HttpRequestHook,  # noqa: E402
                                         HttpResponseHeadersHook, HttpResponseHook)
from mitmproxy.http import HTTPFlow  # noqa: E402
from mitmproxy.test import taddons, tflow  # noqa: E402

from sessionpin.proxy import make_addons  # noqa: E402
from sessionpin.proxy.bundle import Sessionpin  # noqa: E402

HOOK_NAMES = {h.name for h in hooks.all_hooks.values()}


def _stand_in(part: object) -> object:
    """An object with the part's hook methods (sync or async as the part's), each doing nothing."""
    import inspect

    ns: dict[str, object] = {}
    for name in HOOK_NAMES:
        fn = getattr(part, name, None)
        if callable(fn):
            if inspect.iscoroutinefunction(fn):
                async def nothing_async(*args):
                    return None
                ns[name] = nothing_async
            else:
                def nothing(*args):
                    return None
                ns[name] = nothing
    return type(f"StandIn{type(part).__name__}", (), ns)()


class _Script:
    """What mitmproxy's script loader holds: the module's addons as children."""

    def __init__(self, addons: list) -> None:
        self.addons = addons


def arrangements() -> tuple[_Script, _Script]:
    bundle = make_addons([])[0]
    stand = {n: _stand_in(getattr(bundle, n)) for n in ("defaults", "config", "runtime", "connect", "limit", "pages",
                                                         "status", "router", "lineage", "ws_models", "ws_turns",
                                                         "ws_bounds", "ledger", "allocations", "heads")}
    participants = [_stand_in(p) for p in bundle.participants]
    one = Sessionpin(**stand, participants=participants, pool_options=None)
    # before: 13 addons, the participants' _Lifecycle and the pools' _Options shims
    lifecycle = type("Lifecycle", (), {"running": lambda self: None, "done": lambda self: None})()
    options = type("Options", (), {"load": lambda self, loader: None})()
    many = [stand[n] for n in ("defaults", "config", "runtime", "connect", "limit", "pages", "status", "router",
                               "lineage", "ws_models", "ws_turns", "ws_bounds", "ledger")] + [lifecycle, options]
    return _Script(many), _Script([one])


async def per_request(master, tree: _Script, flows: list[HTTPFlow]) -> float:
    master.addons.chain = [tree]
    t0 = time.process_time()
    for f in flows:
        for hook in (HttpRequestHeadersHook, HttpRequestHook, HttpResponseHeadersHook, HttpResponseHook):
            await master.addons.trigger_event(hook(f))
    return (time.process_time() - t0) / len(flows)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    many, one = arrangements()
    flows = [tflow.tflow(resp=True) for _ in range(args.requests)]
    with taddons.context() as tctx:
        master = tctx.master
        saved = master.addons.chain
        got: dict[str, list[float]] = {"13 addons": [], "one addon": [], "none": []}
        for _ in range(args.rounds):
            got["13 addons"].append(await per_request(master, many, flows))
            got["one addon"].append(await per_request(master, one, flows))
            got["none"].append(await per_request(master, _Script([]), flows))
        master.addons.chain = saved
    a, b = statistics.median(got["13 addons"]), statistics.median(got["one addon"])
    print(f"hooks of one request (requestheaders, request, responseheaders, response), {args.requests} requests, "
          f"median of {args.rounds} rounds, CPU per request:")
    print(f"  13 addons: {a * 1e6:7.1f} µs   (range {min(got['13 addons']) * 1e6:.1f}-{max(got['13 addons']) * 1e6:.1f})")
    print(f"  one addon: {b * 1e6:7.1f} µs   (range {min(got['one addon']) * 1e6:.1f}-{max(got['one addon']) * 1e6:.1f})")
    print(f"  (an empty script: {statistics.median(got['none']) * 1e6:.1f} µs: mitmproxy's own cost per hook)")
    print(f"  saved:     {(a - b) * 1e6:7.1f} µs per request ({b / a:.2f} of the 13 addons' dispatch)")


if __name__ == "__main__":
    asyncio.run(main())
