"""Alerts on throughput: a starving data loader, idle GPUs, straggling ranks and checkpoints that hold training."""

from __future__ import annotations

from .config import Config
from .promql import (
    GPU,
    INSTANCE,
    PERCENT,
    RANK,
    RUN,
    VALUE,
    Alert,
    Group,
    gpu_utilization,
    num,
    on_rank,
    rank_labels,
    run_labels,
    sel,
    unless_halted,
    uuid_of,
)
from .recording import COMPUTE_RATIO, LOADER_WAIT_RANK_2M, STRAGGLER_RATIO


def group(cfg: Config) -> Group:
    rank_on = rank_labels(cfg)
    run_on = run_labels(cfg)
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    w = cfg.gpu_underutilized_window
    idle = (
        on_rank(cfg, f"{gpu_utilization(cfg, w)} < {num(cfg.gpu_underutilized_ratio)}")
        + f"\nand on ({rank_on})\n({s('trainpatrol_rank_up')} == 1)"
        # A paused, stopping or closed run idles its GPUs on purpose.
        + "\n" + unless_halted(run_on, w)
    )
    # Every throughput ratio judges a run that trains: none while any rank of it is paused, stopping,
    # stopped, closed or down, nor for as long as the ratio's window still holds such a time.
    loader = f"{LOADER_WAIT_RANK_2M} > {num(cfg.loader_wait_ratio)}\n" + unless_halted(run_on, "2m")
    # A rank's compute time where it measures one (CPU ranks); its step time otherwise, which lock-step
    # parallelism evens out.
    ratio = num(cfg.straggler_ratio)
    straggler = (f"(\n  {COMPUTE_RATIO} > {ratio}\n  or\n  ({STRAGGLER_RATIO} > {ratio}\n"
                 f"  unless on ({rank_on}) {COMPUTE_RATIO})\n)\n" + unless_halted(run_on, "5m"))
    who = f"Rank {RANK} of run {RUN} on {INSTANCE}"
    cb = cfg.checkpoint_blocked_window
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
            f"GPU {GPU} ({uuid_of(cfg)}) on {INSTANCE}, used by rank {RANK} of run {RUN}, ran kernels only {PERCENT} "
            f"of the time over the last {w} (threshold {num(cfg.gpu_underutilized_ratio * 100)}%).",
        ),
        Alert(
            "Straggler", straggler, "warning",
            "A rank is slower than the rest of its run.",
            f"{who} takes {VALUE} times the run's median compute time, or step time where it measures no "
            f"compute time (means over 5m; threshold {num(cfg.straggler_ratio)}).",
        ),
        Alert(
            "CheckpointsBlockTraining",
            f"rate({s('trainpatrol_checkpoint_blocked_seconds_total')}[{cb}]) > {num(cfg.checkpoint_blocked_ratio)}",
            "warning",
            "Checkpoints hold training for too much of its time.",
            f"{who} spent {PERCENT} of the last {cb} waiting for checkpoints (threshold "
            f"{num(cfg.checkpoint_blocked_ratio * 100)}%).",
        ),
    )
    return Group("trainpatrol-throughput", rules)
