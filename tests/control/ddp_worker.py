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
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = PatrolConfig(run=os.environ.get("RUN", "ddp"), agent_url=os.environ["AGENT_URL"], embedded_agent=False,
                          checkpoint_dir=str(out / "ckpt"), evidence_dir=str(out / "evidence"),
                          push_interval_seconds=0.2, pause_poll_seconds=0.05, control_target_seconds=0.2,
                          guard_actions={"nonfinite_loss": "pause"})
    patrol = Patrol(model=model, optimizer=opt, config=config)
    nan_at = int(os.environ.get("NAN_AT", "0"))
    code = 0
    try:
        while True:
            patrol.boundary()
            time.sleep(0.005 + slow)
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            if nan_at and rank == 1 and patrol.step_count + 1 == nan_at:
                loss = loss * float("nan")
            loss.backward()
            patrol.step(loss, batch_size=8)
            opt.step()
            opt.zero_grad()
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        record = {"rank": rank, "exit": code, "steps": patrol.step_count,
                  "actions": [a.model_dump() for a in patrol.actions]}
        (out / f"rank-{rank}.json").write_text(json.dumps(record))
        patrol.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
