"""The /metrics body: a collector is collected again only when its version moved, a failing one
gives nothing and fails no scrape, each one's success and last collection time are served, and the
body comes in the format and encoding the scraper asks for."""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from exposition_check import assert_as_generate_latest, assert_clean, assert_openmetrics_clean, value
from fake_clock import Clock
from trainpatrol.agent.store import RankStore
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.collectors.registry import Registry
from trainpatrol.protocol import RankSnapshot


class Scripted:
    """A collector whose version, value and failure the test sets; it counts its collections."""

    def __init__(self, x: float | None = None) -> None:
        self.x, self.news, self.error, self.writes = x, 0, "", 0

    def version(self) -> int:
        return self.news

    def collect(self) -> Iterator[Metric]:
        self.writes += 1
        if self.error:
            raise RuntimeError(self.error)
        if self.x is not None:
            yield GaugeMetricFamily("trainpatrol_x", "x", value=self.x)


X = b"# HELP trainpatrol_x x\n# TYPE trainpatrol_x gauge\ntrainpatrol_x 2.0\n"


class CollectorSet(Registry):
    """The registry's text body, as Prometheus' text scrape gets it."""

    def body(self, accept: str = "", accept_encoding: str = "") -> bytes:  # type: ignore[override]
        return super().body(accept, accept_encoding).data


def success(body: bytes, name: str) -> float | None:
    return value(body, "trainpatrol_collector_success", {"collector": name})


def test_a_collector_is_written_again_only_when_it_changed() -> None:
    a, b = Scripted(2.0), Scripted()
    collectors = CollectorSet({"a": a, "b": b})
    first = collectors.body()
    assert first.startswith(X) and (a.writes, b.writes) == (1, 1)
    assert collectors.body() == first and (a.writes, b.writes) == (1, 1)  # nothing new: nothing written
    a.x, a.news = 3.0, 1
    second = collectors.body()
    assert value(second, "trainpatrol_x") == 3.0 and (a.writes, b.writes) == (2, 1)
    assert_clean(second)


def test_a_failing_collector_gives_nothing_logs_once_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainpatrol.collectors.registry")
    flaky, ok = Scripted(2.0), Scripted()
    collectors = CollectorSet({"flaky": flaky, "ok": ok})
    flaky.error = "driver gone"
    body = collectors.body()
    assert (success(body, "flaky"), success(body, "ok")) == (0.0, 1.0)
    assert value(body, "trainpatrol_x") is None
    for _ in range(3):
        flaky.news += 1
        collectors.body()
    assert [r.getMessage() for r in caplog.records] == ["collector flaky failed: RuntimeError: driver gone"]
    flaky.error, flaky.news = "", flaky.news + 1
    body = collectors.body()
    assert success(body, "flaky") == 1.0 and value(body, "trainpatrol_x") == 2.0


def test_the_duration_is_that_of_the_collectors_last_collection() -> None:
    class Slow(Scripted):
        def collect(self) -> Iterator[Metric]:
            threading.Event().wait(0.05)
            return super().collect()

    slow = Slow(2.0)
    collectors = CollectorSet({"slow": slow})
    first = value(collectors.body(), "trainpatrol_collector_duration_seconds", {"collector": "slow"})
    assert first is not None and 0.05 <= first < 1.0
    assert value(collectors.body(), "trainpatrol_collector_duration_seconds", {"collector": "slow"}) == first
    (help_,) = [f.documentation for f in text_string_to_metric_families(collectors.body().decode())
                if f.name == "trainpatrol_collector_duration_seconds"]
    assert help_ == "Duration of the collector's last collection (it collects when it has something new)."


def test_scrapes_on_other_threads_while_ranks_push() -> None:
    clock = Clock()
    store = RankStore(clock=clock)
    collectors = CollectorSet({"ranks": RankCollector(store)})
    errors: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:
        try:
            while not done.is_set():
                text = collectors.body().decode()
                list(text_string_to_metric_families(text))  # well formed
                assert text.count("trainpatrol_rank_up{") == text.count("trainpatrol_loss{")
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=scrape) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            store.push(RankSnapshot.model_validate({
                "run": "r1", "rank": i % 4, "world_size": 4, "step": i, "samples": [
                    {"name": "trainpatrol_step_total", "value": float(i)},
                    {"name": "trainpatrol_loss", "value": 1.0 / (i + 1)}]}))
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    body = collectors.body()
    assert [value(body, "trainpatrol_step_total", {"run": "r1", "rank": str(r)}) for r in range(4)] == [
        296.0, 297.0, 298.0, 299.0]


def test_the_body_comes_as_openmetrics_or_gzipped_when_asked_and_as_text_by_default() -> None:
    store = RankStore(clock=Clock())
    store.push(RankSnapshot.model_validate({"run": "r1", "rank": 0, "samples": [
        {"name": "trainpatrol_step_total", "value": 3.0},
        {"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": 'a"b\\c'}, "value": 1.0}],
        "histogram": {"counts": [0.0] * 15 + [3.0], "sum": 0.3}}))
    registry = Registry({"ranks": RankCollector(store)})
    plain = registry.body()
    assert plain.content_type == "text/plain; version=1.0.0; charset=utf-8" and not plain.gzipped  # as before
    assert_clean(plain.data)
    assert b'trainpatrol_step_total{rank="0",run="r1"} 3.0\n' in plain.data
    prometheus = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                  "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.42 asks for: the text format
    assert registry.body(prometheus) is plain
    assert_as_generate_latest(plain.data)
    om = registry.body("application/openmetrics-text")
    assert om.content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert_openmetrics_clean(om.data)
    assert b"# TYPE trainpatrol_step counter\n" in om.data
    assert b'trainpatrol_step_total{rank="0",run="r1"} 3.0\n' in om.data
    zipped = registry.body("", "deflate, gzip;q=0.8")
    assert zipped.gzipped and gzip.decompress(zipped.data) == plain.data


def test_a_body_is_written_once_per_format_until_a_collector_moves() -> None:
    a = Scripted(2.0)
    registry = Registry({"a": a})
    first = registry.body()
    assert registry.body() is first and a.writes == 1
    om = registry.body("application/openmetrics-text")
    assert registry.body("application/openmetrics-text") is om and a.writes == 1
    a.news += 1
    assert registry.body() is not first and a.writes == 2
