"""Codex's WebSocket in the shell: the socket is decided at its upgrade (router), and each
message the client sends on it is renamed with the model map of the server it was opened to
(``WebSocketModels``) — the map as planned at the upgrade, for the socket's whole life."""

from __future__ import annotations

import json
import time

import pytest
from mitmproxy import websocket
from wsproto.frame_protocol import Opcode

from sessionpin.records import pins
from shellkit import start
from test_proxy_router import CODEX_CONFIG, upgrade

SESSION = "01a22bef-e03d-7c53-8141-6c5fbf6ba8c0"
CREATE = {"type": "response.create", "model": "gpt-6.2-sol", "stream": True, "input": [],
          "client_metadata": {"x-codex-turn-metadata": '{"model":"gpt-6.2-sol"}'}}


@pytest.fixture
async def proxy(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CODEX_CONFIG)
    proxy = start(p)
    proxy.router.env["ALT_KEY"] = "alt-sentinel"
    proxy.path = p
    yield proxy
    proxy.close()


def models_addon(proxy):
    return next(a for a in proxy.addons if hasattr(a, "websocket_message"))


def message(proxy, f, content: bytes, from_client: bool = True) -> bytes:
    """``content`` sent on ``f``'s socket; what goes on."""
    if f.websocket is None:
        f.websocket = websocket.WebSocketData()
    msg = websocket.WebSocketMessage(Opcode.TEXT, from_client, content, time.time())
    f.websocket.messages.append(msg)
    models_addon(proxy).websocket_message(f)
    return msg.content


def encoded(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


async def test_a_routed_sockets_messages_are_renamed_only_in_their_top_level_model(proxy):
    f = upgrade()
    await proxy.send(f)
    assert f.request.host == "alt.example"
    sent = encoded(CREATE)
    assert message(proxy, f, sent) == sent.replace(b'"model":"gpt-6.2-sol"', b'"model":"alt-codex-1"', 1)
    event = encoded({"type": "response.created", "response": {"model": "alt-codex-1"}})
    assert message(proxy, f, event, from_client=False) == event      # the server's events pass as sent
    processed = encoded({"type": "response.processed", "response_id": "resp_1"})
    assert message(proxy, f, processed) == processed                 # no model: nothing to rename


async def test_a_socket_keeps_the_model_map_of_its_upgrade_when_the_config_changes(proxy):
    """The socket was opened to alt with alt's key and alt's map: a config edit (alt's map
    changed, then alt removed) applies from the next socket; messages on the open one are still
    renamed as at its upgrade — never sent on with a name alt does not know."""
    f = upgrade()
    await proxy.send(f)
    proxy.path.write_text(CODEX_CONFIG.replace('"alt-codex-1"', '"alt-codex-2"'))
    proxy.reload()
    assert b'"alt-codex-1"' in message(proxy, f, encoded(CREATE))
    proxy.path.write_text(CODEX_CONFIG.split("[servers.alt]")[0])
    proxy.reload()
    assert "alt" not in proxy.config.config.servers
    assert b'"alt-codex-1"' in message(proxy, f, encoded(CREATE))


async def test_a_pool_pins_socket_is_renamed_with_the_map_it_was_allocated_with(proxy):
    """A pool pin keeps its member's model map from the allocation (docs/serverpools.md); its HTTPS
    turns are planned with it, and so are its socket's messages."""
    proxy.path.write_text(CODEX_CONFIG + '[pools.p]\nmembers = ["alt"]\n')
    proxy.reload()
    now = time.time()
    await pins.create(proxy.store, SESSION, pins.Pin(agent="codex", server="alt", since=now, renewed=now,
                                                      pool="p", models=(("gpt-6.2-*", "alt-codex-0"),)))
    f = upgrade("cold_resume")
    await proxy.send(f)
    assert f.request.host == "alt.example" and f.metadata["sessionpin"]["rule"] == "pinned"
    assert b'"model":"alt-codex-0"' in message(proxy, f, encoded(CREATE))


async def test_a_socket_left_alone_is_not_renamed(proxy):
    proxy.path.write_text(CODEX_CONFIG.replace('[agents.codex]\nserver = "alt"', '[agents.codex]\nserver = "openai"')
                          .replace('[servers.openai]\nurl = "https://api.openai.com"',
                                   '[servers.openai]\nurl = "https://api.openai.com"\nmodels = { "x" = "y" }'))
    proxy.reload()
    f = upgrade()
    await proxy.send(f)
    assert f.request.host == "api.openai.com"
    sent = encoded({**CREATE, "model": "x"})
    assert message(proxy, f, sent) == sent.replace(b'"x"', b'"y"', 1)   # the addressed server's own map
    proxy.path.write_text(CODEX_CONFIG.replace('[agents.codex]\nserver = "alt"', "[agents.codex]"))
    proxy.reload()
    g = upgrade(session="01a22bef-e03d-7c53-8141-6c5fbf6ba8c1")
    await proxy.send(g)                                                 # not routed
    assert g.request.host == "api.openai.com"
    assert message(proxy, g, encoded(CREATE)) == encoded(CREATE)


def on_socket(proxy, f, content: bytes, from_client: bool = True) -> None:
    """``content`` sent on ``f``'s socket, through every addon's message hook (as mitmproxy runs them)."""
    if f.websocket is None:
        f.websocket = websocket.WebSocketData()
    f.websocket.messages.append(websocket.WebSocketMessage(Opcode.TEXT, from_client, content, time.time()))
    for a in proxy.addons:
        if hasattr(a, "websocket_message"):
            a.websocket_message(f)


async def test_a_socket_counts_its_turns_not_its_upgrade(proxy):
    f = upgrade()
    await proxy.send(f)
    assert f.request.host == "alt.example"
    for _ in range(3):
        on_socket(proxy, f, encoded(CREATE))
        on_socket(proxy, f, encoded({"type": "response.completed", "response": {"id": "r"}}), from_client=False)
    on_socket(proxy, f, encoded({"type": "response.processed", "response_id": "resp_1"}))   # not a turn
    # a turn's text naming the type is content, not a turn
    on_socket(proxy, f, encoded({"type": "session.update", "input": '{"type":"response.create"}'}))
    on_socket(proxy, f, b'{"type":"response.create",')                                         # not JSON
    activity = proxy.runtime._take()
    assert [(s, agent, server, n) for s, agent, server, _, n in activity] == [(SESSION, "codex", "alt", 3)]
