"""What members' answers say about their quota (sessionpin/serverpools/quota.py): a table of real header shapes."""

from __future__ import annotations

import pytest

from sessionpin.serverpools import quota

NOW = 1_800_000_000.0       # 2027-01-15T08:00:00Z
ISO_30 = "2027-01-15T08:00:30Z"
ISO_90 = "2027-01-15T08:01:30Z"


def anthropic(dim, limit, remaining, reset):
    p = f"anthropic-ratelimit-{dim}-"
    return [(p + "limit", str(limit)), (p + "remaining", str(remaining)), (p + "reset", reset)]


CASES = [
    ("200, Anthropic headers: headroom is the smallest share",
     200, anthropic("requests", 100, 80, ISO_30) + anthropic("tokens", 1000, 250, ISO_30),
     dict(headroom=0.25, exhausted_until=0.0)),
    ("200, OpenAI headers with durations",
     200, [("x-ratelimit-limit-requests", "60"), ("x-ratelimit-remaining-requests", "30"),
           ("x-ratelimit-reset-requests", "1s"), ("x-ratelimit-limit-tokens", "1000"),
           ("x-ratelimit-remaining-tokens", "900"), ("x-ratelimit-reset-tokens", "6m0s")],
     dict(headroom=0.5, exhausted_until=0.0)),
    ("200 with a dimension at 0: exhausted until its reset",
     200, anthropic("input-tokens", 1000, 0, ISO_90) + anthropic("requests", 10, 5, ISO_30),
     dict(headroom=0.0, exhausted_until=NOW + 90)),
    ("200 without headers: nothing known, not exhausted", 200, [], dict(headroom=None, exhausted_until=0.0)),
    ("429 with retry-after seconds", 429, [("retry-after", "30")], dict(exhausted_until=NOW + 30, headroom=0.0)),
    ("429 with retry-after-ms", 429, [("retry-after-ms", "1500")], dict(exhausted_until=NOW + 1.5)),
    ("429 with an HTTP-date retry-after", 429, [("Retry-After", "Fri, 15 Jan 2027 08:02:00 GMT")],
     dict(exhausted_until=NOW + 120)),
    ("429, no retry-after: the latest reset of what is used up",
     429, anthropic("tokens", 1000, 0, ISO_90) + anthropic("requests", 10, 0, ISO_30),
     dict(exhausted_until=NOW + 90)),
    ("429, nothing said: the default", 429, [], dict(exhausted_until=NOW + quota.DEFAULT_429)),
    ("529 overloaded, no retry-after: the short default", 529, [], dict(exhausted_until=NOW + quota.DEFAULT_529)),
    ("529 with retry-after", 529, [("retry-after", "4")], dict(exhausted_until=NOW + 4)),
    ("500 with headers: headroom only", 500, anthropic("requests", 10, 9, ISO_30),
     dict(headroom=0.9, exhausted_until=0.0)),
]


