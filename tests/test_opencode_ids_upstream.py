"""mitmproxy's upstream options as the pool reads them (the real proxy path is in tests/e2e/test_opencode_ids_e2e.py)."""
import ssl

import certifi
import pytest

from fakegateway import make_ca_and_cert
from sessionpin.opencode_ids import options
from sessionpin.opencode_ids.upstream import Upstream, describe, parse, ssl_context


@pytest.mark.parametrize("modes, proxy", [
    (None, None),
    (["regular"], None),
    (["reverse:https://opencode.ai@8081"], None),                      # a reverse listener: probes go direct
    (["upstream:http://corp:3128"], "http://corp:3128"),
    (["upstream:corp"], "http://corp:80"),                             # mitmproxy's defaults: http, its port
    (["upstream:https://corp/"], "https://corp:443"),
    (["upstream:http://corp:3128@8081"], "http://corp:3128"),          # @listen-port is the listener's
    (["upstream:http://[::1]:3128@127.0.0.1:8081"], "http://[::1]:3128"),
    (["regular", "UPSTREAM:http://corp:3128"], "http://corp:3128"),
    ("upstream:http://corp:3128", "http://corp:3128"),
])
def test_the_upstream_mode_names_the_proxy(modes, proxy):
    assert parse({"mode": modes}).proxy == proxy


@pytest.mark.parametrize("spec", ["upstream:socks5://corp:1080", "upstream:http://corp:3128/path", "upstream:"])
def test_a_mode_that_is_no_http_proxy_is_an_error(spec):
    with pytest.raises(ValueError, match="not an http\\(s\\) upstream proxy"):
        parse({"mode": [spec]})


def test_several_upstream_proxies_the_first_is_followed_and_the_others_named():
    u = parse({"mode": ["upstream:http://a:1@8081", "upstream:http://b:2@8082", "upstream:http://a:1@8083"]})
    assert (u.proxy, u.ignored) == ("http://a:1", ("http://b:2",))
    assert describe(u).endswith("other upstream proxies not used by probes: http://b:2")


def test_auth_is_user_password_and_never_shown():
    u = parse({"mode": ["upstream:http://corp:3128"], "upstream_auth": "alice:pa:ss"})
    assert u.proxy_auth == ("alice", "pa:ss")
    assert "pa:ss" not in repr(u) and "pa:ss" not in describe(u) and "with upstream_auth" in describe(u)
    with pytest.raises(ValueError, match="upstream_auth"):
        parse({"upstream_auth": "no-colon"})


def test_describe_says_how_probes_go_out():
    assert describe(Upstream()) == ("probes connect to the gateway directly (no upstream: mode), "
                                    "trusting certifi's CAs")
    u = parse({"mode": ["upstream:http://corp:3128"], "ssl_verify_upstream_trusted_ca": "/etc/corp.pem"},
              extra_ca="/x/extra.pem")
    assert describe(u) == ("probes go through the upstream proxy http://corp:3128 (mitmproxy's upstream mode), "
                           "trusting /etc/corp.pem and /x/extra.pem")
    assert "without verifying certificates" in describe(parse({"ssl_insecure": True}))


def test_trust_is_mitmproxys_the_trusted_ca_replaces_certifi(tmp_path):
    ca, _, _ = make_ca_and_cert(tmp_path)
    n_certifi = len(ssl.create_default_context(cafile=certifi.where()).get_ca_certs())
    assert len(ssl_context(Upstream()).get_ca_certs()) == n_certifi
    assert len(ssl_context(Upstream(trusted_ca=str(ca))).get_ca_certs()) == 1
    assert len(ssl_context(Upstream(extra_ca=str(ca))).get_ca_certs()) == n_certifi + 1
    off = ssl_context(Upstream(insecure=True))
    assert off.verify_mode == ssl.CERT_NONE and not off.check_hostname


def test_pool_options_carry_the_upstream_and_name_a_bad_one():
    cfg = options.parse({"mode": ["upstream:http://corp:3128"], "upstream_auth": "a:b",
                         "sessionpin_pool_ca_file": "/x/extra.pem"})
    assert cfg.upstream == Upstream(proxy="http://corp:3128", auth="a:b", extra_ca="/x/extra.pem")
    assert options.parse({}).upstream == Upstream()
    with pytest.raises(ValueError, match="sessionpin pool: mode 'upstream:ftp://x'"):
        options.parse({"mode": ["upstream:ftp://x"]})
