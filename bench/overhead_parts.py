"""Which part of Patrol costs what on one case: variants of the Patrol loop side by side in one process.

    python bench/overhead_parts.py [--case gpt-10ms-bf16-8x512] [--reps 49] [--profile]

Variants (paired medians over the bare loop, as in bench/overhead.py): ``full`` (optimizer hooked, the
non-finite skip on), ``noskip`` (hooked, skip off), ``nohooks`` (no optimizer given: no step hooks),
``nopub`` (a second Patrol whose publisher pushes once an hour), ``bare2`` (the noise floor). Guards only
record here, so a spike in the shared model never pauses the benchmark. Also the cost of one snapshot
(what the publisher thread builds once a second) and of one host-memory read.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

import overhead as ov

from trainpatrol import Patrol, PatrolConfig

VARIANTS = ["bare", "full", "noskip", "nohooks", "nopub", "bare2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", default="gpt-10ms-bf16-8x512", choices=sorted(ov.CASES))
    ap.add_argument("--reps", type=int, default=49)
    ap.add_argument("--port", type=int, default=9471)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of 150 full steps")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = ov.CASES[args.case]
    torch.manual_seed(0)
    model = case.build(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    batches = [case.batch(dev) for _ in range(32)]
    agent = ov._agent(args.port)
    time.sleep(3)

    def patrol(run: str, interval: float) -> Patrol:
        return Patrol(model=model, config=PatrolConfig(
            run=run, agent_url=f"http://127.0.0.1:{args.port}", embedded_agent=False,
            checkpoint_dir="/tmp/trainpatrol-bench/ckpt", evidence_dir="/tmp/trainpatrol-bench/ev",
            push_interval_seconds=interval, guard_actions={}))

    pushing, quiet = patrol("parts-a", 1.0), patrol("parts-b", 3600.0)

    def timed(variant: str, n: int) -> float:
        p = None if variant.startswith("bare") else quiet if variant == "nopub" else pushing
        if p is not None:
            p.config.skip_nonfinite_updates = variant != "noskip"
            p.optimizer = None if variant == "nohooks" else opt
        try:
            return ov.run_variant("patrol" if p else "bare", model, opt, case, batches, n, p, dev)
        finally:
            if p is not None:
                p.optimizer = None

    for v in VARIANTS:
        timed(v, 50)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for v in VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]:
            times[v].append(timed(v, case.steps))
    out = {
        "benchmark": "overhead_parts", "case": case.name, "device": str(dev), "reps": args.reps,
        "step_ms": {v: round(statistics.median(t) * 1e3, 4) for v, t in times.items()},
        "paired_pct": {v: round(statistics.median(100 * (t / b - 1) for t, b in zip(times[v], times["bare"],
                                                                                   strict=True)), 3)
                       for v in VARIANTS[1:]},
    }
    snaps = []
    for _ in range(50):
        start = time.perf_counter()
        pushing.snapshot()
        snaps.append(time.perf_counter() - start)
    out["snapshot_ms_median"] = round(statistics.median(snaps) * 1e3, 3)
    start = time.perf_counter()
    pushing.host_memory.read([])
    out["host_memory_read_ms"] = round((time.perf_counter() - start) * 1e3, 3)
    print(json.dumps(out))
    if args.profile:
        pushing.optimizer = opt
        prof = cProfile.Profile()
        prof.enable()
        ov.run_variant("patrol", model, opt, case, batches, 150, pushing, dev)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue(), file=sys.stderr)
    pushing.close()
    quiet.close()
    if agent is not None:
        agent.terminate()


if __name__ == "__main__":
    main()
