"""What a checkpoint holds of the training: the replicated state (model, optimizer, scheduler, scaler),
and per rank the RNG, the loader's position and the caller's extra state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from . import checkpoint as ckpt

STATEFUL = ("model", "optimizer", "scheduler", "scaler")


class LoaderPosition(Protocol):
    def state(self) -> dict[str, Any] | None: ...

    def restore(self, state: dict[str, Any] | None, restore_rng: Callable[[], None]) -> int: ...


class TrainingState:
    def __init__(self, objects: Callable[[], dict[str, Any]], loader: LoaderPosition,
                 extra_state: Callable[[], dict[str, Any]] | None = None,
                 load_extra_state: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._objects, self._loader = objects, loader
        self.extra_state, self.load_extra_state = extra_state, load_extra_state
        self.best_pending: float | None = None
        """A new best validation loss that the next checkpoint is marked with."""

    def replicated(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {"step": step}
        for name, obj in self._objects().items():
            if obj is not None:
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
