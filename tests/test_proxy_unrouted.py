"""Unrouted (sessionpin/proxy/unrouted.py): what looked like inference at a configured origin and
was left alone is said once per (origin, path prefix), listed, and bounded."""

from __future__ import annotations

import logging

from sessionpin.config.config import parse
from sessionpin.proxy import unrouted as U

CONFIG = parse('''
[servers.glm]
url = "https://api.z.ai"
[servers.gw]
url = "https://gw.example/zen/v1"
''')
GLM, GW = CONFIG.servers["glm"], CONFIG.servers["gw"]


def test_said_once_per_origin_and_prefix_with_the_url_that_would_route_it(caplog):
    u = U.Unrouted()
    with caplog.at_level(logging.WARNING, "sessionpin"):
        for _ in range(3):
            u.note(GLM, "POST", "/api/paas/v4/chat/completions?x=SECRET", now=10.0)
        u.note(GLM, "POST", "/api/paas/v4/responses", now=11.0)     # same origin and prefix
        u.note(GW, "POST", "/openai/chat/completions", now=12.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "POST https://api.z.ai/api/paas/v4/chat/completions looks like inference" in lines[0]
    assert 'a server with url = "https://api.z.ai/api/paas/v4" would route it' in lines[0]
    assert "SECRET" not in " ".join(lines)
    assert "no server URL would route it" in lines[1] and "server gw is written https://gw.example/zen/v1" in lines[1]
    listed = u.listed(CONFIG)
    assert [(x.origin, x.prefix, x.endpoint, x.count, x.first, x.last, x.url) for x in listed] == [
        ("https://api.z.ai", "/api/paas/v4", "/chat/completions", 4, 10.0, 11.0, "https://api.z.ai/api/paas/v4"),
        ("https://gw.example", "/openai", "/chat/completions", 1, 12.0, 12.0, None)]


def test_routed_paths_look_alikes_and_other_methods_are_not_noted(caplog):
    u = U.Unrouted()
    with caplog.at_level(logging.WARNING, "sessionpin"):
        for path in ("/v1/messages", "/zen/v1/chat/completions", "/v1/threads/x/messages", "/v1/messages/batches",
                     "/v1/organizations/o/messages", "/api/claude_code/settings"):
            u.note(GLM, "POST", path)
        u.note(GLM, "GET", "/v4/chat/completions")
    assert caplog.records == [] and u.listed(CONFIG) == []


def test_an_entry_the_config_now_routes_is_not_listed():
    u = U.Unrouted()
    u.note(GLM, "POST", "/api/paas/v4/chat/completions")
    fixed = parse('[servers.glm]\nurl = "https://api.z.ai"\n[servers.paas]\nurl = "https://api.z.ai/api/paas/v4"\n')
    assert u.listed(fixed) == [] and len(u.listed(CONFIG)) == 1
    assert u.listed(parse("")) == []          # the origin is no longer configured


def test_bounded(caplog):
    u = U.Unrouted()
    with caplog.at_level(logging.WARNING, "sessionpin"):
        for i in range(U.LIMIT + 10):
            u.note(GLM, "POST", f"/p{i}/v2/messages")
    assert len(u.entries) == U.LIMIT and u.dropped == 10 and len(caplog.records) == U.LIMIT


def test_a_key_in_the_path_prefix_is_never_said_or_listed(caplog):
    """Some gateways take the key in the URL's path (``/key/<key>/v4/...``): the warning and
    the listing (doctor, status) name the prefix without it."""
    key = "sk-Q8zv2Lr7XwKp4TnB9sYd6HcJ1mFgA5eRuV0iO3lZ"
    u = U.Unrouted()
    with caplog.at_level(logging.WARNING, "sessionpin"):
        u.note(GLM, "POST", f"/key/{key}/v4/chat/completions", now=10.0)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "looks like inference" in said and key not in said and "Q8zv2Lr7" not in said, said
    listed = u.listed(CONFIG)
    assert len(listed) == 1 and key not in listed[0].prefix and key not in (listed[0].url or "")
