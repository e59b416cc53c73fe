"""A stand-in for the pynvml module that serves readings recorded on a real H200.

``FakeNvml.from_fixture()`` loads ``nvml_h200.json`` beside it (written by bench/capture_nvml_fixture.py)
and presents it as ``gpus`` GPUs that differ only in index, uuid, PCI bus id and serial. Calls the
real GPU did not support raise the same NVMLError subclass here. Hooks inject faults: a lost GPU,
a missing driver, an XID event, MIG mode, or any other value. Every call is counted in ``calls``
and can be slowed down with ``delays`` (seconds per function name), as on real hardware.

Test code, not shipped: tests import it as ``nvml_fake.fake``; ``trainpatrol agent --nvml-fake FIXTURE``
loads it by path from beside its fixture (agent/server.py), for demos from the repository.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml  # only for the exception classes; the library itself is never loaded

DEFAULT_FIXTURE = Path(__file__).parent / "nvml_h200.json"
NVMLError = pynvml.NVMLError


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass(frozen=True)
class MigHandle:
    """A MIG device: slot ``slot`` of GPU ``index``."""
    index: int
    slot: int


@dataclass(frozen=True)
class MigInstance:
    """What NVML reports of one MIG device; a test sets the values (no MIG-configured GPU was recorded)."""
    gpu_instance: int
    compute_instance: int
    profile: str
    total_bytes: int
    used_bytes: int


MAX_MIG_DEVICES = 7


@dataclass
class _EventSet:
    handles: set[int]


def _error(name: str) -> pynvml.NVMLError:
    cls = getattr(pynvml, name)
    return cls()  # type: ignore[no-any-return]


def _obj(value: Any) -> Any:
    """JSON from the fixture as pynvml returns it: structures as attribute objects."""
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _obj(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_obj(v) for v in value]
    return value


class FakeNvml:
    """Module-like fake of the pynvml functions the NVML collector uses."""

    NVMLError = pynvml.NVMLError

    def __init__(self, fixture: Mapping[str, Any], gpus: int = 8, delays: Mapping[str, float] | None = None):
        self.fixture = fixture
        self.gpus = gpus
        self.delays = dict(delays or {})
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Condition()
        self._init_count = 0
        self._driver_error: str | None = None
        self._lost: set[int] = set()
        self._overrides: dict[int, dict[str, tuple[Any, str | None]]] = collections.defaultdict(dict)
        self._events: collections.deque[tuple[int, int]] = collections.deque()
        self._mig: dict[int, list[MigInstance]] = {}
        self._readings = {k: self._entry(v) for k, v in fixture["device"].items()}
        self._device_calls = frozenset(k.split("/")[0] for k in self._readings)
        self._system = {k: self._entry(v) for k, v in fixture["system"].items()}
        self._event_calls = {k: self._entry(v) for k, v in fixture.get("events", {}).items()}

    @classmethod
    def from_fixture(
        cls, path: str | Path = DEFAULT_FIXTURE, gpus: int = 8, delays: Mapping[str, float] | None = None
    ) -> FakeNvml:
        """A fake of ``gpus`` identical GPUs; ``delays`` makes named calls take that many seconds."""
        with open(path) as f:
            return cls(json.load(f), gpus=gpus, delays=delays)

    @staticmethod
    def _entry(entry: Mapping[str, Any]) -> tuple[Any, str | None]:
        return (_obj(entry.get("value")), entry.get("error"))

    # -- test hooks ------------------------------------------------------------------------------

    @property
    def call_count(self) -> int:
        with self._lock:
            return sum(self.calls.values())

    @property
    def initialised(self) -> int:
        """NVML's reference count: nvmlInit calls not yet matched by nvmlShutdown."""
        return self._init_count

    def recorded_seconds(self) -> dict[str, float]:
        """Median time of each call on the real GPU, keyed like the fixture ("name/arg")."""
        return {k: float(v["seconds"]["median"]) for k, v in self.fixture["device"].items()}

    def lose_gpu(self, index: int, lost: bool = True) -> None:
        """Every call on this GPU raises NVMLError_GpuIsLost until ``lose_gpu(index, False)``."""
        with self._lock:
            (self._lost.add if lost else self._lost.discard)(index)

    def set_driver_unavailable(self, error: str | None = "NVMLError_DriverNotLoaded") -> None:
        """Every call raises ``error`` (an NVMLError class name) until called with None."""
        with self._lock:
            self._driver_error = error

    def set_value(self, index: int, call: str, value: Any) -> None:
        """Make ``call`` (a fixture key such as "nvmlDeviceGetTemperature/0") return ``value`` on a GPU."""
        with self._lock:
            self._overrides[index][call] = (value, None)

    def set_error(self, index: int, call: str, error: str = "NVMLError_NotSupported") -> None:
        with self._lock:
            self._overrides[index][call] = (None, error)

    def set_processes(self, index: int, processes: Iterable[tuple[int, int | None]]) -> None:
        """(pid, used bytes or None) of the compute processes on a GPU."""
        procs = [SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                                 computeInstanceId=0xFFFFFFFF) for pid, used in processes]
        self.set_value(index, "nvmlDeviceGetComputeRunningProcesses", procs)

    def enable_mig(self, index: int, instances: Iterable[MigInstance] = ()) -> None:
        """MIG mode on, as an H200 parent device reports it: no utilization, no process list; ``instances``
        fill its first MIG device slots (the others answer NotFound, as empty slots do)."""
        self.set_value(index, "nvmlDeviceGetMigMode", [1, 1])
        with self._lock:
            self._mig[index] = list(instances)[:MAX_MIG_DEVICES]
        self.set_error(index, "nvmlDeviceGetUtilizationRates")
        self.set_error(index, "nvmlDeviceGetComputeRunningProcesses")

    def push_xid(self, index: int, xid: int) -> None:
        """Deliver an XID critical-error event for a GPU to the next nvmlEventSetWait."""
        with self._lock:
            self._events.append((index, xid))
            self._lock.notify_all()

    # -- pynvml API ------------------------------------------------------------------------------

    def _enter(self, name: str, handle: FakeHandle | None = None, *, needs_init: bool = True) -> None:
        delay = self.delays.get(name, 0.0)
        if delay:
            time.sleep(delay)
        with self._lock:
            self.calls[name] += 1
            if self._driver_error:
                raise _error(self._driver_error)
            if needs_init and not self._init_count:
                raise _error("NVMLError_Uninitialized")
            if handle is not None and handle.index in self._lost:
                raise _error("NVMLError_GpuIsLost")

    def _reading(self, name: str, handle: FakeHandle, *args: Any) -> Any:
        key = "/".join([name, *map(str, args)])
        self._enter(name, handle)
        with self._lock:
            value, error = self._overrides.get(handle.index, {}).get(key) or self._readings[key]
        if error:
            raise _error(error)
        return value

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", needs_init=False)
        with self._lock:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        with self._lock:
            self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return str(self._system["nvmlSystemGetDriverVersion"][0])

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if not 0 <= index < self.gpus:
            raise _error("NVMLError_InvalidArgument")
        handle = FakeHandle(index)
        self._enter("nvmlDeviceGetHandleByIndex", handle)
        return handle

    def nvmlDeviceGetUUID(self, handle: FakeHandle | MigHandle) -> str:
        uuid = str(self._reading("nvmlDeviceGetUUID", FakeHandle(handle.index)))
        uuid = f"{uuid[:-2]}{(int(uuid[-2:], 16) + handle.index) % 256:02x}"
        if isinstance(handle, MigHandle):  # MIG-<uuid>, as drivers since R470 write it
            return f"MIG-{uuid.removeprefix('GPU-')[:-4]}{handle.index:02x}{handle.slot:02x}"
        return uuid

    # -- MIG devices -----------------------------------------------------------------------------

    def _instance(self, name: str, handle: MigHandle) -> MigInstance:
        self._enter(name, FakeHandle(handle.index))
        with self._lock:
            return self._mig[handle.index][handle.slot]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        return MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> MigHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        with self._lock:
            if index >= len(self._mig.get(handle.index, ())):
                raise _error("NVMLError_NotFound")
        return MigHandle(handle.index, index)

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeHandle | MigHandle) -> int:
        if isinstance(handle, MigHandle):
            return 1
        return int(self._reading("nvmlDeviceIsMigDeviceHandle", handle))

    def nvmlDeviceGetGpuInstanceId(self, handle: MigHandle) -> int:
        return self._instance("nvmlDeviceGetGpuInstanceId", handle).gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, handle: MigHandle) -> int:
        return self._instance("nvmlDeviceGetComputeInstanceId", handle).compute_instance

    def nvmlDeviceGetName(self, handle: FakeHandle | MigHandle) -> str:
        name = str(self._reading("nvmlDeviceGetName", FakeHandle(handle.index)))
        if isinstance(handle, MigHandle):
            return f"{name} MIG {self._instance('nvmlDeviceGetName', handle).profile}"
        return name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle | MigHandle) -> Any:
        if isinstance(handle, MigHandle):
            mig = self._instance("nvmlDeviceGetMemoryInfo", handle)
            return SimpleNamespace(total=mig.total_bytes, used=mig.used_bytes, free=mig.total_bytes - mig.used_bytes)
        return self._reading("nvmlDeviceGetMemoryInfo", handle)

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> Any:
        pci = self._reading("nvmlDeviceGetPciInfo", handle)
        device = pci.device + handle.index
        bus_id = f"{pci.domain:08X}:{pci.bus:02X}:{device:02X}.0"
        return SimpleNamespace(**{**vars(pci), "device": device, "busId": bus_id, "busIdLegacy": bus_id[4:]})

    def nvmlDeviceGetSerial(self, handle: FakeHandle) -> str:
        serial = str(self._reading("nvmlDeviceGetSerial", handle))
        return str(int(serial) + handle.index) if serial.isdigit() else f"{serial}{handle.index}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        procs = self._reading("nvmlDeviceGetComputeRunningProcesses", handle)
        if "nvmlDeviceGetComputeRunningProcesses" in self._overrides.get(handle.index, {}):
            return list(procs)
        # the recorded process on every GPU, with a pid of its own
        return [SimpleNamespace(**{**vars(p), "pid": p.pid + handle.index}) for p in procs]

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: list[int]) -> list[Any]:
        return [self._reading("nvmlDeviceGetFieldValues", handle, f)[0] for f in field_ids]

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        _, error = self._event_calls.get("nvmlEventSetCreate", (None, None))
        if error:
            raise _error(error)
        return _EventSet(set())

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, eset: _EventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        _, error = self._event_calls.get(f"nvmlDeviceRegisterEvents/{event_types}", (None, None))
        if error:
            raise _error(error)
        eset.handles.add(handle.index)

    def nvmlEventSetWait(self, eset: _EventSet, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait")
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            while True:
                for event in self._events:
                    if event[0] in eset.handles:
                        self._events.remove(event)
                        return SimpleNamespace(device=FakeHandle(event[0]), eventType=0x8, eventData=event[1],
                                               gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                left = deadline - time.monotonic()
                if left <= 0 or self._driver_error:
                    raise _error(self._driver_error or "NVMLError_Timeout")
                self._lock.wait(left)

    def nvmlEventSetFree(self, eset: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        eset.handles.clear()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Every other device call recorded in the fixture: ``name(handle, *args)``."""
        if name in self.__dict__.get("_device_calls", ()):
            call = functools.partial(self._reading, name)
            setattr(self, name, call)  # found directly from now on
            return call
        raise AttributeError(f"FakeNvml has no {name!r}: it is not in the fixture")
