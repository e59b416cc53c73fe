"""The one list of every metric trainpatrol exposes, with its help text, unit and labels.

docs/metrics.md is generated from this module (``python -m trainpatrol.catalogue``) and a test
keeps the two equal. Ranks push samples by catalogue name; the agent refuses names that are not
here, so a metric cannot exist without being documented.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.metrics_core import Metric as Family

Kind = Literal["gauge", "counter", "histogram", "info"]
Source = Literal["rank", "agent", "nvml"]

RANK_LABELS = ("run", "rank")
GPU_LABELS = ("gpu", "uuid")

STEP_DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    unit: str
    source: Source
    labels: tuple[str, ...] = ()
    """Labels beyond the source's own (``run``/``rank`` for ranks, ``gpu``/``uuid`` for NVML)."""

    @property
    def all_labels(self) -> tuple[str, ...]:
        base = {"rank": RANK_LABELS, "nvml": GPU_LABELS, "agent": ()}[self.source]
        return base + self.labels

    def family(self) -> Family:
        """An empty prometheus_client family of this metric; its samples are named as exposed
        (a counter's end in ``_total``, an info's in ``_info``)."""
        suffix = {"counter": "_total", "info": "_info"}.get(self.kind, "")
        return Family(self.name.removesuffix(suffix) if suffix else self.name, self.help, self.kind)


def _of(source: Source) -> Callable[..., Metric]:
    def metric(name: str, kind: Kind, unit: str, help: str, *labels: str) -> Metric:
        return Metric(name, kind, help, unit, source, labels)

    return metric


_r, _g, _a = _of("rank"), _of("nvml"), _of("agent")


P = "trainpatrol_"

