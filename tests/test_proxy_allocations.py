"""Allocations in the shell: a pool member's answer that states its quota is written for the next
allocations, after the hook (mitmproxy's loop starts tasks eagerly: a write made in a task the
hook starts ran inside the hook, ahead of the answer's stream)."""

from __future__ import annotations

import asyncio
import time

from mitmproxy import http
from mitmproxy.test import tutils

from sessionpin.serverpools import members
from shellkit import SESSION, flow, start

CONFIG = '''
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.glm-a]
url = "https://a.example"

[servers.glm-b]
url = "https://b.example"

[pools.glm]
members = ["glm-a", "glm-b"]
policy = "round-robin"

[agents.claude-code]
server = "glm"
'''


async def test_a_members_quota_is_written_after_the_hook_on_an_eager_loop(tmp_path, monkeypatch):
    written = []
    real = members.write_quota

    async def write_quota(store, member, q, sent=None):
        written.append((member, sent is not None))
        await real(store, member, q, sent)
    monkeypatch.setattr(members, "write_quota", write_quota)
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    proxy = start(p)
    try:
        f = flow()
        f.metadata["sessionpin"] = {"agent": "claude-code", "session": SESSION, "target": "glm-a"}
        f.response = tutils.tresp(status_code=429, headers=http.Headers([(b"retry-after", b"30")]))
        loop = asyncio.get_running_loop()
        loop.set_task_factory(asyncio.eager_task_factory)        # as mitmproxy runs its loop
        try:
            proxy.bundle.allocations.responseheaders(f)
            assert written == []                                 # nothing of it ran in the hook
            for _ in range(20):
                if proxy.bundle.allocations._tasks:
                    await asyncio.gather(*list(proxy.bundle.allocations._tasks))
            assert written == [("glm-a", True)]                    # with when its request was sent
            q = await members.read_quota(proxy.store, "glm-a", time.time())
            assert q is not None and q.exhausted_until > time.time() + 20
        finally:
            loop.set_task_factory(None)
    finally:
        proxy.close()


async def test_a_pool_pin_lost_after_its_opening_is_a_loss_not_a_conversation_never_seen_begin(tmp_path):
    """The pin the allocation wrote is one this proxy served: deleted (a cleanup script), with
    its index entry, the next turn is refused 424 naming the loss — not left alone and sent to
    the origin it addresses, pinned "not routed" over the loss (as a plain server's pin is)."""
    from sessionpin.records import pins
    p = tmp_path / "config.toml"
    p.write_text(CONFIG.replace('url = "https://a.example"', 'url = "https://a.example"\nkey_env = "ZAI_API_KEY"')
                 .replace('url = "https://b.example"', 'url = "https://b.example"\nkey_env = "ZAI_API_KEY"'))
    proxy = start(p)
    try:
        f = flow()
        await proxy.send(f)
        member = f.metadata["sessionpin"]["target"]
        assert member in ("glm-a", "glm-b") and f.request.host != "api.anthropic.com"
        await proxy.store.delete(pins.key(SESSION))
        await proxy.store.zrem(pins.index_key("claude-code", member), SESSION)
        g = flow("continuation")
        await proxy.send(g)
        assert g.response is not None and g.response.status_code == 424, g.metadata.get("sessionpin")
        assert g.response.headers["x-sessionpin-refused"] == "store-lost"
        assert await proxy.store.get(pins.key(SESSION)) is None            # nothing written over the loss
    finally:
        proxy.close()


SOFT = CONFIG.replace('policy = "round-robin"', 'policy = "round-robin"\naffinity = "soft"')


def errored(member: str, *, answered: bool, connected: bool):
    f = flow()
    f.metadata["sessionpin"] = {"agent": "claude-code", "session": SESSION, "target": member}
    if answered:
        f.response = tutils.tresp(status_code=200)
    f.server_conn.timestamp_tcp_setup = time.time() if connected else None
    f.server_conn.timestamp_tls_setup = time.time() if connected else None
    return f


async def test_only_a_connection_that_failed_makes_a_soft_member_unreachable(tmp_path):
    """A client that hangs up while the member thinks, or mid-stream, says nothing of the
    member: every soft member left new allocations for 10 s when clients pressed Esc."""
    p = tmp_path / "config.toml"
    p.write_text(SOFT)
    proxy = start(p)
    try:
        a = proxy.bundle.allocations
        a.failed(errored("glm-a", answered=True, connected=True))          # hung up mid-stream
        a.failed(errored("glm-a", answered=False, connected=True))         # hung up while it thought
        assert a.unreachable == {}
        a.failed(errored("glm-b", answered=False, connected=False))        # its connection failed
        assert set(a.unreachable) == {"glm-b"}
    finally:
        proxy.close()
