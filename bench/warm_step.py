"""What ``patrol.step`` and the optimizer hooks cost the host warm, in a tight loop, beside one kernel launch.

In the training loop the same calls cost several times as much (``bench/overhead.py``'s split, py-spy): their code
and data are cold each step. This bench gives the warm side of that comparison on the same kind of host: a 24-layer
MLP (48 parameters, like the small GPT cases), a fused AdamW whose hooks run as ``optimizer.step()`` runs them (pre,
then post, without the update), fresh loss and grad-norm tensors each call as a loop makes them (their clones timed
alone and taken off), folds of the device ring included. Training-thread CPU time, the median of the repetitions.

    python bench/warm_step.py [--device cuda|cpu] [--calls 5000] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from overhead import launch_us

from trainpatrol import Patrol, PatrolConfig


def cpu_us_per_call(call: Callable[[], None], device: torch.device, calls: int, reps: int) -> float:
    for _ in range(calls // 10):
        call()
    runs = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.thread_time()
        for _ in range(calls):
            call()
        runs.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(24)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model(torch.randn(2, 16, device=device)).sum().backward()
    patrol = Patrol(model=model, optimizer=opt, config=PatrolConfig(
        run="warm-step", agent_url="http://127.0.0.1:9", embedded_agent=False, checkpoint_dir="/tmp/tp-warm-step/ck",
        evidence_dir="/tmp/tp-warm-step/ev", guard_actions={}, push_interval_seconds=3600))
    loss, norm = torch.tensor(2.0, device=device), torch.tensor(1.0, device=device)
    pre, post = opt._optimizer_step_pre_hooks.values(), opt._optimizer_step_post_hooks.values()

    def clones() -> None:
        loss.clone(), norm.clone()

    def step() -> None:
        patrol.step(loss.clone(), grad_norm=norm.clone(), batch_size=8, tokens=1024)
        for hook in pre:
            hook(opt, (), {})
        for hook in post:
            hook(opt, (), {})

    try:
        base = cpu_us_per_call(clones, device, args.calls, args.reps)
        with_patrol = cpu_us_per_call(step, device, args.calls, args.reps)
    finally:
        patrol.close()
    print(json.dumps({"benchmark": "warm_step", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                      else platform.processor() or "cpu", "torch": torch.__version__,
                      "python": platform.python_version(), "calls": args.calls, "reps": args.reps,
                      "patrol_us_per_call": round(with_patrol - base, 2), "clones_us": round(base, 2),
                      "kernel_launch_us": round(launch_us(device), 2) if device.type == "cuda" else None}, indent=2))


if __name__ == "__main__":
    main()