RANK_METRICS: tuple[Metric, ...] = (
    _r(P + "rank_info", "info", "", "Identity of a rank: host, GPU uuid, versions and the job's launcher. Join GPU metrics on uuid.", "local_rank", "world_size", "host", "gpu_uuid", "device", "torch_version", "cuda_version", "trainpatrol_version", "launcher", "launcher_job"),
    _r(P + "step_total", "counter", "", "Optimizer steps completed."),
    _r(P + "micro_step_total", "counter", "", "Micro-steps (backward passes) completed, gradient accumulation included."),
    _r(P + "step_duration_seconds", "histogram", "seconds", "Wall time of one optimizer step, boundary to boundary."),
    _r(P + "samples_total", "counter", "", "Training samples consumed."),
    _r(P + "tokens_total", "counter", "", "Training tokens consumed."),
    _r(P + "loss", "gauge", "", "Training loss of the last step read back from the device."),
    _r(P + "loss_window_mean", "gauge", "", "Mean finite training loss over the recent window."),
    _r(P + "loss_window_max", "gauge", "", "Largest finite training loss over the recent window, so a spike between scrapes shows."),
    _r(P + "validation_loss", "gauge", "", "Last validation loss passed to Patrol.evaluate()."),
    _r(P + "nonfinite_steps_total", "counter", "", "Steps whose loss or grad norm was NaN or Inf, by kind.", "kind"),
    _r(P + "grad_norm", "gauge", "", "Global L2 norm of the gradients at the last optimizer step."),
    _r(P + "grad_norm_window_max", "gauge", "", "Largest finite global grad norm over the recent window."),
    _r(P + "amp_skipped_steps_total", "counter", "", "Optimizer steps skipped by GradScaler because of inf/NaN gradients."),
    _r(P + "amp_loss_scale", "gauge", "", "Current GradScaler loss scale."),
    _r(P + "learning_rate", "gauge", "", "Learning rate of each optimizer param group (index label, at most 16 groups).", "param_group"),
    _r(P + "loader_wait_seconds_total", "counter", "seconds", "Time spent waiting for the next batch from the data loader."),
    _r(P + "compute_seconds_total", "counter", "seconds", "Time computing each step (forward and backward, up to the model's last gradient), apart from the data wait and the wait for peers in DDP's gradient all-reduce: under lock-step parallelism step times even out, compute times do not. A sample of steps is timed, every step of a slow loop and about ten a second of a fast one, and each timed step counts for the steps since the last: on CPU the host clock, on a GPU CUDA events from the model's first forward to its last gradient, read back without a sync."),
    _r(P + "loader_wait_ratio", "gauge", "ratio", "Loader wait time divided by step time over the recent window."),
    _r(P + "dataloader_info", "info", "", "DataLoader settings seen by the audit.", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "batch_size"),
    _r(P + "dataloader_warning", "gauge", "", "1 when a DataLoader audit check fails (see docs/runbooks.md).", "check"),
    _r(P + "cuda_memory_allocated_bytes", "gauge", "bytes", "Bytes held by live tensors in the caching allocator."),
    _r(P + "cuda_memory_reserved_bytes", "gauge", "bytes", "Bytes reserved from the device by the caching allocator."),
    _r(P + "cuda_memory_active_bytes", "gauge", "bytes", "Bytes in active allocator blocks."),
    _r(P + "cuda_memory_inactive_split_bytes", "gauge", "bytes", "Bytes in inactive, non-releasable split blocks."),
    _r(P + "cuda_memory_peak_allocated_bytes", "gauge", "bytes", "Peak allocated bytes over the recent window."),
    _r(P + "cuda_memory_fragmentation_ratio", "gauge", "ratio", "Share of reserved bytes that stayed unusable even at the allocation peak: unusable_at_peak / reserved."),
    _r(P + "cuda_memory_unusable_at_peak_bytes", "gauge", "bytes", "Reserved bytes beyond the highest allocation peak seen (max(0, reserved - peak allocated)); never resets the user's peak statistics."),
    _r(P + "cuda_memory_capacity_bytes", "gauge", "bytes", "Total memory of the rank's device."),
    _r(P + "cuda_memory_used_ratio", "gauge", "ratio", "Allocated bytes divided by device capacity."),
    _r(P + "cuda_alloc_retries_total", "counter", "", "cudaMalloc retries after the allocator flushed its cache."),
    _r(P + "cuda_ooms_total", "counter", "", "Out-of-memory errors raised by the caching allocator."),
    _r(P + "cuda_memory_baseline_bytes", "gauge", "bytes", "Allocated bytes at the step boundary, the leak-trend sample point."),
    _r(P + "cuda_memory_baseline_slope_bytes_per_step", "gauge", "bytes", "Least-squares slope of the baseline over the window; positive and steady means a leak."),
    _r(P + "host_memory_resident_bytes", "gauge", "bytes", "Resident set size of the rank's process (/proc/self/statm), read about once a second off the training thread."),
    _r(P + "host_memory_limit_bytes", "gauge", "bytes", "Host memory limit in force for the rank: PatrolConfig.host_memory_limit_bytes, else the lower of its cgroup's memory.max (v1 memory.limit_in_bytes) and MemTotal."),
    _r(P + "dataloader_worker_resident_bytes", "gauge", "bytes", "Resident set size of each live worker process of the DataLoader iterated through Patrol.loader(), by worker index; it includes pages shared with the rank.", "worker"),
    _r(P + "probe_overhead_ratio", "gauge", "ratio", "Patrol's host time on the training thread (step(), the loader wrapper, the optimizer hooks, the compute clock's hooks, the step boundary, and what a fused torch optimizer spends on Patrol's non-finite flag) divided by step time over the recent window, plus its publisher thread's CPU seconds per second. On a GPU, times the share of sampled steps whose device ran out of queued work while Patrol's step() ran: host time hidden behind queued GPU work costs the step nothing."),
    _r(P + "guard_trips_total", "counter", "", "Local guard trips, by guard. At the standard series level, only the guards that tripped at least once.", "guard"),
    _r(P + "guard_active", "gauge", "", "1 while a local guard's condition holds at the last read step.", "guard"),
    _r(P + "rank_state", "gauge", "", "The rank's control state: 0 running, 1 pausing, 2 paused, 3 stopping (on a stop command, or in close while its last writes finish), 4 stopped, 5 closed (>= 1: not training on purpose; >= 4: finished)."),
    _r(P + "rank_stalled_phase", "gauge", "", "0 while the rank reaches step boundaries; once it has not for PatrolConfig.stall_seconds (or stall_step_multiple times its step time), the phase its training thread is stuck in: 1 waiting for data, 2 forward, 3 backward (under DDP also the wait for peers in the gradient all-reduce), 4 optimizer, 5 a collective, 6 Patrol's step boundary; inside an action held longer than PatrolConfig.action_stall_seconds, 7 writing the checkpoint, 8 writing evidence, 9 waiting for the other ranks to agree on its outcome. At the standard series level, served only while not 0."),
    _r(P + "actions_total", "counter", "", "Control actions carried out by the rank, by action and outcome (per run at the standard level: trainpatrol_run_actions_total).", "action", "outcome"),
    _r(P + "checkpoint_failures_total", "counter", "", "Checkpoint writes that failed and left the previous one in place."),
    _r(P + "checkpoint_blocked_seconds_total", "counter", "seconds", "Training time spent waiting for checkpoints: a checkpoint action's staging in host memory (it is written in the background), a pause's or stop's whole write."),
    _r(P + "checkpoint_write_seconds", "gauge", "seconds", "How long the last successful checkpoint took from its start until it was durable."),
    _r(P + "last_checkpoint_timestamp_seconds", "gauge", "seconds", "Unix time of the last successful checkpoint."),
    _r(P + "last_checkpoint_step", "gauge", "", "Step of the last successful checkpoint."),
    _r(P + "control_interval_steps", "gauge", "", "Steps between two control-word exchanges, agreed across ranks."),
    _r(P + "push_dropped_total", "counter", "", "Snapshots the rank could not deliver to its agent."),
)

