"""Codex's Responses WebSocket, end to end: real sockets through a real ``mitmdump -s addons/route.py``.

Codex 0.171.0 opens ``GET /v1/responses`` with ``Upgrade: websocket`` and sends every turn of a run
over that socket (docs/traffic.md, "Lineage"). The router decides the socket at its upgrade and the
socket is then opened to the chosen server (docs/router.md, "Codex's WebSocket"). Here the servers
are ``wsfake.WsFake``: TLS servers on loopback that accept the upgrade and speak the Responses
WebSocket (RFC 6455, permessage-deflate accepted as Codex offers it), so a WebSocket is really
established through the proxy, both ways.

What is replayed: the recorded upgrades of tests/fixtures/traffic/codex/websocket-0N (a new thread,
its ``codex exec resume`` — ``cold_resume`` — and its ``codex exec fork`` — ``cold_fork`` with
``forked_from_thread_id``), their headers as ``replay.Replay`` prepares them (fresh session ids,
origin-named sentinel keys), and the recorded client messages (``response.create``: a warm-up, then
one per turn), sent as ``json.dumps`` of the recorded value with the ids swapped alike; a
``previous_response_id`` is set to the id of the socket's previous ``response.completed``, as Codex
does (the fake answers ``previous_response_not_found`` to any other). The subagent's upgrade is
exec-subagent's recorded one (``x-openai-subagent``) with its session made the replayed thread's.
The server's events are the fake's, shaped as the recorded ones.

Servers: openai (the origin Codex addresses, no key), alt and beta (each its own key and model map).
Codex's current server: alt, unless a test says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from sessionpin.records import pins
from sessionpin.decision.headers import allowed as allowed_header
from sessionpin.reader.ids import short
from sessionpin.store import open_store

from .harness import LOOPBACK, Client, Mitmdump, TestCA, free_port, running_rig, toml_config
from .replay import FIXTURES, Prepared, Recorded, Replay, load
from .test_replay_e2e import is_credential
from .wsfake import HANDSHAKE, WsClient, WsFake, WsSocket, deflate_frame, fragmented

RUN = uuid.uuid4().hex[:8]
KEYS = {"alt": ("SESSIONPIN_WS_ALT_KEY", f"ALT-WS-KEY-SENTINEL-{RUN}"),
        "beta": ("SESSIONPIN_WS_BETA_KEY", f"BETA-WS-KEY-SENTINEL-{RUN}")}
MODELS = {"alt": {"gpt-6.2-*": "alt-codex-1"}, "beta": {"gpt-6.2-*": "beta-codex-2"}}
RECORDED_MODEL = "gpt-6.2-sol"
SUBAGENT_SESSION = "01a22a22-e3b3-7eb3-bd94-a6e2c5ad09da"     # exec-subagent's recorded session id
SECRETS = {**Replay.owner(RUN), **{key: name for name, (_, key) in KEYS.items()}}


# --------------------------------------------------------------------------- the rig


class WsRig:
    def __init__(self, tmp: Path, ca: TestCA, fakes: dict[str, WsFake]) -> None:
        self.fakes = fakes
        self.current: str | None = "alt"
        self.without: tuple[str, ...] = ()
        self.reverse_port = free_port()
        self.mitm = Mitmdump.router(tmp / "router", ca, self.config(),
                                    env={env: key for env, key in KEYS.values()},
                                    modes=["regular", f"reverse:{fakes['openai'].origin}@{self.reverse_port}"])
        self.store_path = tmp / "router" / "state.db"

    def config(self) -> str:
        servers: dict[str, dict[str, Any]] = {"openai": {"url": self.fakes["openai"].origin}}
        for name in ("alt", "beta"):
            servers[name] = {"url": self.fakes[name].origin, "key_env": KEYS[name][0], "models": MODELS[name]}
        return toml_config({k: v for k, v in servers.items() if k not in self.without}, {"codex": self.current})

    @property
    def port(self) -> int:
        [port] = set(self.mitm.ports) - {self.reverse_port}
        return port

    def set_current(self, server: str | None, without: tuple[str, ...] = ()) -> None:
        """Codex's current server (and servers left out of the config), once the proxy shows it."""
        self.current, self.without = server, without
        self.mitm.write_config(self.config())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                r = Client.via_proxy(self.port, self.mitm.mitm_ca, 10).request(
                    "GET", self.fakes["openai"].origin + "/__sessionpin/status")
                status = r.json() if r.status == 200 else {}
            except (OSError, ValueError):
                status = {}
            if status and status["agents"].get("codex") == server \
                    and set(status["servers"]) == {"openai", "alt", "beta"} - set(without):
                return
            time.sleep(0.05)
        raise AssertionError("the proxy did not take the config within 5 s")

    def open(self, p: Prepared, reverse: bool = False) -> tuple[WsClient, str | None, WsSocket | None]:
        """Open ``p``'s socket as Codex would (through the proxy to the origin it addresses, or to
        the reverse-mode port): the client, the fake it reached and what that fake received."""
        before = {n: len(f.sockets) for n, f in self.fakes.items()}
        if reverse:
            ws = WsClient.reverse(self.reverse_port, p.path, p.headers)
        else:
            ws = WsClient.via_proxy(self.port, self.mitm.mitm_ca, LOOPBACK, self.fakes[p.to].port, p.path, p.headers)
        landed = [(n, s) for n, f in self.fakes.items() for s in f.sockets[before[n]:]]
        assert len(landed) <= 1, f"{p.name}: one upgrade reached {[n for n, _ in landed]}"
        name, sock = landed[0] if landed else (None, None)
        return ws, name, sock

    def pin(self, session: str) -> pins.Pin | None:
        async def read() -> pins.Pin | None:
            store = open_store(f"file:{self.store_path}")
            try:
                return (await pins.load(store, session)).pin
            finally:
                await store.close()
        return asyncio.run(read())

    def assert_no_foreign_secrets(self) -> None:
        for name, fake in self.fakes.items():
            for s in fake.sockets:
                for secret, owner in SECRETS.items():
                    assert owner == name or secret.encode() not in s.raw(), f"{name} received a secret of {owner}"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WsRig]:
    with running_rig(tmp_path_factory.mktemp("e2e-websocket"),
                     lambda ca: {name: WsFake(name, ca) for name in ("openai", "alt", "beta")}, WsRig) as r:
        yield r


