"""Alerts on throughput: a starving data loader, idle GPUs, straggling ranks and checkpoints that hold training."""

from __future__ import annotations

from .config import Config
from .promql import (
    INSTANCE,
    PERCENT,
    RANK,
    RUN,
    VALUE,
    Alert,
    Group,
    Recording,
    dcgm_gpu_labels,
    dsel,
    gpu_utilization,
    indent,
    num,
    on_rank,
    rank_labels,
    rate_ratio,
    run_labels,
    sel,
    unless_halted,
)
from .recording import COMPUTE_MEDIAN_RUN, STEP_MEAN_RANK, compute_mean, compute_median, mfu

MEASURE = "{{ $labels.measure }}"
"""What GPUUnderutilized judged the rank by: ``model FLOPs utilisation``, ``SM activity`` or ``kernel time``."""


def sm_clause(cfg: Config) -> str:
    return f", else SM activity {num(cfg.sm_active_underutilized_ratio * 100)}%" if cfg.gpu_source == "dcgm" else ""


def underused(cfg: Config, w: str) -> str:
    """Ranks whose GPU does little of the work it could over ``w``, each labelled with the ``measure`` it was judged
    by: its model FLOPs utilisation where its run gives its FLOPs and the peak is known (NVML's utilisation counts
    any kernel running, however few SMs it keeps busy); else, with DCGM, the SM activity
    (``DCGM_FI_PROF_SM_ACTIVE``, where dcgm-exporter's profiling fields are on); else the share of time any kernel
    ran."""
    rank_on = rank_labels(cfg)
    mfu_w = f"(\n{indent(mfu(cfg, w))}\n)"
    by_mfu = f"{mfu_w}\n< {num(cfg.mfu_underutilized_ratio)}"
    kernel_time = f"{gpu_utilization(cfg, w)} < {num(cfg.gpu_underutilized_ratio)}"
    fallbacks = [("kernel time", kernel_time)]
    if cfg.gpu_source == "dcgm":
        sm_active = dsel(cfg, "DCGM_FI_PROF_SM_ACTIVE")
        fallbacks = [("SM activity", f"avg_over_time({sm_active}[{w}]) < {num(cfg.sm_active_underutilized_ratio)}"),
                     ("kernel time", f"{kernel_time}\nunless on ({dcgm_gpu_labels(cfg)})\n{sm_active}")]
    branches = [labelled("model FLOPs utilisation", by_mfu)] + [
        labelled(name, f"(\n{indent(on_rank(cfg, expr))}\n)\nunless on ({rank_on})\n{mfu_w}")
        for name, expr in fallbacks]
    return "\nor\n".join(branches)


def labelled(measure: str, expr: str) -> str:
    return f'label_replace(\n{indent(expr)},\n  "measure", "{measure}", "", ""\n)'


def group(cfg: Config) -> Group:
    rank_on = rank_labels(cfg)
    run_on = run_labels(cfg)
    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    w = cfg.gpu_underutilized_window
    idle = (f"(\n{indent(underused(cfg, w))}\n)\nand on ({rank_on})\n({s('trainpatrol_rank_up')} == 1)"
            # A paused, stopping or closed run idles its GPUs on purpose.
            + "\n" + unless_halted(run_on, w))
    # Every throughput ratio judges a run that trains: none while any rank of it is paused, stopping,
    # stopped, closed or down, nor for as long as the ratio's window still holds such a time.
    loader_ratio = rate_ratio(cfg, "trainpatrol_loader_wait_seconds_total", "trainpatrol_step_duration_seconds_sum",
                              "2m")
    loader = f"(\n{indent(loader_ratio)}\n)\n> {num(cfg.loader_wait_ratio)}\n" + unless_halted(run_on, "2m")
    # A rank's mean over its run's median rank (1.5: half as slow again): its compute time where it measures
    # one, its step time otherwise, which lock-step parallelism evens out. Each median is of the same instant's
    # means: the step median taken here, the compute median recorded by this group just before (one recorded by
    # another group can be an interval old, and when every rank's mean jumps at once that puts every rank past
    # the threshold).
    def over_median(per_rank: str, median: str) -> str:
        return f"{per_rank}\n/ on ({run_on}) group_left ()\n({median} > 0)"
    compute = over_median(f"(\n{indent(compute_mean(cfg))}\n)", COMPUTE_MEDIAN_RUN)
    step = over_median(STEP_MEAN_RANK, f"quantile by ({run_on}) (0.5, {STEP_MEAN_RANK})")
    ratio = num(cfg.straggler_ratio)
    straggler = (f"(\n  (\n{indent(compute, '    ')}\n  ) > {ratio}\n  or\n  (\n"
                 f"{indent(step, '    ')}\n  ) > {ratio}\n"
                 f"  unless on ({rank_on}) {sel(cfg, 'trainpatrol_compute_seconds_total')}\n)\n"
                 + unless_halted(run_on, "5m"))
    who = f"Rank {RANK} of run {RUN} on {INSTANCE}"
    cb = cfg.checkpoint_blocked_window
    rules = (
        Recording(COMPUTE_MEDIAN_RUN, compute_median(cfg)),
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
            "A training GPU does little of the work it could.",
            f"{who}{{{{ with $labels.gpu }}}} (GPU {{{{ . }}}}){{{{ end }}}}: {MEASURE} {PERCENT} over the last {w} "
            f"(thresholds: model FLOPs utilisation {num(cfg.mfu_underutilized_ratio * 100)}% where the run gives its "
            f"FLOPs{sm_clause(cfg)}, else kernel time {num(cfg.gpu_underutilized_ratio * 100)}%).",
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
