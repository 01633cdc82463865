"""The Prometheus text format (version 0.0.4) that ``/__sessionpin/metrics`` answers.

``family(out, name, kind, help, labels, samples)`` appends one metric family as one group:
its ``# HELP`` and ``# TYPE`` lines, then every sample of it, so no two families interleave.
``labels`` are the label names, in the order they are written; ``samples`` is an iterable
of ``(values, value)``: ``values`` is a tuple of one label value per name, or with one
label name the label value itself (a dict's or Counter's ``items()`` as they are).

Escaping, as the format says: in a label value a backslash, a double quote and a line feed
become ``\\\\``, ``\\"`` and ``\\n``; in HELP text a backslash and a line feed. Label names and
metric names are ours (constants), never escaped. Values are ints here.

Kept instead of ``prometheus_client``'s exposition: per scrape it costs several times as
much at our label counts (``scripts/bench_metrics.py``, docs/benchmarks.md "Metrics
scrape"; docs/design.md "Our code or a library's"). The tests read our text with the
reference client's parser.
"""

from __future__ import annotations

from typing import Any, Iterable


def label(v: object) -> str:
    """A label value, escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def help_text(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def family(out: list[str], name: str, kind: str, help: str, labels: tuple[str, ...],
           samples: Iterable[tuple[Any, int | float]]) -> None:
    out.append(f"# HELP {name} {help_text(help)}")
    out.append(f"# TYPE {name} {kind}")
    if not labels:
        out.extend([f"{name} {value}" for _, value in samples])
    elif len(labels) == 1:
        head = f'{name}{{{labels[0]}="'
        out.extend([f'{head}{label(v)}"}} {value}' for v, value in samples])
    else:
        head = f'{name}{{{labels[0]}="'
        seps = [f'",{k}="' for k in labels[1:]]
        for values, value in samples:
            parts = [head, label(values[0])]
            for sep, v in zip(seps, values[1:], strict=True):
                parts += (sep, label(v))
            parts.append(f'"}} {value}')
            out.append("".join(parts))


def joined(out: list[str]) -> str:
    return "\n".join(out) + "\n" if out else ""