AGENT_METRICS: tuple[Metric, ...] = (
    _a(P + "agent_info", "info", "", "Agent identity.", "version", "host", "mode"),
    _a(P + "collector_success", "gauge", "", "1 if the collector's last run succeeded.", "collector"),
    _a(P + "collector_duration_seconds", "gauge", "seconds", "Duration of the collector's last collection (it collects when it has something new).", "collector"),
    _a(P + "rank_up", "gauge", "", "1 while the rank pushed within the liveness TTL.", "run", "rank"),
    _a(P + "rank_last_push_timestamp_seconds", "gauge", "seconds", "Unix time of the rank's last accepted push.", "run", "rank"),
    _a(P + "rank_last_step_timestamp_seconds", "gauge", "seconds", "Unix time at which the rank's step counter last advanced: the rank's own clock at that step's end, to the sub-second (kept between its previous push and the one that reported the step, the agent's clock on a rank's first push).", "run", "rank"),
    _a(P + "run_actions_total", "counter", "", "Control actions carried out in a run, by action and outcome: the most that any of this agent's ranks of the run reports (every rank carries out each agreed action once). max by (run, action, outcome) over agents.", "run", "action", "outcome"),
    _a(P + "run_learning_rate", "gauge", "", "Learning rate of each optimizer param group, as the lowest of this agent's ranks of the run reports it (data-parallel ranks agree; per rank: trainpatrol_learning_rate at the full series level).", "run", "param_group"),
    _a(P + "run_restarts", "gauge", "", "Restarts of the run so far (torchrun's TORCHELASTIC_RESTART_COUNT, as each rank pushes it): the most any of this agent's ranks of the run reports. The run-timeline dashboard marks each increase.", "run"),
    _a(P + "run_model_flops_per_token", "gauge", "", "The model's training FLOPs per token (forward and backward), as its ranks were given it (PatrolConfig.flops_per_token): rate(trainpatrol_tokens_total) times this is a rank's achieved FLOP/s.", "run"),
    _a(P + "run_model_flops_per_step", "gauge", "", "The model's training FLOPs per optimizer step on one rank, given (PatrolConfig.flops_per_step) or measured (trainpatrol.measure_flops), where no per-token figure is: rate(trainpatrol_step_total) times this is a rank's achieved FLOP/s.", "run"),
    _a(P + "run_peak_flops", "gauge", "", "Dense peak FLOP/s of the run's GPUs in the dtype the model computes in (label dtype), from trainpatrol's table of NVIDIA data sheets or PatrolConfig.peak_flops; absent for a device or dtype the table lacks. Achieved FLOP/s over this is the model FLOPs utilisation (MFU).", "run", "dtype"),
    _a(P + "run_samples_total", "counter", "", "Samples consumed by this agent's ranks of the run, their trainpatrol_samples_total summed: sum by (run) (rate(...)) over agents is the run's throughput.", "run"),
    _a(P + "run_tokens_total", "counter", "", "Tokens consumed by this agent's ranks of the run, their trainpatrol_tokens_total summed.", "run"),
    _a(P + "run_loader_wait_seconds_total", "counter", "seconds", "Time this agent's ranks of the run waited for their next batch, their trainpatrol_loader_wait_seconds_total summed.", "run"),
    _a(P + "run_step_duration_seconds", "histogram", "seconds", "Wall time of one optimizer step, the histograms of this agent's ranks of the run summed. sum by (run, le) over agents gives the run's quantiles.", "run"),
    _a(P + "pushes_total", "counter", "", "Push requests received, by outcome: ok, invalid, unauthorized (agent token), wrong_namespace (a namespace token of another namespace), wrong_run_key (the run is bound to another key), too_large, refused (over a bound).", "outcome"),
    _a(P + "webhook_alerts_total", "counter", "", "Alerts received on the Alertmanager webhook, by outcome.", "outcome"),
    _a(P + "dropped_ranks_total", "counter", "", "Ranks whose series the agent dropped before their time, by reason: keyless (a run bound a key, its keyless ranks were not its own), superseded (a relaunch with another key took the name), evicted (a new run needed the room of one that gave way).", "reason"),
    _a(P + "control_commands_total", "counter", "", "Control commands queued for ranks, by action and source.", "action", "source"),
    _a(P + "control_commands_refused_total", "counter", "", "Control commands not queued, by action and reason: coalesced (a command of the same action waits already), rate_limited (the run's actions of that kind per minute are used up).", "action", "reason"),
    _a(P + "forwarded_alerts_total", "counter", "", "Alerts forwarded to peer agents, by outcome.", "outcome"),
    _a(P + "refused_requests_total", "counter", "", "Requests, connections and pushes refused at the edge or over a bound, by reason (docs/security.md).", "reason"),
    _a("process_resident_memory_bytes", "gauge", "bytes", "Resident memory size in bytes."),
    _a("process_virtual_memory_bytes", "gauge", "bytes", "Virtual memory size in bytes."),
    _a("process_cpu_seconds_total", "counter", "seconds", "Total user and system CPU time spent in seconds."),
    _a("process_open_fds", "gauge", "", "Number of open file descriptors."),
    _a("process_max_fds", "gauge", "", "Maximum number of open file descriptors."),
    _a("process_start_time_seconds", "gauge", "seconds", "Start time of the process since unix epoch in seconds."),
)

