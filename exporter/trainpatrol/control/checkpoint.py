"""Atomic checkpoints: temp file, fsync, rename; a failed write leaves the previous one intact.

Layout of one checkpoint, ``<dir>/step-00001234/``:
- ``state.bin``: replicated state (model, optimizer, scheduler, GradScaler), written by rank 0 once
  (``control/state_file.py``; checkpoints of earlier versions hold ``state.pt``, torch.save, still read);
- ``dcp-<write>/``: for a sharded model (``control/sharded.py``), the model's and optimizer's shards, which
  every rank writes through torch.distributed.checkpoint; ``state.bin`` then holds the rest;
- ``rank-00003.pt``: per-rank state (RNG states of python, numpy, torch and CUDA; the user's extra
  state), one per rank;
- ``meta.json``: step, world size, time, reason, ``pinned``, ``finite`` (whether every floating-point
  tensor of the model and optimizer state is finite, with the names of those that are not), ``best``
  (the validation loss, for the checkpoint of the best one) and, for shards, ``format: dcp`` with the
  DCP directory, its files and their sizes; written last by rank 0, so a directory without it is incomplete and
  ignored, as is one whose recorded shard files are not all there.
Rotation keeps the newest ``keep_last`` unpinned checkpoints and the newest ``keep_pinned`` pinned ones (a
pause's or a stop's), and never removes the newest finite one or the newest best one. ``restore("latest")``
takes the newest finite one. A checkpoint that would not fit in the free space (the size of the last one) is
refused before anything is written, and a run whose state is still non-finite does not save it again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import random
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from . import sharded, state_file

log = logging.getLogger("trainpatrol")
STALE_TEMP_SECONDS = 3600.0
"""A temporary file older than this is from a write that died, wherever it ran."""
NONFINITE_NAMES_KEPT = 20


def temp_path(path: Path) -> Path:
    """Where ``atomic_write`` writes ``path`` first: named by host and pid, so a dead writer's file is known."""
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


class _KeepsWriteErrors:
    """A file that remembers the first OSError of a write: torch.save's zip writer swallows it and
    raises "unexpected pos 704 vs 598" instead, so a full disk would not say so."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> Any:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write to a temporary file, fsync, rename; on any failure the temporary file is removed.

    A failed write raises OSError with its errno and the path (``[Errno 28] No space left on
    device: '.../state.bin'``), also where the writer (torch.save) reported it as something else."""
    tmp = temp_path(path)
    kept: _KeepsWriteErrors | None = None
    try:
        with open(tmp, "wb") as f:
            kept = _KeepsWriteErrors(f)
            write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        cause = kept.error if kept is not None and kept.error is not None else exc
        if isinstance(cause, OSError) and not (isinstance(exc, OSError) and exc.filename):
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from exc
        raise


def write_state(directory: Path, replicated: dict[str, Any]) -> None:
    """The replicated state, atomically, as ``state.bin``."""
    atomic_write(directory / state_file.NAME, lambda f: state_file.write(replicated, f))


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        # plain lists load with torch.load(weights_only=True), as Lightning loads its checkpoints
        state["numpy"] = (name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(gauss))
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

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(directory: Path, now: float | None = None) -> list[Path]:
    """Temporary files of writes that died: this host's whose process is gone, or any over an hour old."""
    if not directory.is_dir():
        return []
    now = time.time() if now is None else now
    host = socket.gethostname()
    removed = []
    for tmp in directory.glob("step-*/.*.tmp-*"):
        owner = tmp.name.rsplit(".tmp-", 1)[1]
        tmp_host, _, pid = owner.rpartition("-")
        try:
            dead = (tmp_host == host and pid.isdigit() and not _alive(int(pid))) or \
                now - tmp.stat().st_mtime > STALE_TEMP_SECONDS
            if dead:
                tmp.unlink()
                removed.append(tmp)
        except OSError:
            continue
    return removed


