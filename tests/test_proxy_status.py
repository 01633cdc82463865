"""The status and metrics endpoints: who may read them, and what they say, in O(1)."""

from __future__ import annotations

import re

import msgspec
import pytest

from sessionpin.records.documents import read_status
from sessionpin.proxy.participants import Participant
from shellkit import CONFIG, flow, internal, start


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.fixture
async def proxy(cfg_path):
    p = start(cfg_path)
    yield p
    p.close()


async def test_status_and_metrics(proxy):
    await proxy.send(flow())
    f = internal("/__sessionpin/status")
    await proxy.send(f)
    status = read_status(f.response.content)
    assert status is not None, f.response.content
    assert status.agents["claude-code"] == "glm" and status.pins["glm"].pins == 1
    assert status.servers["glm"].key_set is True and status.store == "memory:"
    assert "zai-sentinel" not in f.response.text
    assert "sessionpin" not in f.metadata          # the router left it to the status addon
    f = internal("/__sessionpin/metrics", peer=("::ffff:127.0.0.1", 1, 0, 0))
    await proxy.send(f)
    text = f.response.text
    assert 'sessionpin_pins{server="glm"} 1' in text
    assert 'sessionpin_decisions_total{agent="claude-code",turn="opening",outcome="routed"} 1' in text
    assert "sessionpin_store_errors_total 0" in text
    for line in text.splitlines():
        assert line.startswith("#") or re.match(r'^sessionpin_[a-z_]+(\{[^}]*\})? -?\d+$', line), line
    f = internal("/__sessionpin/nope")
    await proxy.send(f)
    assert f.response.status_code == 404


@pytest.mark.parametrize("peer, host, headers, allowed", [
    (("127.0.0.1", 1), "127.0.0.1:8080", [], True),
    (("::1", 1, 0, 0), "[::1]:8080", [], True),
    (("127.0.0.1", 1), "localhost:8080", [(b"sec-fetch-site", b"none")], True),
    (("10.0.0.5", 1), "127.0.0.1:8080", [], False),                                  # not loopback
    (("127.0.0.1", 1), "evil.example:8080", [], False),                              # DNS rebinding
    (("127.0.0.1", 1), "evil.example", [], False),
    (("127.0.0.1", 1), "127.0.0.1:8080", [(b"sec-fetch-site", b"same-origin")], False),   # a page's script
    (("127.0.0.1", 1), "api.anthropic.com", [], False),                               # reverse mode rewrote it
])
async def test_who_may_read_the_status(proxy, peer, host, headers, allowed):
    f = internal("/__sessionpin/status", peer=peer, host=host, headers=headers)
    await proxy.send(f)
    assert (f.response.status_code == 200) is allowed
    if not allowed:
        assert b"config" not in f.response.content


async def test_the_heartbeat_token_opens_it_on_any_listener(proxy):
    token = proxy.status.token
    assert proxy.runtime.heartbeat().token == token
    f = internal("/__sessionpin/status", host="api.anthropic.com", headers=[(b"x-sessionpin-token", token.encode())])
    await proxy.send(f)
    assert f.response.status_code == 200
    f = internal("/__sessionpin/status", host="127.0.0.1:8080", headers=[(b"x-sessionpin-token", b"guess")])
    await proxy.send(f)
    assert f.response.status_code == 403


async def test_counts_come_from_the_index(proxy):
    # many pins: the status reads a zcount per server, not the pins
    from sessionpin.records import pins
    for i in range(50):
        await pins.create(proxy.store, f"s{i}", pins.Pin(agent="claude-code", server="glm" if i % 2 else None,
                                                         since=2e9, renewed=2e9))
    calls = []
    real = proxy.store

    class Counting:
        url = real.url

        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)
    proxy.runtime.store = Counting()
    counts, problem = await proxy.status.counts()
    assert problem is None and counts["glm"].pins == 25 and counts["-"].pins == 25
    assert "get" not in calls and "keys" not in calls and "mget" not in calls
    assert len(calls) <= 1 + 2 * len(counts)


