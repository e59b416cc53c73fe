"""Rank liveness on an injected clock, stale series removed after their TTLs, a /metrics body
that generate_latest and promtool agree with, and a ``capture`` that dumps every thread's stack
into the evidence directory."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from exposition_check import Watched, assert_as_generate_latest, assert_clean, text
from exposition_check import value as sample_value
from fake_clock import T0, Clock, script_perf_counter
from loops import scripted_patrol
from nvml_fake.fake import FakeNvml
from servers import agent, http_json, wait_for
from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.agent.stats import AgentStats
from trainpatrol.agent.store import RankStore
from trainpatrol.collectors.nvml import NvmlCollector
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.collectors.registry import Registry
from trainpatrol.protocol import RankSnapshot

UP_TTL, EXPIRE, CLOSED_EXPIRE = 15.0, 600.0, 60.0


def store_and_registry(clock: Clock) -> tuple[RankStore, RankCollector]:
    store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
    return store, RankCollector(store)


def snap(run: str = "r1", rank: int = 0, step: int = 0, **extra: Any) -> RankSnapshot:
    return RankSnapshot.model_validate({
        "run": run, "rank": rank, "world_size": 2, "step": step, "instance": "a" * 16,
        "samples": [{"name": "trainpatrol_step_total", "labels": {}, "value": step}], **extra})


def liveness(registry: RankCollector, run: str = "r1", rank: int = 0) -> tuple[float | None, ...]:
    """(up, last push, last step advance, step_total) of one rank, None where the series is absent."""
    labels = {"run": run, "rank": str(rank)}
    names = ("rank_up", "rank_last_push_timestamp_seconds", "rank_last_step_timestamp_seconds", "step_total")
    body = text(registry)
    return tuple(sample_value(body, f"trainpatrol_{name}", labels) for name in names)


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
    assert b'run="done"' not in text(registry)
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
    assert [ln for ln in text(registry).decode().splitlines() if not ln.startswith("#")] == []
    assert store.runs() == {}


def test_the_last_step_time_is_the_ranks_own_to_the_sub_second_within_its_push_interval() -> None:
    """Pushes fall on whole seconds on every rank; the step's own end orders the ranks. A clock that runs ahead
    or behind (or lies) moves the timestamp by at most the time since the rank's previous push."""
    clock = Clock()
    store, registry = store_and_registry(clock)
    store.push(snap(step=5, seq=1, step_time=T0 - 0.4))
    assert liveness(registry)[2] == T0  # a first push: nothing bounds the rank's clock from below
    clock.now = T0 + 1
    store.push(snap(step=6, seq=2, step_time=T0 + 0.637))
    assert liveness(registry)[1:3] == (T0 + 1, T0 + 0.637)
    clock.now = T0 + 2
    store.push(snap(step=7, seq=3, step_time=T0 + 7))  # ahead of the agent: now
    assert liveness(registry)[2] == T0 + 2
    clock.now = T0 + 3
    store.push(snap(step=8, seq=4, step_time=T0 - 100))  # behind: no earlier than the previous push
    assert liveness(registry)[2] == T0 + 2
    clock.now = T0 + 4
    store.push(snap(step=8, seq=5, step_time=T0 + 3.5))  # the step did not advance: nothing moves
    assert liveness(registry)[2] == T0 + 2


def test_a_patrol_pushes_the_wall_clock_of_its_last_step_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = script_perf_counter(monkeypatch)
    patrol = scripted_patrol(tmp_path)
    assert patrol._report.snapshot()["step_time"] == 0.0  # no step yet
    steps.now = 10.0
    patrol.boundary()
    patrol.step(torch.tensor(1.0))
    patrol.boundary()
    steps.now = 12.5  # the step ended 2.5 s (of the step clock) before the push
    pushed = patrol._report.snapshot()
    assert pushed["step"] == 1 and pushed["step_time"] == pytest.approx(pushed["time"] - 2.5, abs=1e-6)
    patrol.close()


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


def test_the_body_of_ranks_gpus_and_counts_is_what_generate_latest_writes() -> None:
    clock = Clock()
    store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
    nvml = NvmlCollector(FakeNvml.from_fixture(gpus=2), clock=clock)
    nvml.sample_once()
    nvml.sample_once()  # rates need two samples
    stats = AgentStats("agent")
    stats.count("pushes", "ok")
    collectors = Registry({"ranks": RankCollector(store), "nvml": nvml, "agent": stats})
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
    first = collectors.body().data
    assert_clean(first)
    assert b'host="quote \\" backslash \\\\ done"' in first
    assert b"trainpatrol_step_total{rank=\"1\",run=\"r1\"} 1e+21" in first
    assert b"trainpatrol_gpu_info{" in first and b"trainpatrol_run_step_duration_seconds_bucket{" in first
    assert b"# TYPE trainpatrol_step_duration_seconds summary" in first  # a rank's, at the standard level


def test_metrics_endpoint_serves_the_last_push_of_each_rank() -> None:
    agent_ = Agent(AgentConfig(token="t", nvml=False).load(), clock=Clock())
    client = TestClient(agent_.app, base_url="http://localhost")
    for rank, step in ((0, 1), (1, 1), (0, 2)):
        body = {"run": "r1", "rank": rank, "world_size": 2, "step": step,
                "samples": [{"name": "trainpatrol_step_total", "labels": {}, "value": step}]}
        assert client.post("/v1/push", json=body, headers={"Authorization": "Bearer t"}).status_code == 200
    served = client.get("/metrics").content
    assert_as_generate_latest(served)
    assert b'trainpatrol_step_total{rank="0",run="r1"} 2.0\n' in served
    assert b'trainpatrol_step_total{rank="1",run="r1"} 1.0\n' in served


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
def test_an_expired_rank_leaves_the_body(state: str) -> None:
    clock = Clock()
    store = RankStore(UP_TTL, EXPIRE, CLOSED_EXPIRE, clock=clock)
    collector = Watched(RankCollector(store))
    store.push(snap("x", 0, step=1, state=state))
    assert b'trainpatrol_step_total{rank="0",run="x"} 1.0\n' in text(collector)
    clock.now = T0 + EXPIRE + 1
    assert collector.changed()
    assert text(collector) == b""


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
