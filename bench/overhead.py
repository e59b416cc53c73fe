"""Probe overhead on the README's path: ``for batch in patrol.loader(dl)`` over a real shuffled DataLoader.

Every variant iterates the same ``DataLoader`` (shuffled, 2 workers, pinned memory on CUDA, persistent
workers), one epoch per repetition: ``--warmup`` untimed steps, then ``--steps`` timed ones, closed by a
device sync. The README loop: batch to the device (non-blocking), forward, backward,
``clip_grad_norm_``, ``patrol.step(loss, grad_norm=total, batch_size=B, tokens=B*T)``, the optimizer
step (fused AdamW on CUDA). Each repetition runs the variants ``bare``, ``patrol`` and ``bare_again``
(whose "overhead" is the run's noise floor) in one of their six orders, in turn (so use a multiple of six
repetitions). The Patrol variant builds a fresh ``Patrol`` before its epoch and closes it after (both untimed),
so its optimizer hooks and its publisher thread live only while it runs, as in a job; a real agent process
takes its pushes.

Reported per case: step time, the paired median overhead (each repetition's variants ran back to back)
with a bootstrap 95 % interval and the quartiles of the pairs, each repetition's step times, the training
thread's CPU time per step (``time.thread_time``: robust on a noisy host) and what Patrol adds to it, in
kernel launches of this host (the floor, measured here), every thread's CPU per step by role (on Linux: the
training thread, torch's autograd thread that runs a CUDA backward, the DataLoader's pinning thread, Patrol's
publisher), the publisher thread's CPU per second, Patrol's own
``trainpatrol_probe_overhead_ratio`` against the measured overhead, and one instrumented epoch that splits
Patrol's host time per step by part.

    python bench/overhead.py [--device cpu|cuda] [--case NAME ...] [--reps N | --seconds S] [--profile]

Under ``torchrun --nproc-per-node 2 bench/overhead.py --ddp`` the model is wrapped in DDP, the loader
takes a ``DistributedSampler``, and the Patrol variant includes the control-word exchange.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import math
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe import compute_clock, device_values, guards, loader, readback, step_recorder, update_hooks
from trainpatrol.probe import patrol as patrol_module


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
    build: Callable[[], nn.Module]
    data: Callable[[int], TensorDataset]
    """The dataset for ``n`` samples."""
    batch: int
    tokens: int
    """Tokens per sample (0: not a language model)."""
    bf16: bool
    reps: int
    steps: int


def _token_data(t: int, vocab: int = 50257) -> Callable[[int], TensorDataset]:
    return lambda n: TensorDataset(torch.randint(0, vocab, (n, t + 1), generator=torch.Generator().manual_seed(0)))


def _teacher_data(n: int) -> TensorDataset:
    """A noisy teacher, so the loss settles near the noise instead of being memorised to ~1e-11, where
    loss-spike guards would trip on rounding noise."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(256, 1, generator=g) / 16
    x = torch.randn(n, 256, generator=g)
    return TensorDataset(x, torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g))


CASES = {c.name: c for c in [
    Case("gpt-5ms", lambda: GPT(2, 256, 4, seq=128), _token_data(128), 8, 128, True, reps=36, steps=200),
    Case("gpt-10ms", lambda: GPT(4, 512, 8, seq=256), _token_data(256), 16, 256, True, reps=24, steps=200),
    Case("gpt2-124m", lambda: GPT(12, 768, 12), _token_data(1024), 16, 1024, True, reps=6, steps=60),
    Case("mlp-cpu", lambda: nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                                          nn.Linear(512, 1)), _teacher_data, 64, 0, False, reps=42, steps=200),
]}
VARIANTS = ["bare", "patrol", "bare_again"]
ORDERS = list(itertools.permutations(VARIANTS))
"""Every order of the variants in turn: each variant runs first, second and third, and right after each other one,
equally often. A rotation alone puts ``bare_again`` after ``patrol`` in two of three repetitions and ``bare``
in none, so whatever a Patrol epoch leaves behind lands on the noise floor."""


