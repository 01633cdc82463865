"""The service the addon calls: scope, routing decisions, observation, fallbacks, the loop."""
import asyncio
from types import SimpleNamespace

import pytest

import sessionpin.opencode_ids as pool
from fakegateway import FakeClock, ScriptedProbe
from sessionpin.opencode_ids import state
from sessionpin.opencode_ids.options import OPTIONS, PoolConfig
from sessionpin.opencode_ids.participant import PoolParticipant
from sessionpin.opencode_ids.service import PoolService, conversation_of, scope_of
from sessionpin.opencode_ids.signals import ProbeResult
from sessionpin.store import identity, open_store
from sessionpin.store.aio import Inline
from sessionpin.decision.steps import Refuse
from sessionpin.store.base import READS, WRITES, NotDurable, StoreUnavailable
from sessionpin.store.memory import MemoryStore

GW = "https://opencode.ai"
CHAT = GW + "/zen/go/v1/chat/completions"
M = "deepseek-v4.1-flash"
AUTH = {"authorization": "Bearer k1"}
FAST = ProbeResult("fast", 200, 900, "upstream")
SLOW = ProbeResult("slow", 200, 20_000, "upstream")


@pytest.mark.parametrize("method,url,expect", [
    ("POST", CHAT, ("opencode-go", "chat/completions")),
    ("POST", GW + "/zen/v1/messages", ("opencode", "messages")),
    ("POST", GW + "/zen/v1/responses?x=1", ("opencode", "responses")),
    ("post", "https://OPENCODE.AI:443/zen/v1/chat/completions", ("opencode", "chat/completions")),
    ("GET", CHAT, None),
    ("POST", GW + "/zen/v1/models", None),
    ("POST", GW + "/inference/v1/chat/completions", None),
    ("POST", "https://api.anthropic.com/v1/messages", None),
    ("POST", "http://opencode.ai/zen/v1/messages", None),
    ("POST", "not a url", None),
])
def test_scope(method, url, expect):
    sc = scope_of(PoolConfig(), method, url)
    assert (sc and (sc.provider, sc.kind)) == (expect or None)


def test_scope_off_switch_and_custom_gateway():
    assert scope_of(PoolConfig(enabled=False), "POST", CHAT) is None
    cfg = PoolConfig(gateways=("https://127.0.0.1:9443",))
    assert scope_of(cfg, "POST", "https://127.0.0.1:9443/zen/v1/messages").provider == "opencode"
    assert scope_of(cfg, "POST", CHAT) is None


def test_conversation_prefers_the_client_header_then_the_reader():
    assert conversation_of({"x-opencode-session": "ses_1"}, "fp:abc") == "ses_1"
    assert conversation_of({}, "fp:abc") == "fp:abc"
    assert conversation_of({"x-opencode-session": "x" * 300}, None) is None
    assert conversation_of({"x-opencode-session": "a\nb"}, "fp:z") == "fp:z"


def make(cfg=PoolConfig(), script=(), default=None, takes_ms=1000):
    clock = FakeClock()
    scripted = ScriptedProbe(clock, script, default=default, takes_ms=takes_ms)

    async def probe(target, sid, timeout):
        return await scripted(sid, timeout)

    svc = PoolService(cfg, open_store("memory:"), clock=clock, probe=probe)
    return svc, clock, scripted


async def add_spare(svc, clock, sid, provider="opencode-go", model=M):
    await state.add_spare(svc.store, provider, model, sid, state.Spare(upstream_ms=900, verified_at=clock.now,
                                                                        created_at=clock.now))


async def test_opencode_client_gets_a_fresh_spare_then_keeps_it():
    svc, clock, _ = make()
    await add_spare(svc, clock, "spare-1")
    h = {"X-OpenCode-Session": "ses_abc", **AUTH}
    r = await svc.route("POST", CHAT, h, session="ses_abc", model=M)
    assert (r.routed_id, r.how, r.client_id) == ("spare-1", "spare", "ses_abc")
    assert r.key == "ses_abc::opencode-go::deepseek-v4.1-flash"
    await add_spare(svc, clock, "spare-2")
    again = await svc.route("POST", CHAT, h, session="ses_abc", model=M)
    assert (again.routed_id, again.how) == ("spare-1", "binding")
    assert svc.refill_at == clock.now + svc.cfg.refill_delay_ms       # a take asks for a refill


