"""Serves the ranks' pushed snapshots, plus the liveness the agent derives from them.

Emits every ``source="rank"`` metric of the catalogue with ``run`` and ``rank`` labels, and
``trainpatrol_rank_up``, ``trainpatrol_rank_last_push_timestamp_seconds`` and
``trainpatrol_rank_last_step_timestamp_seconds``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from ..agent.store import RankStore
from ..catalogue import AGENT_METRICS, RANK_METRICS, STEP_DURATION_BUCKETS
from ..catalogue import Metric as CatalogueMetric

_BOUNDS = [str(b) for b in STEP_DURATION_BUCKETS] + ["+Inf"]
_EXTRA = {m.name: m.labels for m in RANK_METRICS}
_LIVENESS = {m.name: m for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_")}


def _family(m: CatalogueMetric) -> Metric:
    labels = list(m.all_labels)
    if m.kind == "counter":
        return CounterMetricFamily(m.name, m.help, labels=labels)
    if m.kind == "histogram":
        return HistogramMetricFamily(m.name, m.help, labels=labels)
    if m.kind == "info":
        # the extra labels arrive as the info's value dict
        return InfoMetricFamily(m.name.removesuffix("_info"), m.help, labels=labels[: len(labels) - len(m.labels)])
    return GaugeMetricFamily(m.name, m.help, labels=labels)


class RankCollector:
    def __init__(self, store: RankStore) -> None:
        self._store = store

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        entries = self._store.entries()
        families = {m.name: _family(m) for m in RANK_METRICS}
        up, push, advanced = (
            GaugeMetricFamily(name, m.help, labels=list(m.all_labels)) for name, m in _LIVENESS.items()
        )
        for e in entries:
            snap = e.snapshot
            base = [snap.run, str(snap.rank)]
            for s in snap.samples:
                family = families[s.name]
                if isinstance(family, InfoMetricFamily):
                    family.add_metric(base, s.labels)
                else:
                    extra = [s.labels[k] for k in _EXTRA[s.name]]
                    family.add_metric(base + extra, s.value)  # type: ignore[attr-defined]
            if snap.histogram is not None:
                h = snap.histogram
                buckets = list(zip(_BOUNDS, h.counts, strict=False))
                families[h.name].add_metric(base, buckets, h.sum)  # type: ignore[attr-defined]
            up.add_metric(base, 1.0 if self._store.is_up(e) else 0.0)
            push.add_metric(base, e.last_push)
            advanced.add_metric(base, e.last_step_advance)
        yield from families.values()
        yield from (up, push, advanced)

