"""A fake OpenCode gateway over TLS that behaves like the measurements of seeds/002.

- ``/zen/v1/<kind>`` and ``/zen/go/v1/<kind>`` (chat/completions, messages, responses);
  400 ``MissingSessionID`` without ``x-opencode-session``; 401 for a key not in ``keys``.
- Sticky mode (default): the id's hash picks a group — fast (``fast_ms``) or slow
  (``slow_ms``); ``slow_ids`` forces ids slow (an id that "turns slow").
  Load-balance mode (``balance=True``): fast or slow at random, whatever the id.
- ``server-timing: gateway;dur=…, upstream;dur=…, total;dur=…`` unless ``server_timing``
  is False; the real delay is ``upstream * delay_scale`` (0: answer at once, the header
  still says how slow), so tests are fast and can still exercise the wall clock.
- ``overload(n, retry_after_ms=…, retry_after=…)``: the next n requests get 429.
- Streams SSE for chat/completions when the body asks for ``stream``.
- Every request is recorded (path, session header, which credential header) — never the key.

Runs in its own thread and event loop, so sync tests, async tests and a mitmdump
subprocess can all talk to it.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import random
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
import ipaddress


def make_ca_and_cert(dirpath: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, cert.pem, key.pem): a throwaway CA and a server cert for localhost/127.0.0.1."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake gateway test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = dirpath / "ca.pem", dirpath / "cert.pem", dirpath / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def is_fast_id(sid: str) -> bool:
    """The sticky grouping: half of all ids hash to the fast workers."""
    return hashlib.sha256(sid.encode()).digest()[0] % 2 == 0


@dataclass
class Seen:
    path: str
    session: str | None
    credential: str | None       # which header carried a key: authorization | x-api-key | None
    status: int
    probe: bool                  # a 1-token probe (max_tokens 1 / max_output_tokens 16)
    headers: tuple[tuple[str, str], ...] = ()   # in order; credential values redacted


@dataclass
class FakeGateway:
    keys: set[str] = field(default_factory=lambda: {"good-key"})
    fast_ms: int = 900
    slow_ms: int = 20_000
    delay_scale: float = 0.0
    server_timing: bool = True
    balance: bool = False
    slow_ids: set[str] = field(default_factory=set)
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._overload: list[dict] = []
        self._lock = threading.Lock()
        self._rng = random.Random(7)

    # ---- control --------------------------------------------------------------------
    def overload(self, n: int, *, retry_after_ms: int | None = None, retry_after: str | None = None) -> None:
        with self._lock:
            self._overload += [{"ms": retry_after_ms, "s": retry_after}] * n

    def probes(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.probe]

    def requests(self) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if not s.probe]

    def upstream_for(self, sid: str) -> int:
        if self.balance:
            return self.fast_ms if self._rng.random() < 0.5 else self.slow_ms
        if sid in self.slow_ids or not is_fast_id(sid):
            return self.slow_ms
        return self.fast_ms

    # ---- lifecycle --------------------------------------------------------------------
    def start(self, tmpdir: Path, *, cert_and_key: Path | None = None, ca: Path | None = None) -> "FakeGateway":
        """Serve with a fresh CA of its own, or with a certificate+key PEM (e.g. the e2e TestCA's)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        if cert_and_key is not None:
            self.ca = ca
            ctx.load_cert_chain(cert_and_key)
        else:
            self.ca, cert, key = make_ca_and_cert(tmpdir)
            ctx.load_cert_chain(cert, key)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=ctx)
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()

        self._thread = threading.Thread(target=self._run, args=(main, started), daemon=True)
        self._thread.start()
        started.wait(10)
        self.origin = f"https://127.0.0.1:{self.port}"
        return self

    def _run(self, main, started) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(main())
        self._loop.run_forever()

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # ---- HTTP/1.1 -----------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                raw: list[tuple[str, str]] = []
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    n, _, v = h.decode("latin-1").partition(":")
                    headers[n.strip().lower()] = v.strip()
                    secret = n.strip().lower() in ("authorization", "x-api-key")
                    raw.append((n.strip(), "<redacted>" if secret else v.strip()))
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                close = await self._answer(method, path, headers, body, writer, tuple(raw))
                if close or headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, ssl.SSLError):
            return
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes, writer,
                      raw: tuple[tuple[str, str], ...] = ()) -> bool:
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            doc = {}
        probe = doc.get("max_tokens") == 1 or doc.get("max_output_tokens") == 16
        sid = headers.get("x-opencode-session")
        cred_header = "authorization" if "authorization" in headers else "x-api-key" if "x-api-key" in headers else None
        key = headers.get("authorization", "").removeprefix("Bearer ") or headers.get("x-api-key", "")

        def record(status: int) -> None:
            with self._lock:
                self.seen.append(Seen(path.split("?")[0], sid, cred_header, status, probe, raw))

        if key not in self.keys:
            record(401)
            return await self._send(writer, 401, {"error": {"type": "AuthError", "message": "bad key"}})
        if not sid:
            record(400)
            return await self._send(writer, 400, {"type": "error", "error": {"type": "MissingSessionID"}})
        with self._lock:
            over = self._overload.pop(0) if self._overload else None
        if over is not None:
            record(429)
            extra = {}
            if over["ms"] is not None:
                extra["retry-after-ms"] = str(over["ms"])
            if over["s"] is not None:
                extra["retry-after"] = over["s"]
            return await self._send(writer, 429, {"message": "Upstream request failed: [overloaded] the server "
                                                             "is overloaded; retry shortly"}, extra)
        up = self.upstream_for(sid)
        if self.delay_scale:
            await asyncio.sleep(up * self.delay_scale / 1000)
        record(200)
        extra = {"x-zen-model": str(doc.get("model", "")), "cf-placement": "remote-IAD"}
        if self.server_timing:
            extra["server-timing"] = f"gateway;dur=10, upstream;dur={up}, total;dur={up + 20}"
        rid = ("gw-3-17" if up <= self.fast_ms else "chatcmpl-x1")
        if doc.get("stream"):
            events = [{"id": rid, "choices": [{"index": 0, "delta": {"content": w}}]} for w in ("O", "K")]
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return await self._send_raw(writer, 200, data.encode(), "text/event-stream", extra)
        return await self._send(writer, 200, {"id": rid, "object": "chat.completion", "model": doc.get("model"),
                                              "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                    "content": "OK"}}]}, extra)

    async def _send(self, writer, status: int, doc: dict, extra: dict | None = None) -> bool:
        return await self._send_raw(writer, status, json.dumps(doc).encode(), "application/json", extra or {})

    async def _send_raw(self, writer, status: int, data: bytes, ctype: str, extra: dict) -> bool:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 429: "Too Many Requests"}.get(status, "X")
        head = [f"HTTP/1.1 {status} {reason}", f"content-type: {ctype}", f"content-length: {len(data)}"]
        head += [f"{k}: {v}" for k, v in extra.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
        await writer.drain()
        return False


# ---- fakes for the pool's unit tests: a clock and a scripted probe ------------------------

class FakeClock:
    """Epoch milliseconds that only move when a test (or a fake sleep/probe) moves them."""

    def __init__(self, now_ms: int = 1_794_000_000_000) -> None:
        self.now = now_ms
        self.slept: list[int] = []

    def now_ms(self) -> int:
        return self.now

    async def sleep_ms(self, ms: int) -> None:
        self.slept.append(ms)
        self.now += max(0, ms)
        await asyncio.sleep(0)


class ScriptedProbe:
    """A probe function whose results come from a script; each call moves the clock.

    ``script`` entries are ProbeResults (or callables id -> ProbeResult); a probe "takes"
    ``takes_ms`` of the fake clock, cut at its timeout like the real one."""

    def __init__(self, clock: FakeClock, script=(), *, takes_ms: int = 1_000, default=None) -> None:
        self.clock = clock
        self.script = list(script)
        self.takes_ms = takes_ms
        self.default = default
        self.calls: list[tuple[str, int, int]] = []   # (id, timeout_ms, started_at)

    async def __call__(self, sid: str, timeout_ms: int):
        from sessionpin.opencode_ids.signals import ProbeResult
        self.calls.append((sid, timeout_ms, self.clock.now))
        item = self.script.pop(0) if self.script else self.default
        result = item(sid) if callable(item) else item
        if result is None:
            result = ProbeResult("fast", 200, 900, "upstream")
        if self.takes_ms > timeout_ms:
            self.clock.now += timeout_ms
            return ProbeResult("timeout", None, timeout_ms, "wall")
        self.clock.now += self.takes_ms
        await asyncio.sleep(0)
        return result
