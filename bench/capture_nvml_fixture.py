"""Capture the NVML fixture that the test double ``tests/nvml_fake/fake.py`` serves, on a real GPU.

Calls every pynvml function the NVML collector uses on one GPU and records, for each call, the
value (ctypes structures as dicts) or the NVMLError subclass it raised, plus its timings. The
device calls are recorded twice: idle, then while a child process keeps the GPU busy with bf16
matrix products (so utilization, power, clocks and the process list are realistic)::

    python3 bench/capture_nvml_fixture.py --out tests/nvml_fake/nvml_h200.json

Needs only pynvml (nvidia-ml-py); torch is used for the load phase when it is installed.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

import pynvml as N

XID = N.nvmlEventTypeXidCriticalError

# (function, extra args after the handle, repetitions); keys in the fixture are "name/arg/arg".
DEVICE_CALLS: list[tuple[str, tuple[int, ...], int]] = [
    ("nvmlDeviceGetName", (), 20),
    ("nvmlDeviceGetUUID", (), 20),
    ("nvmlDeviceGetPciInfo", (), 20),
    ("nvmlDeviceGetSerial", (), 20),
    ("nvmlDeviceGetMigMode", (), 20),
    ("nvmlDeviceIsMigDeviceHandle", (), 20),
    ("nvmlDeviceGetUtilizationRates", (), 20),
    ("nvmlDeviceGetMemoryInfo", (), 20),
    ("nvmlDeviceGetPowerUsage", (), 20),
    ("nvmlDeviceGetEnforcedPowerLimit", (), 20),
    ("nvmlDeviceGetTotalEnergyConsumption", (), 20),
    ("nvmlDeviceGetTemperature", (N.NVML_TEMPERATURE_GPU,), 20),
    ("nvmlDeviceGetFieldValues", (N.NVML_FI_DEV_MEMORY_TEMP,), 20),
    ("nvmlDeviceGetClockInfo", (N.NVML_CLOCK_SM,), 20),
    ("nvmlDeviceGetClockInfo", (N.NVML_CLOCK_MEM,), 20),
    ("nvmlDeviceGetPerformanceState", (), 20),
    ("nvmlDeviceGetCurrentClocksEventReasons", (), 20),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", (), 20),
    ("nvmlDeviceGetCurrPcieLinkGeneration", (), 20),
    ("nvmlDeviceGetCurrPcieLinkWidth", (), 20),
    ("nvmlDeviceGetPcieThroughput", (N.NVML_PCIE_UTIL_TX_BYTES,), 5),
    ("nvmlDeviceGetPcieThroughput", (N.NVML_PCIE_UTIL_RX_BYTES,), 5),
    ("nvmlDeviceGetTotalEccErrors", (N.NVML_MEMORY_ERROR_TYPE_CORRECTED, N.NVML_VOLATILE_ECC), 20),
    ("nvmlDeviceGetTotalEccErrors", (N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC), 20),
    ("nvmlDeviceGetRetiredPages", (N.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,), 5),
    ("nvmlDeviceGetRetiredPages", (N.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,), 5),
    ("nvmlDeviceGetRemappedRows", (), 20),
    ("nvmlDeviceGetComputeRunningProcesses", (), 20),
    ("nvmlDeviceGetSupportedEventTypes", (), 5),
]

LOAD = """
import sys, time, torch
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
hold = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")  # 4 GiB, visible per process
torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        y = x @ x
    torch.cuda.synchronize()
