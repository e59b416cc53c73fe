"""Formats the ranks' snapshots into exposition lines, one family at a time across all ranks.

Building prometheus_client families for every push and formatting their samples cost about
0.6 ms per push on the development VM. Here a rank's series are laid out once (``Layout``: each
family's lines as a ``%``-template, one ``%r`` per value), the layouts of all ranks are put
together once (``Table``), and a scrape after new pushes writes each family whose values moved with
a single ``%`` over the values of all ranks: in C, where formatting each rank's changed families in
Python as it pushed cost the agent more than validating the push (bench/scrape.py). The lines are
byte for byte what ``generate_latest`` writes for the same samples, which ``family_samples`` still
builds for any reader that wants ``Sample`` objects (tests/agent/test_liveness.py compares the two).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

from ..agent.exposition import escape, go_floats
from ..catalogue import RANK_BY_NAME, RANK_METRICS, STEP_DURATION_BUCKETS
from ..catalogue import Metric as CatalogueMetric
from ..protocol import Histogram, RankSnapshot
from ..protocol import Sample as PushedSample

BOUNDS = [str(b) for b in STEP_DURATION_BUCKETS] + ["+Inf"]
_HISTOGRAM = next(m.name for m in RANK_METRICS if m.kind == "histogram")
WORKLOAD_LABELS = ("namespace", "pod", "container", "node")
"""The training process's own Kubernetes identity, on every series of its rank when it has one."""
_MAX = sys.float_info.max
FAMILIES = [m.name for m in RANK_METRICS]
"""Every rank metric family, in catalogue order: the order of ``Table`` families."""
_POSITION = {name: i for i, name in enumerate(FAMILIES)}
HISTOGRAM_AT = _POSITION[_HISTOGRAM]
_INFO = {m.name for m in RANK_METRICS if m.kind == "info"}
_NAME, _LABELS, _VALUE = attrgetter("name"), attrgetter("labels"), attrgetter("value")


def base_labels(snap: RankSnapshot) -> dict[str, str]:
    """The labels every series of a rank carries, escaped: run, rank and the workload's identity."""
    base = {"run": escape(snap.run), "rank": str(snap.rank)}
    for key in WORKLOAD_LABELS:
        value = getattr(snap, key)
        if value:
            base[key] = escape(value)
    return base


def _block(values: dict[str, str]) -> str:
    """A label block in exposition order (prometheus_client sorts label names)."""
    return ",".join([f'{k}="{values[k]}"' for k in sorted(values)])


def plain_labels(snap: RankSnapshot) -> str:
    """The label block of a rank's metrics that have no labels of their own."""
    return _block(base_labels(snap))


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """One rank's series, laid out for formatting; the same object while the rank pushes the same
    series in the same order, whatever their values."""

    plain: str
    """``rank="…",run="…"``: the label block of metrics without labels of their own."""
    names: tuple[str, ...]
    labels: tuple[dict[str, str], ...]
    members: tuple[tuple[int, ...], ...]
    """Per position in ``FAMILIES``, the indices of its samples, in order."""
    templates: tuple[str, ...]
    """Per position in ``FAMILIES``, its lines with ``%r`` for each value (``%`` in labels doubled);
    an info metric's value is always written 1.0."""
    text_templates: tuple[str, ...]
    """The same with ``%s``, for values written by ``go_floats`` first."""
    histogram_template: str
    histogram_heads: tuple[str, ...]

    @classmethod
    def of(cls, snap: RankSnapshot) -> Layout:
        base = base_labels(snap)
        plain = _block(base)
        names, labels = tuple(map(_NAME, snap.samples)), tuple(map(_LABELS, snap.samples))
        heads = tuple(map(_head, names, labels, [base] * len(names), [plain] * len(names)))
        grouped: list[list[int]] = [[] for _ in FAMILIES]
        for i, name in enumerate(names):
            grouped[_POSITION[name]].append(i)
        members = tuple(map(tuple, grouped))
        templates, text_templates = (_templates(heads, names, members, value) for value in ("%r", "%s"))
        histogram_heads = (*(f'{_HISTOGRAM}_bucket{{{_block(base | {"le": le})}}} ' for le in BOUNDS),
                           f"{_HISTOGRAM}_count{{{plain}}} ", f"{_HISTOGRAM}_sum{{{plain}}} ")
        return cls(plain, names, labels, members, templates, text_templates,
                   "".join([_percent(head) + "%r\n" for head in histogram_heads]), histogram_heads)

    def fits(self, snap: RankSnapshot) -> bool:
        """True when ``snap`` has this layout's series, in the same order, for the same rank. A
        delta keeps its base's very name and label objects, which compare at once."""
        samples = snap.samples
        return (len(samples) == len(self.names) and tuple(map(_NAME, samples)) == self.names
                and tuple(map(_LABELS, samples)) == self.labels and plain_labels(snap) == self.plain)


