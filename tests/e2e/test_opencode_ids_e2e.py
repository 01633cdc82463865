"""The OpenCode id pool end to end: a real mitmdump, real TLS, the fake gateway, real clients' shapes.

One mitmdump serves the module; it runs a copy of addons/route.py (so a test may edit it and
watch mitmproxy reload it), i.e. the real router with the pool wired in by make_addons. The gateway is
the fake of tests/fakegateway.py with a certificate from the harness' test CA; the proxy and
the pool's probes both trust that CA. The pool's state is read back from the same file store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from fakegateway import FakeGateway, is_fast_id
from sessionpin.opencode_ids import report, state
from sessionpin.reader.ids import short
from sessionpin.records import lineindex, pins
from sessionpin.store import identity, open_store

from .harness import Client, Mitmdump, TestCA

RUN = uuid.uuid4().hex[:6]
KEY = "good-key"
MODEL = "deepseek-v4.1-flash"
SCRIPT = (Path(__file__).resolve().parents[2] / "addons" / "route.py").read_text() + "\n# MARKER\n"


@pytest.fixture(scope="module")
def env():
    # Not tmp_path_factory: pytest prunes old base temp dirs of *other* concurrent runs by the
    # same user, which would delete the store under a running mitmdump.
    with tempfile.TemporaryDirectory(prefix="sessionpin-pool-e2e-") as tmp:
        yield from _env(Path(tmp))


def _env(work: Path):
    ca = TestCA(work / "ca")
    gw = FakeGateway(keys={KEY}).start(work, cert_and_key=ca.issue("gateway"), ca=ca.pem)
    script = work / "route_pool.py"
    script.write_text(SCRIPT.replace("MARKER", "v1"))
    (work / "config.toml").write_text("")
    opts = {
        "sessionpin_config": str(work / "config.toml"),
        "sessionpin_store": f"file:{work / 'state.db'}",
        "ssl_verify_upstream_trusted_ca": str(ca.pem),
        "connection_strategy": "lazy",
        "sessionpin_pool_gateways": gw.origin,
        "sessionpin_pool_ca_file": str(ca.pem),
        "sessionpin_pool_size": 2,
        "sessionpin_pool_refill_delay_ms": 200,
        "sessionpin_pool_min_probe_interval_ms": 0,
        "sessionpin_pool_refresh_interval_ms": 1000,
    }
    m = Mitmdump(work, script=script, options=opts)
    m.start()
    yield {"gw": gw, "m": m, "client": Client.via_proxy(m.port, m.mitm_ca), "store_url": opts["sessionpin_store"],
           "script": script, "work": work, "opts": opts}
    m.stop()
    gw.stop()


def chat(env, headers: list[tuple[str, str]], messages: list[dict], path="/zen/go/v1/chat/completions"):
    env["client seen"] = True
    body = json.dumps({"model": MODEL, "messages": messages, "stream": True}).encode()
    return env["client"].request("POST", env["gw"].origin + path, headers=headers, body=body)


def read_store(env, fn):
    """``await fn(store)`` on the proxies' store, from this (synchronous) test."""
    async def run():
        store = open_store(env["store_url"])
        try:
            return await fn(store)
        finally:
            await store.close()
    return asyncio.run(run())


def spares(env) -> dict:
    return read_store(env, lambda store: state.spares(store, "opencode-go", MODEL, drop_bad=False))


def wait_spares(env, n: int, timeout=15.0) -> dict:
    if not env.get("client seen"):      # the pool fills with a client's key: this test runs alone
        chat(env, [*OPENCODE_HEADERS, ("x-opencode-session", f"ses_{RUN}_key")], [{"role": "user", "content": "k"}])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = spares(env)
        if len(s) >= n:
            return s
        time.sleep(0.25)
    raise AssertionError(f"pool did not fill: {spares(env)}\n{env['m'].tail(30)}")


def last_request(env):
    return env["gw"].requests()[-1]


OPENCODE_HEADERS = [("user-agent", "opencode/1.18.33"), ("authorization", f"Bearer {KEY}"),
                    ("x-opencode-project", "prj_1"), ("x-opencode-request", "msg_1"),
                    ("x-opencode-client", "cli"), ("content-type", "application/json")]
PI_HEADERS = [("user-agent", "pi-coding-agent"), ("authorization", f"Bearer {KEY}"),
              ("content-type", "application/json")]


