"""NVML collector: background threads read the GPUs; a scrape serves only the last sample.

Emits the catalogue's GPU metrics (``NVML_METRICS``, listed in docs/metrics.md), per GPU labelled ``gpu``
(index) and ``uuid``, and per MIG instance of a GPU in MIG mode. Series a GPU does not support are left out.

A sample of one GPU is JSON-able: ``{"gpu", "uuid", ..., "timestamp", "series", "processes"}`` where
``series`` maps a catalogue name without its ``trainpatrol_`` prefix to ``[(extra label values, value), ...]``
in base units; the functions up to ``families()`` (which makes them prometheus_client families) are pure.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric as Family

from ..catalogue import NVML_METRICS, P

log = logging.getLogger(__name__)

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


# Uninitialized, DriverNotLoaded, LibraryNotFound, GpuIsLost, ResetRequired, LibRmVersionMismatch: the handles
# are useless, so NVML is initialised again, with backoff
_LOST_CODES = frozenset({1, 9, 12, 15, 16, 18})
_ROUTINE_CODES = frozenset({3, 13})  # NotSupported, FunctionNotFound: the series is simply left out
_TIMEOUT = 10

Gpu = tuple[object, dict[str, str]]
"""A device handle and its identity: gpu, uuid, name, pci_bus_id, serial, mig_mode."""


class NvmlUnavailable(RuntimeError):
    """There is no usable NVML sample; the message says why."""


class NvmlCollector:
    """Samples every GPU on a background thread and counts XID events on another."""

    max_backoff_seconds = 60.0
    event_timeout_ms = 1000  # bounds one nvmlEventSetWait so stop() returns within a second; each wakes the thread

    def __init__(self, nvml: object | None = None, *, interval_seconds: float = 1.0, slow_interval_seconds: float = 5.0,
                 pcie: bool = False, processes: bool = False,
                 pid_to_rank: Callable[[], dict[int, tuple[str, str]]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not interval_seconds > 0:
            raise ValueError(f"`NvmlCollector(interval_seconds={interval_seconds!r})` is not a positive interval.")
        if not slow_interval_seconds >= 0:
            raise ValueError(f"`NvmlCollector(slow_interval_seconds={slow_interval_seconds!r})` is not an interval "
                             "of 0 seconds (every sample) or more.")
        self._nvml: Any = nvml
        self.interval_seconds = interval_seconds
        self.slow_interval_seconds = slow_interval_seconds  # for SLOW_CALLS; samples between carry them
        self.stale_after_seconds = max(5.0, 5 * interval_seconds)  # collect() fails past it (a hung NVML call)
        self._pcie, self._processes = pcie, processes
        self._pid_to_rank = pid_to_rank
        self._clock = clock
        self._lock = threading.Lock()  # guards the state that scrapes and both threads share
        self._sample: dict[str, Any] | None = None
        self._error = "NVML has not been sampled yet"
        self._xids: dict[Labels, tuple[int, float]] = {}
        self._news = 0  # samples, failures and XID events so far: what moves the version
        self._gpus: list[Gpu] | None = None  # set while NVML is initialised for the sampler
        self._mig: dict[str, list[MigInstance]] = {}  # by the uuid of each GPU in MIG mode
        self._generation = 0  # bumped on every (re-)initialisation, so the event thread re-registers
        self._driver_version = ""
        self._last_raw: dict[str, dict[str, Any]] = {}  # by uuid: the last readings, slow ones included
        self._slow_due = float("-inf")
        self._initialised = False
        self._backoff = interval_seconds
        self._logged: set[str] = set()
        self._failures_logged: set[str] = set()
        self._sampling = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the sampler thread and the XID event thread."""
        if self._threads:
            return
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run_sampler, name="trainpatrol-nvml", daemon=True),
                         threading.Thread(target=self._run_events, name="trainpatrol-nvml-xid", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop both threads (bounded waits) and shut NVML down."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.event_timeout_ms / 1000 + 5.0)
        hung = any(t.is_alive() for t in self._threads)
        self._threads = []
        if not hung:  # never pull NVML from under a call that is still in flight
            with self._sampling:
                self._shutdown()

    def version(self) -> Hashable:
        """Moves with a new sample, failure or XID event, and when the sample goes stale."""
        return self._news, self._stale()

    def _stale(self) -> bool:
        sample = self._sample
        return sample is not None and self._clock() - sample["timestamp"] > self.stale_after_seconds

    def collect(self) -> list[Family]:
        """The last sample's families; raises NvmlUnavailable when there is no usable one."""
        with self._lock:
            sample, error, xids = self._sample, self._error, dict(self._xids)
        if error or sample is None:
            raise NvmlUnavailable(error or "no NVML sample")
        if self._stale():
            age, limit = self._clock() - sample["timestamp"], self.stale_after_seconds
            raise NvmlUnavailable(f"the last NVML sample is {age:.1f} s old (limit {limit:g} s)")
        return families(sample["gpus"], xids)

    def uuids(self) -> frozenset[str]:
        """The UUIDs of this node's GPUs and their MIG instances, from the last sample; empty before one."""
        with self._lock:
            gpus = (self._sample or {}).get("gpus", [])
        found = {gpu["uuid"] for gpu in gpus}
        found.update(labels[0] for gpu in gpus for labels, _ in gpu["series"].get("gpu_mig_info", []))
        return frozenset(found)

    def snapshot(self) -> dict[str, Any]:
        """The last sample, the current error and the XID counts, as JSON-able data."""
        with self._lock:
            sample, error = copy.deepcopy(self._sample) or {}, self._error
            xids = [{"gpu": gpu, "uuid": uuid, "xid": xid, "count": count, "last_timestamp_seconds": last}
                    for (gpu, uuid, xid), (count, last) in sorted(self._xids.items())]
        return {"error": error or None, "timestamp": sample.get("timestamp"),
                "driver_version": sample.get("driver_version", ""), "gpus": sample.get("gpus", []), "xid": xids}

    def sample_once(self) -> float:
        """Sample every GPU, initialising NVML first if needed; returns the seconds until the next try."""
        with self._sampling:
            started, begun = self._clock(), time.monotonic()
            try:
                gpus = self._gpus if self._gpus is not None else self._init()
                ranks = self._ranks() if self._processes else None
                slow = started >= self._slow_due
                samples = [sample_gpu(info, self._read(handle, info["uuid"], slow),
                                         driver_version=self._driver_version, timestamp=self._clock(),
                                         pid_to_rank=ranks) for handle, info in gpus]
                for sample in samples:
                    if sample["uuid"] in self._mig:
                        sample["series"].update(mig_series(self._call, self._mig[sample["uuid"]]))
                if slow:
                    self._slow_due = started + self.slow_interval_seconds
            except Exception as exc:  # the sampler must outlive any driver or GPU fault
                return self._fail(exc)
            sample = {"timestamp": started, "driver_version": self._driver_version, "gpus": samples}
            with self._lock:
                self._sample, self._error = sample, ""
                self._news += 1
            if self._failures_logged:
                log.info("NVML sampling recovered: %d GPU(s)", len(samples))
                self._failures_logged.clear()
            self._backoff = self.interval_seconds
            return max(0.0, self.interval_seconds - (time.monotonic() - begun))

    def _read(self, handle: object, uuid: str, slow: bool) -> dict[str, Any]:
        """This GPU's readings: all of them when ``slow``, else the fast ones over the last slow ones."""
        last = self._last_raw.get(uuid)
        if slow or last is None:
            self._last_raw[uuid] = read_gpu(self._call, handle, pcie=self._pcie, processes=self._processes)
            return self._last_raw[uuid]
        return {**last, **read_gpu(self._call, handle, pcie=self._pcie, processes=self._processes, slow=False)}

    # -- sampler -------------------------------------------------------------------------------

    def _run_sampler(self) -> None:
        delay = self.sample_once()
        while not self._stop.wait(delay):
            delay = self.sample_once()

    def _init(self) -> list[Gpu]:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from exc
            self._nvml = pynvml
        nvml = self._nvml
        nvml.nvmlInit()
        self._initialised = True
        self._driver_version = text(self._call("nvmlSystemGetDriverVersion"))
        gpus: list[Gpu] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            is_mig = self._call("nvmlDeviceIsMigDeviceHandle", handle)
            if getattr(is_mig, "value", is_mig):  # pynvml returns a c_uint here
                continue  # a MIG child is not a GPU of its own; its parent says mig_mode="enabled"
            gpus.append((handle, read_identity(self._call, handle, index)))
        self._mig = {info["uuid"]: mig_instances(self._call, handle, self._mig_child)
                     for handle, info in gpus if info["mig_mode"] == "enabled"}
        with self._lock:
            self._gpus = gpus
            self._generation += 1
        return gpus

    def _fail(self, exc: Exception) -> float:
        reason = f"{type(exc).__name__}: {exc}"
        self._shutdown()
        with self._lock:
            self._error = reason
            self._news += 1
        if reason not in self._failures_logged:
            self._failures_logged.add(reason)
            log.warning("NVML unavailable (%s); GPU metrics are off, retrying with backoff up to %.0f s",
                        reason, self.max_backoff_seconds)
        delay, self._backoff = self._backoff, min(self._backoff * 2, self.max_backoff_seconds)
        return delay

    def _shutdown(self) -> None:
        self._last_raw.clear()  # a re-initialised GPU is read whole first
        self._slow_due = float("-inf")
        with self._lock:
            self._gpus = None
            self._generation += 1
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(Exception):  # the driver may be gone; nothing is left to release
                self._nvml.nvmlShutdown()

    def _call(self, name: str, *args: Any) -> Any:
        """``nvml.<name>(*args)``, or None where unsupported; errors that lose the GPU propagate."""
        fn = getattr(self._nvml, name, None)
        if fn is None:
            self._note(name, "missing from this pynvml")
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if getattr(exc, "value", None) in _LOST_CODES:
                raise
            self._note(name, exc)
            return None

    def _mig_child(self, parent: object, index: int) -> object | None:
        """The ``index``-th MIG device of ``parent``; None for an empty slot (NVML answers NotFound)."""
        try:
            handle: object = self._nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
            return handle
        except Exception as exc:
            code = getattr(exc, "value", None)
            if code in _LOST_CODES:
                raise
            if code != ERROR_NOT_FOUND:
                self._note("nvmlDeviceGetMigDeviceHandleByIndex", exc)
            return None

    def _ranks(self) -> dict[int, tuple[str, str]]:
        try:
            return dict(self._pid_to_rank()) if self._pid_to_rank else {}
        except Exception as exc:  # a broken mapping must not cost the GPU metrics
            self._note("pid_to_rank", exc)
            return {}

    def _note(self, name: str, error: object) -> None:
        key = f"{name}: {type(error).__name__}: {error}"
        if key not in self._logged:
            self._logged.add(key)
            routine = getattr(error, "value", None) in _ROUTINE_CODES
            log.log(logging.DEBUG if routine else logging.WARNING, "NVML %s", key)

    # -- XID events ------------------------------------------------------------------------------

    def _run_events(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                gpus, generation = self._gpus, self._generation
            eset = self._register(gpus) if gpus else None
            if eset is None:  # no NVML or no XID events here: try again after the next (re-)init
                while not self._stop.wait(self.interval_seconds) and self._generation == generation:
                    pass
                continue
            try:
                self._wait_events(eset, generation)
            finally:
                self._release(eset)

    def _register(self, gpus: list[Gpu]) -> object | None:
        nvml = self._nvml
        try:
            nvml.nvmlInit()  # our own reference: a re-init by the sampler must not free the set under us
        except Exception as exc:
            self._note("nvmlInit", exc)
            return None
        try:
            eset: object = nvml.nvmlEventSetCreate()
        except Exception as exc:
            self._note("nvmlEventSetCreate", exc)
            self._release(None)
            return None
        registered = 0
        for handle, _ in gpus:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, EVENT_XID_CRITICAL, eset)
                registered += 1
            except Exception as exc:
                self._note("nvmlDeviceRegisterEvents", exc)
        if not registered:
            self._release(eset)
            return None
        return eset

    def _wait_events(self, eset: object, generation: int) -> None:
        nvml = self._nvml
        while not self._stop.is_set() and self._generation == generation:
            try:
                data = nvml.nvmlEventSetWait(eset, self.event_timeout_ms)
            except Exception as exc:
                if getattr(exc, "value", None) == _TIMEOUT:
                    continue
                self._note("nvmlEventSetWait", exc)
                self._stop.wait(self.interval_seconds)
                return
            if data.eventType & EVENT_XID_CRITICAL:
                self._record_xid(data.device, int(data.eventData))

    def _record_xid(self, device: object, xid: int) -> None:
        try:
            uuid = text(self._nvml.nvmlDeviceGetUUID(device))
        except Exception:
            uuid = ""
        with self._lock:
            gpu = next((info["gpu"] for _, info in self._gpus or () if info["uuid"] == uuid), "")
            key = (gpu, uuid, str(xid))
            count = self._xids.get(key, (0, 0.0))[0]
            self._xids[key] = (count + 1, self._clock())
            self._news += 1
        log.warning("XID %d on GPU %s (%s)", xid, gpu or "?", uuid or "unknown uuid")

    def _release(self, eset: object | None) -> None:
        with contextlib.suppress(Exception):  # the set dies with the driver anyway
            if eset is not None:
                self._nvml.nvmlEventSetFree(eset)
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()
