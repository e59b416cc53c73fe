"""The agent's registry: named collectors, their health, and the /metrics body in the format asked for.

Each collector is a prometheus_client collector (``collect()``) that also says, cheaply, when it would
give something new (``version()``). A collector is collected again only when its version moved, a
failing one gives nothing and fails no scrape, and the body is written once per format for each
state of the collectors: the text format (``text_format``) to every scraper that accepts it, Prometheus
included; OpenMetrics, by prometheus_client, to one that asks for OpenMetrics alone; gzip when accepted.
Emits ``trainpatrol_collector_success{collector}`` and ``trainpatrol_collector_duration_seconds{collector}``.
"""

from __future__ import annotations

import functools
import gzip
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.exposition import CONTENT_TYPE_LATEST, gzip_accepted
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from ..catalogue import BY_NAME

log = logging.getLogger(__name__)
_SUCCESS, _DURATION = "trainpatrol_collector_success", "trainpatrol_collector_duration_seconds"


class Collector(Protocol):
    def version(self) -> Hashable:
        """Changes whenever ``collect`` would give something else. Cheap: asked at every scrape."""

    def collect(self) -> Iterable[Metric]:
        """The collector's families; raises when it has nothing valid to say."""


@dataclass(frozen=True)
class _Part:
    """A collector's last collection: at which version, its families (none when it failed), how it went."""

    version: Hashable
    families: tuple[Metric, ...]
    ok: bool
    seconds: float


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics only for a scraper that does not take the text format: the text format is written
    in a third of the time (docs/benchmarks.md), and Prometheus takes either."""
    types = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    return "application/openmetrics-text" in types and not types & {"text/plain", "text/*", "*/*"}


@dataclass(frozen=True)
class Body:
    data: bytes
    content_type: str
    gzipped: bool


class Registry:
    """What /metrics serves. Thread-safe: one scrape at a time collects; the others wait for its body."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self._collectors = dict(collectors)
        self._parts: dict[str, _Part] = {}
        self._logged: set[tuple[str, str]] = set()
        self._bodies: dict[tuple[str, bool], Body] = {}
        self._lock = threading.Lock()

    def body(self, accept: str = "", accept_encoding: str = "") -> Body:
        """The body for a scrape with these ``Accept`` and ``Accept-Encoding`` headers."""
        om = wants_openmetrics(accept)
        content_type = openmetrics.CONTENT_TYPE_LATEST if om else CONTENT_TYPE_LATEST
        gzipped = gzip_accepted(accept_encoding)
        with self._lock:
            if self._refresh():
                self._bodies.clear()
            key = (content_type, gzipped)
            body = self._bodies.get(key)
            if body is None:
                data = openmetrics.generate_latest(self) if om else text_format(self.collect())
                body = self._bodies[key] = Body(gzip.compress(data, 6) if gzipped else data, content_type, gzipped)
            return body

    def collect(self) -> Iterator[Metric]:
        """Every collector's last families, then their health (what prometheus_client's writers read)."""
        for part in self._parts.values():
            yield from part.families
        success = GaugeMetricFamily(_SUCCESS, BY_NAME[_SUCCESS].help, labels=["collector"])
        duration = GaugeMetricFamily(_DURATION, BY_NAME[_DURATION].help, labels=["collector"])
        for name, part in self._parts.items():
            success.add_metric([name], 1.0 if part.ok else 0.0)
            duration.add_metric([name], part.seconds)
        yield success
        yield duration

    def _refresh(self) -> bool:
        """Collects each collector whose version moved; says whether any did."""
        moved = False
        for name, collector in self._collectors.items():
            try:
                version = collector.version()
            except Exception as exc:  # asking must not break the scrape either: collect, and fail there
                self._log(name, exc)
                version = object()
            part = self._parts.get(name)
            if part is None or part.version != version:
                self._parts[name] = self._collect(name, version)
                moved = True
        return moved

    def _collect(self, name: str, version: Hashable) -> _Part:
        start = time.perf_counter()
        try:
            families, ok = tuple(self._collectors[name].collect()), True
        except Exception as exc:  # a broken collector must not break the scrape
            self._log(name, exc)
            families, ok = (), False
        return _Part(version, families, ok, time.perf_counter() - start)

    def _log(self, name: str, exc: Exception) -> None:
        key = (name, f"{type(exc).__name__}: {exc}")
        if key not in self._logged:
            self._logged.add(key)
            log.warning("collector %s failed: %s", name, key[1])


class ProcessMetrics:
    """The agent process's own ``process_*`` metrics: prometheus_client's process collector, read at most
    once a second (it reads /proc; where there is none, it gives nothing)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._collector = ProcessCollector(registry=None)
        self._clock = clock

    def version(self) -> Hashable:
        return int(self._clock())

    def collect(self) -> Iterable[Metric]:
        return self._collector.collect()


# The text format (0.0.4) as prometheus_client's ``generate_latest`` writes it, but with each series'
# ``name{labels}`` head written once and kept: between scrapes only the values change. Escaping every label
# at every scrape took 38 ms at 64 ranks, this about 8 ms (docs/benchmarks.md); tests/exposition_check.py
# holds it to ``generate_latest`` byte for byte.
_EXPOSED = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
            "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}


class Labels(dict[str, str]):
    """A series' labels with their block as the text format writes it (``a="x",b="y"``), made once for a
    collector that keeps its labels between scrapes (collectors.ranks); other writers read it as a dict."""

    __slots__ = ("block",)

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__(labels)
        self.block = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def text_format(families: Iterable[Metric]) -> bytes:
    out: list[str] = []
    for family in families:
        suffix, kind = _EXPOSED.get(family.type, ("", family.type))
        out.append(_header(family.name + suffix, kind, family.documentation))
        for s in family.samples:
            if s.timestamp is not None or s.name.endswith(("_created", "_gsum", "_gcount")):
                raise ValueError(f"{s.name}: timestamps and OpenMetrics-only samples are not written here")
            block = getattr(s.labels, "block", None)
            head = f"{s.name}{{{block}}} " if block else _head(s.name, tuple(s.labels.items()))
            out.append(f"{head}{floatToGoString(s.value)}\n")
    return "".join(out).encode()


@functools.lru_cache(maxsize=256)
def _header(name: str, kind: str, help_: str) -> str:
    escaped = help_.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


@functools.lru_cache(maxsize=1 << 16)
def _head(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    """A series' line up to its value; the cache is bounded (the agent's series are: agent.limits)."""
    return f"{name}{{{Labels(dict(labels)).block}}} " if labels else name + " "


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
