"""Alerts on throughput: a starving data loader, idle GPUs and straggling ranks."""

from __future__ import annotations

from .config import Config
from .promql import (
    GPU,
    INSTANCE,
    PERCENT,
    RANK,
    RANK_ON,
    RUN,
    RUN_ON,
    UUID,
    VALUE,
    Alert,
    Group,
    num,
    on_rank,
    sel,
    unless_halted,
)
from .recording import LOADER_WAIT_RANK_2M, STRAGGLER_RATIO


def group(cfg: Config) -> Group:
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    w = cfg.gpu_underutilized_window
    idle = (
        on_rank(
            f"avg_over_time({s('trainpatrol_gpu_utilization_ratio')}[{w}]) < {num(cfg.gpu_underutilized_ratio)}"
        )
        + f"\nand on ({RANK_ON})\n({s('trainpatrol_rank_up')} == 1)"
        # A paused, stopping or closed run idles its GPUs on purpose.
        + "\n" + unless_halted(RUN_ON, w)
    )
    # Every throughput ratio judges a run that trains: none while any rank of it is paused, stopping,
    # stopped, closed or down, nor for as long as the ratio's window still holds such a time.
    loader = f"{LOADER_WAIT_RANK_2M} > {num(cfg.loader_wait_ratio)}\n" + unless_halted(RUN_ON, "2m")
    straggler = f"{STRAGGLER_RATIO} > {num(cfg.straggler_ratio)}\n" + unless_halted(RUN_ON, "5m")
    who = f"Rank {RANK} of run {RUN} on {INSTANCE}"
    rules = (
        Alert(
            "DataLoaderBound", loader, "warning",
            "Training waits for the data loader.",
            f"{who} spends {PERCENT} of its step time waiting for the next batch (over the last 2m; "
            f"threshold {num(cfg.loader_wait_ratio * 100)}%). trainpatrol captures evidence: the all-thread "
            "stacks show where the input pipeline waits.",
            action="capture",
        ),
        Alert(
            "GPUUnderutilized", idle, "info",
            "A training GPU is mostly idle.",
            f"GPU {GPU} ({UUID}) on {INSTANCE}, used by rank {RANK} of run {RUN}, ran kernels only {PERCENT} "
            f"of the time over the last {w} (threshold {num(cfg.gpu_underutilized_ratio * 100)}%).",
        ),
        Alert(
            "Straggler", straggler, "warning",
            "A rank is slower than the rest of its run.",
            f"{who} takes {VALUE} times the run's median step time (means over 5m; threshold "
            f"{num(cfg.straggler_ratio)}).",
        ),
    )
    return Group("trainpatrol-throughput", rules)
