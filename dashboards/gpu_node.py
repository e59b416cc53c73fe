"""The GPU node view: NVML readings per GPU, each labelled with the run and rank that use it."""

from __future__ import annotations

from grafana_foundation_sdk.builders import bargauge, table
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from dashboards.common import (
    DS,
    NODE,
    RANK_GPU,
    WHOLE,
    Q,
    dashboard,
    finish,
    on_node_gpu,
    row,
    state_timeline,
    steps,
    target,
    ts,
    value_map,
)

UID = "trainpatrol-gpu-node"
TITLE = "trainpatrol / GPU node"
ABOUT = ("NVML readings per GPU of the selected nodes, joined through the GPU uuid to the runs and ranks "
         "that use them. It opens on one node, a line or two per GPU (at most 20 lines on a node of 8 "
         "GPUs); pick more nodes for more lines. Picking a run narrows the panels to its GPUs plus the GPUs no "
         "rank uses (run and rank \"-\"); the rank drill-down does not narrow them.")

LEGEND = "{{node}} GPU {{gpu}} (run {{run}} rank {{rank}})"
RI = "$__rate_interval"
GPU = ("node", "instance", "gpu", "uuid")  # node: shown; instance and uuid: the join to ranks
ENERGY = "trainpatrol_gpu_energy_joules_total"


def _by(*extra: str) -> str:
    return ", ".join((*GPU, *extra))


def _gauge(metric: str, *extra: str) -> str:
    """A per-GPU gauge, labelled with run and rank."""
    return on_node_gpu(f"max by ({_by(*extra)}) ({metric}{{{NODE}}})")


def _counter(metric: str, window: str, *extra: str) -> str:
    return on_node_gpu(f"sum by ({_by(*extra)}) (increase({metric}{{{NODE}}}[{window}]))")


def inventory() -> table.Panel:
    expr = (f"trainpatrol_gpu_info{{{NODE}}} * on (instance, uuid) group_left (run, rank) {RANK_GPU} "
            f"or on (instance, uuid) trainpatrol_gpu_info{{{NODE}}}")
    return (
        table.Panel()
        .title("GPUs and the ranks that use them")
        .description("Which GPUs does each node have, which run and rank uses each one, and which driver "
                     "and PCI slot is it on? GPUs no rank of the selected runs uses show an empty run.")
        .datasource(DS)
        .targets([target(Q(expr), instant=True, table=True)])
        .with_transformation(dm.DataTransformerConfig("organize", options={
            "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True, "instance": True},
            "indexByName": {"node": 0, "gpu": 1, "run": 2, "rank": 3, "name": 4, "uuid": 5},
        }))
        .cell_height(cm.TableCellHeight.SM)
        .span(24)
        .height(7)
    )


def energy() -> bargauge.Panel:
    return (
        bargauge.Panel()
        .title("Energy in the time range")
        .description("How much energy did each GPU consume over the selected time range?")
        .datasource(DS)
        .targets([target(Q(_counter(ENERGY, "$__range"), LEGEND), instant=True)])
        .unit("joule")
        .min(0)
        .display_mode(cm.BarGaugeDisplayMode.BASIC)
        .orientation(cm.VizOrientation.HORIZONTAL)
        .span(12)
        .height(8)
    )


