"""What members' answers say about their quota (sessionpin/quota.py): a table of real header shapes."""

from __future__ import annotations

import pytest

from sessionpin import quota

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
