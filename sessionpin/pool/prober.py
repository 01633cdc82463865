"""Probes: one 1-token request to the gateway with a candidate id (seeds/002 §2).

The only network code of the pool: a tiny HTTP/1.1 client on ``asyncio.open_connection``
(stdlib, no new dependency), one connection per probe, ``Connection: close``.

Rules it keeps:
- a probe is an ordinary 1-token completion (prompt ``OK``) to the same endpoint kind the
  clients use, with the client's own credentials for that gateway and provider, sent only
  to that gateway's origin;
- TLS is verified against the system CAs, plus an optional extra CA file (tests);
- the timeout given is a hard ceiling (``asyncio.timeout``): a 40 s shard cannot blow a
  budget; a timeout or a connection error is a result, never an exception;
- credentials live in memory only and never appear in a repr, a log line or the store.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .signals import ProbeResult, classify

MAX_BODY = 256 * 1024
USER_AGENT = "sessionpin-pool"
# Headers copied from a client's request into its probes: credentials and API versioning.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")
COPIED_HEADERS = CREDENTIAL_HEADERS + ("anthropic-version",)


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
    ctx = ssl.create_default_context()
    if ca_file:
        ctx.load_verify_locations(ca_file)
    return ctx


def request_bytes(target: ProbeTarget, sid: str, host_header: str) -> bytes:
    body = body_for(target.kind, target.model)
    lines = [f"POST {target.path} HTTP/1.1", f"Host: {host_header}", f"User-Agent: {USER_AGENT}",
             "Content-Type: application/json", "Accept: application/json", f"Content-Length: {len(body)}",
             "Connection: close", f"x-opencode-session: {sid}"]
    names = {n for n, _ in target.headers}
    lines += [f"{n}: {v}" for n, v in target.headers if "\r" not in v and "\n" not in v]
    if target.kind == "messages" and "anthropic-version" not in names:
        lines.append("anthropic-version: 2023-06-01")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ValueError("not an HTTP response")
    status = int(parts[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        headers[name] = (headers[name] + ", " if name in headers else "") + value.strip()
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while len(body) < MAX_BODY:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            body += await reader.readexactly(size)
            await reader.readline()
    elif "content-length" in headers:
        body = await reader.readexactly(min(int(headers["content-length"]), MAX_BODY))
    else:
        body = await reader.read(MAX_BODY)
    return status, headers, body


def _body_id(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc.get("id") if isinstance(doc, dict) and isinstance(doc.get("id"), str) else None


async def probe(target: ProbeTarget, sid: str, timeout_ms: int, *, max_upstream_ms: int,
                require_gateway_id: bool = False, ssl_ctx: ssl.SSLContext | None = None) -> ProbeResult:
    """Send one probe with ``x-opencode-session: sid``; never raises (except cancellation)."""
    parts = urlsplit(target.origin)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.hostname or ""
    host_header = parts.netloc.rpartition("@")[2]
    started = time.monotonic()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=(ssl_ctx or ssl_context()) if tls else None,
                server_hostname=host if tls else None)
            writer.write(request_bytes(target, sid, host_header))
            await writer.drain()
            status, headers, body = await _read_response(reader)
    except TimeoutError:
        return ProbeResult("timeout", None, timeout_ms, "wall", detail=f"no answer in {timeout_ms} ms")
    except (OSError, ValueError, asyncio.IncompleteReadError, ssl.SSLError) as e:
        return ProbeResult("failed", None, None, "", detail=type(e).__name__)
    finally:
        if writer is not None:
            writer.close()
    wall = (time.monotonic() - started) * 1000
    return classify(status, headers.get("server-timing"), wall, max_upstream_ms=max_upstream_ms,
                    retry_after_ms_value=headers.get("retry-after-ms"), retry_after=headers.get("retry-after"),
                    body_id=_body_id(body) if require_gateway_id else None,
                    require_gateway_id=require_gateway_id, now_epoch_s=time.time())
