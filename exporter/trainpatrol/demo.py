"""``trainpatrol demo``: a small model trains with Patrol, a fault is injected, the run pauses with a
checkpoint and evidence, and resumes on command.

On CPU there is no CUDA caching allocator, so the demo feeds Patrol a simulated allocator reading
(``SimulatedAllocator``), said so on start; on a GPU the real allocator is read.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .cli import FAULTS
from .probe.memory import MemoryReading


class SimulatedAllocator:
    """A CPU stand-in for the CUDA allocator reading: steady use, plus injected fragmentation."""

    def __init__(self) -> None:
        self.fragmented = False
        self.calls = 0

    def __call__(self) -> MemoryReading:
        self.calls += 1
        gib = 2.0**30
        allocated = 6 * gib + (self.calls % 7) * 0.05 * gib
        reserved = allocated / (0.4 if self.fragmented else 0.9)
        return MemoryReading(allocated=allocated, reserved=reserved, active=allocated * 1.02,
                             inactive_split=reserved - allocated if self.fragmented else 0.05 * gib,
                             peak_allocated=allocated + 0.4 * gib, alloc_retries=3.0 if self.fragmented else 0.0,
                             ooms=0.0, capacity=80 * gib)


class StallingLoader:
    """Wraps a DataLoader; sleeps before each batch once ``stall`` is set (a starved pipeline)."""

    def __init__(self, loader: DataLoader[Any], stall_seconds: float) -> None:
        self.loader, self.stall, self.stall_seconds = loader, False, stall_seconds
        self.num_workers, self.pin_memory = loader.num_workers, loader.pin_memory
        self.persistent_workers, self.prefetch_factor = loader.persistent_workers, loader.prefetch_factor
        self.batch_size = loader.batch_size

    def __iter__(self) -> Any:
        for batch in self.loader:
            if self.stall:
                time.sleep(self.stall_seconds)
            yield batch


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).to(device)


def _data(n: int = 4096, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def _validate(model: nn.Module, data: TensorDataset, device: torch.device) -> float:
    model.eval()
    with torch.no_grad():
        x, y = (t.to(device) for t in data.tensors)
        loss = float(nn.functional.mse_loss(model(x), y))
    model.train()
    return loss


def _run_state(agent_url: str, run: str) -> str:
    try:
        with urllib.request.urlopen(f"{agent_url}/v1/runs/{run}", timeout=1) as r:
            return str(json.loads(r.read())["state"])
    except Exception:
        return "unknown"


def _auto_resume(agent_url: str, run: str, after: float, stop: threading.Event) -> None:
    """Acts like the operator: once the run is paused, wait, then ask the agent to resume it."""
    while not stop.wait(0.25):
        if _run_state(agent_url, run) != "paused":
            continue
        print(f"[demo] run {run} is paused; inspect it, e.g. `trainpatrol status`. Resuming in {after:g} s "
              f"as if you ran `trainpatrol resume {run}`.", flush=True)
        if stop.wait(after):
            return
        body = json.dumps({"action": "resume", "reason": "demo auto-resume"}).encode()
        req = urllib.request.Request(f"{agent_url}/v1/runs/{run}/actions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
        while not stop.wait(0.25) and _run_state(agent_url, run) == "paused":
            pass


def run_demo(args: argparse.Namespace) -> int:
    from .probe.config import PatrolConfig
    from .probe.patrol import Patrol

    fault, _, at = args.inject.partition("@")
    if fault not in FAULTS:
        raise SystemExit(f"`--inject {args.inject}` is not valid. Expected FAULT@STEP with FAULT in {FAULTS}.")
    fault_step = int(at or 0)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    work = Path(args.workdir)
    allocator = None if use_cuda else SimulatedAllocator()
    if allocator is not None:
        print("[demo] CPU run: allocator metrics come from a simulated allocator (no CUDA here).", flush=True)
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps, 1))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    loader = StallingLoader(DataLoader(_data(), batch_size=64, shuffle=True), stall_seconds=0.05)
    held_out = _data(512, seed=2)
    config = PatrolConfig(run=args.run, agent_url=args.agent_url, checkpoint_dir=str(work / "checkpoints"),
                          evidence_dir=str(work / "evidence"), memory_reader=allocator,
                          memory_interval_seconds=0.2)
    stop = threading.Event()
    if args.auto_resume > 0:
        threading.Thread(target=_auto_resume, args=(args.agent_url, args.run, args.auto_resume, stop),
                         daemon=True).start()
    print(f"[demo] metrics: {args.agent_url}/metrics   status: trainpatrol status --agent {args.agent_url}",
          flush=True)
    last_print = 0.0
    with Patrol(model=model, optimizer=opt, scheduler=sched, scaler=scaler, config=config) as patrol:
        while patrol.step_count < args.steps:
            for x, y in patrol.loader(loader):
                step = patrol.step_count + 1
                if step > args.steps:
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = nn.functional.mse_loss(model(x), y)
                if fault == "nan" and step == fault_step:
                    loss = loss * math.nan
                if fault == "grad_spike" and step >= fault_step:
                    loss = loss * 1e4
                if allocator is not None and fault == "fragmentation" and step == fault_step:
                    allocator.fragmented = True
                if fault == "loader_stall" and step == fault_step:
                    loader.stall = True
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                patrol.step(loss, grad_norm=total, batch_size=x.shape[0])
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                if step % args.eval_every == 0:
                    patrol.evaluate(_validate(model, held_out, device))
                if args.checkpoint_every and step % args.checkpoint_every == 0:
                    patrol.request("checkpoint", f"periodic checkpoint every {args.checkpoint_every} steps",
                                   source="demo")
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if not args.quiet and time.monotonic() - last_print > 1.0:
                    last_print = time.monotonic()
                    lt = patrol.latest
                    print(f"[demo] step {step:5d}  loss {lt.loss:9.4f}  grad_norm {lt.grad_norm:9.3f}  "
                          f"state {patrol.state}", flush=True)
    stop.set()
    print(f"[demo] done: {patrol.step_count} steps. Evidence: {patrol.last_evidence or 'none'}; "
          f"last checkpoint: {patrol.last_checkpoint or 'none'}", flush=True)
    return 0
