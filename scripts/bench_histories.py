#!/usr/bin/env python3
"""What a repeated history costs the facts read and the ledger's shape, turn after turn (issue 22).

    .venv/bin/python scripts/bench_histories.py
    PYTHONPATH=<another tree> .venv/bin/python scripts/bench_histories.py     # another tree's reader

A recorded pi chat request, a recorded Codex Responses request and a recorded Claude Code
continuation, their history (every item after the first) repeated until the body is about each
size: up to 250 KB a body the facts decode (``knownarrays``), 1 MB one they read in parts
(``largebody``: its tail searched from the end, ``searched``). Then a conversation's last 20-30
turns, each two items more than the one before, are read in order:
  facts   ``facts.read`` of each turn (what the router reads on every request)
  first   the first of those turns, read first (a conversation's first read in this process)
  shape   ``promptshape.shape`` of each turn with the ledger's event-loop memo (``Runs`` by
          session, ``Seen``): what ``LedgerWatch`` works out after each answer
µs a turn, best of five passes, each from nothing kept but what the pass itself read.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))          # after PYTHONPATH: another tree's sessionpin comes first

from sessionpin.reader import facts as F  # noqa: E402
from sessionpin.reader import knownarrays, knownvalues, promptshape  # noqa: E402
try:
    from sessionpin.reader import searched  # noqa: E402
except ImportError:         # another tree's reader, from before it (issue 22, sixteenth round)
    searched = None

TRAFFIC = ROOT / "tests" / "fixtures" / "traffic"
CASES = (("pi", "pi/lineage-chat-05-fork.json", F.OPENAI_CHAT, (100_000, 250_000, 1_000_000)),
         ("codex", "codex/exec-lineage-06-tool-result.json", F.OPENAI_RESPONSES, (80_000, 120_000, 1_000_000)),
         ("claude", "claude-code/interactive-06-continuation.json", F.ANTHROPIC_MESSAGES, (1_000_000,)))
PASSES = 5


def turns(fixture: dict, size: int) -> tuple[list[bytes], int]:
    """The conversation's last turns at about ``size`` bytes, two items apart, and its items."""
    body = fixture["body"]
    name = "input" if "input" in body else "messages"
    items = body[name]
    grown = dict(body)
    while len(json.dumps(grown)) < size:
        grown[name] = grown[name] + items[1:]
    n = len(grown[name])
    bodies = [json.dumps(dict(grown, **{name: grown[name][:k]}), separators=(",", ":")).encode()
              for k in range(max(2, n - 40 if n > 60 else n // 2), n + 1, 2)]
    return bodies, n


def forget() -> None:
    knownarrays._kept.clear()
    knownvalues._known.clear()
    if searched is not None:
        searched.forget()


def main() -> None:
    print(f"sessionpin from {Path(F.__file__).resolve().parent.parent.parent}")
    print(f"{'client':6} {'body':>8} {'items':>6} {'first':>8} {'facts':>8} {'shape':>8}   (µs a turn)")
    for client, path, api, sizes in CASES:
        fx = json.loads((TRAFFIC / path).read_text())
        for size in sizes:
            bodies, n = turns(fx, size)
            first = facts = shape = float("inf")
            for _ in range(PASSES):
                forget()
                t = time.perf_counter()
                F.read(fx["method"], fx["url"], fx["headers"], bodies[0])
                first = min(first, time.perf_counter() - t)
                t = time.perf_counter()
                for b in bodies[1:]:
                    got = F.read(fx["method"], fx["url"], fx["headers"], b)
                facts = min(facts, (time.perf_counter() - t) / (len(bodies) - 1))
                assert got.parsed, got.reason
                runs, seen = promptshape.Runs(limit=64, max_bytes=16 << 20), {}
                promptshape.shape(bodies[0], api, "", seen, runs=runs, key="s")
                t = time.perf_counter()
                for b in bodies[1:]:
                    promptshape.shape(b, api, "", seen, runs=runs, key="s")
                shape = min(shape, (time.perf_counter() - t) / (len(bodies) - 1))
            print(f"{client:6} {len(bodies[-1]):8d} {n:6d} {first * 1e6:8.0f} {facts * 1e6:8.1f} {shape * 1e6:8.1f}")


if __name__ == "__main__":
    main()
