"""Guard ranges on real workloads: what each guard's inputs read on a healthy run, and where a sick one trips.

Runs one case for a while with a Patrol whose guards judge but do not act (``guard_actions={}``), then
prints JSON: every guard's trip count, the range of the allocator readings Patrol took (fragmentation,
unusable-at-peak, inactive split, reserved, retries), and how close the loss and grad norm came to the
relative guards' thresholds (the largest value over the running median of the 100 steps before).

    python bench/guard_ranges.py --case gpt2-124m-bf16-16x1024 --seconds 300
    python bench/guard_ranges.py --case fragmented --seconds 60

``fragmented``: the 6-layer GPT on sequence lengths drawn from 128 to 2048 each step, with long-lived
tensors of random sizes kept between the activations (a cache with random eviction) and the process
capped at a fraction of the device, so freed blocks cannot serve the next sizes and the allocator
has to free its cache and retry.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from overhead import CASES, GPT, _loss

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe.guards import GuardConfig

GIB = 2.0**30


def relative_peaks(values: list[float], cfg: GuardConfig) -> float:
    """The largest value / running median of the ``median_window`` values before it (after ``min_steps``)."""
    worst = 0.0
    for i in range(cfg.min_steps, len(values)):
        window = [v for v in values[max(0, i - cfg.median_window):i] if math.isfinite(v)]
        med = statistics.median(window) if window else math.nan
        if med > 0 and math.isfinite(values[i]):
            worst = max(worst, values[i] / med)
    return worst


def run(case: str, seconds: float, device: torch.device) -> dict[str, Any]:
    rng = random.Random(0)
    torch.manual_seed(0)
    fragmented = case == "fragmented"
    if fragmented:
        torch.cuda.set_per_process_memory_fraction(0.1, device)
        model = GPT(6, 512, 8, seq=2048).to(device)
    else:
        c = CASES[case]
        model = c.build(device)
        batches = [c.batch(device) for _ in range(8)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    cfg = PatrolConfig(run=f"ranges-{case}", agent_url="http://127.0.0.1:9", embedded_agent=False,
                       push_interval_seconds=3600.0, guard_actions={}, memory_interval_seconds=0.25,
                       checkpoint_dir="/tmp/ranges/ckpt", evidence_dir="/tmp/ranges/ev")
    patrol = Patrol(model=model, optimizer=opt, config=cfg)
    readings: list[Any] = []
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    ooms = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        patrol.boundary()
        try:
            if fragmented:
                t = rng.randint(128, 2048)
                x = torch.randint(0, 50257, (8, t), device=device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(x)
                loss = F.cross_entropy(out.flatten(0, 1).float(), x.flatten())
                del out
                kept.append(torch.empty(rng.randint(1, 32) * 2**20, dtype=torch.uint8, device=device))
                if len(kept) > 80:
                    kept.pop(rng.randrange(len(kept)))
            else:
                x, y = batches[len(losses) % len(batches)]
                loss = _loss(model, CASES[case], x, y)
            loss.backward()
        except torch.OutOfMemoryError:
            ooms += 1
            opt.zero_grad(set_to_none=True)
            kept = kept[len(kept) // 2:]
            continue
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        patrol.step(loss, grad_norm=total, batch_size=x.shape[0])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        norms.append(total.detach())
        m = patrol._latest.memory
        if m is not None and (not readings or readings[-1] is not m):
            readings.append(m)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    patrol.close()
    loss_values = torch.stack(losses).float().cpu().tolist()
    norm_values = torch.stack(norms).float().cpu().tolist()
    g = cfg.guards

    def span(field: str, scale: float = 1.0) -> list[float]:
        values = [getattr(r, field) / scale for r in readings]
        return [round(min(values), 4), round(max(values), 4)] if values else []

    return {
        "case": case, "seconds": round(elapsed, 1), "steps": len(losses),
        "step_ms_mean": round(1e3 * elapsed / max(1, len(losses)), 2),
        "guard_trips": dict(patrol._guards.trips),
        "memory_reads": len(readings),
        "fragmentation_ratio": span("fragmentation"),
        "unusable_at_peak_gib": span("unusable_at_peak", GIB),
        "inactive_split_gib": span("inactive_split", GIB),
        "reserved_gib": span("reserved", GIB),
        "allocated_at_boundary_gib": span("allocated", GIB),
        "peak_allocated_gib": span("peak_allocated", GIB),
        "old_definition_reserved_minus_allocated_ratio": [
            round(min((r.reserved - r.allocated) / r.reserved for r in readings), 4),
            round(max((r.reserved - r.allocated) / r.reserved for r in readings), 4)] if readings else [],
        "alloc_retries": readings[-1].alloc_retries if readings else 0,
        "ooms_caught": ooms,
        "loss_first_last": [round(loss_values[0], 4), round(loss_values[-1], 4)],
        "max_loss_over_running_median": round(relative_peaks(loss_values, g), 3),
        "loss_spike_factor": g.loss_spike_factor,
        "max_grad_norm_over_running_median": round(relative_peaks(norm_values, g), 3),
        "grad_norm_factor": g.grad_norm_factor,
        "grad_norm_range": [round(min(norm_values), 4), round(max(norm_values), 4)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", required=True, choices=[*CASES, "fragmented"])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    result = run(args.case, args.seconds, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"benchmark": "guard_ranges", "device": name,
                      "torch": torch.__version__, **result}, indent=2))


if __name__ == "__main__":
    main()
