"""Serves the ranks' pushed series, plus the liveness the agent derives from them.

Yields every ``source="rank"`` metric of the catalogue that some rank pushed, with ``run`` and
``rank`` labels (and the workload labels a rank has), then ``trainpatrol_rank_up``,
``trainpatrol_rank_last_push_timestamp_seconds`` and ``trainpatrol_rank_last_step_timestamp_seconds``.
A prometheus_client collector: the agent's /metrics writes it in either format (collectors.health).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple, Protocol

from prometheus_client.metrics_core import Metric

from ..catalogue import AGENT_METRICS, RANK_METRICS, STEP_DURATION_BUCKETS
from ..protocol import RankSnapshot
from .text_format import Labels

WORKLOAD_LABELS = ("namespace", "pod", "container", "node")
"""The training process's own Kubernetes identity, on every series of its rank when it has one."""
_HISTOGRAM = next(m.name for m in RANK_METRICS if m.kind == "histogram")
_BOUNDS = (*(str(b) for b in STEP_DURATION_BUCKETS), "+Inf")
_LIVENESS = tuple(m for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_"))


class RankRow(NamedTuple):
    """What a scrape writes of one rank."""

    snapshot: RankSnapshot
    up: bool
    last_push: float
    last_step_advance: float


class RankSource(Protocol):
    """Where the ranks come from (agent.store)."""

    def state(self) -> Hashable:
        """Changes whenever ``rows`` would give something else: a push, an expiry, an up flag flipping."""

    def rows(self) -> Sequence[RankRow]:
        """Every rank, sorted by (namespace, run, rank)."""


def rank_labels(snap: RankSnapshot) -> dict[str, str]:
    """The labels every series of a rank carries: run, rank and the workload labels it has."""
    labels = {"run": snap.run, "rank": str(snap.rank)}
    labels.update({k: getattr(snap, k) for k in WORKLOAD_LABELS if getattr(snap, k)})
    return labels


class RankCollector:
    """Families in catalogue order, the ranks in order within each; labels sorted by name, as the
    text format has always written them."""

    def __init__(self, source: RankSource, max_series: int = 200_000) -> None:
        self._source = source
        self._labels: dict[tuple[object, ...], dict[str, str]] = {}
        """Each series' labels, sorted, kept from scrape to scrape: a rank pushes the same series every
        second, and building them again was most of a scrape. Cleared when past ``max_series``."""
        self._max_series = max_series

    def version(self) -> Hashable:
        return self._source.state()

    def collect(self) -> Iterator[Metric]:
        rows = self._source.rows()
        families = {spec.name: spec.family() for spec in RANK_METRICS}
        liveness = [spec.family() for spec in _LIVENESS]
        if len(self._labels) > self._max_series:
            self._labels.clear()
        labels_of = self._labels
        for row in rows:
            snap = row.snapshot
            rank = (snap.run, snap.rank, *(getattr(snap, k) for k in WORKLOAD_LABELS))
            base: dict[str, str] | None = None
            for s in snap.samples:
                key = (rank, s.name, *s.labels.items())
                labels = labels_of.get(key)
                if labels is None:
                    base = base or rank_labels(snap)
                    labels = labels_of[key] = _sorted(base | s.labels)
                fam = families[s.name]
                fam.add_sample(s.name, labels, 1.0 if fam.type == "info" else s.value)
            plain = labels_of.get(rank)
            if plain is None:
                plain = labels_of[rank] = _sorted(rank_labels(snap))
            if snap.histogram is not None:
                fam, counts = families[_HISTOGRAM], snap.histogram.counts
                for le, count in zip(_BOUNDS, counts, strict=True):
                    key = (rank, le)
                    labels = labels_of.get(key)
                    if labels is None:
                        labels = labels_of[key] = _sorted(plain | {"le": le})
                    fam.add_sample(_HISTOGRAM + "_bucket", labels, count)
                fam.add_sample(_HISTOGRAM + "_count", plain, counts[-1])
                fam.add_sample(_HISTOGRAM + "_sum", plain, snap.histogram.sum)
            for fam, value in zip(liveness, (1.0 if row.up else 0.0, row.last_push, row.last_step_advance),
                                  strict=True):
                fam.add_sample(fam.name, plain, value)
        yield from (f for f in (*families.values(), *liveness) if f.samples)


def _sorted(labels: dict[str, str]) -> dict[str, str]:
    return Labels(dict(sorted(labels.items())))