def test_opencode_client_first_keeps_its_id_then_new_conversations_get_verified_spares(env):
    own = f"ses_{RUN}_a"
    r = chat(env, [*OPENCODE_HEADERS, ("x-opencode-session", own)], [{"role": "user", "content": "hi"}])
    assert r.status == 200 and r.events                                # streamed through
    assert last_request(env).session == own                            # no spare yet: its own id
    pool = wait_spares(env, 2)                                         # refilled with the client's key
    assert all(is_fast_id(i) for i in pool)                            # only fast ids were kept
    assert all(p.session not in pool or is_fast_id(p.session) for p in env["gw"].probes())

    other = f"ses_{RUN}_b"
    r = chat(env, [*OPENCODE_HEADERS, ("x-opencode-session", other)], [{"role": "user", "content": "hello"}])
    assert r.status == 200
    routed = last_request(env).session
    assert routed in pool and routed != other
    assert routed not in spares(env)                                   # taken, not shared
    # the same conversation keeps its id; the first one stays on its own id
    chat(env, [*OPENCODE_HEADERS, ("x-opencode-session", other)], [{"role": "user", "content": "again"}])
    assert last_request(env).session == routed


def test_only_the_session_header_changes(env):
    wait_spares(env, 1)
    gw = env["gw"]
    before = len(gw.requests())
    conv = f"ses_{RUN}_c"
    sent = [*OPENCODE_HEADERS, ("X-OpenCode-Session", conv), ("x-opencode-session-id", conv),
            ("x-session-affinity", conv)]
    chat(env, sent, [{"role": "user", "content": "x"}])
    (seen,) = gw.requests()[before:]
    assert seen.session != conv and seen.credential == "authorization"
    plumbing = {"host", "content-length", "x-opencode-session"}
    got = [(k.lower(), v) for k, v in seen.headers if k.lower() not in plumbing]
    want = [(k.lower(), "<redacted>" if k.lower() == "authorization" else v) for k, v in sent
            if k.lower() not in plumbing]
    assert got == want                      # everything else arrives as sent, in order
    assert [v for k, v in seen.headers if k.lower() == "x-opencode-session"] == [seen.session]


ROOTS = lineindex.root_key("pi", "")      # the router's record of a conversation's history root


@contextlib.contextmanager
def gateway_routed_for_pi(env):
    """The gateway configured as a server pi is routed to, so the router tells pi's
    conversations apart (a fingerprint of the opening, a nonce, the lineage) and pins them."""
    m, cfg = env["m"], env["work"] / "config.toml"
    mark = m.line_count
    cfg.write_text(f'[servers.zen]\nurl = "{env["gw"].origin}/zen/go"\n\n[agents.pi]\nserver = "zen"\n')
    assert m.wait_output(r"config reloaded from .*servers: zen", timeout=15, since=mark), m.tail(20)
    try:
        yield
    finally:
        mark = m.line_count
        cfg.write_text("")
        assert m.wait_output(r"config reloaded from .*servers: none", timeout=15, since=mark), m.tail(20)


def test_pi_shaped_client_without_a_session_header_gets_one_id_for_the_whole_conversation(env):
    wait_spares(env, 1)
    with gateway_routed_for_pi(env):
        system = {"role": "system", "content": f"You are pi {RUN}"}
        first = [system, {"role": "user", "content": "list files"}]
        roots = set(read_store(env, lambda st: st.keys(ROOTS)))
        r = chat(env, PI_HEADERS, first)
        assert r.status == 200                         # the gateway got a session header
        routed = last_request(env).session
        assert routed and is_fast_id(routed)
        deadline = time.monotonic() + 10               # the router learns the root from the answer, after it
        while not set(read_store(env, lambda st: st.keys(ROOTS))) - roots:
            assert time.monotonic() < deadline, env["m"].tail(20)
            time.sleep(0.05)
        turn2 = [*first, {"role": "assistant", "content": "OK"}, {"role": "user", "content": "thanks"}]
        chat(env, PI_HEADERS, turn2)
        assert last_request(env).session == routed


