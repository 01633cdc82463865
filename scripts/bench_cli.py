#!/usr/bin/env python3
"""How fast ``sessionpin sessions`` answers on a store of any size: time to the first row,
total time, rows and peak RSS, per command line.

    .venv/bin/python scripts/bench_cli.py [--runs 1] [--timeout 600] [--tree DIR] STORE_URL [-- ARGS...]

Runs ``python -m sessionpin.cli --store STORE_URL sessions ARGS`` in a child process (the
default set of ARGS below when none are given) with a config naming the servers
``scripts/fill_pins.py`` pins to, reads its standard output as it comes, and prints per
command: the seconds to the first output line after the header (the first row; for
``--json`` the first object's first line), the seconds to the end, the lines read, and the
child's peak resident memory (``wait4``'s ``ru_maxrss``). Fill the store first with
``scripts/fill_pins.py``. ``--tree`` runs the sessionpin of another checkout (e.g. an earlier
commit unpacked with ``git archive REV | tar -x -C DIR``) with this Python.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """[servers.anthropic]
url = "https://api.anthropic.com"
[servers.glm]
url = "https://api.z.ai/api/anthropic"
[servers.gpu-a]
url = "https://gpu-a.invalid"
"""
DEFAULT = [["sessions"], ["sessions", "--json"], ["sessions", "--server", "glm"],
           ["sessions", "--agent", "codex", "--not-routed"]]


def measure(url: str, argv: list[str], config: Path, timeout: float, tree: Path) -> dict[str, float | int | str]:
    cmd = [sys.executable, "-m", "sessionpin.cli", "--store", url, "--config", str(config), *argv]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tree, env=env)
    first = None
    lines = 0
    assert p.stdout is not None
    deadline = t0 + timeout
    for line in p.stdout:
        lines += 1
        if first is None and lines == 2:          # the header (or "[") came first
            first = time.perf_counter() - t0
        if time.perf_counter() > deadline:
            p.kill()
            break
    _, status, usage = os.wait4(p.pid, 0)
    total = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace").strip() if p.stderr else ""
    p.returncode = os.waitstatus_to_exitcode(status)
    return {"cmd": " ".join(argv), "first": first if first is not None else float("nan"), "total": total,
            "lines": lines, "rss_mb": usage.ru_maxrss / 1024, "code": p.returncode, "stderr": err[-300:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", metavar="STORE_URL")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="kill a command still running after this")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose sessionpin runs (default: this one)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- and the sessions command's arguments")
    a = ap.parse_args()
    variants = [a.args[1:] if a.args[:1] == ["--"] else a.args] if a.args else DEFAULT
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-cli-") as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(CONFIG)
        print("| command | first row s | total s | lines | peak RSS MB | exit |")
        print("|---|---|---|---|---|---|")
        for argv in variants:
            for _ in range(a.runs):
                r = measure(a.url, argv, config, a.timeout, a.tree.resolve())
                print(f"| `{r['cmd']}` | {r['first']:.2f} | {r['total']:.1f} | {r['lines']} | {r['rss_mb']:.0f} | "
                      f"{r['code']} |", flush=True)
                if r["code"]:
                    print(f"  stderr: {r['stderr']}", file=sys.stderr)


if __name__ == "__main__":
    main()
