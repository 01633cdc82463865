"""How probes reach the gateway: the way mitmproxy's own upstream connections go.

A probe must fail where the agent's request would fail and work where it works, so it
follows mitmproxy's options, passed in as plain values (this module does not import
mitmproxy; ``participant.PoolOptions`` reads them from the shell's options):

- ``mode``: an ``upstream:[SCHEME://]HOST[:PORT][@LISTEN]`` mode names the proxy that
  mitmproxy sends its upstream connections to; probes go through it as well (CONNECT for
  an https gateway, absolute-form for an http one; TLS to the proxy for ``https://``).
  Without one, probes connect to the gateway directly. With several upstream modes the
  first is followed (the start line names the ones that are not).
- ``upstream_auth`` (``user:password``): sent to the upstream proxy as
  ``Proxy-Authorization: Basic``, as mitmproxy sends it.
- ``ssl_verify_upstream_trusted_ca`` (a PEM file) and ``ssl_verify_upstream_trusted_confdir``
  (a directory of hashed certificates) verify the gateway and an https proxy *instead of*
  certifi's bundle, as in mitmproxy; ``ssl_insecure`` turns verification off.
- ``sessionpin_pool_ca_file`` adds one more trusted CA on top (kept from before).
- The environment's ``HTTPS_PROXY`` and friends are ignored, as mitmproxy ignores them.

``describe`` is the one log line that says at start how probes go out.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field
from typing import Any, Mapping

# mitmproxy's option names, read from the values the shell passes (never registered here).
UPSTREAM_OPTIONS = ("mode", "upstream_auth", "ssl_insecure", "ssl_verify_upstream_trusted_ca",
                    "ssl_verify_upstream_trusted_confdir")

# mitmproxy.net.server_spec's grammar: [scheme://]host[:port][/]
_SPEC = re.compile(r"^(?:(?P<scheme>\w+)://)?(?P<host>[^:/]+|\[.+\])(?::(?P<port>\d+))?/?$")


@dataclass(frozen=True)
class Upstream:
    proxy: str | None = None                          # http(s)://host:port; None: direct
    auth: str | None = field(default=None, repr=False)  # user:password (a secret)
    trusted_ca: str | None = None
    trusted_confdir: str | None = None
    insecure: bool = False
    extra_ca: str = ""
    ignored: tuple[str, ...] = ()                     # further upstream modes, not followed

    @property
    def proxy_auth(self) -> tuple[str, str] | None:
        if not self.auth:
            return None
        user, _, password = self.auth.partition(":")
        return user, password


def _proxy_url(spec: str) -> str | None:
    """The upstream proxy of one ``--mode`` spec, or None when it is not an upstream mode."""
    head, _, listen = spec.strip().rpartition("@")
    if not head:
        head = listen
    name, _, data = head.partition(":")
    if name.lower() != "upstream":
        return None
    m = _SPEC.match(data)
    scheme = (m.group("scheme") or "http").lower() if m else ""
    if not m or scheme not in ("http", "https"):
        raise ValueError(f"mode {spec!r}: not an http(s) upstream proxy")
    host = m.group("host")
    port = int(m.group("port") or (443 if scheme == "https" else 80))
    return f"{scheme}://{host}:{port}"


def parse(values: Mapping[str, Any], extra_ca: str = "") -> Upstream:
    """mitmproxy's option values -> Upstream (missing options: mitmproxy's defaults)."""
    modes = values.get("mode") or ()
    if isinstance(modes, str):
        modes = (modes,)
    proxies = [p for p in (_proxy_url(str(s)) for s in modes) if p]
    auth = values.get("upstream_auth") or None
    if auth is not None and ":" not in str(auth):
        raise ValueError("upstream_auth: not user:password")
    return Upstream(
        proxy=proxies[0] if proxies else None,
        auth=str(auth) if auth else None,
        trusted_ca=values.get("ssl_verify_upstream_trusted_ca") or None,
        trusted_confdir=values.get("ssl_verify_upstream_trusted_confdir") or None,
        insecure=bool(values.get("ssl_insecure", False)),
        extra_ca=extra_ca,
        ignored=tuple(dict.fromkeys(p for p in proxies[1:] if p != proxies[0])),
    )


def ssl_context(u: Upstream) -> ssl.SSLContext:
    """The verification mitmproxy applies to its upstream TLS, plus ``extra_ca``."""
    if u.trusted_ca or u.trusted_confdir:
        ctx = ssl.create_default_context(cafile=u.trusted_ca, capath=u.trusted_confdir)
    else:
        # mitmproxy's default trust store (certifi: a dependency of mitmproxy and of httpx)
        import certifi

        ctx = ssl.create_default_context(cafile=certifi.where())
    if u.extra_ca:
        ctx.load_verify_locations(u.extra_ca)
    if u.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def describe(u: Upstream) -> str:
    """How probes go out, in one line (no secret)."""
    if u.proxy:
        how = f"probes go through the upstream proxy {u.proxy} (mitmproxy's upstream mode"
        how += ", with upstream_auth)" if u.auth else ")"
    else:
        how = "probes connect to the gateway directly (no upstream: mode)"
    if u.insecure:
        trust = "without verifying certificates (ssl_insecure)"
    else:
        where = [x for x in (u.trusted_ca, u.trusted_confdir) if x] or ["certifi's CAs"]
        trust = "trusting " + " and ".join(where + ([u.extra_ca] if u.extra_ca else []))
    line = f"{how}, {trust}"
    if u.ignored:
        line += f"; other upstream proxies not used by probes: {', '.join(u.ignored)}"
    return line
