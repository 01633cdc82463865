import subprocess
import sys
from pathlib import Path

import sessionpin

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{sessionpin.__version__}"' in text


def test_the_layers_hold():
    # The contracts are [tool.importlinter] in pyproject.toml: the core imports neither
    # mitmproxy nor the shell nor the CLI; the store imports nothing of the core; the pool
    # and the CLI never import the shell; no two modules import each other.
    lint = Path(sys.executable).parent / "lint-imports"
    p = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "broken" in p.stdout and " 0 broken" in p.stdout


# The library's modules that are not the core: tools beside it that may use mitmproxy's
# readers (classify, flowfile) or edit the user's config file (configedit).
NOT_CORE = {"__init__", "classify", "configedit", "flowfile"}


def test_every_core_module_is_under_the_contracts():
    # A module added to sessionpin/ without being named in the core contract would escape
    # it silently; name it there (or here, with the reason it is not core).
    import tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    core = next(c for c in contracts if c["name"].startswith("the core"))
    store = next(c for c in contracts if c["name"].startswith("the store"))
    modules = {p.stem for p in (ROOT / "sessionpin").glob("*.py")} - NOT_CORE
    assert modules - {m.removeprefix("sessionpin.") for m in core["source_modules"]} == set()
    assert modules - {m.removeprefix("sessionpin.") for m in store["forbidden_modules"]} == set()


# Module-level objects of the shell and the pool that hold state, with why (proxy/__init__.py).
PROCESS_STATE = {
    "sessionpin.proxy.defaults._no_chatter": "a logging filter without state (added and removed by identity)",
    "sessionpin.opencode_ids.options.BY_NAME": "a constant table: option name -> option",
}


def test_the_shell_and_the_pool_keep_no_other_module_level_state():
    import importlib
    import pkgutil
    import sessionpin.opencode_ids
    import sessionpin.proxy

    found: dict[int, str] = {}
    for pkg in (sessionpin.proxy, sessionpin.opencode_ids):
        for name in [pkg.__name__] + [f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]:
            for attr, value in vars(importlib.import_module(name)).items():
                mutable = isinstance(value, (dict, list, set, bytearray))
                ours = type(value).__module__.startswith("sessionpin.") and not isinstance(value, type)
                if (mutable or ours) and not attr.startswith("__"):
                    found.setdefault(id(value), f"{name}.{attr}")     # first binding: where it is made
    assert sorted(found.values()) == sorted(PROCESS_STATE)


def test_no_proxy_state_is_the_processs():
    """Issue 21: a proxy's decision lines and its OpenCode id pool are its own (the addon
    tree's; the pool's kept on mitmproxy's master across a script reload): no module binds
    a DecisionLog, a pool Manager or a PoolService."""
    import importlib
    import pkgutil

    from sessionpin.opencode_ids import Manager, PoolService
    from sessionpin.proxy.defaults import DecisionLog

    for m in pkgutil.walk_packages(sessionpin.__path__, "sessionpin."):
        if m.name.startswith("sessionpin.mitmscript") or m.name.endswith("__main__"):
            continue                   # a mitmproxy script (its addons are the tree), a command's entry
        for attr, value in vars(importlib.import_module(m.name)).items():
            assert not isinstance(value, (DecisionLog, Manager, PoolService)), f"{m.name}.{attr}"
