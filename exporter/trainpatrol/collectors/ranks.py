"""Serves the ranks' pushed snapshots, plus the liveness the agent derives from them.

Emits every ``source="rank"`` metric of the catalogue with ``run`` and ``rank`` labels, and
``trainpatrol_rank_up``, ``trainpatrol_rank_last_push_timestamp_seconds`` and
``trainpatrol_rank_last_step_timestamp_seconds``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, is_

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from ..agent.exposition import RenderedFamily, SamplesFn, go_floats
from ..agent.store import RankEntry, RankStore
from ..catalogue import AGENT_METRICS, RANK_METRICS
from ..protocol import Histogram, RankSnapshot
from ..protocol import Sample as PushedSample
from .rank_lines import HISTOGRAM_AT, WORKLOAD_LABELS, Layout, Table, family, family_samples

_LIVENESS = [(m.name, m.help) for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_")]
assert [name for name, _ in _LIVENESS] == ["trainpatrol_rank_up", "trainpatrol_rank_last_push_timestamp_seconds",
                                           "trainpatrol_rank_last_step_timestamp_seconds"]  # Liveness below
_FAMILIES = [(m.name, family(m)) for m in RANK_METRICS]
_SAMPLES, _HISTOGRAM = attrgetter("samples"), attrgetter("histogram")
_LAST_PUSH, _LAST_STEP = attrgetter("last_push"), attrgetter("last_step_advance")


@dataclass(frozen=True)
class _Liveness:
    """The liveness lines of a ``Table``'s ranks: rank_up's two lines per rank, and the timestamp
    families as ``%s``-templates (timestamps are 1e6 and more, which ``go_float`` writes). A run
    name has no ``%`` (protocol.RUN_PATTERN), so the labels need no escaping."""

    up: tuple[str, ...]
    down: tuple[str, ...]
    push: str
    step: str

    @classmethod
    def of(cls, layouts: tuple[Layout, ...]) -> _Liveness:
        (up, _), (push, _), (step, _) = _LIVENESS
        return cls(tuple(f"{up}{{{layout.plain}}} 1.0\n" for layout in layouts),  # as floatToGoString writes 1.0
                   tuple(f"{up}{{{layout.plain}}} 0.0\n" for layout in layouts),
                   "".join([f"{push}{{{layout.plain}}} %s\n" for layout in layouts]),
                   "".join([f"{step}{{{layout.plain}}} %s\n" for layout in layouts]))

    def columns(self, entries: tuple[RankEntry, ...], up: list[bool]) -> tuple[str, str, str]:
        return ("".join([u if is_up else d for u, d, is_up in zip(self.up, self.down, up, strict=True)]),
                self.push % tuple(go_floats(tuple(map(_LAST_PUSH, entries)))),
                self.step % tuple(go_floats(tuple(map(_LAST_STEP, entries)))))


@dataclass(frozen=True)
class _Scrape:
    """What a scrape served, per entry in store order; the next scrape reuses what did not change."""

    entries: tuple[RankEntry, ...]
    up: list[bool]
    table: Table
    liveness: _Liveness
    samples: list[tuple[PushedSample, ...]]
    """Per family, the samples its lines were written from (by identity: a delta keeps the rest)."""
    histograms: list[Histogram | None]
    families: list[RenderedFamily]


class RankCollector:
    """A rank's series are laid out as it pushes (``prepare``); the values are written at the next
    scrape, each family whose samples changed in one go across all ranks (rank_lines.Table). A
    snapshot nobody prepared is laid out at that scrape. A scrape that finds the same entries, each
    as up as before, serves the last scrape's families again."""

    def __init__(self, store: RankStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._layouts: dict[tuple[str, str, int], tuple[RankSnapshot, Layout]] = {}
        self._last: _Scrape | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        entries = self._store.entries()
        up = self._store.up(entries)
        last = self._last
        if last is None or last.up != up or (  # equal ups: equal lengths
                last.entries is not entries and not all(map(is_, last.entries, entries))):
            last = self._last = self._scrape(entries, up, last)
        return iter(last.families)

    def prepare(self, snap: RankSnapshot, same_series_as: RankSnapshot | None = None) -> None:
        """Lay out a pushed snapshot's series, unless it keeps its rank's last layout.
        ``same_series_as``: a snapshot known to have the same series (a delta's base), which skips
        the comparison when it is the snapshot the rank's layout was made for."""
        key = (snap.namespace, snap.run, snap.rank)  # runs of two namespaces may share a name
        with self._lock:
            known = self._layouts.get(key)
        if known is not None and same_series_as is not None and known[0] is same_series_as:
            layout = known[1]
        else:
            layout = known[1] if known is not None and known[1].fits(snap) else Layout.of(snap)
        with self._lock:
            self._layouts[key] = (snap, layout)

    def _layout(self, snap: RankSnapshot) -> Layout:
        """The snapshot's layout: the one ``prepare`` made, or made now."""
        with self._lock:
            known = self._layouts.get((snap.namespace, snap.run, snap.rank))
        if known is None or known[0] is not snap:
            self.prepare(snap)
            with self._lock:
                known = self._layouts[(snap.namespace, snap.run, snap.rank)]
        return known[1]

    def _scrape(self, entries: tuple[RankEntry, ...], up: list[bool], last: _Scrape | None) -> _Scrape:
        """Families for ``entries``. Only the families whose samples changed since ``last`` are
        written again; a family written the same as before is the very same object."""
        snaps = [e.snapshot for e in entries]
        layouts = [self._layout(s) for s in snaps]
        with self._lock:
            if len(self._layouts) > len(entries):  # ranks that expired drop out here
                keys = {(s.namespace, s.run, s.rank) for s in snaps}
                self._layouts = {k: v for k, v in self._layouts.items() if k in keys}
        # the last scrape, where it had the same layouts: its table, and its families whose samples stayed
        same = last if last is not None and len(last.table.layouts) == len(layouts) and all(
            map(is_, last.table.layouts, layouts)) else None
        table = same.table if same is not None else Table(layouts)
        liveness = same.liveness if same is not None else _Liveness.of(table.layouts)
        flat = list(chain.from_iterable(map(_SAMPLES, snaps)))
        histograms = list(map(_HISTOGRAM, snaps))
        samples, families = [], []
        for j, (name, f) in enumerate(_FAMILIES):
            now = table.samples(j, flat)
            samples.append(now)
            if same is not None and (all(map(is_, histograms, same.histograms)) if j == HISTOGRAM_AT
                                     else all(map(is_, now, same.samples[j]))):  # same length: same table
                families.append(same.families[j])
                continue
            lines = (table.histogram(histograms) if j == HISTOGRAM_AT else table.text(j, now)).encode()
            families.append(_same_text(last, j, lines) or RenderedFamily(
                f.name, f.documentation, f.type, f.unit, lines, _samples_of(name, entries)))
        for i, ((name, help_), column) in enumerate(zip(_LIVENESS, liveness.columns(entries, up), strict=True)):
            lines = column.encode()
            families.append(_same_text(last, len(_FAMILIES) + i, lines) or RenderedFamily(
                name, help_, "gauge", "", lines, _liveness_samples(i, entries, up)))
        return _Scrape(entries, up, table, liveness, samples, histograms, families)


def _same_text(last: _Scrape | None, j: int, lines: bytes) -> RenderedFamily | None:
    """The last scrape's ``j``-th family where it has these very lines (a whole push of the same
    values, or other ranks around), so that the body's parts stay the same objects."""
    return last.families[j] if last is not None and last.families[j].lines == lines else None


def _liveness_samples(i: int, entries: tuple[RankEntry, ...], up: list[bool]) -> SamplesFn:
    """The samples of the ``i``-th liveness family, built only when someone asks."""
    def build() -> list[Sample]:
        name = _LIVENESS[i][0]
        out = []
        for e, u in zip(entries, up, strict=True):
            values = (1.0 if u else 0.0, e.last_push, e.last_step_advance)
            snap = e.snapshot
            labels = {"run": snap.run, "rank": str(snap.rank),
                      **{k: getattr(snap, k) for k in WORKLOAD_LABELS if getattr(snap, k)}}
            out.append(Sample(name, labels, values[i]))
        return out
    return build


def _samples_of(name: str, entries: tuple[RankEntry, ...]) -> SamplesFn:
    """The family's samples, built only when someone asks (generate_latest, tests), never per scrape."""
    return lambda: [s for e in entries for s in family_samples(e.snapshot).get(name, [])]
