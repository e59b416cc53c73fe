"""One rank's series as the agent holds and writes them: laid out once, its values in a flat array.

The layout (a ``%``-template of each catalogue family's lines, labels escaped) changes only when the
rank pushes other series. The values are held as the text format writes them (Go's float format),
formatted once as they arrive rather than at every scrape. Each push makes a ``Written`` (a delta
line's is its stream's last one with the changed slots assigned) that replaces the record's. Writing
a record's lines is one ``%`` over its values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from operator import itemgetter

from ..catalogue import RANK_METRICS, STEP_DURATION_BUCKETS
from ..exposition import go_float, go_floats, head, label_block
from ..protocol import Histogram, RankSnapshot

WORKLOAD_LABELS = ("namespace", "pod", "container", "node")
"""The training process's own Kubernetes identity, on every series of its rank when it has one."""
_POSITION = {m.name: j for j, m in enumerate(RANK_METRICS)}
_INFO = frozenset(m.name for m in RANK_METRICS if m.kind == "info")
_HISTOGRAM = next(m.name for m in RANK_METRICS if m.kind == "histogram")
_BOUNDS = (*(str(b) for b in STEP_DURATION_BUCKETS), "+Inf")


def rank_labels(snap: RankSnapshot) -> dict[str, str]:
    """The labels every series of a rank carries: run, rank and the workload labels it has."""
    labels = {"run": snap.run, "rank": str(snap.rank)}
    labels.update({k: getattr(snap, k) for k in WORKLOAD_LABELS if getattr(snap, k)})
    return labels


def series_key(snap: RankSnapshot) -> Hashable:
    """What the layout depends on: the rank's labels and its samples' names and labels, in order."""
    return (tuple(rank_labels(snap).items()), tuple([(s.name, tuple(s.labels.items())) for s in snap.samples]),
            snap.histogram is not None)


def values_of(snap: RankSnapshot) -> list[str]:
    """The samples' values, then the step histogram's bucket counts, count and sum, as written."""
    return go_floats([float(s.value) for s in snap.samples]) + histogram_values(snap.histogram)


def histogram_values(histogram: Histogram | None) -> list[str]:
    """The step histogram's bucket counts, count and sum, as written; none without one."""
    if histogram is None:
        return []
    counts = histogram.counts
    return go_floats([*map(float, counts), float(counts[-1]), float(histogram.sum)])


@dataclass(frozen=True)
class Layout:
    plain: str
    """``rank="…",run="…"`` and the workload labels: the label block of the rank's liveness lines."""
    template: str
    """Every catalogue family's lines, NUL between families, with ``%s`` where each value goes (an
    info's is always 1.0): one ``%`` writes the whole record. No label value holds a NUL (protocol.printable)."""
    order: Callable[[list[str]], tuple[str, ...]]
    """The texts of the values in the order the template takes them."""

    @classmethod
    def of(cls, snap: RankSnapshot) -> Layout:
        base = rank_labels(snap)
        lines: list[list[str]] = [[] for _ in RANK_METRICS]
        slots: list[list[int]] = [[] for _ in RANK_METRICS]
        for i, s in enumerate(snap.samples):
            j = _POSITION[s.name]
            text = _percent(head(s.name, base | s.labels))
            if s.name in _INFO:
                lines[j].append(text + "1.0\n")
            else:
                lines[j].append(text + "%s\n")
                slots[j].append(i)
        if snap.histogram is not None:
            j, at = _POSITION[_HISTOGRAM], len(snap.samples)
            heads = [*(head(_HISTOGRAM + "_bucket", base | {"le": le}) for le in _BOUNDS),
                     head(_HISTOGRAM + "_count", base), head(_HISTOGRAM + "_sum", base)]
            lines[j] = [_percent(h) + "%s\n" for h in heads]
            slots[j] = list(range(at, at + len(heads)))
        return cls(label_block(base), "\0".join(map("".join, lines)), _getter([i for f in slots for i in f]))


@dataclass(frozen=True, slots=True, eq=False)
class Written:
    """What one push wrote for a rank: its series, their layout, and the values as the text format
    writes them. Never changed once made, so a push stream keeps the one it wrote as the base of its
    next delta, whatever other pushes of the rank wrote meanwhile."""

    series: Hashable
    layout: Layout
    samples: int
    """How many pushed samples it holds: the indices a delta line may assign."""
    values: list[str]

    @classmethod
    def of(cls, snap: RankSnapshot, like: Written | None = None) -> Written:
        """A whole snapshot, laid out again only where its series differ from ``like``'s."""
        series = series_key(snap)
        layout = like.layout if like is not None and like.series == series else Layout.of(snap)
        return cls(series, layout, len(snap.samples), values_of(snap))

    @property
    def has_histogram(self) -> bool:
        return len(self.values) > self.samples

    def changed(self, pairs: Iterable[tuple[int, float]], histogram: Histogram | None) -> Written:
        """A delta line onto this: its (sample index, value) pairs assigned and its histogram, which
        travels whole, in place of this one's, as a new array. The indices were checked against
        ``samples``, and that the line has a histogram where this has one."""
        values = self.values[:self.samples]
        for i, value in pairs:
            values[i] = go_float(value)
        return Written(self.series, self.layout, self.samples, values + histogram_values(histogram))


class RankRecord:
    """A rank's last write, and its lines. Its owner (agent.store) serialises writes and reads."""

    __slots__ = ("_texts", "_texts_of", "generation", "written")

    def __init__(self, written: Written, generation: int) -> None:
        self.written, self.generation = written, generation
        self._texts: tuple[str, ...] = ()
        self._texts_of = -1

    def write(self, written: Written, generation: int) -> None:
        self.written, self.generation = written, generation

    def texts(self) -> tuple[str, ...]:
        """Per catalogue family, this rank's lines; written again only after a write to the record."""
        if self._texts_of != self.generation:
            layout = self.written.layout
            self._texts = tuple((layout.template % layout.order(self.written.values)).split("\0"))
            self._texts_of = self.generation
        return self._texts


def _getter(slots: list[int]) -> Callable[[list[str]], tuple[str, ...]]:
    """The texts at ``slots`` as a tuple (``itemgetter`` of one index gives the item itself)."""
    if len(slots) > 1:
        return itemgetter(*slots)
    return lambda texts: tuple([texts[i] for i in slots])


def _percent(text: str) -> str:
    """Text that ``%`` writes as it is (label values may hold ``%``)."""
    return text.replace("%", "%%")
