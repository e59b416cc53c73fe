"""What a checkpoint holds of the training: the replicated state (model, optimizer, scheduler, scaler),
and per rank the RNG, the loader's position and the caller's extra state. A sharded model's and its
optimizer's state goes through torch.distributed.checkpoint instead (``sharded``), every rank its shards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from . import checkpoint as ckpt
from . import sharded as dcp_state

STATEFUL = ("model", "optimizer", "scheduler", "scaler")


class LoaderPosition(Protocol):
    def state(self) -> dict[str, Any] | None: ...

    def restore(self, state: dict[str, Any] | None, restore_rng: Callable[[], None]) -> int: ...


class TrainingState:
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
                                      (self._format == "auto" and dcp_state.holds_dtensors(model)))

    def sharded_state(self) -> dict[str, Any]:
        objects = self._objects()
        return dcp_state.state(objects["model"], objects["optimizer"])

    def load_sharded(self, where: Path) -> None:
        objects = self._objects()
        dcp_state.load(where, objects["model"], objects["optimizer"])

    def replicated(self, step: int, *, sharded: bool = False) -> dict[str, Any]:
        """What rank 0 saves whole: all of it, or (``sharded``) all but the model and optimizer."""
        state: dict[str, Any] = {"step": step}
        for name, obj in self._objects().items():
            if obj is not None and not (sharded and name in ("model", "optimizer")):
                state[name] = obj.state_dict()
        return state

    def per_rank(self, step: int) -> dict[str, Any]:
        return {"step": step, "rng": ckpt.rng_state(), "loader": self._loader.state(),
                "extra": self.extra_state() if self.extra_state is not None else None}

    def load(self, replicated: dict[str, Any], per_rank: dict[str, Any]) -> int:
        """Loads what the checkpoint holds; returns the loader's epoch."""
        for name, obj in self._objects().items():
            if obj is not None and name in replicated:
                obj.load_state_dict(replicated[name])
        if "rng" in per_rank:
            ckpt.set_rng_state(per_rank["rng"])
        # the loader replays its epoch's start from its own RNG, then the checkpoint's RNG is set again
        epoch = self._loader.restore(per_rank.get("loader"), lambda: ckpt.set_rng_state(per_rank["rng"]))
        if self.load_extra_state is not None and per_rank.get("extra") is not None:
            self.load_extra_state(per_rank["extra"])
        return epoch
