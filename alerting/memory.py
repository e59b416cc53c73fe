"""Alerts on the CUDA caching allocator: fragmentation, alloc retries and OOM risk."""

from __future__ import annotations

from .config import Config
from .promql import COUNT, INSTANCE, PERCENT, RANK, RUN, Alert, Group, increased, indent, num, rank_labels, sel


def group(cfg: Config) -> Group:
    rank_on = rank_labels(cfg)
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    # The ratio is unusable-at-peak / reserved: reserved bytes beyond the highest allocation peak,
    # which no allocation of the run could use. Not (reserved - allocated) / reserved read after
    # backward: that is the activation cache of a healthy run (0.70 on GPT-2-124M bf16, H200).
    # Much of much unusable, or some while cudaMalloc keeps retrying (which stalls steps). Both
    # sides keep the ratio's value and labels, so ``or`` yields one series per rank.
    ratio = s("trainpatrol_cuda_memory_fragmentation_ratio")
    retrying = increased(cfg, s("trainpatrol_cuda_alloc_retries_total"), cfg.alloc_retries_window)
    fragmentation = (
        f"(\n  {ratio} > {num(cfg.fragmentation_ratio)}\n"
        f"  and on ({rank_on})\n"
        f"  {s('trainpatrol_cuda_memory_reserved_bytes')} > {num(cfg.fragmentation_min_reserved_bytes)}\n)\n"
        f"or on ({rank_on})\n"
        f"(\n  {ratio} > {num(cfg.fragmentation_retrying_ratio)}\n"
        f"  and on ({rank_on})\n  (\n{indent(retrying, '    ')}\n  )\n)"
    )
    retries = increased(
        cfg, s("trainpatrol_cuda_alloc_retries_total"), cfg.alloc_retries_window, cfg.alloc_retries_threshold
    )
    # The left side wins where both hold (``or`` matches label sets without the metric name), so
    # each rank yields one alert.
    oom = (
        f"{s('trainpatrol_cuda_memory_used_ratio')} > {num(cfg.oom_used_ratio)}\n"
        # the peak over the probe's window, so an OOM-sized spike between two scrapes still shows
        f"or\n(\n  {s('trainpatrol_cuda_memory_peak_allocated_bytes')}\n  / on ({rank_on})\n"
        f"  ({s('trainpatrol_cuda_memory_capacity_bytes')} > 0)\n) > {num(cfg.oom_used_ratio)}"
    )
    who = f"Rank {RANK} of run {RUN} on {INSTANCE}"
    gib = num(cfg.fragmentation_min_reserved_bytes / 1024**3)
    rules = (
        Alert(
            "MemoryFragmentationHigh", fragmentation, "warning",
            "The CUDA caching allocator is fragmented.",
            f"{who}: {PERCENT} of its reserved CUDA memory stayed unusable even at the allocation peak "
            f"(threshold {num(cfg.fragmentation_ratio * 100)}% with more than {gib} GiB reserved, or "
            f"{num(cfg.fragmentation_retrying_ratio * 100)}% while cudaMalloc retries). "
            "trainpatrol empties the allocator cache at the next step boundary.",
            action="empty_cache",
        ),
        Alert(
            "AllocRetries", retries, "warning",
            "The CUDA allocator keeps retrying allocations.",
            f"{who}: {COUNT} cudaMalloc retries in the last {cfg.alloc_retries_window}. Each one freed "
            "the allocator cache and stalled the step. trainpatrol captures the allocator state.",
            action="capture",
        ),
        Alert(
            "OOMRisk", oom, "critical",
            "The rank is close to running out of GPU memory.",
            f"{who} uses {PERCENT} of its device memory (allocated, or the recent peak, over capacity; "
            f"threshold {num(cfg.oom_used_ratio * 100)}%). trainpatrol checkpoints the run before an OOM can "
            "lose the progress.",
            action="checkpoint",
        ),
    )
    return Group("trainpatrol-memory", rules)
