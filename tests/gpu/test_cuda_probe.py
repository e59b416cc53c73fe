"""Issue 3 on a real GPU: allocator readings, retries, OOM forensics, and no host-device sync."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from trainpatrol import Patrol, PatrolConfig
from trainpatrol.probe.device_values import DeviceValues
from trainpatrol.probe.identity import gpu_uuid
from trainpatrol.probe.memory import cuda_reader, from_stats

DEV = torch.device("cuda", 0)


def patrol_for(tmp: Path, model: torch.nn.Module | None = None, **cfg: object) -> Patrol:
    config = PatrolConfig(run="gpu", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=str(tmp / "ckpt"), evidence_dir=str(tmp / "evidence"),
                          push_interval_seconds=3600, **cfg)  # type: ignore[arg-type]
    return Patrol(model=model, device=DEV, config=config)


def test_raw_reader_matches_public_memory_stats() -> None:
    keep = [torch.empty(n * 2**20, dtype=torch.uint8, device=DEV) for n in (1, 3, 7, 20, 33)]
    torch.cuda.synchronize()
    capacity = float(torch.cuda.get_device_properties(DEV).total_memory)
    for _ in range(5):  # a thread left by an earlier test may allocate between two reads: read until still
        fast = cuda_reader(DEV)()
        public = from_stats(_nest(torch.cuda.memory_stats(DEV)), capacity)
        if cuda_reader(DEV)() == fast:
            break
    assert cuda_reader(DEV)() == fast, "the allocator kept changing under the test"
    assert fast == public
    assert fast.allocated == torch.cuda.memory_allocated(DEV)
    assert fast.reserved == torch.cuda.memory_reserved(DEV)
    del keep


def _nest(flat: dict[str, int]) -> dict[str, object]:
    from trainpatrol.probe.memory import _nest as nest

    return nest(flat)


def test_fragmentation_counts_only_what_stayed_unusable_at_the_peak(tmp_path: Path) -> None:
    torch.cuda.empty_cache()
    # interleave small blocks in 2 MiB segments, free every other one: reserved stays, allocated halves,
    # yet at the peak every reserved byte was in use, so nothing stayed unusable (caching, not fragmentation)
    blocks = [torch.empty(256 * 1024, dtype=torch.uint8, device=DEV) for _ in range(4096)]
    del blocks[::2]
    torch.cuda.synchronize()
    patrol = patrol_for(tmp_path, memory_interval_seconds=0.0)
    patrol.step(torch.ones((), device=DEV))
    m = patrol._latest.memory
    stats = torch.cuda.memory_stats(DEV)
    reserved, peak = stats["reserved_bytes.all.current"], stats["allocated_bytes.all.peak"]
    assert m is not None
    assert (reserved - stats["allocated_bytes.all.current"]) / reserved > 0.3  # what the old ratio read
    assert m.unusable_at_peak == pytest.approx(max(0.0, reserved - peak), abs=2**20)
    assert m.fragmentation == pytest.approx(m.unusable_at_peak / reserved, abs=1e-9) and m.fragmentation < 0.1
    assert m.inactive_split == pytest.approx(stats["inactive_split_bytes.all.current"], abs=2**20)
    assert m.inactive_split > 0  # the raw number is kept
    patrol.close()
    del blocks


def test_forced_alloc_retries_raise_the_counter(tmp_path: Path) -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction(4 * 2**30 / total, DEV)
    patrol = patrol_for(tmp_path, memory_interval_seconds=0.0)
    before = patrol_reading_retries(patrol)
    try:
        # fill the cap with cached-but-free 100 MiB blocks, then ask for one larger block:
        # the allocator must free its cache and retry cudaMalloc
        chunks = [torch.empty(100 * 2**20, dtype=torch.uint8, device=DEV) for _ in range(28)]
        del chunks
        big = torch.empty(2 * 2**30, dtype=torch.uint8, device=DEV)
        del big
        after = patrol_reading_retries(patrol)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEV)
        patrol.close()
    assert after >= before + 1


def patrol_reading_retries(patrol: Patrol) -> float:
    patrol.step(torch.ones((), device=DEV))
    m = patrol._latest.memory
    assert m is not None
    return m.alloc_retries


def test_oom_writes_the_evidence_directory(tmp_path: Path) -> None:
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total, DEV)
    patrol = patrol_for(tmp_path, record_memory_history=True)
    try:
        with pytest.raises(torch.OutOfMemoryError), patrol:
            patrol.step(torch.ones((), device=DEV))
            torch.empty(8 * 2**30, dtype=torch.uint8, device=DEV)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEV)
        torch.cuda.memory._record_memory_history(enabled=None)
    bundle = next((tmp_path / "evidence").glob("*-oom"))
    part = bundle / "rank-00000"
    stats = json.loads((part / "memory_stats.json").read_text())
    assert stats["num_ooms"] >= 1
    assert "PyTorch CUDA memory summary" in (part / "memory_summary.txt").read_text()
    assert (part / "memory_snapshot.pickle").stat().st_size > 0
    assert json.loads((bundle / "manifest.json").read_text())["action"] == "oom"


def test_instrumented_step_never_syncs(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    patrol = patrol_for(tmp_path, model, memory_interval_seconds=0.0)
    patrol.optimizer = opt
    x = torch.randn(64, 512, device=DEV)
    for _ in range(3):  # warm-up outside the check (lazy CUDA init, pinned buffers)
        model(x).pow(2).mean().backward()
        patrol.step(torch.zeros((), device=DEV))
        opt.step()
        opt.zero_grad()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            patrol.boundary()
            loss = model(x).pow(2).mean()
            loss.backward()
            patrol.step(loss)  # foreach grad norm path
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            patrol.step(loss, grad_norm=total)  # reused clip total path
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    patrol.close()
    assert patrol.step_count == 43
    assert patrol._latest.loss == patrol._latest.loss  # read back, finite


def test_the_readme_loop_over_a_dataloader_with_workers_never_syncs(tmp_path: Path) -> None:
    """The path users run: ``patrol.loader`` over a shuffled DataLoader with workers and pinned memory, the
    batch copied non-blocking, the clip total passed, the fused AdamW's non-finite skip on, the allocator read
    at every fold; the second epoch runs with any host-device sync raising."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 128), torch.nn.Linear(128, 512)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = TensorDataset(torch.randint(0, 512, (32 * 16, 33)))
    dl = DataLoader(data, batch_size=16, shuffle=True, num_workers=2, pin_memory=True, persistent_workers=True)
    config = PatrolConfig(run="gpu-readme", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=str(tmp_path / "ckpt"), evidence_dir=str(tmp_path / "evidence"),
                          memory_interval_seconds=0.0)
    with Patrol(model=model, optimizer=opt, config=config) as patrol:
        for epoch in range(2):
            if epoch == 1:  # the first epoch warms up outside the check (lazy CUDA init, pinned buffers)
                torch.cuda.set_sync_debug_mode("error")
            try:
                for (seq,) in patrol.loader(dl):
                    seq = seq.to(DEV, non_blocking=True)
                    logits = model(seq[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
                    loss.backward()
                    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    patrol.step(loss, grad_norm=total, batch_size=seq.shape[0], tokens=seq[:, 1:].numel())
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    assert patrol.step_count == 64
    assert patrol._totals.tokens == 64 * 16 * 32
    assert patrol._totals.compute > 0  # the compute clock's CUDA events were read back, with no sync
    assert 0 < patrol._latest.loss < 10  # read back, finite


def test_compute_time_is_the_device_time_of_forward_and_backward_not_a_wait_of_the_host(tmp_path: Path) -> None:
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(4096, 2048, device=DEV)

    def forward_backward() -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(3):
        forward_backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        forward_backward()
    end.record()
    end.synchronize()
    device_s = start.elapsed_time(end) / 1e3 / 10
    opt.zero_grad()
    patrol = patrol_for(tmp_path, model)
    patrol.optimizer = opt
    for _ in range(40):
        torch.cuda.synchronize()
        time.sleep(0.02)  # the host waits (for data, say) while the device idles
        patrol.step(forward_backward())
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    patrol.close()
    per_step = patrol._totals.compute / 40
    assert 0.8 * device_s <= per_step <= 1.15 * device_s, (per_step, device_s)


def test_loss_sync_is_caught_by_the_check() -> None:
    """The debug mode works here: an .item() raises, so the test above would catch a sync."""
    x = torch.ones((), device=DEV)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_rank_gpu_uuid_matches_nvml() -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        index = torch.cuda.current_device()
        visible = __import__("os").environ.get("CUDA_VISIBLE_DEVICES")
        nv_index = int(visible.split(",")[index]) if visible else index
        handle = pynvml.nvmlDeviceGetHandleByIndex(nv_index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    finally:
        pynvml.nvmlShutdown()
    assert gpu_uuid(DEV) == uuid


def exposed_share(tmp: Path, matmul: int, host_seconds: float) -> tuple[float, float]:
    """A loop of one ``matmul``-sized product a step and ``host_seconds`` of host work, never synced: (the share
    of Patrol's host time it pays for, Patrol's self-report)."""
    patrol = patrol_for(tmp, readback_lag_seconds=0.01)
    a = torch.randn(matmul, matmul, device=DEV)
    for _ in range(300):
        loss = (a @ a).mean()
        end = time.perf_counter() + host_seconds
        while time.perf_counter() < end:
            pass
        patrol.step(loss)
    share = patrol._latest.exposed_share
    ratio = next(s["value"] for s in patrol._report.snapshot()["samples"]
                 if s["name"] == "trainpatrol_probe_overhead_ratio")
    patrol.close()
    return share, ratio


def test_a_gpu_bound_loop_pays_none_of_patrols_host_time_and_a_host_bound_one_all(tmp_path: Path) -> None:
    # an 8192-wide product takes a few ms on an H200; the host queues it in microseconds and runs ahead
    assert exposed_share(tmp_path / "gpu-bound", 8192, 0.0) == (0.0, 0.0)
    # a 16-wide product takes microseconds; the host's 2 ms a step leave the device waiting
    share, ratio = exposed_share(tmp_path / "host-bound", 16, 0.002)
    assert share == 1.0 and 0 < ratio < 0.5


def test_a_gpu_bound_loop_whose_host_waits_in_the_launch_queue_pays_none_of_patrols_host_time(tmp_path: Path) -> None:
    """Each step queues 3,000 kernels that each keep the device busy for some 50 µs and cost the host a few: more
    than the driver's launch queue holds, so the host blocks in a launch and is never a whole step ahead, as with a
    large model, yet the device never waits for it."""
    patrol = patrol_for(tmp_path, readback_lag_seconds=0.01)
    for _ in range(12):
        for _ in range(3000):
            torch.cuda._sleep(100_000)  # about 50 µs at the H200's clock
        patrol.step(torch.ones((), device=DEV))
    share = patrol._latest.exposed_share
    ratio = next(s["value"] for s in patrol._report.snapshot()["samples"]
                 if s["name"] == "trainpatrol_probe_overhead_ratio")
    patrol.close()
    assert (share, ratio) == (0.0, 0.0)


def test_values_on_another_device_are_judged_and_read_back_as_given() -> None:
    """A pipeline's last stage may hand a loss that lives elsewhere than the ring: the verdict and the read-back
    still come right, and the caller's CUDA loss stays as it was for autograd."""
    values = DeviceValues(torch.device("cuda"))
    x = torch.tensor([0.1, 0.2], device="cuda", requires_grad=True)
    loss = x.exp().sum().exp()  # its graph keeps the loss: an in-place change would fail the backward
    version = loss._version
    flags = [values.record(torch.tensor(1.5), torch.tensor(0.5, device="cuda"), None, judge=True),
             values.record(loss, torch.tensor(float("nan")), None, judge=True),
             values.record(torch.tensor([2.5], device="cuda"), None, None, judge=True)]
    rows, buf = values.flush()
    assert [f.item() for f in flags if f is not None] == [0.0, 1.0, 0.0]
    expected = [1.5, 0.5, 1.0, loss.item(), math.nan, 1.0, 2.5, -1.0, 1.0]
    torch.testing.assert_close(buf[:9].cpu(), torch.tensor(expected), equal_nan=True)
    assert rows == 3 and loss._version == version
    loss.backward()


def test_a_loss_from_a_cuda_graph_is_read_back_as_its_step_had_it_or_not_at_all(tmp_path: Path) -> None:
    """``torch.compile(mode="reduce-overhead")`` hands a loss that is a CUDA graph's output, overwritten by the
    next replay. Patrol holds a step's values until its batch is flushed: each step's recorded loss is the one that
    step had, or none (a batch it could no longer read), never a later step's, and the loop runs on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loss_of = torch.compile(lambda out, y: (out - y).pow(2).mean(), mode="reduce-overhead")
    config = PatrolConfig(run="gpu-graph", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=str(tmp_path / "ckpt"), evidence_dir=str(tmp_path / "evidence"),
                          guard_actions={})
    seen = []
    with Patrol(model=model, optimizer=opt, config=config) as patrol:
        for _ in range(64):
            x, y = torch.randn(16, 8, device=DEV), torch.randn(16, 1, device=DEV)
            loss = loss_of(model(x), y)
            loss.backward()
            seen.append(loss.detach().clone())
            patrol.step(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    recorded = {r.step: r.loss for r in patrol._history.records}
    expected = [float(v) for v in torch.stack(seen).cpu()]
    got = [recorded.get(step, math.nan) for step in range(1, 65)]
    assert all(math.isnan(g) or g == want for g, want in zip(got, expected, strict=True)), (got, expected)
    assert sum(not math.isnan(g) for g in got[-32:]) == 32  # copied at once from the first lost batch on, if any
