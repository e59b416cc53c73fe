"""One GPU's NVML readings: which calls to make, and their pure conversion to catalogue series.

A sample of one GPU is JSON-able: ``{"gpu", "uuid", ..., "timestamp", "series", "processes"}`` where
``series`` maps a catalogue name without its ``trainpatrol_`` prefix to ``[(extra label values,
value), ...]`` in base units. ``families()`` turns samples into prometheus_client families.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric as Family

from ..catalogue import NVML_METRICS, P

Labels = tuple[str, ...]
Series = dict[str, list[tuple[Labels, float]]]
Call = Callable[..., Any]
"""``call(name, *args)``: the pynvml function's result, or None where the GPU does not support it."""

# NVML enum values are a stable C ABI; tests check them against pynvml.
TEMPERATURE_GPU = 0
FI_DEV_MEMORY_TEMP = 82
CLOCK_SM, CLOCK_MEM = 1, 2
PCIE_UTIL_TX_BYTES, PCIE_UTIL_RX_BYTES = 0, 1
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC = 0, 1, 0
RETIRED_MULTIPLE_SBE, RETIRED_DBE = 0, 1
PSTATE_UNKNOWN = 32
DEVICE_MIG_ENABLE = 1
EVENT_XID_CRITICAL = 0x8

CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100}
_FIELD_VALUE_ATTR = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def read_identity(call: Call, handle: object, index: int) -> dict[str, str]:
    """A GPU's identity labels, read once per NVML initialisation (MIG mode changes need a reset)."""
    mig = call("nvmlDeviceGetMigMode", handle)
    pci = call("nvmlDeviceGetPciInfo", handle)
    return {
        "gpu": str(index),
        "uuid": text(call("nvmlDeviceGetUUID", handle)),
        "name": text(call("nvmlDeviceGetName", handle)),
        "pci_bus_id": text(pci.busId) if pci is not None else "",
        "serial": text(call("nvmlDeviceGetSerial", handle)),
        "mig_mode": "" if mig is None else ("enabled" if mig[0] == DEVICE_MIG_ENABLE else "disabled"),
    }


MigInstance = tuple[object, Labels]
"""A MIG device handle and its labels: mig_uuid, gpu_instance, compute_instance, profile."""
ERROR_NOT_FOUND = 6


def mig_instances(call: Call, parent: object, child: Callable[[object, int], object | None]) -> list[MigInstance]:
    """The MIG instances of a MIG-enabled GPU, read once per NVML initialisation like its identity.
    ``child(parent, i)``: the i-th MIG device handle, None for an empty slot."""
    out: list[MigInstance] = []
    for i in range(int(call("nvmlDeviceGetMaxMigDeviceCount", parent) or 0)):
        handle = child(parent, i)
        if handle is None:
            continue
        name = text(call("nvmlDeviceGetName", handle))
        out.append((handle, (text(call("nvmlDeviceGetUUID", handle)), text(call("nvmlDeviceGetGpuInstanceId", handle)),
                             text(call("nvmlDeviceGetComputeInstanceId", handle)),
                             name.rpartition(" MIG ")[2] if " MIG " in name else "")))
    return out


def mig_series(call: Call, instances: Sequence[MigInstance]) -> Series:
    """Per MIG instance: its info and its memory; its utilization is not readable (NVML: not supported)."""
    series: Series = {"gpu_mig_info": [(labels, 1.0) for _, labels in instances]}
    for handle, labels in instances:
        mem = call("nvmlDeviceGetMemoryInfo", handle)
        if mem is not None:
            series.setdefault("gpu_mig_memory_used_bytes", []).append(((labels[0],), float(mem.used)))
            series.setdefault("gpu_mig_memory_total_bytes", []).append(((labels[0],), float(mem.total)))
    return series


SLOW_CALLS = ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption",
              "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetRemappedRows")
"""Read every slow interval, with ECC, retired pages and PCIe throughput (read_gpu): counters, settings that
rarely move, and the calls that block (energy, PCIe throughput)."""


