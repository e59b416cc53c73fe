"""The daily inspection checklist: one row per run, one status per check, with its range and action."""

from __future__ import annotations

from dataclasses import dataclass, field

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import table, text
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import text as tm

from dashboards.common import (
    DS,
    NODES,
    RUN,
    RUNBOOKS,
    TIMES,
    Q,
    dashboard,
    finish,
    on_dcgm_gpu,
    on_gpu,
    row,
    runbook,
    stat_panel,
    steps,
    target,
    value_map,
)

UID = "trainpatrol-checklist"
TITLE = "trainpatrol / Training checklist"
ABOUT = ("The morning inspection: every run's health checks at a glance, each with its normal range, "
         "the action to take and the runbook. Each check is one value per run over all its ranks, however "
         "many (the rank drill-down does not narrow it). Counters cover the selected time range.")

ALERTS = tuple("TrainPatrol" + name for name in (
    "NonFiniteLoss", "NonFiniteGrad", "GradNormExplosion", "LossSpike", "LossStagnation",
    "ValLossDiverging", "MemoryFragmentationHigh", "AllocRetries", "OOMRisk", "DataLoaderBound",
    "GPUUnderutilized", "RankStalled", "RankDown", "Straggler", "GPUXidError", "ThermalThrottle",
    "EccUncorrectable", "RowRemapFailure", "AgentDown",
))

GREEN, YELLOW, RED = "green", "yellow", "red"
OK = {"0": ("OK", GREEN)}


@dataclass(frozen=True)
class Check:
    """One line of the checklist. ``expr`` yields one value per run: the worst rank's."""

    title: str
    question: str
    expr: str
    unit: str
    thresholds: tuple[tuple[float | None, str], ...]
    normal: str
    action: str
    alerts: tuple[str, ...]
    mappings: dict[str, tuple[str, str]] = field(default_factory=dict)
    decimals: float | None = None
    no_value: str = ""
    """Shown instead of "No data" when the run legitimately has no such series."""

    @property
    def links(self) -> list[tuple[str, str]]:
        return [(f"Runbook: {a}", runbook(a)) for a in self.alerts] or [("Runbooks", RUNBOOKS)]

    @property
    def description(self) -> str:
        links = ", ".join(f"[{title.removeprefix('Runbook: ')}]({url})" for title, url in self.links)
        return f"{self.question} Normal: {self.normal}. Action: {self.action} Runbook: {links}."


def _count(metric: str) -> str:
    return f"sum by (run) (round(increase({metric}{{{RUN}}}[$__range])))"


_AGENT_RUN = "cluster, namespace, job, instance, run"
MFU = (
    "min by (run) (\n"
    f"  (\n    rate(trainpatrol_tokens_total{{{RUN}}}[5m])\n    * on ({_AGENT_RUN}) group_left ()\n"
    f"    trainpatrol_run_model_flops_per_token{{{RUN}}}\n    or\n"
    f"    rate(trainpatrol_step_total{{{RUN}}}[5m])\n    * on ({_AGENT_RUN}) group_left ()\n"
    f"    trainpatrol_run_model_flops_per_step{{{RUN}}}\n  )\n"
    f"  / on ({_AGENT_RUN}) group_left ()\n  max without (dtype) (trainpatrol_run_peak_flops{{{RUN}}} > 0)\n)"
)
"""The run's lowest rank's MFU, as alerting/recording.py works a rank's out."""

