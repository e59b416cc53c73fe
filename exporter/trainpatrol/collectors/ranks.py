"""Serves the ranks' pushed snapshots, plus the liveness the agent derives from them.

Emits every ``source="rank"`` metric of the catalogue with ``run`` and ``rank`` labels, and
``trainpatrol_rank_up``, ``trainpatrol_rank_last_push_timestamp_seconds`` and
``trainpatrol_rank_last_step_timestamp_seconds``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import compress
from operator import is_, is_not, or_

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ..agent.exposition import RenderedFamily, SamplesFn
from ..agent.store import RankEntry, RankStore
from ..catalogue import AGENT_METRICS, RANK_METRICS
from ..protocol import RankSnapshot
from .rank_lines import Rendered, family, family_samples, plain_labels, rank_lines

_LIVENESS = [(m.name, m.help) for m in AGENT_METRICS if m.name.startswith("trainpatrol_rank_")]
assert [name for name, _ in _LIVENESS] == ["trainpatrol_rank_up", "trainpatrol_rank_last_push_timestamp_seconds",
                                           "trainpatrol_rank_last_step_timestamp_seconds"]  # Liveness below
_FAMILIES = [(m.name, family(m)) for m in RANK_METRICS]
Lines = tuple[str, ...]
"""One rank's exposition lines per family, in ``_FAMILIES`` order ("" where it has none):
``Rendered.columns``, where a family whose lines did not change is the previous push's very string."""
Liveness = tuple[str, str, str, str]
"""One rank's liveness lines: rank_up while up, rank_up once down, last push, last step advance."""


def _liveness(e: RankEntry) -> Liveness:
    """Formatted once per push: only rank_up changes between pushes, and it has just two values."""
    labels = plain_labels(e.snapshot)
    up, push, step = (f"{name}{{{labels}}} " for name, _ in _LIVENESS)
    return (f"{up}1.0\n", f"{up}0.0\n",  # as floatToGoString writes 1.0 and 0.0
            f"{push}{floatToGoString(e.last_push)}\n", f"{step}{floatToGoString(e.last_step_advance)}\n")


@dataclass(frozen=True)
class _Scrape:
    """What a scrape served, per entry in store order; the next scrape reuses what did not change."""

    entries: tuple[RankEntry, ...]
    up: list[bool]
    lines: list[Lines]
    liveness: list[Liveness]
    families: list[RenderedFamily]


class RankCollector:
    """Each rank's lines are formatted once per push (``prepare``), not once per scrape (see
    agent.exposition); a snapshot nobody prepared is formatted at the next scrape. A scrape that
    finds the same entries, each as up as before, serves the last scrape's families again."""

    def __init__(self, store: RankStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._rendered: dict[tuple[str, int], Rendered] = {}
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

    def _scrape(self, entries: tuple[RankEntry, ...], up: list[bool], last: _Scrape | None) -> _Scrape:
        """Families for ``entries``. Only the entries ``last`` did not serve are formatted, and only the
        families whose lines they changed are joined again (most lines stay put from push to push)."""
        lines: list[Lines]
        liveness: list[Liveness]
        if last is not None and len(last.entries) == len(entries):
            lines, liveness = list(last.lines), list(last.liveness)
            bodies = [f.lines for f in last.families[:len(_FAMILIES)]]
            changed = list(compress(range(len(entries)), map(is_not, last.entries, entries)))
            dirty = [False] * len(_FAMILIES)
        else:
            lines, liveness = [()] * len(entries), [("", "", "", "")] * len(entries)
            bodies = [b""] * len(_FAMILIES)
            changed, dirty = list(range(len(entries))), [True] * len(_FAMILIES)
        for i in changed:
            new = self._render(entries[i].snapshot)
            if lines[i]:  # a family whose lines did not change keeps the very same string (Lines)
                dirty = list(map(or_, dirty, map(is_not, lines[i], new)))
            lines[i], liveness[i] = new, _liveness(entries[i])
        with self._lock:
            if len(self._rendered) > len(entries):  # ranks that expired drop out here
                keys = {(e.snapshot.run, e.snapshot.rank) for e in entries}
                self._rendered = {k: v for k, v in self._rendered.items() if k in keys}
        families = [RenderedFamily(f.name, f.documentation, f.type, f.unit,
                                   "".join([rank[j] for rank in lines]).encode() if dirty[j] else bodies[j],
                                   _samples_of(name, entries))
                    for j, (name, f) in enumerate(_FAMILIES)]
        columns = ([line[0] if u else line[1] for line, u in zip(liveness, up, strict=True)],
                   [line[2] for line in liveness], [line[3] for line in liveness])
        for i, ((name, help_), column) in enumerate(zip(_LIVENESS, columns, strict=True)):
            families.append(RenderedFamily(name, help_, "gauge", "", "".join(column).encode(),
                                           _liveness_samples(i, entries, up)))
        return _Scrape(entries, up, lines, liveness, families)

    def prepare(self, snap: RankSnapshot) -> None:
        """Format a snapshot as it is pushed, so that a scrape, however frequent, only joins lines."""
        key = (snap.run, snap.rank)
        with self._lock:
            previous = self._rendered.get(key)
        rendered = rank_lines(snap, previous)
        with self._lock:
            self._rendered[key] = rendered

    def _render(self, snap: RankSnapshot) -> Lines:
        """The snapshot's lines per family: those ``prepare`` made, or made now."""
        key = (snap.run, snap.rank)
        with self._lock:
            cached = self._rendered.get(key)
        if cached is None or cached.snapshot is not snap:
            cached = rank_lines(snap, cached)
            with self._lock:
                self._rendered[key] = cached
        return cached.columns


def _liveness_samples(i: int, entries: tuple[RankEntry, ...], up: list[bool]) -> SamplesFn:
    """The samples of the ``i``-th liveness family, built only when someone asks."""
    def build() -> list[Sample]:
        name, help_ = _LIVENESS[i]
        f = GaugeMetricFamily(name, help_, labels=["run", "rank"])
        for e, u in zip(entries, up, strict=True):
            values = (1.0 if u else 0.0, e.last_push, e.last_step_advance)
            f.add_metric([e.snapshot.run, str(e.snapshot.rank)], values[i])
        return f.samples
    return build


def _samples_of(name: str, entries: tuple[RankEntry, ...]) -> SamplesFn:
    """The family's samples, built only when someone asks (generate_latest, tests), never per scrape."""
    return lambda: [s for e in entries for s in family_samples(e.snapshot).get(name, [])]
