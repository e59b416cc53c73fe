"""The GPU node view beside dcgm-exporter: DCGM_FI_* readings per GPU, with the run and rank using each.

For ``gpuSource: dcgm``, where the agent's NVML is off. GPUs join ranks through the recording rule
``cluster_uuid:trainpatrol_rank_info:topk1_newest`` of alerting/rules-dcgm.yml (shipped with this
dashboard): one rank per GPU UUID, so the join stays one-to-one while an older run's
``trainpatrol_rank_info`` for the same GPU is still alive, which a plain join would not.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.common import (
    DCGM_JOIN,
    DS,
    Q,
    dashboard,
    finish,
    on_dcgm_gpu,
    row,
    state_timeline,
    steps,
    target,
    ts,
    value_map,
)

UID = "trainpatrol-gpu-node-dcgm"
TITLE = "trainpatrol / GPU node (DCGM)"
ABOUT = ("dcgm-exporter's readings per GPU of the selected nodes, joined through the GPU UUID to the runs and "
         "ranks that use them (the DCGM rules' join table). GPUs no rank uses show run and rank \"-\". It opens "
         "on one node, at most 2 lines a GPU (16 on a node of 8 GPUs); the rank drill-down does not narrow it.")

NODE = 'cluster=~"$cluster", Hostname=~"$node"'
LEGEND = "{{Hostname}} GPU {{gpu}} (run {{run}} rank {{rank}})"
GPU = ("Hostname", "gpu", "UUID")
MIB = 1024 * 1024


def _by(*extra: str) -> str:
    return ", ".join((*GPU, *extra))


def on_node_gpu(expr: str) -> str:
    """``expr`` per GPU, labelled with run and rank where a rank of the selected runs uses it, "-" where none
    does."""
    used = on_dcgm_gpu(expr)
    idle = f"{expr} unless on (UUID) {DCGM_JOIN}"
    idle = f'label_replace(label_replace({idle}, "run", "-", "", ""), "rank", "-", "", "")'
    return f"({used}) or on (UUID) {idle}"


def _gauge(metric: str, scale: str = "") -> str:
    return on_node_gpu(f"max by ({_by()}) ({metric}{{{NODE}}}){scale}")


def inventory() -> table.Panel:
    info = f"max by ({_by('modelName', 'pci_bus_id', 'DCGM_FI_DRIVER_VERSION')}) (DCGM_FI_DEV_GPU_TEMP{{{NODE}}})"
    return (
        table.Panel()
        .title("GPUs and the ranks that use them")
        .description("Which GPUs does each node have (model, PCI slot, driver), and which run and rank uses "
                     "each one? GPUs no rank uses show run \"-\".")
        .datasource(DS)
        .targets([target(Q(on_node_gpu(info)), instant=True, table=True)])
        .with_transformation(dm.DataTransformerConfig("organize", options={
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {"Hostname": 0, "gpu": 1, "run": 2, "rank": 3, "modelName": 4, "UUID": 5},
        }))
        .cell_height(cm.TableCellHeight.SM)
        .span(24)
        .height(7)
    )


def build() -> dm.Dashboard:
    d = dashboard(TITLE, UID, ABOUT, 'label_values(DCGM_FI_DEV_GPU_UTIL{cluster=~"$cluster"}, Hostname)',
                  one_node=True)
    d = d.tooltip(dm.DashboardCursorSync.CROSSHAIR).time("now-3h", "now")
    d = d.with_row(row("Inventory")).with_panel(inventory())

    d = d.with_row(row("Utilization and memory"))
    d = d.with_panel(ts(
        "GPU utilization",
        "Is each GPU busy? DCGM_FI_DEV_GPU_UTIL as a fraction (dashed: the 50 % underutilization threshold).",
        [Q(_gauge("DCGM_FI_DEV_GPU_UTIL", " / 100"), LEGEND)],
        unit="percentunit", minimum=0, thresholds=steps((None, "red"), (0.5, "green")),
    ))
    d = d.with_panel(ts(
        "SM and tensor-core activity",
        "What do the GPU's units really do? DCGM's profiling fields: the share of cycles its SMs had work "
        "(DCGM_FI_PROF_SM_ACTIVE, where a counters file adds it; else the share of time its graphics engine ran, "
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE, in dcgm-exporter's default counters) and the share its tensor cores "
        "computed (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, default too). A loop whose kernels keep one SM busy reads "
        "100 % utilization above and a few percent of SM activity. Empty where dcgm-exporter collects no "
        "profiling fields.",
        [Q(_gauge("DCGM_FI_PROF_SM_ACTIVE") + "\nor\n" + _gauge("DCGM_FI_PROF_GR_ENGINE_ACTIVE"),
           LEGEND + " SM (or engine)"),
         Q(_gauge("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"), LEGEND + " tensor")],
        unit="percentunit", minimum=0,
    ))
    d = d.with_panel(ts(
        "Device memory used",
        "How much framebuffer memory is in use on each GPU, by every process, and how much is free?",
        [
            Q(_gauge("DCGM_FI_DEV_FB_USED", f" * {MIB}"), LEGEND + " used"),
            Q(_gauge("DCGM_FI_DEV_FB_FREE", f" * {MIB}"), LEGEND + " free"),
        ],
        unit="bytes", minimum=0,
    ))
    d = d.with_panel(ts(
        "Device memory used ratio",
        "How close is each GPU to full, as DCGM sees it (dashed: the 92 % OOM-risk threshold)?",
        [Q(on_node_gpu(f"max by ({_by()}) (DCGM_FI_DEV_FB_USED{{{NODE}}} / (DCGM_FI_DEV_FB_USED{{{NODE}}} "
                       f"+ DCGM_FI_DEV_FB_FREE{{{NODE}}}))"), LEGEND)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.92, "red")),
    ))
    d = d.with_panel(ts(
        "Power draw",
        "How much power does each GPU draw?",
        [Q(_gauge("DCGM_FI_DEV_POWER_USAGE"), LEGEND)], unit="watt", minimum=0,
    ))

    d = d.with_row(row("Temperatures and throttling"))
    d = d.with_panel(ts(
        "Temperatures",
        "How hot are each GPU's die and memory (dashed: 85 °C, a common warning level)?",
        [
            Q(_gauge("DCGM_FI_DEV_GPU_TEMP"), LEGEND + " gpu"),
            Q(_gauge("DCGM_FI_DEV_MEMORY_TEMP"), LEGEND + " memory"),
        ],
        unit="celsius", thresholds=steps((None, "green"), (85, "red")),
    ))
    # Bits 0x20 and 0x40 of the reasons bitmask: SW and HW thermal slowdown (what ThermalThrottle reads).
    reasons = f"(DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{NODE}}} or DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{NODE}}})"
    d = d.with_panel(state_timeline(
        "Thermal throttling",
        "Was each GPU slowed down by temperature, and when? 1 while a thermal bit (0x20 SW, 0x40 HW) of its "
        "clock event reasons is set.",
        Q(on_node_gpu(f"max by ({_by()}) (clamp_max(floor({reasons} / 32) % 4, 1))"), LEGEND),
        mappings=[value_map({"0": ("no", "transparent"), "1": ("thermal", "orange")})],
        thresholds=steps((None, "transparent"), (1, "orange")), w=12, h=8,
    ))

    d = d.with_row(row("ECC and XID"))
    d = d.with_panel(ts(
        "Double-bit ECC errors",
        "Is device memory producing uncorrectable (double-bit) ECC errors? Errors per interval.",
        [Q(on_node_gpu(f"sum by ({_by()}) (increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{NODE}}}[$__rate_interval]))"),
           LEGEND)],
        unit="short", minimum=0, bars=True, w=8,
    ))
    d = d.with_panel(ts(
        "Row remap failure",
        "Did a GPU fail to remap a faulty memory row (1: it cannot repair further errors)?",
        [Q(_gauge("DCGM_FI_DEV_ROW_REMAP_FAILURE"), LEGEND)], unit="short", minimum=0, w=8,
    ))
    d = d.with_panel(ts(
        "Last XID",
        "Which XID did the driver report last on each GPU? dcgm-exporter's XID is a gauge of the last code "
        "(0: none), not a count.",
        [Q(_gauge("DCGM_FI_DEV_XID_ERRORS"), LEGEND)], unit="none", minimum=0, w=8,
    ))
    return finish(d)
