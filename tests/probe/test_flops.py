"""Model FLOPs and device peaks: what the run's achieved FLOP/s and MFU are worked out from.

``measure_flops`` counts one forward and backward exactly; the dtype the model computes in is seen at its first
forward (autocast's, or the parameters'); the peak table knows the supported GPUs and names none for others; and
the agent serves the run's figures once per run, from a real Patrol's pushes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from servers import agent, http_get
from trainpatrol import Patrol, PatrolConfig, measure_flops
from trainpatrol.probe.flops import dtype_name, peak_flops


def test_measure_flops_counts_a_linear_layers_forward_and_backward() -> None:
    layer = torch.nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    # forward: 2 * 8 * 16 * 32; backward: the same again for the input's gradient and for the weight's
    assert measure_flops(lambda: layer(x).sum().backward()) == 3 * 2 * 8 * 16 * 32


@pytest.mark.parametrize(("name", "dtype", "peak"), [
    ("NVIDIA H200", "bf16", 989.4e12), ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H100 NVL", "fp8", 1670.5e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12), ("NVIDIA L40S", "fp16", 362.05e12), ("NVIDIA B200", "bf16", 2250e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 0.0), ("NVIDIA A100-SXM4-80GB", "fp8", 0.0)])
def test_the_peak_of_a_known_device_and_dtype_and_none_for_others(name: str, dtype: str, peak: float) -> None:
    assert peak_flops(name, dtype) == pytest.approx(peak)


def test_fp32_matmuls_count_as_tf32_where_torch_allows_it() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert (dtype_name(torch.float32), dtype_name(torch.bfloat16)) == ("fp32", "bf16")
        torch.set_float32_matmul_precision("high")
        assert dtype_name(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def run_series(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(body)
            for s in f.samples if s.name.startswith("trainpatrol_run_") and "flops" in s.name}


def test_the_agent_serves_the_runs_flops_and_peak_once_from_the_ranks_pushes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with agent(tmp_path) as url:
        ranks = []
        for rank in range(2):  # two ranks of one run in this process, on devices of different peaks
            monkeypatch.setenv("RANK", str(rank))
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
            patrol = Patrol(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=PatrolConfig(
                run="flops", agent_url=url, embedded_agent=False, checkpoint_dir=str(tmp_path / f"ckpt{rank}"),
                evidence_dir=str(tmp_path / "evidence"), push_interval_seconds=3600, flops_per_token=6 * 593.0,
                peak_flops=5e12 if rank == 0 else 4e12))
            ranks.append((patrol, model))
        try:
            for patrol, model in ranks:
                with torch.autocast("cpu", dtype=torch.bfloat16):  # the first forward: under autocast, in bf16
                    loss = model(torch.randn(4, 16)).float().pow(2).mean()
                loss.backward()
                patrol.step(loss, tokens=64)
                assert patrol._publisher.push_now()
            # the slowest device's peak: the run's MFU is judged against what every one of its GPUs can do
            assert run_series(http_get(f"{url}/metrics").decode()) == {
                ("trainpatrol_run_model_flops_per_token", (("run", "flops"),)): 3558.0,
                ("trainpatrol_run_peak_flops", (("dtype", "bf16"), ("run", "flops"))): 4e12}
        finally:
            for patrol, _ in ranks:
                patrol.close()
