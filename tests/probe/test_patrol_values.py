"""Scripted loss/grad sequences, and a scripted step clock, give exact exported values, on CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fake_clock import Clock, script_perf_counter
from loops import losses_with_nan, run_scripted, scripted_patrol
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe.guards import GuardConfig
from trainpatrol.probe.memory import MemoryReading
from trainpatrol.protocol import RankSnapshot

GIB = 2.0**30


def value(snapshot: dict[str, Any], name: str, **labels: str) -> float:
    found = [s["value"] for s in snapshot["samples"]
             if s["name"] == "trainpatrol_" + name and all(s["labels"].get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return float(found[0])


def absent(snapshot: dict[str, Any], name: str) -> bool:
    return not any(s["name"] == "trainpatrol_" + name for s in snapshot["samples"])


def test_nan_counted_without_any_push(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, guard_actions={})
    losses = losses_with_nan(20, nan_at=7)
    run_scripted(patrol, losses, grad_norms=[1.0] * 20)
    snap = patrol._report.snapshot()
    RankSnapshot.model_validate(snap)  # the push payload is what the agent accepts
    assert patrol._publisher.delivered == 0
    assert value(snap, "nonfinite_steps_total", kind="loss") == 1
    assert value(snap, "nonfinite_steps_total", kind="grad") == 0
    assert value(snap, "step_total") == 20
    assert value(snap, "loss") == pytest.approx(losses[-1], rel=1e-7)
    finite = [v for v in losses if math.isfinite(v)]
    assert value(snap, "loss_window_max") == pytest.approx(max(finite), rel=1e-7)
    assert value(snap, "loss_window_mean") == pytest.approx(sum(finite) / len(finite), rel=1e-6)
    assert value(snap, "guard_trips_total", guard="nonfinite_loss") == 1
    assert value(snap, "guard_active", guard="nonfinite_loss") == 0  # step 20 is finite again
    patrol.close()


def test_window_statistics_and_grad_norm_max(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, window=4, guard_actions={})
    losses = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25]
    norms = [1.0, 9.0, 2.0, 3.0, 0.5, math.inf]
    run_scripted(patrol, losses, grad_norms=norms)
    snap = patrol._report.snapshot()
    assert value(snap, "loss_window_mean") == (2.0 + 1.0 + 0.5 + 0.25) / 4
    assert value(snap, "loss_window_max") == 2.0
    assert value(snap, "grad_norm_window_max") == 3.0  # the Inf is counted, not maxed
    assert value(snap, "nonfinite_steps_total", kind="grad") == 1
    assert absent(snap, "grad_norm")  # last grad norm is Inf: not exported as a number
    assert value(snap, "samples_total") == 6 * 8
    patrol.close()


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, grad_accum_steps=4, guard_actions={})
    micro = [1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]
    run_scripted(patrol, micro)
    snap = patrol._report.snapshot()
    assert value(snap, "micro_step_total") == 8
    assert value(snap, "step_total") == 2
    assert value(snap, "loss") == 25.0  # the mean of the second optimizer step's micro-losses
    assert value(snap, "loss_window_max") == 25.0
    assert [r.loss for r in patrol._history.records] == [2.5, 25.0]
    assert snap["histogram"]["counts"][-1] == 2
    patrol.close()


def test_foreach_grad_norm_matches_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
    model[1].to(torch.float64)
    x = torch.randn(4, 16)
    loss = model[1](model[0](x).double()).sum()
    loss.backward()
    reference = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    cfg = PatrolConfig(run="gn", checkpoint_dir=str(tmp_path), agent_url="http://127.0.0.1:9",
                       embedded_agent=False, guard_actions={},
                       push_interval_seconds=3600)
    patrol = Patrol(model=model, config=cfg)
    patrol.step(loss)
    assert value(patrol._report.snapshot(), "grad_norm") == pytest.approx(float(reference), rel=1e-6)
    patrol.close()


def test_learning_rate_per_param_group_and_validation_loss(tmp_path: Path) -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": a.parameters(), "lr": 0.5}, {"params": b.parameters(), "lr": 0.25}])
    cfg = PatrolConfig(run="lr", checkpoint_dir=str(tmp_path), agent_url="http://127.0.0.1:9",
                       embedded_agent=False, push_interval_seconds=3600)
    patrol = Patrol(optimizer=opt, config=cfg, device="cpu")
    patrol.step(torch.tensor(1.0))
    patrol.evaluate(torch.tensor(0.75))
    snap = patrol._report.snapshot()
    assert value(snap, "learning_rate", param_group="0") == 0.5
    assert value(snap, "learning_rate", param_group="1") == 0.25
    assert value(snap, "validation_loss") == 0.75
    patrol.close()


def test_amp_skipped_steps_and_loss_scale(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    cfg = PatrolConfig(run="amp", checkpoint_dir=str(tmp_path), agent_url="http://127.0.0.1:9",
                       embedded_agent=False, guard_actions={},
                       push_interval_seconds=3600)
    patrol = Patrol(model=model, optimizer=opt, scaler=scaler, config=cfg)
    for i in range(4):
        loss = model(torch.ones(2, 4)).sum() * (math.nan if i == 1 else 1.0)
        scaler.scale(loss).backward()
        patrol.step(loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    patrol.close()
    snap = patrol._report.snapshot()
    assert value(snap, "amp_skipped_steps_total") == 1
    assert value(snap, "amp_loss_scale") == 512.0
    assert value(snap, "nonfinite_steps_total", kind="loss") == 1


class TimedDataset(Dataset[torch.Tensor]):
    """40 numbers, each taking ITEM_SECONDS of the scripted clock to read."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        self.clock.now += ITEM_SECONDS
        return torch.tensor(float(index))


