"""Recorded client traffic (tests/fixtures/traffic), made ready to replay through a proxy.

``load(agent, scenario)`` gives one scenario's requests in their recorded order (the ``nn`` of
``<scenario>-<nn>-<kind>.json``, which is the order of scripts/record/scenarios.py).

``Replay(run)`` turns a recorded request into the bytes a test sends (``prepare``):
- the body: the recorded JSON value encoded with ``json.dumps(separators=(",", ":"),
  ensure_ascii=False)``. For every recorded body that has a ``Content-Length``, that encoding has
  exactly the recorded length (the recorder stored ``json.loads`` of the bytes, and Python keeps key
  order), so these are the bytes the client sent. A string body is sent as its UTF-8 bytes.
- headers: as recorded (order, case, duplicates), minus ``Host`` (the client sets the fake's);
  ``Content-Length`` stays in place with the length of the body sent.
- credentials: the fixtures' redacted values (``sk-ant-REDACTED``, ``sk-REDACTED``, ``REDACTED``)
  become a sentinel that names the origin the client addressed, so a test can check that no
  server ever received another origin's secret (``Replay.owner``: sentinel -> fake name).
- session ids: every value of a session header (Claude Code, opencode, Codex, pi) is replaced,
  in headers and body alike, by a fresh id of the same shape and length, the same one for the
  whole replay. One proxy and one pin store then serve every test of a module, and a scenario
  replayed "alone" (a resume without its opening) is not decided by a pin another test made.
- ``cwd``: pi sends no id on chat/completions and messages; the router keys those on a
  fingerprint of the system prompt and first message. The recorded working directory
  (``/tmp/rec/proj``) is replaced by one of the same length unique to the replay, as if the
  conversation ran in another project, so two replays never share a fingerprint by accident.
Nothing else is changed.
"""

from __future__ import annotations

import json
import random
import re
import string
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traffic"

# The origin each recorded request addressed -> the fake server standing in for it.
ORIGINS = {"api.anthropic.com": "anthropic", "opencode.ai": "opencode", "api.openai.com": "openai"}
ELSEWHERE = "elsewhere"   # any other host (model catalog, npm registry, telemetry): no configured server

# Headers that carry a session (or thread) id of one of the agents.
SESSION_HEADERS = ("x-claude-code-session-id", "x-opencode-session", "x-session-id", "x-session-affinity",
                   "x-parent-session-id", "session-id", "session_id", "thread-id")
RECORDED_CWD = "/tmp/rec/proj"
_REDACTED = re.compile(r"(?:sk-ant-|sk-)?REDACTED")
_FILE = re.compile(r"^(?P<scenario>.+)-(?P<nn>\d\d)-(?P<kind>[a-z-]+)\.json$")


@dataclass(frozen=True)
class Recorded:
    """One recorded request, as the fixture holds it."""

    agent: str
    scenario: str
    nn: int
    kind: str
    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: Any
    expect: dict[str, Any]
    body_encoding: str | None = None   # the client compressed the body (stored decoded): not replayed here
    http_version: str = "HTTP/1.1"     # as the client spoke it to the proxy

    @property
    def name(self) -> str:
        return f"{self.agent}/{self.scenario}-{self.nn:02d}-{self.kind}"

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.url).hostname or ""

    @property
    def path(self) -> str:
        u = urllib.parse.urlsplit(self.url)
        return (u.path or "/") + (f"?{u.query}" if u.query else "")

    @property
    def turn(self) -> str | None:
        return self.expect.get("turn")

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


def load(agent: str, scenario: str) -> list[Recorded]:
    """The requests of one recorded scenario, in recorded order."""
    out = []
    for path in (FIXTURES / agent).glob(f"{scenario}-*.json"):
        m = _FILE.match(path.name)
        if not m or m["scenario"] != scenario:
            continue
        d = json.loads(path.read_text())
        assert not d.get("body_base64"), f"{path.name}: binary body"
        out.append(Recorded(agent, scenario, int(m["nn"]), m["kind"], d["method"], d["url"],
                            tuple((k, v) for k, v in d["headers"]), d["body"], d["expect"], d.get("body_encoding"),
                            d.get("http_version") or "HTTP/1.1"))
    assert out, f"no fixtures for {agent}/{scenario}"
    return sorted(out, key=lambda r: r.nn)


