"""The pool's knobs: plain data the addon registers, and their parsing into ``PoolConfig``.

Rules this module keeps:
- Every knob of seeds/002 §11 is here with the seed's default; the seed leaves five
  defaults unstated (size, ttl, lease ttl, max bindings, probe spacing): ours are marked
  "sessionpin default" in their help text and in docs/opencode_ids.md.
- Times are integer milliseconds (mitmproxy options have no float).
- No mitmproxy import: ``OPTIONS`` is a tuple of (name, type, default, help) that the
  addon passes to ``loader.add_option`` in ``load``; ``parse`` turns the option values
  into a frozen ``PoolConfig`` and raises ``ValueError`` naming the bad option (the
  addon re-raises it as ``OptionsError``).
- The values may also carry mitmproxy's own upstream options (``upstream.UPSTREAM_OPTIONS``:
  mode, upstream_auth, the certificate settings); they become ``PoolConfig.upstream``, how
  probes go out. Absent ones take mitmproxy's defaults (direct, certifi's CAs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

from .upstream import Upstream, parse as parse_upstream

DEFAULT_GATEWAY = "https://opencode.ai"

# A probe is never started with less than this left: a healthy shard answers in 0.8-2.0 s,
# so a shorter timeout would throw a good id away (seeds/002 §5). A constant, not a knob.
MIN_PROBE_BUDGET_MS = 1_500
# A resumed binding's lastSeenAt is written at most this often by acquire (seeds/002 §6).
TOUCH_EVERY_MS = 30_000
# A healthy observation is persisted at most this often (seeds/002 §7).
OBSERVE_WRITE_EVERY_MS = 5_000
# Background probes have no caller budget: wait for the probe ceiling plus connection
# set-up, then call the id slow.
BACKGROUND_PROBE_SLACK_MS = 2_500


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    field: str  # the PoolConfig attribute it sets


def _o(name: str, typ: type, default: Any, help: str) -> Option:
    return Option("sessionpin_pool" + name, typ, default, help, (name.lstrip("_") or "enabled"))


OPTIONS: tuple[Option, ...] = (
    _o("", bool, True, "OpenCode session-id pool: route requests to OpenCode's gateway with verified, "
       "pooled x-opencode-session ids (an opportunistic cache since the gateway load-balances)."),
    _o("_gateways", str, DEFAULT_GATEWAY, "Comma-separated gateway origins whose /zen/v1/ and "
       "/zen/go/v1/ requests the pool routes (self-hosted gateways, tests)."),
    _o("_ca_file", str, "", "Extra PEM CA file trusted by probes, besides the CAs mitmproxy trusts "
       "upstream (ssl_verify_upstream_trusted_ca/confdir, else certifi's)."),
    _o("_size", int, 2, "Fresh spares kept per provider+model; not a concurrency cap "
       "(PI_OCPOOL_SIZE; sessionpin default)."),
    _o("_ttl_ms", int, 1_800_000, "A spare verified within this is fresh; older spares are "
       "re-verified in the background (PI_OCPOOL_TTL_MS; sessionpin default)."),
    _o("_lease_ttl_ms", int, 86_400_000, "A binding idle longer than this is retired "
       "(PI_OCPOOL_LEASE_TTL_MS; sessionpin default)."),
    _o("_max_bindings", int, 1_000, "Cap on the binding table; the oldest idle bindings are "
       "dropped first (PI_OCPOOL_MAX_BINDINGS; sessionpin default)."),
    _o("_max_upstream_ms", int, 2_500, "A probe is fast when server-timing upstream;dur (wall "
       "clock when absent) is at most this (PI_OCPOOL_MAX_UPSTREAM_MS)."),
    _o("_degrade_ms", int, 6_000, "A real response with upstream;dur at or above this is a strike "
       "against its id (PI_OCPOOL_DEGRADE_MS)."),
    _o("_quarantine_ms", int, 8_000, "A real response with upstream;dur at or above this retires "
       "its id at once (PI_OCPOOL_QUARANTINE_MS)."),
    _o("_quarantine_failures", int, 2, "Strikes that retire an id (PI_OCPOOL_QUARANTINE_FAILURES)."),
    _o("_min_probe_interval_ms", int, 1_000, "Minimum spacing between two probes to one target "
       "(PI_OCPOOL_MIN_PROBE_INTERVAL_MS; sessionpin default)."),
    _o("_probe_cooldown_ms", int, 60_000, "After a budgeted acquisition fails, the conversation "
       "gets no probe budget for this long (PI_OCPOOL_PROBE_COOLDOWN_MS)."),
    _o("_startup_budget_ms", int, 0, "Probe budget on a conversation's opening request when no "
       "fresh spare exists; 0 = never probe on the request path (PI_OCPOOL_STARTUP_BUDGET_MS)."),
    _o("_request_budget_ms", int, 0, "Probe budget on later requests when no fresh spare exists; "
       "0 = never probe on the request path (PI_OCPOOL_REQUEST_BUDGET_MS)."),
    _o("_refresh_interval_ms", int, 300_000, "Background refresh period: prune, re-verify stale "
       "spares, refill (PI_OCPOOL_REFRESH_INTERVAL_MS)."),
    _o("_refill_delay_ms", int, 15_000, "Delay of the first refresh after start and of the refill "
       "after a spare is taken (PI_OCPOOL_REFILL_DELAY_MS)."),
    _o("_require_gateway_id", bool, False, "Also require the probe's response id to start with "
       "gw- (a route signal only before 2026-11-11; diagnostics) (PI_OCPOOL_REQUIRE_GATEWAY_ID)."),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class PoolConfig:
    enabled: bool = True
    gateways: tuple[str, ...] = (DEFAULT_GATEWAY,)
    ca_file: str = ""
    size: int = 2
    ttl_ms: int = 1_800_000
    lease_ttl_ms: int = 86_400_000
    max_bindings: int = 1_000
    max_upstream_ms: int = 2_500
    degrade_ms: int = 6_000
    quarantine_ms: int = 8_000
    quarantine_failures: int = 2
    min_probe_interval_ms: int = 1_000
    probe_cooldown_ms: int = 60_000
    startup_budget_ms: int = 0
    request_budget_ms: int = 0
    refresh_interval_ms: int = 300_000
    refill_delay_ms: int = 15_000
    require_gateway_id: bool = False
    upstream: Upstream = Upstream()     # how probes go out: mitmproxy's upstream options

    @property
    def probes_per_cycle(self) -> int:
        return 2 * self.size

    @property
    def background_probe_timeout_ms(self) -> int:
        return max(MIN_PROBE_BUDGET_MS, self.max_upstream_ms) + BACKGROUND_PROBE_SLACK_MS


def normalize_origin(text: str) -> str:
    """``https://Host:443/`` -> ``https://host``; raises ValueError for anything but an origin."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) origin: {text!r}")
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"a gateway is an origin only (no credentials, path or query): {text!r}")
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + ("" if port == default else f":{port}")