@pytest.fixture(autouse=True)
def _alive_and_clean(rig: WsRig) -> Iterator[None]:
    if not rig.mitm.alive:
        rig.mitm.start()
    rig.set_current("alt")
    yield
    rig.assert_no_foreign_secrets()


# --------------------------------------------------------------------------- recordings


def upgrade(nn: int) -> Recorded:
    """websocket-01 (a new thread), -02 (its resume), -03 (its fork)."""
    return next(r for r in load("codex", "websocket") if r.nn == nn)


def client_messages(nn: int) -> list[dict[str, Any]]:
    """The ``response.create`` messages Codex sent on that recorded socket, in order."""
    path = next((FIXTURES / "codex").glob(f"websocket-{nn:02d}-*.json"))
    return [m["content"] for m in json.loads(path.read_text())["websocket"] if m["from_client"]]


def subagent_upgrade(r: Replay, thread: Recorded) -> Prepared:
    """exec-subagent's recorded subagent socket, its session (and parent thread) made ``thread``'s."""
    rec = next(x for x in load("codex", "exec-subagent") if x.method == "GET" and x.header("x-openai-subagent"))
    r.alias(SUBAGENT_SESSION, r.fresh(thread.header("session-id")))
    return r.prepare(rec)


def session_of(r: Replay, rec: Recorded) -> str:
    return r.fresh(rec.header("session-id"))


def converse(ws: WsClient, r: Replay, messages: list[dict[str, Any]]) -> list[str]:
    """Send each message as Codex does (ids swapped; ``previous_response_id`` = the socket's last
    response); return the texts sent."""
    done = [json.loads(e) for e in ws.received if '"response.completed"' in e]
    sent, last = [], done[-1]["response"]["id"] if done else None
    for m in messages:
        if "previous_response_id" in m:
            m = {**m, "previous_response_id": last}
        text = r._swap(json.dumps(m, separators=(",", ":"), ensure_ascii=False))
        events = [json.loads(e) for e in ws.turn(text)]
        assert events[-1]["type"] == "response.completed", f"turn {len(sent) + 1}: {events[-1]}"
        last = events[-1]["response"]["id"]
        sent.append(text)
    return sent


