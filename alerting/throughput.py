"""Alerts on throughput: a starving data loader, idle GPUs and straggling ranks."""

from __future__ import annotations

from .config import Config
from .promql import GPU, INSTANCE, PERCENT, RANK, RANK_ON, RUN, UUID, VALUE, Alert, Group, num, on_rank, sel
from .recording import LOADER_WAIT_RANK, STRAGGLER_RATIO


def group(cfg: Config) -> Group:
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    w = cfg.gpu_underutilized_window
    idle = (
        on_rank(
            f"avg_over_time({s('trainpatrol_gpu_utilization_ratio')}[{w}]) < {num(cfg.gpu_underutilized_ratio)}"
        )
        + f"\nand on ({RANK_ON})\n({s('trainpatrol_rank_up')} == 1)"
        # A paused run idles its GPUs on purpose.
        + f"\nunless on ({RANK_ON})\n(max_over_time({s('trainpatrol_paused')}[{w}]) == 1)"
    )
    who = f"Rank {RANK} of run {RUN} on {INSTANCE}"
    rules = (
        Alert(
            "DataLoaderBound", f"{LOADER_WAIT_RANK} > {num(cfg.loader_wait_ratio)}", "warning",
            "Training waits for the data loader.",
            f"{who} spends {PERCENT} of its step time waiting for the next batch (mean over 5m; "
            f"threshold {num(cfg.loader_wait_ratio * 100)}%).",
        ),
        Alert(
            "GPUUnderutilized", idle, "info",
            "A training GPU is mostly idle.",
            f"GPU {GPU} ({UUID}) on {INSTANCE}, used by rank {RANK} of run {RUN}, ran kernels only {PERCENT} "
            f"of the time over the last {w} (threshold {num(cfg.gpu_underutilized_ratio * 100)}%).",
        ),
        Alert(
            "Straggler", f"{STRAGGLER_RATIO} > {num(cfg.straggler_ratio)}", "warning",
            "A rank is slower than the rest of its run.",
            f"{who} takes {VALUE} times the run's median step time (means over 5m; threshold "
            f"{num(cfg.straggler_ratio)}).",
        ),
    )
    return Group("trainpatrol-throughput", rules)