@pytest.mark.parametrize("status, headers, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_observe(status, headers, expected):
    q = quota.observe(status, headers, NOW)
    assert q is not None and q.status == status and q.observed == NOW
    for k, v in expected.items():
        assert getattr(q, k) == (pytest.approx(v) if isinstance(v, float) else v), k


def test_other_answers_teach_nothing():
    assert quota.observe(500, [("content-type", "application/json")], NOW) is None
    assert quota.observe(400, [], NOW) is None


def test_garbage_headers_are_ignored_not_trusted():
    q = quota.observe(200, [("anthropic-ratelimit-tokens-limit", "lots"),
                            ("anthropic-ratelimit-tokens-remaining", "nan"),
                            ("x-ratelimit-reset-requests", "soon")], NOW)
    assert q is not None and q.headroom is None and q.exhausted_until == 0.0
    q = quota.observe(429, [("retry-after", "whenever")], NOW)
    assert q.exhausted_until == NOW + quota.DEFAULT_429


def test_codec_and_ttl():
    q = quota.observe(429, [("retry-after", "30")], NOW)
    assert quota.decode(quota.encode(q)) == q
    assert quota.decode("{bad") is None and quota.decode(None) is None
    assert quota.ttl(q, NOW) == pytest.approx(30 + quota.STALE)


# --------------------------------------------------------------------------- claims are clamped (issue 20)

FAR = [
    ("retry-after: 99999999 (3.2 years)", 429, [("retry-after", "99999999")]),
    ("retry-after: 1e300", 429, [("retry-after", "1e300")]),
    ("retry-after: a thousand digits", 429, [("retry-after", "9" * 1000)]),
    ("retry-after: inf", 429, [("retry-after", "inf")]),
    ("retry-after-ms: 1e308", 429, [("retry-after-ms", "1e308")]),
    ("retry-after: an HTTP date in 9999", 429, [("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT")]),
    ("529 with retry-after: 1e300", 529, [("retry-after", "1e300")]),
    ("200, a dimension at 0 until 9999", 200, anthropic("tokens", 10, 0, "9999-12-31T23:59:59Z")),
    ("200, a dimension at 0 for 1e999 seconds", 200, [("x-ratelimit-remaining-tokens", "0"),
                                                      ("x-ratelimit-reset-tokens", "1e999")]),
    ("429, a reset duration of a million hours", 429, [("x-ratelimit-remaining-tokens", "0"),
                                                       ("x-ratelimit-reset-tokens", "1000000h")]),
]


@pytest.mark.parametrize("status, headers", [c[1:] for c in FAR], ids=[c[0] for c in FAR])
def test_a_reset_beyond_the_bound_is_taken_as_the_bound(status, headers):
    q = quota.observe(status, headers, NOW)
    assert q.exhausted_until == NOW + quota.MAX_RESET
    assert "taken as 3600s" in q.why
    assert quota.decode(quota.encode(q)) == q and quota.ttl(q, NOW) == quota.MAX_RESET + quota.STALE
    q = quota.observe(status, headers, NOW, max_reset=120.0)
    assert q.exhausted_until == NOW + 120.0


@pytest.mark.parametrize("value", ["-5", "-1e300", "-inf", "NaN", "nan", "", "1e", "0x10", "\x00"])
def test_a_retry_after_that_is_no_time_ahead_exhausts_for_no_more_than_the_default(value):
    q = quota.observe(429, [("retry-after", value)], NOW)
    assert NOW <= q.exhausted_until <= NOW + quota.DEFAULT_429


def test_a_claimed_headroom_is_never_above_its_limit():
    for remaining, limit in (("1000000", "1"), ("inf", "1"), ("1e308", "1e-308"), ("5", "5")):
        q = quota.observe(200, anthropic("requests", limit, remaining, ISO_30), NOW)
        assert q.headroom == 1.0, (remaining, limit)
    for remaining, limit in (("inf", "inf"), ("1", "nan"), ("1", "-1"), ("1", "0")):
        assert quota.observe(200, anthropic("requests", limit, remaining, ISO_30), NOW).headroom is None


def test_a_stored_state_is_clamped_when_read_and_never_unreadable_numbers():
    far = quota.Quota(observed=NOW, status=429, headroom=0.0, exhausted_until=NOW + 99999999, why="429")
    got = quota.clamped(far, NOW + 10)
    assert got.exhausted_until == NOW + quota.MAX_RESET and "taken as" in got.why
    assert quota.clamped(far, NOW, max_reset=60.0).exhausted_until == NOW + 60
    # an observation stamped in the future (another clock) is bounded from now
    ahead = quota.Quota(observed=NOW + 1e9, exhausted_until=NOW + 2e9)
    assert quota.clamped(ahead, NOW).exhausted_until == NOW + quota.MAX_RESET
    near = quota.Quota(observed=NOW, exhausted_until=NOW + 30)
    assert quota.clamped(near, NOW) is near and quota.clamped(None, NOW) is None
    # what no observe writes is not read: non-finite times, a headroom outside 0..1
    assert quota.decode('{"observed": 1e999, "exhausted_until": 0}') is None
    assert quota.decode('{"observed": 1.0, "exhausted_until": 1e999}') is None
    assert quota.decode('{"observed": 1.0, "headroom": 7.5}').headroom == 1.0
    assert quota.decode('{"observed": 1.0, "headroom": -2}').headroom == 0.0


def test_an_older_request_s_answer_never_shortens_a_later_exhaustion():
    t = 1_800_000_000.0
    limited = quota.observe(429, [("retry-after", "60")], t)
    ok = quota.observe(200, [], t + 3)
    assert not quota.supersedes(ok, t - 1, limited)         # sent before the 429 was seen
    assert quota.supersedes(ok, t + 1, limited)             # sent after it: the member answered
    assert quota.supersedes(ok, t - 1, None)
    assert quota.supersedes(quota.observe(429, [("retry-after", "90")], t + 3), t - 1, limited)
    assert not quota.supersedes(quota.observe(429, [("retry-after", "10")], t + 3), t - 1, limited)
    assert quota.supersedes(ok, t - 1, quota.observe(200, [], t))           # no exhaustion to keep
    assert quota.supersedes(ok, t + 100, limited)                           # and past it, anything
    assert quota.supersedes(quota.observe(200, [], t + 70), t - 1, limited)  # it has ended
