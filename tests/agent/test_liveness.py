"""Issue 4: rank liveness on an injected clock, stale series removed after their TTLs, a byte-exact
fast /metrics body, and a ``capture`` that dumps every thread's stack into the evidence directory."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fake_clock import T0, Clock
from loops import scripted_patrol
from nvml_fake.fake import FakeNvml
from servers import agent, http_json, wait_for
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.agent.exposition import exposition
from trainpatrol.agent.store import RankStore
from trainpatrol.collectors.agent_self import AgentStats
from trainpatrol.collectors.nvml import NvmlCollector
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.protocol import RankSnapshot

UP_TTL, EXPIRE, CLOSED_EXPIRE = 15.0, 600.0, 60.0


def store_and_registry(clock: Clock) -> tuple[RankStore, CollectorRegistry]:
    store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
    registry = CollectorRegistry()
    registry.register(RankCollector(store))
    return store, registry


def snap(run: str = "r1", rank: int = 0, step: int = 0, **extra: Any) -> RankSnapshot:
    return RankSnapshot.model_validate({
        "run": run, "rank": rank, "world_size": 2, "step": step, "instance": "a" * 16,
        "samples": [{"name": "trainpatrol_step_total", "labels": {}, "value": step}], **extra})


def liveness(registry: CollectorRegistry, run: str = "r1", rank: int = 0) -> tuple[float | None, ...]:
    """(up, last push, last step advance, step_total) of one rank, None where the series is absent."""
    labels = {"run": run, "rank": str(rank)}
    names = ("rank_up", "rank_last_push_timestamp_seconds", "rank_last_step_timestamp_seconds", "step_total")
    return tuple(registry.get_sample_value(f"trainpatrol_{name}", labels) for name in names)


def test_last_push_and_up_follow_the_ttl() -> None:
    clock = Clock()
    store, registry = store_and_registry(clock)
    store.push(snap(step=3))
    assert liveness(registry) == (1.0, T0, T0, 3.0)
    clock.now = T0 + UP_TTL  # the TTL itself still counts as up
    assert liveness(registry) == (1.0, T0, T0, 3.0)
    clock.now = T0 + UP_TTL + 0.001
    assert liveness(registry) == (0.0, T0, T0, 3.0)  # down, but still reported with when it was seen
    assert [(r["up"], r["state"]) for r in store.runs()["r1"]["ranks"]] == [(False, "down")]
    clock.now = T0 + 20
    store.push(snap(step=4))
    assert liveness(registry) == (1.0, T0 + 20, T0 + 20, 4.0)


def test_last_step_moves_only_when_the_step_advances() -> None:
    clock = Clock()
    store, registry = store_and_registry(clock)
    store.push(snap(step=5, seq=1))
    # a stuck loop: the publisher thread still pushes, the step counter does not move
    for i, dt in enumerate((1.0, 2.0, 10.0), start=2):
        clock.now = T0 + dt
        store.push(snap(step=5, seq=i))
        assert liveness(registry) == (1.0, T0 + dt, T0, 5.0)
    clock.now = T0 + 12
    store.push(snap(step=6, seq=5))
    assert liveness(registry) == (1.0, T0 + 12, T0 + 12, 6.0)
    # a late push that arrives after a newer one changes nothing
    clock.now = T0 + 13
    store.push(snap(step=7, seq=4))
    assert liveness(registry) == (1.0, T0 + 12, T0 + 12, 6.0)
    # a dead process: no pushes at all, so up drops and both timestamps stay where they were
    clock.now = T0 + 12 + UP_TTL + 1
    assert liveness(registry) == (0.0, T0 + 12, T0 + 12, 6.0)


def test_closed_run_is_removed_after_closed_expire() -> None:
    clock = Clock()
    store, registry = store_and_registry(clock)
    for rank in (0, 1):
        store.push(snap("done", rank, step=9, state="closed"))
    store.push(snap("live", 0, step=1))
    assert liveness(registry, "done", 1) == (0.0, T0, T0, 9.0)  # a closed rank is not up
    clock.now = T0 + CLOSED_EXPIRE
    assert liveness(registry, "done", 1) == (0.0, T0, T0, 9.0)
    clock.now = T0 + CLOSED_EXPIRE + 0.001
    for rank in (0, 1):
        assert liveness(registry, "done", rank) == (None, None, None, None)
    assert b'run="done"' not in generate_latest(registry)
    assert set(store.runs()) == {"live"} and not store.hosts_run("done")
    assert liveness(registry, "live", 0) == (0.0, T0, T0, 1.0)  # only down: it has not vanished yet


def test_vanished_run_is_removed_after_rank_expire() -> None:
    clock = Clock()
    store, registry = store_and_registry(clock)
    store.push(snap("gone", 0, step=2))
    clock.now = T0 + EXPIRE
    assert liveness(registry, "gone") == (0.0, T0, T0, 2.0)
    clock.now = T0 + EXPIRE + 0.001
    assert liveness(registry, "gone") == (None, None, None, None)
    assert [ln for ln in generate_latest(registry).decode().splitlines() if not ln.startswith("#")] == []
    assert store.runs() == {}


def test_agent_serves_liveness_on_its_clock() -> None:
    clock = Clock()
    agent_ = Agent(AgentConfig(token="t", nvml=False, rank_up_ttl_seconds=UP_TTL).load(), clock=clock)
    client = TestClient(agent_.app, base_url="http://localhost")
    body = {"run": "r1", "rank": 1, "world_size": 2, "step": 7}
    assert client.post("/v1/push", json=body, headers={"Authorization": "Bearer t"}).status_code == 200
    clock.now = T0 + UP_TTL + 1

    def value(name: str) -> float:
        text = client.get("/metrics").text
        family = next(f for f in text_string_to_metric_families(text) if f.name == name)
        (sample,) = [s for s in family.samples if s.labels == {"run": "r1", "rank": "1"}]
        return float(sample.value)

    assert value("trainpatrol_rank_up") == 0.0
    assert value("trainpatrol_rank_last_push_timestamp_seconds") == T0
    assert value("trainpatrol_rank_last_step_timestamp_seconds") == T0


def test_fast_exposition_is_byte_identical_to_generate_latest() -> None:
    """/metrics formats rank and NVML samples once per reading; the body must not differ by a byte."""
    clock = Clock()
    store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
    nvml = NvmlCollector(FakeNvml.from_fixture(gpus=2), clock=clock)
    nvml.sample_once()
    nvml.sample_once()  # rates need two samples
    stats = AgentStats("agent")
    stats.count("pushes", "ok")
    registry = CollectorRegistry()
    for collector in (RankCollector(store), nvml, stats):
        registry.register(collector)
    odd = 'quote " backslash \\ done'  # a newline is refused at the push (protocol.printable)
    for rank in range(3):
        store.push(snap("r1", rank % 2, step=rank, host=odd, samples=[
            {"name": "trainpatrol_step_total", "labels": {}, "value": 1e21 + rank},
            {"name": "trainpatrol_loss", "labels": {}, "value": float("nan")},
            {"name": "trainpatrol_grad_norm", "labels": {}, "value": float("inf")},
            {"name": "trainpatrol_rank_info", "labels": {
                "local_rank": "0", "world_size": "2", "host": odd, "gpu_uuid": "GPU-x", "device": "cuda:0",
                "torch_version": "2", "cuda_version": "13", "trainpatrol_version": "0",
                    "launcher": "", "launcher_job": ""}, "value": 1.0}],
            histogram={"counts": [float(i) for i in range(len(_bounds()) + 1)], "sum": 2.5}))
    first = exposition(registry)
    assert first == generate_latest(registry)
    assert exposition(registry) == first  # served again from the cached lines
    assert b'host="quote \\" backslash \\\\ done"' in first
    assert b"trainpatrol_step_total{rank=\"1\",run=\"r1\"} 1e+21" in first
    assert b"trainpatrol_gpu_info{" in first and b"trainpatrol_step_duration_seconds_bucket{" in first


def test_metrics_endpoint_serves_pushes_laid_out_at_push_time() -> None:
    agent_ = Agent(AgentConfig(token="t", nvml=False).load(), clock=Clock())
    client = TestClient(agent_.app, base_url="http://localhost")
    for rank, step in ((0, 1), (1, 1), (0, 2)):
        body = {"run": "r1", "rank": rank, "world_size": 2, "step": step,
                "samples": [{"name": "trainpatrol_step_total", "labels": {}, "value": step}]}
        assert client.post("/v1/push", json=body, headers={"Authorization": "Bearer t"}).status_code == 200
    assert set(agent_.ranks._layouts) == {("", "r1", 0), ("", "r1", 1)}  # laid out as they arrived

    def stable(body: bytes) -> list[str]:  # the collectors' own timings differ from call to call
        return [ln for ln in body.decode().splitlines() if "collector_duration_seconds{" not in ln]

    served = client.get("/metrics").content
    assert stable(served) == stable(generate_latest(agent_.registry))
    assert 'trainpatrol_step_total{rank="0",run="r1"} 2.0' in stable(served)


def _bounds() -> list[float]:
    from trainpatrol.catalogue import STEP_DURATION_BUCKETS

    return list(STEP_DURATION_BUCKETS)


def _stack_blocks(stacks: str) -> list[str]:
    return re.findall(r"^(?:Current thread|Thread) 0x[0-9a-f]+", stacks, flags=re.MULTILINE)


def test_capture_dumps_every_threads_stack(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        patrol = scripted_patrol(tmp_path, url, run="cap", push_interval_seconds=0.1, pause_poll_seconds=0.05)
        try:
            wait_for(lambda: http_json(f"{url}/v1/runs/cap")["ranks"], 10, what="first push")
            reply = http_json(f"{url}/v1/runs/cap/actions", {"action": "capture", "reason": "look"})
            deadline = time.monotonic() + 20
            while not patrol.actions and time.monotonic() < deadline:  # the training loop, in this thread
                patrol.boundary()
                patrol.step(torch.tensor(1.0), grad_norm=torch.tensor(0.5))
                time.sleep(0.01)
            (record,) = patrol.actions
            assert (record.id, record.action, record.outcome) == (reply["id"], "capture", "ok")
            assert patrol.state == "running"  # evidence only: the run goes on
            stacks = (Path(record.evidence) / "rank-00000" / "stacks.txt").read_text()
            assert len(_stack_blocks(stacks)) >= 2, stacks  # this thread and the publisher, at least
            assert "in test_capture_dumps_every_threads_stack" in stacks  # the loop that asked for it
            assert "publisher.py" in stacks and "in _loop" in stacks  # the publisher thread, waiting
            manifest = json.loads((Path(record.evidence) / "manifest.json").read_text())
            assert manifest["action"] == "capture" and "rank-00000/stacks.txt" in manifest["files"]
            wait_for(lambda: (http_json(f"{url}/v1/runs/cap")["last_action"] or {}).get("action") == "capture",
                     10, what="agent sees the capture")
        finally:
            patrol.close()


@pytest.mark.parametrize("state", ["closed", "running"])
def test_expired_rank_drops_out_of_the_render_cache(state: str) -> None:
    clock = Clock()
    store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
    collector = RankCollector(store)
    store.push(snap("x", 0, step=1, state=state))
    assert next(f for f in collector.collect() if f.name == "trainpatrol_step").samples
    clock.now = T0 + EXPIRE + 1
    assert not next(f for f in collector.collect() if f.name == "trainpatrol_step").samples
    assert collector._layouts == {}


def test_a_run_whose_ranks_all_stopped_pushing_is_down() -> None:
    clock = Clock(T0)
    store, _ = store_and_registry(clock)
    store.push(snap("gone", 0, step=3))
    store.push(snap("gone", 1, step=3))
    assert store.runs()["gone"]["state"] == "running"
    clock.now = T0 + UP_TTL + 1
    status = store.runs()["gone"]
    assert status["state"] == "down"
    assert [(r["rank"], r["state"], r["up"]) for r in status["ranks"]] == [(0, "down", False), (1, "down", False)]


def test_a_rank_that_ended_on_purpose_is_shown_ended_after_its_ttl_never_down() -> None:
    """A rank whose last push said ``closed`` (a normal exit) or ``stopped`` (the stop action) pushes
    no more, by design: past the liveness TTL it is still shown as it ended, not ``down``."""
    clock = Clock(T0)
    store, registry = store_and_registry(clock)
    store.push(snap("done", 0, step=9, state="closed"))
    store.push(snap("halted", 0, step=4, state="stopped"))
    store.push(snap("gone", 0, step=3))
    clock.now = T0 + UP_TTL + 1
    runs = store.runs()
    assert {run: (s["state"], [r["state"] for r in s["ranks"]]) for run, s in runs.items()} == {
        "done": ("closed", ["closed"]), "halted": ("stopped", ["stopped"]), "gone": ("down", ["down"])}
    assert [liveness(registry, run)[0] for run in ("done", "halted", "gone")] == [0.0, 0.0, 0.0]


def test_command_queues_expire_with_their_ttl() -> None:
    from trainpatrol.agent.store import COMMAND_TTL_SECONDS
    from trainpatrol.protocol import Command

    clock = Clock(T0)
    store, _ = store_and_registry(clock)
    assert store.enqueue(Command(id=5, run="never-started", action="pause", created=T0))[0] == "queued"
    assert [c.id for c in store.pending("never-started")] == [5]
    clock.now = T0 + COMMAND_TTL_SECONDS + 1
    store.expire()
    assert store.pending("never-started") == []


def test_a_table_of_ranks_writes_what_generate_latest_writes() -> None:
    """Each family is written across ranks with one template; values it cannot write (NaN, ±Inf,
    1e6 and above) take the line-by-line path, and ``%`` in a label is no placeholder."""
    from prometheus_client.core import Metric

    from trainpatrol.agent.exposition import Families
    from trainpatrol.collectors.rank_lines import FAMILIES, HISTOGRAM_AT, Layout, Table, family_samples

    def ranked(rank: int, loss: float, zero: float, kind: str, total: float, hsum: float) -> RankSnapshot:
        counts = [float(min(i, 5)) for i in range(16)]
        return snap("r1", rank, samples=[
            {"name": "trainpatrol_loss", "labels": {}, "value": loss},
            {"name": "trainpatrol_grad_norm", "labels": {}, "value": zero},
            {"name": "trainpatrol_nonfinite_steps_total", "labels": {"kind": kind}, "value": 3.0},
            {"name": "trainpatrol_step_total", "labels": {}, "value": total},
            {"name": "trainpatrol_rank_info", "labels": {"local_rank": "0", "world_size": "2", "host": "h%d",
                                                         "gpu_uuid": "u", "device": "cpu", "torch_version": "2",
                                                         "cuda_version": "", "trainpatrol_version": "0",
                                                             "launcher": "", "launcher_job": ""},
             "value": 7.0}],
            histogram={"counts": counts, "sum": hsum},  # rank 1 runs in a pod: its workload labels sort in
            **({"namespace": "team-a", "pod": "w-1", "container": "trainer", "node": "gpu-12"} if rank else {}))

    snaps = [ranked(0, 1.5, -0.0, "l%s", 7.0, 0.5), ranked(1, float("nan"), 0.0, "grad", 1e6, 2e6)]
    table = Table([Layout.of(s) for s in snaps])
    flat = [sample for s in snaps for sample in s.samples]
    for j, name in enumerate(FAMILIES):
        expected_samples = [x for s in snaps for x in family_samples(s).get(name, [])]
        m = Metric(name.removesuffix("_total").removesuffix("_info"), "h", "gauge")
        m.samples = expected_samples
        expected = generate_latest(Families([m])).decode().split("\n", 2)[2] if expected_samples else ""
        written = table.histogram([s.histogram for s in snaps]) if j == HISTOGRAM_AT else table.text(
            j, table.samples(j, flat))
        assert written == expected, name
    text = table.text(FAMILIES.index("trainpatrol_loss"), table.samples(FAMILIES.index("trainpatrol_loss"), flat))
    assert text == ('trainpatrol_loss{rank="0",run="r1"} 1.5\n'
                    'trainpatrol_loss{container="trainer",namespace="team-a",node="gpu-12",pod="w-1",rank="1",'
                    'run="r1"} NaN\n')
    step = FAMILIES.index("trainpatrol_step_total")
    assert table.text(step, table.samples(step, flat)).endswith(
        'trainpatrol_step_total{container="trainer",namespace="team-a",node="gpu-12",pod="w-1",rank="1",'
        'run="r1"} 1e+06\n')
    kind = FAMILIES.index("trainpatrol_nonfinite_steps_total")
    assert table.text(kind, table.samples(kind, flat)).startswith(
        'trainpatrol_nonfinite_steps_total{kind="l%s",rank="0",run="r1"} 3.0\n')
    assert Layout.of(snaps[0]).fits(ranked(0, 2.0, 1.0, "l%s", 8.0, 0.7))
    assert not Layout.of(snaps[0]).fits(ranked(0, 2.0, 1.0, "grad", 8.0, 0.7))  # another label value
    assert not Layout.of(snaps[0]).fits(ranked(1, 1.5, -0.0, "l%s", 7.0, 0.5))  # another rank