async def test_scrapes_share_one_count_until_this_proxy_writes_a_pin(proxy, monkeypatch):
    # A count scans the index on the reader thread every pin read uses: scrapers must not
    # run one each (issue 9: two scrapers at 100k pins delayed every opening).
    import asyncio

    from sessionpin.records import pins
    from sessionpin.proxy import status as status_mod
    counted = []
    real = pins.counts

    async def counting(*a, **kw):
        counted.append(1)
        await asyncio.sleep(0.01)
        return await real(*a, **kw)
    monkeypatch.setattr(status_mod.pins, "counts", counting)
    await proxy.send(flow())                                       # an opening: pinned to glm
    replies = []
    for _ in range(3):
        fs = [internal("/__sessionpin/status") for _ in range(5)]
        await asyncio.gather(*(proxy.send(f) for f in fs))        # five scrapers at once
        replies += [read_status(f.response.content) for f in fs]
    assert len(counted) == 1 and all(r.pins["glm"].pins == 1 for r in replies)
    await proxy.send(flow(session="abcd1234-0000-4000-8000-000000000002"))   # this proxy pins again
    f = internal("/__sessionpin/status")
    await proxy.send(f)
    assert read_status(f.response.content).pins["glm"].pins == 2 and len(counted) == 2
    monkeypatch.setattr(status_mod, "COUNTS_FRESH", 0.0)            # and a count goes stale with time
    await proxy.send(internal("/__sessionpin/metrics"))
    assert len(counted) == 3


async def test_a_participants_status_and_metrics_are_shared_by_scrapes_too(cfg_path):
    # the OpenCode pool's report reads its spares and bindings: not once per scrape
    import asyncio

    class Pool(Participant):
        name = "pool"

        def __init__(self):
            self.calls = {"status": 0, "metrics": 0}

        async def request(self, flow, facts, decision):
            pass

        async def status(self):
            self.calls["status"] += 1
            await asyncio.sleep(0.01)
            return {"spares": 3}

        async def metrics(self):
            self.calls["metrics"] += 1
            return "# HELP x y\n# TYPE x gauge\nx 1\n"

    part = Pool()
    p = start(cfg_path, participants=[part])
    try:
        fs = [internal(path) for path in ["/__sessionpin/status", "/__sessionpin/metrics"] * 4]
        await asyncio.gather(*(p.send(f) for f in fs))
        assert part.calls == {"status": 1, "metrics": 1}
        assert all(f.response.status_code == 200 for f in fs)
        assert read_status(fs[0].response.content).participants["pool"]["spares"] == 3
        assert "x 1" in fs[1].response.text
    finally:
        p.close()


def test_status_document_roundtrip():
    from sessionpin.records.documents import PinCount, Status
    s = Status(version="1", pid=1, host="h", started=1.0, pins={"glm": PinCount(pins=2, active=1)})
    assert read_status(msgspec.json.encode(s)) == s
    assert read_status(b'{"version": 1}') is None


# --------------------------------------------------------------- the exposition, read by the reference parser

ODD = ['plain', 'quo"te', 'back\\slash', 'new\nline', 'all "\\\n of them\\n', 'ünï—code']


def families(text):
    """Our text through prometheus_client's parser: {name: family}; each family one group, typed."""
    from prometheus_client.parser import text_string_to_metric_families
    got = list(text_string_to_metric_families(text))
    names = [f.name for f in got]
    assert len(names) == len(set(names)), f"a family in two groups: {names}"
    assert all(f.type != "unknown" and f.documentation for f in got), [(f.name, f.type) for f in got]
    return {f.name: f for f in got}


def test_label_values_are_escaped_and_read_back_as_they_were():
    from sessionpin.records.documents import PinCount
    from sessionpin.proxy.router import Metrics
    from sessionpin.proxy.status import metrics_text
    m = Metrics()
    for i, v in enumerate(ODD):
        m.decisions[(v, "opening", "routed")] += i + 1
        m.refusals[v] += i + 1
    text = metrics_text({v: PinCount(pins=i, active=1) for i, v in enumerate(ODD)}, m, 0, 0, 0)
    assert len(text.splitlines()) == 2 * 8 + 4 * len(ODD) + 3          # a raw line feed would add lines
    got = families(text)
    assert {s.labels["server"]: s.value for s in got["sessionpin_pins"].samples} == \
        {v: i for i, v in enumerate(ODD)}
    assert {s.labels["reason"]: s.value for s in got["sessionpin_refusals"].samples} == \
        {v: i + 1 for i, v in enumerate(ODD)}
    assert {s.labels["agent"] for s in got["sessionpin_decisions"].samples} == set(ODD)
    got = families(metrics_text(None, Metrics(), 2, 0, 0))     # the store cannot be read
    assert [(s.labels, s.value) for s in got["sessionpin_pins"].samples] == [({}, -1)]
    assert got["sessionpin_store_errors"].samples[0].value == 2


