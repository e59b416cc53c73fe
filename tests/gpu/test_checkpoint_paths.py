"""Checkpoints of a CUDA model on the GPU: a background checkpoint staged through pinned memory, and a
torch.distributed.checkpoint (DCP) checkpoint written in the loop or staged and written in the background,
each restored into a fresh model exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainpatrol import Patrol, PatrolConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda", 0)


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)).to(DEV)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def one_step(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 256, device=DEV)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    loss.backward()
    patrol.step(loss)
    opt.step()
    opt.zero_grad()


def train(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, until: int) -> None:
    while patrol.step_count < until:
        patrol.boundary()
        one_step(patrol, model, opt)


@pytest.mark.parametrize(("fmt", "background"), [("torch", True), ("dcp", False), ("dcp", True)])
def test_a_cuda_checkpoint_restores_the_state_of_its_step(tmp_path: Path, fmt: str, background: bool) -> None:
    cfg = PatrolConfig(run=f"gpu-{fmt}", agent_url="http://127.0.0.1:9", embedded_agent=False,
                       checkpoint_dir=str(tmp_path / "ckpt"), evidence_dir=str(tmp_path / "evidence"),
                       push_interval_seconds=3600, guard_actions={}, checkpoint_format=fmt,
                       background_checkpoints=background)
    model, opt = build(0)
    patrol = Patrol(model=model, optimizer=opt, config=cfg)
    train(patrol, model, opt, 20)
    patrol.request("checkpoint", "test")
    for _ in range(50):  # the boundary where the request is agreed on takes the state of the step before it
        step, at_step = patrol.step_count, {k: v.clone() for k, v in model.state_dict().items()}
        patrol.boundary()
        if patrol.actions or patrol._control.executor._writer is not None:
            break
        one_step(patrol, model, opt)
    train(patrol, model, opt, step + 20)  # the weights move on while a background write runs
    patrol.close()
    assert [(a.action, a.outcome, a.step) for a in patrol.actions][:1] == [("checkpoint", "ok", step)]

    model, opt = build(1)
    fresh = Patrol(model=model, optimizer=opt, config=cfg)
    assert fresh.restore("latest").step == step
    for k, v in model.state_dict().items():
        assert v.device == DEV and torch.equal(v, at_step[k]), k
    train(fresh, model, opt, step + 5)  # the restored optimizer steps on the GPU
    fresh.close()


def pinned_bytes() -> int:
    return int(torch.cuda.host_memory_stats().get("active_bytes.current", 0))


@pytest.mark.parametrize("background", [True, False])
def test_background_checkpoints_pin_their_host_memory_before_the_first_one_is_asked_for(tmp_path: Path,
                                                                                       background: bool) -> None:
    cfg = PatrolConfig(run="gpu-reserve", agent_url="http://127.0.0.1:9", embedded_agent=False,
                       checkpoint_dir=str(tmp_path / "ckpt"), evidence_dir=str(tmp_path / "evidence"),
                       push_interval_seconds=3600, guard_actions={}, background_checkpoints=background)
    model, opt = build(0)
    before = pinned_bytes()
    patrol = Patrol(model=model, optimizer=opt, config=cfg)
    train(patrol, model, opt, 5)
    state = sum(t.nbytes for t in model.state_dict().values()) + sum(
        t.nbytes for s in opt.state.values() for t in s.values() if t.is_cuda)
    for _ in range(500):  # bounded: pinning this small state takes milliseconds
        if pinned_bytes() - before >= state:
            break
        train(patrol, model, opt, patrol.step_count + 1)
    grown = pinned_bytes() - before
    patrol.close()
    assert not patrol.actions  # no checkpoint was asked for
    assert (grown >= state) is background, (grown, state, torch.cuda.host_memory_stats())