def build() -> dm.Dashboard:
    d = dashboard(TITLE, UID, ABOUT, 'label_values(trainpatrol_gpu_info{cluster=~"$cluster"}, node)', one_node=True)
    d = d.tooltip(dm.DashboardCursorSync.CROSSHAIR).time("now-3h", "now")
    d = d.with_row(row("Inventory")).with_panel(inventory())

    d = d.with_row(row("Utilization and memory"))
    d = d.with_panel(ts(
        "GPU utilization",
        "Is each GPU busy? Fraction of the sample period a kernel was running (dashed: the 50 % "
        "underutilization threshold).",
        [Q(_gauge("trainpatrol_gpu_utilization_ratio"), LEGEND)],
        unit="percentunit", minimum=0, thresholds=steps((None, "red"), (0.5, "green")),
    ))
    d = d.with_panel(ts(
        "Memory bandwidth utilization",
        "Is the workload memory-bound? Fraction of the sample period device memory was read or written.",
        [Q(_gauge("trainpatrol_gpu_memory_utilization_ratio"), LEGEND)], unit="percentunit", minimum=0,
    ))
    d = d.with_panel(ts(
        "Device memory used",
        "How much device memory is in use on each GPU, by every process, against its total?",
        [
            Q(_gauge("trainpatrol_gpu_memory_used_bytes"), LEGEND + " used"),
            Q(_gauge("trainpatrol_gpu_memory_total_bytes"), LEGEND + " total"),
        ],
        unit="bytes", minimum=0,
    ))
    d = d.with_panel(ts(
        "Device memory used ratio",
        "How close is each GPU to full, as NVML sees it (dashed: the 92 % OOM-risk threshold)?",
        [Q(on_node_gpu(f"max by ({_by()}) (trainpatrol_gpu_memory_used_bytes{{{NODE}}} "
                  f"/ trainpatrol_gpu_memory_total_bytes{{{NODE}}})"), LEGEND)],
        unit="percentunit", minimum=0, thresholds=steps((None, "green"), (0.92, "red")),
    ))

    d = d.with_row(row("Power and energy"))
    d = d.with_panel(ts(
        "Power draw and limit",
        "How much power does each GPU draw, and is it pinned at its enforced limit?",
        [
            Q(_gauge("trainpatrol_gpu_power_watts"), LEGEND),
            Q(_gauge("trainpatrol_gpu_power_limit_watts"), LEGEND + " limit"),
        ],
        unit="watt", minimum=0,
    ))
    d = d.with_panel(energy())

    d = d.with_row(row("Temperatures"))
    d = d.with_panel(ts(
        "Temperatures",
        "How hot are each GPU's die and memory (dashed: 85 °C, a common warning level; the GPU "
        "throttles on its own limits)?",
        [Q(_gauge("trainpatrol_gpu_temperature_celsius", "sensor"), LEGEND + " {{sensor}}")],
        unit="celsius", thresholds=steps((None, "green"), (85, "red")), w=24,
    ))

    d = d.with_row(row("Clocks and throttling"))
    d = d.with_panel(ts(
        "Clocks",
        "Are SM and memory clocks at their usual speed, or pulled down?",
        [Q(_gauge("trainpatrol_gpu_clock_hertz", "clock"), LEGEND + " {{clock}}")], unit="hertz", minimum=0,
    ))
    d = d.with_panel(ts(
        "Performance state",
        "Is each GPU in P0 (fastest), or has it dropped to a slower performance state?",
        [Q(_gauge("trainpatrol_gpu_performance_state"), LEGEND)], unit="none", minimum=0,
    ))
    d = d.with_panel(state_timeline(
        "Throttle reasons",
        "Which clock-event (throttle) reasons were active on the node's GPUs, and when? A row per reason "
        "(9 at most) per node, coloured while it is active on any GPU; the value is how many GPUs.",
        Q(f"sum by (node, reason) (max by ({_by('reason')}) (trainpatrol_gpu_clock_event_active{{{NODE}}}))",
          "{{node}} {{reason}}"),
        mappings=[value_map({"0": ("inactive", "transparent")})],
        thresholds=steps((None, "transparent"), (1, "orange")), w=24, h=10,
    ))

    d = d.with_row(row("ECC and XID"))
    d = d.with_panel(ts(
        "ECC errors",
        "Is device memory producing corrected or uncorrected ECC errors?",
        [Q(_counter("trainpatrol_gpu_ecc_errors_total", RI, "type"), LEGEND + " {{type}}")],
        unit="short", minimum=0, bars=True, w=8,
    ))
    # Per state (4) and cause (2) summed over the node's GPUs, and per GPU summed over states and causes:
    # 14 lines on a node of 8 GPUs, not 6 a GPU.
    rows_pages = (f"max by ({_by('state')}) (trainpatrol_gpu_remapped_rows{{{NODE}}}) or "
                  f'label_replace(max by ({_by("cause")}) (trainpatrol_gpu_retired_pages{{{NODE}}}), '
                  '"state", "retired pages ($1)", "cause", "(.*)")')
    d = d.with_panel(ts(
        "Remapped rows and retired pages",
        "Has a GPU remapped memory rows (Ampere and later) or retired pages (older GPUs), did a remap "
        "fail, or is one pending a reset? Each state summed over the node's GPUs, and each GPU's rows and "
        "pages in all states.",
        [
            Q(f"sum by (node, state) ({rows_pages})", "{{node}} {{state}}, all GPUs"),
            Q(on_node_gpu(f"sum by ({_by()}) ({rows_pages})"), LEGEND + " rows and pages"),
        ],
        unit="short", minimum=0, w=8,
    ))
    # A GPU without XID errors has no xid series: it shows 0. The codes: the node's 3 most frequent over
    # the time range (xid "none" at 0 when the node has had none).
    xids = f"trainpatrol_gpu_xid_errors_total{{{NODE}}}"
    xid = on_node_gpu(
        f"(sum by ({_by()}) (increase({xids}[{RI}])) "
        f"or on (instance, uuid) 0 * max by ({_by()}) (trainpatrol_gpu_info{{{NODE}}}))"
    )
    codes = (f"(sum by (node, xid) (increase({xids}[{RI}])) and on (node, xid) "
             f"topk by (node) (3, sum by (node, xid) (increase({xids}{WHOLE})))) "
             f'or label_replace(0 * max by (node) (trainpatrol_gpu_info{{{NODE}}}), "xid", "none", "", "")')
    d = d.with_panel(ts(
        "XID errors",
        "Did the driver report XID errors on a GPU, and which codes? Errors per interval on each GPU, and "
        'per code on the node for its 3 most frequent codes over the time range (xid "none" at 0).',
        [Q(xid, LEGEND + " XIDs"), Q(codes, "{{node}} xid {{xid}}, all GPUs")],
        unit="short", minimum=0, bars=True, w=8,
    ))

    d = d.with_row(row("Freshness"))
    d = d.with_panel(ts(
        "NVML sample age",
        "Is the agent's NVML sampler keeping up? Seconds since the served sample was taken.",
        [Q(on_node_gpu(f"max by ({_by()}) (time() - trainpatrol_nvml_sample_timestamp_seconds{{{NODE}}})"),
           LEGEND)],
        unit="s", minimum=0, w=24, h=6,
    ))
    return finish(d)
