"""A loopback port for a server a test starts, and may restart on the same port.

A port from ``bind(port 0)`` comes from the kernel's ephemeral range, which every other
``bind(0)`` and every outgoing connection on the machine draws from too: a server killed and
restarted on it (mitmdump's reverse mode, redis-server after ``kill -9``) can find it taken in
between — a test run beside other tests failed so ("address already in use" at a restart,
every test of one module after it). Here the port is drawn below the ephemeral range, where
nothing is handed out but what is asked for by number.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"


def _below_ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = max(low, 11000)
    return 10000, low - 1


def free_port() -> int:
    """A port that was free a moment ago, outside the ephemeral range (see the module)."""
    lo, hi = _below_ephemeral()
    for _ in range(200):
        port = random.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:               # (a crowded range: any free port, as before)
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
