"""``classify`` and ``pool``: commands whose work lives in other modules."""

from __future__ import annotations

import argparse
import importlib
import inspect
import time

from .common import Fail, out
from .context import Ctx


def cmd_delegate(module: str, argv: list[str]) -> int:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise Fail(f"`sessionpin {module.rsplit('.', 1)[-1]}` is not available in this installation") from None
    return int(mod.main(argv) or 0)


def cmd_pool(ctx: Ctx, args: argparse.Namespace) -> int:
    """The pool engineer's report (sessionpin.opencode_ids.report), read from the shared store."""
    try:
        from ..opencode_ids import report
        from ..opencode_ids.options import PoolConfig
    except ImportError:
        raise Fail("`sessionpin pool` is not available in this installation") from None
    ttl_ms = args.ttl_ms if args.ttl_ms is not None else PoolConfig().ttl_ms
    store = ctx.store()
    if store is None:
        snap = {"groups": [], "retired": 0}
    else:
        snap = report.snapshot(store, int(time.time() * 1000), ttl_ms)
        if inspect.isawaitable(snap):
            snap = ctx.run(snap)
    out(report.json_text(snap) if args.json else report.text(snap))
    return 0
