"""Defaults: lazy connections, no request streaming, one line per decision."""

from __future__ import annotations

import logging
import re
from typing import Optional

import pytest
from mitmproxy import exceptions

from sessionpin.proxy.defaults import Defaults
from shellkit import flow, start


@pytest.fixture
def proxy(tmp_path):
    p = start(tmp_path / "none.toml")
    yield p
    p.close()


def test_connection_chatter_is_off_unless_asked(proxy, caplog):
    server_log = logging.getLogger("mitmproxy.proxy.server")
    with caplog.at_level(logging.INFO, logger="mitmproxy.proxy.server"):
        server_log.info("client connect")
        server_log.info("server disconnect api.z.ai:443")
        server_log.info("error establishing server connection: refused")
        server_log.info("Streaming response from api.z.ai.")          # one per streamed answer
    assert "client connect" not in caplog.text and "server disconnect" not in caplog.text
    assert "Streaming response" not in caplog.text
    assert "error establishing" in caplog.text
    d = next(a for a in proxy.addons if isinstance(a, Defaults))
    proxy.tctx.configure(d, sessionpin_connection_log=True)
    with caplog.at_level(logging.INFO, logger="mitmproxy.proxy.server"):
        server_log.info("client connect")
    assert "client connect" in caplog.text


async def test_one_line_per_decision_on_the_terminal(proxy, capsys, caplog):
    import asyncio
    await proxy.send(flow())
    await proxy.send(flow("continuation"))
    await asyncio.sleep(0)           # lines are written once per turn of the event loop
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and "claude-code opening abcd1234" in out and "continuation abcd1234" in out
    # timestamped like mitmproxy's own lines: [HH:MM:SS.mmm]
    assert all(re.match(r"^\[\d\d:\d\d:\d\d\.\d{3}\] sessionpin: claude-code ", line) for line in out.splitlines()), out
    d = next(a for a in proxy.addons if isinstance(a, Defaults))
    proxy.tctx.configure(d, sessionpin_decision_log="off")
    await proxy.send(flow())
    await asyncio.sleep(0)
    assert capsys.readouterr().out == ""
    proxy.tctx.configure(d, sessionpin_decision_log="eventlog")
    with caplog.at_level(logging.INFO, logger="sessionpin.decisions"):
        await proxy.send(flow())
    assert "claude-code opening abcd1234" in caplog.text and capsys.readouterr().out == ""


async def test_a_refusal_is_one_line_its_warning(tmp_path, capsys, caplog):
    import asyncio

    from shellkit import CONFIG
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG)
    p = start(cfg, sessionpin_store_retry_ms=0)
    try:
        from sessionpin.store import StoreUnavailable

        class Down:
            """The real store, whose reads fail."""
            def __init__(self, store):
                self._s, self.url = store, store.url

            def __getattr__(self, name):
                if name != "get":
                    return getattr(self._s, name)

                async def fails(*a, **k):
                    raise StoreUnavailable("file:x: disk I/O error")
                return fails
        p.runtime.store = Down(p.store)
        with caplog.at_level(logging.WARNING, logger="sessionpin"):
            f = flow("continuation")
            await p.send(f)
            await asyncio.sleep(0)
        assert f.response.status_code == 424
        assert capsys.readouterr().out == ""                          # no decision line besides it
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("sessionpin: refused 424 (store) claude-code continuation abcd1234 "
                                                      "[store-unreadable]: "), said
    finally:
        p.close()


def test_each_proxy_has_its_own_decision_lines_shared_by_its_defaults_and_router():
    """Issue 21: no process global. The decision log is the addon tree's: Defaults points it
    (``sessionpin_decision_log``), the Router writes to it, another tree has its own."""
    from sessionpin.proxy import Router, make_addons

    trees = [make_addons([]), make_addons([])]
    logs = []
    for tree in trees:
        defaults = next(a for a in tree if isinstance(a, Defaults))
        router = next(a for a in tree if isinstance(a, Router))
        assert defaults.decisions is router.decisions
        logs.append(router.decisions)
    assert logs[0] is not logs[1]
    logs[0].mode = "off"
    assert not logs[0].on and logs[1].on