# --------------------------------------------------------------------------- checks


def renamed(text: str, server: str | None) -> str:
    """``text`` with only its top-level model's bytes renamed for ``server`` (None: as sent)."""
    new = MODELS[server]["gpt-6.2-*"] if server in MODELS else RECORDED_MODEL
    old_b, new_b = f'"model":"{RECORDED_MODEL}"', f'"model":"{new}"'
    assert text.index(old_b) < text.index('"input"'), "the top-level model comes first"
    return text.replace(old_b, new_b, 1)


def assert_socket(p: Prepared, ws: WsClient, landed: str | None, sock: WsSocket | None, server: str,
                  sent: list[str] = ()) -> None:
    """``p``'s socket reached ``server``: its path, its headers (the allowed ones as sent; the
    server's key, or the agent's own at the origin it addressed), each message with only the top-
    level model renamed per the server's map, and every event the server sent back, unchanged."""
    assert ws.accepted, f"{p.name}: upgrade answered {ws.status}: {ws.reject_body[:300]!r}"
    assert landed == server and sock is not None, f"{p.name}: reached {landed}, expected {server}"
    assert sock.path == p.path
    assert ws.header("x-fake-server") == server
    assert ws.extensions == ["permessage-deflate"] and sock.offered, "compressed both ways, as Codex asks"
    creds = [(k, v) for k, v in sock.headers if is_credential(k) and k not in HANDSHAKE]
    if server in KEYS:
        assert creds == [("authorization", f"Bearer {KEYS[server][1]}")], f"{p.name}: credentials {creds}"
        keep = [(k.lower(), v) for k, v in p.headers if k.lower() not in HANDSHAKE and not is_credential(k)
                and allowed_header(k)]
    else:      # the origin it addressed: left alone, the agent's own key
        assert creds == [(k.lower(), v) for k, v in p.headers if is_credential(k) and k.lower() not in HANDSHAKE]
        keep = [(k.lower(), v) for k, v in p.headers if k.lower() not in HANDSHAKE and not is_credential(k)]
    seen = [(k, v) for k, v in sock.headers if k not in HANDSHAKE and not is_credential(k)]
    assert sorted(seen) == sorted(keep), f"{p.name}: headers changed beyond the credentials and the allowlist"
    assert sock.received == [renamed(t, server if server in KEYS else None) for t in sent], \
        f"{p.name}: messages changed beyond the top-level model"
    assert ws.received == sock.sent, f"{p.name}: the server's events did not reach the client unchanged"


# --------------------------------------------------------------------------- tests


def test_a_routed_codex_socket_goes_to_the_chosen_server_whole(rig: WsRig):
    """A new thread's socket (websocket-01) addressed to api.openai.com opens at alt, with alt's key,
    the model renamed in each ``response.create`` (warm-up, first turn, tool output), every event
    streamed back unchanged; the thread is pinned to alt at the upgrade."""
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p)
    with ws:
        sent = converse(ws, r, client_messages(1))
    assert_socket(p, ws, landed, sock, "alt", sent)
    assert [json.loads(e)["response"]["model"] for e in ws.received if '"response.completed"' in e] \
        == ["alt-codex-1"] * 3
    pin = rig.pin(session_of(r, upgrade(1)))
    assert pin is not None and (pin.agent, pin.server, pin.turn) == ("codex", "alt", "opening"), pin