def encode_body(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Prepared:
    """A request ready to send: to the fake named ``to`` (the origin the client addressed)."""

    rec: Recorded
    to: str
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def name(self) -> str:
        return self.rec.name

    @property
    def http2(self) -> bool:
        return self.rec.http_version == "HTTP/2.0"

    def with_body(self, body: bytes) -> Prepared:
        """The same request with another body (``Content-Length`` follows)."""
        headers = [(k, str(len(body)) if k.lower() == "content-length" else v) for k, v in self.headers]
        return Prepared(self.rec, self.to, self.method, self.path, headers, body)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


def _same_shape(value: str, rnd: random.Random) -> str:
    """A fresh id shaped like ``value``: hex stays hex, letters and digits stay alphanumeric,
    separators and a ``ses_``-style prefix stay."""
    prefix = ""
    if "_" in value[:5]:
        prefix, value = value[: value.index("_") + 1], value[value.index("_") + 1:]
    hexlike = all(c in string.hexdigits.lower() + "-:" for c in value)
    pool = "0123456789abcdef" if hexlike else string.ascii_letters + string.digits
    return prefix + "".join(rnd.choice(pool) if c.isalnum() else c for c in value)


@dataclass
class Replay:
    """Fresh ids and origin sentinels for one replay (see the module docstring)."""

    run: str
    rnd: random.Random = field(default_factory=random.Random)
    ids: dict[str, str] = field(default_factory=dict)
    cwd: str = ""

    def __post_init__(self) -> None:
        if not self.cwd:
            self.cwd = "/tmp/rec/" + "".join(self.rnd.choice(string.ascii_lowercase) for _ in range(4))

    @staticmethod
    def sentinel(fake: str, run: str) -> str:
        return f"CLIENT-KEY-OF-{fake}-SENTINEL-{run}"

    @classmethod
    def owner(cls, run: str) -> dict[str, str]:
        return {cls.sentinel(f, run): f for f in (*ORIGINS.values(), ELSEWHERE)}

    def fresh(self, recorded_id: str) -> str:
        """The id this replay uses for ``recorded_id`` (made on first use)."""
        if recorded_id not in self.ids:
            new = _same_shape(recorded_id, self.rnd)
            assert len(new) == len(recorded_id) and new != recorded_id
            self.ids[recorded_id] = new
        return self.ids[recorded_id]

    def alias(self, recorded_id: str, new_id: str) -> None:
        """Use ``new_id`` for ``recorded_id`` (e.g. to make two agents share one session id)."""
        self.ids[recorded_id] = new_id

    def _swap(self, text: str) -> str:
        for old, new in self.ids.items():
            text = text.replace(old, new)
        return text

    def prepare(self, rec: Recorded, *, drop: tuple[str, ...] = ()) -> Prepared:
        """The request to send for ``rec`` (``drop``: header names to leave out, lower case)."""
        assert rec.body_encoding is None, f"{rec.name}: a {rec.body_encoding} body is not replayed"
        for k, v in rec.headers:
            if k.lower() in SESSION_HEADERS and v:
                self.fresh(v)
        to = ORIGINS.get(rec.host, ELSEWHERE)
        secret = self.sentinel(to, self.run)
        body_text = encode_body(rec.body).decode()
        body = self._swap(body_text).replace(RECORDED_CWD, self.cwd).encode()
        headers: list[tuple[str, str]] = []
        for k, v in rec.headers:
            low = k.lower()
            if low == "host" or low in drop:
                continue
            if low == "content-length":
                v = str(len(body))
            v = _REDACTED.sub(lambda m: secret, self._swap(v))
            headers.append((k, v))
        return Prepared(rec, to, rec.method, rec.path, headers, body)


# --------------------------------------------------------------------------- HTTP/2 through the proxy


@dataclass
class H2Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def h2_request(proxy_port: int, mitm_ca: str | Path, host: str, port: int, method: str, path: str,
               headers: list[tuple[str, str]], body: bytes, timeout: float = 30.0) -> H2Reply:
    """One HTTP/2 request through the proxy's CONNECT tunnel (Codex speaks HTTP/2 to api.openai.com).

    ``headers`` as recorded (lower case; ``host`` and connection-specific headers are left out,
    HTTP/2 forbids them); ``:authority`` is ``host:port``."""
    import socket
    import ssl

    import h2.config
    import h2.connection
    import h2.events

    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=timeout)
    try:
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("proxy closed the CONNECT")
            head += chunk
        if not head.split(b"\r\n", 1)[0].split()[1] == b"200":
            raise ConnectionError(f"CONNECT refused: {head[:200]!r}")
        ctx = ssl.create_default_context(cafile=str(mitm_ca))
        ctx.set_alpn_protocols(["h2"])
        tls = ctx.wrap_socket(sock, server_hostname=host)
        if tls.selected_alpn_protocol() != "h2":
            raise ConnectionError(f"the proxy did not take h2 (ALPN {tls.selected_alpn_protocol()!r})")
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        tls.sendall(conn.data_to_send())
        sid = conn.get_next_available_stream_id()
        forbidden = {"host", "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
        hs = [(":method", method), (":scheme", "https"), (":authority", f"{host}:{port}"), (":path", path)]
        hs += [(k.lower(), v) for k, v in headers if k.lower() not in forbidden]
        conn.send_headers(sid, hs, end_stream=not body)
        tls.sendall(conn.data_to_send())

        status, resp_headers, data, ended, sent = 0, [], bytearray(), False, 0

        def pump() -> None:
            nonlocal status, resp_headers, ended
            chunk = tls.recv(65536)
            if not chunk:
                raise ConnectionError("the proxy closed the HTTP/2 connection")
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                    resp_headers = [(k if isinstance(k, str) else k.decode(), v if isinstance(v, str) else v.decode())
                                    for k, v in ev.headers]
                    status = int(dict(resp_headers)[":status"])
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    data.extend(ev.data)
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)) and ev.stream_id == sid:
                    ended = True
            out = conn.data_to_send()
            if out:
                tls.sendall(out)

        while sent < len(body):
            n = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size, len(body) - sent)
            if n <= 0:
                pump()   # wait for a WINDOW_UPDATE
                continue
            conn.send_data(sid, body[sent:sent + n], end_stream=sent + n == len(body))
            sent += n
            tls.sendall(conn.data_to_send())
        while not ended:
            pump()
        return H2Reply(status, [(k, v) for k, v in resp_headers if not k.startswith(":")], bytes(data))
    finally:
        sock.close()
