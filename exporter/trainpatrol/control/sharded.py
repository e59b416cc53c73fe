"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP).

A model that holds DTensors (FSDP2's ``fully_shard``, tensor parallel) has no whole state on any one
rank: every rank writes its own shards, and a restore reads them back, resharded where the world size
changed. ``get_state_dict``/``set_state_dict`` give DCP the model's and optimizer's state in the
form it saves and loads (the optimizer's lazy state is created first, so a fresh process can load into it).
"""

from __future__ import annotations

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