NVML_METRICS: tuple[Metric, ...] = (
    _g(P + "gpu_info", "info", "", "GPU identity.", "name", "pci_bus_id", "driver_version", "serial", "mig_mode"),
    _g(P + "gpu_mig_info", "info", "", "A MIG instance of the GPU: its own uuid (ranks on it report this as gpu_uuid), GPU and compute instance and profile.", "mig_uuid", "gpu_instance", "compute_instance", "profile"),
    _g(P + "gpu_mig_memory_used_bytes", "gauge", "bytes", "Device memory in use on a MIG instance.", "mig_uuid"),
    _g(P + "gpu_mig_memory_total_bytes", "gauge", "bytes", "Device memory of a MIG instance.", "mig_uuid"),
    _g(P + "gpu_utilization_ratio", "gauge", "ratio", "Fraction of the sample period a kernel was running."),
    _g(P + "gpu_memory_utilization_ratio", "gauge", "ratio", "Fraction of the sample period device memory was read or written."),
    _g(P + "gpu_memory_used_bytes", "gauge", "bytes", "Device memory in use (all processes)."),
    _g(P + "gpu_memory_free_bytes", "gauge", "bytes", "Device memory free."),
    _g(P + "gpu_memory_total_bytes", "gauge", "bytes", "Device memory total."),
    _g(P + "gpu_power_watts", "gauge", "watts", "Power draw."),
    _g(P + "gpu_power_limit_watts", "gauge", "watts", "Enforced power limit."),
    _g(P + "gpu_energy_joules_total", "counter", "joules", "Energy consumed since the driver loaded."),
    _g(P + "gpu_temperature_celsius", "gauge", "celsius", "Temperature, by sensor (gpu, memory).", "sensor"),
    _g(P + "gpu_clock_hertz", "gauge", "hertz", "Current clock, by domain (sm, memory).", "clock"),
    _g(P + "gpu_performance_state", "gauge", "", "Performance state, 0 (P0, fastest) to 15."),
    _g(P + "gpu_clock_event_active", "gauge", "", "1 while a clock-event (throttle) reason is active.", "reason"),
    _g(P + "gpu_pcie_link_generation", "gauge", "", "Current PCIe link generation."),
    _g(P + "gpu_pcie_link_width", "gauge", "", "Current PCIe link width (lanes)."),
    _g(P + "gpu_pcie_throughput_bytes_per_second", "gauge", "bytes", "PCIe throughput by direction (opt-in, about 20 ms per GPU).", "direction"),
    _g(P + "gpu_ecc_errors_total", "counter", "", "ECC errors since the driver loaded, by type (corrected, uncorrected).", "type"),
    _g(P + "gpu_retired_pages", "gauge", "", "Retired memory pages, by cause.", "cause"),
    _g(P + "gpu_remapped_rows", "gauge", "", "Remapped memory rows, by state (correctable, uncorrectable, pending, failure).", "state"),
    _g(P + "gpu_xid_errors_total", "counter", "", "XID errors seen by the agent's event thread, by xid.", "xid"),
    _g(P + "gpu_xid_last_timestamp_seconds", "gauge", "seconds", "Unix time of the last XID error, by xid.", "xid"),
    _g(P + "gpu_process_memory_bytes", "gauge", "bytes", "Device memory per training rank (opt-in); other processes under run=\"\".", "run", "rank"),
    _g(P + "nvml_sample_timestamp_seconds", "gauge", "seconds", "Unix time of the NVML sample being served."),
)

