"""The run timeline: data, memory, gradients, loss and step time per rank on one shared time axis."""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dm

from dashboards.common import NODES, RANK, TIMES, WHERE, Q, dashboard, finish, row, state_timeline, steps, ts, value_map

UID = "trainpatrol-run-timeline"
TITLE = "trainpatrol / Run timeline"
ABOUT = ("Every rank's data pipeline, CUDA memory, gradients, loss and step time on one time axis with a "
         "shared crosshair; control actions are annotations.")

LEGEND = "{{run}} rank {{rank}}"
RI = "$__rate_interval"

# Mean step time per rank over the rate interval; the median over all ranks of the run (the rank
# variable does not narrow it) is the straggler baseline.
STEP_MEAN = (f"sum by (run, rank) (rate(trainpatrol_step_duration_seconds_sum{{{RANK}}}[{RI}])) "
             f"/ sum by (run, rank) (rate(trainpatrol_step_duration_seconds_count{{{RANK}}}[{RI}]))")
RUN = WHERE + ', run=~"$run", node=~"$node"'
STEP_MEDIAN = ("quantile by (run) (0.5, "
               f"sum by (run, rank) (rate(trainpatrol_step_duration_seconds_sum{{{RUN}}}[{RI}])) "
               f"/ sum by (run, rank) (rate(trainpatrol_step_duration_seconds_count{{{RUN}}}[{RI}])))")


def _sel(metric: str) -> str:
    return f"{metric}{{{RANK}}}"


def _rate(metric: str) -> str:
    return f"sum by (run, rank) (rate({_sel(metric)}[{RI}]))"


def _increase(metric: str, *by: str) -> str:
    return f"sum by ({', '.join(('run', 'rank', *by))}) (increase({_sel(metric)}[{RI}]))"


def _last(metric: str) -> str:
    return f"max by (run, rank) ({_sel(metric)})"


