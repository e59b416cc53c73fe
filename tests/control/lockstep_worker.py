"""One rank of a 4-rank gloo DDP job under torchrun, training through ``patrol.loader`` over a shuffled
DataLoader. HANG_RANK blocks in its data loading at step HANG_AT for HANG_SECONDS while the others go on into
the gradient all-reduce; SLOW_LOADER makes every rank's loader slow but steady; FORWARD_SECONDS is each
rank's forward time, SLOW_RANK's 30 % longer. CHECKPOINT_AT: rank 0 asks for a checkpoint after that step, and
EVIDENCE_HANG_RANK's write of that action's evidence takes HANG_SECONDS (a stuck filesystem) while the other ranks
wait for it to agree on the outcome; ACTION_STALL_SECONDS is ``PatrolConfig.action_stall_seconds``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.control import evidence


class Batches(Dataset[torch.Tensor]):
    def __init__(self, rank: int) -> None:
        self.rank, self.served = rank, 0
        self.hang_at = int(os.environ.get("HANG_AT", "0")) if rank == int(os.environ.get("HANG_RANK", "-1")) else 0
        self.data = torch.randn(4096, 16, generator=torch.Generator().manual_seed(rank))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        self.served += 1
        if self.hang_at and self.served == self.hang_at * 8 + 1:  # the first sample of batch hang_at + 1
            time.sleep(float(os.environ["HANG_SECONDS"]))
        time.sleep(float(os.environ.get("SLOW_LOADER", "0")) / 8)
        return self.data[i]


def stall_evidence_writes(seconds: float) -> None:
    """This rank's evidence for an action takes ``seconds`` to write, inside Patrol's writer (its stall captures do
    not)."""
    write = evidence._json

    def slow(path: Path, value: Any) -> None:
        if path.name == "history.json" and not path.parent.parent.name.startswith("stall-"):
            time.sleep(seconds)
        write(path, value)

    evidence._json = slow


def main() -> None:
    rank = int(os.environ["RANK"])
    if rank == int(os.environ.get("EVIDENCE_HANG_RANK", "-1")):
        stall_evidence_writes(float(os.environ["HANG_SECONDS"]))
    out = Path(os.environ["OUT"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    patrol = Patrol(model=model, optimizer=opt, config=PatrolConfig(
        run=os.environ.get("RUN", "hang"), agent_url=os.environ["AGENT_URL"], embedded_agent=False,
        checkpoint_dir=str(out / "ckpt"), evidence_dir=str(out / "evidence"), push_interval_seconds=0.2,
        stall_seconds=3.0, guard_actions={},
        action_stall_seconds=float(os.environ.get("ACTION_STALL_SECONDS", "600"))))
    loader = DataLoader(Batches(rank), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    forward = float(os.environ.get("FORWARD_SECONDS", "0")) * (1.3 if rank == int(os.environ.get("SLOW_RANK", "-1"))
                                                                else 1.0)
    for step, x in enumerate(patrol.loader(loader), 1):
        loss = model(x).pow(2).mean()
        time.sleep(forward)
        loss.backward()
        patrol.step(loss, batch_size=8)
        opt.step()
        opt.zero_grad()
        if rank == 0 and step == int(os.environ.get("CHECKPOINT_AT", "0")):
            patrol.request("checkpoint", "asked by the test")
        if step == int(os.environ["STEPS"]):
            break
    patrol.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
