"""Checks of a /metrics body: ``promtool check metrics`` and prometheus_client's parsers, in the text
format and in OpenMetrics; and the text a collector gives, as the agent's /metrics writes it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from servers import PROMTOOL


class _Families:
    """Parsed families as a prometheus_client collector."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def text(collector: Any) -> bytes:
    """What a collector gives, in the text format, as /metrics writes it (collectors.registry)."""
    return generate_latest(collector)  # type: ignore[no-any-return]


class Watched:
    """A collector as the agent's registry sees it: ``changed()`` says whether its version moved since
    it was last collected."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector
        self._seen: Any = object()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.collector, name)

    def changed(self) -> bool:
        return bool(self.collector.version() != self._seen)

    def collect(self) -> Any:
        self._seen = self.collector.version()
        return self.collector.collect()


def openmetrics_text(collector: Any) -> bytes:
    """What a collector gives, in OpenMetrics."""
    return openmetrics.generate_latest(collector)  # type: ignore[no-any-return]


def assert_openmetrics_clean(body: bytes) -> None:
    """``body`` parses as OpenMetrics with prometheus_client's strict parser. (promtool 2.42's ``check
    metrics`` lints the text format only: it reads an OpenMetrics counter's family name, without
    ``_total``, as a metric with no samples; a real Prometheus ingests the format in the integration tests.)"""
    assert body.endswith(b"# EOF\n")
    list(openmetrics_families(body.decode()))  # raises on anything invalid


def reference(body: bytes) -> bytes:
    """``body`` parsed by prometheus_client and written again by its ``generate_latest``."""
    families = []
    for parsed in text_string_to_metric_families(body.decode()):
        rebuilt = Metric(parsed.name, parsed.documentation, parsed.type)
        rebuilt.samples = list(parsed.samples)
        families.append(rebuilt)
    return generate_latest(_Families(families))  # type: ignore[arg-type]  # a collector by shape


def assert_as_generate_latest(body: bytes) -> None:
    """``body`` is exactly what ``generate_latest`` writes for the same families."""
    expected = reference(body)
    assert body == expected, _first_difference(body, expected)


def promtool_problems(body: bytes) -> str:
    """What ``promtool check metrics`` says about ``body``: empty when it is clean."""
    if PROMTOOL is None:
        raise AssertionError("promtool is not installed (/usr/bin/promtool; `make system-deps` installs it)")
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30)
    said = (result.stdout + result.stderr).decode().strip()
    return said or ("" if result.returncode == 0 else f"exit status {result.returncode}")


def assert_clean(body: bytes) -> None:
    """Byte-equal to ``generate_latest`` and clean for promtool."""
    assert_as_generate_latest(body)
    problems = promtool_problems(body)
    assert problems == "", problems


def _first_difference(got: bytes, expected: bytes) -> str:
    for number, (a, b) in enumerate(zip(got.splitlines(), expected.splitlines(), strict=False), 1):
        if a != b:
            return f"line {number}: wrote {a!r}, generate_latest writes {b!r}"
    return f"{len(got.splitlines())} lines written, generate_latest writes {len(expected.splitlines())}"


def values(body: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``body``, parsed by prometheus_client: (name, labels) to value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def value(body: bytes, name: str, labels: dict[str, str] | None = None) -> float | None:
    """One sample's value, None where ``body`` has no such sample."""
    return values(body).get((name, frozenset((labels or {}).items())))


class Scraped:
    """A /metrics body source (collectors.registry.Registry), read as tests read a registry."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def body(self) -> bytes:
        body: bytes = self.source.body().data
        return body

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return value(self.body(), name, labels)
