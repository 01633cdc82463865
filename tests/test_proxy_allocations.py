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

    async def write_quota(store, member, q):
        written.append(member)
        await real(store, member, q)
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
            assert written == ["glm-a"]
            q = await members.read_quota(proxy.store, "glm-a", time.time())
            assert q is not None and q.exhausted_until > time.time() + 20
        finally:
            loop.set_task_factory(None)
    finally:
        proxy.close()