def test_two_pi_conversations_that_opened_alike_never_share_a_gateway_id(env):
    """pi sends no id: the reader names a conversation by a fingerprint of its opening, so
    two that opened alike share it. The router tells them apart (a nonce each) and pins them
    apart; before, the pool keyed its binding by the fingerprint alone and gave both one id."""
    wait_spares(env, 2)
    with gateway_routed_for_pi(env):
        first = [{"role": "system", "content": f"You are pi {RUN}-alike"}, {"role": "user", "content": "hello"}]
        assert chat(env, PI_HEADERS, first).status == 200
        a = last_request(env).session
        assert chat(env, PI_HEADERS, first).status == 200       # a second conversation, opened alike
        b = last_request(env).session
        pinned = [k for k in read_store(env, lambda st: st.keys(pins.PIN_PREFIX)) if k.startswith("pin:fp:")]
        bound = [k for k in read_store(env, lambda st: st.keys(state.BIND_PREFIX)) if k.startswith("pool:bind:fp:")]
        assert a and b and a != b, (a, b, pinned, bound)
        for sid in (a, b):                                       # one binding each, under the router's sessions
            key = read_store(env, lambda st, sid=sid: st.get(state.id_key(sid)))
            assert key.split(state.SEP)[0] in {p[len(pins.PIN_PREFIX):] for p in pinned}, (key, pinned)


def test_a_pi_conversation_the_router_does_not_resolve_is_keyed_by_its_fingerprint(env):
    """The gateway is not a server the router routes (no configuration): the router resolves
    no pi conversation. The pool keys it by its fingerprint, as before, so pi keeps working
    (the gateway refuses a request without an id), and the log says once that conversations
    that opened alike then share an id, and how to tell them apart."""
    wait_spares(env, 1)
    before = len(read_store(env, lambda st: st.keys(state.BIND_PREFIX)))
    first = [{"role": "system", "content": f"You are pi {RUN}-alone"}, {"role": "user", "content": "hello"}]
    r = chat(env, PI_HEADERS, first)
    assert r.status == 200 and last_request(env).session, (r.status, last_request(env))
    assert len(read_store(env, lambda st: st.keys(state.BIND_PREFIX))) == before + 1
    assert env["m"].wait_output(r"only the fingerprint of its opening names", timeout=5), env["m"].tail(20)


def test_a_bound_id_that_turns_slow_is_retired_and_replaced(env):
    wait_spares(env, 2)
    conv = f"ses_{RUN}_slow"
    h = [*OPENCODE_HEADERS, ("x-opencode-session", conv)]
    chat(env, h, [{"role": "user", "content": "1"}])
    routed = last_request(env).session
    env["gw"].slow_ids.add(routed)
    chat(env, h, [{"role": "user", "content": "2"}])                  # answered with upstream;dur=20000
    assert last_request(env).session == routed
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:                                 # observation runs off the stream's path
        chat(env, h, [{"role": "user", "content": "3"}])
        if last_request(env).session != routed:
            break
        time.sleep(0.1)
    assert last_request(env).session not in (routed, conv)
    assert read_store(env, lambda store: state.is_retired(store, routed))
    snap = read_store(env, lambda store: report.snapshot(store, int(time.time() * 1000), 1_800_000))
    assert routed not in json.dumps(snap["groups"])                    # gone from spares and bindings


def test_a_rejected_key_is_probed_once_then_never_again(env):
    gw = env["gw"]
    bad = [("authorization", "Bearer wrong"), ("content-type", "application/json")]
    r = chat(env, [*bad, ("x-opencode-session", f"ses_{RUN}_bad")], [{"role": "user", "content": "x"}],
             path="/zen/v1/chat/completions")
    assert r.status == 401                                             # the gateway's own answer, untouched
    time.sleep(2.5)                                                    # two refresh cycles (1 s interval)

    def rejected():
        return [p for p in gw.probes() if p.path == "/zen/v1/chat/completions" and p.status == 401]

    assert len(rejected()) == 1                                        # tried once, then blocked
    time.sleep(1.2)
    assert len(rejected()) == 1


def test_the_pool_survives_a_reload_of_the_script(env):
    m, gw = env["m"], env["gw"]
    kept = wait_spares(env, 2)
    mark = m.line_count
    env["script"].write_text(SCRIPT.replace("MARKER", "v2"))
    assert m.wait_output(r"refresh loop started", timeout=15, since=mark), m.tail(30)
    out = m.output.splitlines()[mark:]
    assert sum("refresh loop started" in line for line in out) == 1
    assert sum("refresh loop stopped" in line for line in out) == 1
    assert set(kept) <= set(spares(env))                               # no spare lost
    conv = f"ses_{RUN}_after"
    chat(env, [*OPENCODE_HEADERS, ("x-opencode-session", conv)], [{"role": "user", "content": "x"}])
    assert last_request(env).session in kept                           # the same pool serves
    assert m.alive