async def test_no_spare_no_budget_opencode_keeps_its_own_id_pi_gets_one_id_for_good():
    svc, clock, probe = make()
    oc = await svc.route("POST", CHAT, {"x-opencode-session": "ses_1", **AUTH}, session="ses_1", model=M)
    assert (oc.routed_id, oc.how, oc.observed) == ("ses_1", "client", False)
    pi1 = await svc.route("POST", CHAT, AUTH, session="fp:0123", model=M)
    assert pi1.how == "fresh" and pi1.client_id is None
    await add_spare(svc, clock, "spare-1")
    pi2 = await svc.route("POST", CHAT, AUTH, session="fp:0123", model=M)
    assert pi2.routed_id == pi1.routed_id and pi2.how == "binding"
    assert probe.calls == []                                        # nothing on the request path


@pytest.mark.parametrize("kwargs", [
    dict(method="POST", url=CHAT, headers={"x-opencode-session": "s"}, session="s", model=M),   # no credentials
    dict(method="POST", url=CHAT, headers=AUTH, session=None, model=M),                          # no conversation
    dict(method="POST", url=CHAT, headers=AUTH, session="s", model=None),                        # no model
    dict(method="GET", url=CHAT, headers=AUTH, session="s", model=M),
])
async def test_left_alone(kwargs):
    svc, *_ = make()
    assert await svc.route(**kwargs) is None


async def test_concurrent_requests_of_one_key_share_one_acquisition():
    svc, clock, probe = make(PoolConfig(startup_budget_ms=5000), [FAST])
    h = {"x-opencode-session": "ses_1", **AUTH}
    a, b = await asyncio.gather(*(svc.route("POST", CHAT, h, session="ses_1", model=M, opening=True)
                                  for _ in range(2)))
    assert a.routed_id == b.routed_id and a.how == "probe" and len(probe.calls) == 1
    assert svc.counters["deduped"] == 1


async def test_failed_budgeted_acquisition_cools_the_key_down():
    cfg = PoolConfig(request_budget_ms=3000, min_probe_interval_ms=0)
    svc, clock, probe = make(cfg, default=SLOW, takes_ms=1000)
    h = {"x-opencode-session": "ses_1", **AUTH}
    first = await svc.route("POST", CHAT, h, session="ses_1", model=M)
    assert first.how == "client" and len(probe.calls) == 2 and svc.counters["cooldowns"] == 1
    await svc.route("POST", CHAT, h, session="ses_1", model=M)
    assert len(probe.calls) == 2                                     # no second tax
    clock.now += cfg.probe_cooldown_ms
    await svc.route("POST", CHAT, h, session="ses_1", model=M)
    assert len(probe.calls) == 4


async def test_startup_budget_applies_to_the_opening_request_only():
    svc, clock, probe = make(PoolConfig(startup_budget_ms=5000), [FAST])
    h = {"x-opencode-session": "ses_9", **AUTH}
    assert (await svc.route("POST", CHAT, h, session="ses_9", model=M)).how == "client"
    assert probe.calls == []
    assert (await svc.route("POST", CHAT, h, session="ses_9", model=M, opening=True)).how == "probe"


async def test_rejected_key_blocks_until_a_new_key_is_seen():
    svc, clock, probe = make(PoolConfig(request_budget_ms=5000), [ProbeResult("unauthorized", 401)], default=FAST)
    await svc.route("POST", CHAT, {"x-opencode-session": "a", **AUTH}, session="a", model=M)
    await svc.route("POST", CHAT, {"x-opencode-session": "b", **AUTH}, session="b", model=M)
    assert len(probe.calls) == 1
    r = await svc.route("POST", CHAT, {"x-opencode-session": "c", "authorization": "Bearer k2"}, session="c", model=M)
    assert r.how == "probe" and len(probe.calls) == 2


async def test_observe_retires_and_the_next_request_gets_a_new_id():
    svc, clock, _ = make()
    await add_spare(svc, clock, "s1")
    await add_spare(svc, clock, "s2")
    h = {"x-opencode-session": "ses_1", **AUTH}
    r = await svc.route("POST", CHAT, h, session="ses_1", model=M)
    assert await svc.observe(r, 200, {"Server-Timing": "upstream;dur=9000"}) == "retire"
    r2 = await svc.route("POST", CHAT, h, session="ses_1", model=M)
    assert r2.routed_id != r.routed_id and r2.how == "spare"
    assert await svc.observe(r, 200, {"server-timing": "upstream;dur=100"}) == "unbound"


