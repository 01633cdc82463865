import pytest

from sessionpin.opencode_ids import options
from sessionpin.opencode_ids.options import OPTIONS, PoolConfig, parse

SEED_DEFAULTS = {  # stated in seeds/002
    "sessionpin_pool_max_upstream_ms": 2_500,
    "sessionpin_pool_degrade_ms": 6_000,
    "sessionpin_pool_quarantine_ms": 8_000,
    "sessionpin_pool_quarantine_failures": 2,
    "sessionpin_pool_probe_cooldown_ms": 60_000,
    "sessionpin_pool_startup_budget_ms": 0,
    "sessionpin_pool_request_budget_ms": 0,
    "sessionpin_pool_refresh_interval_ms": 300_000,
    "sessionpin_pool_refill_delay_ms": 15_000,
    "sessionpin_pool_require_gateway_id": False,
}
SEED_KNOBS = ["size", "ttl_ms", "lease_ttl_ms", "max_bindings", "min_probe_interval_ms", "max_upstream_ms",
              "degrade_ms", "quarantine_ms", "quarantine_failures", "probe_cooldown_ms", "startup_budget_ms",
              "request_budget_ms", "refresh_interval_ms", "refill_delay_ms", "require_gateway_id"]


def test_every_seed_knob_is_an_option_with_the_seed_default():
    names = {o.name: o for o in OPTIONS}
    for knob in SEED_KNOBS:
        assert f"sessionpin_pool_{knob}" in names
    for name, default in SEED_DEFAULTS.items():
        assert names[name].default == default
    assert names["sessionpin_pool"].type is bool and names["sessionpin_pool"].default is True


def test_options_are_plain_types_and_defaults_parse_to_the_dataclass_defaults():
    assert all(o.type in (str, int, bool) for o in OPTIONS)
    assert all(isinstance(o.default, o.type) for o in OPTIONS)
    assert parse({}) == PoolConfig()
    cfg = parse(options.defaults())
    assert cfg.gateways == ("https://opencode.ai",)
    assert cfg.probes_per_cycle == 4


@pytest.mark.parametrize("text,origins", [
    ("https://opencode.ai", ("https://opencode.ai",)),
    ("https://OpenCode.ai:443/, https://127.0.0.1:8443", ("https://opencode.ai", "https://127.0.0.1:8443")),
    ("http://gw.local:80,http://gw.local", ("http://gw.local",)),
])
def test_gateways_are_normalised_origins(text, origins):
    assert parse({"sessionpin_pool_gateways": text}).gateways == origins


@pytest.mark.parametrize("values,needle", [
    ({"sessionpin_pool_gateways": "https://user:pw@opencode.ai"}, "gateways"),
    ({"sessionpin_pool_gateways": "https://opencode.ai/zen"}, "gateways"),
    ({"sessionpin_pool_gateways": "ftp://x"}, "gateways"),
    ({"sessionpin_pool_size": 0}, "size"),
    ({"sessionpin_pool_size": -1}, "size"),
    ({"sessionpin_pool_ttl_ms": True}, "ttl_ms"),
    ({"sessionpin_pool": "yes"}, "sessionpin_pool"),
    ({"sessionpin_pool_degrade_ms": 9000}, "quarantine_ms"),
    ({"sessionpin_pool_refresh_interval_ms": 10}, "refresh_interval_ms"),
])
def test_bad_values_name_the_option(values, needle):
    with pytest.raises(ValueError, match=needle):
        parse(values)
