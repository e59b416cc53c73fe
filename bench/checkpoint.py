"""What a checkpoint costs the training loop, side by side in one run: Patrol's ``checkpoint`` action (state
staged in pinned host memory, written in the background, as ``state.bin`` and as DCP shards), a synchronous
``torch.save`` (what a pause or stop writes), DCP's ``async_save`` (default, and with a pinned ``DefaultStager``),
one pinned device-to-host copy of the state (the floor) and the disk's own sequential rate (``dd``, O_DIRECT);
and the ways of writing the staged state on a thread while training runs (torch.save to a file object or a path,
and Patrol's own ``state.bin``), which is why Patrol writes its own file.

    python bench/checkpoint.py [--layers 24 --dim 1792] [--dir /path/on/the/disk] [--steps 20]

For each path: the time training is blocked, the time until the checkpoint is durable, and the mean step time
while the write runs against the same steps without one. Patrol's checkpoint is restored into a fresh model and
compared with a copy of the weights taken at the step it names (``exact``). Prints JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from overhead import GPT

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.control import checkpoint as ckpt
from trainpatrol.control.state_file import Stager


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Loop:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device, seq: int) -> None:
        self.model, self.opt, self.device = model, opt, device
        self.batch = torch.randint(0, 50257, (4, seq + 1), device=device)
        self.patrol: Patrol | None = None
        """When set, each step is the README loop's: the boundary, then ``patrol.step(loss)``."""

    def step(self) -> None:
        if self.patrol is not None:
            self.patrol.boundary()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(self.batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.batch[:, 1:].flatten())
        loss.backward()
        if self.patrol is not None:
            self.patrol.step(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def steps(self, n: int) -> float:
        """Mean seconds per step over ``n`` steps."""
        sync(self.device)
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        sync(self.device)
        return (time.perf_counter() - start) / n

    def steps_while(self, busy: Any, n: int) -> float:
        """Mean seconds per step over up to ``n`` steps taken while ``busy()`` holds (at least one)."""
        sync(self.device)
        start, done = time.perf_counter(), 0
        while done < n and (done == 0 or busy()):
            self.step()
            done += 1
        sync(self.device)
        return (time.perf_counter() - start) / done


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        total += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return total


def disk_rate(directory: Path, size: int) -> dict[str, Any]:
    """Sequential write rate of the disk under ``directory`` with ``dd`` (O_DIRECT, fsync at the end)."""
    target = directory / "dd.bin"
    mib = max(64, min(size, 6 << 30) >> 20)
    start = time.perf_counter()
    done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "oflag=direct",
                           "conv=fsync"], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    target.unlink(missing_ok=True)
    return {"mib": mib, "seconds": round(seconds, 3), "gb_per_s": round(mib * 2**20 / seconds / 1e9, 3),
            "ok": done.returncode == 0}


def _torch_save_file_object(state: Any, path: Path) -> None:
    ckpt.atomic_write(path, lambda f: torch.save(state, f))


def _torch_save_path(state: Any, path: Path) -> None:
    torch.save(state, str(path))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _state_file(state: Any, path: Path) -> None:
    path.mkdir()
    ckpt.write_state(path, state)
    shutil.rmtree(path)


def compare_writers(loop: Loop, staged: Any, root: Path, steps: int) -> dict[str, Any]:
    """Each way of writing the staged (pinned, host) state, on a thread while training steps run: how long
    until durable, and the step time meanwhile (a writer that holds the GIL slows the training thread)."""
    out: dict[str, Any] = {}
    for name, write in (("torch_save_file_object", _torch_save_file_object),
                        ("torch_save_path", _torch_save_path), ("trainpatrol_state_file", _state_file)):
        target = root / f"writer-{name}"
        start = time.perf_counter()
        thread = threading.Thread(target=write, args=(staged, target))
        thread.start()
        during = loop.steps_while(thread.is_alive, 10_000)
        thread.join()
        out[name] = {"durable_s": round(time.perf_counter() - start, 3),
                     "step_ms_while_writing": round(during * 1e3, 2)}
        target.unlink(missing_ok=True)
    return out


