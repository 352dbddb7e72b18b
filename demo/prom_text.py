"""Prometheus text exposition, parsed: what a server's ``/metrics`` says.

Parsing is ``prometheus_client``'s (a vLLM dependency); this module only indexes
the samples by their own name (``vllm:kvtail_tails_zeroed_total``, ``..._bucket``)
and adds the sums the harness asks for.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

# sample name -> [(labels, value), ...] for every sample
Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    """Every sample of a text exposition, by sample name."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    return sum(
        v
        for got, v in samples.get(name, [])
        if all(got.get(k) == want for k, want in labels.items())
    )


def kvtail_values(samples: Samples) -> dict[str, float]:
    """The wrapper's metrics (``vllm:kvtail_*``, summed over labels), by the name
    without prefix and ``_total`` suffix: ``tails_zeroed``, ``held_requests``..."""
    out: dict[str, float] = {}
    for name, rows in samples.items():
        if name.startswith("vllm:kvtail_") and not name.endswith("_created"):
            key = name[len("vllm:kvtail_") :].removesuffix("_total")
            out[key] = out.get(key, 0.0) + sum(v for _, v in rows)
    return out


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def info_label(samples: Samples, name: str, label: str) -> str:
    """A label of an info-style gauge (``vllm:cache_config_info``: ``block_size``...)."""
    rows = samples.get(name, [])
    if not rows or label not in rows[0][0]:
        raise KeyError(f"{name} has no label {label!r} in /metrics")
    return rows[0][0][label]
