"""A CPU rank's compute time counts its forward and backward, not its wait for data nor an evaluation between
steps: with a loader that takes 0.1 s a batch and a forward of 0.05 s, compute is about 0.05 s a step while a step
takes about 0.2 s."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from trainpatrol import Patrol, PatrolConfig


class Slow(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.1)
        return torch.ones(4)


def test_compute_time_leaves_out_the_wait_for_data(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    patrol = Patrol(model=model, optimizer=opt, config=PatrolConfig(
        run="compute", agent_url="http://127.0.0.1:9", embedded_agent=False, checkpoint_dir=str(tmp_path / "ckpt"),
        evidence_dir=str(tmp_path / "evidence"), push_interval_seconds=3600, guard_actions={}))
    for x in patrol.loader(DataLoader(Slow(), batch_size=1)):
        loss = model(x).pow(2).mean()
        time.sleep(0.05)
        loss.backward()
        patrol.step(loss)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation, then other host work, before the next batch
            model(x)
        time.sleep(0.05)
    totals = patrol._totals
    patrol.close()
    assert totals.steps == 12
    assert 0.045 <= totals.compute / 12 <= 0.09, totals.compute
    assert totals.step_sum / 11 >= 0.14 and totals.loader_wait / 12 >= 0.095
