"""Host time per call on CUDA, for a launch-bound model where host time is step time.

    python bench/host_cost.py

Medians of bursts of 10 calls (a sync before each burst, none inside it): the fused AdamW step with and
without a ``found_inf`` flag (what the non-finite skip hands it), the kernels the skip adds, and
``Patrol.step`` with the skip on and off, alone and followed by the optimizer step. Prints JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

import overhead as ov

from trainpatrol import Patrol, PatrolConfig


def burst_us(fn: Callable[[], object], reps: int = 200, k: int = 10) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(k):
            fn()
        out.append((time.perf_counter() - start) / k)
    return round(statistics.median(out) * 1e6, 2)


def main() -> None:
    dev = torch.device("cuda")
    case = ov.CASES["gpt-10ms-bf16-8x512"]
    torch.manual_seed(0)
    model = case.build(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = case.batch(dev)
    loss = ov._loss(model, case, x, y)
    loss.backward()
    res: dict[str, float] = {"opt_step_plain_us": burst_us(opt.step)}
    flag = torch.zeros((), device=dev)

    def with_flag() -> None:
        opt.found_inf = flag  # type: ignore[attr-defined]
        opt.step()
        del opt.found_inf  # type: ignore[attr-defined]

    res["opt_step_found_inf_us"] = burst_us(with_flag)
    res["opt_step_plain_again_us"] = burst_us(opt.step)
    row, one = torch.zeros(3, device=dev), torch.ones((), device=dev)
    res["zero_us"] = burst_us(flag.zero_)
    res["amp_check_us"] = burst_us(lambda: torch._amp_foreach_non_finite_check_and_unscale_([row], flag, one))
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    res["stack_us"] = burst_us(lambda: torch.stack([loss.detach().reshape(()), total.detach().reshape(()), one],
                                                   out=row))
    for skip in (True, False):
        patrol = Patrol(model=model, config=PatrolConfig(
            run=f"host-cost-{skip}", agent_url="http://127.0.0.1:1", embedded_agent=False,
            push_interval_seconds=3600, guard_actions={}, skip_nonfinite_updates=skip))
        patrol.optimizer = opt

        def step_and_update(p: Patrol = patrol) -> None:
            p.step(loss, grad_norm=total, batch_size=8)
            opt.step()

        def step_only(p: Patrol = patrol) -> None:
            p.step(loss, grad_norm=total, batch_size=8)  # the next step's verdict replaces this one

        res[f"patrol_step_plus_opt_step_skip_{skip}_us"] = burst_us(step_and_update)
        res[f"patrol_step_only_skip_{skip}_us"] = burst_us(step_only)
        patrol.optimizer = None
        patrol.close()
    res["opt_step_plain_final_us"] = burst_us(opt.step)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
