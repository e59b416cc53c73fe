"""The run timeline: data, memory, gradients, loss and step time of each run on one shared time axis.

A run may have 1,024 ranks, so a panel draws per run its lowest, median and highest rank and names its
outlier ranks (common.spread, common.outliers), never a line per rank; the rank variable drills down
to chosen ranks (common.drill).
"""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dm

from dashboards.common import (
    NODES,
    RANK,
    RI,
    RUN,
    TIMES,
    WHERE,
    WHOLE,
    PerRank,
    Q,
    dashboard,
    drill,
    finish,
    gauge,
    gauge_product,
    increase,
    outliers,
    rate,
    row,
    spread,
    state_timeline,
    steps,
    ts,
    value_map,
)

UID = "trainpatrol-run-timeline"
TITLE = "trainpatrol / Run timeline"
ABOUT = ("Each run's data pipeline, CUDA memory, gradients, loss and step time on one time axis with a "
         "shared crosshair: per run its lowest, median and highest rank and its outlier ranks by name, so a "
         "1,024-rank run stays readable; pick ranks in the rank drill-down for a line each. Control actions "
         "are annotations.")

STEP = "trainpatrol_step_duration_seconds"
RUN_STEP = "trainpatrol_run_step_duration_seconds"
# The run's own step histogram (each agent sums its ranks'): no rank label, so the rank drill-down
# cannot narrow it.
RUN_HIST = RUN
RUN_P95 = f"histogram_quantile(0.95, sum by (run, le) (rate({RUN_STEP}_bucket{{{RUN_HIST}}}[{RI}])))"
RUN_MEAN = (f"sum by (run) (rate({RUN_STEP}_sum{{{RUN_HIST}}}[{RI}])) "
            f"/ sum by (run) (rate({RUN_STEP}_count{{{RUN_HIST}}}[{RI}]))")


def _step_mean(sel: str, window: str) -> str:
    return (f"sum by (run, rank) (rate({STEP}_sum{{{sel}}}{window})) "
            f"/ sum by (run, rank) (rate({STEP}_count{{{sel}}}{window}))")


# Mean step time per rank over the rate interval; outliers by the mean over the whole time range.
STEP_MEAN = PerRank(lambda sel: _step_mean(sel, f"[{RI}]"), lambda sel: _step_mean(sel, WHOLE))
# A rank's mean step time over the median rank's of its run (the rank variable does not narrow the
# median): every rank waits for the slowest at each collective.
STRAGGLER = PerRank(
    lambda sel: f"{STEP_MEAN.now(sel)} / on (run) group_left () quantile by (run) (0.5, {STEP_MEAN.now(RUN)})",
    STEP_MEAN.whole,
)
NONFINITE = "trainpatrol_nonfinite_steps_total"

STATES = {"0": ("running", "green"), "1": ("pausing", "yellow"), "2": ("paused", "orange"),
          "3": ("stopping", "purple"), "4": ("stopped", "blue"), "5": ("closed", "#8e8e8e")}
"""trainpatrol_rank_state's values (docs/metrics.md)."""


