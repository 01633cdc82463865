"""What a gateway response says about the id it was sent with (seeds/002 §2, §7).

Pure functions over status codes and header values; nothing here raises on bad input.

Rules this module keeps:
- ``upstream;dur`` of ``server-timing`` is the whole story; when a proxy stripped the
  header the caller's wall-clock time stands in (``measure``).
- ``retry-after-ms`` wins over ``Retry-After`` (seconds or an HTTP date); a 429 without
  either backs off for ``DEFAULT_BACKOFF_MS``.
- A probe is *fast* when it answered 2xx within ``max_upstream_ms`` (and, only when asked
  for, its body id starts with ``gw-``). 401/403 are *unauthorized*, 400 *rejected* (both
  stop probing the target), 429 *overloaded* (back off), anything else *slow* or *failed*.
"""

from __future__ import annotations

import email.utils
import re
from dataclasses import dataclass
from typing import Literal

DEFAULT_BACKOFF_MS = 5_000
MAX_BACKOFF_MS = 3_600_000

_UPSTREAM = re.compile(r"(?:^|,)\s*upstream\s*;[^,]*?\bdur\s*=\s*\"?([0-9]+(?:\.[0-9]+)?)", re.I)

Kind = Literal["fast", "slow", "unauthorized", "rejected", "overloaded", "timeout", "failed"]
STOPS_PROBING: frozenset[str] = frozenset({"unauthorized", "rejected"})


def upstream_ms(server_timing: str | None) -> int | None:
    """``gateway;dur=10, upstream;dur=1447, total;dur=1498`` -> 1447."""
    if not server_timing:
        return None
    m = _UPSTREAM.search(server_timing)
    if not m:
        return None
    try:
        return round(float(m.group(1)))
    except ValueError:
        return None


def measure(server_timing: str | None, wall_ms: int | float) -> tuple[int, str]:
    """(milliseconds, source): upstream;dur when present, else the wall clock."""
    up = upstream_ms(server_timing)
    if up is not None:
        return up, "upstream"
    return max(0, round(wall_ms)), "wall"


def retry_after_ms(retry_after_ms_value: str | None, retry_after: str | None, now_epoch_s: float = 0.0) -> int:
    """How long a 429 asks us to stay away, in ms (bounded to an hour)."""
    for text, scale in ((retry_after_ms_value, 1.0), (retry_after, 1000.0)):
        if not text:
            continue
        text = text.strip()
        try:
            value = float(text) * scale
        except ValueError:
            if scale == 1.0:
                continue
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                continue
            if when is None:
                continue
            value = (when.timestamp() - now_epoch_s) * 1000.0
        if value != value:  # NaN
            continue
        return int(min(MAX_BACKOFF_MS, max(0.0, value)))
    return DEFAULT_BACKOFF_MS


@dataclass(frozen=True)
class ProbeResult:
    kind: Kind
    status: int | None = None
    ms: int | None = None            # upstream;dur, or wall clock (see source)
    source: str = ""                 # "upstream" | "wall" | ""
    retry_after_ms: int = 0          # for "overloaded"
    detail: str = ""                 # a short reason; never response content

    @property
    def fast(self) -> bool:
        return self.kind == "fast"


def classify(status: int, server_timing: str | None, wall_ms: float, *, max_upstream_ms: int,
             retry_after_ms_value: str | None = None, retry_after: str | None = None,
             body_id: str | None = None, require_gateway_id: bool = False,
             now_epoch_s: float = 0.0) -> ProbeResult:
    """A probe's response -> ProbeResult."""
    ms, source = measure(server_timing, wall_ms)
    if status in (401, 403):
        return ProbeResult("unauthorized", status, ms, source, detail=f"HTTP {status}")
    if status == 400:
        return ProbeResult("rejected", status, ms, source, detail="HTTP 400")
    if status == 429:
        back = retry_after_ms(retry_after_ms_value, retry_after, now_epoch_s)
        return ProbeResult("overloaded", status, ms, source, retry_after_ms=back, detail="HTTP 429")
    if not 200 <= status < 300:
        return ProbeResult("failed", status, ms, source, detail=f"HTTP {status}")
    if ms > max_upstream_ms:
        return ProbeResult("slow", status, ms, source, detail=f"{source} {ms} ms > {max_upstream_ms} ms")
    if require_gateway_id and not (body_id or "").startswith("gw-"):
        return ProbeResult("slow", status, ms, source, detail="response id is not gw-*")
    return ProbeResult("fast", status, ms, source)


# ---- observation of real responses (seeds/002 §7) -------------------------------------

Verdict = Literal["healthy", "strike", "retire"]


def judge(status: int, up_ms: int | None, failures: int, *, degrade_ms: int, quarantine_ms: int,
          quarantine_failures: int) -> tuple[Verdict, str]:
    """A real response on a bound id -> (healthy | strike | retire, reason)."""
    if status == 429:
        return "retire", "429"
    if up_ms is None:
        return "healthy", "no upstream timing"  # nothing to judge; only lastSeenAt moves
    if up_ms >= quarantine_ms:
        return "retire", "quarantine"
    if up_ms >= degrade_ms:
        if failures + 1 >= quarantine_failures:
            return "retire", "strikes"
        return "strike", "degraded"
    return "healthy", "ok"
