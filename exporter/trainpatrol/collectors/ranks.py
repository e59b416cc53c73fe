"""Serves the ranks' pushed snapshots, plus the liveness the agent derives from them.

Emits every ``source="rank"`` metric of the catalogue with ``run`` and ``rank`` labels, and
``trainpatrol_rank_up``, ``trainpatrol_rank_last_push_timestamp_seconds`` and
``trainpatrol_rank_last_step_timestamp_seconds``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

from ..agent.exposition import RenderedFamily, render
from ..agent.store import RankEntry, RankStore
from ..catalogue import AGENT_METRICS, RANK_METRICS, STEP_DURATION_BUCKETS
from ..catalogue import Metric as CatalogueMetric
from ..protocol import RankSnapshot

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
    """Each rank's samples are formatted once per push (``prepare``), not once per scrape (see
    agent.exposition); a snapshot nobody prepared is formatted at the next scrape."""

    def __init__(self, store: RankStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._rendered: dict[tuple[str, int], tuple[RankSnapshot, dict[str, tuple[list[Sample], str]]]] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        entries = self._store.entries()
        families = {m.name: _rendered_family(m) for m in RANK_METRICS}
        up, push, advanced = (
            GaugeMetricFamily(name, m.help, labels=list(m.all_labels)) for name, m in _LIVENESS.items()
        )
        for e, rendered in zip(entries, self._render(entries), strict=True):
            for name, (samples, text) in rendered.items():
                families[name].add_part(samples, text)
            base = [e.snapshot.run, str(e.snapshot.rank)]
            up.add_metric(base, 1.0 if self._store.is_up(e) else 0.0)
            push.add_metric(base, e.last_push)
            advanced.add_metric(base, e.last_step_advance)
        yield from families.values()
        yield from (up, push, advanced)

    def prepare(self, snap: RankSnapshot) -> None:
        """Format a snapshot as it is pushed, so that a scrape, however rare, only joins lines."""
        rendered = (snap, _render_rank(snap))
        with self._lock:
            self._rendered[(snap.run, snap.rank)] = rendered

    def _render(self, entries: list[RankEntry]) -> list[dict[str, tuple[list[Sample], str]]]:
        """Per entry: family name -> (samples, formatted lines), reused until the rank pushes again."""
        with self._lock:
            cache = dict(self._rendered)
        out, fresh = [], {}
        for e in entries:
            key = (e.snapshot.run, e.snapshot.rank)
            cached = cache.get(key)
            if cached is None or cached[0] is not e.snapshot:
                cached = (e.snapshot, _render_rank(e.snapshot))
            fresh[key] = cached
            out.append(cached[1])
        with self._lock:
            self._rendered = fresh  # ranks that expired drop out here
        return out


def _rendered_family(m: CatalogueMetric) -> RenderedFamily:
    f = _family(m)
    return RenderedFamily(f.name, f.documentation, f.type, f.unit)


def _render_rank(snap: RankSnapshot) -> dict[str, tuple[list[Sample], str]]:
    families = {m.name: _family(m) for m in RANK_METRICS}
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
    used = {name: f for name, f in families.items() if f.samples}
    return {name: (r.samples, r.text) for name, r in zip(used, render(used.values()), strict=True)}
