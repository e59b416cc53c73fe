"""What a /metrics scrape reuses from the last one, and what it must not: every body here is checked
byte for byte against ``generate_latest``, which builds each family's samples on demand."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from fake_clock import T0, Clock
from trainpatrol.agent.exposition import Families, RenderedFamily, exposition, go_float, go_floats, render, sample_line
from trainpatrol.agent.store import RankStore
from trainpatrol.catalogue import STEP_DURATION_BUCKETS
from trainpatrol.collectors.agent_self import AgentStats
from trainpatrol.collectors.health import CollectorSet
from trainpatrol.collectors.nvml import NvmlCollector
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.nvml_fake import FakeNvml
from trainpatrol.protocol import RankSnapshot

INFO = {"local_rank": "0", "world_size": "4", "host": 'node "7" \\ ', "gpu_uuid": "GPU-x", "device": "cuda:0",
        "torch_version": "2", "cuda_version": "13", "trainpatrol_version": "0", "launcher": "", "launcher_job": ""}
UP_TTL, EXPIRE, CLOSED_EXPIRE = 15.0, 600.0, 60.0


class Ranks:
    """A store and its collector, pushed to as the agent does: store first, then formatting."""

    def __init__(self, clock: Clock) -> None:
        self.store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
        self.collector = RankCollector(self.store)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)

    def push(self, snapshot: RankSnapshot) -> None:
        self.store.push(snapshot)
        self.collector.prepare(snapshot)

    def body(self) -> str:
        served = exposition(self.registry)
        assert served == generate_latest(self.registry)
        return served.decode()

    def families(self) -> dict[str, RenderedFamily]:
        out = {}
        for f in self.collector.collect():
            assert isinstance(f, RenderedFamily)
            out[f.name] = f
        return out


def snap(rank: int, step: int, loss: float = 1.5, run: str = "r1", kinds: tuple[str, ...] = ("loss",),
         **extra: Any) -> RankSnapshot:
    return RankSnapshot.model_validate({
        "run": run, "rank": rank, "world_size": 4, "step": step, "instance": "a" * 16, **extra,
        "samples": [{"name": "trainpatrol_step_total", "labels": {}, "value": step},
                    {"name": "trainpatrol_loss", "labels": {}, "value": loss},
                    *({"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": k}, "value": 0.0}
                      for k in kinds),
                    {"name": "trainpatrol_rank_info", "labels": INFO, "value": 1.0}],
        "histogram": {"counts": [float(step)] * (len(STEP_DURATION_BUCKETS) + 1), "sum": 0.25 * step}})


def value(body: str, name: str, rank: int, run: str = "r1") -> str | None:
    """The value written for a rank's sample of ``name``, None where there is no such line."""
    prefix = f'{name}{{rank="{rank}",run="{run}"}} '
    return next((line[len(prefix):] for line in body.splitlines() if line.startswith(prefix)), None)


def at(seconds: float) -> str:
    """T0 plus ``seconds``, as the body writes a timestamp."""
    return floatToGoString(T0 + seconds)


def liveness(body: str, rank: int) -> tuple[str | None, ...]:
    names = ("rank_up", "rank_last_push_timestamp_seconds", "rank_last_step_timestamp_seconds")
    return tuple(value(body, f"trainpatrol_{name}", rank) for name in names)


def test_a_scrape_with_nothing_new_serves_the_last_families_again() -> None:
    ranks = Ranks(Clock())
    for rank in range(3):
        ranks.push(snap(rank, step=5))
    first = list(ranks.collector.collect())
    again = list(ranks.collector.collect())
    assert len(first) == len(again) and all(a is b for a, b in zip(first, again, strict=True))
    assert ranks.body() == ranks.body()


