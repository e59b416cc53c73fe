"""What ``optimizer.step()`` costs on the host in the training loop, with each part of Patrol's non-finite skip.

A case of ``bench/overhead.py`` with its batches on the device, the README loop's body (its loss in bf16 autocast,
backward, ``clip_grad_norm_``, then the variant's own work, a timed fused AdamW step, ``zero_grad``).
The variants take turns in blocks of 40 steps (the first 5 of a block untimed), each block in a rotated order:

- ``bare`` and ``bare_again``: the loop alone (their difference is the noise floor);
- ``noop_hooks``: two step hooks that do nothing;
- ``flag``: the optimizer handed a ``found_inf`` flag of its own (a 0-dim zero tensor), as GradScaler does;
- ``flag_view``: the flag a view into a 16-slot buffer, as Patrol's ring keeps them;
- ``check_and_flag``: ``flag_view`` plus the check kernel on (loss, grad norm) into it, Patrol's verdict;
- ``patrol``: a fresh ``Patrol`` per block over ``patrol.loader`` with ``patrol.step(loss, grad_norm=...)``.

Reported per variant: the medians of the optimizer step's host time, of the step's host time and of the training
thread's CPU a step; for ``patrol`` also its self-report, its estimate of torch's work on the flag
(``probe/flag_cost.py``) and the CPU a step it adds over ``bare``.

    python bench/optimizer_step.py [--case gpt-5ms] [--blocks 30] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from overhead import CASES, Case, _loss, self_reported

from trainpatrol import Patrol, PatrolConfig

VARIANTS = ["bare", "bare_again", "noop_hooks", "flag", "flag_view", "check_and_flag", "patrol"]
BLOCK, SETTLE = 40, 5


class Loop:
    def __init__(self, case: Case, device: torch.device) -> None:
        torch.manual_seed(0)
        self.case, self.device = case, device
        self.model = case.build().to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        tensors, b = case.data(16 * case.batch).tensors, case.batch
        self.data = [[t[k * b:(k + 1) * b].to(device) for t in tensors] for k in range(16)]
        self.flags = torch.zeros(16, device=device)
        self.views = list(self.flags.unbind())
        self.flag = torch.zeros((), device=device)
        self.one = torch.ones((), device=device)
        self.steps = 0

    def loss(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = _loss(self.model, self.case, batch, self.device)
        loss.backward()
        return loss, torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def block(self, variant: str, patrol: Patrol | None) -> list[tuple[float, float, float]]:
        """(optimizer step, whole step, training-thread CPU) seconds of each timed step."""
        opt = self.opt
        hooks = [opt.register_step_pre_hook(lambda *a: None), opt.register_step_post_hook(lambda *a: None)] \
            if variant == "noop_hooks" else []
        batches = [self.data[(self.steps + k) % len(self.data)] for k in range(BLOCK)]
        source: Iterable[list[torch.Tensor]] = patrol.loader(batches) if patrol is not None else batches
        out = []
        wall, cpu = time.perf_counter(), time.thread_time()
        for batch in source:
            i = self.steps
            self.steps += 1
            loss, total = self.loss(batch)
            if variant == "flag":
                opt.found_inf = self.flag  # type: ignore[attr-defined]
            elif variant in ("flag_view", "check_and_flag"):
                flag = self.views[i % 16]
                if variant == "check_and_flag":
                    if i % 16 == 0:
                        self.flags.zero_()
                    torch._amp_foreach_non_finite_check_and_unscale_([loss.detach(), total.detach()], flag, self.one)
                opt.found_inf = flag  # type: ignore[attr-defined]
            elif patrol is not None:
                n = self.case.batch
                patrol.step(loss, grad_norm=total, batch_size=n, tokens=n * self.case.tokens or None)
            start = time.perf_counter()
            opt.step()
            took = time.perf_counter() - start
            if hasattr(opt, "found_inf") and patrol is None:
                del opt.found_inf
            opt.zero_grad(set_to_none=True)
            now, now_cpu = time.perf_counter(), time.thread_time()
            out.append((took, now - wall, now_cpu - cpu))
            wall, cpu = now, now_cpu
        for h in hooks:
            h.remove()
        return out[SETTLE:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), default="gpt-5ms")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    loop = Loop(CASES[args.case], device)
    for k in range(60):
        loop.loss(loop.data[k % len(loop.data)])
        loop.opt.step()
        loop.opt.zero_grad(set_to_none=True)
    sync()
    timed: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    reported: list[float] = []
    estimates: list[float] = []
    for b in range(args.blocks):
        for v in VARIANTS[b % len(VARIANTS):] + VARIANTS[:b % len(VARIANTS)]:
            patrol = None
            if v == "patrol":  # no agent: the pushes fail, untimed, on the publisher thread
                cfg = PatrolConfig(run="optimizer-step", agent_url="http://127.0.0.1:9", embedded_agent=False,
                                   checkpoint_dir="/tmp/trainpatrol-bench/ckpt",
                                   evidence_dir="/tmp/trainpatrol-bench/ev", guard_actions={})
                patrol = Patrol(model=loop.model, optimizer=loop.opt, config=cfg)
            timed[v] += loop.block(v, patrol)
            if patrol is not None:
                reported.append(self_reported(patrol))
                estimates.append(patrol._hooks.flag_cost.seconds)  # type: ignore[union-attr]
                patrol.close()
        sync()

    def us(v: str, field: int) -> float:
        return round(statistics.median(t[field] for t in timed[v]) * 1e6, 1)

    out: dict[str, Any] = {
        "benchmark": "optimizer_step", "case": args.case, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "blocks": args.blocks, "timed_steps_per_variant": len(timed["bare"]),
        "variants": {v: {"optimizer_step_us": us(v, 0), "step_us": us(v, 1), "step_cpu_us": us(v, 2)}
                     for v in VARIANTS},
        "patrol_self_reported": round(statistics.median(reported), 5),
        "patrol_flag_estimate_us": round(statistics.median(estimates) * 1e6, 1),
    }
    out["patrol_added_cpu_us"] = round(us("patrol", 2) - us("bare", 2), 1)
    out["noise_added_cpu_us"] = round(us("bare_again", 2) - us("bare", 2), 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