def test_a_lost_store_shows_in_the_metrics():
    from sessionpin.proxy.router import Metrics
    from sessionpin.proxy.status import metrics_text
    from sessionpin.proxy.storeguard import StoreGuard
    guard = StoreGuard({})
    got = families(metrics_text(None, Metrics(), 0, 0, 0, guard))
    assert got["sessionpin_store_lost"].samples[0].value == 0
    guard.lost, guard.partial = "store file:x lost what it held", 3
    got = families(metrics_text(None, Metrics(), 0, 0, 0, guard))
    assert got["sessionpin_store_lost"].samples[0].value == 1
    assert got["sessionpin_store_partial_losses"].samples[0].value == 3


def test_help_text_is_escaped():
    from sessionpin.proxy.exposition import family, joined
    out = []
    family(out, "x_total", "counter", 'a "help" with \\ and\na line feed', ("k",), [("v", 1)])
    assert families(joined(out))["x"].documentation == 'a "help" with \\ and\na line feed'


async def test_the_pools_families_are_escaped_and_grouped():
    from sessionpin.serverpools import quota
    from sessionpin.config.config import parse
    from sessionpin.opencode_ids import report
    from sessionpin.proxy.allocations import pool_metrics_text
    cfg = parse(CONFIG + '''
[servers.glm-b]
url = "https://b.example"
[pools.both]
members = ["glm", "glm-b"]
''')
    text = pool_metrics_text(cfg.pools.values(), {("both", "glm"): 2}, {("both", "glm-b"): 1}, ["glm", "glm-b"],
                             {"glm": 3}, {"glm": quota.Quota(observed=0.0, exhausted_until=9.0)}, {"glm-b": 1.0}, 0.0)
    got = families(text)
    assert [(s.labels, s.value) for s in got["sessionpin_pool_allocations"].samples] == \
        [({"pool": "both", "member": "glm"}, 2), ({"pool": "both", "member": "glm-b"}, 0)]
    assert [(s.labels, s.value) for s in got["sessionpin_pool_moves"].samples] == \
        [({"pool": "both", "member": "glm-b"}, 1)]
    for name, values in (("active", [3, 0]), ("exhausted", [1, 0]), ("drained", [0, 1])):
        assert [(s.labels, s.value) for s in got[f"sessionpin_pool_member_{name}"].samples] == \
            [({"member": "glm"}, values[0]), ({"member": "glm-b"}, values[1])]
    # the OpenCode id pool: provider and model names come from the agents' requests
    snap = {"groups": [{"provider": p, "model": m, "fresh_spares": i, "bindings": [{}] * i}
                       for i, (p, m) in enumerate(zip(ODD, reversed(ODD)))]}
    got = families(report.metrics({"probes": 4}, snap))
    assert {(s.labels["provider"], s.labels["model"]): s.value for s in got["sessionpin_pool_spares"].samples} == \
        {(p, m): i for i, (p, m) in enumerate(zip(ODD, reversed(ODD)))}
    assert len(got["sessionpin_pool_bindings"].samples) == len(ODD)


async def test_the_whole_scrape_reads_as_prometheus_text(cfg_path):
    cfg_path.write_text(CONFIG + '''
[servers.glm-b]
url = "https://b.example"
[pools.both]
members = ["glm", "glm-b"]
''')
    p = start(cfg_path, pool=True)
    try:
        await p.send(flow())
        f = internal("/__sessionpin/metrics")
        await p.send(f)
    finally:
        p.close()
    got = families(f.response.text)
    assert {"sessionpin_pins", "sessionpin_decisions", "sessionpin_pool_allocations", "sessionpin_pool_events"} <= \
        set(got)