def test_rank_up_drops_on_the_cached_path_once_the_ttl_passes() -> None:
    clock = Clock()
    ranks = Ranks(clock)
    ranks.push(snap(0, step=3))
    ranks.push(snap(1, step=3))
    assert liveness(ranks.body(), 0) == ("1.0", at(0), at(0))
    clock.now = T0 + UP_TTL  # the TTL itself still counts as up, served from the cached scrape
    assert liveness(ranks.body(), 0)[0] == "1.0"
    clock.now = T0 + UP_TTL + 0.001
    body = ranks.body()
    assert liveness(body, 0) == ("0.0", at(0), at(0))
    assert liveness(body, 1)[0] == "0.0" and value(body, "trainpatrol_step_total", 0) == "3.0"
    ranks.push(snap(0, step=3))  # back, its step where it was
    body = ranks.body()
    assert liveness(body, 0) == ("1.0", at(UP_TTL + 0.001), at(0))
    assert liveness(body, 1)[0] == "0.0"


def test_a_closed_rank_is_never_up() -> None:
    ranks = Ranks(Clock())
    ranks.push(snap(0, step=1, state="closed"))
    assert liveness(ranks.body(), 0)[0] == "0.0"


def test_liveness_after_a_new_push_is_that_push() -> None:
    clock = Clock()
    ranks = Ranks(clock)
    ranks.push(snap(0, step=1))
    ranks.body()
    clock.now = T0 + 5
    ranks.push(snap(0, step=1))  # a push without a step: only the push time moves
    assert liveness(ranks.body(), 0) == ("1.0", at(5), at(0))
    clock.now = T0 + 7
    ranks.push(snap(0, step=2, loss=0.5))
    body = ranks.body()
    assert liveness(body, 0) == ("1.0", at(7), at(7))
    assert value(body, "trainpatrol_loss", 0) == "0.5" and value(body, "trainpatrol_step_total", 0) == "2.0"


def test_an_expired_rank_disappears_and_leaves_the_cache() -> None:
    clock = Clock()
    ranks = Ranks(clock)
    ranks.push(snap(0, step=1))
    ranks.push(snap(1, step=1))
    assert 'rank="1"' in ranks.body()
    clock.now = T0 + EXPIRE / 2
    ranks.push(snap(0, step=2))
    ranks.body()
    clock.now = T0 + EXPIRE + 0.001  # rank 1 has been silent for longer than EXPIRE, rank 0 has not
    body = ranks.body()
    assert 'rank="1"' not in body and liveness(body, 0)[0] == "0.0"
    assert set(ranks.collector._layouts) == {("", "r1", 0)}
    clock.now = T0 + EXPIRE / 2 + EXPIRE + 0.001
    assert [ln for ln in ranks.body().splitlines() if not ln.startswith("#")] == []
    assert ranks.collector._layouts == {}


def test_a_rank_that_replaces_an_expired_one_at_its_place_is_served() -> None:
    """The same number of ranks, but not the same ranks: every line of the newcomer is written."""
    clock = Clock()
    ranks = Ranks(clock)
    ranks.push(snap(0, step=1))
    ranks.push(snap(1, step=1))
    ranks.body()
    clock.now = T0 + EXPIRE + 1
    ranks.push(snap(0, step=2))
    ranks.push(snap(2, step=1))
    body = ranks.body()
    assert value(body, "trainpatrol_step_total", 2) == "1.0" and 'rank="1"' not in body


def test_only_the_families_a_push_changed_are_joined_again() -> None:
    ranks = Ranks(Clock())
    for rank in range(3):
        ranks.push(snap(rank, step=4))
    before = ranks.families()
    ranks.push(snap(1, step=4, loss=0.75))
    after = ranks.families()
    changed = {name for name, f in after.items() if f.lines is not before[name].lines}
    # the loss moved; the clock did not, so the liveness lines read as before and are the same objects
    assert changed == {"trainpatrol_loss"}
    body = ranks.body()
    assert [value(body, "trainpatrol_loss", rank) for rank in range(3)] == ["1.5", "0.75", "1.5"]
    ranks.push(snap(2, step=4, kinds=("loss", "grad")))  # a new series: the whole snapshot is formatted again
    latest = ranks.families()
    changed = {name for name, f in latest.items() if f.lines is not after[name].lines}
    assert changed == {"trainpatrol_nonfinite_steps"}
    assert 'trainpatrol_nonfinite_steps_total{kind="grad",rank="2",run="r1"} 0.0' in ranks.body()


