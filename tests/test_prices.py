"""Prices: the operator's, per server and model; a cost only when every kind of token has one."""

import pytest

from sessionpin.config import config
from sessionpin.accounting.prices import Price, cost, price_for
from sessionpin.accounting.usage import Usage

TEXT = '''
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.anthropic.prices."claude-opus-*"]
input = 5
output = 25
cache_read = 0.5
cache_write_5m = 6.25
cache_write_1h = 10

[servers.anthropic.prices."*"]
input = 1
output = 5
'''


def test_prices_are_read_from_the_config_per_server_and_model_glob():
    s = config.parse(TEXT).servers["anthropic"]
    assert price_for(s.prices, "claude-opus-5-5") == Price(input=5, output=25, cache_read=0.5, cache_write_5m=6.25,
                                                           cache_write_1h=10)
    assert price_for(s.prices, "claude-haiku-5") == Price(input=1, output=5)
    assert price_for((), "x") is None
    assert config.parse('[servers.a]\nurl = "https://a"\n').servers["a"].prices == ()


@pytest.mark.parametrize("table,message", [
    ('input = "5"', "must be a price per million tokens"),
    ("input = -1", "must be a price per million tokens"),
    ("cache_write = 1", "unknown key"),
])
def test_a_bad_price_is_refused_with_its_line(table, message):
    with pytest.raises(config.ConfigError) as e:
        config.parse(f'[servers.a]\nurl = "https://a"\n\n[servers.a.prices."m"]\n{table}\n', "c.toml")
    assert message in str(e.value) and "c.toml:5" in str(e.value)


def test_each_kind_of_token_at_its_price():
    price = Price(input=5, output=25, cache_read=0.5, cache_write_5m=6.25, cache_write_1h=10)
    u = Usage(input=1_000_000 + 2_000_000 + 100_000 + 10_000, output=50_000, cache_read=2_000_000,
              cache_write_5m=100_000, cache_write_1h=10_000, reasoning=20_000)
    got, missing = cost(u, price)
    assert missing == () and got == pytest.approx(5 + 50_000 * 25 / 1e6 + 1.0 + 0.625 + 0.1)


def test_a_missing_price_makes_the_cost_unknown_and_says_which():
    assert cost(Usage(input=10, output=5, cache_read=4), Price(input=1, output=1)) == (None, ("cache_read",))
    assert cost(Usage(input=10, output=5), None) == (None, ("input", "output"))
    assert cost(Usage(input=10, output=5), Price(input=1, output=1, cache_read=None))[1] == ()