FULL_ONLY: frozenset[str] = frozenset(P + name for name in (
    "micro_step_total", "amp_loss_scale", "dataloader_warning", "cuda_memory_active_bytes",
    "cuda_memory_inactive_split_bytes", "cuda_memory_unusable_at_peak_bytes", "cuda_memory_baseline_bytes",
    "cuda_memory_baseline_slope_bytes_per_step", "host_memory_limit_bytes", "dataloader_worker_resident_bytes",
    "guard_active", "actions_total", "last_checkpoint_timestamp_seconds", "last_checkpoint_step",
    "control_interval_steps", "learning_rate", "checkpoint_failures_total", "push_dropped_total",
    "probe_overhead_ratio", "host_memory_resident_bytes", "dataloader_info", "cuda_memory_allocated_bytes"))
"""Rank metrics the agent serves only at the ``full`` series level (``--series full``); at the default,
``standard``, a rank's step-duration histogram is also served as a summary (its ``_sum`` and ``_count``, no
buckets: the ``+Inf`` one repeats ``_count``, the others are summed per run), and the NONZERO_ONLY series only
while not 0. SERIES_BUDGET says what that leaves."""

NONZERO_ONLY: frozenset[str] = frozenset({P + "guard_trips_total", P + "rank_stalled_phase"})
"""Rank series the agent serves at the standard level only while not 0: 0 is what every healthy rank says, and
no shipped rule reads them but as ``> 0`` (a series that goes away is marked stale at the next scrape, so such a
rule stops matching just as it would at 0)."""

SERIES_BUDGET = 30
"""The most series one rank may cost at the standard level, the agent's liveness series included."""

ALL_METRICS: tuple[Metric, ...] = RANK_METRICS + AGENT_METRICS + NVML_METRICS
BY_NAME: dict[str, Metric] = {m.name: m for m in ALL_METRICS}