def test_a_family_that_changes_and_changes_back_is_served_as_it_is() -> None:
    ranks = Ranks(Clock())
    ranks.push(snap(0, step=1, loss=-0.0))
    assert value(ranks.body(), "trainpatrol_loss", 0) == "-0.0"
    ranks.push(snap(0, step=1, loss=0.0))  # equal to -0.0, but written differently
    assert value(ranks.body(), "trainpatrol_loss", 0) == "0.0"
    ranks.push(snap(0, step=1, loss=2.0))
    ranks.push(snap(0, step=1, loss=0.0))  # two pushes between scrapes, the second undoing the first
    assert value(ranks.body(), "trainpatrol_loss", 0) == "0.0"


def test_a_snapshot_nobody_prepared_is_formatted_at_the_scrape() -> None:
    ranks = Ranks(Clock())
    ranks.push(snap(0, step=1))
    ranks.body()
    ranks.store.push(snap(0, step=9, loss=3.0))  # stored, never prepared
    body = ranks.body()
    assert value(body, "trainpatrol_step_total", 0) == "9.0" and value(body, "trainpatrol_loss", 0) == "3.0"


def test_a_late_push_the_store_refused_changes_nothing() -> None:
    """The agent prepares every valid push; a reordered one the store kept out must not reach /metrics."""
    ranks = Ranks(Clock())
    ranks.push(snap(0, step=5, seq=5))
    before = ranks.body()
    ranks.push(snap(0, step=4, loss=9.0, seq=4))
    assert ranks.body() == before
    ranks.store.push(snap(1, step=1))  # another rank's arrival: rank 0 is written from its stored snapshot
    body = ranks.body()
    assert value(body, "trainpatrol_loss", 0) == "1.5" and value(body, "trainpatrol_step_total", 0) == "5.0"


def test_agent_counters_are_formatted_again_only_when_they_change() -> None:
    stats = AgentStats("agent")
    registry = CollectorRegistry()
    registry.register(stats)
    first, again = stats.collect(), stats.collect()
    assert all(a is b for a, b in zip(first, again, strict=True))
    stats.count("pushes", "ok")
    stats.count("commands", ("pause", 'odd "source" \\ \n'))
    after = stats.collect()
    assert [a is b for a, b in zip(first, after, strict=True)] == [True, False, True, True, False, True, True]
    served = exposition(registry)
    assert served == generate_latest(registry)
    assert b'trainpatrol_pushes_total{outcome="ok"} 1.0' in served
    assert b'source="odd \\"source\\" \\\\ \\n"' in served


def test_collector_health_gauges_match_generate_latest() -> None:
    def broken() -> list[Any]:
        raise RuntimeError("no")

    ranks = Ranks(Clock())
    ranks.push(snap(0, step=1))
    collectors = CollectorSet({"ranks": ranks.collector, "broken": type("C", (), {"collect": staticmethod(broken)})()})
    families = Families(collectors.collect())  # one collection: the durations are the same in both bodies
    served = exposition(families)
    assert served == generate_latest(families)
    assert b'trainpatrol_collector_success{collector="broken"} 0.0' in served
    assert b'trainpatrol_collector_success{collector="ranks"} 1.0' in served


def test_families_of_any_kind_match_generate_latest() -> None:
    """Plain families take the short formatter; timestamps and OpenMetrics-only samples go to
    prometheus_client; families that are not rendered are formatted at the scrape."""
    counter = CounterMetricFamily("c", "with _created", labels=["l"], created=T0)
    counter.add_metric(['x"y'], 2.0)
    stamped = GaugeMetricFamily("g_seconds", "help \\ with \n newline", labels=["a", "b"], unit="seconds")
    stamped.add_metric(["1", "2"], float("-inf"), timestamp=T0)
    info = InfoMetricFamily("i", "an info", value={"v": "é"})
    families = [counter, stamped, info]
    expected = generate_latest(Families(families))
    rendered = render(families)
    assert exposition(Families(rendered)) == expected == exposition(Families(families))
    assert [f.samples for f in rendered] == [f.samples for f in families]


