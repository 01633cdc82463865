"""Every test's processes remember stores (``store.identity.Memory``) in a directory of the
test module's own, never the user's config dir: a Redis port or a temporary path reused by
a later module must not be taken for a store that lost what it held. Module-scoped (and
autouse, so it comes before a module's own fixtures): a module-scoped rig's proxies,
started once, remember where its later tests look."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _store_memory(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SESSIONPIN_STORE_MEMORY", str(tmp_path_factory.mktemp("store-memory")))
        yield
