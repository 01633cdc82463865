"""The one addon mitmproxy loads (``sessionpin.proxy.bundle``): what mitmproxy sees, the
parts' order, a part's failure, and the participants' one interface."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from mitmproxy import exceptions, hooks, http
from mitmproxy.addonmanager import traverse
from mitmproxy.addons import script
from mitmproxy.test import taddons, tflow, tutils

from sessionpin.opencode_ids.participant import PoolParticipant
from sessionpin.proxy import make_addons, perflow
from sessionpin.proxy.browsers import PageGuard
from sessionpin.proxy.bundle import ORDER, Sessionpin, _sync
from sessionpin.proxy.connect import ConnectCheck
from sessionpin.proxy.ledgerwatch import LedgerWatch
from sessionpin.proxy.limits import BodyLimit
from sessionpin.proxy.lineagewatch import LineageWatch
from sessionpin.proxy.participants import Participant
from sessionpin.proxy.router import Router
from shellkit import CONFIG, SESSION, flow, start

REPO = Path(__file__).resolve().parents[1]
HOOKS = {h.name for h in hooks.all_hooks.values()}


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.mark.parametrize("path", ["addons/route.py", "sessionpin/mitmscript/route.py"])
def test_mitmproxy_sees_exactly_one_addon_in_each_script(path):
    with taddons.context():
        ns = script.load_script(str(REPO / path))
    assert len(ns.addons) == 1 and isinstance(ns.addons[0], Sessionpin)
    assert list(traverse(ns.addons)) == ns.addons          # no child addons either: one object per hook


def test_a_loaded_proxy_holds_one_addon_of_ours_and_every_part_registered_its_options(tmp_path):
    addons = make_addons(env={"SESSIONPIN_CONFIG": str(tmp_path / "none.toml"), "SESSIONPIN_STORE": "memory:"})
    with taddons.context(*addons) as tctx:
        ours = [a for a in traverse(tctx.master.addons.chain) if type(a).__module__.startswith("sessionpin")]
        assert ours == addons
        for option in ("sessionpin_max_body_mb", "sessionpin_allow_origins", "sessionpin_store_retry_ms",
                       "sessionpin_ws_keep_kb", "sessionpin_otel", "sessionpin_pools_wait_ms", "sessionpin_pool",
                       "sessionpin_connect_check", "sessionpin_decision_log", "sessionpin_config", "sessionpin_store"):
            assert option in tctx.options, option
        addons[0].done()


def test_only_hooks_some_part_takes_exist_on_the_addon():
    bundle = make_addons([])[0]
    have = {n for n in HOOKS if callable(getattr(bundle, n, None))}
    taken = {n for n in HOOKS for p in bundle.parts if callable(getattr(p, n, None))}
    # the participants' running/done and PoolOptions/Allocations' load are parts' too
    assert have == taken, (have - taken, taken - have)
    assert [type(p).__name__ for p in bundle.parts][:13] == [
        "Defaults", "ConfigWatch", "StoreRuntime", "ConnectCheck", "BodyLimit", "PageGuard", "StatusEndpoints",
        "Router", "LineageWatch", "WebSocketModels", "SocketTurns", "SocketBounds", "LedgerWatch"]
    assert ORDER[:13] == ("defaults", "config", "runtime", "connect", "limit", "pages", "status", "router", "lineage",
                          "ws_models", "ws_turns", "ws_bounds", "ledger")


def _boom(*args, **kwargs):
    raise RuntimeError("a part's bug")


@pytest.mark.parametrize("broken", [BodyLimit, PageGuard])
async def test_a_failing_part_is_logged_and_the_flow_still_reaches_the_routers_decision(cfg_path, monkeypatch,
                                                                                       caplog, broken):
    """mitmproxy's own dispatch logged such an exception and then skipped every later addon
    of the script for that hook: the request left unrouted. Here the next part runs."""
    monkeypatch.setattr(broken, "request", _boom)
    monkeypatch.setattr(ConnectCheck, "requestheaders", _boom)
    p = start(cfg_path)
    try:
        f = flow()
        with caplog.at_level(logging.ERROR, "sessionpin"):
            p.bundle.requestheaders(f)
            await p.send(f)
    finally:
        p.close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"sessionpin: {broken.__name__}.request failed" in said
    assert "sessionpin: ConnectCheck.requestheaders failed" in said
    assert any("a part's bug" in (r.exc_text or "") or r.exc_info for r in caplog.records)
    assert f.response is None and not f.error                       # not dropped
    assert f.metadata["sessionpin"]["rule"] == "opening" and f.request.host == "api.z.ai"   # decided and routed


async def test_a_failing_router_response_hook_leaves_the_watches_after_it_their_turn(cfg_path, monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(Router, "response", _boom)
    monkeypatch.setattr(LineageWatch, "response", lambda self, f: seen.append("lineage"))
    monkeypatch.setattr(LedgerWatch, "response", lambda self, f: seen.append("ledger"))
    p = start(cfg_path)
    try:
        f = flow()
        await p.send(f)
        f.response = tutils.tresp()
        with caplog.at_level(logging.ERROR, "sessionpin"):
            assert p.bundle.response(f) is None
    finally:
        p.close()
    assert seen == ["lineage", "ledger"]
    assert "sessionpin: Router.response failed" in [r.getMessage() for r in caplog.records]


def test_configure_reaches_every_part_past_a_failing_one_and_an_options_error_stops_it(cfg_path, monkeypatch, caplog):
    reached = []
    monkeypatch.setattr(PageGuard, "configure", _boom)
    monkeypatch.setattr(LedgerWatch, "configure", lambda self, updated: reached.append("ledger"))
    p = start(cfg_path)
    try:
        assert reached and set(reached) == {"ledger"}     # (start configures twice, as the loader does)
        assert "sessionpin: PageGuard.configure failed" in [r.getMessage() for r in caplog.records]

        def refuse(self, updated):
            raise exceptions.OptionsError("no")
        monkeypatch.setattr(BodyLimit, "configure", refuse)
        bundle = make_addons([])[0]
        reached.clear()
        with pytest.raises(exceptions.OptionsError):
            bundle.configure({"sessionpin_max_body_mb"})
        assert reached == []                 # as mitmproxy's chain: an option refused stops there
    finally:
        p.close()


async def test_an_awaitable_a_part_returns_is_awaited_before_the_next_part_runs():
    order = []

    async def slow():
        await asyncio.sleep(0.01)
        order.append("first, awaited")

    def first(x):
        return slow()

    def second(x):
        order.append("second")

    def third(x):
        raise RuntimeError("logged, not raised")

    def fourth(x):
        order.append("fourth")

    pending = _sync((first, second, third, fourth), "response", object())
    assert order == []
    await pending
    assert order == ["first, awaited", "second", "fourth"]
    assert _sync((second, fourth), "response", object()) is None     # nothing to await: stays sync


def test_every_participant_has_the_whole_interface():
    """The OpenCode id pool may not import the shell (a layer contract): it keeps the
    interface by having every method, and the router calls them without looking."""
    names = {n for n in dir(Participant) if not n.startswith("_")} | {"name"}
    bundle = make_addons()[0]
    for p in bundle.participants:
        assert isinstance(p, Participant), type(p).__name__
        missing = {n for n in names if not hasattr(p, n)}
        assert not missing, (type(p).__name__, missing)
    assert any(isinstance(p, PoolParticipant) for p in bundle.participants)
    assert {"configure_store", "running", "done", "wants", "request", "responseheaders", "status",
            "metrics", "name"} <= names
    for p in bundle.participants:
        if isinstance(p, PoolParticipant):
            p.done()


async def test_a_parts_state_in_a_flow_goes_with_the_flow_and_no_copy_carries_it(cfg_path):
    p = start(cfg_path)
    try:
        f = flow()
        await p.send(f)
        f.response = tutils.tresp(headers=[(b"content-type", b"text/event-stream")])
        p.bundle.responseheaders(f)
        assert perflow.LINEAGE in f.metadata and perflow.LEDGER in f.metadata and perflow.BODY in f.metadata
        copied = f.copy()                       # mitmproxy's duplicate, replay and save copy the metadata
        assert copied.metadata[perflow.LINEAGE] is None and copied.metadata[perflow.LEDGER] is None
        assert copied.metadata[perflow.BODY] is None
        assert copied.metadata["sessionpin"]["session"] == SESSION
        await _settle(p.bundle.response(f))
        assert not {k for k in f.metadata if k.startswith("sessionpin.")}
    finally:
        p.close()


async def test_the_routers_body_members_go_with_an_error_too(cfg_path):
    p = start(cfg_path)
    try:
        f = flow()
        await p.send(f)
        assert perflow.BODY in f.metadata        # the facts' decode of the body, for the ledger
        f.error = tflow.terr()
        await _settle(p.bundle.error(f))
        assert perflow.BODY not in f.metadata
    finally:
        p.close()


async def _settle(got):
    if got is not None:
        await got


def test_a_part_left_out_for_a_benchmark_is_never_called():
    """``bench_proxy.py --no-lineage/--no-ledger``: the router without that part."""
    from sessionpin.proxy.bundle import Idle

    bundle = make_addons([], without=("lineage", "ledger"))[0]
    assert isinstance(bundle.lineage, Idle) and isinstance(bundle.ledger, Idle) and bundle.router.lineage is None
    f = tflow.tflow(resp=True)
    assert bundle.response(f) is None and bundle.error(f) is None
    bundle.done()
    whole = make_addons([])[0]
    assert isinstance(whole.router.lineage, LineageWatch) and isinstance(whole.ledger, LedgerWatch)
    whole.done()


SSE_WITH_USAGE = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","model":"glm-4.6","content":[],'
    b'"usage":{"input_tokens":3,"cache_read_input_tokens":0,"cache_creation_input_tokens":900,"output_tokens":1}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hello."}}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":5}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


async def _answered(p, f) -> None:
    """The response through the bundle's hooks, as mitmproxy hands it: headers, the stream, the end."""
    f.response = tutils.tresp(status_code=200, content=b"", headers=http.Headers(
        [(b"content-type", b"text/event-stream"), (b"request-id", b"req_stop_1")]))
    f.response.headers.pop("content-length", None)
    p.bundle.responseheaders(f)
    for chunk in SSE_WITH_USAGE + [b""]:
        f.response.stream(chunk)
    await _settle(p.bundle.response(f))