"""


def to_json(v: Any) -> Any:
    """pynvml return values as JSON: structures become dicts of their fields."""
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, (list, tuple, ctypes.Array)):
        return [to_json(x) for x in v]
    if isinstance(v, ctypes._Pointer):
        return "<handle>"
    if isinstance(v, ctypes._SimpleCData):
        return to_json(v.value)
    if hasattr(v, "_fields_"):
        return {f[0]: to_json(getattr(v, f[0])) for f in v._fields_}
    if hasattr(v, "__dict__"):
        return {k: to_json(x) for k, x in vars(v).items() if not k.startswith("_")}
    return repr(v)


def timed(fn_name: str, *args: Any, reps: int = 1) -> tuple[dict[str, Any], Any]:
    """Call ``N.<fn_name>(*args)`` reps times; the entry holds the last value or error, and timings."""
    fn = getattr(N, fn_name)
    times: list[float] = []
    value: Any = None
    error: BaseException | None = None
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            value, error = fn(*args), None
        except Exception as exc:
            value, error = None, exc
        times.append(time.perf_counter() - t0)
    entry: dict[str, Any] = {}
    if error is None:
        entry["value"] = to_json(value)
    else:
        entry["error"] = type(error).__name__
        entry["error_code"] = getattr(error, "value", None)
        entry["message"] = str(error)
    entry["seconds"] = {
        "first": times[0], "min": min(times), "median": statistics.median(times), "max": max(times),
        "n": reps,
    }
    return entry, value


def key(name: str, args: tuple[int, ...]) -> str:
    return "/".join([name, *map(str, args)])


def capture_device(handle: Any) -> dict[str, Any]:
    out = {}
    for name, args, reps in DEVICE_CALLS:
        call_args: tuple[Any, ...] = ([*args],) if name == "nvmlDeviceGetFieldValues" else args
        out[key(name, args)] = timed(name, handle, *call_args, reps=reps)[0]
    return out


def capture_events(handle: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["nvmlEventSetCreate"], eset = timed("nvmlEventSetCreate")
    if eset is None:
        return out
    out[f"nvmlDeviceRegisterEvents/{XID}"], _ = timed("nvmlDeviceRegisterEvents", handle, XID, eset)
    out["nvmlEventSetWait/100"], _ = timed("nvmlEventSetWait", eset, 100, reps=3)
    out["nvmlEventSetFree"], _ = timed("nvmlEventSetFree", eset)
    return out


def start_load(seconds: float) -> subprocess.Popen[str] | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    proc = subprocess.Popen([sys.executable, "-c", LOAD, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        return None
    time.sleep(3.0)  # let clocks, power and utilization settle
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--load-seconds", type=float, default=60.0)
    ns = ap.parse_args()
    fixture: dict[str, Any] = {
        "captured": {
            "script": "bench/capture_nvml_fixture.py",
            "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "nvidia_ml_py": metadata.version("nvidia-ml-py"),
            "gpu_index": ns.gpu,
        },
        "system": {},
    }
    system = fixture["system"]
    system["nvmlInit"], _ = timed("nvmlInit")
    ok = "error" not in system["nvmlInit"]
    if ok:
        for name in ("nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion",
                     "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetCount"):
            system[name], _ = timed(name, reps=5)
        system[f"nvmlDeviceGetHandleByIndex/{ns.gpu}"], handle = timed(
            "nvmlDeviceGetHandleByIndex", ns.gpu, reps=5)
        ok = handle is not None
    if ok:
        fixture["device_idle"] = capture_device(handle)
        fixture["events"] = capture_events(handle)
        load = start_load(ns.load_seconds)
        fixture["captured"]["load"] = (
            f"torch bf16 8192^3 matmul loop, 4 GiB held, pid {load.pid}" if load else "none (no torch)")
        fixture["device"] = capture_device(handle)
        if load:
            load.kill()
            load.wait()
        # what a re-initialisation after a lost GPU costs
        system["nvmlShutdown"], _ = timed("nvmlShutdown")
        system["nvmlInit (again)"], _ = timed("nvmlInit")
        timed("nvmlShutdown")
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(fixture, f, indent=1, sort_keys=False)
        f.write("\n")
    summary = {k: (v.get("error") or v.get("value"), round(v["seconds"]["median"] * 1e6, 1))
               for k, v in fixture.get("device", {}).items()}
    print(json.dumps({"system": {k: v.get("error") or v.get("value") for k, v in system.items()},
                      "device_us_median": summary, "events": fixture.get("events")}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
