#!/usr/bin/env python3
"""Where the router's CPU goes: py-spy on the router and on plain mitmdump under bench_proxy's
10 KB 8-client load, summarised by sessionpin function.

    .venv/bin/pip install py-spy        # a tool of this script's, not a dependency of sessionpin
    .venv/bin/python scripts/profile_router.py [--seconds 40] [--rate 250] [--out DIR]
    .venv/bin/python scripts/profile_router.py --summarise ROUTER.raw [PLAIN.raw]
    .venv/bin/python scripts/bench_parts.py --variants full --spy DIR && \
        .venv/bin/python scripts/profile_router.py --summarise DIR/full.raw DIR/plain.raw   # per request

Runs ``scripts/bench_proxy.py --only throughput`` (plain mitmdump and the router taking turns
under 4 and 8 keep-alive clients), attaches ``py-spy record --format raw`` to the router's and to
plain mitmdump's process for ``--seconds`` once both are up, and prints the bench's figures and
the summary. py-spy samples only the thread holding the GIL (``--gil``: CPU spent in Python;
SQLite and hashing release it, so their time shows in ``bench_parts.py``'s per-thread figures,
not here). The two proxies take turns, so "the same seconds" hold different numbers of requests:
profiles recorded by ``bench_parts.py --spy`` carry their request counts, and the summary is then
per request. For the router the summary gives the share of them spent inside sessionpin's own
code: by hook (the outermost sessionpin frame: ``Router.request``, ``LineageWatch.response``…)
and by function (the innermost sessionpin frame: where the time is spent, callees outside
sessionpin such as msgspec or mitmproxy's header API counted to the sessionpin function that
called them). Shares are of all the router's samples; multiply by the router's CPU per request
(bench_proxy's latency table prints it) for milliseconds per request.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def ours(path: str) -> bool:
    # py-spy names a file by its path under sys.path ("sessionpin/decision/rewrite.py")
    return path.startswith("sessionpin/") or "/sessionpin/" in path or path.endswith("addons/route.py")


def short_name(func: str, path: str) -> str:
    mod = ("sessionpin/" + path.split("sessionpin/", 1)[-1]).removesuffix(".py").replace("/", ".")
    return f"{mod}.{func}"


def load(raw: Path) -> list[tuple[list[tuple[str, str]], int]]:
    stacks = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for f in stack.split(";"):
            m = FRAME.match(f)
            frames.append((m["func"], m["file"]) if m else (f, ""))
        stacks.append((frames, int(count)))
    return stacks


def _requests(raw: Path) -> int | None:
    """The requests the proxy served while ``raw`` was recorded (``bench_parts.py --spy`` writes
    them beside it, ``NAME.requests``), or None."""
    try:
        return int(raw.with_suffix(".requests").read_text())
    except (OSError, ValueError):
        return None


def summarise(router: Path, plain: Path | None = None, top: int = 25, rate: int = 250) -> str:
    stacks = load(router)
    total = sum(n for _, n in stacks)
    lines = [f"router: {total} samples"]
    n_router = _requests(router)
    if n_router:
        lines[0] += f" over {n_router} requests: {1000 * total / rate / n_router:.2f} ms per request at {rate} Hz"
    if plain is not None and plain.exists():
        p = sum(n for _, n in load(plain))
        n_plain = _requests(plain)
        if n_router and n_plain:
            lines.append(f"plain mitmdump: {p} samples over {n_plain} requests: {1000 * p / rate / n_plain:.2f} ms "
                         f"per request (router / plain per request = {total * n_plain / max(p * n_router, 1):.2f})")
        else:
            lines.append(f"plain mitmdump: {p} samples over the same seconds (router / plain = {total / max(p, 1):.2f})")
    mine = 0
    by_hook: collections.Counter[str] = collections.Counter()
    by_func: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        ours_frames = [(f, p) for f, p in frames if ours(p)]
        if not ours_frames:
            continue
        mine += n
        # py-spy's raw stacks run from the outermost frame to the innermost
        by_hook[short_name(*ours_frames[0])] += n
        by_func[short_name(*ours_frames[-1])] += n
    lines.append(f"in sessionpin's own code: {mine} samples = {100 * mine / max(total, 1):.1f} % of the router's")
    lines.append("")
    lines.append("| hook (outermost sessionpin frame) | % of router CPU | % of sessionpin's |")
    lines.append("|---|---|---|")
    for name, n in by_hook.most_common(12):
        lines.append(f"| `{name}` | {100 * n / total:.1f} | {100 * n / max(mine, 1):.1f} |")
    inside: collections.Counter[str] = collections.Counter()
    request = 0
    for frames, n in stacks:
        names = [short_name(f, p) for f, p in frames if ours(p)]
        if "sessionpin.proxy.router.Router.request" in names:      # (called by the bundle's request hook)
            request += n
            for name in set(names):
                inside[name] += n
    lines.append("")
    lines.append(f"Inside `Router.request` ({request} samples = {100 * request / max(total, 1):.1f} % of the "
                 "router's), each sessionpin function with everything it calls:")
    lines.append("")
    lines.append("| function | % of `Router.request` | % of router CPU |")
    lines.append("|---|---|---|")
    for name, n in inside.most_common(top):
        lines.append(f"| `{name}` | {100 * n / max(request, 1):.1f} | {100 * n / total:.1f} |")
    lines.append("")
    lines.append("| function (innermost sessionpin frame, its callees included) | % of router CPU | % of sessionpin's |")
    lines.append("|---|---|---|")
    for name, n in by_func.most_common(top):
        lines.append(f"| `{name}` | {100 * n / total:.1f} | {100 * n / max(mine, 1):.1f} |")
    return "\n".join(lines)


def find(pattern: str, deadline: float) -> int:
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        if out:
            return int(out[0])
        time.sleep(0.3)
    raise SystemExit(f"no process matching {pattern!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=40)
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--out", type=Path, help="keep the raw profiles here (default: a temp dir, removed)")
    ap.add_argument("--summarise", nargs="+", type=Path, metavar="RAW", help="only summarise these raw profiles")
    args = ap.parse_args()
    if args.summarise:
        print(summarise(args.summarise[0], args.summarise[1] if len(args.summarise) > 1 else None, rate=args.rate))
        return
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="sessionpin-profile-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        bench = subprocess.Popen([sys.executable, "-u", str(ROOT / "scripts" / "bench_proxy.py"), "--only",
                                  "throughput"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        deadline = time.monotonic() + 120
        # this venv's mitmdump (other checkouts on this machine may run the same bench)
        mitmdump = re.escape(str(Path(sys.executable).parent / "mitmdump"))
        router = find(mitmdump + r" .*sessionpin-bench-[^/]*/router/confdir", deadline)
        plain = find(mitmdump + r" .*sessionpin-bench-[^/]*/plain/confdir", deadline)
        # past start-up and the routing check: the bench says it routes once both proxies are up
        # (a fixed wait was not enough on a loaded machine: the profile was of the imports)
        said = []
        for line in bench.stdout:        # type: ignore[union-attr]
            said.append(line)
            if "routes to the upstream" in line:
                break
        time.sleep(1)
        # --gil: only the thread holding the GIL is sampled. Without it py-spy also counts a thread
        # waiting on a queue, an Event or the GIL as busy: the store's idle threads came out as a
        # third of the router's CPU (issue 22; /proc's per-thread times, bench_parts.py, say ~12 %)
        spies = [subprocess.Popen([spy, "record", "-p", str(pid), "-r", str(args.rate), "-d", str(args.seconds),
                                   "--gil", "--format", "raw", "--nonblocking", "-o", str(out / f"{name}.raw")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, pid in (("router", router), ("plain", plain))]
        for s in spies:
            s.wait()
        text, _ = bench.communicate()
        print("".join(said) + text)
        print(summarise(out / "router.raw", out / "plain.raw"))
        if args.out is None:
            os.sync()


if __name__ == "__main__":
    main()