CHECKS: tuple[Check, ...] = (
    Check(
        "MFU",
        "How much of its GPUs' dense peak does the run's model use? Lowest model FLOPs utilisation over the "
        "run's ranks (model FLOPs per token or step, given to Patrol or measured, times the rank's tokens or "
        "steps per second, over the peak of its GPU in the dtype it computes in); the run's median rank is "
        "run:trainpatrol_mfu:median_rate5m.",
        MFU, "percentunit", ((None, RED), (0.2, YELLOW), (0.35, GREEN)),
        "35 % or more for a large transformer in bf16 (published large runs report 35-55 %); far below its "
        "run's median, the rank straggles",
        "Find where the step time goes: loader wait, host-side launch overhead (small kernels; try "
        "torch.compile or CUDA graphs), communication, a straggling rank; raise the per-GPU batch.",
        ("TrainPatrolGPUUnderutilized", "TrainPatrolStraggler"), decimals=3,
        no_value="no FLOPs or peak known",
    ),
    Check(
        "Tokens/s per GPU",
        "How fast does each GPU consume tokens? Lowest rank's tokens per second over 5 minutes (the run's "
        "median rank: run:trainpatrol_tokens_per_rank:median_rate5m).",
        f"min by (run) (rate(trainpatrol_tokens_total{{{RUN}}}[5m]))",
        "short", ((None, RED), (1, GREEN)),
        "close to the run's median and to the same model's earlier runs; none for 5 minutes: the rank is stuck",
        "Compare with the median rank and earlier runs; a slow rank: see Straggler.",
        ("TrainPatrolStraggler",), no_value="no tokens passed to step()",
    ),
    Check(
        "GPU utilization",
        "Are the run's GPUs busy? Lowest 10-minute mean utilization over the run's GPUs (NVML's, or "
        "dcgm-exporter's DCGM_FI_DEV_GPU_UTIL in DCGM mode).",
        "min by (run) (\n  " + on_gpu("avg_over_time(trainpatrol_gpu_utilization_ratio{node=~\"$node\"}[10m])")
        + "\n  or\n  " + on_dcgm_gpu('avg_over_time(DCGM_FI_DEV_GPU_UTIL{cluster=~"$cluster"}[10m]) / 100') + "\n)",
        "percentunit", ((None, RED), (0.5, YELLOW), (0.8, GREEN)),
        "at least 50 % (the alert fires below 50 %)",
        "Look for the bottleneck outside the GPU: loader wait ratio, host CPU, step-time stragglers; "
        "raise the batch size or DataLoader workers.",
        ("TrainPatrolGPUUnderutilized",), no_value="no GPU",
    ),
    Check(
        "Fragmentation",
        "Is the caching allocator wasting reserved memory? Highest share of reserved bytes that stayed "
        "unusable even at the allocation peak, over ranks (healthy: a few percent).",
        f"max by (run) (trainpatrol_cuda_memory_fragmentation_ratio{{{RUN}}})",
        "percentunit", ((None, GREEN), (0.2, YELLOW), (0.35, RED)),
        "below 20 % (the alert fires above 35 % with more than 4 GiB reserved, or above 20 % while "
        "cudaMalloc retries)",
        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or send empty_cache; look for tensors "
        "whose shapes vary from step to step.",
        ("TrainPatrolMemoryFragmentationHigh",),
    ),
    Check(
        "Grad norm",
        "Are gradients exploding? Highest window maximum of the grad norm, as a multiple of its "
        "1-hour median.",
        f"max by (run) (trainpatrol_grad_norm_window_max{{{RUN}}} "
        f"/ quantile_over_time(0.5, trainpatrol_grad_norm{{{RUN}}}[1h]))",
        TIMES, ((None, GREEN), (3, YELLOW), (10, RED)),
        "below 3 times the 1-hour median",
        "Checkpoint and pause; lower the learning rate or tighten gradient clipping, and inspect the "
        "batch recorded in the evidence bundle.",
        ("TrainPatrolGradNormExplosion", "TrainPatrolLossSpike"), decimals=2,
    ),
    Check(
        "Val / train loss",
        "Is the model overfitting? Last validation loss over the recent mean training loss.",
        f"max by (run) (trainpatrol_validation_loss{{{RUN}}} / trainpatrol_loss_window_mean{{{RUN}}})",
        TIMES, ((None, GREEN), (1.1, YELLOW), (1.3, RED)),
        "below 1.1 times the training loss",
        "Checkpoint; consider early stopping, more regularisation or more data, and confirm the "
        "validation set has not changed.",
        ("TrainPatrolValLossDiverging", "TrainPatrolLossStagnation"), decimals=2,
        no_value="no validation loss",
    ),
    Check(
        "Loader wait",
        "Is the run starved by its input pipeline? Highest share of step time spent waiting for a batch.",
        f"max by (run) (trainpatrol_loader_wait_ratio{{{RUN}}})",
        "percentunit", ((None, GREEN), (0.1, YELLOW), (0.3, RED)),
        "below 30 % of step time",
        "Raise num_workers and prefetch_factor, enable pin_memory and persistent_workers; read the "
        "DataLoader audit warnings.",
        ("TrainPatrolDataLoaderBound",),
    ),
    Check(
        "Memory headroom",
        "How close is the run to an out-of-memory error? Smallest free share of device memory over ranks.",
        f"1 - max by (run) (trainpatrol_cuda_memory_used_ratio{{{RUN}}})",
        "percentunit", ((None, RED), (0.08, YELLOW), (0.15, GREEN)),
        "more than 8 % free (the alert fires above 92 % used)",
        "Checkpoint now; then lower the micro-batch size, enable activation checkpointing or send "
        "empty_cache.",
        ("TrainPatrolOOMRisk",),
    ),
    Check(
        "Alloc retries",
        "Did the allocator have to flush its cache to satisfy a cudaMalloc? Retries in the time range.",
        _count("trainpatrol_cuda_alloc_retries_total"),
        "short", ((None, GREEN), (1, YELLOW), (10, RED)),
        "0 in the time range",
        "Memory pressure: each retry stalls the step. Reduce the batch size or fragmentation.",
        ("TrainPatrolAllocRetries",), OK, 0,
    ),
    Check(
        "Non-finite steps",
        "Did any step produce a NaN or Inf loss or grad norm? Steps in the time range.",
        _count("trainpatrol_nonfinite_steps_total"),
        "short", ((None, GREEN), (1, RED)),
        "0 in the time range",
        "The local guard pauses the run within two steps: read the evidence bundle, then resume from "
        "the last checkpoint with a lower learning rate or the bad batch skipped.",
        ("TrainPatrolNonFiniteLoss", "TrainPatrolNonFiniteGrad"), OK, 0,
    ),
    Check(
        "Ranks up",
        "Are all ranks alive? Share of the run's ranks that pushed within the liveness TTL.",
        f"avg by (run) (trainpatrol_rank_up{{{RUN}}})",
        "percentunit", ((None, RED), (1, GREEN)),
        "100 %",
        "A dead or stalled rank blocks every collective: capture stacks, check the node and the process, "
        "then stop and restart from the last checkpoint.",
        ("TrainPatrolRankDown", "TrainPatrolRankStalled", "TrainPatrolStraggler", "TrainPatrolAgentDown"),
        {"1": ("all up", GREEN)},
    ),
    Check(
        "Firing alerts",
        "Which runs have trainpatrol alerts firing right now? Count of firing alerts labelled with the run.",
        'count by (run) (ALERTS{alertname=~"TrainPatrol.*", alertstate="firing", run=~"$run", run!=""}) '
        f"or 0 * max by (run) (trainpatrol_rank_up{{{RUN}}})",
        "short", ((None, GREEN), (1, RED)),
        "0",
        "Open the firing alert's runbook from the alerts table.",
        (), {"0": ("none", GREEN)}, 0,
    ),
)


