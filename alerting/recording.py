"""Recording rules: per-rank and per-run aggregates that alerts and dashboards share.

Names follow ``level:metric:operations`` (level ``run`` = by cluster, namespace, job and run,
``run_rank`` = one series per rank, ``instance_uuid`` = one per NVML GPU, ``cluster_uuid`` = one per
GPU UUID, the DCGM join table). Windows are fixed in every profile and named (5 m), so a name never lies
about its window. A series is recorded per rank only where the rollups, dashboards or several rules share
it: each costs a series a rank (1,024 on a 1,024-rank run), so a ratio that one alert reads is worked out
in that alert.

A ratio is defined only where its denominator is positive: each divisor is filtered with ``> 0``, so
a ratio is absent, never NaN or +Inf, before a rank's first step completes, while it does not step,
or on a device that reports no capacity (+Inf passes every ``>`` threshold: it made
TrainPatrolDataLoaderBound pending at every run start).
"""

from __future__ import annotations

from .config import Config
from .promql import (
    DCGM_NEWEST_RANK,
    DCGM_RANK_COPIED,
    DCGM_RANK_INFO,
    RANK_COPIED,
    RANK_HALTED,
    RANK_INFO,
    RANK_ODD,
    RANK_STALLED,
    RANK_STATE_HALTED,
    STALL_PHASES,
    Group,
    Recording,
    dcgm_gpu_labels,
    gpu_labels,
    gpu_utilization,
    indent,
    on_rank,
    rank_labels,
    rate_ratio,
    run_labels,
    sel,
)

LOADER_WAIT_RUN = "run:trainpatrol_loader_wait_seconds_per_step_seconds:ratio_rate5m"
STEP_MEAN_RANK = "run_rank:trainpatrol_step_duration_seconds:mean5m"
STEP_MEDIAN_RUN = "run:trainpatrol_step_duration_seconds:median_mean5m"
COMPUTE_MEDIAN_RUN = "run:trainpatrol_compute_seconds_per_step:median_mean5m"
STEP_RATE_RUN = "run:trainpatrol_step:max_rate5m"
FLOPS_RUN = "run:trainpatrol_model_flops:rate5m"
MFU_MEDIAN_RUN = "run:trainpatrol_mfu:median_rate5m"
MFU_MIN_RUN = "run:trainpatrol_mfu:min_rate5m"
LOSS_RUN = "run:trainpatrol_loss_window_mean:avg"
VAL_LOSS_RUN = "run:trainpatrol_validation_loss:avg"


def group(cfg: Config) -> Group:
    """Per-rank states and means that the liveness, throughput and rollup rules read, the run's step median, and
    the join table from GPUs to ranks."""
    rank_on = rank_labels(cfg)
    run_on = run_labels(cfg)
    gpu_on = gpu_labels(cfg)

    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    with_gpu = s("trainpatrol_rank_info", 'gpu_uuid!=""')
    rank_info = f'label_replace({with_gpu}, "uuid", "$1", "gpu_uuid", "(.+)")'
    halted_state = s("trainpatrol_rank_state")
    rules = (
        # Ranks that do not train on purpose (or are gone): liveness and progress alerts skip them.
        Recording(
            RANK_HALTED,
            f"max by ({rank_on}) (\n"
            f"  {halted_state} >= {RANK_STATE_HALTED}\n  or\n"
            f"  1 - {s('trainpatrol_rank_up')} > 0\n)",
        ),
        # Ranks that Patrol found stuck, by phase: RankHung names the odd one; other alerts look away.
        Recording(RANK_STALLED, f"{s('trainpatrol_rank_stalled_phase')} > 0"),
        Recording(RANK_ODD, _odd_ranks(run_on)),
        Recording(
            STEP_MEAN_RANK,
            rate_ratio(cfg, "trainpatrol_step_duration_seconds_sum", "trainpatrol_step_duration_seconds_count", "5m"),
        ),
        Recording(STEP_MEDIAN_RUN, f"quantile by ({run_on}) (0.5, {STEP_MEAN_RANK})"),
        # The join table from GPUs to ranks: every rank on each GPU (alerting/promql.py, RANK_INFO).
        *((_dcgm_join(cfg, with_gpu, rank_on), _dcgm_newest(cfg, with_gpu, rank_on)) if cfg.gpu_source == "dcgm"
          else (_join(cfg, rank_info, gpu_on, rank_on),)),
    )
    return Group("trainpatrol-recording", rules)


