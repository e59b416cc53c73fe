"""What handing a fused AdamW the ``found_inf`` flag adds to its step's host time, back to back (warm).

Patrol's non-finite skip hands torch's fused optimizer a device flag; torch then spends host time on it (one
``_foreach_sub_`` over the step counts) outside Patrol's code. Per case: the optimizer step's host time with and
without the flag (interleaved, median), the same subtraction timed on three kinds of stand-in, and the ops the flag
adds to ten steps (``torch.profiler``). In the training loop the same work costs more, and what Patrol counts for it
(``probe/flag_cost.py``) is taken there: ``bench/optimizer_step.py`` compares the two.

    python bench/flag_cost.py [CASE ...]        # CUDA only; cases: gpt-5ms, gpt-10ms, gpt2-124m
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from overhead import GPT

SHAPES = {"gpt-5ms": (2, 256, 4, 128), "gpt-10ms": (4, 512, 8, 256), "gpt2-124m": (12, 768, 12, 1024)}


def subtract_us(steps: list[torch.Tensor], flag: torch.Tensor) -> float:
    """Median host µs of the subtraction torch runs when handed the flag, back to back."""
    torch._foreach_sub_(steps, [flag] * len(steps))
    took = []
    for _ in range(201):
        start = time.perf_counter()
        torch._foreach_sub_(steps, [flag] * len(steps))
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1e6


def case(layers: int, dim: int, heads: int, seq: int, device: torch.device) -> dict[str, object]:
    model = GPT(layers, dim, heads, seq=seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model(torch.randint(0, 50257, (2, seq), device=device)).float().mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    flag = torch.zeros((), device=device)
    for _ in range(20):
        opt.step()
    torch.cuda.synchronize()
    plain, flagged = [], []
    for i in range(600):  # interleaved, so drift on the host lands on both
        opt.found_inf = flag if i % 2 else None  # type: ignore[attr-defined]
        start = time.perf_counter()
        opt.step()
        (flagged if i % 2 else plain).append(time.perf_counter() - start)
        if i % 50 == 0:
            torch.cuda.synchronize()  # keep the queue short: a blocked launch would time the device
    opt.found_inf = None  # type: ignore[attr-defined]
    n = len(params)
    counts = [opt.state[p]["step"] for p in params]
    step_plain, step_flag = statistics.median(plain) * 1e6, statistics.median(flagged) * 1e6
    result: dict[str, object] = {
        "params": n, "step_us_plain": step_plain, "step_us_flag": step_flag, "step_added_us": step_flag - step_plain,
        "sub_views_us": subtract_us(list(torch.zeros(n, device=device).unbind()), flag),
        "sub_separate_us": subtract_us([torch.zeros((), device=device) for _ in range(n)], flag),
        "sub_real_clones_us": subtract_us([c.clone() for c in counts], flag),
        "step_dtype": str(counts[0].dtype), "step_device": str(counts[0].device),
    }
    per_step: dict[str, dict[str, list[float]]] = {}
    for label, found_inf in (("plain", None), ("flag", flag)):
        opt.found_inf = found_inf  # type: ignore[attr-defined]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                opt.step()
            torch.cuda.synchronize()
        per_step[label] = {e.key: [e.count, round(e.cpu_time_total / 10, 1)] for e in prof.key_averages()
                           if e.count >= 10}
    opt.found_inf = None  # type: ignore[attr-defined]
    result["ops_added"] = {k: v for k, v in per_step["flag"].items()  # [calls in 10 steps, host µs a step]
                           if per_step["plain"].get(k, [None])[0] != v[0]}
    return result


def main() -> None:
    device = torch.device("cuda")
    names = sys.argv[1:] or list(SHAPES)
    print(json.dumps({name: case(*SHAPES[name], device) for name in names}, indent=1))


if __name__ == "__main__":
    main()
