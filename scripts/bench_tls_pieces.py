#!/usr/bin/env python3
"""What mitmproxy's TLS layer does with a large request body, in-process: whole, and in pieces.

    .venv/bin/python scripts/bench_tls_pieces.py [--mb 45] [--runs 5]

mitmproxy (proxy/layers/tls.py, ``TLSLayer.send_data``) hands a request body to pyOpenSSL in
one ``Connection.sendall`` into a memory BIO, then reads the BIO out 64 KiB at a time
(``tls_interact``), each piece a write to the socket's transport — all in one turn of the event
loop, after the body was assembled (``bytes(request_body_buf)``, proxy/layers/http/__init__.py).
This does the same with a pyOpenSSL client/server pair on memory BIOs (no socket, no mitmproxy):

- ``whole``: the body assembled, one ``sendall``, the BIO read out (what mitmproxy does);
- ``N KiB``: ``sendall`` of one piece, the BIO read out, the next piece — the total, and the
  longest piece (what a loop that yielded between pieces would be held for at most);
- the whole body's three parts apart, and the pieces with the BIO read out only at the end.

Issue 20 (docs/benchmarks.md). The machine is shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from OpenSSL import SSL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import TestCA  # noqa: E402


def pair(cert: Path) -> SSL.Connection:
    """A client connection, its handshake done with a server on memory BIOs."""
    sctx = SSL.Context(SSL.TLS_METHOD)
    sctx.use_certificate_chain_file(str(cert))
    sctx.use_privatekey_file(str(cert))
    s = SSL.Connection(sctx, None)
    s.set_accept_state()
    c = SSL.Connection(SSL.Context(SSL.TLS_METHOD), None)
    c.set_connect_state()
    for _ in range(10):
        for a, b in ((c, s), (s, c)):
            try:
                a.do_handshake()
            except SSL.WantReadError:
                pass
            try:
                while True:
                    b.bio_write(a.bio_read(65535))
            except SSL.WantReadError:
                pass
    return c


def drain(c: SSL.Connection) -> int:
    """Read the BIO out as mitmproxy's ``tls_interact`` does: 64 KiB a time."""
    n = 0
    try:
        while True:
            n += len(c.bio_read(65535))
    except SSL.WantReadError:
        return n


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.0f} (min {min(xs) * 1000:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=45.0, help="the body's size in MiB")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    one = b'{"role":"user","content":"x"},'
    body = one * (int(args.mb * 2**20) // len(one))
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-tls-") as tmp:
        cert = TestCA(Path(tmp) / "ca").issue("srv")
        print(f"{len(body) / 2**20:.0f} MiB, {args.runs} runs, median ms (min); load average "
              f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        print(f"{'piece':>9} | {'total':>14} | {'longest hold':>14}")
        for piece in (None, 4 << 20, 1 << 20, 256 << 10):
            total, longest = [], []
            for _ in range(args.runs):
                c = pair(cert)
                t0 = time.perf_counter()
                hold = 0.0
                if piece is None:
                    c.sendall(bytes(bytearray(body)))
                    drain(c)
                    hold = time.perf_counter() - t0
                else:
                    mv = memoryview(body)
                    for i in range(0, len(body), piece):
                        p0 = time.perf_counter()
                        c.sendall(mv[i:i + piece])
                        drain(c)
                        hold = max(hold, time.perf_counter() - p0)
                total.append(time.perf_counter() - t0)
                longest.append(hold)
            print(f"{'whole' if piece is None else f'{piece >> 10} KiB':>9} | {ms(total):>14} | {ms(longest):>14}")
        parts: dict[str, list[float]] = {"assembly": [], "sendall": [], "read out": []}
        late = []
        for _ in range(args.runs):
            c = pair(cert)
            t0 = time.perf_counter()
            joined = bytes(bytearray(body))
            t1 = time.perf_counter()
            c.sendall(joined)
            t2 = time.perf_counter()
            drain(c)
            t3 = time.perf_counter()
            parts["assembly"].append(t1 - t0)
            parts["sendall"].append(t2 - t1)
            parts["read out"].append(t3 - t2)
            c = pair(cert)
            mv = memoryview(body)
            t0 = time.perf_counter()
            for i in range(0, len(body), 1 << 20):
                c.sendall(mv[i:i + (1 << 20)])
            drain(c)
            late.append(time.perf_counter() - t0)
        print("whole, its parts: " + ", ".join(f"{k} {ms(v)}" for k, v in parts.items()))
        print(f"1 MiB pieces, the BIO read out only at the end: {ms(late)}")
        print(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