def _column(check: Check, ref: str) -> db.DashboardFieldConfigSourceOverrides:
    props = [
        dm.DynamicConfigValue("displayName", check.title),
        dm.DynamicConfigValue("unit", check.unit),
        dm.DynamicConfigValue("thresholds", steps(*check.thresholds).build()),
        dm.DynamicConfigValue("custom.cellOptions", {"type": "color-background", "mode": "basic"}),
        dm.DynamicConfigValue("links", [{"title": t, "url": u, "targetBlank": True} for t, u in check.links]),
        dm.DynamicConfigValue("description", check.description),
    ]
    if check.mappings:
        props.append(dm.DynamicConfigValue("mappings", [value_map(check.mappings)]))
    if check.decimals is not None:
        props.append(dm.DynamicConfigValue("decimals", check.decimals))
    if check.no_value:
        props.append(dm.DynamicConfigValue("noValue", check.no_value))
    matcher = dm.MatcherConfig("byName", f"Value #{ref}")
    return db.DashboardFieldConfigSourceOverrides().matcher(matcher).properties(props)


def checks_table() -> table.Panel:
    refs = [chr(ord("A") + i) for i in range(len(CHECKS))]
    return (
        table.Panel()
        .title("Runs: one row per run, one status per check")
        .description("Which run needs attention this morning? Each cell is the run's worst rank for that "
                     "check, coloured by the check's normal range; click a column's value for its runbook.")
        .datasource(DS)
        .targets([target(Q(c.expr), instant=True, table=True) for c in CHECKS])
        .with_transformation(dm.DataTransformerConfig("merge", options={}))
        .with_transformation(dm.DataTransformerConfig("organize", options={
            "excludeByName": {"Time": True},
            "indexByName": {"run": 0, **{f"Value #{r}": i + 1 for i, r in enumerate(refs)}},
        }))
        .overrides([_column(c, r) for c, r in zip(CHECKS, refs, strict=True)])
        .span(24)
        .height(7)
    )