ITEM_SECONDS = 0.001


def test_dataloader_audit_and_wait_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = script_perf_counter(monkeypatch)
    patrol = scripted_patrol(tmp_path, guard_actions={})
    data = DataLoader(TimedDataset(clock), batch_size=4, num_workers=0)
    for x in patrol.loader(data):
        clock.now += 0.006  # the step's compute
        patrol.step(x.mean(), batch_size=len(x))
    snap = patrol._report.snapshot()
    assert value(snap, "dataloader_warning", check="num_workers_zero") == 1
    assert value(snap, "dataloader_warning", check="pin_memory_off") == 0  # CPU: pinning is irrelevant
    info = next(s for s in snap["samples"] if s["name"] == "trainpatrol_dataloader_info")["labels"]
    assert info == {"num_workers": "0", "pin_memory": "false", "persistent_workers": "false",
                    "prefetch_factor": "", "batch_size": "4"}
    # a batch is 4 reads of 1 ms, then 6 ms of compute: 4 ms of every 10 ms step, 10 batches in all
    assert value(snap, "loader_wait_ratio") == pytest.approx(0.4, rel=1e-9)
    assert value(snap, "loader_wait_seconds_total") == pytest.approx(10 * 0.004, rel=1e-9)
    assert value(snap, "step_total") == 10
    patrol.close()


class ScriptedAllocator:
    """Stands in for the CUDA allocator on CPU: allocated grows 1 MiB per read (a leak); from
    ``fragmented_from`` on, reserved is twice the peak and the allocator has retried twice."""

    def __init__(self, reserved: float, fragmented_from: int = 10**9) -> None:
        self.reads = 0
        self.reserved = reserved
        self.fragmented_from = fragmented_from

    def __call__(self) -> MemoryReading:
        self.reads += 1
        allocated = 4 * GIB + self.reads * 2**20
        reserved = self.reserved if self.reads < self.fragmented_from else allocated / 0.5
        return MemoryReading(allocated=allocated, reserved=reserved, active=allocated, inactive_split=2**20,
                             peak_allocated=allocated,
                             alloc_retries=2.0 if self.reads >= self.fragmented_from else 0.0, ooms=0.0,
                             capacity=80 * GIB)



def test_allocator_metrics_leak_slope_and_fragmentation_guard(tmp_path: Path) -> None:
    reader = ScriptedAllocator(reserved=5 * GIB, fragmented_from=8)
    patrol = scripted_patrol(tmp_path, memory_reader=reader, memory_interval_seconds=0.0, guard_actions={})
    run_scripted(patrol, [1.0] * 10)
    snap = patrol._report.snapshot()
    allocated = 4 * GIB + 10 * 2**20
    assert value(snap, "cuda_memory_allocated_bytes") == allocated
    assert value(snap, "cuda_memory_reserved_bytes") == allocated / 0.5
    assert value(snap, "cuda_memory_fragmentation_ratio") == 0.5
    assert value(snap, "cuda_memory_used_ratio") == allocated / (80 * GIB)
    assert value(snap, "cuda_alloc_retries_total") == 2
    assert value(snap, "cuda_memory_capacity_bytes") == 80 * GIB
    assert value(snap, "cuda_memory_baseline_slope_bytes_per_step") == pytest.approx(2**20, rel=1e-9)
    assert value(snap, "cuda_memory_peak_allocated_bytes") == allocated
    assert value(snap, "guard_trips_total", guard="memory_fragmentation") == 1
    assert value(snap, "guard_active", guard="memory_fragmentation") == 1
    assert value(snap, "guard_trips_total", guard="oom_risk") == 0
    patrol.close()


