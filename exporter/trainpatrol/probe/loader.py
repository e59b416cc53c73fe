"""Times the wait for each batch and audits the DataLoader's settings.

Feeds ``trainpatrol_loader_wait_seconds_total``, ``trainpatrol_loader_wait_ratio``,
``trainpatrol_dataloader_info`` and ``trainpatrol_dataloader_warning{check}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

ADVICE = {
    "num_workers_zero": "num_workers=0 loads batches on the training thread; use 4-8 workers per GPU.",
    "pin_memory_off": "pin_memory=False on CUDA makes host-to-device copies synchronous and slower.",
    "persistent_workers_off": "persistent_workers=False re-forks the workers at every epoch.",
    "prefetch_factor_low": "prefetch_factor below 2 leaves the GPU waiting when one batch is slow.",
}


@dataclass
class LoaderAudit:
    info: dict[str, str] = field(default_factory=dict)
    warnings: dict[str, str] = field(default_factory=dict)


def audit(loader: Any, on_cuda: bool) -> LoaderAudit | None:
    """The seed checklist on a torch DataLoader; None for any other iterable."""
    if not hasattr(loader, "num_workers") or not hasattr(loader, "pin_memory"):
        return None
    workers = int(loader.num_workers)
    prefetch = getattr(loader, "prefetch_factor", None)
    result = LoaderAudit(info={
        "num_workers": str(workers), "pin_memory": str(bool(loader.pin_memory)).lower(),
        "persistent_workers": str(bool(getattr(loader, "persistent_workers", False))).lower(),
        "prefetch_factor": "" if prefetch is None else str(prefetch),
        "batch_size": "" if getattr(loader, "batch_size", None) is None else str(loader.batch_size),
    })
    checks = {
        "num_workers_zero": workers == 0,
        "pin_memory_off": on_cuda and not loader.pin_memory,
        "persistent_workers_off": workers > 0 and not getattr(loader, "persistent_workers", False),
        "prefetch_factor_low": workers > 0 and prefetch is not None and int(prefetch) < 2,
    }
    result.warnings = {k: ADVICE[k] for k, bad in checks.items() if bad}
    return result


class TimedLoader(Iterable[T]):
    """Iterates ``loader``; calls ``boundary()`` before each fetch and reports each fetch's wait."""

    def __init__(self, loader: Iterable[T], boundary: Callable[[], None], waited: Callable[[float], None]) -> None:
        self._loader = loader
        self._boundary = boundary
        self._waited = waited

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        it = iter(self._loader)
        while True:
            self._boundary()
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._waited(time.perf_counter() - start)
            yield batch