def alerts_expr() -> str:
    """Firing and pending trainpatrol alerts, each labelled with its runbook anchor for the table link."""
    expr = 'ALERTS{alertname=~"TrainPatrol.*", cluster=~"$cluster", namespace=~"$namespace", run=~"$run|"}'
    for alert in ALERTS:
        expr = f'label_replace({expr}, "runbook", "{alert.lower()}", "alertname", "{alert}")'
    return expr


def alerts_table() -> table.Panel:
    link = [{"title": "Runbook", "url": RUNBOOKS + "#${__data.fields.runbook}", "targetBlank": True}]
    severity = value_map({
        "critical": ("critical", "red"), "warning": ("warning", "orange"), "info": ("info", "blue")})
    return (
        table.Panel()
        .title("Firing and pending alerts")
        .description("Which trainpatrol alerts are firing or pending, for which run, rank and node? "
                     "Click the alert name for its runbook.")
        .datasource(DS)
        .targets([target(Q(alerts_expr()), instant=True, table=True)])
        .with_transformation(dm.DataTransformerConfig("organize", options={
            "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True},
            "indexByName": {name: i for i, name in enumerate(
                ("alertname", "alertstate", "severity", "cluster", "namespace", "run", "rank", "node", "action"))},
        }))
        .override_by_name("alertname", [dm.DynamicConfigValue("links", link)])
        .override_by_name("runbook", [dm.DynamicConfigValue("custom.hidden", True)])
        .override_by_name("severity", [
            dm.DynamicConfigValue("mappings", [severity]),
            dm.DynamicConfigValue("custom.cellOptions", {"type": "color-text"}),
        ])
        .no_value("No trainpatrol alert is firing.")
        .cell_height(cm.TableCellHeight.SM)
        .span(24)
        .height(7)
    )


def reference() -> text.Panel:
    lines = ["| check | normal range | action | runbook |", "| --- | --- | --- | --- |"]
    for c in CHECKS:
        links = ", ".join(f"[{title.removeprefix('Runbook: ')}]({url})" for title, url in c.links)
        lines.append(f"| {c.title} | {c.normal} | {c.action} | {links} |")
    return (
        text.Panel()
        .title("Checks: normal range and action")
        .description("What does each check mean, what is normal, and what do I do when it is not?")
        .mode(tm.TextMode.MARKDOWN)
        .content("\n".join(lines))
        .span(24)
        .height(9)
    )


def build() -> dm.Dashboard:
    d = dashboard(TITLE, UID, ABOUT, NODES)
    d = d.with_row(row("Overview")).with_panel(checks_table()).with_panel(alerts_table())
    d = d.with_row(row("Run $run").repeat("run"))
    for c in CHECKS:
        d = d.with_panel(stat_panel(
            c.title, c.description, Q(c.expr, "{{run}}"), unit=c.unit, thresholds=steps(*c.thresholds),
            mappings=[value_map(c.mappings)] if c.mappings else [],
            links=c.links, decimals=c.decimals, no_value=c.no_value,
        ))
    d = d.with_row(row("Reference")).with_panel(reference())
    return finish(d)