def run_group(cfg: Config) -> Group:
    """The run's throughput, utilisation and loss, across its ranks: for dashboards and the slower alerts
    (LossStagnation, ValLossDiverging). A group apart from the per-rank states and means that the fast alerts
    read, so neither waits for the other; it reads the GPU join table one interval behind."""
    run_on = run_labels(cfg)

    def s(metric: str, *matchers: str) -> str:
        return sel(cfg, metric, *matchers)

    def ratio_by_run(num: str, den: str) -> str:
        return (
            f"sum by ({run_on}) (rate({s(num)}[5m]))\n/ on ({run_on})\n"
            f"(sum by ({run_on}) (rate({s(den)}[5m])) > 0)"
        )

    def run_rate(metric: str, agg: str = "sum") -> str:
        return f"{agg} by ({run_on}) (rate({s(metric)}[5m]))"

    def run_quantile(q: float) -> str:  # interpolates within the buckets: NaN where no step completed
        return (
            f"histogram_quantile(\n  {q},\n"
            f"  sum by ({run_on}, le) (rate({s('trainpatrol_run_step_duration_seconds_bucket')}[5m]))\n"
            f"  and on ({run_on})\n"
            f"  (sum by ({run_on}) (rate({s('trainpatrol_run_step_duration_seconds_count')}[5m])) > 0)\n)"
        )

    rules = (
        # The run's sums read the counters each agent serves once per run, its ranks' summed: a few series instead
        # of a rate of every rank's.
        # Time waiting for data over step time, of the whole run: above about 0.3 the GPUs starve (a rank's own is
        # its trainpatrol_loader_wait_ratio; TrainPatrolDataLoaderBound reads a 2 m ratio of its own).
        Recording(
            LOADER_WAIT_RUN,
            ratio_by_run("trainpatrol_run_loader_wait_seconds_total", "trainpatrol_run_step_duration_seconds_sum"),
        ),
        # Throughput of the whole run: every rank counts the samples and tokens it consumed.
        Recording("run:trainpatrol_samples:rate5m", run_rate("trainpatrol_run_samples_total")),
        Recording("run:trainpatrol_tokens:rate5m", run_rate("trainpatrol_run_tokens_total")),
        # Optimizer steps per second of the run: ranks step together, so the fastest one counts.
        Recording(STEP_RATE_RUN, run_rate("trainpatrol_step_total", "max")),
        Recording("run:trainpatrol_step_duration_seconds:p50_rate5m", run_quantile(0.5)),
        Recording("run:trainpatrol_step_duration_seconds:p90_rate5m", run_quantile(0.9)),
        Recording(
            "run:trainpatrol_gpu_utilization_ratio:avg",
            f"avg by ({run_on}) (\n{indent(on_rank(cfg, gpu_utilization(cfg)))}\n)",
        ),
        # What the run's GPUs achieve: model FLOP/s (from each agent's sums), and MFU (over the device's dense peak),
        # per rank worked out here and not recorded; the run's median and lowest rank are.
        Recording(FLOPS_RUN, f"sum by ({run_on}) (\n{indent(achieved_flops(cfg, per_agent=True))}\n)"),
        Recording(MFU_MEDIAN_RUN, f"quantile by ({run_on}) (\n  0.5,\n{indent(mfu(cfg))}\n)"),
        Recording(MFU_MIN_RUN, f"min by ({run_on}) (\n{indent(mfu(cfg))}\n)"),
        Recording("run:trainpatrol_tokens_per_rank:median_rate5m",
                  f"quantile by ({run_on}) (0.5, rate({s('trainpatrol_tokens_total')}[5m]))"),
        Recording("run:trainpatrol_samples_per_rank:median_rate5m",
                  f"quantile by ({run_on}) (0.5, rate({s('trainpatrol_samples_total')}[5m]))"),
        Recording(LOSS_RUN, f"avg by ({run_on}) ({s('trainpatrol_loss_window_mean')})"),
        Recording(VAL_LOSS_RUN, f"avg by ({run_on}) ({s('trainpatrol_validation_loss')})"),
    )
    return Group("trainpatrol-run", rules)