def sampled_nvml() -> tuple[Clock, FakeNvml, NvmlCollector, CollectorRegistry]:
    """A collector of two fake H200s, registered, that has taken one sample."""
    clock = Clock()
    fake = FakeNvml.from_fixture(gpus=2)
    nvml = NvmlCollector(fake, clock=clock)
    registry = CollectorRegistry()
    registry.register(nvml)
    nvml.sample_once()
    return clock, fake, nvml, registry


def test_nvml_is_formatted_once_per_sample_by_the_sampler() -> None:
    _, fake, nvml, registry = sampled_nvml()
    formatted = nvml._rendered
    assert formatted is not None  # by sample_once, before any scrape
    first, again = list(nvml.collect()), list(nvml.collect())
    assert first == formatted[2] and all(a is b for a, b in zip(first, again, strict=True))
    assert exposition(registry) == generate_latest(registry)
    nvml._record_xid(fake.nvmlDeviceGetHandleByIndex(1), 79)  # a new XID count: formatted at the next scrape
    served = exposition(registry)
    assert served == generate_latest(registry)
    assert b"trainpatrol_gpu_xid_errors_total{" in served
    after = list(nvml.collect())
    assert [f.name for f in after if not any(f is g for g in first)] == [
        "trainpatrol_gpu_xid_errors", "trainpatrol_gpu_xid_last_timestamp_seconds"]  # only the new families
    nvml.sample_once()
    assert nvml._rendered is not None and nvml._rendered[0] is not formatted[0]


def test_an_nvml_family_whose_series_stayed_is_not_written_again() -> None:
    clock, fake, nvml, registry = sampled_nvml()
    first = {f.name: f for f in nvml.collect()}
    clock.now = T0 + 1
    fake.set_value(1, "nvmlDeviceGetPowerUsage", 431_250)  # milliwatts
    nvml.sample_once()
    second = {f.name: f for f in nvml.collect()}
    assert first.keys() == second.keys()
    assert {name for name in first if first[name] is not second[name]} == {
        "trainpatrol_gpu_power_watts", "trainpatrol_nvml_sample_timestamp_seconds"}
    served = exposition(registry)
    assert served == generate_latest(registry)
    assert b'trainpatrol_gpu_power_watts{gpu="1",' in served and b"} 431.25\n" in served


def test_scrapes_on_other_threads_while_ranks_push() -> None:
    clock = Clock()
    ranks = Ranks(clock)
    errors: list[BaseException] = []
    done = threading.Event()

    def scrape() -> None:
        try:
            while not done.is_set():
                text = exposition(ranks.registry).decode()
                list(text_string_to_metric_families(text))  # well formed
                assert text.count("trainpatrol_rank_up{") == text.count("trainpatrol_loss{")
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=scrape) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            clock.now = T0 + i
            ranks.push(snap(i % 4, step=i, loss=1.0 / (i + 1)))
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    body = ranks.body()
    assert [value(body, "trainpatrol_step_total", rank) for rank in range(4)] == ["296.0", "297.0", "298.0", "299.0"]


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, 3, 999_999.9, 1e6, 1_234_567.0, -1e9, 1.5e300, -2.5e-7,
                                   float("nan"), float("inf"), float("-inf")])
def test_sample_line_writes_values_and_labels_as_generate_latest(value: float) -> None:
    labels = {"uuid": 'GPU-"1"', "gpu": "0", "cause": "a\\b\nc"}
    family = GaugeMetricFamily("trainpatrol_x", "x", labels=sorted(labels))
    family.add_metric([labels[k] for k in sorted(labels)], value)
    expected = generate_latest(Families([family])).decode().split("\n", 2)[2]
    assert sample_line("trainpatrol_x", labels, value) == expected
    assert sample_line("trainpatrol_x", labels, value) == expected  # again, from the label-block cache


def test_go_floats_writes_each_value_as_float_to_go_string() -> None:
    values = (0.0, -0.0, 1.0, 999_999.9, 1e6, 1_000_000.5, 1_234_567.0, 60_921_649_970.87696, 1_796_037_377.5177,
              9_999_999_999_999_998.0, 1e16, 1.5e300, -1e9, -1_234_567.25, 2.5e-7, float("nan"), float("inf"),
              float("-inf"))
    assert go_floats(values) == [floatToGoString(v) for v in values]
    assert go_floats(values) == [go_float(v) for v in values]


