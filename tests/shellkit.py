"""What the shell's tests share: a config, flows as the agents send them, the addons in a
taddons context with a real store."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mitmproxy import hooks, http
from mitmproxy.test import taddons, tflow, tutils

from sessionpin.proxy import make_addons
from sessionpin.proxy.bundle import Sessionpin
from sessionpin.proxy.configwatch import ConfigWatch
from sessionpin.proxy.connect import ConnectCheck
from sessionpin.proxy.router import Router
from sessionpin.proxy.status import StatusEndpoints
from sessionpin.proxy.storeruntime import StoreRuntime

CONFIG = '''
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"
models = { "claude-opus-*" = "glm-4.6" }

[servers.nokey]
url = "https://nokey.example"

[agents.claude-code]
server = "glm"
'''
SESSION = "abcd1234-0000-4000-8000-000000000001"
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


def env(config_path, **more) -> dict[str, str]:
    """An environment whose defaults are not the user's own config file and store."""
    return {"ZAI_API_KEY": "zai-sentinel", "SESSIONPIN_CONFIG": str(config_path), "SESSIONPIN_STORE": "memory:",
            **more}


def body(kind="opening", model="claude-opus-4-1") -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    if kind == "continuation":
        messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    b = {"model": model, "max_tokens": 5, "stream": True, "messages": messages}
    if kind in ("opening", "continuation"):
        b["tools"] = TOOLS
    return json.dumps(b, indent=1).encode()


def flow(kind="opening", session=SESSION, host="api.anthropic.com", path="/v1/messages?beta=true", content=None,
         headers=None, method=b"POST", peer=("127.0.0.1", 5555), agent=b"claude-cli/2.1.332 (external, cli)"):
    h = [
        (b"host", host.encode()),
        (b"user-agent", agent),
        (b"content-type", b"application/json"),
        (b"x-api-key", b"agent-sentinel"),
        (b"cookie", b"sid=agent"),
        (b"anthropic-version", b"2023-06-01"),
        (b"x-claude-code-request-class", {"opening": b"main", "continuation": b"main", "title": b"auxiliary",
                                          "subagent": b"subagent"}[kind]),
    ]
    if session:
        h.append((b"x-claude-code-session-id", session.encode()))
    h += headers or []
    req = tutils.treq(method=method, scheme=b"https", host=host, port=443, path=path.encode(),
                      headers=http.Headers(h), content=body(kind) if content is None else content)
    f = tflow.tflow(req=req)
    f.client_conn.peername = peer
    return f


def internal(path: str, peer=("127.0.0.1", 5555), host="127.0.0.1:8080", headers=None):
    """A request for the status endpoints as the CLI sends it (absolute form to the proxy itself)."""
    h = http.Headers([(b"host", host.encode()), *(headers or [])])
    req = tutils.treq(method=b"GET", scheme=b"http", host=host.split(":")[0], port=8080, path=path.encode(),
                      headers=h, content=b"")
    f = tflow.tflow(req=req)
    f.client_conn.peername = peer
    return f


@dataclass
class Proxy:
    """The one addon of a proxy (``bundle``), its parts (``addons``, in their order) and the
    main parts by job."""
    tctx: taddons.context
    bundle: Sessionpin
    addons: list
    config: ConfigWatch
    runtime: StoreRuntime
    connect: ConnectCheck
    status: StatusEndpoints
    router: Router

    @property
    def store(self):
        return self.runtime.store

    async def send(self, f) -> None:
        """The addon's request hook (every part's, in order, as mitmproxy runs it)."""
        await self.bundle.request(f)

    async def settle(self) -> None:
        """Let the effects that run after a request left (renewals, memories) finish."""
        import asyncio
        for _ in range(3):
            pending = list(self.router._background)
            if not pending:
                return
            await asyncio.gather(*pending)

    def reload(self) -> None:
        """What the watch loop does: a new text is applied when two looks in a row find it."""
        self.config.check()
        self.config.check()

    def close(self) -> None:
        self.bundle.done()


def start(config_path, participants=None, *, pool: bool = False, **options) -> Proxy:
    """The addons on ``config_path`` with a memory store (``sessionpin_store=`` for another).
    The connect check is off unless asked for (test hosts like api.z.ai do not resolve
    here). ``pool=True``: the addons as mitmdump loads them, the OpenCode id pool included."""
    addons = make_addons(participants=None if pool else participants if participants is not None else [],
                         env=env(config_path))
    assert len(addons) == 1
    bundle = addons[0]
    tctx = taddons.context(bundle)
    options.setdefault("sessionpin_connect_check", False)
    options.setdefault("sessionpin_store", "memory:")
    tctx.options.update(sessionpin_config=str(config_path), **options)
    # as mitmproxy's script loader does: configure every addon with every option
    tctx.master.addons.invoke_addon_sync(bundle, hooks.ConfigureHook(set(tctx.options.keys())))
    return Proxy(tctx, bundle, bundle.parts, bundle.config, bundle.runtime, bundle.connect, bundle.status,
                 bundle.router)
