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
