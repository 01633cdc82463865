import subprocess
import sys
from pathlib import Path

import sessionpin

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{sessionpin.__version__}"' in text


def test_core_never_imports_mitmproxy():
    # The functional core must be importable (and usable) without mitmproxy: only
    # sessionpin/addon.py adapts flows, and flowfile.py (the classify tool's reader of
    # mitmdump -w files) uses mitmproxy's own FlowReader, imported when a flow file is read.
    allowed = {"sessionpin/addon.py", "sessionpin/flowfile.py"}
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "sessionpin").rglob("*.py")
        if p.relative_to(ROOT).as_posix() not in allowed and "mitmproxy" in "".join(
            line for line in p.read_text().splitlines(keepends=True)
            if line.lstrip().startswith(("import ", "from "))
        )
    ]
    assert offenders == []
