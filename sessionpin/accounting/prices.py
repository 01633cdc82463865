"""What tokens cost: the operator's prices per server and model, and a ledger's cost under them.

Rules it keeps:
- Prices are the operator's, written in the config (``[servers.NAME.prices."GLOB"]``, in
  currency units per million tokens): sessionpin ships no price table (a built-in one would be
  wrong the day a provider changes it, and for every gateway, discount and contract).
- A model's price is the first glob of its server that matches the model the server named in
  its answer (``fnmatch``, case-sensitive, like ``models``).
- Each kind of token is billed at its own price: uncached input at ``input``, cache reads at
  ``cache_read``, cache writes at ``cache_write_5m``/``cache_write_1h``, output (reasoning
  included: providers bill it as output) at ``output``. A kind the usage holds whose price is not
  written makes the cost unknown (None), never a guess: the figure names what is missing.
Pure.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .usage import Usage

KINDS = ("input", "output", "cache_read", "cache_write_5m", "cache_write_1h")
PER = 1_000_000


@dataclass(frozen=True)
class Price:
    """Per million tokens; None: not written."""
    input: float | None = None
    output: float | None = None
    cache_read: float | None = None
    cache_write_5m: float | None = None
    cache_write_1h: float | None = None


def price_for(prices: tuple[tuple[str, Price], ...], model: str) -> Price | None:
    for pattern, price in prices:
        if fnmatch.fnmatchcase(model, pattern):
            return price
    return None


def cost(usage: Usage, price: Price | None) -> tuple[float | None, tuple[str, ...]]:
    """The cost of ``usage`` at ``price``, and the kinds of token it holds that have no price
    (then the cost is None)."""
    amounts = {"input": usage.uncached, "output": usage.output, "cache_read": usage.cache_read,
               "cache_write_5m": usage.cache_write_5m, "cache_write_1h": usage.cache_write_1h}
    if price is None:
        return None, tuple(k for k, n in amounts.items() if n) or ("input",)
    missing = tuple(k for k, n in amounts.items() if n and getattr(price, k) is None)
    if missing:
        return None, missing
    return sum(n * (getattr(price, k) or 0.0) for k, n in amounts.items()) / PER, ()
