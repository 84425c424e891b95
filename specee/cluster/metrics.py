"""The ingress's /metrics: every replica's own metrics, labelled `replica="<id>"`, and their sum
labelled `replica="all"` (so `sum(x{replica!="all"})` and `x{replica="all"}` agree)."""
from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

ALL = "all"


class Merged:
    """A prometheus_client collector over replicas' expositions (text, as each replica wrote it)."""

    def __init__(self, expositions: dict[str, str]) -> None:
        self.expositions = expositions

    def collect(self):
        families: dict[str, Metric] = {}
        sums: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        for replica, text in sorted(self.expositions.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue  # a per-process timestamp: neither summable nor useful per replica
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
                    sums[family.name][(sample.name, tuple(sorted(sample.labels.items())))] += sample.value
        for name, merged in families.items():
            for (sample_name, labels), value in sums[name].items():
                merged.add_sample(sample_name, {**dict(labels), "replica": ALL}, value)
            yield merged


def exposition(expositions: dict[str, str], *registries: CollectorRegistry) -> bytes:
    """The replicas' metrics merged, then the ingress's own registries."""
    merged = CollectorRegistry(auto_describe=False)
    merged.register(Merged(expositions))
    return generate_latest(merged) + b"".join(generate_latest(r) for r in registries)