def build() -> dm.Dashboard:
    d = dashboard(TITLE, UID, ABOUT, NODES)
    d = d.tooltip(dm.DashboardCursorSync.CROSSHAIR).time("now-1h", "now")

    d = d.with_row(row("Data"))
    d = d.with_panel(ts(
        "Loader wait ratio",
        "Is a rank waiting for its data loader? Share of step time spent waiting for the next batch "
        "(dashed: the 30 % alert threshold).",
        [Q(_last("trainpatrol_loader_wait_ratio"), LEGEND)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.3, "red")), w=8,
    ))
    d = d.with_panel(ts(
        "Samples per second",
        "How fast is each rank consuming training samples?",
        [Q(_rate("trainpatrol_samples_total"), LEGEND)], unit="short", minimum=0, w=8,
    ))
    d = d.with_panel(ts(
        "Tokens per second",
        "How fast is each rank consuming training tokens?",
        [Q(_rate("trainpatrol_tokens_total"), LEGEND)], unit="short", minimum=0, w=8,
    ))

    d = d.with_row(row("Memory"))
    d = d.with_panel(ts(
        "CUDA memory: allocated, reserved, peak",
        "How much device memory do live tensors hold, how much has the caching allocator reserved, "
        "and how close is the window's peak to the device's capacity?",
        [
            Q(_last("trainpatrol_cuda_memory_allocated_bytes"), LEGEND + " allocated"),
            Q(_last("trainpatrol_cuda_memory_reserved_bytes"), LEGEND + " reserved"),
            Q(_last("trainpatrol_cuda_memory_peak_allocated_bytes"), LEGEND + " peak"),
            Q(_last("trainpatrol_cuda_memory_capacity_bytes"), LEGEND + " capacity"),
        ],
        unit="bytes", minimum=0, w=8,
    ))
    d = d.with_panel(ts(
        "Fragmentation ratio",
        "Is reserved memory going to waste? The share of reserved bytes that stayed unusable even at the "
        "allocation peak: max(0, reserved - peak allocated) / reserved. A healthy run reads a few percent "
        "(GPT-2-124M bf16 on an H200: 1-3 % of 16.8 GiB), a fragmented one 30-60 % with alloc retries "
        "(dashed: the 35 % alert threshold; the alert also fires above 20 % while cudaMalloc retries).",
        [Q(_last("trainpatrol_cuda_memory_fragmentation_ratio"), LEGEND)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.35, "red")), w=8,
    ))
    d = d.with_panel(ts(
        "Alloc retries and OOMs",
        "When did the allocator have to flush its cache to allocate, or fail with out-of-memory?",
        [
            Q(_increase("trainpatrol_cuda_alloc_retries_total"), LEGEND + " retries"),
            Q(_increase("trainpatrol_cuda_ooms_total"), LEGEND + " OOMs"),
        ],
        unit="short", minimum=0, bars=True, w=8,
    ))

    d = d.with_row(row("Gradients"))
    d = d.with_panel(ts(
        "Grad norm",
        "Are gradients exploding or vanishing? Global L2 norm at the last step and the window maximum, "
        "so a spike between scrapes still shows.",
        [
            Q(_last("trainpatrol_grad_norm"), LEGEND),
            Q(_last("trainpatrol_grad_norm_window_max"), LEGEND + " window max"),
        ],
        log=True, w=12,
    ))
    d = d.with_panel(ts(
        "Non-finite and AMP-skipped steps",
        "Did a step produce NaN or Inf, and how often does GradScaler skip steps?",
        [
            Q(_increase("trainpatrol_nonfinite_steps_total", "kind"), LEGEND + " non-finite {{kind}}"),
            Q(_increase("trainpatrol_amp_skipped_steps_total"), LEGEND + " AMP skipped"),
        ],
        unit="short", minimum=0, bars=True, w=12,
    ))

    d = d.with_row(row("Loss"))
    d = d.with_panel(ts(
        "Training loss",
        "Is the training loss going down, and did it spike? Last value, window mean and window maximum.",
        [
            Q(_last("trainpatrol_loss"), LEGEND),
            Q(_last("trainpatrol_loss_window_mean"), LEGEND + " window mean"),
            Q(_last("trainpatrol_loss_window_max"), LEGEND + " window max"),
        ],
        w=8,
    ))
    d = d.with_panel(ts(
        "Validation vs training loss",
        "Is validation loss following training loss, or diverging from it (overfitting)?",
        [
            Q(_last("trainpatrol_validation_loss"), LEGEND + " validation"),
            Q(_last("trainpatrol_loss_window_mean"), LEGEND + " training (window mean)"),
        ],
        w=8,
    ))
    d = d.with_panel(ts(
        "Learning rate",
        "What learning rate did each parameter group use, e.g. around a loss spike?",
        [Q(f"max by (run, rank, param_group) ({_sel('trainpatrol_learning_rate')})",
           LEGEND + " group {{param_group}}")],
        unit="short", w=8,
    ))

    d = d.with_row(row("Step time"))
    d = d.with_panel(ts(
        "Step time: mean and p95",
        "How long does an optimizer step take on each rank, and how wide is its tail?",
        [
            Q(STEP_MEAN, LEGEND + " mean"),
            Q("histogram_quantile(0.95, sum by (run, rank, le) "
              f"(rate({_sel('trainpatrol_step_duration_seconds_bucket')}[{RI}])))", LEGEND + " p95"),
        ],
        unit="s", minimum=0, w=8,
    ))
    d = d.with_panel(ts(
        "Straggler ratio",
        "Is one rank slower than the others? Its mean step time over the median rank's of the run; "
        "every rank waits for the slowest at each collective.",
        [Q(f"{STEP_MEAN} / on (run) group_left () {STEP_MEDIAN}", LEGEND)],
        unit=TIMES, thresholds=steps((None, "green"), (1.2, "red")), w=8,
    ))
    d = d.with_panel(state_timeline(
        "Paused",
        "When was each rank held in a coordinated pause, waiting for an explicit resume?",
        Q(_last("trainpatrol_paused"), LEGEND),
        mappings=[value_map({"0": ("running", "green"), "1": ("paused", "orange")})],
        thresholds=steps((None, "green"), (1, "orange")), w=8,
    ))
    return finish(d)