def achieved_flops(cfg: Config, window: str = "5m", per_agent: bool = False) -> str:
    """Each rank's model FLOP/s over ``window``: its tokens (or steps) per second times the run's FLOPs per token
    (or step), which its agent serves once per run; ``per_agent``: the sum over each agent's ranks of the run, from
    the counters it sums (its run histogram's count is their steps)."""
    agent_run = f"{cfg.cluster_label}, namespace, job, instance, run"
    tokens, steps = (("trainpatrol_run_tokens_total", "trainpatrol_run_step_duration_seconds_count") if per_agent
                     else ("trainpatrol_tokens_total", "trainpatrol_step_total"))
    def times(counter: str, per: str) -> str:
        return f"rate({sel(cfg, counter)}[{window}])\n* on ({agent_run}) group_left ()\n{sel(cfg, per)}"
    return (f"{times(tokens, 'trainpatrol_run_model_flops_per_token')}\nor\n"
            f"{times(steps, 'trainpatrol_run_model_flops_per_step')}")


def mfu(cfg: Config, window: str = "5m") -> str:
    """Each rank's model FLOPs utilisation over ``window``: its model FLOP/s over its GPUs' dense peak in the dtype
    it computes in; none where the run gives no FLOPs or the peak is unknown."""
    agent_run = f"{cfg.cluster_label}, namespace, job, instance, run"
    return (f"(\n{indent(achieved_flops(cfg, window))}\n)\n/ on ({agent_run}) group_left ()\n"
            f"max without (dtype) ({sel(cfg, 'trainpatrol_run_peak_flops')} > 0)")


def compute_median(cfg: Config) -> str:
    """The run's median of its ranks' mean compute time a step (COMPUTE_MEDIAN_RUN): under DDP every rank waits for
    the slowest at the all-reduce, so step times even out; a slow rank's compute time still stands out from it.
    Recorded in the throughput group, just before TrainPatrolStraggler reads it at the same instant."""
    return f"quantile by ({run_labels(cfg)}) (\n  0.5,\n{indent(compute_mean(cfg))}\n)"


def compute_mean(cfg: Config) -> str:
    """Each rank's mean compute time a step over 5 m (where its compute clock measures one): read by the run's
    median and by TrainPatrolStraggler, not recorded per rank."""
    return rate_ratio(cfg, "trainpatrol_compute_seconds_total", "trainpatrol_step_total", "5m")


def _odd_ranks(run_on: str) -> str:
    """The stalled ranks whose phase fewer of their run's stalled ranks share than its most common one."""
    by_phase = f'count_values by ({run_on}) ("phase", {RANK_STALLED})'
    odd = (
        f'count_values without () ("phase", {RANK_STALLED})\n'
        f"* on ({run_on}, phase) group_left ()\n{by_phase}\n"
        f"< on ({run_on}) group_left ()\nmax by ({run_on}) ({by_phase})"
    )
    for code, name in enumerate(STALL_PHASES[1:], 1):
        odd = f'label_replace(\n{odd},\n"phase", "{name}", "phase", "{code}")'
    return odd


def _every_rank(cfg: Config, rank_info: str, on: str, copied: str, rank_on: str) -> str:
    """Every live rank on each GPU (``on``), and on a GPU without a live one every rank that still has
    its series (a run that the GPU's fault killed is still named), labelled only by the GPU's identity
    and ``copied``: the join tables of ``promql.on_rank``."""
    live = f"{rank_info}\n* on ({rank_on}) group_left ()\n({sel(cfg, 'trainpatrol_rank_up')} == 1)"
    return (
        f"max by ({on}, {copied}) (\n{indent(live)}\n)\nor on ({on})\n"
        f"max by ({on}, {copied}) (\n{indent(rank_info)}\n)"
    )


