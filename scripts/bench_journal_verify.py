"""What one look of the store's journal verification costs (journal.Verifier, docs/store.md
"The decision journal", "While the store runs").

usage: python scripts/bench_journal_verify.py [--pins 100000] [--repeat 5]

Builds, in a temp directory, the journal a store of N pins has after a compaction: a header,
one snapshot line per pin (a real ``pins.encode`` text, 30-day expiry) and the agent's index
set, then times, in thread CPU time (best and median of --repeat):
- the first look at a file (every line's checksum: at start, after a compaction or rebuild);
- a look after one append (the CRC-32 of the bytes already verified, then the new line);
- a look at an unchanged file (one fstat);
and, for comparison, ``journal.parse`` of the whole file (what opening the store reads).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessionpin import pins as P  # noqa: E402
from sessionpin.store.journal import VERIFY_SHARE, Verifier, encode, parse  # noqa: E402


def cpu(f, repeat: int) -> str:
    ts = []
    for _ in range(repeat):
        t = time.thread_time()
        f()
        ts.append(time.thread_time() - t)
    ts.sort()
    return f"best {ts[0] * 1000:.1f} ms, median {ts[len(ts) // 2] * 1000:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pins", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    pin = P.Pin(agent="claude-code", server="glm", since=1764500000.123, renewed=1764500000.123,
                rule="route:glm", turn="t-0123456789abcdef", source="header")
    text, n = P.encode(pin), a.pins
    sessions = [f"sess-{i:012d}-0123456789abcdef" for i in range(n)]
    lines = [encode({"sessionpin_journal": 1, "base": 5, "keys": n + 1, "at": 1.0})]
    lines += [encode(["put", P.key(s), "s", text, 1767000000.0]) for s in sessions]
    lines.append(encode(["put", P.index_key("claude-code", "glm"), "z", {s: 1767000000.0 for s in sessions}, None]))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.db.journal"
        path.write_bytes(b"".join(lines))
        print(f"journal of {n} pins: {path.stat().st_size / 1e6:.1f} MB")
        print("first look (every line's checksum):", cpu(lambda: Verifier(path).check(), a.repeat))
        v = Verifier(path)
        assert v.check() is None
        line = encode({"s": 10**9, "at": 1.0, "w": [["put", "pin:x", "s", text, None]]})

        def appended():
            with open(path, "ab") as f:
                f.write(line)
            assert v.check() is None
        print("a look after one append:", cpu(appended, a.repeat))
        past = time.time() - 10
        os.utime(path, (past, past))
        time.sleep(1.1)                      # a ctime over a second old: the file is settled
        v.check()
        print("a look at an unchanged file:", cpu(v.check, a.repeat))
        print(f"(the next look waits {1 / VERIFY_SHARE:g} x the last one's time)")
        print("for comparison, journal.parse of the whole file:",
              cpu(lambda: parse(path.read_bytes()), max(1, a.repeat // 2)))


if __name__ == "__main__":
    main()
