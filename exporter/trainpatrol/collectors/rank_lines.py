"""Formats one pushed snapshot straight into exposition lines, once per push.

Building prometheus_client families for every push and formatting their samples cost about
0.6 ms per push on the development VM; writing the lines directly costs a fraction of that. The
lines are byte for byte what ``generate_latest`` writes for the same samples, which
``family_samples`` still builds for any reader that wants ``Sample`` objects
(tests/agent/test_liveness.py compares the two).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import compress
from operator import is_not

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from ..agent.exposition import escape
from ..catalogue import RANK_BY_NAME, RANK_METRICS, STEP_DURATION_BUCKETS
from ..catalogue import Metric as CatalogueMetric
from ..protocol import RankSnapshot, same_value
from ..protocol import Sample as PushedSample

BOUNDS = [str(b) for b in STEP_DURATION_BUCKETS] + ["+Inf"]
_HISTOGRAM = next(m.name for m in RANK_METRICS if m.kind == "histogram")
_ORDER = {m.name: sorted(m.all_labels) for m in RANK_METRICS}
"""Label names of each rank metric in exposition order (prometheus_client sorts them)."""
_MAX = sys.float_info.max
FAMILIES = [m.name for m in RANK_METRICS]
"""Every rank metric family, in catalogue order: the order of ``Rendered.columns``."""
_POSITION = {name: i for i, name in enumerate(FAMILIES)}
_HISTOGRAM_AT = _POSITION[_HISTOGRAM]
_INFO = {m.name for m in RANK_METRICS if m.kind == "info"}
assert sorted([*RANK_BY_NAME[_HISTOGRAM].all_labels, "le"]) == ["le", "rank", "run"]  # bucket lines below


def plain_labels(snap: RankSnapshot) -> str:
    """The label block of a rank's metrics that have no labels of their own."""
    return f'rank="{snap.rank}",run="{escape(snap.run)}"'


@dataclass(frozen=True, slots=True)
class Rendered:
    """One snapshot's lines: per sample (for reuse by the next push) and joined per family."""

    snapshot: RankSnapshot
    sample_lines: list[str]
    columns: tuple[str, ...]
    """Each catalogue rank metric's lines, in ``FAMILIES`` order ("" where the snapshot has none)."""
    members: dict[str, list[int]]
    """Family name -> the indices of its samples, in order."""
    histogram_heads: tuple[str, ...]
    """The step histogram's lines up to their value: bucket by bucket, then _count and _sum."""

    @property
    def families(self) -> dict[str, str]:
        return {name: text for name, text in zip(FAMILIES, self.columns, strict=True) if text}


def rank_lines(snap: RankSnapshot, previous: Rendered | None = None) -> Rendered:
    """The snapshot's exposition lines, per sample and per catalogue family.

    When the snapshot has the same series as ``previous`` (the rank's last push), only samples
    whose value changed are formatted again, and only their families joined again: info metrics,
    settings and most counters do not change from one push to the next, and a delta push
    (protocol.SnapshotDelta) keeps the very sample objects it did not change. A family whose lines
    did not change is the previous push's very string, so that a scrape finds changes by identity."""
    base = {"run": escape(snap.run), "rank": str(snap.rank)}
    plain = plain_labels(snap)
    samples = snap.samples
    same_rank = previous is not None and plain_labels(previous.snapshot) == plain
    before = previous.snapshot.samples if previous is not None and same_rank else []
    if previous is not None and len(before) == len(samples):
        lines, dirty = list(previous.sample_lines), set[str]()
        for i in compress(range(len(samples)), map(is_not, samples, before)):  # a delta keeps the rest
            s, old = samples[i], before[i]
            if s.name != old.name:
                break  # another layout: the families' members differ
            if s.labels != old.labels or not same_value(s.value, old.value):
                lines[i] = _line(s, base, plain)
                dirty.add(s.name)
        else:
            columns = list(previous.columns)
            for name in dirty:
                columns[_POSITION[name]] = "".join([lines[i] for i in previous.members[name]])
            heads = previous.histogram_heads
            columns[_HISTOGRAM_AT] = _histogram(snap, heads, previous)
            return Rendered(snap, lines, tuple(columns), previous.members, heads)
    lines = []
    members: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        prior = before[i] if i < len(before) else None
        if prior is not None and prior.name == s.name and prior.labels == s.labels and same_value(s.value, prior.value):
            lines.append(previous.sample_lines[i])  # type: ignore[union-attr]
        else:
            lines.append(_line(s, base, plain))
        members.setdefault(s.name, []).append(i)
    fresh = [""] * len(FAMILIES)
    for name, where in members.items():
        fresh[_POSITION[name]] = "".join([lines[i] for i in where])
    heads = (*(f'{_HISTOGRAM}_bucket{{le="{le}",{plain}}} ' for le in BOUNDS),
             f"{_HISTOGRAM}_count{{{plain}}} ", f"{_HISTOGRAM}_sum{{{plain}}} ")
    fresh[_HISTOGRAM_AT] = _histogram(snap, heads, None)
    if previous is not None:  # equal text, same string: the scrape's change detection goes by identity
        fresh = [old if old == new else new for old, new in zip(previous.columns, fresh, strict=True)]
    return Rendered(snap, lines, tuple(fresh), members, heads)


def _line(s: PushedSample, base: dict[str, str], plain: str) -> str:
    if s.labels:
        values = base | {k: escape(v) for k, v in s.labels.items()}
        block = ",".join([f'{k}="{values[k]}"' for k in _ORDER[s.name]])
    else:
        block = plain
    v = s.value  # floatToGoString(v) is repr(v) below 1e6, when finite; a call costs more than that test
    return f"{s.name}{{{block}}} {'1.0' if s.name in _INFO else repr(v) if -_MAX <= v < 1e6 else floatToGoString(v)}\n"


def _histogram(snap: RankSnapshot, heads: tuple[str, ...], previous: Rendered | None) -> str:
    """The step histogram's lines; the previous push's string when nothing in it changed."""
    h, old = snap.histogram, previous.snapshot.histogram if previous is not None else None
    if h is None:
        return ""
    if previous is not None and old is not None and old.counts == h.counts and same_value(old.sum, h.sum):
        return previous.columns[_HISTOGRAM_AT]
    values = [*h.counts, h.counts[-1], h.sum]
    return "".join([f"{head}{repr(v) if -_MAX <= v < 1e6 else floatToGoString(v)}\n"
                    for head, v in zip(heads, values, strict=True)])


def family(m: CatalogueMetric) -> Metric:
    """An empty prometheus_client family for a rank metric, labelled run, rank and its own labels."""
    labels = list(m.all_labels)
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
    families = {m.name: family(m) for m in RANK_METRICS}
    base = [snap.run, str(snap.rank)]
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
