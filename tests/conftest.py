"""The test suite's two tiers (docs/design.md, "The tests").

- The default tier: ``scripts/test`` with no test paths (the README's command). Every unit,
  router, replay, lineage, websocket and pool e2e test; in parallel (pytest-xdist, one file
  per worker at a time); each test bounded by pytest-timeout.
- The slow tier: the heavy fault, cluster and kill tests named in ``SLOW`` below. Left out of
  the default tier; ``scripts/test --all`` (what ``.ci/run`` runs) runs both. Naming test
  files or ids (``scripts/test tests/test_store_damage.py``) runs what is named, slow or not;
  ``-m`` chooses for itself (``scripts/test -m slow``: the slow tier alone).

The tiers are kept here, by node id pattern, rather than as marks in each file, so a test
file stays as it is; a pattern that no longer names any test is an error (a renamed slow
test would otherwise move to the default tier unseen), checked when the whole suite is
collected. ``tests/redis_servers.shared_cluster`` refuses to start a Redis Cluster for a
test that is not slow, so the default tier never pays for one.

Every test's processes remember stores (``store.identity.Memory``) in a directory of the
test run's own, never the user's config dir (``_store_memory`` below).
"""

from __future__ import annotations

import fnmatch
import os

import pytest
from hypothesis import HealthCheck, settings

import redis_servers

# Hypothesis times each example (200 ms by default) and fails a test whose example took
# longer: on a loaded machine (CI beside other jobs, xdist workers) that fails a property
# test for the machine's load, not for the property (test_allocate failed so at load 24).
# Time is the suite's timeout's business (pytest-timeout), not each example's.
settings.register_profile("sessionpin", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("sessionpin")

# node id pattern (fnmatch; "[[]" is a literal "[") -> why it is slow
SLOW: dict[str, str] = {
    # A Redis Cluster: six redis-servers and a cluster made by redis-cli (several seconds per
    # test process), then failovers.
    "tests/test_store_conformance.py::*[[]redis_cluster*]": "the contract on a cluster",
    "tests/test_store_conformance.py::test_memory_and_redis_cluster_agree": "random operations on a cluster",
    "tests/test_store_redis.py::*[[]cluster]": "the Redis store on a cluster",
    "tests/test_ledger.py::*[[]redis_cluster]": "the ledger's sums on a cluster",
    "tests/test_store_redis.py::test_redis_cluster_and_memory_agree": "random operations on a cluster",
    "tests/test_store_redis.py::test_a_standalone_url_to_a_cluster_node_is_refused": "a cluster node",
    "tests/test_store_redis_cluster.py::*": "a master failed over",
    "tests/test_proxy_redis.py::test_a_server_the_store_will_not_use_is_named_and_refused": "a cluster node",
    "tests/e2e/test_redis_e2e.py::test_the_same_on_a_cluster_with_a_master_failed_over": "routers on a cluster",
    # kill -9 soaks
    "tests/e2e/test_redis_e2e.py::test_thirty_kill_9s_of_routers_under_load_lose_nothing": "30 kill -9s",
    "tests/test_store_processes.py::test_sigkill_loses_no_acknowledged_durable_write": "writers kill -9'd",
    # The file store's damage and repair faults: real damaged files, real processes, each
    # repair waited for (the store's fault table, docs/store.md).
    "tests/test_store_damage.py::*": "damaged and deleted store files",
    "tests/test_store_restore_damaged.py::*": "damage then the directory deleted",
    "tests/e2e/test_store_faults_e2e.py::*": "the store's faults under a running router",
    # The store lost under running routers (flushed, evicted, emptied, restarted without its
    # AOF, copied under load) and Redis's own faults (stopped, paused, reconfigured, loading):
    # real redis-servers started, broken and waited for, each test 5-20 s.
    "tests/e2e/test_store_loss_e2e.py::*": "the store lost under running routers",
    "tests/test_store_redis_faults.py::*": "a real Redis stopped, paused, reconfigured",
    "tests/e2e/test_redis_e2e.py::test_a_stopped_redis_gets_503_naming_it_then_the_same_routers_route_again":
        "a real Redis stopped under routers, then started",
    "tests/e2e/test_redis_e2e.py::test_kill_9_of_redis_loses_no_acknowledged_pin": "redis-server kill -9'd",
    "tests/e2e/test_request_path_e2e.py::test_a_locked_store_never_sends_a_new_conversation_away_and_never_stalls_a_pinned_one":
        "the file store locked by another process for seconds",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", dest="all_tiers",
                     help="sessionpin: run the slow tier too (tests/conftest.py SLOW); CI does")


def _is_slow(nodeid: str) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, p) for p in SLOW)


@pytest.hookimpl(tryfirst=True)   # before -m deselects by mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if whole:
        stale = [p for p in SLOW if not any(fnmatch.fnmatchcase(i.nodeid, p) for i in items)]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py SLOW names no test: {stale}")
    slow = [i for i in items if _is_slow(i.nodeid)]
    for item in slow:
        item.add_marker(pytest.mark.slow)
    # The default tier: the whole suite, not --all, no -m of the caller's.
    if whole and not config.option.all_tiers and not config.option.markexpr:
        keep = [i for i in items if not _is_slow(i.nodeid)]
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)   # before the test's fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    redis_servers.CLUSTER_ALLOWED = item.get_closest_marker("slow") is not None


def pytest_runtest_teardown(item: pytest.Item) -> None:
    redis_servers.CLUSTER_ALLOWED = False


@pytest.fixture(autouse=True, scope="session")
def _store_memory(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SESSIONPIN_STORE_MEMORY", str(tmp_path_factory.mktemp("store-memory")))
        yield


@pytest.fixture(autouse=True)
def _umask_kept():
    """Each test starts with the umask the run began with: a test (or code it loads
    in-process) that changes the process umask must not change what a later test of the same
    worker creates (seen once: a test's "untouched" file made 0600 by an earlier umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    yield
    os.umask(mask)
