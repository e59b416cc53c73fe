"""The DataLoader settings checklist: pure, without torch, so the report (which shows it) runs without torch.

Feeds ``trainpatrol_dataloader_info`` and ``trainpatrol_dataloader_warning{check}`` through the probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
