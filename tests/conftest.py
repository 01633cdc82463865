"""Every test's processes remember stores (``store.identity.Memory``) in a directory of the
test run's own, never the user's config dir. Session-scoped (and autouse, so it is in place
before any rig a module or the session starts): every store a test makes has a location of
its own (a temporary path; a Redis URL under a unique key prefix), so one directory for the
run cannot make one test's store look like another's lost one."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _store_memory(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SESSIONPIN_STORE_MEMORY", str(tmp_path_factory.mktemp("store-memory")))
        yield
