"""Serves the ranks' pushed snapshots, plus the liveness the agent derives from them.

Emits every ``source="rank"`` metric of the catalogue with ``run`` and ``rank`` labels, and
``trainpatrol_rank_up``, ``trainpatrol_rank_last_push_timestamp_seconds`` and
``trainpatrol_rank_last_step_timestamp_seconds``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ..agent.exposition import RenderedFamily
from ..agent.store import RankEntry, RankStore
from ..catalogue import AGENT_METRICS, RANK_METRICS
from ..protocol import RankSnapshot
from .rank_lines import Rendered, family, family_samples, plain_labels, rank_lines

_LIVENESS = {m.name: m for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_")}
_FAMILIES = [(m.name, family(m)) for m in RANK_METRICS]
Lines = tuple[str, ...]
"""One rank's exposition lines per family, in ``_FAMILIES`` order ("" where it has none)."""


def _lines(snap: RankSnapshot, previous: Rendered | None = None) -> tuple[Rendered, Lines]:
    rendered = rank_lines(snap, previous)
    return rendered, tuple(rendered.families.get(name, "") for name, _ in _FAMILIES)


class RankCollector:
    """Each rank's lines are formatted once per push (``prepare``), not once per scrape (see
    agent.exposition); a snapshot nobody prepared is formatted at the next scrape."""

    def __init__(self, store: RankStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._rendered: dict[tuple[str, int], tuple[Rendered, Lines]] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        entries = self._store.entries()
        snaps = [e.snapshot for e in entries]
        rendered = self._render(entries)
        columns = zip(*rendered, strict=True) if rendered else ((),) * len(_FAMILIES)
        for (name, f), texts in zip(_FAMILIES, columns, strict=True):
            out = RenderedFamily(f.name, f.documentation, f.type, f.unit)
            text = "".join(texts)
            if text:
                out.add_lazy(text, _samples_of(name, snaps))
            yield out
        yield from self._liveness(entries)

    def _liveness(self, entries: list[RankEntry]) -> Iterator[Metric]:
        """rank_up, last push and last step advance, written as lines (three per rank per scrape)."""
        values = [(1.0 if self._store.is_up(e) else 0.0, e.last_push, e.last_step_advance) for e in entries]
        for i, (name, m) in enumerate(_LIVENESS.items()):
            out = RenderedFamily(name, m.help, "gauge")
            if entries:
                text = "".join(f"{name}{{{plain_labels(e.snapshot)}}} {floatToGoString(v[i])}\n"
                               for e, v in zip(entries, values, strict=True))
                out.add_lazy(text, _gauge_samples(name, m.help, entries, [v[i] for v in values]))
            yield out

    def prepare(self, snap: RankSnapshot) -> None:
        """Format a snapshot as it is pushed, so that a scrape, however frequent, only joins lines."""
        key = (snap.run, snap.rank)
        with self._lock:
            previous = self._rendered.get(key)
        rendered = _lines(snap, previous[0] if previous is not None else None)
        with self._lock:
            self._rendered[key] = rendered

    def _render(self, entries: list[RankEntry]) -> list[Lines]:
        """Per entry: family name -> formatted lines, reused until the rank pushes again."""
        with self._lock:
            cache = dict(self._rendered)
        out, fresh = [], {}
        for e in entries:
            key = (e.snapshot.run, e.snapshot.rank)
            cached = cache.get(key)
            if cached is None or cached[0].snapshot is not e.snapshot:
                cached = _lines(e.snapshot, cached[0] if cached is not None else None)
            fresh[key] = cached
            out.append(cached[1])
        with self._lock:
            self._rendered = fresh  # ranks that expired drop out here
        return out


def _gauge_samples(name: str, help_: str, entries: list[RankEntry], values: list[float]) -> RenderedFamily.SamplesFn:
    def build() -> list[Sample]:
        f = GaugeMetricFamily(name, help_, labels=["run", "rank"])
        for e, v in zip(entries, values, strict=True):
            f.add_metric([e.snapshot.run, str(e.snapshot.rank)], v)
        return f.samples
    return build


def _samples_of(name: str, snaps: list[RankSnapshot]) -> RenderedFamily.SamplesFn:
    """The family's samples, built only when someone asks (generate_latest, tests), never per scrape."""
    return lambda: [s for snap in snaps for s in family_samples(snap).get(name, [])]
