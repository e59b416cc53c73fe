"""One rank of a tiny real CPU training run with Patrol, a NaN injected at a known step.

Run as ``python train_ranks.py --rank R --world-size N --port P --workdir DIR --agent-url URL``.
Ranks agree through torch.distributed (gloo). The model is DDP-wrapped, so the NaN loss injected on
one rank poisons every rank's gradients, as in a real job; the local guard pauses the run, and the
test (the operator) resumes it through the agent.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.demo import SimulatedAllocator


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--agent-url", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--nan-at", type=int, default=30)
    ap.add_argument("--nan-rank", type=int, default=1)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world_size)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(args.rank)
    x = torch.randn(1024, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    work = Path(args.workdir)
    cfg = PatrolConfig(run="report-test", agent_url=args.agent_url, embedded_agent=False,
                       checkpoint_dir=str(work / "ckpt"), evidence_dir=str(work / "evidence"),
                       push_interval_seconds=0.2, memory_reader=SimulatedAllocator(), memory_interval_seconds=0.0,
                       control_target_seconds=0.05, pause_timeout_seconds=120.0)
    with Patrol(model=model, optimizer=opt, config=cfg) as patrol:
        while patrol.step_count < args.steps:
            for xb, yb in patrol.loader(loader):
                step = patrol.step_count + 1
                if step > args.steps:
                    break
                loss = nn.functional.mse_loss(model(xb), yb)
                if step == args.nan_at and args.rank == args.nan_rank:
                    loss = loss * math.nan
                opt.zero_grad(set_to_none=True)
                loss.backward()
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                patrol.step(loss, grad_norm=total, batch_size=xb.shape[0])
                if step != args.nan_at:  # the NaN step is skipped, as GradScaler would skip it
                    opt.step()
                time.sleep(0.004)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