class Table:
    """The layouts of all ranks a scrape serves, in exposition order, put together: per family
    the positions of its samples in all ranks' samples laid end to end, and the templates of its
    lines across ranks."""

    def __init__(self, layouts: Sequence[Layout]) -> None:
        self.layouts = tuple(layouts)
        offsets, at = [], 0
        for layout in layouts:
            offsets.append(at)
            at += len(layout.names)
        self.getters: list[Callable[[list[PushedSample]], tuple[PushedSample, ...]] | None] = []
        self.templates: list[str] = []
        self.text_templates: list[str] = []
        self.info: list[bool] = []
        for j, name in enumerate(FAMILIES):
            where = [offset + i for layout, offset in zip(layouts, offsets, strict=True) for i in layout.members[j]]
            self.getters.append(None if not where else _getter(where))
            self.templates.append("".join([layout.templates[j] for layout in layouts]))
            self.text_templates.append("".join([layout.text_templates[j] for layout in layouts]))
            self.info.append(name in _INFO)
        self.histogram_template = "".join([layout.histogram_template for layout in layouts])
        self.histogram_heads = [layout.histogram_heads for layout in layouts]

    def samples(self, j: int, flat: list[PushedSample]) -> tuple[PushedSample, ...]:
        """Family ``j``'s samples of all ranks, given all ranks' samples laid end to end."""
        getter = self.getters[j]
        return () if getter is None else getter(flat)

    def text(self, j: int, samples: tuple[PushedSample, ...]) -> str:
        """Family ``j``'s lines for ``samples`` (``samples(j, …)``)."""
        if not samples:
            return ""
        if self.info[j]:
            return self.templates[j] % ()
        values = tuple(map(_VALUE, samples))
        if _repr_writes(values):
            return self.templates[j] % values
        return self.text_templates[j] % tuple(go_floats(values))

    def histogram(self, histograms: Sequence[Histogram | None]) -> str:
        """The step histogram's lines of all ranks (one histogram or None per rank, in order)."""
        present = [h for h in histograms if h is not None]
        if present and len(present) == len(histograms):
            values = tuple([v for h in present for v in (*h.counts, h.counts[-1], h.sum)])
            if _repr_writes(values):
                return self.histogram_template % values
        # a rank without one (its lines are left out), or a value ``repr`` does not write as Go does
        return "".join([_histogram_lines(heads, h)
                        for heads, h in zip(self.histogram_heads, histograms, strict=True) if h is not None])


def _templates(heads: tuple[str, ...], names: tuple[str, ...], members: tuple[tuple[int, ...], ...],
               value: str) -> tuple[str, ...]:
    """Each family's lines with ``value`` (a ``%`` placeholder) for each sample's value; an info's is 1.0."""
    return tuple("".join([_percent(heads[i]) + ("1.0" if names[i] in _INFO else value) + "\n" for i in where])
                 for where in members)


def _repr_writes(values: tuple[float, ...]) -> bool:
    """True when ``repr`` writes each value as ``floatToGoString`` does: all finite and below 1e6.
    A NaN makes the sum NaN, which no ``min`` or ``max`` would show; an infinity fails those."""
    total = sum(values)
    return total == total and max(values) < 1e6 and min(values) >= -_MAX


def _getter(where: list[int]) -> Callable[[list[PushedSample]], tuple[PushedSample, ...]]:
    if len(where) == 1:
        i = where[0]
        return lambda flat: (flat[i],)
    return itemgetter(*where)


def _head(name: str, labels: dict[str, str], base: dict[str, str], plain: str) -> str:
    block = _block(base | {k: escape(v) for k, v in labels.items()}) if labels else plain
    return f"{name}{{{block}}} "


def _percent(text: str) -> str:
    return text.replace("%", "%%")


def _histogram_lines(heads: tuple[str, ...], h: Histogram) -> str:
    texts = go_floats((*h.counts, h.counts[-1], h.sum))
    return "".join([f"{head}{text}\n" for head, text in zip(heads, texts, strict=True)])


def family(m: CatalogueMetric, workload: tuple[str, ...] = ()) -> Metric:
    """An empty prometheus_client family for a rank metric, labelled run, rank, the ``workload`` labels a
    rank has, and its own labels."""
    labels = [*m.all_labels[: len(m.all_labels) - len(m.labels)], *workload, *m.labels]
    if m.kind == "counter":
        return CounterMetricFamily(m.name, m.help, labels=labels)
    if m.kind == "histogram":
        return HistogramMetricFamily(m.name, m.help, labels=labels)
    if m.kind == "info":
        # the extra labels arrive as the info's value dict
        return InfoMetricFamily(m.name.removesuffix("_info"), m.help, labels=labels[: len(labels) - len(m.labels)])
    return GaugeMetricFamily(m.name, m.help, labels=labels)


def family_samples(snap: RankSnapshot) -> dict[str, list[Sample]]:
    """The same snapshot as prometheus_client samples, per catalogue metric name (the slow path)."""
    workload = tuple(k for k in WORKLOAD_LABELS if getattr(snap, k))
    families = {m.name: family(m, workload) for m in RANK_METRICS}
    base = [snap.run, str(snap.rank), *(getattr(snap, k) for k in workload)]
    for s in snap.samples:
        f = families[s.name]
        if isinstance(f, InfoMetricFamily):
            f.add_metric(base, s.labels)
        else:
            extra = [s.labels[k] for k in RANK_BY_NAME[s.name].labels]
            f.add_metric(base + extra, s.value)  # type: ignore[attr-defined]
    if snap.histogram is not None:
        h = snap.histogram
        families[_HISTOGRAM].add_metric(base, list(zip(BOUNDS, h.counts, strict=False)), h.sum)  # type: ignore[attr-defined]
    return {name: f.samples for name, f in families.items() if f.samples}
