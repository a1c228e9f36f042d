"""One Prometheus text for several engine replicas' metrics.

Each replica's series come back with a ``replica="<i>"`` label, and every series also
once more as ``replica="all"``: the replicas' sum (counters, histograms and most
gauges), their mean (``*_perc`` usage gauges), their largest value (``*_info``) or
their smallest (``*_created``, start times). ``<prefix>:replica_up{replica="<i>"}``
says which replicas answered. A query that sums over replicas must therefore pick
either ``replica="all"`` or ``replica!="all"``, never both.
"""
from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

ALL = "all"


def _combine(name: str, kind: str, values: list[float]) -> float:
    if kind == "gauge":
        if name.endswith("_perc"):
            return sum(values) / len(values)
        if name.endswith("_info"):
            return max(values)
        if name.endswith("_created") or name.endswith("start_time_seconds"):
            return min(values)
    return sum(values)


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return "NaN" if math.isnan(v) else repr(float(v))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join('{}="{}"'.format(k, v.replace("\\", r"\\").replace("\n", r"\n")
                                     .replace('"', r'\"')) for k, v in labels.items())
    return "{" + body + "}"


def merge_metrics(texts: list[str | None], prefix: str = "folio") -> str:
    """``texts[i]``: replica i's Prometheus text, None when it did not answer."""
    families: dict[str, tuple[str, str]] = {}  # header name → (type, help), first seen
    samples: dict[str, list[tuple[str, dict, float]]] = defaultdict(list)
    totals: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for replica, text in enumerate(texts):
        if text is None:
            continue
        for family in text_string_to_metric_families(text):
            header = family.name + ("_total" if family.type == "counter" else "")
            families.setdefault(header, (family.type, family.documentation))
            for s in family.samples:
                samples[header].append((s.name, {**s.labels, "replica": str(replica)},
                                        s.value))
                key = (s.name, tuple(sorted(s.labels.items())))
                totals[header][key].append(s.value)
    lines = [f"# HELP {prefix}:replica_up Whether each engine replica answered this scrape",
             f"# TYPE {prefix}:replica_up gauge"]
    lines += [f'{prefix}:replica_up{{replica="{i}"}} {1.0 if t is not None else 0.0}'
              for i, t in enumerate(texts)]
    for header, (kind, doc) in families.items():
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {header} {doc}")
        lines.append(f"# TYPE {header} {kind}")
        lines += [f"{name}{_labels(labels)} {_value(v)}" for name, labels, v in samples[header]]
        for (name, labels), values in totals[header].items():
            lines.append(f"{name}{_labels({**dict(labels), 'replica': ALL})} "
                         f"{_value(_combine(header, kind, values))}")
    return "\n".join(lines) + "\n"
