"""Benchmark the lineage reader against the request reader on the same bodies, in one run.

usage: python scripts/bench_lineage.py [--repeat N] [--sizes 10k,1m,8m]

For each size, the Claude-Code-shaped body of scripts/bench_classify.py (a long conversation of
thinking blocks, tool calls and file-like tool results), best of N:
- ``facts.read`` (the baseline: what the router already pays per request);
- ``lineage.chain(turns=1)``: the root key (first exchange), what a router looks up;
- ``lineage.chain()``: the whole chain (one pass over the history);
- ``lineage.signals()`` with the body (explicit links);
- the opening shape: one user message holding the whole body (``chain`` reads it to its end).
and a streamed answer of ~the same size through ``StreamReader`` in 16 KiB chunks, against a
plain ``bytes.find`` walk over the same chunks (the least any reader of the stream must do).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_classify import HEADERS, SIZES, URL, best, claude_code_body, file_text  # noqa: E402

from sessionpin.reader import facts  # noqa: E402
from sessionpin.lineage import lineage  # noqa: E402
from sessionpin.lineage.lineage_stream import StreamReader  # noqa: E402

API = facts.ANTHROPIC_MESSAGES


def sse_answer(size: int) -> bytes:
    """An Anthropic stream of about ``size`` bytes: a thinking signature, text deltas, a tool call."""
    rng = random.Random(3)
    out = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_bench","content":[]}}\n\n',
           b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n',
           b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"' + b"s" * 400 + b'"}}\n\n',
           b'event: content_block_start\ndata: {"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}\n\n']
    n = sum(map(len, out))
    while n < size:
        piece = json.dumps({"type": "content_block_delta", "index": 1,
                            "delta": {"type": "text_delta", "text": file_text(rng, 40)}})
        ev = f"event: content_block_delta\ndata: {piece}\n\n".encode()
        out.append(ev)
        n += len(ev)
    out.append(b'event: content_block_start\ndata: {"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_bench","name":"Bash","input":{}}}\n\n')
    out.append(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    return b"".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=0, help="timings per measurement (default: by size)")
    ap.add_argument("--sizes", default="10k,1m,8m")
    args = ap.parse_args(argv)
    print(f"python {sys.version.split()[0]}; best of N, ms; ratio = x / facts.read of the same body")
    print(f"{'size':>5} {'bytes':>9} {'facts.read':>10} {'root key':>16} {'whole chain':>17} {'signals':>16} "
          f"{'opening chain':>18}")
    for name in args.sizes.split(","):
        body = json.loads(claude_code_body(SIZES[name]))
        # as Claude Code sends it: the previous message's id after the messages, the system
        # prompt's first block the billing line with the previous request's id
        body["diagnostics"] = {"previous_message_id": "msg_01bench"}
        body["system"][0]["text"] += " cc_prev_req=req_01bench;"
        data = json.dumps(body).encode()
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": file_text(random.Random(2), SIZES[name])}]}]
        opening = json.dumps(body).encode()
        repeat = args.repeat or {"10k": 2000, "1m": 30, "8m": 6}[name]
        assert lineage.chain(data, API, turns=1).keys and lineage.chain(opening, API).head
        assert lineage.signals(HEADERS, data, api=API).anchors == ("req:req_01bench", "msg:msg_01bench")
        base = best(lambda: facts.read("POST", URL, HEADERS, data), repeat)
        root = best(lambda: lineage.chain(data, API, turns=1), repeat)
        whole = best(lambda: lineage.chain(data, API), repeat)
        sig = best(lambda: lineage.signals(HEADERS, data, api=API), repeat)
        base_open = best(lambda: facts.read("POST", URL, HEADERS, opening), repeat)
        open_chain = best(lambda: lineage.chain(opening, API, turns=1), repeat)
        print(f"{name:>5} {len(data):>9} {base * 1e3:>10.3f} {root * 1e3:>8.3f} ({root / base:>5.2f}) "
              f"{whole * 1e3:>8.3f} ({whole / base:>6.1f}) {sig * 1e3:>8.3f} ({sig / base:>5.1f}) "
              f"{open_chain * 1e3:>8.3f} ({open_chain / base_open:>5.2f})")
    print()
    print(f"{'answer':>7} {'bytes':>9} {'find walk':>10} {'StreamReader':>20}")
    for name in args.sizes.split(","):
        stream = sse_answer(SIZES[name])
        chunks = [stream[i:i + 16384] for i in range(0, len(stream), 16384)]
        repeat = args.repeat or {"10k": 2000, "1m": 30, "8m": 6}[name]

        def walk():
            for c in chunks:
                i = c.find(b"\n")
                while i != -1:
                    i = c.find(b"\n", i + 1)

        def read():
            r = StreamReader(API)
            for c in chunks:
                r(c)
            r(b"")
            return r.result()

        assert read().complete and read().tool_ids == ("toolu_bench",)
        base = best(walk, repeat)
        ours = best(read, repeat)
        print(f"{name:>7} {len(stream):>9} {base * 1e3:>10.3f} {ours * 1e3:>10.3f} ({ours / base:>5.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
