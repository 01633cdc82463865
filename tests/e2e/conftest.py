"""When an end-to-end test fails, show the tail of every mitmdump's output next to the failure."""

from __future__ import annotations

import pytest

from .harness import LIVE


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed:
        for i, m in enumerate(LIVE):
            report.sections.append((f"mitmdump #{i} output (tail)", m.tail(60)))
    return report
