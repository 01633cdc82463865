"""What the ledger adds per turn, against what the router already pays, in one run.

usage: python scripts/bench_ledger.py [--repeat N] [--sizes 10k,1m,8m]

For each size, the Claude-Code-shaped body of scripts/bench_classify.py, best of N (ms):
- ``facts.read`` (the baseline: what the router already pays per request, on its path);
- ``promptshape.shape`` (the ledger's read of the request, after its answer), cold, and as the
  proxy runs it: with the digests of the previous request's messages kept (``seen``);
- ``ledger.assess`` against the previous turn's shape, and the store writes it makes;
and a streamed answer of about the same size (scripts/bench_lineage.py's, with usage in
``message_start`` and ``message_delta``) in 16 KiB chunks: ``usage.UsageReader`` against the
lineage reader (``StreamReader``) and a plain ``bytes.find`` walk over the same chunks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_classify import HEADERS, SIZES, URL, best, claude_code_body  # noqa: E402
from bench_lineage import sse_answer  # noqa: E402

from sessionpin.reader import facts, promptshape  # noqa: E402
from sessionpin.accounting import ledger  # noqa: E402
from sessionpin.lineage.lineage_stream import StreamReader  # noqa: E402
from sessionpin.accounting.usage import Usage, UsageReader  # noqa: E402

API = facts.ANTHROPIC_MESSAGES
START = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_bench","content":[],'
         b'"usage":{"input_tokens":3,"cache_read_input_tokens":90000,"cache_creation_input_tokens":500,'
         b'"output_tokens":1}}}\n\n')
DELTA = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
         b'"usage":{"output_tokens":420}}\n\n')


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=0, help="timings per measurement (default: by size)")
    ap.add_argument("--sizes", default="10k,1m,8m")
    args = ap.parse_args(argv)
    print(f"python {sys.version.split()[0]}; best of N, ms; ratio = x / facts.read of the same body")
    print(f"{'size':>5} {'bytes':>9} {'facts.read':>10} {'shape':>16} {'shape, seen':>16} {'assess+writes':>16}")
    for name in args.sizes.split(","):
        data = claude_code_body(SIZES[name])
        repeat = args.repeat or {"10k": 2000, "1m": 30, "8m": 6}[name]
        prev_body = json.loads(data)
        prev_body["messages"] = prev_body["messages"][:-2]
        prev = promptshape.shape(json.dumps(prev_body).encode(), API)
        cur = promptshape.shape(data, API)
        assert prev is not None and cur is not None and promptshape.compare(prev, cur).share == 1.0
        turn = ledger.Turn(t=100.0, api=API, server="anthropic", model="m",
                           usage=Usage(input=90_503, output=420, cache_read=90_000, cache_write_5m=500))
        prior = ledger.prior_of(turn, prev, None)

        def assess():
            t = ledger.assess(turn, 99.0, cur, prior, prev)
            return ledger.writes("s", "claude-code", t, ledger.prior_of(t, cur, prior))
        base = best(lambda: facts.read("POST", URL, HEADERS, data), repeat)
        shape = best(lambda: promptshape.shape(data, API), repeat)
        seen: promptshape.Seen = {}
        promptshape.shape(json.dumps(prev_body).encode(), API, seen=seen)     # the previous turn

        def warm():
            kept = dict(seen)           # each timing meets the previous turn's digests only
            return promptshape.shape(data, API, seen=kept)
        assert warm() == cur
        kept_shape = best(warm, repeat) - best(lambda: dict(seen), repeat)
        judged = best(assess, repeat)
        print(f"{name:>5} {len(data):>9} {base * 1e3:>10.3f} {shape * 1e3:>8.3f} ({shape / base:>5.2f}) "
              f"{kept_shape * 1e3:>8.3f} ({kept_shape / base:>5.2f}) "
              f"{judged * 1e3:>8.3f} ({judged / base:>5.3f})")
    print()
    print(f"{'answer':>7} {'bytes':>9} {'find walk':>10} {'UsageReader':>20} {'StreamReader':>20}")
    for name in args.sizes.split(","):
        body = sse_answer(SIZES[name])
        stream = START + body.split(b"\n\n", 1)[1][:-len(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')] \
            + DELTA + b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
        chunks = [stream[i:i + 16384] for i in range(0, len(stream), 16384)]
        repeat = args.repeat or {"10k": 2000, "1m": 30, "8m": 6}[name]

        def walk():
            for c in chunks:
                i = c.find(b"\n")
                while i != -1:
                    i = c.find(b"\n", i + 1)

        def read(reader):
            r = reader(API)
            for c in chunks:
                r(c)
            r(b"")
            return r.result()

        assert read(UsageReader).usage == Usage(input=90_503, output=420, cache_read=90_000, cache_write_5m=500)
        base = best(walk, repeat)
        ours = best(lambda: read(UsageReader), repeat)
        theirs = best(lambda: read(StreamReader), repeat)
        print(f"{name:>7} {len(stream):>9} {base * 1e3:>10.3f} {ours * 1e3:>10.3f} ({ours / base:>5.2f}x) "
              f"{theirs * 1e3:>10.3f} ({theirs / base:>5.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
