"""When an end-to-end test fails, show the tail of every mitmdump's output next to the failure."""

from __future__ import annotations

import pytest

from .harness import LIVE


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed:
        # the running ones (else the last one started: a test about a failed start)
        for m in [m for m in LIVE if m.alive] or LIVE[-1:]:
            report.sections.append((f"mitmdump in {m.workdir.name} (last lines)", m.tail(60)))
    return report