class UnwritableStore(MemoryStore):
    """The real memory store whose writes fail as the contract says a failing disk's do."""

    def _fail(self, *a, **k):
        raise NotDurable("file:/broken: disk is gone")

    apply = cas = set = hset = hsetnx = hdel = _fail


class FailingStore(MemoryStore):
    """The real memory store, every call of which fails while ``failures`` > 0 (one used per call)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.failures = 0

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in READS | WRITES and super().__getattribute__("failures") > 0:
            def fail(*a, **k):
                self.failures -= 1
                raise StoreUnavailable("file:/shared: database is locked")
            return fail
        return attr


async def test_unwritable_store_refuses_what_it_cannot_bind_and_keeps_no_private_store():
    svc, clock, _ = make()
    svc.configure(svc.cfg, Inline(UnwritableStore("memory:")))
    r = await svc.route("POST", CHAT, AUTH, session="fp:1", model=M)
    assert isinstance(r, Refuse) and r.status == 503 and r.retry_after and r.kind == "pool-store"
    assert "file:/broken: disk is gone" in r.message and "was not sent" in r.message
    assert svc.counters["store_errors"] == 2 and svc.counters["refused_store"] == 1   # tried twice
    again = await svc.route("POST", CHAT, AUTH, session="fp:1", model=M)
    assert isinstance(again, Refuse)                   # no id made up in memory, not even the second time
    # a client that sent its own id and needs no write keeps it: the store's reads answer
    own = await svc.route("POST", CHAT, {"x-opencode-session": "ses_own", **AUTH}, session=None, model=M)
    assert own.how == "client" and own.routed_id == "ses_own"


async def test_a_store_error_never_splits_bindings_between_proxies():
    """Two proxies share one store; one meets a store error. Was: it switched to a private
    memory store for the rest of the process, so it bound the conversation to an id the other
    proxy never saw (and that a restart forgot)."""
    shared = FailingStore("memory:")
    a, clock, _ = make()
    b = PoolService(a.cfg, Inline(shared), clock=clock, probe=lambda *x: None)
    a.configure(a.cfg, Inline(shared))
    shared.failures = 2                          # the call and its retry
    refused = await a.route("POST", CHAT, AUTH, session="fp:1", model=M)
    assert isinstance(refused, Refuse)
    assert shared.failures == 0                  # the store answers again
    first = await a.route("POST", CHAT, AUTH, session="fp:1", model=M)
    assert first.how == "fresh"
    other = await b.route("POST", CHAT, AUTH, session="fp:1", model=M)
    assert other.routed_id == first.routed_id and other.how == "binding"
    assert a.store.backend is b.store.backend is shared     # the shared store, not a private one


async def test_one_store_error_is_retried_on_the_same_store():
    shared = FailingStore("memory:")
    svc, clock, _ = make()
    svc.configure(svc.cfg, Inline(shared))
    await add_spare(svc, clock, "s1")
    shared.failures = 1
    r = await svc.route("POST", CHAT, {"x-opencode-session": "ses_1", **AUTH}, session="ses_1", model=M)
    assert r.how == "spare" and r.routed_id == "s1" and svc.counters["store_errors"] == 1
    assert (await state.binding(svc.store, r.key)).routed_id == "s1"     # in the shared store
    shared.failures = 1                          # a failed observation is dropped, never moved elsewhere
    assert await svc.observe(r, 200, {"server-timing": "upstream;dur=10"}) == "error"
    assert svc.store.backend is shared


async def test_a_refused_pool_request_is_answered_by_the_router_in_the_agents_format():
    part = PoolParticipant(pool.Manager())
    part.configure({o.name: o.default for o in OPTIONS})
    part.configure_store(Inline(UnwritableStore("memory:")))
    flow = SimpleNamespace(response=None, metadata={}, comment="",
                           request=SimpleNamespace(method="POST", url=CHAT, headers={"authorization": "Bearer k1"},
                                                   raw_content=b""))
    facts = SimpleNamespace(session="s9", session_source="metadata.user_id", model=M,
                            has_history=True)   # no budget: no probe
    got = await part.request(flow, facts)
    assert isinstance(got, Refuse) and got.status == 503
    assert flow.request.headers == {"authorization": "Bearer k1"} and flow.metadata == {}   # nothing changed


async def _bound(svc, clock, conv="ses_del"):
    await add_spare(svc, clock, "spare-1")
    await add_spare(svc, clock, "spare-2")
    h = {"x-opencode-session": conv, **AUTH}
    r = await svc.route("POST", CHAT, h, session=conv, model=M)
    assert r.routed_id == "spare-1"
    return h, r


async def test_a_binding_deleted_while_its_id_record_names_it_is_refused_not_given_a_new_id(caplog):
    """A cleanup deletes a conversation's binding; its id's record still names the key. Before,
    the next request took the next spare: the conversation's id changed mid-way."""
    svc, clock, _ = make()
    h, r = await _bound(svc, clock)
    assert await svc.store.delete(state.bind_key(r.key))
    assert await svc.store.get(state.id_key("spare-1")) == r.key
    clock.now += 60_000
    for _ in range(2):                      # refused each time, said once
        got = await svc.route("POST", CHAT, h, session="ses_del", model=M)
        assert isinstance(got, Refuse) and (got.status, got.kind, got.retry_after) == (424, "pool-lost", None)
        assert "ses_del" in got.message and "store copy" in got.message
    assert "spare-2" in await state.spares(svc.store, "opencode-go", M)          # no spare taken
    assert await state.binding(svc.store, r.key) is None
    assert svc.counters["refused_lost"] == 2
    assert sum("is gone from store" in rec.getMessage() for rec in caplog.records) == 1