def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{name}{'.' if not name.endswith(':') else ''}{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{name}.{i}")


def nonfinite_entries(state: dict[str, Any]) -> list[str]:
    """Names of the model's and optimizer's floating-point tensors holding a NaN or an Inf.

    One fused max-norm per device and dtype (a NaN or an Inf anywhere makes it non-finite) and one read per device:
    a 1B model's state is about 1,200 tensors, and a check per tensor held training for tens of milliseconds."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[str], list[torch.Tensor]]] = {}
    for part in ("model", "optimizer"):
        for name, t in _tensors(state.get(part), f"{part}:"):
            if t.is_floating_point() or t.is_complex():
                t = sharded.local(t)  # a rank judges its own shards, and may hold none of a small tensor
                if not t.numel():
                    continue
                names, tensors = groups.setdefault((t.device, t.dtype), ([], []))
                names.append(name)
                tensors.append(t)
    by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
    for (device, _), (names, tensors) in groups.items():
        all_names, norms = by_device.setdefault(device, ([], []))
        all_names += names
        norms.append(torch.stack(torch._foreach_norm(tensors, math.inf)).float())
    bad: list[str] = []
    for names, norms in by_device.values():
        finite = torch.isfinite(torch.cat(norms)).tolist()
        bad += [n for n, ok in zip(names, finite, strict=True) if not ok]
    return bad


@dataclass(frozen=True)
class Restored:
    """What ``Patrol.restore`` loaded; false when there was nothing to restore."""

    step: int = 0
    path: str = ""
    reason: str = ""
    """Why this checkpoint (or why none)."""
    skipped: tuple[str, ...] = field(default_factory=tuple)
    """Newer checkpoints passed over, each with why."""
    epoch: int = 0
    """The data loader's epoch at the checkpoint (0 without ``patrol.loader``)."""

    def __bool__(self) -> bool:
        return bool(self.path)


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / "meta.json").read_text()))
    except (OSError, ValueError):
        return {}


def missing_shards(path: Path, meta: dict[str, Any]) -> list[str]:
    """The DCP files ``meta.json`` records that are not there, or not of their recorded size."""
    if meta.get("format") != "dcp":
        return []
    return sharded.missing(path / str(meta.get("dcp", "")), meta.get("shards") or {}) or \
        ([] if meta.get("shards") else ["(no shard files recorded)"])


