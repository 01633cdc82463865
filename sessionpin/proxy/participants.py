"""Participant: what the shell asks of the parts that take a turn beside the router's decision.

A participant is a piece of the proxy the router and the status endpoint call at fixed
points: the OpenCode id pool (``sessionpin.opencode_ids.participant.PoolParticipant``), the server
pools' quota reader (``allocations.Allocations``) and the ledger's counters
(``ledgerwatch.LedgerMetrics``). It is not a mitmproxy addon: mitmproxy sees one addon
(``bundle.Sessionpin``), whose hooks hand ``running`` and ``done`` to each participant; the
router calls ``wants``, ``request`` and ``responseheaders``; the status endpoint calls
``status`` and ``metrics``; the store runtime calls ``configure_store``.

Every participant has every method of ``Participant`` (called as written, never looked up
by name): one implemented in the shell subclasses it and keeps the defaults it does not
need; the OpenCode id pool, which may not import the shell (a layer contract), implements
all of them, and ``tests/test_proxy_bundle.py`` checks that it does.

Rules this module keeps:
- The defaults do nothing: a participant that does not act at a point is called there and
  returns at once (``wants`` False, ``request`` None, ``status`` None: not listed in the
  status, ``metrics`` empty: nothing rendered).
- A participant's exception is logged by whoever called it, never raised into a hook: the
  request goes on as if the participant had done nothing.
"""

from __future__ import annotations

from typing import Any, Awaitable, Protocol, runtime_checkable


@runtime_checkable
class Participant(Protocol):
    name: str      # its key under "participants" in /__sessionpin/status

    def configure_store(self, store: Any) -> None:
        """The store the proxy opened (again whenever ``sessionpin_store`` changes)."""

    def running(self) -> None:
        """mitmproxy's event loop runs."""

    def done(self) -> None:
        """The proxy stops (or the script is reloaded)."""

    def wants(self, method: str, url: str) -> bool:
        """Does a request the router does not route need its facts read for ``request``?"""
        return False

    async def request(self, flow: Any, facts: Any = None, decision: Any = None) -> Any:
        """After the router's decision; a ``steps.Refuse`` returned is answered, the request not sent."""
        return None

    def responseheaders(self, flow: Any) -> Any:
        """A response's headers arrived (before the router's own participants' turn ends)."""
        return None

    def status(self) -> Any:
        """Its part of ``/__sessionpin/status`` (a dict, or an awaitable of one); None: not listed."""
        return None

    def metrics(self) -> str | Awaitable[str]:
        """Prometheus text (or an awaitable of it) added to ``/metrics``; empty: nothing."""
        return ""
