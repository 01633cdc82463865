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
    # mitmproxy nor the shell, the CLI, the OpenCode id pool or the offline tools; the store
    # imports nothing of the core; the core's packages are layers; the id pool and the CLI
    # never import the shell; no two modules import each other.
    lint = Path(sys.executable).parent / "lint-imports"
    p = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "broken" in p.stdout and " 0 broken" in p.stdout
    assert f"{len(_contracts())} kept" in p.stdout


# sessionpin's packages that are not the core, with why: each is under a contract of its own.
NOT_CORE = {
    "proxy": "the shell, the only mitmproxy importer",
    "mitmscript": "the mitmproxy script that loads the shell",
    "cli": "the operator's command",
    "store": "the store: knows no pins or rules (its own contract)",
    "opencode_ids": "the OpenCode id pool: the shell drives it",
    "offline": "offline readers (sessionpin classify): may import mitmproxy's flow reader",
}


def _contracts():
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_core_is_in_packages_each_under_the_contracts():
    # A module added flat to sessionpin/, or a package named in no contract, would escape the
    # layers silently: put it in the package that holds its kind (docs/design.md), or name
    # the new package in the contracts (or in NOT_CORE, with the reason it is not core).
    sp = ROOT / "sessionpin"
    assert {p.name for p in sp.glob("*.py")} == {"__init__.py"}
    packages = {p.parent.name for p in sp.glob("*/__init__.py")}
    contracts = _contracts()
    core = next(c for c in contracts if c["name"].startswith("the core knows"))
    store = next(c for c in contracts if c["name"].startswith("the store"))
    layers = next(c for c in contracts if c["type"] == "layers")
    named = {m.removeprefix("sessionpin.") for m in core["source_modules"]}
    assert named == packages - set(NOT_CORE)
    assert set(NOT_CORE) <= packages
    assert {"sessionpin." + p for p in packages - {"store"}} <= set(store["forbidden_modules"])
    in_layers = {m.strip().removeprefix("sessionpin.") for layer in layers["layers"] for m in layer.split("|")}
    assert in_layers == named | {"store"}


def test_every_package_says_what_it_holds():
    import ast
    for init in (ROOT / "sessionpin").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, init.parent.name


# Module-level objects of the shell and the pool that hold state, with why (proxy/__init__.py).
PROCESS_STATE = {
    "sessionpin.proxy.defaults._no_chatter": "a logging filter without state (added and removed by identity)",
    "sessionpin.proxy.defaults._content_free": "a logging filter without state (added and removed by identity)",
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
