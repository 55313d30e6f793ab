"""Prometheus' text format for ``/metrics``, as ``prometheus_client.generate_latest`` writes it,
at the openb cluster's size.

prometheus_client 0.26 checks and escapes every label name of every sample, for UTF-8 names:
at 6,212 GPUs and 8,040 sandboxes that is 670,000 checks for 100,000 lines, 1.1 of the
scrape's 1.8 s. Our families' names and label names are fixed identifiers, so each set is
checked once, with the library's own rules, and the lines are written with its value
formatting. Anything this writer does not know (another metric type, OpenMetrics-only
samples) goes to ``generate_latest`` whole. ``tests/portal/telemetry/test_metrics.py`` holds the two
outputs equal.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_TYPES = {"gauge": "", "counter": "_total"}  # the types we write, and the suffix of their samples


def text_format(registry: Collector) -> bytes:
    families = list(registry.collect())
    if not all(_plain(family) for family in families):
        return generate_latest(_Families(families))
    out: list[str] = []
    # Rendered label sets: a GPU's ten DCGM series share one, so most samples find theirs.
    rendered: dict[tuple[tuple[str, str], ...], str] = {}
    label_names: dict[str, str] = {}
    for family in families:
        name = escape_metric_name(family.name + _TYPES[family.type])
        help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {family.type}\n")
        for sample in family.samples:
            if not sample.labels:
                out.append(f"{name} {floatToGoString(sample.value)}\n")
                continue
            items = tuple(sorted(sample.labels.items()))
            labels = rendered.get(items)
            if labels is None:
                pairs = ",".join(f'{_label_name(k, label_names)}="{_label_value(v)}"' for k, v in items)
                labels = rendered[items] = "{" + pairs + "}"
            out.append(f"{name}{labels} {floatToGoString(sample.value)}\n")
    return "".join(out).encode()


def _plain(family: Metric) -> bool:
    suffix = _TYPES.get(family.type)
    if suffix is None:
        return False
    return all(s.name == family.name + suffix and s.timestamp is None for s in family.samples)


def _label_name(name: str, known: dict[str, str]) -> str:
    escaped = known.get(name)
    if escaped is None:
        escaped = known[name] = escape_label_name(name)
    return escaped


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Families:
    """Families already collected, as a collector ``generate_latest`` can read again."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)
