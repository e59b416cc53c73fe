"""Rule types and the few PromQL building blocks the rule groups share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import ALERT_PREFIX, Config

Severity = Literal["critical", "warning", "info"]

def rank_labels(cfg: Config) -> str:
    """Identity of a rank's series: the cluster, the workload's namespace, the agent (job, instance)
    and the rank (run, rank). Two namespaces may run the same run name on one agent."""
    return f"{cfg.cluster_label}, namespace, job, instance, run, rank"


def run_labels(cfg: Config) -> str:
    """Identity of a run: alerts and ``run:`` aggregates keep cluster and namespace apart."""
    return f"{cfg.cluster_label}, namespace, job, run"


def gpu_labels(cfg: Config) -> str:
    """Identity of an NVML GPU series: no namespace, which on a GPU series is the agent pod's."""
    return f"{cfg.cluster_label}, job, instance, uuid"


def dcgm_gpu_labels(cfg: Config) -> str:
    """Identity of a dcgm-exporter GPU series: another scrape job, so only cluster and UUID join."""
    return f"{cfg.cluster_label}, UUID"


RANK_COPIED = "namespace, pod, container, run, rank, host"
"""Labels a GPU series takes from the rank that uses it (namespace: the workload's, not the agent's)."""
DCGM_RANK_COPIED = "job, instance, " + RANK_COPIED
"""In DCGM mode also job and instance: the agent that hosts the rank, whose webhook acts on it."""

RANK_INFO = "instance_uuid_rank:trainpatrol_rank_info:live"
"""The join table: every rank that uses each GPU (the live ones; where none is live, every rank
that still has its series), with ``uuid`` copied from ``gpu_uuid`` and only the GPU's and the rank's
identity as labels. Never one rank chosen per GPU: any push may name any ``gpu_uuid``, so a rank
that claims a GPU must not take the GPU's alerts away from the run that really uses it."""
DCGM_RANK_INFO = "cluster_uuid_rank:trainpatrol_rank_info:live"
"""The same for dcgm-exporter's series, by ``UUID`` across the cluster, with the rank's agent
(``job``, ``instance``): the agent whose webhook acts."""
DCGM_NEWEST_RANK = "cluster_uuid:trainpatrol_rank_info:topk1_newest"
"""One rank per GPU UUID (the one that pushed last), with ``UUID`` copied from ``gpu_uuid``: only for
the DCGM dashboard, whose panels show one run per GPU. No alert reads it."""

GPU_COPIED = "gpu"
"""Labels an alert takes from an NVML GPU series, besides its identity and the alert's own labels."""
DCGM_GPU_COPIED = "gpu, device, pci_bus_id, modelName, Hostname, DCGM_FI_DRIVER_VERSION"
"""The same for dcgm-exporter's series (its default label set)."""

RANK_STATES = ("running", "pausing", "paused", "stopping", "stopped", "closed")
"""``trainpatrol_rank_state``'s encoding: the value is the index (trainpatrol.actions.RUN_STATES)."""
RANK_STATE_HALTED = RANK_STATES.index("pausing")
"""From this value on, a rank is not training on purpose."""
RANK_STATE_FINISHED = RANK_STATES.index("stopped")
"""From this value on, a rank stopped or closed on purpose: it is not down."""
RANK_HALTED = "run_rank:trainpatrol_rank_state:halted"
RANK_STALLED = "run_rank:trainpatrol_rank_stalled_phase:stalled"
"""The phase (``trainpatrol_rank_stalled_phase``) of each rank whose training thread Patrol found stuck."""
RANK_ODD = "run_rank:trainpatrol_rank_stalled_phase:odd"
"""The stalled ranks stuck in another phase than most stalled ranks of their run (label ``phase``, its name; the
value: how many stalled ranks share that phase): in a lock-step job the others wait for them."""
STALL_PHASES = ("", "data", "forward", "backward", "optimizer", "collective", "boundary", "checkpoint", "evidence",
                "agreement")