def defaults() -> dict[str, Any]:
    return {o.name: o.default for o in OPTIONS}


def parse(values: Mapping[str, Any]) -> PoolConfig:
    """Option values (missing ones take their default) -> PoolConfig; ValueError names the option."""
    kw: dict[str, Any] = {}
    for opt in OPTIONS:
        value = values.get(opt.name, opt.default)
        if opt.type is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{opt.name} must be a non-negative integer, not {value!r}")
        elif opt.type is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{opt.name} must be true or false, not {value!r}")
        elif not isinstance(value, str):
            raise ValueError(f"{opt.name} must be a string, not {value!r}")
        kw[opt.field] = value
    try:
        gateways = tuple(dict.fromkeys(normalize_origin(g) for g in kw["gateways"].split(",") if g.strip()))
    except ValueError as e:
        raise ValueError(f"sessionpin_pool_gateways: {e}") from None
    kw["gateways"] = gateways
    try:
        kw["upstream"] = parse_upstream(values, extra_ca=kw["ca_file"])
    except ValueError as e:
        raise ValueError(f"sessionpin pool: {e}") from None
    for name in ("size", "quarantine_failures", "max_bindings"):
        if kw[name] < 1:
            raise ValueError(f"sessionpin_pool_{name} must be at least 1")
    if kw["refresh_interval_ms"] < 1_000:
        raise ValueError("sessionpin_pool_refresh_interval_ms must be at least 1000")
    if kw["quarantine_ms"] < kw["degrade_ms"]:
        raise ValueError("sessionpin_pool_quarantine_ms must not be below sessionpin_pool_degrade_ms")
    return PoolConfig(**kw)