def _join(cfg: Config, rank_info: str, gpu_on: str, rank_on: str) -> Recording:
    return Recording(RANK_INFO, _every_rank(cfg, rank_info, gpu_on, RANK_COPIED, rank_on))


def _dcgm_join(cfg: Config, with_gpu: str, rank_on: str) -> Recording:
    """The join table from dcgm-exporter's GPUs (``UUID``) to every rank that uses each of them."""
    rank_info = f'label_replace({with_gpu}, "UUID", "$1", "gpu_uuid", "(.+)")'
    return Recording(DCGM_RANK_INFO, _every_rank(cfg, rank_info, dcgm_gpu_labels(cfg), DCGM_RANK_COPIED, rank_on))


def _dcgm_newest(cfg: Config, with_gpu: str, rank_on: str) -> Recording:
    """For the DCGM dashboard only (no alert reads it): one rank per GPU, the one that pushed last. A
    plain ``group_left`` onto ``trainpatrol_rank_info`` fails with many-to-many while an older run's
    rank_info for the same GPU is still alive (until the agent expires it)."""
    newest = f"{with_gpu}\n* on ({rank_on}) group_left ()\n{sel(cfg, 'trainpatrol_rank_last_push_timestamp_seconds')}"
    return Recording(
        DCGM_NEWEST_RANK,
        "label_replace(\n  clamp_max(\n"
        f"    topk by ({cfg.cluster_label}, gpu_uuid) (1,\n{indent(newest, '      ')}\n    ),\n    1\n  ),\n"
        '  "UUID", "$1", "gpu_uuid", "(.+)"\n)',
    )


ROLLUP_QUANTITIES = (
    # (the per-rank series, its name in rollups, its window (none for a gauge), what its top ranks are called)
    (STEP_MEAN_RANK, "trainpatrol_step_duration_seconds", "mean5m", "slowest"),
    ("trainpatrol_loader_wait_ratio", "trainpatrol_loader_wait_ratio", "", "most_waiting"),
    ("trainpatrol_grad_norm", "trainpatrol_grad_norm", "", "largest"),
    ("trainpatrol_cuda_memory_used_ratio", "trainpatrol_cuda_memory_used_ratio", "", "fullest"),
)
OUTLIER_COUNT = 3
"""Ranks each outlier rule names per run: enough to see whether one rank or a group stands out."""


def rollups(cfg: Config) -> Group:
    """Per run and per node (its agent, the series' ``instance``; no join to ``trainpatrol_rank_info``): min,
    median and max across ranks of step time, loader wait, grad norm and memory used; per run the ranks that
    stand out (``run_rank:<metric>:outlier_<what>``, the top ``OUTLIER_COUNT``).
    Dashboards and a 1,024-rank run read these instead of one line per rank. Evaluated in a group of their own,
    after the per-rank means of ``trainpatrol-recording`` (one interval behind them)."""
    run_on = run_labels(cfg)
    rules: list[Recording] = []
    for source, name, window, outlier in ROLLUP_QUANTITIES:
        per_rank = sel(cfg, source) if source.startswith("trainpatrol_") else source
        suffix = f"_{window}" if window else ""
        for agg, expr in (("min", f"min by ({run_on}) ({per_rank})"),
                          ("median", f"quantile by ({run_on}) (0.5, {per_rank})"),
                          ("max", f"max by ({run_on}) ({per_rank})")):
            if (agg, name) != ("median", "trainpatrol_step_duration_seconds"):  # STEP_MEDIAN_RUN already is
                rules.append(Recording(f"run:{name}:{agg}{suffix}", expr))
        for agg in ("min", "max"):  # a node's ranks push to its agent: the node is the series' instance
            rules.append(Recording(f"run_instance:{name}:{agg}{suffix}", f"{agg} by ({run_on}, instance) ({per_rank})"))
        rules.append(Recording(f"run_rank:{name}:outlier_{outlier}",
                               f"topk by ({run_on}) ({OUTLIER_COUNT}, {per_rank})"))
    return Group("trainpatrol-rollups", tuple(rules))