def _loss(model: nn.Module, case: Case, batch: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=case.bf16):
        if case.tokens:
            seq = batch[0].to(device, non_blocking=True)
            out = model(seq[:, :-1])
            return F.cross_entropy(out.flatten(0, 1).float(), seq[:, 1:].flatten())
        x, y = (t.to(device, non_blocking=True) for t in batch)
        return F.mse_loss(model(x).float(), y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _thread_cpu(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return math.nan
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except OSError:  # the thread has ended
        return math.nan


def _threads_cpu_ns() -> dict[int, tuple[str, int]]:
    """Every thread of this process: thread id -> (name, nanoseconds on a CPU), from ``/proc`` (Linux; {} elsewhere).
    Torch's autograd engine runs a CUDA backward on a thread of its own, and the DataLoader pins on another."""
    out: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = (f.read().strip(), on_cpu)
        except (OSError, ValueError, IndexError):  # the thread ended
            continue
    return out


def _thread_role(tid: int, name: str, named: dict[int | None, str]) -> str:
    if tid in named:
        return named[tid]
    return "autograd" if name.startswith("pt_autograd") else "other"


@dataclass
class Epoch:
    step_s: float
    cpu_s: float
    """The training thread's CPU seconds per step."""
    publisher_cpu_per_s: float = math.nan
    self_reported: float = math.nan
    exposed_share: float = math.nan
    """The share of Patrol's host time its self-report counts (the device ran out of queued work while Patrol ran)."""
    opt_step_s: float = math.nan
    """Host seconds per ``optimizer.step()`` call (instrumented epochs only)."""
    threads_cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds per step of the process's threads by role: training, autograd, pin_memory, publisher, other."""


def run_epoch(batches: Iterable[Any], model: nn.Module, opt: torch.optim.Optimizer, case: Case,
              device: torch.device, warmup: int, patrol: Patrol | None, time_opt: bool = False,
              timed_start: Callable[[], None] = lambda: None) -> Epoch:
    """One epoch of the README loop; times the steps after ``warmup`` (``timed_start`` is called as they start)."""
    start = cpu = pub = 0.0
    publisher = patrol._publisher._thread if patrol is not None else None
    opt_s, steps = 0.0, 0
    threads_before: dict[int, tuple[str, int]] = {}
    for i, batch in enumerate(batches):
        if i == warmup:
            _sync(device)
            timed_start()
            start, cpu, pub = time.perf_counter(), time.thread_time(), _thread_cpu(publisher)
            threads_before = _threads_cpu_ns()
        loss = _loss(model, case, batch, device)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if patrol is not None:
            n = batch[0].shape[0]
            patrol.step(loss, grad_norm=total, batch_size=n, tokens=n * case.tokens or None)
        t0 = time.perf_counter()
        opt.step()
        if i >= warmup:
            opt_s += time.perf_counter() - t0
            steps += 1
        opt.zero_grad(set_to_none=True)
    _sync(device)
    wall = time.perf_counter() - start
    out = Epoch(wall / steps, (time.thread_time() - cpu) / steps, (_thread_cpu(publisher) - pub) / wall)
    pin = getattr(getattr(getattr(batches, "_loader", batches), "_iterator", None), "_pin_memory_thread", None)
    named = {threading.main_thread().native_id: "training", getattr(publisher, "native_id", None): "publisher",
             getattr(pin, "native_id", None): "pin_memory"}
    by_role: dict[str, float] = defaultdict(float)
    for tid, (name, on_cpu) in _threads_cpu_ns().items():
        if tid in threads_before:
            by_role[_thread_role(tid, name, named)] += (on_cpu - threads_before[tid][1]) / 1e9 / steps
    out.threads_cpu_s = dict(by_role)
    if time_opt:
        out.opt_step_s = opt_s / steps
    return out


def self_reported(patrol: Patrol) -> float:
    snap = patrol._report.snapshot()
    return next((s["value"] for s in snap["samples"] if s["name"] == "trainpatrol_probe_overhead_ratio"), math.nan)


class Split:
    """Exclusive host time per part on the training thread, by wrapping Patrol's functions (an
    instrumented epoch only: the wrappers cost about a microsecond a call, which ``wrapper_seconds`` measures)."""

    PARTS: dict[str, list[tuple[Any, str]]] = {
        "loader wrapper": [],  # TimedLoader.__iter__, below
        "step() itself": [(patrol_module.Patrol, "step"), (step_recorder.StepRecorder, "record")],
        "device values and verdict": [(device_values.DeviceValues, "record"),
                                      (device_values.DeviceValues, "flush")],
        "read-back": [(readback.Readback, "poll"), (readback.Readback, "submit"),
                      (step_recorder.StepRecorder, "_flush")],
        "fold-in": [(step_recorder.StepRecorder, "fold_in"), (step_recorder.StepRecorder, "_absorb"),
                    (step_recorder.StepRecorder, "_absorb_values")],
        "guards": [(guards.Guards, "check_step"), (guards.Guards, "check_memory")],
        "memory reads": [(step_recorder.StepRecorder, "read_memory")],
        "optimizer hooks": [(update_hooks.UpdateHooks, "_pre"), (update_hooks.UpdateHooks, "_post")],
        "boundary": [(patrol_module.Patrol, "boundary"), (patrol_module.Patrol, "_after_optimizer_step")],
        "compute clock": [(compute_clock.ComputeClock, name) for name in ("_forward", "_backward_done", "step",
                                                                          "collect")],
        "(the DataLoader itself)": [],
    }

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls = 0
        self._stack: list[float] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._owner = threading.get_ident()

    def _frame(self, part: str, fn: Callable[[], Any]) -> Any:
        if threading.get_ident() != self._owner:
            return fn()
        self.calls += 1
        self._stack.append(0.0)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            dt = time.perf_counter() - t0
            self.seconds[part] += dt - self._stack.pop()
            if self._stack:
                self._stack[-1] += dt

    def _wrap(self, owner: Any, name: str, part: str) -> None:
        original = owner.__dict__[name]

        def timed(*args: Any, **kwargs: Any) -> Any:
            return self._frame(part, lambda: original(*args, **kwargs))
        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def __enter__(self) -> Split:
        for part, targets in self.PARTS.items():
            for owner, name in targets:
                self._wrap(owner, name, part)
        split, timed_loader, tracker = self, loader.TimedLoader, loader.LoaderTracker
        wrapper_iter, start_epoch = timed_loader.__dict__["__iter__"], tracker.__dict__["start_epoch"]

        def iter_timed(self: Any) -> Iterator[Any]:
            gen = wrapper_iter(self)
            while True:
                try:
                    item = split._frame("loader wrapper", lambda: next(gen))
                except StopIteration:
                    return
                yield item

        class Timed:
            def __init__(self, it: Iterator[Any]) -> None:
                self.it = it

            def __iter__(self) -> Timed:
                return self

            def __next__(self) -> Any:
                return split._frame("(the DataLoader itself)", lambda: next(self.it))

            def __getattr__(self, name: str) -> Any:  # the host-memory read finds the workers through it
                return getattr(self.it, name)

        class Source:
            """The loader as the tracker sees it: starting its epoch (``iter``, which a bare loop pays too) is the
            DataLoader's time, not the wrapper's."""

            def __init__(self, loader_: Any) -> None:
                self.loader = loader_

            def __getattr__(self, name: str) -> Any:
                return getattr(self.loader, name)

            def __iter__(self) -> Timed:
                return Timed(split._frame("(the DataLoader itself)", lambda: iter(self.loader)))

        def start_timed(self: Any, loader_: Any) -> Iterator[Any]:
            return start_epoch(self, Source(loader_))

        timed_loader.__iter__ = iter_timed  # type: ignore[method-assign]
        tracker.start_epoch = start_timed  # type: ignore[method-assign]
        self._undo += [(timed_loader, "__iter__", wrapper_iter), (tracker, "start_epoch", start_epoch)]
        return self

    def reset(self) -> None:
        """Count from here (the timed steps start; no part is open)."""
        self.seconds.clear()
        self.calls = 0

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    @staticmethod
    def wrapper_seconds(calls: int = 20000) -> float:
        """What one wrapped call costs more than the plain call (a method that does nothing, best of 5): the
        most the split can add per call to the parts' sum, which holds the calls nested inside others whole."""
        class Plain:
            def nothing(self) -> None:
                pass

        class Wrapped(Plain):
            nothing = Plain.__dict__["nothing"]

        plain, split = Plain(), Split()
        split._wrap(Wrapped, "nothing", "calibration")
        wrapped = Wrapped()
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                plain.nothing()
            t1 = time.perf_counter()
            for _ in range(calls):
                wrapped.nothing()
            best = min(best, (time.perf_counter() - t1) - (t1 - t0))
        return best / calls


def median_interval(values: list[float], resamples: int = 2000) -> list[float]:
    """A bootstrap 95 % interval of the median of ``values`` (seeded: the same data gives the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [round(medians[int(0.025 * resamples)], 3), round(medians[int(0.975 * resamples) - 1], 3)]


def launch_us(device: torch.device) -> float:
    """Host time of one tiny op: a kernel launch on CUDA (no sync inside a burst), a dispatch on CPU."""
    x = torch.zeros(1, device=device)
    bursts = []
    for _ in range(30):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(200):
            x.add_(1.0)
        bursts.append((time.perf_counter() - t0) / 200)
    _sync(device)
    return statistics.median(bursts) * 1e6


def bench_case(case: Case, device: torch.device, args: argparse.Namespace, agent_url: str) -> dict[str, Any]:
    reps, steps, warmup = 0 if args.seconds else args.reps or case.reps, args.steps or case.steps, args.warmup
    torch.manual_seed(0)
    model: nn.Module = case.build().to(device)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    world = torch.distributed.get_world_size() if args.ddp else 1
    data = case.data((warmup + steps) * case.batch * world)
    sampler = DistributedSampler(data, shuffle=True) if args.ddp else None
    dl = DataLoader(data, batch_size=case.batch, shuffle=sampler is None, sampler=sampler, num_workers=2,
                    pin_memory=device.type == "cuda", persistent_workers=True, drop_last=True)
    epochs = 0

    def fresh_patrol() -> Patrol:
        # guards only record: a trip would pause the benchmark, and the checks run all the same
        cfg = PatrolConfig(run=f"bench-{case.name}", agent_url=agent_url, embedded_agent=False,
                           checkpoint_dir="/tmp/trainpatrol-bench/ckpt", evidence_dir="/tmp/trainpatrol-bench/ev",
                           guard_actions={})
        return Patrol(model=model, optimizer=opt, config=cfg)

    def epoch(variant: str, time_opt: bool = False, timed_start: Callable[[], None] = lambda: None) -> Epoch:
        nonlocal epochs
        if sampler is not None:
            sampler.set_epoch(epochs)
        epochs += 1
        gc.collect()
        if variant.startswith("bare"):
            return run_epoch(dl, model, opt, case, device, warmup, None, time_opt)
        patrol = fresh_patrol()
        try:
            result = run_epoch(patrol.loader(dl), model, opt, case, device, warmup, patrol, time_opt, timed_start)
            result.self_reported = self_reported(patrol)
            result.exposed_share = patrol._latest.exposed_share
            return result
        finally:
            patrol.close()

    epoch("bare")
    epoch("patrol")
    runs: dict[str, list[Epoch]] = {v: [] for v in VARIANTS}
    deadline, rep = time.monotonic() + (args.seconds or 0.0), 0
    # with --seconds, whole rounds of the six orders until the time is up
    while rep < reps or (args.seconds and (rep % len(ORDERS) or time.monotonic() < deadline)):
        for v in ORDERS[rep % len(ORDERS)]:
            runs[v].append(epoch(v))
        rep += 1
    reps = rep

    def differences(v: str, field: str, pct: bool) -> list[float]:
        pairs = [(getattr(a, field), getattr(b, field)) for a, b in zip(runs[v], runs["bare"], strict=True)]
        return [100 * (x / y - 1) if pct else x - y for x, y in pairs]

    def paired(v: str, field: str, pct: bool) -> float:
        return statistics.median(differences(v, field, pct))

    floor = launch_us(device)
    added_cpu_us = paired("patrol", "cpu_s", False) * 1e6
    measured = paired("patrol", "step_s", True)
    reported = 100 * statistics.median(e.self_reported for e in runs["patrol"])
    roles = sorted({r for v in VARIANTS for e in runs[v] for r in e.threads_cpu_s})

    def role_us(e: Epoch, role: str) -> float:
        return e.threads_cpu_s.get(role, 0.0) * 1e6
    out: dict[str, Any] = {
        "case": case.name, "reps": reps, "steps_per_rep": steps, "warmup_steps": warmup,
        "step_ms": {v: round(statistics.median(e.step_s for e in runs[v]) * 1e3, 4) for v in VARIANTS},
        "overhead_pct_paired_median": {v: round(paired(v, "step_s", True), 3) for v in VARIANTS[1:]},
        "overhead_pct_paired_median_95ci": {v: median_interval(differences(v, "step_s", True))
                                            for v in VARIANTS[1:]},
        "overhead_pct_paired_quartiles": {v: [round(q, 2) for q in statistics.quantiles(
            differences(v, "step_s", True), n=4)] for v in VARIANTS[1:]},
        "training_thread_cpu_us_per_step": {v: round(statistics.median(e.cpu_s for e in runs[v]) * 1e6, 1)
                                            for v in VARIANTS},
        "patrol_added_cpu_us_per_step_paired": round(added_cpu_us, 1),
        "threads_cpu_us_per_step": {r: {v: round(statistics.median(role_us(e, r) for e in runs[v]), 1)
                                        for v in VARIANTS} for r in roles},
        "threads_added_cpu_us_per_step_paired": {r: {v: round(statistics.median(
            role_us(a, r) - role_us(b, r) for a, b in zip(runs[v], runs["bare"], strict=True)), 1)
            for v in VARIANTS[1:]} for r in roles},
        "noise_added_cpu_us_per_step_paired": round(paired("bare_again", "cpu_s", False) * 1e6, 1),
        "kernel_launch_us" if device.type == "cuda" else "op_dispatch_us": round(floor, 2),
        "patrol_added_cpu_in_launches": round(added_cpu_us / floor, 1),
        "publisher_cpu_ms_per_s": round(statistics.median(e.publisher_cpu_per_s for e in runs["patrol"]) * 1e3, 3),
        "self_reported_pct": round(reported, 3),
        "self_report_exposed_share": round(statistics.median(e.exposed_share for e in runs["patrol"]), 3),
        "self_report_minus_measured_pp": round(reported - measured, 3),
    }
    out["raw_step_ms"] = {v: [round(e.step_s * 1e3, 4) for e in runs[v]] for v in VARIANTS}
    # one instrumented Patrol epoch, and a bare one for the optimizer step's own host time
    with Split() as split:
        part = epoch("patrol", time_opt=True, timed_start=split.reset)
    bare = epoch("bare", time_opt=True)
    by_part = {k: v / steps * 1e6 for k, v in split.seconds.items()}  # the timed steps, as in the other epochs
    out["patrol_host_us_per_step_by_part"] = {k: round(v, 2) for k, v in by_part.items()}
    patrol_parts = sum(v for k, v in by_part.items() if not k.startswith("("))
    wrapper_us = split.calls / steps * Split.wrapper_seconds() * 1e6
    out["patrol_parts_us_per_step"] = {"sum": round(patrol_parts, 2),
                                       "split_wrapper_cost_at_most": round(wrapper_us, 2),
                                       "sum_less_wrapper_cost": round(patrol_parts - wrapper_us, 2)}
    out["optimizer_step_host_us"] = {"bare": round(bare.opt_step_s * 1e6, 1), "patrol": round(part.opt_step_s * 1e6, 1)}
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        epoch("patrol")
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
        print(text.getvalue(), file=sys.stderr)
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--reps", type=int, help="repetitions of each variant (default: the case's own)")
    ap.add_argument("--seconds", type=float,
                    help="instead of --reps: rounds of the six orders until this many seconds passed, per case")
    ap.add_argument("--steps", type=int, help="timed steps per repetition (default: the case's own)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of each epoch")
    ap.add_argument("--ddp", action="store_true", help="run under torchrun; wraps the model in DDP")
    ap.add_argument("--port", type=int, default=9471)
    ap.add_argument("--profile", action="store_true", help="cProfile one more Patrol epoch (to stderr)")
    args = ap.parse_args()
    if args.ddp:
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    names = args.case or (["gpt-5ms", "gpt-10ms", "gpt2-124m"] if device.type == "cuda" else ["mlp-cpu"])
    agent = _agent(args.port) if local == 0 else None
    time.sleep(2.0 if agent else 0)
    try:
        results = [bench_case(CASES[n], device, args, f"http://127.0.0.1:{args.port}") for n in names]
    finally:
        if agent is not None:
            agent.terminate()
    if local == 0:
        print(json.dumps({
            "benchmark": "overhead", "path": "README loop over patrol.loader(DataLoader)",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "ddp_world": torch.distributed.get_world_size() if args.ddp else 1,
            "agent": agent is not None, "results": results}, indent=2))
    if args.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