def read_gpu(call: Call, handle: object, *, pcie: bool, processes: bool, slow: bool = True) -> dict[str, Any]:
    """Raw readings of one GPU, keyed ``name[/arg...]`` like the fixture; None where unsupported. With
    ``slow`` False, the readings of SLOW_CALLS, ECC, retired pages and PCIe throughput are left out."""
    raw: dict[str, Any] = {}

    def get(name: str, *args: int) -> None:
        fn_args: tuple[Any, ...] = ([*args],) if name == "nvmlDeviceGetFieldValues" else args
        raw["/".join([name, *map(str, args)])] = call(name, handle, *fn_args)

    for name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage",
                 "nvmlDeviceGetPerformanceState"):
        get(name)
    get("nvmlDeviceGetTemperature", TEMPERATURE_GPU)
    get("nvmlDeviceGetFieldValues", FI_DEV_MEMORY_TEMP)
    get("nvmlDeviceGetClockInfo", CLOCK_SM)
    get("nvmlDeviceGetClockInfo", CLOCK_MEM)
    get("nvmlDeviceGetCurrentClocksEventReasons")
    if raw["nvmlDeviceGetCurrentClocksEventReasons"] is None:  # drivers before 535
        get("nvmlDeviceGetCurrentClocksThrottleReasons")
    if processes:
        get("nvmlDeviceGetComputeRunningProcesses")
    if not slow:
        return raw
    for name in SLOW_CALLS:
        get(name)
    for error_type in (MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED):
        get("nvmlDeviceGetTotalEccErrors", error_type, VOLATILE_ECC)
    for cause in (RETIRED_MULTIPLE_SBE, RETIRED_DBE):
        get("nvmlDeviceGetRetiredPages", cause)
    if pcie:  # the slowest call of all
        get("nvmlDeviceGetPcieThroughput", PCIE_UTIL_TX_BYTES)
        get("nvmlDeviceGetPcieThroughput", PCIE_UTIL_RX_BYTES)
    return raw


