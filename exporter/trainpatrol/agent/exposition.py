"""The /metrics body: prometheus_client's text format, with pre-rendered sample lines reused.

A rank pushes about once a second and NVML is sampled once a second, while Prometheus (or a
person) may scrape much more often; formatting every sample on every scrape dominated the agent's
CPU. Collectors yield ``RenderedFamily`` objects whose sample lines were formatted once per new
reading; ``exposition`` writes those as they are and formats any other family on the spot. Plain
samples take a short formatter, anything unusual goes to ``generate_latest``; the body is byte for
byte what ``generate_latest(registry)`` gives (tests/agent/test_liveness.py checks).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_MAX = sys.float_info.max
SamplesFn = Callable[[], list[Sample]]
"""Builds a rendered family's samples, for the rare reader that asks for ``Sample`` objects."""


class RenderedFamily(Metric):
    """A family whose sample lines were formatted once; ``samples`` are built only when asked for.

    Nothing changes it once made, so a collector may serve the same object to any number of
    scrapes, on any thread."""

    header: bytes
    """The family's ``# HELP`` and ``# TYPE`` lines, encoded."""
    lines: bytes
    """Its sample lines, encoded: most are served again and again as they are."""

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "", lines: bytes = b"",
                 samples: SamplesFn = list) -> None:
        self.name, self.documentation, self.type, self.unit, self.header = _family(name, documentation, typ, unit)
        self.lines = lines
        self._samples = samples

    @property
    def samples(self) -> list[Sample]:  # type: ignore[override]  # read-only: built on demand
        return self._samples()


@functools.cache
def _family(name: str, documentation: str, typ: str, unit: str) -> tuple[str, str, str, str, bytes]:
    """Metric's checks and renaming, and the family's header: once per family, not once per scrape."""
    m = Metric(name, documentation, typ, unit)
    return m.name, m.documentation, m.type, m.unit, generate_latest(Families([m]))


class Families(Collector):
    """A fixed list of families as a collector, to format them with ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^(?!__)[a-zA-Z_][a-zA-Z0-9_]*$")
_OPENMETRICS_ONLY = ("_created", "_gsum", "_gcount")


def _plain(samples: list[Sample]) -> bool:
    """True when ``sample_line`` formats the samples exactly as ``generate_latest`` does."""
    for s in samples:
        if s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None:
            return False
        if not _plain_name(s.name) or not all(map(_plain_label, s.labels)):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def _plain_name(name: str) -> bool:
    return bool(_METRIC_NAME.match(name)) and not name.endswith(_OPENMETRICS_ONLY)


@functools.lru_cache(maxsize=4096)
def _plain_label(name: str) -> bool:
    return bool(_LABEL_NAME.match(name))


def _text(m: Metric, samples: list[Sample]) -> str:
    """The family's sample lines as ``generate_latest`` writes them."""
    if _plain(samples):
        return "".join([sample_line(s.name, s.labels, s.value) for s in samples])
    copy = Metric(m.name, m.documentation, m.type, m.unit)  # anything unusual: prometheus_client, less the header
    copy.samples = samples
    return generate_latest(Families([copy])).decode().split("\n", 2)[2]


def escape(value: str) -> str:
    """A label value as the text format writes it."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return value


def go_float(value: float) -> str:
    """``floatToGoString(value)`` for a float, with less work on the way: it is ``repr`` for finite
    values below 1e6, and only NaN and the infinities need its checks."""
    if -_MAX <= value < 1e6:
        return repr(value)
    if value != value or not -_MAX <= value <= _MAX:
        special: str = floatToGoString(value)
        return special
    return go_floats((value,))[0]  # finite, 1e6 or more: Go writes an exponent where Python writes digits


def go_floats(values: Sequence[float]) -> list[str]:
    """``go_float`` of each value in one pass. A family of byte counts or timestamps writes every
    value in Go's exponent form (positive values of 1e6 and more, up to where ``repr`` takes an
    exponent itself), and a call per value cost half as much again."""
    return [go_float(v) if t[-1] in "nf" else  # nan, inf: the finite end in a digit
            f"{t[0]}.{t[1:d]}{t[d + 1:]}".rstrip("0.") + _EXPONENT[d] if (d := t.find(".")) > 6 and t[0] != "-" else t
            for v, t in zip(values, map(repr, values), strict=True)]


_EXPONENT = tuple(f"e+{dot - 1:02d}" for dot in range(24))
"""Go's exponent for a repr whose dot is at this index (finite values below 1e16 have at most 16 digits)."""


def sample_line(name: str, labels: Mapping[str, str], value: float) -> str:
    """One sample as ``generate_latest`` writes it, for a valid metric name and valid label names."""
    return labelled_line(name, tuple(labels.items()), value)


def labelled_line(name: str, labels: tuple[tuple[str, str], ...], value: float) -> str:
    """``sample_line`` with the labels as (name, value) pairs."""
    text = go_float(value) if type(value) is float else floatToGoString(value)
    if labels:
        return f"{name}{{{_label_block(labels)}}} {text}\n"
    return f"{name} {text}\n"


@functools.lru_cache(maxsize=16384)
def _label_block(items: tuple[tuple[str, str], ...]) -> str:
    """The labels as the text format writes them; the same label sets come back every sample."""
    return ",".join([f'{k}="{escape(v)}"' for k, v in sorted(items)])


def render(families: Iterable[Metric]) -> list[RenderedFamily]:
    """The same families, each as a ``RenderedFamily`` carrying its formatted sample lines."""
    out = []
    for f in families:
        kept = list(f.samples)
        out.append(RenderedFamily(f.name, f.documentation, f.type, f.unit, _text(f, kept).encode(),
                                  functools.partial(list, kept)))
    return out


def exposition(registry: Collector) -> bytes:
    """``generate_latest(registry)``, reusing the lines of rendered families."""
    out: list[bytes] = []
    for metric in registry.collect():
        if isinstance(metric, RenderedFamily):
            out += (metric.header, metric.lines)
        else:
            header = _family(metric.name, metric.documentation, metric.type, metric.unit)[4]
            out += (header, _text(metric, list(metric.samples)).encode())
    return b"".join(out)
