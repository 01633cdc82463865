"""The guards see what the router routes (issue 19), end to end: a real mitmdump, real TLS,
fake servers on loopback.

A server written with a base that has no ``/v1`` (``https://host/api/paas/v4``, Z.ai's
OpenAI-compatible API) has its ``/api/paas/v4/chat/completions`` routed; the body limit
decided by the path alone, so such a request over the limit was buffered whole and sent on
instead of getting the 413. Both now ask the one rule (``config.Config.scope``), and a path
the router does not route gets no 413 from sessionpin either.
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


@pytest.mark.parametrize("where,path", [("zai", BASE + "/threads/x/messages"),        # a look-alike
                                        ("bare", BASE + "/chat/completions")])        # not this server's base
def test_a_path_the_router_does_not_route_gets_no_413_from_sessionpin(rig: Rig, where: str, path: str) -> None:
    fake = rig.zai if where == "zai" else rig.bare
    before = len(fake.received())
    r = rig.send(fake, path, chat(3 * 1024 * 1024))
    assert r.status != 413 and r.header("x-sessionpin-refused") is None, (r.status, r.text[:300])
    got = fake.received()[before:]
    assert [g.path for g in got] == [path], "it went where it was addressed, as sent"
    assert (got[0].header("authorization") or "") == "Bearer agent-key"
