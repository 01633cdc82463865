"""BodyLimit: mitmproxy's stream_large_bodies is the body limit, and no other value."""

from __future__ import annotations

from typing import Optional

import pytest
from mitmproxy import exceptions

from sessionpin.proxy.limits import BodyLimit
from shellkit import start


@pytest.fixture
def proxy(tmp_path):
    p = start(tmp_path / "none.toml")
    yield p
    p.close()


def _limit(proxy) -> BodyLimit:
    return next(a for a in proxy.addons if isinstance(a, BodyLimit))


def test_stream_large_bodies_follows_the_body_limit(proxy):
    b = _limit(proxy)
    proxy.tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    proxy.tctx.configure(b, sessionpin_max_body_mb=8)
    assert proxy.tctx.options.stream_large_bodies == "8m"
    proxy.tctx.configure(b, sessionpin_max_body_mb=64)
    assert proxy.tctx.options.stream_large_bodies == "64m"


def test_another_stream_large_bodies_is_refused(proxy):
    """A smaller value would stream inference bodies under the limit to the addressed
    server before the router read them."""
    b = _limit(proxy)
    proxy.tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    proxy.tctx.configure(b, sessionpin_max_body_mb=64)
    with pytest.raises(exceptions.OptionsError, match="stream_large_bodies"):
        proxy.tctx.configure(b, stream_large_bodies="1m")
    assert proxy.tctx.options.stream_large_bodies == "64m"
