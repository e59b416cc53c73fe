"""Atomic checkpoints: temp file, fsync, rename; a failed write leaves the previous one intact.

Layout of one checkpoint, ``<dir>/step-00001234/``:
- ``state.pt``: replicated state (model, optimizer, scheduler, GradScaler), written by rank 0 once;
- ``rank-00003.pt``: per-rank state (RNG states of python, numpy, torch and CUDA; the user's extra
  state), one per rank;
- ``meta.json``: step, world size, time, reason and ``pinned``; written last by rank 0, so a
  directory without it is incomplete and ignored by ``latest()``.
Checkpoints written by a pause are pinned and never rotated away.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SaveFn = Callable[[Path, dict[str, Any]], None]
"""A user-supplied saver (e.g. torch.distributed.checkpoint for FSDP): gets the directory and the
default state; it must write atomically itself."""


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep_last: int = 3, save_fn: SaveFn | None = None) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.save_fn = save_fn

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def save_rank(self, step: int, rank: int, replicated: dict[str, Any] | None, per_rank: dict[str, Any]) -> Path:
        """Write this rank's share. Raises OSError (disk full, read-only) with nothing half-written."""
        target = self.path_for(step)
        target.mkdir(parents=True, exist_ok=True)
        if replicated is not None:
            if self.save_fn is not None:
                self.save_fn(target, replicated)
            else:
                atomic_write(target / "state.pt", lambda f: torch.save(replicated, f))
        atomic_write(target / f"rank-{rank:05d}.pt", lambda f: torch.save(per_rank, f))
        return target

    def commit(self, step: int, meta: dict[str, Any]) -> Path:
        """Rank 0, after every rank saved: mark complete, then rotate unpinned old ones."""
        target = self.path_for(step)
        body = json.dumps({"step": step, "time": time.time(), **meta}, indent=2).encode()
        atomic_write(target / "meta.json", lambda f: f.write(body))
        self._rotate(keep=target)
        return target

    def complete(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("step-*") if (p / "meta.json").is_file())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def _rotate(self, keep: Path) -> None:
        unpinned = [p for p in self.complete() if not json.loads((p / "meta.json").read_text()).get("pinned")]
        for old in unpinned[: max(0, len(unpinned) - self.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


def load(path: Path, rank: int, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any],
                                                                                      dict[str, Any]]:
    """(meta, replicated state, this rank's state) of a complete checkpoint."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} is incomplete: no meta.json.")
    meta = json.loads(meta_file.read_text())
    replicated = torch.load(path / "state.pt", map_location=map_location, weights_only=False) \
        if (path / "state.pt").is_file() else {}
    rank_file = path / f"rank-{rank:05d}.pt"
    per_rank = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else {}
    return meta, replicated, per_rank