"""``trainpatrol_rank_stalled_phase``'s encoding (trainpatrol.probe.stall_watch.PHASES)."""
"""1 for each rank that is pausing, paused, stopping, stopped or closed, or down (``rank_up`` 0)."""

# Annotation template pieces (Go templates, rendered by Prometheus).
RUN = "{{ $labels.run }}{{ with $labels.namespace }} in namespace {{ . }}{{ end }}"
"""A run's name, and its namespace where it has one: the same name may run in two namespaces."""
RANK = "{{ $labels.rank }}"
INSTANCE = "{{ $labels.instance }}"
GPU = "{{ $labels.gpu }}"
UUID = "{{ $labels.uuid }}"
HOST = "{{ $labels.host }}"


def uuid_of(cfg: Config) -> str:
    """The GPU's UUID in an annotation: dcgm-exporter names the label ``UUID``."""
    return "{{ $labels.UUID }}" if cfg.gpu_source == "dcgm" else UUID

VALUE = "{{ $value | humanize }}"
PERCENT = "{{ $value | humanizePercentage }}"
COUNT = '{{ printf "%.0f" $value }}'


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str

    def to_dict(self, cfg: Config) -> dict[str, object]:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class Alert:
    name: str
    """Without the prefix; also the key of the alert's ``for:`` in the config."""
    expr: str
    severity: Severity
    summary: str
    description: str
    action: str | None = None

    @property
    def alertname(self) -> str:
        return ALERT_PREFIX + self.name

    def to_dict(self, cfg: Config) -> dict[str, object]:
        if not self.summary.endswith("."):
            raise ValueError(f"Alert {self.alertname!r} has summary {self.summary!r}. It must end in a period.")
        labels: dict[str, str] = {"severity": self.severity}
        if self.action:
            labels["action"] = self.action
        return {
            "alert": self.alertname,
            "expr": self.expr,
            "for": cfg.for_(self.name),
            "labels": labels,
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": f"{cfg.runbook_base}#{self.alertname.lower()}",
            },
        }


Rule = Recording | Alert


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Rule, ...]

    def to_dict(self, cfg: Config) -> dict[str, object]:
        return {"name": self.name, "rules": [r.to_dict(cfg) for r in self.rules]}


def sel(cfg: Config, metric: str, *matchers: str) -> str:
    """``metric{<config selector>,<matchers>}``."""
    parts = [p for p in (cfg.selector, *matchers) if p]
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def rate_ratio(cfg: Config, num: str, den: str, window: str) -> str:
    """Per rank, the rate of counter ``num`` over the rate of counter ``den`` in ``window``; absent, never NaN
    or +Inf, where ``den`` did not grow (before a rank's first step completes, while it does not step)."""
    return (f"rate({sel(cfg, num)}[{window}])\n/ on ({rank_labels(cfg)})\n"
            f"(rate({sel(cfg, den)}[{window}]) > 0)")


def dsel(cfg: Config, metric: str, *matchers: str) -> str:
    """A dcgm-exporter selector: ``cfg.dcgm_selector``, not trainpatrol's ``job``."""
    parts = [p for p in (cfg.dcgm_selector, *matchers) if p]
    return f"{metric}{{{','.join(parts)}}}" if parts else metric


def gpu_utilization(cfg: Config, window: str | None = None) -> str:
    """GPU utilisation as a 0-1 ratio (its average over ``window`` if given), from either source."""
    if cfg.gpu_source == "dcgm":  # DCGM_FI_DEV_GPU_UTIL is a percentage
        metric = dsel(cfg, "DCGM_FI_DEV_GPU_UTIL")
        return f"avg_over_time({metric}[{window}]) / 100" if window else f"{metric} / 100"
    metric = sel(cfg, "trainpatrol_gpu_utilization_ratio")
    return f"avg_over_time({metric}[{window}])" if window else metric