async def test_a_binding_and_its_id_record_deleted_within_the_hour_are_a_loss_but_not_later():
    """Both deleted less than an hour after this proxy routed the binding: a retirement since
    would have left its tombstone, so this is a loss. Later (a tombstone may have expired), or
    on a proxy that never routed the key, nothing says it was one: a new conversation."""
    svc, clock, _ = make()
    h, r = await _bound(svc, clock)
    assert await svc.store.delete(state.bind_key(r.key)) and await svc.store.delete(state.id_key("spare-1"))
    clock.now += 10 * 60_000
    got = await svc.route("POST", CHAT, h, session="ses_del", model=M)
    assert isinstance(got, Refuse) and got.kind == "pool-lost"
    other = make()[0]                        # another proxy on a store of its own, which never routed it
    await add_spare(other, clock, "spare-9")
    assert (await other.route("POST", CHAT, h, session="ses_del", model=M)).routed_id == "spare-9"
    clock.now += int(state.KEEP_RETIRED_S * 1000)
    await add_spare(svc, clock, "spare-3")
    got = await svc.route("POST", CHAT, h, session="ses_del", model=M)
    assert got.routed_id == "spare-3" and got.how == "spare"


async def test_a_retired_binding_takes_a_new_id_and_that_one_deleted_is_refused():
    """A retirement leaves its tombstone: the next request takes a new id, as before; the
    binding it makes is watched as the first was."""
    svc, clock, _ = make()
    h, r = await _bound(svc, clock)
    assert await state.retire(svc.store, r.key, "spare-1", clock.now)
    got = await svc.route("POST", CHAT, h, session="ses_del", model=M)
    assert got.routed_id == "spare-2" and got.how == "spare"
    assert await svc.store.delete(state.bind_key(r.key))
    await add_spare(svc, clock, "spare-3")
    got = await svc.route("POST", CHAT, h, session="ses_del", model=M)
    assert isinstance(got, Refuse) and got.kind == "pool-lost"


async def test_probe_credentials_stay_in_memory_and_are_replaced():
    svc, clock, _ = make()
    await svc.route("POST", CHAT, {"authorization": "Bearer k1", "x-opencode-session": "a", "cookie": "c"},
                    session="a", model=M)
    (t,) = svc.targets.values()
    assert dict(t.probe_target.headers) == {"authorization": "Bearer k1"}
    await svc.route("POST", CHAT, {"authorization": "Bearer k2"}, session="fp:1", model=M)
    assert dict(t.probe_target.headers) == {"authorization": "Bearer k2"}
    dump = repr([await svc.store.hgetall(k) if k.startswith(state.SPARE_PREFIX) or k == identity.MADE_KEY
                 else await svc.store.get(k) for k in await svc.store.keys("")])
    assert "k1" not in dump and "k2" not in dump and "opencode.ai" not in dump


