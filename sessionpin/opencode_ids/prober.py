"""Probes: one 1-token request to the gateway with a candidate id (seeds/002 §2).

The only network code of the pool, on httpx (async, proxies, TLS, timeouts): one client
and one connection per probe, ``Connection: close``, so a probe's wall clock includes
what a new conversation's first request pays.

Rules it keeps:
- a probe is an ordinary 1-token completion (prompt ``OK``) to the same endpoint kind the
  clients use, with the client's own credentials for that gateway and provider, sent only
  to that gateway's origin;
- it goes out the way mitmproxy's upstream connections go (``upstream.Upstream``: its
  upstream proxy and auth, its certificate settings); the environment's proxy variables
  are ignored, as mitmproxy ignores them;
- the timeout given is a hard ceiling (``asyncio.timeout`` around httpx's own): a 40 s
  shard cannot blow a budget; a timeout or a connection error is a result, never an
  exception; at most ``MAX_BODY`` bytes of an answer are read;
- credentials live in memory only and never appear in a repr, a log line or the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from dataclasses import dataclass, field

import httpx

from .signals import ProbeResult, classify
from .upstream import Upstream, ssl_context as upstream_ssl_context

MAX_BODY = 256 * 1024
USER_AGENT = "sessionpin-pool"
# Headers copied from a client's request into its probes: credentials and API versioning.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")
COPIED_HEADERS = CREDENTIAL_HEADERS + ("anthropic-version",)

# httpx logs every request at INFO, which mitmproxy shows as a line per probe; the pool
# logs its own summary. Quiet unless someone configured that logger on purpose.
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass(frozen=True)
class ProbeTarget:
    origin: str                       # https://opencode.ai
    path: str                         # /zen/go/v1/chat/completions
    kind: str                         # chat/completions | messages | responses
    model: str
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # secret: memory only


def body_for(kind: str, model: str) -> bytes:
    if kind == "messages":
        doc: dict = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "OK"}]}
    elif kind == "responses":
        # The Responses API refuses max_output_tokens below 16; still one short answer.
        doc = {"model": model, "max_output_tokens": 16, "input": "OK", "store": False}
    else:
        doc = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "OK"}],
               "stream": False}
    return json.dumps(doc, separators=(",", ":")).encode()


def ssl_context(ca_file: str = "") -> ssl.SSLContext:
    """Direct probes' verification: mitmproxy's default (certifi) plus ``ca_file``."""
    return upstream_ssl_context(Upstream(extra_ca=ca_file))


def headers_for(target: ProbeTarget, sid: str) -> list[tuple[str, str]]:
    headers = [("user-agent", USER_AGENT), ("content-type", "application/json"), ("accept", "application/json"),
               ("connection", "close"), ("x-opencode-session", sid)]
    headers += [(n, v) for n, v in target.headers if "\r" not in v and "\n" not in v]
    if target.kind == "messages" and "anthropic-version" not in {n for n, _ in target.headers}:
        headers.append(("anthropic-version", "2023-06-01"))
    return headers


def client(via: Upstream, ssl_ctx: ssl.SSLContext, timeout_s: float) -> httpx.AsyncClient:
    proxy = None
    if via.proxy:   # TLS to the proxy itself only for an https:// proxy (httpx refuses a context otherwise)
        tls = ssl_ctx if via.proxy.startswith("https:") else None
        proxy = httpx.Proxy(via.proxy, auth=via.proxy_auth, ssl_context=tls)
    return httpx.AsyncClient(verify=ssl_ctx, proxy=proxy, trust_env=False, timeout=timeout_s,
                             follow_redirects=False)


async def _read_capped(resp: httpx.Response) -> bytes:
    body = b""
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) >= MAX_BODY:
            break
    return body[:MAX_BODY]


def _body_id(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc.get("id") if isinstance(doc, dict) and isinstance(doc.get("id"), str) else None


async def probe(target: ProbeTarget, sid: str, timeout_ms: int, *, max_upstream_ms: int,
                require_gateway_id: bool = False, ssl_ctx: ssl.SSLContext | None = None,
                via: Upstream | None = None) -> ProbeResult:
    """Send one probe with ``x-opencode-session: sid``; never raises (except cancellation).

    ``via`` is how mitmproxy's upstream connections go (default: directly); ``ssl_ctx``
    its verification, built once by the caller (default: built from ``via``)."""
    via = via or Upstream()
    ctx = ssl_ctx or upstream_ssl_context(via)
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            async with client(via, ctx, timeout_ms / 1000) as c:
                async with c.stream("POST", target.origin + target.path, headers=headers_for(target, sid),
                                    content=body_for(target.kind, target.model)) as resp:
                    status, headers = resp.status_code, resp.headers
                    body = await _read_capped(resp) if require_gateway_id else b""
    except (TimeoutError, httpx.TimeoutException):
        return ProbeResult("timeout", None, timeout_ms, "wall", detail=f"no answer in {timeout_ms} ms")
    except Exception as e:   # connection, TLS, proxy refusal (407), protocol: a result, never a raise
        return ProbeResult("failed", None, None, "", detail=type(e).__name__)
    wall = (time.monotonic() - started) * 1000
    return classify(status, headers.get("server-timing"), wall, max_upstream_ms=max_upstream_ms,
                    retry_after_ms_value=headers.get("retry-after-ms"), retry_after=headers.get("retry-after"),
                    body_id=_body_id(body) if require_gateway_id else None,
                    require_gateway_id=require_gateway_id, now_epoch_s=time.time())