def test_status_and_metrics_carry_the_pool(env):
    """Reads the counters the tests above moved (a spare routed, a slow id retired): it runs
    after them, as the module does, not alone."""
    r = env["client"].request("GET", env["gw"].origin + "/__sessionpin/status")
    pool = r.json()["participants"]["pool"]
    assert pool["enabled"] and pool["refresh_running"] and pool["refresh_loops"] == 1
    assert pool["counters"]["routed_spare"] >= 1 and pool["counters"]["probes_fast"] >= 2
    assert pool["counters"]["retired_quarantine"] >= 1
    text = env["client"].request("GET", env["gw"].origin + "/__sessionpin/metrics").body.decode()
    assert 'sessionpin_pool_events_total{event="routed_spare"}' in text
    assert f'sessionpin_pool_spares{{provider="opencode-go",model="{MODEL}"}}' in text


def test_two_proxies_sharing_one_store_never_share_an_id(env):
    m2 = Mitmdump(env["work"] / "second", script=env["script"], options=env["opts"])
    m2.start()
    try:
        kept = wait_spares(env, 2)
        ports = [(env["m"].port, env["m"].mitm_ca), (m2.port, m2.mitm_ca)]
        convs = [f"ses_{RUN}_twin{i}" for i in range(10)]
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode()

        def send(i: int, conv: str) -> None:
            port, ca = ports[i % 2]
            Client.via_proxy(port, ca).request(
                "POST", env["gw"].origin + "/zen/go/v1/chat/completions",
                headers=[*OPENCODE_HEADERS, ("x-opencode-session", conv)], body=body)

        threads = [threading.Thread(target=send, args=(i, c)) for i, c in enumerate(convs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        bindings = read_store(env, lambda store: state.bindings(store, drop_bad=False))
        bound = {k.split("::")[0]: b.routed_id for k, b in bindings.items()}
        left = set(spares(env))
        ids = list(bound.values())
        assert len(ids) == len(set(ids))                              # no id in two conversations
        assert not set(ids) & left                                    # no bound id is a spare
        assert set(kept) & {bound.get(c) for c in convs}               # the race was for the same spares
        # a bound conversation's next request, through the *other* proxy, keeps its id; one that
        # kept its own id may get a spare now, but never an id bound elsewhere
        for i, conv in enumerate(convs):
            send(i + 1, conv)
            seen = last_request(env).session
            if conv in bound:
                assert seen == bound[conv]
            else:
                assert seen == conv or seen not in ids
    finally:
        m2.stop()


def status(env) -> dict:
    return env["client"].request("GET", env["gw"].origin + "/__sessionpin/status").json()


def restart(env) -> None:
    env["m"].start()
    env["client"] = Client.via_proxy(env["m"].port, env["m"].mitm_ca)


def test_a_store_rolled_back_under_the_pools_bindings_is_refused_not_reused():
    """A cold backup of the file store is taken while the proxy is stopped; conversation A
    then takes a spare; the proxy is stopped and the backup put back. The proxy passes only
    gateway traffic (no router pins), so before, nothing counted the binding: the rollback
    went unseen, a new conversation B opening first was given A's id (a spare again in the
    old copy) and A a new id mid-conversation. A binding counts one pin made now, so the
    store reads as rolled back and every request is refused until the operator decides."""
    with tempfile.TemporaryDirectory(prefix="sessionpin-pool-rb-") as tmp:
        gen = _env(Path(tmp))
        env = next(gen)
        try:
            work, m = env["work"], env["m"]
            wait_spares(env, 2)
            m.stop()
            backup = work / "backup"
            backup.mkdir()
            for f in work.glob("state.db*"):
                shutil.copy2(f, backup / f.name)
            restart(env)
            a_headers = [*OPENCODE_HEADERS, ("x-opencode-session", f"ses_{RUN}_rb_a")]
            b_headers = [*OPENCODE_HEADERS, ("x-opencode-session", f"ses_{RUN}_rb_b")]
            a_first = [{"role": "user", "content": "conversation A"}]
            assert chat(env, a_headers, a_first).status == 200
            a1 = last_request(env).session
            made = read_store(env, identity.made)
            deadline = time.monotonic() + 15                # the proxy remembers the count (it looks every second)
            while status(env)["store_info"]["identity"].get("remembered_made", 0) < made:
                assert time.monotonic() < deadline, status(env)["store_info"]
                time.sleep(0.2)
            m.stop()
            for f in work.glob("state.db*"):
                f.unlink()
            for f in backup.iterdir():
                shutil.copy2(f, work / f.name)
            restart(env)
            before = len(env["gw"].requests())
            rb = chat(env, b_headers, [{"role": "user", "content": "conversation B"}])   # a new one opens first
            assert rb.status == 424 and rb.header("x-sessionpin-refused") == "store-lost", (rb.status, rb.text[:300])
            assert "rolled back" in rb.text
            ra = chat(env, a_headers, [*a_first, {"role": "assistant", "content": "OK"},
                                       {"role": "user", "content": "more"}])
            assert ra.status == 424 and ra.header("x-sessionpin-refused") == "store-lost", (ra.status, ra.text[:300])
            assert all(r.session != a1 for r in env["gw"].requests()[before:])   # A's id went to nobody
        finally:
            next(gen, None)


def test_an_opencode_binding_deleted_is_refused_not_taken_for_a_new_conversation(env):
    """A cleanup deletes a conversation's binding, while its id's record still names it.
    Before, the next request was given another id mid-conversation; now it is refused (424,
    as a lost pin is), naming the conversation and the way out, and no id is sent."""
    wait_spares(env, 2)
    conv = f"ses_{RUN}_del"
    h = [*OPENCODE_HEADERS, ("x-opencode-session", conv)]
    assert chat(env, h, [{"role": "user", "content": "one"}]).status == 200
    first = last_request(env).session
    assert first != conv

    async def lose(st):
        keys = [k for k in await st.keys(state.BIND_PREFIX) if k.startswith(state.BIND_PREFIX + conv + state.SEP)]
        assert len(keys) == 1
        assert await st.delete(keys[0])
        assert await st.get(state.id_key(first)) == keys[0][len(state.BIND_PREFIX):]   # the witness stays
    read_store(env, lose)
    before = len(env["gw"].requests())
    r = chat(env, h, [{"role": "user", "content": "one"}, {"role": "assistant", "content": "OK"},
                      {"role": "user", "content": "two"}])
    assert r.status == 424 and r.header("x-sessionpin-refused") == "pool-lost", (r.status, r.text[:300])
    assert short(conv) in r.text and "store copy" in r.text, r.text[:300]
    assert len(env["gw"].requests()) == before                          # nothing sent, under no id
    assert env["m"].wait_output(r"sessionpin pool: the binding of conversation .* is gone from store", timeout=5)


# ---- behind a corporate proxy: probes go out the way mitmproxy's upstream connections go ----


@pytest.fixture(scope="module")
def corp():
    """A second, plain mitmdump as the corporate proxy (regular mode, proxy auth, TLS interception),
    writing every flow it carries to corp.flow; the fake gateway behind it has a CA of its own."""
    with tempfile.TemporaryDirectory(prefix="sessionpin-corp-") as tmp:
        work = Path(tmp)
        gw = FakeGateway(keys={KEY}).start(work)
        flows = work / "corp.flow"
        proxy = Mitmdump(work / "corp", script=None, args=["-w", str(flows)], options={
            "proxyauth": "alice:s3cret", "ssl_verify_upstream_trusted_ca": str(gw.ca)})
        proxy.start()
        try:
            yield {"gw": gw, "proxy": proxy, "flows": flows, "url": f"http://127.0.0.1:{proxy.port}"}
        finally:
            proxy.stop()
            gw.stop()


def corp_flows(corp) -> list:
    """The requests the corporate proxy carried (mitmdump's -w file, read as it stands)."""
    from sessionpin.offline import flowfile

    data = corp["flows"].read_bytes() if corp["flows"].exists() else b""
    try:
        return list(flowfile.read_requests(data)) if data else []
    except flowfile.FlowFileError:     # a flow being written as we read: the complete ones
        return []


def wait_corp_flow(corp, sid: str, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in corp_flows(corp):
            if (b"x-opencode-session", sid.encode()) in r.headers:
                return r
        time.sleep(0.1)
    raise AssertionError(f"the corporate proxy carried no request with id {sid}:\n{corp['proxy'].tail(20)}")


async def test_a_probe_goes_through_the_upstream_proxy_with_its_auth_and_ca(corp):
    from sessionpin.opencode_ids.prober import ProbeTarget, probe
    from sessionpin.opencode_ids.upstream import parse as parse_upstream

    gw = corp["gw"]
    target = ProbeTarget(gw.origin, "/zen/go/v1/chat/completions", "chat/completions", MODEL,
                         (("authorization", f"Bearer {KEY}"),))
    # what the shell hands the pool: mitmproxy's own option values
    via = parse_upstream({"mode": [f"upstream:{corp['url']}"], "upstream_auth": "alice:s3cret",
                          "ssl_verify_upstream_trusted_ca": str(corp["proxy"].mitm_ca)})
    sid = f"corp-{RUN}-ok"
    r = await probe(target, sid, 10_000, max_upstream_ms=2500, via=via)
    assert r.kind in ("fast", "slow") and r.status == 200, r
    carried = wait_corp_flow(corp, sid)
    assert carried.url == f"{gw.origin}/zen/go/v1/chat/completions"     # CONNECT tunnel, TLS intercepted
    assert [s.session for s in gw.probes()].count(sid) == 1              # ...and it reached the gateway

    # each setting is needed: without the auth the proxy refuses, without its CA the tunnel is not trusted
    no_auth = await probe(target, f"corp-{RUN}-noauth", 10_000, max_upstream_ms=2500,
                          via=parse_upstream({"mode": [f"upstream:{corp['url']}"],
                                              "ssl_verify_upstream_trusted_ca": str(corp["proxy"].mitm_ca)}))
    no_ca = await probe(target, f"corp-{RUN}-noca", 10_000, max_upstream_ms=2500,
                        via=parse_upstream({"mode": [f"upstream:{corp['url']}"], "upstream_auth": "alice:s3cret"}))
    insecure = await probe(target, f"corp-{RUN}-insecure", 10_000, max_upstream_ms=2500,
                           via=parse_upstream({"mode": [f"upstream:{corp['url']}"], "upstream_auth": "alice:s3cret",
                                               "ssl_insecure": True}))
    assert (no_auth.kind, no_ca.kind, insecure.status) == ("failed", "failed", 200), (no_auth, no_ca, insecure)
    # direct (no upstream mode), trusting the corporate CA only: the gateway's own certificate fails
    direct = await probe(target, f"corp-{RUN}-direct", 10_000, max_upstream_ms=2500,
                         via=parse_upstream({"ssl_verify_upstream_trusted_ca": str(corp["proxy"].mitm_ca)}))
    assert direct.kind == "failed"
    assert not [s for s in gw.probes() if s.session in (f"corp-{RUN}-noauth", f"corp-{RUN}-noca",
                                                         f"corp-{RUN}-direct")]


async def test_the_pools_refresh_fills_spares_through_the_upstream_proxy(corp):
    from sessionpin.opencode_ids import PoolService, options

    gw = corp["gw"]
    cfg = options.parse({"sessionpin_pool_gateways": gw.origin, "sessionpin_pool_size": 2,
                         "sessionpin_pool_min_probe_interval_ms": 0,
                         "mode": [f"upstream:{corp['url']}"], "upstream_auth": "alice:s3cret",
                         "ssl_verify_upstream_trusted_ca": str(corp["proxy"].mitm_ca)})
    svc = PoolService(cfg, open_store("memory:"))
    conv = f"ses_{RUN}_corp"
    route = await svc.route("POST", gw.origin + "/zen/go/v1/chat/completions",
                            {"authorization": f"Bearer {KEY}", "x-opencode-session": conv}, session=conv, model=MODEL)
    assert route.how == "client"                          # no spare yet; the request taught the pool a target
    for _ in range(8):          # a cycle sends 4 probes and half of all ids are fast: 2 kept in ~69 % of cycles
        await svc.refresh_once()
        pool = await state.spares(svc.store, "opencode-go", MODEL)
        if len(pool) == 2:
            break
    assert len(pool) == 2 and all(is_fast_id(i) for i in pool)
    for sid in pool:
        wait_corp_flow(corp, sid)                         # every kept id was probed through the proxy