def test_memory_is_sampled_on_a_time_budget(tmp_path: Path) -> None:
    reader = ScriptedAllocator(reserved=5 * GIB)
    patrol = scripted_patrol(tmp_path, memory_reader=reader, memory_interval_seconds=3600.0)
    run_scripted(patrol, [1.0] * 50)
    assert reader.reads == 1
    patrol.close()


def test_loss_spike_and_grad_explosion_guards(tmp_path: Path) -> None:
    guards = GuardConfig(min_steps=5, loss_spike_factor=4.0, grad_norm_factor=10.0, grad_norm_ceiling=1e6)
    patrol = scripted_patrol(tmp_path, guards=guards, guard_actions={})
    losses = [1.0] * 10 + [5.0] + [1.0] * 5
    norms = [2.0] * 12 + [25.0] + [2.0] * 3
    run_scripted(patrol, losses, grad_norms=norms)
    snap = patrol._report.snapshot()
    assert value(snap, "guard_trips_total", guard="loss_spike") == 1
    assert value(snap, "guard_trips_total", guard="grad_norm_explosion") == 1
    assert value(snap, "guard_trips_total", guard="nonfinite_loss") == 0
    patrol.close()


@pytest.mark.parametrize("action", [None, "checkpoint"])
def test_loss_stagnation_trips_on_a_flat_loss_and_not_on_a_falling_one(tmp_path: Path, action: str | None) -> None:
    """Judged on the last 40 finite losses, though the step being judged has no loss yet; with an
    action configured the steps are folded one by one, without it in batches."""
    guards = GuardConfig(min_steps=5, stagnation_steps=40, stagnation_min_improvement=0.01, median_refresh_steps=4)
    patrol = scripted_patrol(tmp_path, guards=guards,
                             guard_actions={"loss_stagnation": action} if action else {})
    run_scripted(patrol, [2.0 - 0.02 * i for i in range(60)])  # falling 1 % a step: never stagnant
    snap = patrol._report.snapshot()
    assert value(snap, "guard_trips_total", guard="loss_stagnation") == 0
    run_scripted(patrol, [0.8] * 60)  # flat: the older half no longer beats the newer one
    snap = patrol._report.snapshot()
    assert value(snap, "guard_trips_total", guard="loss_stagnation") == 1
    assert value(snap, "guard_active", guard="loss_stagnation") == 1
    if action:
        assert [a.action for a in patrol.actions] == ["checkpoint"]  # carried out at the next boundary
    patrol.close()


def test_oom_writes_evidence_and_reraises(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, guard_actions={})
    with pytest.raises(torch.OutOfMemoryError), patrol:
        run_scripted(patrol, [1.0, 2.0, 3.0])
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    bundles = list((tmp_path / "evidence").glob("*-step00000003-oom"))
    assert len(bundles) == 1
    manifest = json.loads((bundles[0] / "manifest.json").read_text())
    assert manifest["action"] == "oom" and manifest["step"] == 3
    history = json.loads((bundles[0] / "rank-00000" / "history.json").read_text())
    assert [h["loss"] for h in history] == [1.0, 2.0, 3.0]
    assert "Tried to allocate" in (bundles[0] / "rank-00000" / "extra.json").read_text()
    assert (bundles[0] / "rank-00000" / "stacks.txt").read_text().startswith("Thread")
    assert patrol.state == "closed"


def test_rank_info_and_overhead_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = script_perf_counter(monkeypatch)

    def allocator_read() -> None:
        """The probe's own work in every step: 2 ms, finding no allocator."""
        clock.now += 0.002

    patrol = scripted_patrol(tmp_path, guard_actions={}, window=20, memory_reader=allocator_read,
                             memory_interval_seconds=0.0)
    for _ in range(30):
        clock.now += 0.098  # the training step's own work
        patrol.step(torch.tensor(1.0))
    patrol._publisher.stop(final_push=False)  # its thread's CPU time is scripted below
    patrol._publisher.cpu_seconds = 0.0
    snap = patrol._report.snapshot()
    info = next(s for s in snap["samples"] if s["name"] == "trainpatrol_rank_info")["labels"]
    assert info["device"] == "cpu" and info["world_size"] == "1" and info["torch_version"] == torch.__version__
    # the window's 20 steps each last 98 ms of training and 2 ms of probe
    assert value(snap, "probe_overhead_ratio") == pytest.approx(0.002 / 0.1, rel=1e-9)
    # the publisher thread's CPU seconds per second are added: 0.5 s of it over the next 2 s
    patrol._publisher.cpu_seconds = 0.5
    clock.now += 2.0
    assert value(patrol._report.snapshot(), "probe_overhead_ratio") == pytest.approx(0.002 / 0.1 + 0.25, rel=1e-9)
    patrol.close()