def test_the_body_joins_a_collector_once_while_its_families_stay_the_same() -> None:
    def durations_apart(body: bytes) -> list[bytes]:  # the collectors' own timings differ from run to run
        return [ln for ln in body.splitlines() if b"collector_duration_seconds{" not in ln]

    def broken() -> list[Any]:
        raise RuntimeError("no")

    clock = Clock()
    ranks = Ranks(clock)
    stats = AgentStats("agent")
    collectors = CollectorSet({"ranks": ranks.collector, "agent": stats,
                               "broken": type("C", (), {"collect": staticmethod(broken)})()})
    registry = CollectorRegistry()
    registry.register(collectors)
    for rank in range(2):
        ranks.push(snap(rank, step=3))
    first = collectors.body()
    assert durations_apart(first) == durations_apart(generate_latest(registry))
    assert b'trainpatrol_collector_success{collector="broken"} 0.0' in first
    parts = {name: run.part for name, run in collectors._runs.items()}
    assert set(parts) == {"ranks", "agent", "broken"}
    assert collectors.body() is first  # nothing new: the same bytes, health gauges and all
    ranks.push(snap(1, step=4, loss=0.25))
    stats.count("pushes", "ok")
    third = collectors.body()
    assert third != first
    assert collectors._runs["ranks"].part is not parts["ranks"] and collectors._runs["agent"].part is not parts["agent"]
    assert collectors._runs["broken"].part is parts["broken"]
    assert durations_apart(third) == durations_apart(generate_latest(registry))
    assert value(third.decode(), "trainpatrol_loss", 1) == "0.25"
    assert b'trainpatrol_pushes_total{outcome="ok"} 1.0' in third


def test_health_gauges_stand_while_no_collector_finds_something_new() -> None:
    state: dict[str, Any] = {"families": [], "fail": False}

    def flaky() -> list[Any]:
        if state["fail"]:
            raise RuntimeError("driver gone")
        return list(state["families"])

    collectors = CollectorSet({"flaky": type("C", (), {"collect": staticmethod(flaky)})()})
    first = collectors.body()
    assert b'trainpatrol_collector_success{collector="flaky"} 1.0' in first
    assert collectors.body() is first
    state["fail"] = True  # no families before and none now, but the run failed: a new run
    failed = collectors.body()
    assert b'trainpatrol_collector_success{collector="flaky"} 0.0' in failed
    assert collectors.body() is failed
    state.update(fail=False, families=[GaugeMetricFamily("trainpatrol_x", "x", value=2.0)])
    recovered = collectors.body()
    assert b'trainpatrol_collector_success{collector="flaky"} 1.0' in recovered and b"trainpatrol_x 2.0" in recovered
    assert [f.name for f in collectors.collect()] == ["trainpatrol_x", "trainpatrol_collector_success",
                                                      "trainpatrol_collector_duration_seconds"]


def test_up_stands_until_the_oldest_up_rank_passes_the_ttl() -> None:
    clock = Clock()
    ranks = Ranks(clock)
    ranks.push(snap(0, step=1))
    clock.now = T0 + 5
    ranks.push(snap(1, step=1))
    entries = ranks.store.entries()
    first = ranks.store.up(entries)
    assert first == [True, True]
    clock.now = T0 + UP_TTL  # rank 0's push is exactly TTL old: still up, the same answer
    assert ranks.store.up(entries) is first
    clock.now = T0 + UP_TTL + 0.001
    assert ranks.store.up(entries) == [False, True]
    clock.now = T0 + 1  # a clock that went back is asked again, not answered from the cache
    assert ranks.store.up(entries) == [True, True]


def test_agent_families_stand_until_a_count() -> None:
    stats = AgentStats("agent")
    first = stats.collect()
    assert stats.collect() is first
    stats.count("alerts", "act")
    after = stats.collect()
    assert after is not first and stats.collect() is after
    assert b'trainpatrol_webhook_alerts_total{outcome="act"} 1.0' in exposition(Families(after))
