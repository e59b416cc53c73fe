"""NVML collector: background threads read the GPUs; a scrape serves only the last sample.

Emits the catalogue's GPU metrics (``NVML_METRICS``, listed in docs/metrics.md), per GPU labelled ``gpu``
(index) and ``uuid``, and per MIG instance of a GPU in MIG mode. Series a GPU does not support are left out.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from prometheus_client.metrics_core import Metric as Family

from . import _nvml_sample as ns

log = logging.getLogger(__name__)

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
        self.slow_interval_seconds = slow_interval_seconds  # for ns.SLOW_CALLS; samples between carry them
        self.stale_after_seconds = max(5.0, 5 * interval_seconds)  # collect() fails past it (a hung NVML call)
        self._pcie, self._processes = pcie, processes
        self._pid_to_rank = pid_to_rank
        self._clock = clock
        self._lock = threading.Lock()  # guards the state that scrapes and both threads share
        self._sample: dict[str, Any] | None = None
        self._error = "NVML has not been sampled yet"
        self._xids: dict[ns.Labels, tuple[int, float]] = {}
        self._news = 0  # samples, failures and XID events so far: what moves the version
        self._gpus: list[Gpu] | None = None  # set while NVML is initialised for the sampler
        self._mig: dict[str, list[ns.MigInstance]] = {}  # by the uuid of each GPU in MIG mode
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
        return ns.families(sample["gpus"], xids)

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
                samples = [ns.sample_gpu(info, self._read(handle, info["uuid"], slow),
                                         driver_version=self._driver_version, timestamp=self._clock(),
                                         pid_to_rank=ranks) for handle, info in gpus]
                for sample in samples:
                    if sample["uuid"] in self._mig:
                        sample["series"].update(ns.mig_series(self._call, self._mig[sample["uuid"]]))
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
            self._last_raw[uuid] = ns.read_gpu(self._call, handle, pcie=self._pcie, processes=self._processes)
            return self._last_raw[uuid]
        return {**last, **ns.read_gpu(self._call, handle, pcie=self._pcie, processes=self._processes, slow=False)}

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
        self._driver_version = ns.text(self._call("nvmlSystemGetDriverVersion"))
        gpus: list[Gpu] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            is_mig = self._call("nvmlDeviceIsMigDeviceHandle", handle)
            if getattr(is_mig, "value", is_mig):  # pynvml returns a c_uint here
                continue  # a MIG child is not a GPU of its own; its parent says mig_mode="enabled"
            gpus.append((handle, ns.read_identity(self._call, handle, index)))
        self._mig = {info["uuid"]: ns.mig_instances(self._call, handle, self._mig_child)
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
            if code != ns.ERROR_NOT_FOUND:
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
                nvml.nvmlDeviceRegisterEvents(handle, ns.EVENT_XID_CRITICAL, eset)
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
            if data.eventType & ns.EVENT_XID_CRITICAL:
                self._record_xid(data.device, int(data.eventData))

    def _record_xid(self, device: object, xid: int) -> None:
        try:
            uuid = ns.text(self._nvml.nvmlDeviceGetUUID(device))
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