async def test_a_clean_stop_writes_the_records_the_watches_hold_back_before_the_store_closes(cfg_path, tmp_path):
    """SIGTERM right after a turn, inside the watches' batching window (reads gather 50 ms,
    records 100-200 ms): the lineage's root and anchor and the ledger's turn are written before
    the store closes. Before, the store closed first and the watches' flushes found none."""
    from sessionpin.accounting import ledger
    from sessionpin.records import lineindex
    from sessionpin.store import open_store

    url = f"file:{tmp_path / 'store'}"
    p = start(cfg_path, sessionpin_store=url)
    f = flow("continuation")
    await p.send(f)
    await _answered(p, f)
    assert p.bundle.lineage.busy() and p.bundle.ledger.busy()      # nothing written yet
    p.tctx.master.should_exit.set()                                  # mitmproxy is stopping
    await asyncio.wait_for(_settle(p.bundle.done()), 30)             # mitmproxy awaits what it returns
    assert p.runtime.store is None                                   # closed, after the records
    assert not p.bundle.lineage.busy() and not p.bundle.ledger.busy()
    store = open_store(url)
    try:
        assert len(await store.keys("lin:claude-code:root:")) == 1
        assert await store.keys("lin:claude-code:req:req_stop_1@")
        assert (await ledger.load(store, SESSION)).turns == 1
    finally:
        await store.close()


async def test_a_stop_waits_for_pending_records_at_most_the_drain_timeout(cfg_path, monkeypatch, caplog):
    """A store that does not take the records: the stop goes on after ``DRAIN_TIMEOUT``, with one
    warning, and every part's ``done`` still runs (the store is closed)."""
    from sessionpin.proxy import bundle as B

    async def never(self) -> None:
        await asyncio.Event().wait()
    monkeypatch.setattr(B, "DRAIN_TIMEOUT", 0.2)
    monkeypatch.setattr(LineageWatch, "drain", never)
    p = start(cfg_path)
    f = flow("continuation")
    await p.send(f)
    assert p.bundle.lineage.busy()
    p.tctx.master.should_exit.set()
    with caplog.at_level(logging.WARNING, logger="sessionpin"):
        await asyncio.wait_for(_settle(p.bundle.done()), 10)
    assert p.runtime.store is None
    assert [r.getMessage() for r in caplog.records if "at exit" in r.getMessage()] == [
        "sessionpin: at exit: lineage records and ledger turns not written within 0.2 s: dropped "
        "(forks of those conversations may be left alone)"]

