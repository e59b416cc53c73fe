"""Reads the CUDA caching allocator from the cheapest source available.

``torch._C._cuda_memoryStats`` returns the allocator's dict as it is; the public ``memory_stats()``
flattens and sorts it, an order of magnitude dearer per call (docs/benchmarks.md). The raw call is
private API, so it is wrapped and falls back to the public one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MemoryReading:
    allocated: float
    reserved: float
    active: float
    inactive_split: float
    peak_allocated: float
    alloc_retries: float
    ooms: float
    capacity: float
    peak_seen: float = 0.0
    """The highest allocator peak Patrol has read in this process: a user's ``reset_peak_memory_stats()``
    lowers ``peak_allocated``, never this (Patrol never resets the user's peaks)."""

    @property
    def unusable_at_peak(self) -> float:
        """Reserved bytes beyond the most ever allocated at once: memory the allocator holds that stayed
        unusable even at the peak. Not ``reserved - allocated`` read after backward, which counts the
        freed activations whose blocks are rightly kept for the next step."""
        return max(0.0, self.reserved - max(self.peak_allocated, self.peak_seen))

    @property
    def fragmentation(self) -> float:
        return self.unusable_at_peak / self.reserved if self.reserved > 0 else 0.0

    @property
    def used_ratio(self) -> float:
        return self.allocated / self.capacity if self.capacity > 0 else 0.0


MemoryReader = Callable[[], MemoryReading | None]


def _raw_stats(index: int) -> dict[str, Any]:
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        try:
            return dict(raw(index))
        except Exception:
            pass
    return _nest(torch.cuda.memory_stats(index))


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Public flat keys ('allocated_bytes.all.current') back into the raw nested shape."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def cuda_reader(device: torch.device) -> MemoryReader:
    index = device.index if device.index is not None else torch.cuda.current_device()
    capacity = float(torch.cuda.get_device_properties(index).total_memory)
    return lambda: from_stats(_raw_stats(index), capacity)


def from_stats(s: dict[str, Any], capacity: float) -> MemoryReading:
    def cur(key: str, field: str = "current") -> float:
        return float(s.get(key, {}).get("all", {}).get(field, 0))

    return MemoryReading(
        allocated=cur("allocated_bytes"), reserved=cur("reserved_bytes"), active=cur("active_bytes"),
        inactive_split=cur("inactive_split_bytes"), peak_allocated=cur("allocated_bytes", "peak"),
        alloc_retries=float(s.get("num_alloc_retries", 0)), ooms=float(s.get("num_ooms", 0)),
        capacity=capacity,
    )


def default_reader(device: torch.device) -> MemoryReader | None:
    return cuda_reader(device) if device.type == "cuda" else None