def render_markdown() -> str:
    """docs/metrics.md, generated."""
    out = [
        "<!-- generated by `python -m trainpatrol.catalogue`, do not edit -->",
        "# Metrics",
        "",
        "Every series trainpatrol exposes. Rank metrics carry `run` and `rank`; GPU metrics carry",
        "`gpu` (index) and `uuid`. Join rank metrics to GPU metrics with",
        "`trainpatrol_rank_info{gpu_uuid=...}` through `label_replace(..., \"uuid\", \"$1\", \"gpu_uuid\", \"(.*)\")`.",
        "Histograms expose `_bucket`, `_sum` and `_count`; info metrics have the value 1.",
        "",
        "## Series budget",
        "",
        f"A 1,024-rank job shares its Prometheus with everything else, so one rank costs at most {SERIES_BUDGET} series at",
        "the agent's default series level, `standard` (a GPU rank on the README loop with a validation loss, a",
        f"GradScaler and two parameter groups: {SERIES_BUDGET}, its compute time and the agent's liveness series included;",
        "`tests/agent/test_series_budget.py`). At that level the agent leaves out the metrics marked *full* below;",
        "serves a rank's `trainpatrol_step_duration_seconds` as a summary, its `_sum` and `_count` without buckets",
        "(the `+Inf` bucket repeats `_count`; the run's buckets are in `trainpatrol_run_step_duration_seconds`); and",
        "serves `trainpatrol_guard_trips_total` of a guard and `trainpatrol_rank_stalled_phase` only while they are",
        "not 0 (no rule reads them but as `> 0`; a series that goes away is stale at the next scrape).",
        "What is the same on every rank of a run is served once per run instead: `trainpatrol_run_actions_total`",
        "(every rank carries out each agreed action), `trainpatrol_run_step_duration_seconds` (the ranks'",
        "histograms summed, for the run's quantiles) and `trainpatrol_run_learning_rate` (the lowest rank's); its",
        "`trainpatrol_run_samples_total`, `trainpatrol_run_tokens_total` and `trainpatrol_run_loader_wait_seconds_total`",
        "sum its ranks' counters too, so the run's throughput rules read a few series an agent instead of a rate of",
        "every rank's (a rank keeps its own, which the per-rank rules and panels read). The",
        "rank's memory in use is `trainpatrol_cuda_memory_used_ratio` (times the capacity, the allocated bytes).",
        "The rank's control state is one gauge,",
        "`trainpatrol_rank_state`, whose value encodes the state. Every series an alert reads is served from the",
        "rank's first push, counters at 0 (the stalled phase once the rank stalls). `trainpatrol agent --series full`",
        "(Helm: `agent.series: full`) serves",
        "everything, 103 series for a CPU rank.",
        "",
    ]
    titles = {"rank": "Rank metrics (pushed by Patrol)", "agent": "Agent metrics", "nvml": "GPU metrics (NVML)"}
    notes = {"nvml": ["A background thread samples the GPUs every `--nvml-interval` (1 s). Energy, ECC errors,",
                      "retired pages, remapped rows, the power limit and PCIe (link and throughput) are read every",
                      "`--nvml-slow-interval` (5 s) and carried by the samples in between: counters, settings that",
                      "rarely move, and the calls that block (energy about 3 ms, PCIe throughput about 20 ms a GPU).",
                      ""]}
    notes["agent"] = ["The `process_*` metrics describe the agent process itself, under the names every Prometheus",
                      "client library uses; they are read from /proc at most once a second.", ""]
    for source, title in titles.items():
        level = source == "rank"
        out += [f"## {title}", "", *notes.get(source, []),
                "| name | type | unit | labels |" + (" level |" if level else "") + " help |",
                "| --- | --- | --- | --- |" + (" --- |" if level else "") + " --- |"]
        for m in ALL_METRICS:
            if m.source == source:
                labels = ", ".join(f"`{label}`" for label in m.all_labels)
                served = (" full |" if m.name in FULL_ONLY else " standard |") if level else ""
                out.append(f"| `{m.name}` | {m.kind} | {m.unit or '-'} | {labels or '-'} |{served} {m.help} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_markdown(), end="")