def test_a_threads_sockets_follow_its_pin_across_a_switch_and_a_kill_9(rig: WsRig):
    """Thread S opens on alt; Codex is switched to beta. S's subagent socket, S's resume
    (cold_resume) and S's fork (cold_fork) all open at alt; a new thread N opens at beta. The proxy
    is killed -9 and restarted: the open sockets drop, and the sockets Codex opens again (S, the
    fork, N) reach the same servers."""
    r, rn = Replay(RUN), Replay(RUN)
    s_up = r.prepare(upgrade(1))
    s_ws, landed, sock = rig.open(s_up)
    s_sent = converse(s_ws, r, client_messages(1)[:2])
    rig.set_current("beta")

    sub = subagent_upgrade(r, upgrade(1))
    assert sub.header("session-id") == s_up.header("session-id") and sub.header("x-openai-subagent")
    sub_ws, sub_landed, sub_sock = rig.open(sub)
    with sub_ws:
        sub_sent = converse(sub_ws, r, client_messages(1)[:1])
    assert_socket(sub, sub_ws, sub_landed, sub_sock, "alt", sub_sent)

    n_up = rn.prepare(upgrade(1))
    n_ws, n_landed, n_sock = rig.open(n_up)
    n_sent = converse(n_ws, rn, client_messages(1))
    assert_socket(n_up, n_ws, n_landed, n_sock, "beta", n_sent)

    s_sent += converse(s_ws, r, client_messages(1)[2:])        # the running socket's last turn
    assert_socket(s_up, s_ws, landed, sock, "alt", s_sent)
    s_ws.close()

    opened = {}
    for nn in (2, 3):                                          # resume, fork
        p = r.prepare(upgrade(nn))
        ws, where, got = rig.open(p)
        with ws:
            assert_socket(p, ws, where, got, "alt", converse(ws, r, client_messages(nn)))
        opened[nn] = p
    session, fork = session_of(r, upgrade(1)), session_of(r, upgrade(3))
    fork_pin = rig.pin(fork)
    assert fork_pin is not None and (fork_pin.server, fork_pin.parent) == ("alt", session), fork_pin

    rig.mitm.restart(signal.SIGKILL)
    assert n_ws.wait_closed(), "the socket through the killed proxy is closed"
    n_ws.close()
    for rr, p, server in ((r, r.prepare(upgrade(1)), "alt"), (r, opened[3], "alt"), (rn, n_up, "beta")):
        ws, where, got = rig.open(p)                           # Codex connects again
        with ws:
            assert_socket(p, ws, where, got, server, converse(ws, rr, client_messages(1)[:2]))
    assert {s: (rig.pin(s).server, rig.pin(s).parent) for s in (session, fork, session_of(rn, upgrade(1)))} == {
        session: ("alt", ""), fork: ("alt", session), session_of(rn, upgrade(1)): ("beta", "")}


def test_a_socket_opened_through_reverse_mode_is_routed_alike(rig: WsRig):
    """``codex -c 'openai_base_url="http://127.0.0.1:PORT/v1"'``: Codex opens a plain ws:// socket
    to the reverse-mode port; it reaches alt with alt's key, the model renamed."""
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p, reverse=True)
    with ws:
        sent = converse(ws, r, client_messages(1)[:2])
    assert_socket(p, ws, landed, sock, "alt", sent)


def test_a_socket_of_codex_not_routed_reaches_the_origin_untouched(rig: WsRig):
    rig.set_current(None)
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p)
    with ws:
        sent = converse(ws, r, client_messages(1)[:2])
    assert_socket(p, ws, landed, sock, "openai", sent)
    pin = rig.pin(session_of(r, upgrade(1)))
    assert pin is not None and (pin.agent, pin.server) == ("codex", None), pin


def test_a_socket_of_a_thread_pinned_to_a_removed_server_is_refused_at_its_upgrade(rig: WsRig):
    """alt taken out of the config: the thread's resume and its fork are answered 426 at the
    upgrade, naming the session and the server; no socket reaches any server. With alt back,
    the thread's next socket opens at alt."""
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p)
    with ws:
        converse(ws, r, client_messages(1)[:1])
    assert landed == "alt"
    rig.set_current("beta", without=("alt",))
    session = session_of(r, upgrade(1))
    for nn in (2, 3):
        ws, where, _ = rig.open(r.prepare(upgrade(nn)))
        ws.close()
        assert (ws.status, where) == (426, None), (nn, ws.status, where)   # to HTTPS, where it gets the 424
        message = json.loads(ws.reject_body)["error"]["message"]
        assert short(session) in message and "'alt'" in message, message
    rig.set_current("beta")
    p = r.prepare(upgrade(2))
    ws, landed, sock = rig.open(p)
    with ws:
        assert_socket(p, ws, landed, sock, "alt", converse(ws, r, client_messages(2)[:1]))


