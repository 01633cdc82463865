"""The pool's participant and options addon on real mitmproxy flows (taddons, tflow)."""
import asyncio
import json
import time

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons, tflow, tutils

from sessionpin.decision import ladder
from sessionpin.opencode_ids import Manager, state
from sessionpin.reader import facts as F
from sessionpin.opencode_ids.options import OPTIONS
from sessionpin.opencode_ids.participant import META, PoolOptions, PoolParticipant
from sessionpin.store import open_store

M = "deepseek-v4.1-flash"


def flow(headers, host="opencode.ai", path="/zen/go/v1/chat/completions", messages=None):
    body = json.dumps({"model": M, "messages": messages or [{"role": "user", "content": "hi"}]}).encode()
    req = tutils.treq(method=b"POST", scheme=b"https", host=host, port=443, path=path.encode(), content=body)
    req.headers.clear()
    for k, v in headers:
        req.headers.add(k, v)
    return tflow.tflow(req=req)


@pytest.fixture
def wired():
    manager = Manager()
    p = PoolParticipant(manager)
    opts = PoolOptions(p, exceptions.OptionsError)
    with taddons.context(opts) as tctx:
        store = open_store("memory:")
        p.configure_store(store)
        tctx.configure(opts, sessionpin_pool_size=1)
        yield p, opts, tctx, store
    manager.reset()


def test_every_option_is_registered_and_bad_values_are_option_errors(wired):
    p, opts, tctx, _ = wired
    for o in OPTIONS:
        assert o.name in tctx.options
    assert p.service.cfg.size == 1
    with pytest.raises(exceptions.OptionsError, match="gateways"):
        tctx.configure(opts, sessionpin_pool_gateways="https://user:pw@opencode.ai")


async def test_request_rewrites_only_the_session_header_and_responseheaders_observes(wired):
    p, _, _, store = wired
    now = int(time.time() * 1000)
    await state.add_spare(store, "opencode-go", M, "spare-1", state.Spare(upstream_ms=900, verified_at=now, created_at=now))
    headers = [("User-Agent", "opencode/1.18.33"), ("Authorization", "Bearer k"), ("X-OpenCode-Session", "ses_1"),
               ("x-opencode-project", "prj")]
    f = flow(headers)
    await p.request(f)
    assert f.request.headers["x-opencode-session"] == "spare-1"
    assert [(k.lower(), v) for k, v in f.request.headers.items(multi=True) if k.lower() != "x-opencode-session"] == \
        [(k.lower(), v) for k, v in headers if k.lower() != "x-opencode-session"]
    assert f.metadata[META]["how"] == "spare" and f.metadata[META]["client_id"] == "ses_1"
    assert f.comment.endswith("pool: spare spare-1")
    f.response = tutils.tresp(status_code=429)
    task = p.responseheaders(f)     # observed in a task of its own: the stream does not wait
    assert not task.done()
    assert await task == "retire"
    assert await state.is_retired(store, "spare-1")
    text = await p.metrics()
    assert 'sessionpin_pool_events_total{event="retired_429"} 1' in text


async def test_requests_elsewhere_and_the_off_switch_are_left_alone(wired):
    p, opts, tctx, _ = wired
    f = flow([("authorization", "Bearer k"), ("x-opencode-session", "ses_1")], host="api.anthropic.com",
             path="/v1/messages")
    await p.request(f)
    assert f.request.headers["x-opencode-session"] == "ses_1" and META not in f.metadata
    tctx.configure(opts, sessionpin_pool=False)
    g = flow([("authorization", "Bearer k")])
    await p.request(g)
    assert "x-opencode-session" not in g.request.headers


