"""The guards see what the router routes (issue 19), end to end: a real mitmdump, real TLS,
fake servers on loopback.

A server written with a base that has no ``/v1`` (``https://host/api/paas/v4``, Z.ai's
OpenAI-compatible API) has its ``/api/paas/v4/chat/completions`` routed; the body limit
decided by the path alone, so such a request over the limit was buffered whole and sent on
instead of getting the 413. Both now ask the one rule (``config.Config.scope``), and a path
the router neither routes nor guards gets no 413 from sessionpin either. A path it guards
(``paths.guarded``: one it does not route that ends with an endpoint, where a conversation
pinned elsewhere is refused) gets the 413 too: streamed to the server it addressed, its body
went there before the router could read the pin.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, TestCA, running_rig, toml_config

KEY_ENV = "SESSIONPIN_E2E_GUARD_KEY"
KEY = "guard-SENTINEL-" + uuid.uuid4().hex[:8]
BASE = "/api/paas/v4"


class Rig:
    def __init__(self, tmp, ca: TestCA, fakes: dict[str, FakeServer]) -> None:
        self.zai, self.bare = fakes["zai"], fakes["bare"]
        config = toml_config({"zai": {"url": self.zai.origin + BASE},
                              "bare": {"url": self.bare.origin, "key_env": KEY_ENV}}, {"opencode": "bare"})
        self.mitm = Mitmdump.router(tmp / "router", ca, config, env={KEY_ENV: KEY},
                                    options={"sessionpin_max_body_mb": 1})

    def send(self, fake: FakeServer, path: str, body: bytes) -> Any:
        headers = [("Content-Type", "application/json"), ("User-Agent", "opencode/1.18.33"),
                   ("Authorization", "Bearer agent-key"), ("x-opencode-session", "ses_" + uuid.uuid4().hex[:20])]
        return Client.via_proxy(self.mitm.port, self.mitm.mitm_ca).request("POST", fake.origin + path, headers, body)

    def counts(self) -> tuple[int, int]:
        return len(self.zai.received()), len(self.bare.received())


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    def fakes(ca: TestCA) -> dict[str, FakeServer]:
        return {"zai": FakeServer("zai", ca, prefix=BASE), "bare": FakeServer("bare", ca)}
    with running_rig(tmp_path_factory.mktemp("e2e-guard-scope"), fakes, Rig) as r:
        yield r


def chat(size: int = 0) -> bytes:
    return json.dumps({"model": "glm-4.6", "stream": False,
                       "messages": [{"role": "system", "content": "You are opencode."},
                                    {"role": "user", "content": "hi " + "x" * size}]}).encode()


def test_a_request_the_router_routes_at_a_base_without_v1_is_routed(rig: Rig) -> None:
    """The premise: opencode's chat at the server's own base is routed (to bare, its current)."""
    before = rig.counts()
    r = rig.send(rig.zai, BASE + "/chat/completions", chat(100))
    assert r.status == 200, r.text[:300]
    assert rig.counts() == (before[0], before[1] + 1)
    got = rig.bare.received()[-1]
    assert got.path == "/v1/chat/completions" and KEY in (got.header("authorization") or "")


def test_such_a_request_over_the_limit_gets_the_413_naming_it(rig: Rig) -> None:
    """Failed before: the 3 MiB body was buffered and routed (the limit went by the path alone)."""
    before = rig.counts()
    r = rig.send(rig.zai, BASE + "/chat/completions", chat(3 * 1024 * 1024))
    assert r.status == 413, (r.status, r.text[:300])
    msg = r.json()["error"]["message"]
    assert "1 MiB" in msg and "sessionpin_max_body_mb" in msg
    assert r.header("x-sessionpin-refused") == "too-large"
    assert rig.counts() == before, "nothing reached any server"


def opencode_headers(session: str) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("User-Agent", "opencode/1.18.33"),
            ("Authorization", "Bearer agent-key"), ("x-opencode-session", session)]


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_pinned_conversations_turn_over_the_limit_at_a_path_the_router_guards_reaches_no_server(
        rig: Rig, chunked: bool) -> None:
    """opencode opened at zai's own base, pinned to bare; its next turn, 3 MiB, at zai's
    /chat/completions (a base sessionpin does not route, which the router guards: a
    conversation pinned elsewhere is refused there). Failed before: a body over the limit was
    streamed to zai (mitmproxy's stream_large_bodies, which sessionpin sets to the limit)
    before the router could read the pin, and zai answered it with the agent's key."""
    session = "ses_" + uuid.uuid4().hex[:20]
    client = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca)
    r = client.request("POST", rig.zai.origin + BASE + "/chat/completions", opencode_headers(session), chat(100))
    assert r.status == 200 and rig.bare.received()[-1].path == "/v1/chat/completions", r.text[:300]
    before = rig.counts()
    body, headers = chat(3 * 1024 * 1024), opencode_headers(session)
    if chunked:
        body, headers = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), headers + [("Transfer-Encoding", "chunked")]
    r = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca).request("POST", rig.zai.origin + "/chat/completions",
                                                                  headers, body)
    assert (r.status, rig.counts()) == (413, before), (r.status, r.text[:300])
    assert r.header("x-sessionpin-refused") == "too-large"


@pytest.mark.parametrize("where,path", [("zai", BASE + "/threads/x/messages"),        # a look-alike
                                        ("bare", BASE + "/chat/completions"),         # not this server's base
                                        ("bare", "/model/x/invoke")])                 # another API's endpoint
def test_a_path_the_router_guards_gets_the_413_over_the_limit_too(rig: Rig, where: str, path: str) -> None:
    """Its body over the limit cannot be read, so whether its conversation is pinned elsewhere
    cannot be told: refused clearly, sent nowhere (before: sent where it was addressed)."""
    before = rig.counts()
    fake = rig.zai if where == "zai" else rig.bare
    r = rig.send(fake, path, chat(3 * 1024 * 1024))
    assert (r.status, rig.counts()) == (413, before), (r.status, r.text[:300])


@pytest.mark.parametrize("where,path", [("zai", BASE + "/files"), ("bare", "/v1/uploads/x/parts")])
def test_a_path_the_router_neither_routes_nor_guards_gets_no_413_from_sessionpin(rig: Rig, where: str,
                                                                                path: str) -> None:
    fake = rig.zai if where == "zai" else rig.bare
    before = len(fake.received())
    r = rig.send(fake, path, chat(3 * 1024 * 1024))
    assert r.status != 413 and r.header("x-sessionpin-refused") is None, (r.status, r.text[:300])
    got = fake.received()[before:]
    assert [g.path for g in got] == [path], "it went where it was addressed, as sent"
    assert (got[0].header("authorization") or "") == "Bearer agent-key"