def patrol_checkpoints(loop: Loop, root: Path, fmt: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Two ``checkpoint`` actions of a Patrol writing ``fmt`` in the background (``torch``: rank 0's whole state
    in ``state.bin``; ``dcp``: every rank's shards through DCP's ``async_save``), then a restore into a fresh
    model compared with the weights at the step the second names."""
    model, opt, device = loop.model, loop.opt, loop.device
    config = PatrolConfig(run=f"bench-checkpoint-{fmt}", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=str(root / f"patrol-{fmt}"), evidence_dir=str(root / "evidence"),
                          push_interval_seconds=3600, guard_actions={}, keep_checkpoints=1,
                          background_checkpoints=True, checkpoint_format=fmt)
    patrol = Patrol(model=model, optimizer=opt, config=config)
    executor, loop.patrol = patrol._control.executor, patrol
    start = time.perf_counter()
    loop.steps(1)  # its boundary starts pinning the host memory the first checkpoint stages into, on a thread
    reserving = executor._reserving
    out[f"step_ms_while_pinning_{fmt}"] = round(
        loop.steps_while(lambda: reserving is not None and reserving.is_alive(), 10**6) * 1e3, 2)
    out[f"pinning_s_{fmt}"] = round(time.perf_counter() - start, 3)
    loop.steps(2)
    name = "patrol_checkpoint" if fmt == "torch" else f"patrol_checkpoint_{fmt}"
    out[f"step_ms_with_patrol_{fmt}"] = round(loop.steps(args.steps) * 1e3, 2)
    at_step = None
    for attempt in ("first", "second"):
        patrol.request("checkpoint", f"bench, {attempt}")
        blocked = 0.0
        profile = cProfile.Profile() if args.profile and attempt == "second" else None
        for _ in range(100):  # the boundary where the ranks agree on it stages the state
            sync(device)
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            patrol.boundary()
            if profile is not None:
                profile.disable()
            blocked = max(blocked, time.perf_counter() - start)
            if executor._writer is not None:
                if profile is not None:
                    print(f"--- the {fmt} checkpoint's second boundary, profiled", file=sys.stderr)
                    pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
                at_step = {k: v.detach().clone() for k, v in model.state_dict().items()}
                break
            loop.step()
        writer = executor._writer
        during = loop.steps_while(lambda w=writer: w is not None and w.is_alive(), args.steps)
        executor.wait_for_write()
        out[f"{name}_{attempt.split()[0]}"] = {
            "blocked_s": round(blocked, 3), "durable_s": round(patrol._record.last_checkpoint_write_seconds, 3),
            "step_ms_while_writing": round(during * 1e3, 2), "outcome": patrol.actions[-1].outcome}
    loop.patrol = None
    patrol.close()
    torch.manual_seed(1)
    fresh = GPT(args.layers, args.dim, max(1, args.dim // 128), seq=args.seq).to(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4, fused=device.type == "cuda")
    restorer = Patrol(model=fresh, optimizer=fresh_opt, config=config)
    restorer.restore("latest")
    assert at_step is not None
    out[f"{name}_second"]["exact"] = all(torch.equal(v, at_step[k]) for k, v in fresh.state_dict().items())
    restorer.close()
    del fresh, fresh_opt
    shutil.rmtree(root / f"patrol-{fmt}", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=1792)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="steps timed with and without a write running")
    ap.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--skip", type=lambda v: set(v.split(",")), default=set(),
                    help="parts to leave out, comma-separated: writers (the writer comparison), dcp (DCP's async_save)")
    ap.add_argument("--profile", action="store_true", help="cProfile each Patrol path's second checkpoint boundary "
                    "(to stderr)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    root = Path(tempfile.mkdtemp(dir=args.dir))
    torch.manual_seed(0)
    model = GPT(args.layers, args.dim, max(1, args.dim // 128), seq=args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    loop = Loop(model, opt, device, args.seq)
    loop.steps(3)  # the optimizer's state exists
    size = state_bytes(model, opt)
    out: dict[str, Any] = {"benchmark": "checkpoint", "device": torch.cuda.get_device_name() if device.type == "cuda"
                           else "cpu", "torch": torch.__version__,
                           "parameters": sum(p.numel() for p in model.parameters()), "state_gb": round(size / 1e9, 3),
                           "step_ms": round(loop.steps(args.steps) * 1e3, 2), "disk": disk_rate(root, size)}

    stager = Stager()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    start = time.perf_counter()
    stager.stage(state)  # allocates the pinned buffers once, as a Patrol's first checkpoint does
    out["pinned_first_stage_s"] = round(time.perf_counter() - start, 3)  # what a process's first checkpoint pays
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        stager.stage(state)
        copies.append(time.perf_counter() - start)
    out["pinned_copy_s"] = round(statistics.median(copies), 3)
    if "writers" not in args.skip:
        out["writers"] = compare_writers(loop, stager.stage(state), root, args.steps)
    del stager, copies
    gc.collect()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # Patrol's paths pin afresh, as in a new process

    start = time.perf_counter()
    torch.save(state, root / "sync.pt")
    out["torch_save_sync"] = {"blocked_s": round(time.perf_counter() - start, 3)}
    (root / "sync.pt").unlink()

    for fmt in ("torch", "dcp"):
        patrol_checkpoints(loop, root, fmt, args, out)
    out["disk_after_patrol"] = disk_rate(root, size)  # a cloud disk can slow down after sustained writes

    # DCP's own async_save, default and with pinned staging
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pinned = StagingOptions(True, True, True, True)
    for name, stager_for in (("dcp_async_default", lambda: None),
                             ("dcp_async_pinned_stager", lambda: DefaultStager(pinned))) * ("dcp" not in args.skip):
        try:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            sync(device)
            start = time.perf_counter()
            result = dcp.async_save(state, checkpoint_id=str(root / name), async_stager=stager_for(), no_dist=True)
            blocked = time.perf_counter() - start
            future = getattr(result, "upload_completion", result)
            during = loop.steps_while(lambda f=future: not f.done(), args.steps)
            future.result()
            out[name] = {"blocked_s": round(blocked, 3), "durable_s": round(time.perf_counter() - start, 3),
                         "step_ms_while_writing": round(during * 1e3, 2)}
        except Exception as exc:  # report what the library did, and go on
            out[name] = {"error": repr(exc)[:300]}
    out["step_ms_after"] = round(loop.steps(args.steps) * 1e3, 2)
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
