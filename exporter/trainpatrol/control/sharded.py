"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP).

A model that holds DTensors (FSDP2's ``fully_shard``, tensor parallel) has no whole state on any one
rank: every rank writes its own shards, and a restore reads them back, resharded where the world size
changed. ``get_state_dict``/``set_state_dict`` give DCP the model's and optimizer's state in the
form it saves and loads (the optimizer's lazy state is created first, so a fresh process can load into it).
"""

from __future__ import annotations

import gc
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

PREFIX = "dcp-"
"""A checkpoint's DCP files go in ``<step directory>/dcp-<name>``, a directory of their own for each write, which
``meta.json`` names: a second write of the same step (a stop while paused, a run that reached the step again after
a restore) never touches the files of the complete checkpoint until its own ``meta.json`` replaces the old one."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def holds_dtensors(model: torch.nn.Module | None) -> bool:
    dtensor = _dtensor_type()
    return model is not None and dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t  # type: ignore[attr-defined]


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    return {"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})}


def save(where: Path, sharded: dict[str, Any]) -> None:
    """Every rank writes its shards into ``where`` (a collective: a failure on any rank raises on all)."""
    from torch.distributed.checkpoint import state_dict_saver

    state_dict_saver.save(sharded, checkpoint_id=str(where))


class BackgroundWriter:
    """Every rank's shards written while training goes on, through DCP's ``async_save``.

    ``stage`` copies the rank's shards into host buffers that DCP's ``StateDictStager`` keeps from one checkpoint to
    the next (pinned, with one wait for the copies, when the state is on a GPU): training is held for that copy.
    ``write`` then hands the staged state to DCP's writer thread, whose collectives (the save plan, the metadata)
    run on a gloo group of their own (``join_group``), so they never interleave with the training's collectives on
    the default group. Every rank calls them at the same step boundary: creating the group and saving are
    collectives.
    """

    def __init__(self) -> None:
        self._group: Any = None
        self._stager: Any = None

    def join_group(self) -> None:
        """The gloo group of DCP's collectives, made at the first save: a collective of every rank, so it comes
        before anything at the boundary that could fail on one rank alone. A single process has no group."""
        import torch.distributed as dist

        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")

    def stage(self, state: dict[str, Any], on_gpu: bool) -> dict[str, Any]:
        """``on_gpu``: the rank trains on a GPU (its shards are staged into pinned memory, with one wait)."""
        if self._stager is None:
            self._stager = _host_stager(pinned=on_gpu)
        staged: dict[str, Any] = self._stager.stage(state, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        return staged

    def write(self, where: Path, staged: dict[str, Any]) -> Future[Any]:
        """Starts writing ``staged`` (from ``stage``) into ``where``; the future completes once every rank's shards
        and DCP's metadata are written, and raises on every rank when one rank's write failed."""
        from torch.distributed.checkpoint import state_dict_saver

        result: Any = state_dict_saver.async_save(staged, checkpoint_id=str(where), process_group=self._group,
                                                  async_stager=_AlreadyStaged(), no_dist=not _distributed())
        future: Future[Any] = getattr(result, "upload_completion", result)  # an AsyncSaveResponse, or the future
        return future

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
            # the pinned buffers are unpinned here, not by a garbage collection in a DataLoader worker forked
            # later, where a CUDA call aborts the worker
            gc.collect()


def _host_stager(pinned: bool) -> Any:
    """DCP's ``StateDictStager``: host copies of the shards (DTensors stay DTensors) in storages it keeps from one
    save to the next. torch 2.11's public ``DefaultStager`` closes it after every stage (pytorch#183413), so each
    save allocated and pinned the whole state again (5.8 s for a 1B model's 12.6 GB on an H200, against 0.3 s to
    copy into kept buffers), and the pinned storages it dropped could be collected in a forked DataLoader worker,
    whose unpinning aborted it."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    return StateDictStager(pin_memory=pinned, share_memory=False)


class _AlreadyStaged:
    """DCP's stager protocol for a state that ``BackgroundWriter.stage`` staged already: no second copy."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def load(where: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank reads its shards from ``where`` into the model and optimizer (a collective)."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    target = state(model, optimizer)
    state_dict_loader.load(target, checkpoint_id=str(where))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=target["model"],
                   optim_state_dict=target.get("optimizer", {}))


def files(where: Path) -> dict[str, int]:
    """The DCP files in ``where`` and their sizes, as a checkpoint's ``meta.json`` records them."""
    return {p.name: p.stat().st_size for p in sorted(where.iterdir()) if p.is_file()} if where.is_dir() else {}


def missing(where: Path, recorded: dict[str, int]) -> list[str]:
    """Recorded DCP files that are gone or not of their recorded size."""
    present = files(where)
    return [name for name, size in recorded.items() if present.get(name) != size]


def others(step_directory: Path, keep: str) -> list[Path]:
    """The DCP directories of a step other than ``keep``: left by an older or a failed write of the same step."""
    return [p for p in step_directory.glob(f"{PREFIX}*") if p.is_dir() and p.name != keep]