def test_a_message_whose_model_cannot_be_renamed_is_not_sent(rig: WsRig):
    """At a server that renames models, a ``response.create`` whose model is not a plain string
    is dropped (the server never sees it) and the client gets an ``error`` event saying why;
    the socket stays open and the next message goes through."""
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p)
    with ws:
        [event] = ws.turn(json.dumps({"type": "response.create", "model": [RECORDED_MODEL], "input": []}))
        error = json.loads(event)
        assert error["type"] == "error" and "sessionpin" in error["error"]["message"], error
        sent = converse(ws, r, client_messages(1)[:1])
    assert landed == "alt" and sock is not None
    assert sock.received == [renamed(t, "alt") for t in sent]


# --------------------------------------------------------------------------- bounds (issue 20)

BOMB = 256 * 1024 * 1024         # what a 261 KB permessage-deflate frame inflates to


def rss_mb(rig: WsRig) -> float:
    """The proxy's resident memory now (MiB)."""
    for line in Path(f"/proc/{rig.mitm.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def peak_mb(rig: WsRig) -> float:
    for line in Path(f"/proc/{rig.mitm.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _closed_1009_on_both_sides(ws, before: int, landed, sock, sent, side: str) -> None:
    """The proxy closed both sides 1009, and nothing of the message reached the other side."""
    assert ws.close_code == 1009 and len(ws.received) == before
    assert landed == "alt" and sock is not None
    deadline = time.monotonic() + 5
    while sock.close_code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sock.close_code == 1009, "the server's side was closed with 1009 too"
    assert len(sock.received) == len(sent) + (side == "server")   # the message never reached the server


@pytest.mark.parametrize("side", ["client", "server"])
def test_a_deflate_bomb_on_a_routed_socket_closes_it_1009_and_reaches_no_one(rig: WsRig, side: str):
    """A 256 MiB message in one compressed frame, from Codex's side or the server's: the proxy
    inflates no more than the message limit (16 MiB by default), closes both sides
    with 1009, logs it, and nothing of the message reaches the other side."""
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p)
    lines = rig.mitm.line_count
    with ws:
        sent = converse(ws, r, client_messages(1)[:1])       # compressed messages before it, both ways
        before = len(ws.received)
        if side == "client":
            ws.send_raw(deflate_frame(BOMB, masked=True))
        else:
            ws.send(json.dumps({"type": "test.bomb", "size": BOMB}))
        assert ws.wait_closed(20), "the proxy closed the socket"
    _closed_1009_on_both_sides(ws, before, landed, sock, sent, side)
    assert rig.mitm.wait_output(rf"a WebSocket message from the {side} \(127\.0\.0\.1:\d+\) grew past 16 MiB "
                                r"\(sessionpin_ws_max_message_mb\); the socket was closed \(1009\)", since=lines)
    assert peak_mb(rig) < 600, f"the proxy's peak RSS reached {peak_mb(rig):.0f} MiB"
    # the proxy goes on
    ws, landed, sock = rig.open(r.prepare(upgrade(2)))
    with ws:
        converse(ws, r, client_messages(2)[:1])
    assert landed == "alt"


def cpu_s(rig: WsRig) -> float:
    """The CPU time the proxy has used so far (user + system, seconds)."""
    fields = Path(f"/proc/{rig.mitm.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# (the default limit allows 4195 frames per message, one per 4000 bytes and one more; the
# server's message, 0.2 MB on the wire as the deflate bomb's, was relayed whole, at a cost of CPU)
FRAGMENTS = {"client": 5_000, "server": 100_000}


@pytest.mark.parametrize("side", ["client", "server"])
def test_a_message_of_many_empty_frames_closes_the_socket_1009_at_a_bounded_cost(rig: WsRig, side: str):
    """A text message in thousands of empty frames (2 bytes each from the server, 6 from the
    client) from either side: the proxy spent ~50 us of CPU per frame with nothing to
    wait on (every other client stalled), kept a list entry per frame whatever its size (the
    limit counted bytes only), then sent each frame on. Now a message of more frames than the
    limit allows (one per 4000 bytes of it, mitmproxy's own frame size) closes both sides with
    1009, nothing of it passed on."""
    r = Replay(RUN)
    ws, landed, sock = rig.open(r.prepare(upgrade(1)))
    lines = rig.mitm.line_count
    with ws:
        sent = converse(ws, r, client_messages(1)[:1])
        before, cpu0 = len(ws.received), cpu_s(rig)
        if side == "client":
            with contextlib.suppress(OSError):
                ws.send_raw(fragmented('{"type":"response.processed"}', FRAGMENTS[side], masked=True))
        else:
            ws.send(json.dumps({"type": "test.fragments", "count": FRAGMENTS[side]}))
        assert ws.wait_closed(30), "the proxy closed the socket"
    cpu = cpu_s(rig) - cpu0
    _closed_1009_on_both_sides(ws, before, landed, sock, sent, side)
    assert rig.mitm.wait_output(rf"a WebSocket message from the {side} \(127\.0\.0\.1:\d+\) came in more than "
                                r"4195 frames \(one per 4000 bytes of sessionpin_ws_max_message_mb\); the socket was "
                                r"closed \(1009\)", since=lines)
    assert cpu < 4, f"the proxy spent {cpu:.1f} s of CPU on one message"
    ws, landed, sock = rig.open(r.prepare(upgrade(2)))            # the proxy goes on
    with ws:
        converse(ws, r, client_messages(2)[:1])
    assert landed == "alt"


PINGS = 5_000


def test_a_ping_flood_writes_no_line_per_ping(rig: WsRig):
    """Pings from Codex's side (6 bytes each) are relayed to the server, whose pongs come back:
    mitmproxy wrote a log line for each ping and each pong (two lines of ~90 bytes per 6 bytes
    a peer sent: a flood filled the operator's terminal or log file and buried the decision
    lines). They are its per-frame chatter, dropped as its connect lines are unless
    ``sessionpin_connection_log`` is on; the socket goes on."""
    r = Replay(RUN)
    ws, landed, sock = rig.open(r.prepare(upgrade(1)))
    with ws:
        converse(ws, r, client_messages(1)[:1])
        lines = rig.mitm.line_count
        ws.send_raw(b"".join(ping_frame(i) for i in range(PINGS)))
        converse(ws, r, client_messages(1)[1:2])          # after every ping: the socket goes on
        time.sleep(0.5)
        new = rig.mitm.line_count - lines
        logged = [x for x in rig.mitm.tail(new).splitlines() if "WebSocket p" in x] if new else []
    assert landed == "alt" and len(logged) < 10, f"{len(logged)} lines for {PINGS} pings: {logged[:2]}"


def ping_frame(i: int) -> bytes:
    """A client's (masked) ping frame carrying ``i``."""
    payload, key = str(i).encode(), os.urandom(4)
    return bytes([0x89, 0x80 | len(payload)]) + key + bytes(b ^ key[j % 4] for j, b in enumerate(payload))


def test_a_long_socket_keeps_the_proxy_s_memory_flat(rig: WsRig):
    """80 MB of the server's messages over one routed socket: the proxy keeps only the newest
    (``sessionpin_ws_keep_kb``), during the session and after it."""
    rig.mitm.restart()            # a fresh process: memory an earlier test freed would hide the growth
    r = Replay(RUN)
    ws, landed, _ = rig.open(r.prepare(upgrade(1)))
    with ws:
        converse(ws, r, client_messages(1)[:1])
        start = rss_mb(rig)
        ws.send(json.dumps({"type": "test.stream", "count": 800, "size": 100_000}))
        ws.read_until(lambda e: e.get("type") == "response.completed", timeout=120)
        during = rss_mb(rig)
    assert landed == "alt" and sum(len(m) for m in ws.received) > 80_000_000
    assert during - start < 40, f"RSS {start:.0f} -> {during:.0f} MiB over the session"


def test_a_socket_counts_its_turns_in_the_activity(rig: WsRig):
    """Each ``response.create`` on the socket is a request of its session (``sessions``' REQUESTS);
    the upgrade is none: websocket-01's three messages count 3, in the store within seconds."""
    r = Replay(RUN)
    p = r.prepare(upgrade(1))
    ws, landed, sock = rig.open(p)
    with ws:
        sent = converse(ws, r, client_messages(1))
    assert_socket(p, ws, landed, sock, "alt", sent)
    session = session_of(r, upgrade(1))

    async def requests() -> int:
        store = open_store(f"file:{rig.store_path}")
        try:
            return (await pins.seen(store, session)).requests
        finally:
            await store.close()
    deadline = time.monotonic() + 5
    while asyncio.run(requests()) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)              # a count over (the upgrade's) would be flushed by now too
    assert len(sent) == 3 and asyncio.run(requests()) == 3