# ---- the loop and its survival across a reload --------------------------------------------

def real(cfg, script=(), default=None):
    """A service on the real clock (short delays) with a scripted probe."""
    calls = []

    async def probe(target, sid, timeout):
        calls.append(sid)
        item = script.pop(0) if script else default
        if isinstance(item, float):
            await asyncio.sleep(item)
            return FAST
        return item or FAST

    return PoolService(cfg, open_store("memory:"), probe=probe), calls


async def until(cond, timeout=5.0):
    """Poll a condition (a function, sync or async) on the real clock (generous: CI machines are busy)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        ok = cond()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def spares_are(store, n):
    async def check():
        return len(await state.spares(store, "opencode-go", M)) == n
    return check


LOOP_CFG = PoolConfig(size=1, refill_delay_ms=50, refresh_interval_ms=1000, min_probe_interval_ms=0)


async def test_first_run_is_delayed_then_the_pool_fills_and_start_is_idempotent():
    svc, calls = real(LOOP_CFG)
    await svc.route("POST", CHAT, AUTH, session="fp:1", model=M)   # learns a target
    svc.start()
    task = svc._task
    svc.start()
    assert svc._task is task
    await asyncio.sleep(0.02)
    assert calls == []                                             # delayed by refill_delay_ms
    await until(spares_are(svc.store, 1))
    svc.stop()
    await asyncio.sleep(0)


async def test_manager_survives_a_reload_without_a_second_loop_or_a_lost_spare():
    manager = pool.Manager()       # the proxy's (kept on mitmproxy's master): the same across a reload
    try:
        store = open_store("memory:")
        clock = FakeClock()
        old_spare = state.Spare(upstream_ms=900, verified_at=clock.now - 10**9, created_at=clock.now - 10**9)
        gate = asyncio.Event()

        async def probe(target, sid, timeout):
            await gate.wait()
            return FAST

        old, new = object(), object()
        svc = manager.attach(old, LOOP_CFG, store, probe=probe)
        await svc.route("POST", CHAT, AUTH, session="fp:1", model=M)
        await state.add_spare(store, "opencode-go", M, "stale-1", old_spare)
        manager.start(old)
        await until(spares_are(store, 0))   # the cycle is probing stale-1
        first_task = svc._task
        # mitmproxy's reload: done() on the old addon, then load/configure/running on the new one
        manager.detach(old)
        assert manager.attach(new, LOOP_CFG, store) is svc
        manager.start(new)
        await until(first_task.done)
        assert first_task.cancelled()        # no orphan probe
        assert "stale-1" in await state.spares(store, "opencode-go", M)   # no lost spare
        loops = [t for t in asyncio.all_tasks() if t.get_name() == "sessionpin-pool" and not t.done()]
        assert loops == [svc._task]                                 # one loop
        await until(lambda: svc.loops_alive == 1)
        await asyncio.sleep(0.05)
        assert svc.loops_alive == 1
        gate.set()
        manager.detach(new)
        await asyncio.sleep(0.01)
        assert not svc.running
    finally:
        manager.reset()


async def test_a_take_wakes_the_loop_for_a_refill_after_refill_delay():
    cfg = PoolConfig(size=1, refill_delay_ms=50, refresh_interval_ms=60_000, min_probe_interval_ms=0)
    svc, calls = real(cfg)
    await svc.route("POST", CHAT, AUTH, session="fp:1", model=M)
    svc.start()
    try:
        await until(spares_are(svc.store, 1))
        assert svc.counters["cycles"] == 1
        took = await svc.route("POST", CHAT, {"x-opencode-session": "ses_new", **AUTH}, session="ses_new", model=M)
        assert took.how == "spare" and await state.spares(svc.store, "opencode-go", M) == {}
        await until(spares_are(svc.store, 1))   # long before the 60 s period
        assert svc.counters["cycles"] == 2
    finally:
        svc.stop()
        await asyncio.sleep(0)
