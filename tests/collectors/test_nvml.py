"""NVML collector against FakeNvml, which serves readings recorded on a real H200."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pynvml
import pytest
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from exposition_check import Scraped, Watched, text
from nvml_fake.fake import FakeNvml, MigInstance
from trainpatrol.catalogue import NVML_METRICS
from trainpatrol.collectors import nvml as ns
from trainpatrol.collectors.nvml import NvmlCollector, NvmlUnavailable
from trainpatrol.collectors.registry import Registry

UUID0 = "GPU-eec3c3a2-b837-766e-24b3-24b131d2d7d2"  # the real H200's uuid
T0 = 1_700_000_000.0
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)


def uuid(i: int) -> str:
    return f"{UUID0[:-2]}{0xD2 + i:02x}"


def gpu(i: int, **extra: str) -> dict[str, str]:
    return {"gpu": str(i), "uuid": uuid(i), **extra}


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def setup(gpus: int = 1, **kwargs: Any) -> tuple[FakeNvml, NvmlCollector, Scraped]:
    fake = FakeNvml.from_fixture(gpus=gpus)
    kwargs.setdefault("clock", Clock())
    collector = NvmlCollector(fake, interval_seconds=0.01, **kwargs)
    registry = Scraped(Registry({"nvml": collector}))
    return fake, collector, registry


def value(registry: Scraped, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value("trainpatrol_" + name, labels or {})


def success(registry: Scraped) -> float | None:
    return value(registry, "collector_success", {"collector": "nvml"})


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_enum_values_match_pynvml() -> None:
    assert ns.TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert ns.FI_DEV_MEMORY_TEMP == pynvml.NVML_FI_DEV_MEMORY_TEMP
    assert (ns.CLOCK_SM, ns.CLOCK_MEM) == (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM)
    assert (ns.PCIE_UTIL_TX_BYTES, ns.PCIE_UTIL_RX_BYTES) == (
        pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES)
    assert (ns.MEMORY_ERROR_CORRECTED, ns.MEMORY_ERROR_UNCORRECTED, ns.VOLATILE_ECC) == (
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    assert (ns.RETIRED_MULTIPLE_SBE, ns.RETIRED_DBE) == (
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert ns.PSTATE_UNKNOWN == pynvml.NVML_PSTATE_UNKNOWN
    assert ns.DEVICE_MIG_ENABLE == pynvml.NVML_DEVICE_MIG_ENABLE
    assert pynvml.nvmlEventTypeXidCriticalError == ns.EVENT_XID_CRITICAL
    assert {
        "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
        "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
        "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    } == ns.CLOCK_EVENT_REASONS


def test_recorded_h200_values_in_base_units() -> None:
    _, collector, reg = setup(pcie=True)
    assert collector.sample_once() <= 0.01
    g = gpu(0)
    assert success(reg) == 1.0
    assert value(reg, "gpu_info", gpu(0, name="NVIDIA H200", pci_bus_id="00000000:00:06.0",
                                      driver_version="580.159.04", serial="1654124045941",
                                      mig_mode="disabled")) == 1.0
    assert value(reg, "gpu_utilization_ratio", g) == 1.0  # 100 %
    assert value(reg, "gpu_memory_utilization_ratio", g) == 0.23  # 23 %
    assert value(reg, "gpu_memory_used_bytes", g) == 5_999_820_800
    assert value(reg, "gpu_memory_free_bytes", g) == 144_754_999_296
    assert value(reg, "gpu_memory_total_bytes", g) == 150_754_820_096
    assert value(reg, "gpu_power_watts", g) == 688.708  # 688708 mW
    assert value(reg, "gpu_power_limit_watts", g) == 700.0  # 700000 mW
    assert value(reg, "gpu_energy_joules_total", g) == 8692.207  # 8692207 mJ
    assert value(reg, "gpu_temperature_celsius", gpu(0, sensor="gpu")) == 52.0
    assert value(reg, "gpu_temperature_celsius", gpu(0, sensor="memory")) == 43.0
    assert value(reg, "gpu_clock_hertz", gpu(0, clock="sm")) == 1_425_000_000.0  # 1425 MHz
    assert value(reg, "gpu_clock_hertz", gpu(0, clock="memory")) == 3_201_000_000.0
    assert value(reg, "gpu_performance_state", g) == 0.0
    active = {r: value(reg, "gpu_clock_event_active", gpu(0, reason=r)) for r in ns.CLOCK_EVENT_REASONS}
    assert active == {r: (1.0 if r == "sw_power_cap" else 0.0) for r in ns.CLOCK_EVENT_REASONS}  # 0x4 under load
    assert value(reg, "gpu_pcie_link_generation", g) == 5.0
    assert value(reg, "gpu_pcie_link_width", g) == 16.0
    assert value(reg, "gpu_pcie_throughput_bytes_per_second", gpu(0, direction="tx")) == 5909 * 1024
    assert value(reg, "gpu_pcie_throughput_bytes_per_second", gpu(0, direction="rx")) == 14381 * 1024
    assert value(reg, "gpu_ecc_errors_total", gpu(0, type="corrected")) == 0.0
    assert value(reg, "gpu_ecc_errors_total", gpu(0, type="uncorrected")) == 0.0
    for state in ("correctable", "uncorrectable", "pending", "failure"):
        assert value(reg, "gpu_remapped_rows", gpu(0, state=state)) == 0.0
    assert value(reg, "nvml_sample_timestamp_seconds", g) == T0


def test_set_values_are_converted() -> None:
    fake, collector, reg = setup(gpus=2)
    fake.set_value(1, "nvmlDeviceGetTemperature/0", 91)
    fake.set_value(1, "nvmlDeviceGetPowerUsage", 123_456)
    fake.set_value(1, "nvmlDeviceGetClockInfo/1", 1980)
    fake.set_value(1, "nvmlDeviceGetUtilizationRates", type("U", (), {"gpu": 7, "memory": 50})())
    fake.set_value(1, "nvmlDeviceGetRemappedRows", [3, 1, 1, 0])
    fake.set_value(1, "nvmlDeviceGetCurrentClocksEventReasons", 0x20 | 0x40)
    collector.sample_once()
    assert value(reg, "gpu_temperature_celsius", gpu(1, sensor="gpu")) == 91.0
    assert value(reg, "gpu_temperature_celsius", gpu(0, sensor="gpu")) == 52.0
    assert value(reg, "gpu_power_watts", gpu(1)) == 123.456
    assert value(reg, "gpu_clock_hertz", gpu(1, clock="sm")) == 1_980_000_000.0
    assert value(reg, "gpu_utilization_ratio", gpu(1)) == 0.07
    assert value(reg, "gpu_memory_utilization_ratio", gpu(1)) == 0.5
    assert value(reg, "gpu_remapped_rows", gpu(1, state="correctable")) == 3.0
    assert value(reg, "gpu_remapped_rows", gpu(1, state="pending")) == 1.0
    assert value(reg, "gpu_clock_event_active", gpu(1, reason="sw_thermal_slowdown")) == 1.0
    assert value(reg, "gpu_clock_event_active", gpu(1, reason="hw_thermal_slowdown")) == 1.0
    assert value(reg, "gpu_clock_event_active", gpu(1, reason="sw_power_cap")) == 0.0


def test_unsupported_calls_are_left_out() -> None:
    fake, collector, reg = setup()
    fake.set_error(0, "nvmlDeviceGetTemperature/0")
    fake.set_error(0, "nvmlDeviceGetPerformanceState", "NVMLError_NoPermission")
    collector.sample_once()
    assert success(reg) == 1.0
    # retired pages raised NVMLError_NotSupported on the real H200 (it remaps rows instead)
    for cause in ("multiple_single_bit_ecc", "double_bit_ecc"):
        assert value(reg, "gpu_retired_pages", gpu(0, cause=cause)) is None
    assert b"trainpatrol_gpu_retired_pages" not in reg.body()
    assert value(reg, "gpu_temperature_celsius", gpu(0, sensor="gpu")) is None
    assert value(reg, "gpu_temperature_celsius", gpu(0, sensor="memory")) == 43.0
    assert value(reg, "gpu_performance_state", gpu(0)) is None
    assert value(reg, "gpu_power_watts", gpu(0)) == 688.708


def test_clock_reasons_fall_back_to_throttle_reasons() -> None:
    fake, collector, reg = setup()
    fake.set_error(0, "nvmlDeviceGetCurrentClocksEventReasons", "NVMLError_FunctionNotFound")
    fake.set_value(0, "nvmlDeviceGetCurrentClocksThrottleReasons", 0x8)
    collector.sample_once()
    assert value(reg, "gpu_clock_event_active", gpu(0, reason="hw_slowdown")) == 1.0
    assert value(reg, "gpu_clock_event_active", gpu(0, reason="sw_power_cap")) == 0.0
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_retired_pages_counted_where_supported() -> None:
    fake, collector, reg = setup()
    fake.set_value(0, "nvmlDeviceGetRetiredPages/0", [0x1000, 0x2000])
    fake.set_value(0, "nvmlDeviceGetRetiredPages/1", [])
    fake.enable_mig(7, [MigInstance(gpu_instance=1, compute_instance=0, profile="7g.141gb", total_bytes=150_000_000_000,
                                    used_bytes=6_000_000_000)])
    collector.sample_once()
    assert value(reg, "gpu_retired_pages", gpu(0, cause="multiple_single_bit_ecc")) == 2.0
    assert value(reg, "gpu_retired_pages", gpu(0, cause="double_bit_ecc")) == 0.0


def test_gpu_lost_reinitialises_with_backoff_and_recovers() -> None:
    fake, collector, reg = setup(gpus=4)
    collector.sample_once()
    assert success(reg) == 1.0
    fake.lose_gpu(3)
    delays = [collector.sample_once() for _ in range(4)]
    assert delays == [0.01, 0.02, 0.04, 0.08]  # exponential backoff, each try a fresh nvmlInit
    assert success(reg) == 0.0
    assert value(reg, "gpu_power_watts", gpu(0)) is None  # nothing stale is served
    assert "GpuIsLost" in collector.snapshot()["error"]
    assert fake.initialised == 0  # every failed init was matched by nvmlShutdown
    assert fake.calls["nvmlInit"] == 4
    fake.lose_gpu(3, lost=False)
    assert collector.sample_once() <= 0.01
    assert success(reg) == 1.0
    assert value(reg, "gpu_power_watts", gpu(3)) == 688.708
    assert collector.snapshot()["error"] is None
    fake.lose_gpu(0)
    assert collector.sample_once() == 0.01  # the backoff starts again from the interval


def test_sampler_thread_survives_a_lost_gpu() -> None:
    fake, collector, reg = setup(gpus=2, clock=time.time)
    collector.start()
    try:
        wait_for(lambda: success(reg) == 1.0)
        fake.lose_gpu(1)
        wait_for(lambda: success(reg) == 0.0)
        fake.lose_gpu(1, lost=False)
        wait_for(lambda: success(reg) == 1.0)
        assert value(reg, "gpu_memory_total_bytes", gpu(1)) == 150_754_820_096
    finally:
        collector.stop()
    assert fake.initialised == 0


def test_missing_driver_reports_failure_and_scrape_still_works(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml.from_fixture(gpus=2)
    fake.set_driver_unavailable("NVMLError_LibraryNotFound")
    collector = NvmlCollector(fake, interval_seconds=0.01, clock=Clock())

    class Other:
        def version(self) -> int:
            return 0

        def collect(self) -> list[GaugeMetricFamily]:
            return [GaugeMetricFamily("trainpatrol_other", "Another collector.", value=1.0)]

    reg = Scraped(Registry({"nvml": collector, "other": Other()}))
    caplog.set_level(logging.WARNING, logger="trainpatrol.collectors.nvml")
    for _ in range(3):
        collector.sample_once()
    assert success(reg) == 0.0
    assert value(reg, "collector_success", {"collector": "other"}) == 1.0
    assert value(reg, "other") == 1.0
    assert b"trainpatrol_gpu_" not in reg.body()
    warnings = [r for r in caplog.records if r.name == "trainpatrol.collectors.nvml"]
    assert len(warnings) == 1 and "LibraryNotFound" in warnings[0].getMessage()  # logged once
    fake.set_driver_unavailable(None)
    collector.sample_once()
    assert success(reg) == 1.0


def test_real_pynvml_without_gpu_never_raises() -> None:
    collector = NvmlCollector(interval_seconds=0.01)  # the real pynvml, loaded lazily
    reg = Scraped(Registry({"nvml": collector}))
    collector.sample_once()
    expected = 0.0 if collector.snapshot()["error"] else 1.0  # 0 on a machine without an NVIDIA driver
    assert success(reg) == expected
    collector.stop()


def test_stale_sample_is_not_served() -> None:
    clock = Clock()
    _, collector, reg = setup(clock=clock)
    collector.sample_once()
    clock.now += collector.stale_after_seconds - 0.5
    assert success(reg) == 1.0
    clock.now += 1.0
    assert success(reg) == 0.0


def test_xid_event_counted_with_timestamp() -> None:
    clock = Clock(T0 + 42)
    fake, collector, reg = setup(gpus=4, clock=clock)
    collector.start()
    try:
        wait_for(lambda: fake.calls["nvmlEventSetWait"] > 0)
        fake.push_xid(2, 79)
        fake.push_xid(2, 79)
        fake.push_xid(0, 48)
        labels = gpu(2, xid="79")
        wait_for(lambda: value(reg, "gpu_xid_errors_total", labels) == 2.0)
        wait_for(lambda: value(reg, "gpu_xid_errors_total", gpu(0, xid="48")) == 1.0)
        assert value(reg, "gpu_xid_last_timestamp_seconds", labels) == T0 + 42
        assert value(reg, "gpu_xid_errors_total", gpu(1, xid="79")) is None
        assert {x["xid"]: x["count"] for x in collector.snapshot()["xid"]} == {"48": 1, "79": 2}
    finally:
        collector.stop()
    assert fake.initialised == 0  # the event thread released its own NVML reference


def test_mig_enabled_gpu_does_not_crash() -> None:
    fake, collector, reg = setup(gpus=2, processes=True)
    fake.enable_mig(1)
    collector.sample_once()
    assert success(reg) == 1.0
    assert value(reg, "gpu_info", gpu(1, name="NVIDIA H200", pci_bus_id="00000000:00:07.0",
                                      driver_version="580.159.04", serial="1654124045942",
                                      mig_mode="enabled")) == 1.0
    assert value(reg, "gpu_utilization_ratio", gpu(1)) is None
    assert value(reg, "gpu_utilization_ratio", gpu(0)) == 1.0
    assert value(reg, "gpu_memory_used_bytes", gpu(1)) == 5_999_820_800


def test_mig_child_handles_are_skipped() -> None:
    fake, collector, reg = setup(gpus=3)
    fake.set_value(1, "nvmlDeviceIsMigDeviceHandle", 1)
    collector.sample_once()
    assert value(reg, "gpu_power_watts", gpu(0)) == 688.708
    assert value(reg, "gpu_power_watts", gpu(1)) is None
    assert value(reg, "gpu_power_watts", gpu(2)) == 688.708


def test_pcie_throughput_is_opt_in() -> None:
    fake, collector, reg = setup(gpus=2)
    collector.sample_once()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    assert b"pcie_throughput" not in reg.body()
    assert value(reg, "gpu_pcie_link_width", gpu(1)) == 16.0  # the cheap link readings stay
    fake, collector, reg = setup(gpus=2, pcie=True)
    collector.sample_once()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4
    assert value(reg, "gpu_pcie_throughput_bytes_per_second", gpu(1, direction="rx")) == 14381 * 1024


def test_process_memory_by_run_and_rank_never_by_pid() -> None:
    ranks = {100: ("runA", "0"), 101: ("runA", "1")}
    fake, collector, reg = setup(gpus=2, processes=True, pid_to_rank=lambda: ranks)
    fake.set_processes(0, [(100, 1000), (200, 500), (201, None)])
    fake.set_processes(1, [(101, 2000), (202, 300), (203, 400)])
    collector.sample_once()
    assert value(reg, "gpu_process_memory_bytes", gpu(0, run="runA", rank="0")) == 1000.0
    assert value(reg, "gpu_process_memory_bytes", gpu(0, run="", rank="")) == 500.0
    assert value(reg, "gpu_process_memory_bytes", gpu(1, run="runA", rank="1")) == 2000.0
    assert value(reg, "gpu_process_memory_bytes", gpu(1, run="", rank="")) == 700.0  # summed
    assert value(reg, "gpu_process_memory_bytes", gpu(0, run="runA", rank="1")) is None
    assert b"pid" not in reg.body()
    procs = collector.snapshot()["gpus"][0]["processes"]  # pids belong in evidence, not in labels
    assert procs == [{"pid": 100, "used_bytes": 1000, "run": "runA", "rank": "0"},
                     {"pid": 200, "used_bytes": 500, "run": "", "rank": ""},
                     {"pid": 201, "used_bytes": None, "run": "", "rank": ""}]


def test_process_memory_is_opt_in_and_survives_a_broken_mapping() -> None:
    fake, collector, reg = setup()
    collector.sample_once()
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 0
    assert value(reg, "gpu_process_memory_bytes", gpu(0, run="", rank="")) is None

    def broken() -> dict[int, tuple[str, str]]:
        raise RuntimeError("rank table unavailable")

    fake, collector, reg = setup(processes=True, pid_to_rank=broken)
    collector.sample_once()
    assert success(reg) == 1.0
    # the recorded H200 process (a 4 GiB bf16 matmul loop) counts as "not a rank"
    assert value(reg, "gpu_process_memory_bytes", gpu(0, run="", rank="")) == 5_345_640_448


def test_scrape_and_registration_never_call_nvml() -> None:
    fake, collector, reg = setup(gpus=8, pcie=True, processes=True)
    assert fake.call_count == 0  # describe() at registration touched nothing
    collector.sample_once()
    calls = fake.call_count
    for _ in range(5):
        reg.body()
    assert collector.snapshot()["gpus"]
    assert fake.call_count == calls


def test_snapshot_is_json() -> None:
    fake, collector, _ = setup(gpus=2, processes=True)
    collector.sample_once()
    collector._record_xid(fake.nvmlDeviceGetHandleByIndex(1), 13)
    snap = json.loads(json.dumps(collector.snapshot()))
    assert snap["error"] is None and snap["driver_version"] == "580.159.04" and snap["timestamp"] == T0
    assert [g["uuid"] for g in snap["gpus"]] == [uuid(0), uuid(1)]
    assert snap["gpus"][1]["series"]["gpu_power_watts"] == [[[], 688.708]]
    assert snap["xid"] == [{"gpu": "1", "uuid": uuid(1), "xid": "13", "count": 1, "last_timestamp_seconds": T0}]


def test_start_stop_are_bounded_and_release_nvml() -> None:
    fake, collector, _ = setup(gpus=2, clock=time.time)
    collector.start()
    wait_for(lambda: fake.calls["nvmlEventSetWait"] > 0)
    t0 = time.monotonic()
    collector.stop()
    assert time.monotonic() - t0 < collector.event_timeout_ms / 1000 + 0.5  # the XID wait's bound, no more
    assert fake.initialised == 0


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_seconds=0"):
        NvmlCollector(FakeNvml.from_fixture(), interval_seconds=0)


def test_fake_raises_recorded_errors_and_honours_delays() -> None:
    fake = FakeNvml.from_fixture(gpus=1, delays={"nvmlDeviceGetPcieThroughput": 0.02})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetRetiredPages(handle, 0)
    t0 = time.monotonic()
    assert fake.nvmlDeviceGetPcieThroughput(handle, 0) == 5909
    assert time.monotonic() - t0 >= 0.02
    assert fake.recorded_seconds()["nvmlDeviceGetPcieThroughput/0"] > 0.015  # ~20.8 ms on the H200
    fake.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetPowerUsage(handle)
    fake.nvmlShutdown()


def full_exposition() -> bytes:
    clock = Clock()
    fake, collector, reg = setup(gpus=8, pcie=True, processes=True, clock=clock,
                                 pid_to_rank=lambda: {504 + i: ("demo", str(i)) for i in range(0, 8, 2)})
    fake.set_value(0, "nvmlDeviceGetRetiredPages/0", [0x1000])
    fake.set_value(0, "nvmlDeviceGetRetiredPages/1", [])
    fake.enable_mig(7, [MigInstance(gpu_instance=1, compute_instance=0, profile="7g.141gb", total_bytes=150_000_000_000,
                                    used_bytes=6_000_000_000)])
    collector.sample_once()
    collector._record_xid(fake.nvmlDeviceGetHandleByIndex(5), 79)
    return reg.body()


def test_exposition_matches_the_catalogue() -> None:
    text = full_exposition().decode()
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE trainpatrol_gpu") or line.startswith("# TYPE trainpatrol_nvml"):
            _, _, name, kind = line.split()
            families[name] = kind
    expected = {m.name: ("gauge" if m.kind == "info" else m.kind) for m in NVML_METRICS}
    assert families == expected
    for family in text_string_to_metric_families(text):
        spec = next((m for m in NVML_METRICS if m.name in (family.name, family.name + "_total")), None)
        if spec is None:
            continue
        for sample in family.samples:
            assert set(sample.labels) == set(spec.all_labels), sample


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_promtool_check_metrics_on_8_gpus() -> None:
    assert PROMTOOL is not None
    text = full_exposition()
    assert text.count(b"trainpatrol_gpu_power_watts{") == 8
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""


def test_slow_readings_are_taken_every_slow_interval_and_carried_between() -> None:
    clock = Clock()
    fake, collector, reg = setup(gpus=2, clock=clock, pcie=True, slow_interval_seconds=5.0)
    collector.sample_once()
    energy = value(reg, "gpu_energy_joules_total", gpu(1))
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4 and fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 2
    fake.set_value(1, "nvmlDeviceGetTotalEnergyConsumption", 9_000_000)  # mJ
    fake.set_value(1, "nvmlDeviceGetTotalEccErrors/0/0", 4)
    fake.set_value(1, "nvmlDeviceGetPowerUsage", 123_456)  # mW, a fast reading
    for _ in range(4):
        clock.now += 1.0
        collector.sample_once()
        assert value(reg, "gpu_power_watts", gpu(1)) == 123.456
        assert value(reg, "gpu_energy_joules_total", gpu(1)) == energy  # the last slow reading, carried
        assert value(reg, "gpu_ecc_errors_total", gpu(1, type="corrected")) == 0.0
        assert value(reg, "gpu_pcie_throughput_bytes_per_second", gpu(1, direction="tx")) is not None
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4 and fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 2
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 10
    clock.now += 1.0  # 5 s after the first sample
    collector.sample_once()
    assert value(reg, "gpu_energy_joules_total", gpu(1)) == 9000.0
    assert value(reg, "gpu_ecc_errors_total", gpu(1, type="corrected")) == 4.0
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 8 and fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 4


def test_a_reinitialised_gpu_is_read_whole_at_once() -> None:
    clock = Clock()
    fake, collector, reg = setup(gpus=2, clock=clock, slow_interval_seconds=60.0)
    collector.sample_once()
    fake.set_value(0, "nvmlDeviceGetRemappedRows", [3, 1, 1, 0])
    fake.lose_gpu(0)
    clock.now += 1.0
    collector.sample_once()
    assert success(reg) == 0.0
    fake.lose_gpu(0, lost=False)
    clock.now += 1.0
    collector.sample_once()  # well before the slow interval, but the first sample of a fresh init
    assert value(reg, "gpu_remapped_rows", gpu(0, state="pending")) == 1.0


def test_slow_interval_zero_reads_everything_every_sample() -> None:
    fake, collector, _ = setup(gpus=1, slow_interval_seconds=0.0)
    for _ in range(3):
        collector.sample_once()
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 3
    with pytest.raises(ValueError, match="slow_interval_seconds=-1"):
        NvmlCollector(fake, slow_interval_seconds=-1)


def test_the_collector_has_news_after_a_sample_an_xid_and_once_its_sample_goes_stale() -> None:
    clock = Clock()
    fake, nvml, _ = setup(gpus=2, clock=clock)
    collector = Watched(nvml)
    collector.sample_once()
    assert collector.changed()
    first = text(collector)
    assert b'trainpatrol_gpu_power_watts{gpu="1",' in first
    assert not collector.changed()  # nothing new between two samples: the scrape reuses the last text
    fake.set_value(1, "nvmlDeviceGetPowerUsage", 431_250)  # milliwatts
    collector.sample_once()
    assert collector.changed() and b"} 431.25\n" in text(collector)
    collector._record_xid(fake.nvmlDeviceGetHandleByIndex(1), 79)
    assert collector.changed() and b'trainpatrol_gpu_xid_errors_total{gpu="1",' in text(collector)
    assert not collector.changed()
    clock.now += collector.stale_after_seconds + 1  # no sample since: the clock alone makes it news
    assert collector.changed()
    with pytest.raises(NvmlUnavailable, match="old"):
        text(collector)
    assert not collector.changed()
