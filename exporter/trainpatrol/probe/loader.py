"""Times the wait for each batch, keeps the loader's position for an exact resume, audits its settings.

Feeds ``trainpatrol_loader_wait_seconds_total``, ``trainpatrol_loader_wait_ratio``,
``trainpatrol_dataloader_info`` and ``trainpatrol_dataloader_warning{check}``.

A shuffled DataLoader draws its order (and its workers' seeds) from torch's RNG when an epoch's
iterator starts. So the position a checkpoint keeps is the epoch, the batches handed out in it and
the RNG as that epoch started; a restored run replays the epoch's start from that RNG, skips the
batches already trained on, then takes the RNG the checkpoint saved, and continues bit for bit.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..control.checkpoint import rng_state, set_rng_state

log = logging.getLogger("trainpatrol")

T = TypeVar("T")

@dataclass
class LoaderPosition:
    epoch: int = -1
    """Epochs started before the current one (-1: none started)."""
    batches: int = 0
    """Batches handed out in the current epoch."""
    rng: dict[str, Any] = field(default_factory=dict)
    """The RNG states the epoch's iterator and sampler draw from, as the epoch started."""


def _generators(loader: Any) -> dict[str, torch.Generator]:
    found = {"loader": getattr(loader, "generator", None),
             "sampler": getattr(getattr(loader, "sampler", None), "generator", None)}
    return {k: g for k, g in found.items() if isinstance(g, torch.Generator)}


def epoch_rng(loader: Any) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), **{k: g.get_state() for k, g in _generators(loader).items()}}


def set_epoch_rng(loader: Any, rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    for k, g in _generators(loader).items():
        if k in rng:
            g.set_state(rng[k])


def fast_forward(it: Iterator[Any], loader: Any, batches: int) -> None:
    """Skip ``batches``: by index alone where batches are built on this thread from a map-style dataset
    (nothing is loaded), by fetching where workers (whose RNG advances with each item) build them."""
    by_index = getattr(loader, "num_workers", 1) == 0 and hasattr(it, "_next_index") and \
        not isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
    for _ in range(batches):
        if by_index:
            it._next_index()  # type: ignore[attr-defined]
        else:
            next(it)


class LoaderTracker:
    """The position of the loader Patrol times, and a position to resume at (set by ``restore``)."""

    def __init__(self) -> None:
        self.position = LoaderPosition()
        self.resume_at: tuple[LoaderPosition, Callable[[], None]] | None = None
        """A restored position and what restores the checkpoint's RNG once the loader is back there."""
        self._iterator: Callable[[], Any] = lambda: None
        """The current epoch's iterator, weakly: its worker processes are read for host memory (host_memory.py)."""

    def iterator(self) -> Any:
        """The iterator of the epoch being trained on, while it exists (None otherwise)."""
        return self._iterator()

    def state(self) -> dict[str, Any] | None:
        p = self.position
        return None if p.epoch < 0 else {"epoch": p.epoch, "batches": p.batches, "rng": p.rng}

    def restore(self, state: dict[str, Any] | None, restore_rng: Callable[[], None]) -> int:
        """Resume at ``state`` when the loader next starts an epoch; returns its epoch (0 without one)."""
        if state is None:
            self.resume_at = None
            return 0
        self.resume_at = (LoaderPosition(int(state["epoch"]), int(state["batches"]), state["rng"]), restore_rng)
        return int(state["epoch"])

    def start_epoch(self, loader: Any) -> Iterator[Any]:
        """The iterator of a new epoch, at the restored position if there is one."""
        resume, self.resume_at = self.resume_at, None
        if resume is None:
            self.position = LoaderPosition(self.position.epoch + 1, 0, epoch_rng(loader))
            return self._keep(iter(loader))
        at, restore_rng = resume
        set_epoch_rng(loader, at.rng)
        self.position = LoaderPosition(at.epoch, at.batches, at.rng)
        it: Iterator[Any] = self._keep(iter(loader))
        fast_forward(it, loader, at.batches)
        restore_rng()
        log.warning("trainpatrol: data loader resumed at epoch %d after %d batches", at.epoch, at.batches)
        return it

    def _keep(self, it: Iterator[Any]) -> Iterator[Any]:
        try:
            self._iterator = weakref.ref(it)  # never keeps the workers of an abandoned epoch alive
        except TypeError:  # e.g. a list's iterator: no workers to read
            self._iterator = lambda: None
        return it


class TimedLoader(Iterable[T]):
    """Iterates ``loader``; calls ``boundary()`` before each fetch, reports each fetch's wait, keeps the position.

    ``state_dict``/``load_state_dict`` make it a resumable loader for frameworks that save one (Lightning)."""

    def __init__(self, loader: Iterable[T], boundary: Callable[[], None] = lambda: None,
                 fetched: Callable[[float, float], None] = lambda start, end: None,
                 tracker: LoaderTracker | None = None) -> None:
        """``fetched`` takes each fetch's start and end (``time.perf_counter``): the wait, and from the end on
        the wrapper's own time, Patrol's overhead (the boundary charges its own)."""
        self._loader = loader
        self._boundary = boundary
        self._fetched = fetched
        self._tracker = tracker or LoaderTracker()
        self.trained: int | None = None
        """Batches of the current epoch already trained on, when a framework fetches ahead of training (set by
        its callback); ``state_dict`` then saves this position instead of the batches handed out."""

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        it = self._tracker.start_epoch(self._loader)
        position = self._tracker.position
        self.trained = None
        boundary, fetched, clock = self._boundary, self._fetched, time.perf_counter
        while True:
            boundary()
            start = clock()
            try:
                batch = next(it)
            except StopIteration:
                return
            position.batches += 1
            fetched(start, clock())
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position and the RNG now (torch's, Python's, NumPy's, CUDA's): what an exact resume needs."""
        state = self._tracker.state() or {"epoch": 0, "batches": 0, "rng": epoch_rng(self._loader)}
        if self.trained is not None:
            state["batches"] = self.trained
        return {**state, "rng_now": rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` when the next epoch's iterator starts."""
        self._tracker.restore(state, lambda: set_rng_state(state["rng_now"]))
