"""The Prometheus text format (version 0.0.4) that ``/__sessionpin/metrics`` answers.

``family(out, name, kind, help, samples)`` appends one metric family as one group: its
``# HELP`` and ``# TYPE`` lines, then every sample of it, so no two families interleave.
``samples`` is an iterable of ``(labels, value)``, ``labels`` a sequence of ``(name,
value)`` pairs in the order they are written (empty: a sample without labels).

Escaping, as the format says: in a label value a backslash, a double quote and a line feed
become ``\\\\``, ``\\"`` and ``\\n``; in HELP text a backslash and a line feed. Label names and
metric names are ours (constants), never escaped. Values are ints here.

Kept instead of ``prometheus_client``'s exposition: per scrape it costs several times as
much at our label counts (``scripts/bench_metrics.py``, docs/benchmarks.md "Metrics
scrape"; docs/design.md "Our code or a library's"). The tests read our text with the
reference client's parser.
"""

from __future__ import annotations

from typing import Iterable, Sequence

Labels = Sequence[tuple[str, object]]


def label(v: object) -> str:
    """A label value, escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def help_text(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def family(out: list[str], name: str, kind: str, help: str, samples: Iterable[tuple[Labels, int | float]]) -> None:
    out.append(f"# HELP {name} {help_text(help)}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        if labels:
            inner = ",".join([f'{k}="{label(v)}"' for k, v in labels])
            out.append(f"{name}{{{inner}}} {value}")
        else:
            out.append(f"{name} {value}")


def joined(out: list[str]) -> str:
    return "\n".join(out) + "\n" if out else ""
