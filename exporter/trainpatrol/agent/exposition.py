"""The /metrics body: prometheus_client's text format, with pre-rendered sample lines reused.

A rank pushes about once a second and NVML is sampled once a second, while Prometheus (or a
person) may scrape much more often; formatting every sample on every scrape dominated the agent's
CPU. Collectors yield ``RenderedFamily`` objects whose sample lines were formatted once per new
reading (``render``); ``exposition`` writes those as they are and formats any other family on the
spot. Plain samples take a short formatter, anything unusual goes to ``generate_latest``; the body
is byte for byte what ``generate_latest(registry)`` gives (tests/agent/test_liveness.py checks).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class RenderedFamily(Metric):
    """A family made of parts whose sample lines were formatted once; ``samples`` joins them on demand."""

    SamplesFn = Callable[[], list[Sample]]

    def __init__(self, name: str, documentation: str, typ: str, unit: str = "") -> None:
        self._parts: list[tuple[RenderedFamily.SamplesFn, str]] = []
        super().__init__(name, documentation, typ, unit)

    def add_lazy(self, text: str, samples: SamplesFn) -> None:
        """Formatted lines, and a function that builds the same samples if anyone asks for them."""
        self._parts.append((samples, text))

    @property  # type: ignore[override]
    def samples(self) -> list[Sample]:
        return [s for part, _ in self._parts for s in part()]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        kept = list(samples)
        self._parts = [(lambda: kept, _text(self.name, self.documentation, self.type, self.unit, kept))]

    @property
    def text(self) -> str:
        return "".join(text for _, text in self._parts)


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
    """True when ``_lines`` formats the samples exactly as ``generate_latest`` does."""
    names: set[str] = set()
    labels: set[str] = set()
    for s in samples:
        if s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None:
            return False
        names.add(s.name)
        labels.update(s.labels)
    return (all(_METRIC_NAME.match(n) and not n.endswith(_OPENMETRICS_ONLY) for n in names)
            and all(_LABEL_NAME.match(k) for k in labels))


def _text(name: str, documentation: str, typ: str, unit: str, samples: list[Sample]) -> str:
    if _plain(samples):
        return _lines(samples)
    m = Metric(name, documentation, typ, unit)  # anything unusual: prometheus_client, less the header
    m.samples = list(samples)
    return generate_latest(Families([m])).decode().split("\n", 2)[2]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _lines(samples: Iterable[Sample]) -> str:
    out = []
    for s in samples:
        if s.labels:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
            out.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}\n")
        else:
            out.append(f"{s.name} {floatToGoString(s.value)}\n")
    return "".join(out)


def render(families: Iterable[Metric]) -> list[RenderedFamily]:
    """The same families, each as a ``RenderedFamily`` carrying its formatted sample lines."""
    out = []
    for f in families:
        r = RenderedFamily(f.name, f.documentation, f.type, f.unit)
        r.samples = f.samples
        out.append(r)
    return out


_headers: dict[tuple[str, str, str, str], str] = {}


def _header(m: Metric) -> str:
    key = (m.name, m.documentation, m.type, m.unit)
    if key not in _headers:
        _headers[key] = generate_latest(Families([Metric(m.name, m.documentation, m.type, m.unit)])).decode()
    return _headers[key]


def exposition(registry: Collector) -> bytes:
    """``generate_latest(registry)``, reusing the lines of rendered families."""
    out: list[str] = []
    for metric in registry.collect():
        rendered = metric if isinstance(metric, RenderedFamily) else render([metric])[0]
        out += (_header(metric), rendered.text)
    return "".join(out).encode()