def build() -> dm.Dashboard:
    d = dashboard(TITLE, UID, ABOUT, NODES)
    d = d.tooltip(dm.DashboardCursorSync.CROSSHAIR).time("now-1h", "now")

    d = d.with_row(row("Data"))
    wait = gauge("trainpatrol_loader_wait_ratio")
    d = d.with_panel(ts(
        "Loader wait ratio",
        "Is the run waiting for its data loader, and which ranks wait most? Share of step time spent "
        "waiting for the next batch: the run's lowest, median and highest rank, and the 3 ranks that "
        "waited most over the time range (dashed: the 30 % alert threshold).",
        [*spread(wait), outliers(wait, "waits most"), drill(wait)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.3, "red")), w=8,
    ))
    for title, metric, what in (("Samples per second", "trainpatrol_samples_total", "samples"),
                                ("Tokens per second", "trainpatrol_tokens_total", "tokens")):
        per_s = rate(metric)
        d = d.with_panel(ts(
            title,
            f"How fast do the run's ranks consume training {what}? The slowest, median and fastest rank "
            f"per second, and the 3 ranks that consumed the fewest {what} over the time range.",
            [*spread(per_s), outliers(per_s, f"fewest {what}", low=True), drill(per_s)],
            unit="short", minimum=0, w=8,
        ))

    d = d.with_row(row("Memory"))
    allocated = gauge_product("trainpatrol_cuda_memory_used_ratio", "trainpatrol_cuda_memory_capacity_bytes")
    reserved = gauge("trainpatrol_cuda_memory_reserved_bytes")
    peak = gauge("trainpatrol_cuda_memory_peak_allocated_bytes", "max")
    capacity = gauge("trainpatrol_cuda_memory_capacity_bytes")
    d = d.with_panel(ts(
        "CUDA memory: allocated, reserved, peak",
        "How much device memory do live tensors hold, how much has the caching allocator reserved, "
        "and how close is the window's peak to the device's capacity? Allocated on the run's lowest, "
        "median and highest rank; the most reserved and the highest peak on any rank against the "
        "smallest capacity; and the 3 ranks with the highest peak over the time range.",
        [
            *spread(allocated, "allocated"),
            *spread(reserved, "reserved", stats=("max",)),
            *spread(peak, "peak", stats=("max",)),
            *spread(capacity, "capacity", stats=("min",)),
            outliers(peak, "peak (most memory)"),
            drill(allocated, "allocated"),
            drill(reserved, "reserved"),
            drill(peak, "peak"),
            drill(capacity, "capacity"),
        ],
        unit="bytes", minimum=0, w=8,
    ))
    frag = gauge("trainpatrol_cuda_memory_fragmentation_ratio")
    d = d.with_panel(ts(
        "Fragmentation ratio",
        "Is reserved memory going to waste? The share of reserved bytes that stayed unusable even at the "
        "allocation peak: max(0, reserved - peak allocated) / reserved. A healthy run reads a few percent "
        "(GPT-2-124M bf16 on an H200: 1-3 % of 16.8 GiB), a fragmented one 30-60 % with alloc retries "
        "(dashed: the 35 % alert threshold; the alert also fires above 20 % while cudaMalloc retries). "
        "The run's lowest, median and highest rank, and the 3 most fragmented ranks over the time range.",
        [*spread(frag), outliers(frag, "most fragmented"), drill(frag)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.35, "red")), w=8,
    ))
    retries = increase("trainpatrol_cuda_alloc_retries_total")
    ooms = increase("trainpatrol_cuda_ooms_total")
    d = d.with_panel(ts(
        "Alloc retries and OOMs",
        "When did the allocator have to flush its cache to allocate, or fail with out-of-memory? The "
        "run's retries and OOMs over all its ranks, and the 3 ranks that retried most over the time range.",
        [
            Q(f"sum by (run) ({retries.now(RUN)})", "{{run}} retries, all ranks"),
            Q(f"sum by (run) ({ooms.now(RUN)})", "{{run}} OOMs, all ranks"),
            outliers(retries, "retries (most)", nonzero=True),
            drill(retries, "retries"),
            drill(ooms, "OOMs"),
        ],
        unit="short", minimum=0, bars=True, w=8,
    ))

    d = d.with_row(row("Gradients"))
    norm = gauge("trainpatrol_grad_norm")
    norm_max = gauge("trainpatrol_grad_norm_window_max", "max")
    d = d.with_panel(ts(
        "Grad norm",
        "Are gradients exploding or vanishing? Global L2 norm at the last step on the run's lowest, median "
        "and highest rank, the highest window maximum (so a spike between scrapes still shows), and the "
        "3 ranks with the highest window maximum over the time range.",
        [
            *spread(norm),
            *spread(norm_max, "window max", stats=("max",)),
            outliers(norm_max, "window max (highest)"),
            drill(norm),
            drill(norm_max, "window max"),
        ],
        log=True, w=12,
    ))
    nonfinite = increase(NONFINITE)
    amp = increase("trainpatrol_amp_skipped_steps_total")
    d = d.with_panel(ts(
        "Non-finite and AMP-skipped steps",
        "Did a step produce NaN or Inf, and how often does GradScaler skip steps? Steps per interval on "
        "the run's worst rank, and the 3 ranks with the most non-finite steps over the time range.",
        [
            Q(f"max by (run, kind) (increase({NONFINITE}{{{RUN}}}[{RI}]))",
              "{{run}} non-finite {{kind}}, max rank"),
            Q(f"max by (run) ({amp.now(RUN)})", "{{run}} AMP skipped, max rank"),
            outliers(nonfinite, "non-finite (most)", nonzero=True),
            Q(f"sum by (run, rank, kind) (increase({NONFINITE}{{{RANK}}}[{RI}]))",
              "{{run}} rank {{rank}} non-finite {{kind}}"),
            drill(amp, "AMP skipped"),
        ],
        unit="short", minimum=0, bars=True, w=12,
    ))

    d = d.with_row(row("Loss"))
    loss = gauge("trainpatrol_loss")
    loss_mean = gauge("trainpatrol_loss_window_mean")
    loss_max = gauge("trainpatrol_loss_window_max", "max")
    d = d.with_panel(ts(
        "Training loss",
        "Is the training loss going down, and did it spike? The last value on the run's lowest, median "
        "and highest rank, the median rank's window mean, the highest window maximum, and the 3 ranks "
        "with the highest window maximum over the time range.",
        [
            *spread(loss),
            *spread(loss_mean, "window mean", stats=("median",)),
            *spread(loss_max, "window max", stats=("max",)),
            outliers(loss_max, "window max (highest)"),
            drill(loss),
            drill(loss_mean, "window mean"),
            drill(loss_max, "window max"),
        ],
        w=8,
    ))
    val = gauge("trainpatrol_validation_loss")
    d = d.with_panel(ts(
        "Validation vs training loss",
        "Is validation loss following training loss, or diverging from it (overfitting)? Validation loss "
        "on the run's lowest, median and highest rank against the median rank's training window mean.",
        [
            *spread(val, "validation"),
            *spread(loss_mean, "training (window mean)", stats=("median",)),
            drill(val, "validation"),
            drill(loss_mean, "training (window mean)"),
        ],
        w=8,
    ))
    d = d.with_panel(ts(
        "Learning rate",
        "What learning rate did each parameter group use, e.g. around a loss spike? Per group (at most 16), as "
        "the run's lowest rank on each agent reports it (data-parallel ranks agree; the agent's full series "
        "level serves each rank's).",
        [
            Q(f'max by (run, param_group) (trainpatrol_run_learning_rate{{{WHERE}, run=~"$run"}})',
              "{{run}} group {{param_group}}"),
        ],
        unit="short", w=8,
    ))

    d = d.with_row(row("Step time"))
    d = d.with_panel(ts(
        "Step time: mean and p95",
        "How long does an optimizer step take, and how wide is its tail? The run's mean and p95 (from its "
        "step histogram over every rank), the mean on the run's fastest, median and slowest rank, and the "
        "3 slowest ranks over the time range.",
        [
            Q(RUN_MEAN, "{{run}} mean, all ranks"),
            Q(RUN_P95, "{{run}} p95, all ranks"),
            *spread(STEP_MEAN, "mean"),
            outliers(STEP_MEAN, "mean (slowest)"),
            drill(STEP_MEAN, "mean"),
        ],
        unit="s", minimum=0, w=8,
    ))
    d = d.with_panel(ts(
        "Straggler ratio",
        "Is one rank slower than the others? A rank's mean step time over the median rank's of the run, "
        "on the run's fastest and slowest rank and the 3 slowest ranks over the time range; every rank "
        "waits for the slowest at each collective.",
        [*spread(STRAGGLER, stats=("min", "max")), outliers(STRAGGLER, "(slowest)"), drill(STRAGGLER)],
        unit=TIMES, thresholds=steps((None, "green"), (1.2, "red")), w=8,
    ))
    held = rate("trainpatrol_checkpoint_blocked_seconds_total")
    d = d.with_panel(ts(
        "Checkpoints: training held",
        "How much of the wall time do checkpoints hold training? Seconds blocked per second, on the run's "
        "least and most held rank and the 3 most held ranks over the time range; above 5 % over an hour "
        "TrainPatrolCheckpointsBlockTraining fires. With background_checkpoints a checkpoint holds training "
        "only for its copy into host memory.",
        [*spread(held, stats=("min", "max")), outliers(held, "(most held)", nonzero=True), drill(held)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.05, "red")), w=8,
    ))
    state = gauge("trainpatrol_rank_state")
    d = d.with_panel(state_timeline(
        "Rank state",
        "Is the run training, or held in a coordinated pause, stopping or stopped? The control state of "
        "the run's most advanced rank (the highest: running, pausing, paused, stopping, stopped, closed) "
        "and of its least advanced one; a pause is complete when both read paused.",
        Q(f"max by (run) ({state.now(RUN)})", "{{run}} most advanced rank"),
        more=[Q(f"min by (run) ({state.now(RUN)})", "{{run}} least advanced rank"), drill(state)],
        mappings=[value_map(STATES)],
        thresholds=steps(*((float(v) if v != "0" else None, color) for v, (_, color) in STATES.items())), w=8,
    ))
    return finish(d)