def num(x: float) -> str:
    """A threshold as PromQL writes it: integers without a fraction, no exponent."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def increased(cfg: Config, counter: str, window: str, threshold: float = 0) -> str:
    """``counter`` rose by more than ``threshold`` within ``window``, or is a new series above it.

    increase() needs two samples, so a counter whose first scraped value is already non-zero (the
    event came before the first scrape) never shows up in it. The second branch catches that: the
    series is above the threshold and had no sample in ``cfg.new_series_history`` before the window.
    Combine the result with ``unless`` or ``*`` only inside parentheses: ``or`` binds loosest.
    """
    t = num(threshold)
    return (
        f"increase({counter}[{window}]) > {t}\n"
        f"or\n(\n  {counter} > {t}\n  unless\n  last_over_time({counter}[{cfg.new_series_history}] offset {window})\n)"
    )


def unless_halted(on: str, window: str, stalled: bool = True) -> str:
    """The clause that drops what a halted rank (``RANK_HALTED``) says, now or within ``window``:
    by the rank itself (``on`` = ``RANK_ON``) or by its whole run (``on`` = ``RUN_ON``). Liveness and
    progress alerts judge only ranks that train: a paused, stopping, stopped, closed or dead rank
    makes no progress on purpose or is RankDown's business, and a rate over ``window`` still holds
    its last steps for that long. ``stalled``: also while a rank is stalled (RankHung's business), so a hung
    run raises one alarm, not loss stagnation or an idle GPU as well."""
    halted = f"max_over_time({RANK_HALTED}[{window}])"
    if stalled:
        halted = f"(\n  {halted}\n  or\n  max_over_time({RANK_STALLED}[{window}])\n)"
    return f"unless on ({on})\n  {halted}"


def on_rank(cfg: Config, gpu_expr: str, copied: str = "", pick: str = "topk") -> str:
    """GPU series once for every rank that uses the GPU: the rank's run, rank, host and workload
    identity (and, in DCGM mode, its agent), the GPU's labels (``GPU_COPIED`` and ``copied``, such as
    ``xid``) and the GPU series' value. Two runs on one GPU, or a run and a rank that claims the GPU's
    UUID, each get their own series: the join never chooses one of them.

    PromQL joins one to many, not many to many: where ``gpu_expr`` has several series for a GPU
    (two XID codes, two thermal reasons), the one that ``pick`` (``topk``, or ``bottomk`` for the
    most recent of "seconds ago" values) ranks first stands for the GPU."""
    if cfg.gpu_source == "dcgm":
        on, table, base = dcgm_gpu_labels(cfg), DCGM_RANK_INFO, DCGM_GPU_COPIED
    else:
        on, table, base = gpu_labels(cfg), RANK_INFO, GPU_COPIED
    labels = ", ".join(x for x in (base, copied) if x)
    return f"{pick} by ({on}) (1,\n{indent(gpu_expr)}\n)\n* on ({on}) group_right ({labels})\n  {table}"


def unused_gpu(cfg: Config, gpu_expr: str) -> str:
    """GPU series that no rank uses."""
    if cfg.gpu_source == "dcgm":
        return f"{gpu_expr}\nunless on ({dcgm_gpu_labels(cfg)})\n{DCGM_RANK_INFO}"
    return f"{gpu_expr}\nunless on ({gpu_labels(cfg)})\n{RANK_INFO}"


def on_rank_or_gpu(cfg: Config, gpu_expr: str, copied: str = "", pick: str = "topk") -> str:
    """GPU series once for every rank that uses the GPU (``on_rank``), unchanged where none does."""
    fallback = f"(\n{indent(gpu_expr)}\n)" if "\n" in gpu_expr else gpu_expr
    on = dcgm_gpu_labels(cfg) if cfg.gpu_source == "dcgm" else gpu_labels(cfg)
    return f"(\n{indent(on_rank(cfg, gpu_expr, copied, pick))}\n)\nor on ({on})\n{fallback}"


def indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())