async def test_the_gateway_host_check_follows_the_configured_gateways(wired):
    """The cheap host check before the scope's: a gateway's host in any case routes, a new
    gateway list takes effect at once (a self-hosted gateway on its own port), others not."""
    p, opts, tctx, _ = wired
    pi = [("user-agent", "opencode/1"), ("authorization", "Bearer k"), ("x-opencode-session", "ses_1")]
    f = flow(pi, host="OpenCode.AI")
    await p.request(f)
    assert f.metadata[META]["how"] == "client"
    tctx.configure(opts, sessionpin_pool_gateways="https://gw.example.test:8443")
    for host, routed in (("opencode.ai", False), ("gw.example.test", False), ("GW.example.test", False)):
        g = flow(pi, host=host)
        await p.request(g)
        assert (META in g.metadata) is routed, host
    h = flow(pi, host="gw.example.test")
    h.request.port = 8443
    await p.request(h)
    assert h.metadata[META]["how"] == "client"


PI = [("user-agent", "pi"), ("authorization", "Bearer k")]
OPENING = [{"role": "system", "content": "pi"}, {"role": "user", "content": "go"}]


def routed_pi(messages, resolved: str | None, pin_action=ladder.CREATE):
    """A pi request (no id of its own: a fingerprint session) as the router leaves it: the
    session it resolved in the flow's metadata, and its decision."""
    f = flow(PI, messages=messages)
    facts = F.read(f.request.method, f.request.url, f.request.headers.fields, f.request.raw_content, None)
    assert facts.session_source == "fingerprint" and facts.session.startswith("fp:")
    f.metadata["sessionpin"] = {"session": resolved if resolved is not None else facts.session}
    return f, facts, ladder.Decision("zen", pin_action, ladder.Rule.OPENING, "pinned")


async def test_pi_shaped_request_gets_a_session_header(wired):
    p, *_ = wired
    f, facts, decision = routed_pi(OPENING, "fp:x.1")
    await p.request(f, facts, decision)
    assert f.metadata[META]["how"] == "fresh" and f.request.headers["x-opencode-session"] == f.metadata[META]["id"]
    assert f.metadata[META]["key"].startswith("fp:x.1::")


async def test_two_pi_conversations_that_opened_alike_are_keyed_by_the_routers_sessions(wired):
    """One fingerprint (the same opening), two conversations the router told apart (a nonce
    each, then their lineage): two bindings, two ids; each keeps its own on its next turn."""
    p, *_ = wired
    ids = {}
    for resolved in ("fp:x.a", "fp:x.b"):
        f, facts, decision = routed_pi(OPENING, resolved)
        await p.request(f, facts, decision)
        ids[resolved] = f.request.headers["x-opencode-session"]
    assert ids["fp:x.a"] != ids["fp:x.b"]
    for resolved in ("fp:x.a", "fp:x.b"):
        turn2 = [*OPENING, {"role": "assistant", "content": resolved}, {"role": "user", "content": "on"}]
        f, facts, decision = routed_pi(turn2, resolved, ladder.RENEW)
        await p.request(f, facts, decision)
        assert f.request.headers["x-opencode-session"] == ids[resolved]


@pytest.mark.parametrize("how", ["no router", "bare fingerprint", "no pin", "refused"])
async def test_a_pi_conversation_the_router_did_not_resolve_is_keyed_by_its_fingerprint(wired, caplog, how):
    """Without the router's resolution (the gateway is not a server it routes: an opening's
    nonce that no later turn finds, then the fingerprint alone), the fingerprint keys the
    binding, as before: the gateway answers (it refuses a request without an id), and the log
    says once that conversations that opened alike then share an id, with the way out."""
    p, *_ = wired
    f, facts, decision = routed_pi(OPENING, None if how == "bare fingerprint" else "fp:x.1",
                                   ladder.NONE if how == "no pin" else ladder.CREATE)
    if how == "refused":
        decision = ladder.Decision(None, ladder.CREATE, ladder.Rule.OPENING, "x", refuse=424)
    with caplog.at_level("WARNING", logger="sessionpin.opencode_ids.service"):
        if how == "no router":
            await p.request(f)
        else:
            await p.request(f, facts, decision)
    assert f.request.headers.get("x-opencode-session") and META in f.metadata
    assert p.status()["counters"]["routed_unresolved"] == 1
    assert "only the fingerprint of its opening names" in caplog.text
    bound = await state.bindings(p.service.store)
    assert len(bound) == 1 and facts.session in next(iter(bound))       # keyed by the fingerprint


