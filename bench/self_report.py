"""How much of what Patrol adds to the training thread its own ``trainpatrol_probe_overhead_ratio`` counts.

``bench/overhead.py`` measures the README path over a DataLoader with workers; on a small shared host the
workers, torch's threads and the agent move each epoch by several percent, more than Patrol costs. This bench
keeps the training thread alone: a small MLP on one torch thread, batches from a list in memory, the README loop
(``patrol.loader``, ``patrol.step(loss, grad_norm=total, batch_size=B)``, AdamW), so the thread's CPU time per
step is the step, and Patrol's share of a cheap step is large enough to read.

Each repetition runs the variants in a shuffled order (seeded), one epoch each: ``--warmup`` untimed steps, then
``--steps`` timed ones. ``bare`` and ``bare_again`` run the loop alone (their difference is the noise floor);
``patrol`` is the README loop; ``patrol_without_loader`` iterates the list itself (Patrol acts from its hook
after ``optimizer.step()``); ``patrol_without_optimizer`` also gives Patrol no optimizer (no hooks). A fresh
Patrol is built before its epoch and closed after, untimed; a real agent takes its pushes.

Reported per variant: the paired medians of the wall and CPU time it adds a step, and what Patrol counted a step
(its ``probe_seconds`` over the timed steps, the training thread's part of the ratio); ``counted_share`` is the
counted time over the added CPU time.

    python bench/self_report.py [--device cpu|cuda] [--reps 12] [--steps 1500] [--dim 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from overhead import _agent
from torch import nn

from trainpatrol import Patrol, PatrolConfig

VARIANTS = ["bare", "patrol", "patrol_without_loader", "patrol_without_optimizer", "bare_again"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dim", type=int, default=32, help="the MLP's width: the smaller, the cheaper the step")
    ap.add_argument("--port", type=int, default=9472)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, args.dim), nn.ReLU(), nn.Linear(args.dim, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batches = [(torch.randn(16, args.dim, device=device), torch.randn(16, 1, device=device))
               for _ in range(args.warmup + args.steps)]

    def epoch(source: Iterable[Any], patrol: Patrol | None) -> tuple[float, float]:
        """Wall and training-thread CPU seconds per timed step."""
        for i, (x, y) in enumerate(source):
            if i == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                wall, cpu = time.perf_counter(), time.thread_time()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if patrol is not None:
                patrol.step(loss, grad_norm=total, batch_size=16)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - wall) / args.steps, (time.thread_time() - cpu) / args.steps

    def run(variant: str) -> tuple[float, float, float]:
        """(wall, CPU, Patrol's counted seconds) per timed step."""
        gc.collect()
        if variant.startswith("bare"):
            return (*epoch(batches, None), 0.0)
        cfg = PatrolConfig(run="self-report", agent_url=f"http://127.0.0.1:{args.port}", embedded_agent=False,
                           checkpoint_dir="/tmp/trainpatrol-bench/ckpt", evidence_dir="/tmp/trainpatrol-bench/ev",
                           guard_actions={})
        patrol = Patrol(model=model, optimizer=None if variant == "patrol_without_optimizer" else opt, config=cfg)
        try:
            wall, cpu = epoch(batches if "without" in variant else patrol.loader(batches), patrol)
            patrol._recorder.fold_in()
            timed = list(patrol._history.records)[-args.steps:]
            return wall, cpu, sum(r.probe_seconds for r in timed) / len(timed)
        finally:
            patrol.close()

    agent = _agent(args.port)
    time.sleep(2.0 if agent else 0)
    runs: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    order = random.Random(0)
    try:
        for v in VARIANTS[1:-1]:  # one untimed epoch of each Patrol variant first
            run(v)
        for _ in range(args.reps):
            for v in order.sample(VARIANTS, len(VARIANTS)):
                runs[v].append(run(v))
    finally:
        if agent is not None:
            agent.terminate()

    def added(v: str, field: int) -> float:
        return statistics.median(a[field] - b[field] for a, b in zip(runs[v], runs["bare"], strict=True)) * 1e6

    results: dict[str, Any] = {}
    for v in VARIANTS[1:]:
        counted = statistics.median(r[2] for r in runs[v]) * 1e6
        cpu = added(v, 1)
        results[v] = {"added_wall_us": round(added(v, 0), 2), "added_cpu_us": round(cpu, 2),
                      "counted_us": round(counted, 2), "counted_share": round(counted / cpu, 3) if cpu > 0 else None}
    print(json.dumps({
        "benchmark": "self_report", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "reps": args.reps, "steps": args.steps, "dim": args.dim,
        "bare_step_us": round(statistics.median(r[0] for r in runs["bare"]) * 1e6, 1),
        "bare_cpu_us": round(statistics.median(r[1] for r in runs["bare"]) * 1e6, 1), "variants": results},
        indent=2))


if __name__ == "__main__":
    main()