def parse_gpu(raw: Mapping[str, Any]) -> Series:
    """Convert raw readings to base units: bytes, watts, joules, hertz, celsius, 0-1 ratios."""
    s: Series = defaultdict(list)

    def put(key: str, value: float | None, *labels: str) -> None:
        if value is not None:
            s[key].append((labels, float(value)))

    util = raw.get("nvmlDeviceGetUtilizationRates")
    if util is not None:
        put("gpu_utilization_ratio", util.gpu / 100)
        put("gpu_memory_utilization_ratio", util.memory / 100)
    mem = raw.get("nvmlDeviceGetMemoryInfo")
    if mem is not None:
        put("gpu_memory_used_bytes", mem.used)
        put("gpu_memory_free_bytes", mem.free)
        put("gpu_memory_total_bytes", mem.total)
    put("gpu_power_watts", _scaled(raw.get("nvmlDeviceGetPowerUsage"), 1e-3))
    put("gpu_power_limit_watts", _scaled(raw.get("nvmlDeviceGetEnforcedPowerLimit"), 1e-3))
    put("gpu_energy_joules_total", _scaled(raw.get("nvmlDeviceGetTotalEnergyConsumption"), 1e-3))
    put("gpu_temperature_celsius", raw.get(f"nvmlDeviceGetTemperature/{TEMPERATURE_GPU}"), "gpu")
    put("gpu_temperature_celsius", _field_value(raw.get(f"nvmlDeviceGetFieldValues/{FI_DEV_MEMORY_TEMP}")),
        "memory")
    put("gpu_clock_hertz", _scaled(raw.get(f"nvmlDeviceGetClockInfo/{CLOCK_SM}"), 1e6), "sm")
    put("gpu_clock_hertz", _scaled(raw.get(f"nvmlDeviceGetClockInfo/{CLOCK_MEM}"), 1e6), "memory")
    pstate = raw.get("nvmlDeviceGetPerformanceState")
    put("gpu_performance_state", None if pstate == PSTATE_UNKNOWN else pstate)
    reasons = raw.get("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:
        reasons = raw.get("nvmlDeviceGetCurrentClocksThrottleReasons")
    if reasons is not None:
        for reason, bit in CLOCK_EVENT_REASONS.items():
            put("gpu_clock_event_active", 1 if reasons & bit else 0, reason)
    put("gpu_pcie_link_generation", raw.get("nvmlDeviceGetCurrPcieLinkGeneration"))
    put("gpu_pcie_link_width", raw.get("nvmlDeviceGetCurrPcieLinkWidth"))
    for direction, counter in (("tx", PCIE_UTIL_TX_BYTES), ("rx", PCIE_UTIL_RX_BYTES)):
        # NVML reports KB/s, where KB is 1024 bytes
        put("gpu_pcie_throughput_bytes_per_second",
            _scaled(raw.get(f"nvmlDeviceGetPcieThroughput/{counter}"), 1024), direction)
    for kind, error_type in (("corrected", MEMORY_ERROR_CORRECTED),
                             ("uncorrected", MEMORY_ERROR_UNCORRECTED)):
        put("gpu_ecc_errors_total", raw.get(f"nvmlDeviceGetTotalEccErrors/{error_type}/{VOLATILE_ECC}"), kind)
    for cause, code in (("multiple_single_bit_ecc", RETIRED_MULTIPLE_SBE), ("double_bit_ecc", RETIRED_DBE)):
        pages = raw.get(f"nvmlDeviceGetRetiredPages/{code}")
        put("gpu_retired_pages", None if pages is None else len(pages), cause)
    rows = raw.get("nvmlDeviceGetRemappedRows")
    if rows is not None:
        for state, value in zip(("correctable", "uncorrectable", "pending", "failure"), rows, strict=False):
            put("gpu_remapped_rows", value, state)
    return dict(s)


def sample_gpu(
    info: Mapping[str, str], raw: Mapping[str, Any], *, driver_version: str, timestamp: float,
    pid_to_rank: Mapping[int, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """One GPU's JSON-able sample from its identity (gpu, uuid, name, pci_bus_id, serial, mig_mode)."""
    series = parse_gpu(raw)
    identity = (info["name"], info["pci_bus_id"], driver_version, info["serial"], info["mig_mode"])
    series["gpu_info"] = [(identity, 1.0)]
    series["nvml_sample_timestamp_seconds"] = [((), timestamp)]
    sample: dict[str, Any] = {**info, "timestamp": timestamp, "series": series}
    if pid_to_rank is not None:
        procs = raw.get("nvmlDeviceGetComputeRunningProcesses")
        rows: list[dict[str, Any]] = []
        for p in procs or ():
            run, rank = pid_to_rank.get(int(p.pid), ("", ""))
            used = p.usedGpuMemory  # None where the driver cannot attribute memory
            rows.append({"pid": int(p.pid), "used_bytes": None if used is None else int(used), "run": run,
                         "rank": rank})
        sample["processes"] = rows
        if procs is not None:  # summed by (run, rank): a pid never becomes a label
            total: dict[Labels, float] = defaultdict(float)
            for row in rows:
                total[row["run"], row["rank"]] += row["used_bytes"] or 0
            series["gpu_process_memory_bytes"] = sorted(total.items())
    return sample


def families(gpus: Sequence[Mapping[str, Any]], xids: Mapping[Labels, tuple[int, float]]) -> list[Family]:
    """The families, in catalogue order, of GPU samples and XID counts keyed (gpu, uuid, xid); a
    family no GPU has is left out."""
    rows = _rows(gpus, xids)
    out = []
    for spec in NVML_METRICS:
        series = rows.get(spec.name[len(P):])
        if series:
            fam, names = spec.family(), spec.all_labels
            name = fam.name + {"counter": "_total", "info": "_info"}.get(spec.kind, "")
            info = spec.kind == "info"
            for labels, value in series:
                fam.add_sample(name, dict(_label_items(names, labels)), 1.0 if info else value)
            out.append(fam)
    return out


@functools.lru_cache(maxsize=8192)  # bounded: a node's GPUs, MIG instances and XID codes come back every sample
def _label_items(names: tuple[str, ...], labels: Labels) -> tuple[tuple[str, str], ...]:
    """A series' labels sorted by name."""
    return tuple(sorted(zip(names, labels, strict=True)))


def _rows(gpus: Sequence[Mapping[str, Any]], xids: Mapping[Labels, tuple[int, float]]) -> Series:
    """Every series of all GPUs and the XID counts, by catalogue name without the prefix."""
    rows: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    for gpu in gpus:
        base = (gpu["gpu"], gpu["uuid"])
        for key, series in gpu["series"].items():
            rows[key].extend((base + tuple(labels), value) for labels, value in series)
    for labels, (count, last) in sorted(xids.items()):
        rows["gpu_xid_errors_total"].append((labels, float(count)))
        rows["gpu_xid_last_timestamp_seconds"].append((labels, last))
    return rows


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _field_value(values: Sequence[Any] | None) -> float | None:
    if not values or values[0].nvmlReturn != 0 or not 0 <= values[0].valueType < len(_FIELD_VALUE_ATTR):
        return None
    fv = values[0]
    return float(getattr(fv.value, _FIELD_VALUE_ATTR[fv.valueType]))


def text(value: object) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
