"""Benchmark the request reader against json.loads on Claude-Code-shaped bodies.

usage: python scripts/bench_classify.py [--repeat N] [--sizes 10k,1m,8m]

For each size, builds one Claude Code messages body (billing line, system blocks, 14 tools,
a long conversation of tool calls and tool results of file-like text), then in the same run
times ``json.loads(body)`` (the baseline) and ``sessionpin.reader.facts.read(...)`` on the same bytes,
best of N, and prints the ratio read/json.loads. Goal (issue 3): <= 0.15 at 1 MB and 8 MB.
Also times read() on the zstd-compressed body (what Codex sends) for information.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessionpin.reader import facts  # noqa: E402

try:
    from compression import zstd
except ImportError:
    from backports import zstd

SIZES = {"10k": 10_000, "1m": 1_000_000, "8m": 8_000_000}
HEADERS = [
    ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
    ("X-Claude-Code-Session-Id", "2f732b12-0d37-4b7f-a05c-01c6aa4e6937"),
    ("x-claude-code-request-class", "main"),
    ("content-type", "application/json"),
]
URL = "https://api.anthropic.com/v1/messages?beta=true"
WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "résumé", "→",
         "print(", '"quoted"', "\\path\\", "{x}", "0x1F", "\t")


def file_text(rng: random.Random, n: int) -> str:
    lines = []
    size = 0
    while size < n:
        line = "    " * rng.randint(0, 3) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def tool(name: str, words: int) -> dict:
    return {
        "name": name,
        "description": f"The {name} tool. " * words,
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "what to run"},
                           "timeout": {"type": "number"}},
            "required": ["command"],
        },
    }


def claude_code_body(target: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    small = target < 100_000  # a short conversation: smaller system prompt and tool docs
    body = {
        "model": "claude-opus-5-5",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>" + file_text(rng, 300 if small else 1500) + "</system-reminder>"},
            {"type": "text", "text": "fix the failing test", "cache_control": {"type": "ephemeral"}},
        ]}],
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.d5e; cc_entrypoint=cli; cch=1d757;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": file_text(rng, 600 if small else 3000), "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [tool(n, 1 if small else 20) for n in ("Bash", "Read", "Edit", "Write", "Glob", "Grep", "Agent", "TodoWrite",
                                    "WebFetch", "WebSearch", "NotebookEdit", "BashOutput", "KillShell", "Skill")
                  ][: 6 if small else 14],
        "metadata": {"user_id": json.dumps({"device_id": "b1" * 32, "account_uuid": "",
                                            "session_id": "2f732b12-0d37-4b7f-a05c-01c6aa4e6937"})},
        "max_tokens": 32000,
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "stream": True,
    }
    size = len(json.dumps(body))
    n = 0
    while size < target:
        n += 1
        call = {"role": "assistant", "content": [
            {"type": "thinking", "thinking": file_text(rng, 200), "signature": "sig" * 40},
            {"type": "text", "text": "Let me look at that file."},
            {"type": "tool_use", "id": f"toolu_{n:08d}", "name": "Read",
             "input": {"file_path": f"/src/module_{n}.py", "limit": 2000}},
        ]}
        result_size = min(max(200, (target - size) // 2), rng.randint(500, 6000))
        result = {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{n:08d}",
             "content": [{"type": "text", "text": file_text(rng, result_size)}]},
        ]}
        body["messages"] += [call, result]
        size += len(json.dumps(call)) + len(json.dumps(result)) + 2
    return json.dumps(body).encode()


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=0, help="timings per measurement (default: by size)")
    ap.add_argument("--sizes", default="10k,1m,8m")
    ap.add_argument("--whole", action="store_true",
                    help="always decode the whole body (msgspec, contents skipped): the path below FAST_MIN")
    args = ap.parse_args(argv)
    if args.whole:
        from sessionpin.reader import wire

        wire.FAST_MIN = 1 << 62
    print(f"python {sys.version.split()[0]}")
    print(f"{'size':>6} {'bytes':>10} {'json.loads':>11} {'read()':>10} {'ratio':>7} {'read(zstd)':>11}")
    for name in args.sizes.split(","):
        data = claude_code_body(SIZES[name])
        compressed = zstd.compress(data)
        f = facts.read("POST", URL, HEADERS, data)
        assert f.parsed and f.turn == facts.CONTINUATION, f
        repeat = args.repeat or {"10k": 2000, "1m": 30, "8m": 6}[name]
        base = best(lambda: json.loads(data), repeat)
        ours = best(lambda: facts.read("POST", URL, HEADERS, data), repeat)
        z = best(lambda: facts.read("POST", URL, HEADERS + [("content-encoding", "zstd")], compressed), repeat)
        print(f"{name:>6} {len(data):>10} {base * 1e3:>9.3f}ms {ours * 1e3:>8.3f}ms {ours / base:>7.3f} {z * 1e3:>9.3f}ms")
    # Harder shapes, for information: a key the reader looks for is absent (one scan of the
    # body to be sure), and an opening turn whose one user message is the whole body.
    data = claude_code_body(SIZES["8m"])
    body = json.loads(data)
    del body["stream"]
    no_stream = json.dumps(body).encode()
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": file_text(random.Random(2), 8_000_000)}]}]
    one_message = json.dumps(body).encode()
    for name, data in (("8m, no stream key", no_stream), ("8m, one user message", one_message)):
        repeat = args.repeat or 6
        base = best(lambda: json.loads(data), repeat)
        ours = best(lambda: facts.read("POST", URL, HEADERS, data), repeat)
        print(f"{name}: json.loads {base * 1e3:.3f}ms, read() {ours * 1e3:.3f}ms, ratio {ours / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
