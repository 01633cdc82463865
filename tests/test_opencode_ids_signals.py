import pytest

from sessionpin.opencode_ids.signals import DEFAULT_BACKOFF_MS, classify, judge, measure, retry_after_ms, upstream_ms


@pytest.mark.parametrize("header,ms", [
    ("gateway;dur=10, upstream;dur=1447, total;dur=1498", 1447),
    ("upstream;dur=941.6", 942),
    ("Upstream; desc=\"x\"; dur=12", 12),
    ("gateway;dur=10, total;dur=1498", None),
    ("", None), (None, None), ("upstream;dur=abc", None),
])
def test_upstream_dur(header, ms):
    assert upstream_ms(header) == ms


def test_wall_clock_stands_in_when_server_timing_is_absent():
    assert measure(None, 3210.4) == (3210, "wall")
    assert measure("upstream;dur=5", 3210) == (5, "upstream")


def test_retry_after():
    assert retry_after_ms("1500", "9") == 1500          # retry-after-ms wins
    assert retry_after_ms(None, "3") == 3000
    assert retry_after_ms(None, "Thu, 01 Jan 2026 00:00:10 GMT", now_epoch_s=1767225600.0) == 10_000
    assert retry_after_ms("junk", None) == DEFAULT_BACKOFF_MS
    assert retry_after_ms(None, None) == DEFAULT_BACKOFF_MS
    assert retry_after_ms("99999999999", None) == 3_600_000


@pytest.mark.parametrize("status,timing,wall,kind", [
    (200, "upstream;dur=900", 50_000, "fast"),       # the header wins over the wall clock
    (200, "upstream;dur=2500", 0, "fast"),
    (200, "upstream;dur=2501", 0, "slow"),
    (200, None, 1200, "fast"),
    (200, None, 9000, "slow"),
    (401, None, 10, "unauthorized"), (403, None, 10, "unauthorized"),
    (400, None, 10, "rejected"), (429, None, 10, "overloaded"), (502, None, 10, "failed"),
])
def test_classify(status, timing, wall, kind):
    assert classify(status, timing, wall, max_upstream_ms=2500).kind == kind


def test_require_gateway_id_only_when_asked():
    fast = dict(max_upstream_ms=2500)
    assert classify(200, "upstream;dur=1", 0, body_id="chatcmpl-1", **fast).fast
    assert not classify(200, "upstream;dur=1", 0, body_id="chatcmpl-1", require_gateway_id=True, **fast).fast
    assert classify(200, "upstream;dur=1", 0, body_id="gw-1-2", require_gateway_id=True, **fast).fast


def test_overloaded_carries_the_backoff():
    r = classify(429, None, 1, max_upstream_ms=2500, retry_after="2")
    assert r.retry_after_ms == 2000


K = dict(degrade_ms=6000, quarantine_ms=8000, quarantine_failures=2)


@pytest.mark.parametrize("status,up,failures,verdict,reason", [
    (200, 1000, 0, "healthy", "ok"),
    (200, 5999, 1, "healthy", "ok"),
    (200, 6000, 0, "strike", "degraded"),
    (200, 6000, 1, "retire", "strikes"),
    (200, 8000, 0, "retire", "quarantine"),
    (429, None, 0, "retire", "429"),
    (200, None, 1, "healthy", "no upstream timing"),
])
def test_judge(status, up, failures, verdict, reason):
    assert judge(status, up, failures, **K) == (verdict, reason)