async def test_mitmproxys_upstream_options_reach_the_pools_probes(wired, caplog):
    p, opts, tctx, _ = wired
    assert p.service.cfg.upstream.proxy is None
    caplog.set_level("INFO", logger="sessionpin.opencode_ids.service")
    tctx.options.update(mode=["upstream:http://corp.example:3128@8081"], ssl_insecure=True)   # mitmproxy's own
    up = p.service.cfg.upstream
    assert (up.proxy, up.insecure) == ("http://corp.example:3128", True)
    assert "probes go through the upstream proxy http://corp.example:3128" in caplog.text
    with pytest.raises(exceptions.OptionsError, match="not an http\\(s\\) upstream proxy"):
        tctx.options.update(mode=["upstream:socks5://corp.example:1080"])


async def test_running_and_done_start_and_stop_one_loop(wired):
    p, *_ = wired
    p.running()
    assert p.service.running and p.status()["refresh_running"]
    p.done()
    assert not p.service.running


def test_a_reloaded_script_finds_its_proxys_pool_and_another_proxy_has_its_own():
    """Issue 21: no process global. The pool's manager is kept on mitmproxy's master, which
    a script reload keeps (the addons are built anew): the reloaded participant gets the
    same pool; another proxy (another master) gets its own."""
    from types import SimpleNamespace

    from sessionpin.opencode_ids import manager_of

    with taddons.context() as a, taddons.context() as b:
        parts = []
        for tctx in (a, a, b):         # proxy a's script, reloaded once; then proxy b
            p = PoolParticipant()
            PoolOptions(p).load(SimpleNamespace(master=tctx.master, add_option=lambda *args, **kw: None))
            parts.append(p)
        assert parts[0].manager is parts[1].manager is manager_of(a.master)
        assert parts[2].manager is manager_of(b.master) and parts[2].manager is not parts[0].manager
    given = Manager()
    p = PoolParticipant(given)
    PoolOptions(p).load(SimpleNamespace(master=SimpleNamespace(options=None), add_option=lambda *args, **kw: None))
    assert p.manager is given           # a manager handed in (tests) is kept


async def test_the_pool_shares_the_routers_file_store_and_keeps_it_when_the_router_closes(tmp_path):
    """Issue 22: one backend per file per process (a second open ran a second writer and a
    second background check of both files); the router's handle closing leaves the pool's open."""
    from sessionpin.store import open_store

    router_store = open_store(f"file:{tmp_path / 'state.db'}")
    own = Manager._own(router_store)
    try:
        assert own is not router_store and own.backend is router_store.backend
        await router_store.close()
        await own.set("pool:probe", "1")
        assert await own.get("pool:probe") == "1"
    finally:
        await own.close()
    assert router_store.backend._writer.state.value == "closed"


async def test_the_observation_does_not_run_inside_the_hook_on_an_eager_loop(wired):
    """mitmproxy's loop starts tasks eagerly: the observation's store read and write ran inside
    ``responseheaders``, ahead of the stream (seeds/002 §7). They wait until mitmproxy sent on
    what the hook let go (two turns of the loop)."""
    p, _, _, store = wired
    now = int(time.time() * 1000)
    await state.add_spare(store, "opencode-go", M, "spare-1", state.Spare(upstream_ms=900, verified_at=now, created_at=now))
    f = flow([("User-Agent", "opencode/1.18.33"), ("Authorization", "Bearer k"), ("X-OpenCode-Session", "ses_1")])
    await p.request(f)
    f.response = tutils.tresp(status_code=429)
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)
    try:
        called, real = [], p.service.observe

        async def observe(*args):
            called.append(1)
            return await real(*args)
        p.service.observe = observe
        task = p.responseheaders(f)
        assert called == [] and not task.done()             # nothing of it ran in the hook
        assert await task == "retire" and called == [1]
        assert await state.is_retired(store, "spare-1")
    finally:
        loop.set_task_factory(None)
