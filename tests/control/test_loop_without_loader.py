"""A plain ``for batch in loader`` loop (no ``patrol.loader``, no ``boundary()``) still carries out actions."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from ddp_scenarios import record, state, wait_all
from resume_loops import config, mlp, mlp_loss, pause_then_stop, run_until_stopped
from test_ddp_same_step import WORKER

from servers import agent, free_port, holds_for, http_json, python_env, wait_for
from trainpatrol import STOP_EXIT_CODE, Patrol


def plain_loop(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(512, 8))
    while patrol.step_count < steps:
        for (x,) in torch.utils.data.DataLoader(data, batch_size=16, shuffle=True):
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            loss.backward()
            patrol.step(loss)
            opt.step()
            opt.zero_grad()
            time.sleep(0.002)


def test_pause_resume_and_stop_reach_a_loop_that_never_calls_boundary(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "plain"))
    result: list[int | None] = []
    t = threading.Thread(target=lambda: result.append(run_until_stopped(lambda: plain_loop(patrol, model, opt, 10**6))),
                         daemon=True)
    t.start()
    wait_for(lambda: patrol.step_count > 20, 30, what="training")
    patrol.request("pause", "operator")
    wait_for(lambda: patrol.state == "paused", 30, what="paused")
    paused_at = patrol.step_count
    holds_for(lambda: patrol.step_count == paused_at, 0.5, what="the pause")
    pause = next(a for a in patrol.actions if a.action == "pause")
    assert pause.step == paused_at and Path(pause.checkpoint).name == f"step-{paused_at:08d}"
    patrol.request("resume", "operator")
    wait_for(lambda: patrol.step_count > paused_at + 10, 30, what="resumed")
    patrol.request("stop", "operator")
    t.join(30)
    assert result == [STOP_EXIT_CODE]
    patrol.close()


def test_a_nan_pauses_a_loop_that_never_calls_boundary(tmp_path: Path) -> None:
    model, opt = mlp()
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path, "plain-nan"))

    def loop() -> None:
        for i in range(10**6):
            loss = mlp_loss(model) * (float("nan") if i == 30 else 1.0)
            loss.backward()
            patrol.step(loss)
            opt.step()
            opt.zero_grad()

    assert pause_then_stop(patrol, loop) == STOP_EXIT_CODE
    assert [(a.action, a.step) for a in patrol.actions] == [("pause", 31), ("stop", 31)]
    patrol.close()


def test_a_loop_without_optimizer_or_boundary_is_told_what_to_call(tmp_path: Path) -> None:
    patrol = Patrol(config=config(tmp_path, "nowhere"), device="cpu")
    patrol.step(torch.tensor(1.0))
    patrol.request("pause", "operator")
    with pytest.raises(RuntimeError, match=r"patrol\.loader\(\.\.\.\)"):
        patrol.step(torch.tensor(1.0))
    patrol.close()


def test_two_gloo_ranks_with_a_plain_loop_pause_at_one_step_and_stop(tmp_path: Path) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        port = str(free_port())
        procs = []
        for rank in range(2):
            env = python_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, AGENT_URL=url, OUT=str(tmp_path), RUN="plain2", LOOP="plain",
                             RECORD="plain", SLOW_RANK="1", SLOW_SECONDS="0.002")
            log = open(tmp_path / f"plain-{rank}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=log, stderr=subprocess.STDOUT))
        wait_for(lambda: len(state(url, "plain2")["ranks"]) == 2
                 and min(r["step"] for r in state(url, "plain2")["ranks"]) > 20, 120, what="2 ranks running")
        http_json(f"{url}/v1/runs/plain2/actions", {"action": "pause", "reason": "test"})
        wait_for(lambda: state(url, "plain2")["state"] == "paused", 60, what="both paused")
        steps = {r["step"] for r in state(url, "plain2")["ranks"]}
        assert len(steps) == 1
        paused_at = steps.pop()
        holds_for(lambda: {r["step"] for r in state(url, "plain2")["ranks"]} == {paused_at}, 0.5, what="the pause")
        http_json(f"{url}/v1/runs/plain2/actions", {"action": "resume", "reason": "test"})
        wait_for(lambda: min(r["step"] for r in state(url, "plain2")["ranks"]) > paused_at + 10, 60, what="resumed")
        http_json(f"{url}/v1/runs/plain2/actions", {"action": "stop", "reason": "test"})
        assert wait_all(procs) == [STOP_EXIT_CODE] * 2
    recs = [record(tmp_path, "plain", r) for r in range(2)]
    steps = [[(a["action"], a["step"]) for a in rec["actions"]] for rec in recs]
    assert steps[0] == steps[1]
    assert [a["action"] for a in recs[0]["actions"]] == ["pause", "resume", "stop"]
