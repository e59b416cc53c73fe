"""The /metrics body: a collector is written again only when it says it changed, a failing one
gives nothing and fails no scrape, and each one's success and last collection time are served."""

from __future__ import annotations

import logging
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exposition_check import assert_clean, value
from fake_clock import Clock
from trainpatrol.agent.store import RankStore
from trainpatrol.collectors.health import CollectorSet
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.protocol import RankSnapshot


class Scripted:
    """A collector whose news, text and failure the test sets; it counts its writes."""

    def __init__(self, text: bytes = b"") -> None:
        self.text, self.news, self.error, self.writes = text, True, "", 0

    def changed(self) -> bool:
        return self.news

    def write(self) -> bytes:
        self.writes += 1
        self.news = False
        if self.error:
            raise RuntimeError(self.error)
        return self.text


X = b"# HELP trainpatrol_x x\n# TYPE trainpatrol_x gauge\ntrainpatrol_x 2.0\n"


def success(body: bytes, name: str) -> float | None:
    return value(body, "trainpatrol_collector_success", {"collector": name})


def test_a_collector_is_written_again_only_when_it_changed() -> None:
    a, b = Scripted(X), Scripted(b"")
    collectors = CollectorSet({"a": a, "b": b})
    first = collectors.body()
    assert first.startswith(X) and (a.writes, b.writes) == (1, 1)
    assert collectors.body() == first and (a.writes, b.writes) == (1, 1)  # nothing new: nothing written
    a.text, a.news = X.replace(b"2.0", b"3.0"), True
    second = collectors.body()
    assert value(second, "trainpatrol_x") == 3.0 and (a.writes, b.writes) == (2, 1)
    assert_clean(second)


def test_a_failing_collector_gives_nothing_logs_once_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainpatrol.collectors.health")
    flaky, ok = Scripted(X), Scripted(b"")
    collectors = CollectorSet({"flaky": flaky, "ok": ok})
    flaky.error = "driver gone"
    body = collectors.body()
    assert (success(body, "flaky"), success(body, "ok")) == (0.0, 1.0)
    assert value(body, "trainpatrol_x") is None
    for _ in range(3):
        flaky.news = True
        collectors.body()
    assert [r.getMessage() for r in caplog.records] == ["collector flaky failed: RuntimeError: driver gone"]
    flaky.error, flaky.news = "", True
    body = collectors.body()
    assert success(body, "flaky") == 1.0 and value(body, "trainpatrol_x") == 2.0


def test_the_duration_is_that_of_the_collectors_last_collection() -> None:
    class Slow(Scripted):
        def write(self) -> bytes:
            threading.Event().wait(0.05)
            return super().write()

    slow = Slow(X)
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
