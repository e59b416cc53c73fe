"""Probe overhead: bare loop vs Patrol loop vs seed-style naive telemetry, side by side in one process.

Repetitions alternate between the variants (rotating their order) and the report gives medians of
the per-step time and each variant's overhead over the bare loop, as JSON. A second bare loop
(``bare_again``) is timed like the others: its "overhead" is the noise floor of the run. Short
repetitions, many of them, resolve a small difference best on a noisy host, since drift then
cancels inside each repetition; each case sets its own.

    python bench/overhead.py --device cpu|cuda [--quick] [--case NAME] [--reps N]

Under ``torchrun --nproc-per-node 2 bench/overhead.py --ddp`` the model is wrapped in DDP and the
Patrol variant includes the lagged control-word exchange.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from trainpatrol import Patrol, PatrolConfig


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-shaped decoder; ``GPT(12, 768, 12)`` has about 124M parameters with the 50257 vocabulary."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int = 50257, seq: int = 1024) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


@dataclass
class Case:
    name: str
    build: Callable[[torch.device], nn.Module]
    batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    bf16: bool
    reps: int
    steps: int
    """Repetitions of each variant, and steps in each."""


def _tokens(b: int, t: int, vocab: int = 50257) -> Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]:
    def make(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, vocab, (b, t + 1), device=device)
        return x[:, :-1], x[:, 1:]
    return make


_TEACHER = torch.Generator().manual_seed(1234)
_TEACHER_W = torch.randn(256, 1, generator=_TEACHER) / 16


def _mlp_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy teacher, so the loss settles near the noise (0.01) instead of being memorised to ~1e-11,
    where loss-spike guards would trip on rounding noise and log."""
    x = torch.randn(64, 256, device=device)
    return x, torch.sin(x @ _TEACHER_W.to(device)) + 0.1 * torch.randn(64, 1, device=device)


CASES = {
    "gpt2-124m-bf16-16x1024": Case("gpt2-124m-bf16-16x1024", lambda d: GPT(12, 768, 12).to(d), _tokens(16, 1024),
                                   True, reps=11, steps=30),
    "gpt-10ms-bf16-8x512": Case("gpt-10ms-bf16-8x512", lambda d: GPT(6, 512, 8, seq=512).to(d), _tokens(8, 512),
                                True, reps=101, steps=10),
    "mlp-cpu": Case("mlp-cpu", lambda d: nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512),
                                                       nn.GELU(), nn.Linear(512, 1)).to(d), _mlp_batch, False,
                    reps=201, steps=20),
}
VARIANTS = ["bare", "patrol", "patrol_no_skip", "naive", "bare_again"]
"""``patrol_no_skip``: Patrol with ``skip_nonfinite_updates=False``, so the skip's own cost is the difference."""


def _loss(model: nn.Module, case: Case, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=case.bf16):
        out = model(x)
        if out.dim() == 3:
            return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        return F.mse_loss(out.float(), y)


def run_variant(variant: str, model: nn.Module, opt: torch.optim.Optimizer, case: Case, batches: list[Any],
                steps: int, patrol: Patrol | None, device: torch.device) -> float:
    """Seconds per step over ``steps`` steps (one device sync at the end of the block only)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        if patrol is not None:
            patrol.boundary()
        loss = _loss(model, case, x, y)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if variant.startswith("patrol"):
            assert patrol is not None
            patrol.step(loss, grad_norm=total, batch_size=x.shape[0])
        elif variant == "naive":
            loss.item()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.memory_stats()
            total.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _agent(port: int) -> subprocess.Popen[bytes] | None:
    """A real agent beside the benchmark, so the Patrol's publisher pushes as in production."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return None
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "exporter") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "trainpatrol", "agent", "--port", str(port), "--no-nvml"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench_case(case: Case, device: torch.device, quick: bool, agent_url: str, ddp: bool,
               push_interval: float, reps: int | None = None) -> dict[str, Any]:
    reps, steps, warmup = (5, 20, 5) if quick else (reps or case.reps, case.steps, 50)
    torch.manual_seed(0)
    model = case.build(device)
    if ddp:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    batches = [case.batch(device) for _ in range(32)]
    # guards only record: a trip would pause the benchmark, and the checks run all the same
    cfg = PatrolConfig(run=f"bench-{case.name}", agent_url=agent_url, embedded_agent=False,
                       checkpoint_dir="/tmp/trainpatrol-bench/ckpt", evidence_dir="/tmp/trainpatrol-bench/ev",
                       push_interval_seconds=push_interval, guard_actions={})
    patrol = Patrol(model=model, config=cfg)

    def timed(variant: str, n: int) -> float:
        # Patrol's optimizer hooks exist only while a Patrol variant runs, so the others run bare
        if variant.startswith("patrol"):
            patrol.config.skip_nonfinite_updates = variant == "patrol"
            patrol.optimizer = opt
        try:
            return run_variant(variant, model, opt, case, batches, n,
                               patrol if variant.startswith("patrol") else None, device)
        finally:
            patrol.optimizer = None

    for v in ("bare", "patrol", "patrol_no_skip"):
        timed(v, warmup)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
        for v in order:
            times[v].append(timed(v, steps))
    snap = patrol._report.snapshot()
    probe = next((s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_probe_overhead_ratio"), math.nan)
    patrol.close()
    med = {v: statistics.median(t) for v, t in times.items()}
    # paired per repetition: each repetition's variants ran back to back, so drift cancels
    paired = {v: statistics.median(100 * (t / b - 1) for t, b in zip(times[v], times["bare"], strict=True))
              for v in VARIANTS[1:]}
    return {
        "case": case.name, "reps": reps, "steps_per_rep": steps,
        "step_ms": {v: round(m * 1e3, 4) for v, m in med.items()},
        "overhead_pct": {v: round(100 * (med[v] / med["bare"] - 1), 3) for v in VARIANTS[1:]},
        "skip_mode": "found_inf" if fused else "hide_grads",
        "overhead_pct_paired_median": {v: round(p, 3) for v, p in paired.items()},
        "patrol_self_reported_overhead_ratio": probe,
        "pushes_delivered": patrol._publisher.delivered,
        "control_interval_steps": patrol._coordinator.interval if patrol._coordinator.distributed else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", action="append")
    ap.add_argument("--ddp", action="store_true", help="run under torchrun; wraps the model in DDP")
    ap.add_argument("--port", type=int, default=9471)
    ap.add_argument("--push-interval", type=float, default=1.0, help="Patrol's push interval (diagnostics)")
    ap.add_argument("--reps", type=int, help="repetitions of each variant (default: the case's own)")
    args = ap.parse_args()
    ddp = args.ddp
    if ddp:
        import torch.distributed as dist

        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    names = args.case or (["gpt2-124m-bf16-16x1024", "gpt-10ms-bf16-8x512"] if device.type == "cuda" else ["mlp-cpu"])
    agent = _agent(args.port + (local if ddp else 0)) if local == 0 or not ddp else None
    time.sleep(2.0 if agent else 0)
    url = f"http://127.0.0.1:{args.port}"
    try:
        results = [bench_case(CASES[n], device, args.quick, url, ddp, args.push_interval, args.reps) for n in names]
    finally:
        if agent is not None:
            agent.terminate()
    if local == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
        world = int(os.environ.get("WORLD_SIZE", 1)) if ddp else 1
        print(json.dumps({"benchmark": "overhead", "device": name, "torch": torch.__version__,
                          "push_interval_seconds": args.push_interval, "ddp_world": world,
                          "agent": agent is not None, "results": results}, indent=2))
    if ddp:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
