"""On a real GPU: a NaN step pauses with a finite checkpoint as `latest`, and the restored run is bit-identical.

A 4-layer 512-wide GPT in bf16 autocast, trained from a shuffled DataLoader (2 workers, pinned memory)
through ``patrol.loader``. Deterministic kernels (math attention, deterministic algorithms) make two
runs comparable bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from overhead import GPT

from servers import wait_for
from trainpatrol import STOP_EXIT_CODE, Patrol, PatrolConfig
from trainpatrol.control import state_file
from trainpatrol.control.checkpoint import Checkpointer

DEV = torch.device("cuda", 0)
VOCAB, SEQ, NAN_AT = 512, 128, 201
RESULTS: dict[str, Any] = {}


@contextmanager
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


def gpt(seed: int, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(4, 512, 8, vocab=VOCAB, seq=SEQ).to(DEV)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused, foreach=None if fused else True)


def loader() -> torch.utils.data.DataLoader[Any]:
    tokens = torch.randint(0, VOCAB, (2048, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=16, shuffle=True,
                                       num_workers=2, pin_memory=True)


def config(tmp: Path, **overrides: Any) -> PatrolConfig:
    return PatrolConfig(run="gpu-stop", agent_url="http://127.0.0.1:9", embedded_agent=False,
                        checkpoint_dir=str(tmp / "ckpt"), evidence_dir=str(tmp / "evidence"),
                        push_interval_seconds=3600.0, pause_poll_seconds=0.02, **overrides)


def train(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer, until: int, losses: list[torch.Tensor],
          epochs_from: int = 0, checkpoint_at: int = 0) -> None:
    data = loader()
    for _ in range(epochs_from, 1000):
        for (batch,) in patrol.loader(data):
            batch = batch.to(DEV, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            if patrol.step_count + 1 == NAN_AT:
                loss = loss * float("nan")
            loss.backward()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            patrol.step(loss, grad_norm=total, batch_size=16)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if patrol.step_count == checkpoint_at:
                patrol.request("checkpoint", "periodic")
            if patrol.step_count >= until:
                return


def pause_then_stop(patrol: Patrol, fn: Any) -> int:
    """Run ``fn`` until the guard pauses, then stop it; returns the exit code."""
    result: list[int] = []

    def run() -> None:
        try:
            with deterministic():
                fn()
        except SystemExit as exc:
            result.append(int(exc.code or 0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: patrol.state == "paused", 120, interval=0.01, what="paused by the guard")
    patrol.request("stop", "test over")
    t.join(120)
    return result[0]


def nonfinite(checkpoint: Path) -> int:
    state = state_file.read(checkpoint / "state.bin")
    tensors = list(state["model"].values()) + [v for s in state["optimizer"]["state"].values() for v in s.values()
                                                if v.is_floating_point()]
    return sum(not bool(torch.isfinite(t).all()) for t in tensors)


def floats(losses: list[torch.Tensor]) -> list[float]:
    return [float(v) for v in torch.stack(losses).cpu().tolist()]


def test_a_nan_step_pauses_with_a_finite_latest_and_the_restored_run_is_bit_identical(tmp_path: Path) -> None:
    model, opt = gpt(0, fused=True)
    reference: list[torch.Tensor] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path / "ref", guard_actions={}))
    with deterministic():
        train(patrol, model, opt, 320, reference)
    patrol.close()
    ref = floats(reference)
    assert math.isnan(ref[NAN_AT - 1]) and all(math.isfinite(v) for v in ref[NAN_AT:])  # the update was skipped

    model, opt = gpt(0, fused=True)
    first: list[torch.Tensor] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path / "run"))
    code = pause_then_stop(patrol, lambda: train(patrol, model, opt, 10**6, first))
    patrol.close()
    pause = next(a for a in patrol.actions if a.action == "pause")
    latest = Checkpointer(tmp_path / "run" / "ckpt").latest()
    assert code == STOP_EXIT_CODE and latest is not None and latest.name == f"step-{pause.step:08d}"
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["finite"] is True and nonfinite(latest) == 0
    stop_step = patrol.step_count
    assert floats(first)[NAN_AT:] == ref[NAN_AT:stop_step]

    model, opt = gpt(9, fused=True)
    resumed: list[torch.Tensor] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path / "run"))
    restored = patrol.restore("latest")
    assert restored.step == stop_step
    with deterministic():
        train(patrol, model, opt, stop_step + 50, resumed, epochs_from=restored.epoch)
    patrol.close()
    assert floats(resumed) == ref[stop_step:stop_step + 50]  # bit for bit
    RESULTS["fused"] = {"nan_at": NAN_AT, "paused_at": pause.step, "stopped_at": stop_step,
                        "latest": latest.name, "nonfinite_tensors": 0, "resumed_steps_equal": 50}


def test_without_a_skip_the_poisoned_pause_checkpoint_is_passed_over_for_the_last_finite(tmp_path: Path) -> None:
    model, opt = gpt(0, fused=False)  # foreach AdamW: no device-side skip
    losses: list[torch.Tensor] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path))
    assert patrol._hooks is not None and patrol._hooks.mode == "off"
    code = pause_then_stop(patrol, lambda: train(patrol, model, opt, 10**6, losses, checkpoint_at=101))
    assert code == STOP_EXIT_CODE
    patrol.close()
    pause = next(a for a in patrol.actions if a.action == "pause")
    poisoned = Path(pause.checkpoint)
    meta = json.loads((poisoned / "meta.json").read_text())
    assert meta["finite"] is False and meta["nonfinite_count"] == nonfinite(poisoned) > 0
    model, opt = gpt(9, fused=False)
    fresh = Patrol(model=model, optimizer=opt, config=config(tmp_path))
    restored = fresh.restore("latest")
    assert restored.step == 101 and poisoned.name in restored.skipped[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    fresh.close()
    RESULTS["foreach"] = {"paused_at": pause.step, "pause_checkpoint_nonfinite_tensors": meta["nonfinite_count"],
                          "restored": Path(restored.path).name}


@pytest.fixture(scope="module", autouse=True)
def _record() -> Iterator[None]:
    yield
    out = os.environ.get("OUT")
    if out and RESULTS:
        Path(out, "trustworthy-stop-h200.json").write_text(json.dumps(RESULTS, indent=2))
