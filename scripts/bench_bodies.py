#!/usr/bin/env python3
"""What reading a real request body costs, per part, on the recorded traffic (issue 22).

    .venv/bin/python scripts/bench_bodies.py [--agent claude-code] [--min-kb 20] [--tree DIR] [--renames]

Every recorded request (``tests/fixtures/traffic/AGENT/*.json``) of at least ``--min-kb``:
the facts reader (``facts.read``), the model's rename as the router makes it after the facts
(``rewrite.replace_model`` with the span the facts found, or none: then it looks), the lineage root
(``lineage.chain(turns=1)``), the prompt shape (``promptshape.shape``, with the ledger's
cache of digests warm: a conversation's next turn), µs per call, the best of 5 runs of 50
calls (``time.thread_time``). ``--tree DIR``: that tree's ``sessionpin`` instead of this one's
(a before/after in two runs, e.g. a ``git worktree`` of an earlier commit). ``--renames``: the
facts read as the router reads them under a config with a model map (``locate_model``: the
model's span found by the facts' own decode; a tree without it reads as before).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def best(fn, n: int = 50) -> float:
    try:
        fn()
    except Exception:           # (a body without a top-level model is not renamed: not timed)
        return 0.0
    times = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        times.append(time.thread_time() - t0)
    return min(times) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agent", default="claude-code")
    ap.add_argument("--min-kb", type=int, default=20)
    ap.add_argument("--tree", type=Path, help="another tree's sessionpin (before/after)")
    ap.add_argument("--renames", action="store_true", help="facts read for a config with a model map")
    args = ap.parse_args()
    sys.path.insert(0, str((args.tree or ROOT).resolve()))
    from sessionpin.decision import rewrite
    from sessionpin.lineage import lineage
    from sessionpin.reader import facts as F, promptshape

    print(f"sessionpin from {Path(F.__file__).resolve().parents[2]}")
    print(f"{'request':44} {'KB':>4} {'facts':>7} {'rename':>7} {'root':>7} {'shape':>7}  µs")
    totals = [0.0] * 4
    for p in sorted((ROOT / "tests/fixtures/traffic" / args.agent).glob("*.json")):
        rec = json.loads(p.read_text())
        body = rec.get("body")
        if body is None:
            continue
        raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        if len(raw) < args.min_kb * 1024:
            continue
        headers = rec["headers"].items() if isinstance(rec["headers"], dict) else rec["headers"]
        hdrs = [(k.encode(), v.encode()) for k, v in headers]
        kw = {"locate_model": True} if args.renames else {}
        try:
            f = F.read(rec.get("method", "POST"), rec["url"], hdrs, raw, None, **kw)
        except TypeError:       # a tree before ``locate_model``
            kw = {}
            f = F.read(rec.get("method", "POST"), rec["url"], hdrs, raw, None)
        api = f.api
        seen: dict = {}
        promptshape.shape(raw, api, "", seen)
        got = [best(lambda: F.read(rec.get("method", "POST"), rec["url"], hdrs, raw, None, **kw)),
               best(lambda: rewrite.replace_model(raw, f.model, "glm-4.6", f.model_span)),
               best(lambda: lineage.chain(raw, api, turns=1)),
               best(lambda: promptshape.shape(raw, api, "", seen))]
        totals = [a + b for a, b in zip(totals, got)]
        print(f"{p.stem[:44]:44} {len(raw) // 1024:4d} " + " ".join(f"{x:7.0f}" for x in got))
    print(f"{'sum':44} {'':4} " + " ".join(f"{x:7.0f}" for x in totals))


if __name__ == "__main__":
    main()
