"""The store kinds the conformance tests run against, listed in one place.

``KINDS`` names each kind; ``<kind>_url`` is a fixture giving a fresh, empty store's URL
(it may skip, saying why, where the kind cannot run). Adding a kind — Redis, say — is one
line in ``KINDS`` plus its ``redis_url`` fixture here. Import the fixtures a test module
uses (``from stores import store_url, memory_url, file_url``).
"""

from __future__ import annotations

import pytest

KINDS = ["memory", "file"]


@pytest.fixture
def memory_url() -> str:
    return "memory:"


@pytest.fixture
def file_url(tmp_path) -> str:
    return f"file:{tmp_path}/store.db"


@pytest.fixture(params=KINDS)
def store_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")
