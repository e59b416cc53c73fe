"""One rank of a CPU (gloo) DDP job with Patrol; records what it did to OUT/rank-R.json at exit."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainpatrol import Patrol, PatrolConfig


def main() -> int:
    rank = int(os.environ["RANK"])
    out = Path(os.environ["OUT"])
    slow = float(os.environ.get("SLOW_SECONDS", "0")) if rank == int(os.environ.get("SLOW_RANK", "-1")) else 0.0
    cuda = os.environ.get("DEVICE") == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    dim = 256 if cuda else 16
    net = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Linear(dim, 1)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    max_steps = int(os.environ.get("STEPS", "0"))
    stop_at = int(os.environ.get("STOP_AT", "0"))
    losses: dict[int, torch.Tensor] = {}
    config = PatrolConfig(run=os.environ.get("RUN", "ddp"), agent_url=os.environ["AGENT_URL"], embedded_agent=False,
                          checkpoint_dir=str(out / "ckpt"), evidence_dir=str(out / "evidence"),
                          push_interval_seconds=0.2, pause_poll_seconds=0.05, control_target_seconds=0.2,
                          guard_actions={"nonfinite_loss": "pause"})
    patrol = Patrol(model=model, optimizer=opt, config=config)
    if os.environ.get("RESTORE"):
        patrol.restore("latest")
    nan_at = int(os.environ.get("NAN_AT", "0"))
    code = 0

    def train_step(x: torch.Tensor) -> None:
        step = patrol.step_count + 1
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = (model(x).float() - x.sum(dim=1, keepdim=True) / dim).pow(2).mean()
        if nan_at and rank == 1 and patrol.step_count + 1 == nan_at:
            loss = loss * float("nan")
        loss.backward()
        patrol.step(loss, batch_size=8)
        opt.step()
        opt.zero_grad()
        losses[step] = loss.detach()
        if stop_at and step == stop_at and rank == 0:
            patrol.request("stop", f"test stop at {stop_at}")

    try:
        if os.environ.get("LOOP") == "plain":  # a shuffled DataLoader iterated directly: no patrol.loader or boundary()
            data = torch.utils.data.TensorDataset(torch.randn(4096, dim, generator=torch.Generator().manual_seed(rank)))
            while not max_steps or patrol.step_count < max_steps:
                for (x,) in torch.utils.data.DataLoader(data, batch_size=8, shuffle=True):
                    time.sleep(0.005 + slow)
                    train_step(x.to(device))
                    if max_steps and patrol.step_count >= max_steps:
                        break
        while not max_steps or patrol.step_count < max_steps:
            patrol.boundary()
            time.sleep(0.005 + slow)
            # data depends only on (rank, step), so a restored job sees the same batches
            g = torch.Generator().manual_seed(1000 * rank + patrol.step_count + 1)
            train_step(torch.randn(8, dim, generator=g).to(device))
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        record = {"rank": rank, "exit": code, "steps": patrol.step_count,
                  "actions": [a.model_dump() for a in patrol.actions],
                  "losses": {str(k): float(v) for k, v in losses.items()}}
        (out / f"{os.environ.get('RECORD', 'rank')}-{rank}.json").write_text(json.dumps(record))
        patrol.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
