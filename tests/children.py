"""Child processes' output, read without losing lines.

``Popen.communicate`` reads the pipes' descriptors directly, so the lines an earlier
``p.stdout.readline()`` read ahead into the file object's buffer are lost: a test that waits
for "ready" and then collects the acknowledgements with ``communicate`` loses the first ones
whenever the child wrote them before the test read "ready" (on a loaded machine, often).
``communicate`` here reads through the file objects, buffer first.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor


def communicate(p: subprocess.Popen, input: str | None = None, timeout: float = 30) -> tuple[str, str]:
    """What ``p`` writes to stdout and stderr until it exits (after ``input``, then stdin
    closed): everything its file objects hold, read-ahead included. Kills it after ``timeout``."""
    if p.stdin is not None:
        try:
            if input:
                p.stdin.write(input)
            p.stdin.close()
        except BrokenPipeError:
            pass
    with ThreadPoolExecutor(2) as pool:
        out = pool.submit(p.stdout.read) if p.stdout is not None else None
        err = pool.submit(p.stderr.read) if p.stderr is not None else None
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        return (out.result() if out else None), (err.result() if err else None)