def describe_nonfinite(meta: dict[str, Any]) -> str:
    names = meta.get("nonfinite") or []
    count = int(meta.get("nonfinite_count", len(names)))
    shown = ", ".join(names[:4]) + (", ..." if count > 4 else "")
    return f"{count} non-finite tensor{'s' if count != 1 else ''} ({shown})"


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep_last: int = 3, keep_pinned: int = 8) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_pinned = keep_pinned
        for tmp in remove_stale_temp_files(self.directory):
            log.warning("trainpatrol: removed %s, left by a checkpoint write that died", tmp)

    def check_room(self) -> None:
        """Refuse a checkpoint that would not fit: free space under the directory below the size of the last one.
        Raises OSError (ENOSPC) saying so, before anything is written."""
        last = self.latest()
        if last is None:
            return
        need = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise OSError(errno.ENOSPC, f"not enough free space for a checkpoint: {free / 2**20:.1f} MiB free, the "
                          f"last checkpoint ({last.name}) took {need / 2**20:.1f} MiB; nothing was written",
                          str(self.directory))

    def incident(self) -> Path | None:
        """The first complete checkpoint with non-finite state since the newest finite one, if any: where a run
        whose state is still non-finite already saved it."""
        first = None
        for path in reversed(self.complete()):
            if read_meta(path).get("finite", True) is not False:
                break
            first = path
        return first

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def save_rank(self, step: int, rank: int, replicated: dict[str, Any] | None, per_rank: dict[str, Any]) -> Path:
        """Write this rank's share. Raises OSError (disk full, read-only: its errno and path) with
        nothing half-written, and without the step's directory where it was made for this write and
        holds nothing else."""
        target = self.path_for(step)
        target.mkdir(parents=True, exist_ok=True)
        try:
            if replicated is not None:
                write_state(target, replicated)
            atomic_write(target / f"rank-{rank:05d}.pt", lambda f: torch.save(per_rank, f))
        except BaseException:
            with contextlib.suppress(OSError):
                target.rmdir()  # only when empty: another rank's share or an older complete one stays
            raise
        return target

    def discard(self, step: int, rank: int) -> None:
        """After a checkpoint that failed on some rank: remove this rank's share of the step's directory,
        and the directory once empty, unless it is complete (``meta.json``: an older checkpoint of
        the same step, whose files the failed write left as they were). Rank 0 also removes the
        replicated state."""
        target = self.path_for(step)
        if (target / "meta.json").exists():
            return
        for name in [f"rank-{rank:05d}.pt"] + ([state_file.NAME] if rank == 0 else []):
            (target / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            target.rmdir()

    def discard_incomplete(self, step: int) -> None:
        """Rank 0, after every rank's ``discard``: the step's directory goes unless it is complete; then only
        the shards its ``meta.json`` names stay."""
        target = self.path_for(step)
        if target.is_dir() and not (target / "meta.json").exists():
            shutil.rmtree(target, ignore_errors=True)
        elif target.is_dir():
            for stale in sharded.others(target, keep=str(read_meta(target).get("dcp", ""))):
                shutil.rmtree(stale, ignore_errors=True)

    def commit(self, step: int, meta: dict[str, Any]) -> Path:
        """Rank 0, after every rank saved: mark complete, then rotate unpinned old ones."""
        target = self.path_for(step)
        body = json.dumps({"step": step, "time": time.time(), **meta}, indent=2).encode()
        atomic_write(target / "meta.json", lambda f: f.write(body))
        for stale in sharded.others(target, keep=str(meta.get("dcp", ""))):  # an older write of this step
            shutil.rmtree(stale, ignore_errors=True)
        self._rotate(keep=target)
        return target

    def complete(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("step-*") if (p / "meta.json").is_file())

    def latest(self) -> Path | None:
        """The newest complete checkpoint, finite or not."""
        return next(reversed(self.complete()), None)

    def latest_finite(self) -> tuple[Path | None, list[str]]:
        """The newest complete checkpoint whose state is finite (or was written before that was recorded),
        and why each newer one was passed over."""
        skipped: list[str] = []
        for path in reversed(self.complete()):
            meta = read_meta(path)
            gone = missing_shards(path, meta)
            if gone:
                skipped.append(f"{path.name}: shard files missing or cut short ({', '.join(gone)})")
            elif meta.get("finite", True) is not False:
                return path, skipped
            else:
                skipped.append(f"{path.name}: {describe_nonfinite(meta)}")
        return None, skipped

    def last_good(self) -> Path | None:
        return self.latest_finite()[0]

    def best(self) -> Path | None:
        """The newest checkpoint written for a best validation loss."""
        return next((p for p in reversed(self.complete()) if read_meta(p).get("best") is not None), None)

    def _rotate(self, keep: Path) -> None:
        metas = [(p, read_meta(p)) for p in self.complete()]
        protected = {keep}
        for wanted in (lambda m: m.get("finite", True) is not False, lambda m: m.get("best") is not None):
            newest = [p for p, m in metas if wanted(m)]
            if newest:
                protected.add(newest[-1])
        unpinned = [p for p, m in metas if not m.get("pinned")]
        pinned = [p for p, m in metas if m.get("pinned")]
        over = unpinned[: max(0, len(unpinned) - self.keep_last)] + pinned[: max(0, len(pinned) - self.keep_pinned)]
        for old in over:
            if old not in protected:
                shutil.rmtree(old, ignore_errors=True)


def load(path: Path, rank: int, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any],
                                                                                      dict[str, Any]]:
    """(meta, replicated state, this rank's state) of a complete checkpoint."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} is incomplete: no meta.json.")
    meta = json.loads(meta_file.read_text())
    gone = missing_shards(path, meta)
    if gone:
        raise FileNotFoundError(f"Checkpoint {str(path)!r} is incomplete: shard files missing or cut short: "
                                f"{', '.join(gone)}.")
    if (path / state_file.NAME).is_file():
        replicated = state_file.read(path / state_file.NAME, map_location)
    elif (path / "state.pt").is_file():  # written by an earlier version
        replicated = torch.load(path / "state.pt", map_location=map_location, weights_only=False)
    else:
        replicated = {}
    rank_file = path / f"rank-{rank:05d}.pt"
    per_rank = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else {}
    return meta, replicated, per_rank


STATEFUL = ("model", "optimizer", "scheduler", "scaler")


class LoaderPosition(Protocol):
    def state(self) -> dict[str, Any] | None: ...

    def restore(self, state: dict[str, Any] | None, restore_rng: Callable[[], None]) -> int: ...


class TrainingState:
    """What a checkpoint holds of the training: the replicated state (model, optimizer, scheduler, scaler), and
    per rank the RNG, the loader's position and the caller's extra state. A sharded model's and its optimizer's
    state goes through torch.distributed.checkpoint instead (``sharded``), every rank its shards."""

    def __init__(self, objects: Callable[[], dict[str, Any]], loader: LoaderPosition,
                 extra_state: Callable[[], dict[str, Any]] | None = None,
                 load_extra_state: Callable[[dict[str, Any]], None] | None = None,
                 checkpoint_format: str = "auto") -> None:
        self._objects, self._loader = objects, loader
        self._format = checkpoint_format
        self.extra_state, self.load_extra_state = extra_state, load_extra_state
        self.best_pending: float | None = None
        """A new best validation loss that the next checkpoint is marked with."""

    def sharded(self) -> bool:
        """Whether the model and optimizer state is saved as shards, by every rank (the same on every rank)."""
        model = self._objects()["model"]
        return model is not None and (self._format == "dcp" or
                                      (self._format == "auto" and sharded.holds_dtensors(model)))

    def sharded_state(self) -> dict[str, Any]:
        objects = self._objects()
        return sharded.state(objects["model"], objects["optimizer"])

    def load_sharded(self, where: Path) -> None:
        objects = self._objects()
        sharded.load(where, objects["model"], objects["optimizer"])

    def replicated(self, step: int, *, sharded: bool = False) -> dict[str, Any]:
        """What rank 0 saves whole: all of it, or (``sharded``) all but the model and optimizer."""
        state: dict[str, Any] = {"step": step}
        for name, obj in self._objects().items():
            if obj is not None and not (sharded and name in ("model", "optimizer")):
                state[name] = obj.state_dict()
        return state

    def per_rank(self, step: int) -> dict[str, Any]:
        return {"step": step, "rng": rng_state(), "loader": self._loader.state(),
                "extra": self.extra_state() if self.extra_state is not None else None}

    def load(self, replicated: dict[str, Any], per_rank: dict[str, Any]) -> int:
        """Loads what the checkpoint holds; returns the loader's epoch."""
        for name, obj in self._objects().items():
            if obj is not None and name in replicated:
                obj.load_state_dict(replicated[name])
        if "rng" in per_rank:
            set_rng_state(per_rank["rng"])
        # the loader replays its epoch's start from its own RNG, then the checkpoint's RNG is set again
        epoch = self._loader.restore(per_rank.get("loader"), lambda: set_rng_state(per_rank["rng"]))
        if self.load_extra_state is not None and per_rank.get("extra") is not None:
            self.load_extra_state(per_rank["extra"])
        return epoch
