"""Two-rank DDP scenarios: same-step pause, resume, stop and restore, and a NaN on rank 1.

Run by tests/control/test_ddp_restore.py on CPU (gloo) and tests/gpu/test_nccl_control.py on two GPUs (NCCL).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import agent, free_port, holds_for, http_json, python_env, wait_for
from trainpatrol import STOP_EXIT_CODE

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
WORKER = Path(__file__).parents[1] / "control" / "ddp_worker.py"


def launch(tmp: Path, url: str, run: str, device: str, **env: str) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        e = python_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, AGENT_URL=url, OUT=str(tmp), RUN=run, DEVICE=device, **env)
        log = open(tmp / f"{run}-{env.get('RECORD', 'rank')}-{rank}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=e, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float = 180) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def state(url: str, run: str) -> dict[str, Any]:
    try:
        return dict(http_json(f"{url}/v1/runs/{run}"))
    except Exception:
        return {"state": "unknown", "ranks": []}


def record(tmp: Path, name: str, rank: int) -> dict[str, Any]:
    return dict(json.loads((tmp / f"{name}-{rank}.json").read_text()))


def pause_resume_stop_and_restore(tmp_path: Path, device: str) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        procs = launch(tmp_path, url, "nccl", device, RECORD="live")
        wait_for(lambda: len(state(url, "nccl")["ranks"]) == 2 and min(r["step"] for r in state(url, "nccl")["ranks"])
                 > 20, 120, what="2 ranks running")
        http_json(f"{url}/v1/runs/nccl/actions", {"action": "pause", "reason": "nccl test"})
        wait_for(lambda: state(url, "nccl")["state"] == "paused", 60, what="both paused")
        steps = {r["step"] for r in state(url, "nccl")["ranks"]}
        assert len(steps) == 1
        paused_at = steps.pop()
        holds_for(lambda: {r["step"] for r in state(url, "nccl")["ranks"]} == {paused_at}
                  and state(url, "nccl")["state"] == "paused", 0.5, what="the pause on both ranks")
        http_json(f"{url}/v1/runs/nccl/actions", {"action": "resume", "reason": "nccl test"})
        wait_for(lambda: min(r["step"] for r in state(url, "nccl")["ranks"]) > paused_at + 10, 60, what="resumed")
        http_json(f"{url}/v1/runs/nccl/actions", {"action": "stop", "reason": "nccl test"})
        assert wait_all(procs) == [STOP_EXIT_CODE] * 2
        live = [record(tmp_path, "live", r) for r in range(2)]
        assert [a["step"] for a in live[0]["actions"]] == [a["step"] for a in live[1]["actions"]]
        stop_step = live[0]["steps"]

        # an uninterrupted reference job, and a new job restored from the stop checkpoint
        ref_dir = tmp_path / "ref"
        ref_dir.mkdir()
        assert wait_all(launch(ref_dir, url, "ref", device, RECORD="ref", STEPS=str(stop_step + 30))) == [0, 0]
        assert wait_all(launch(tmp_path, url, "nccl", device, RECORD="restored", RESTORE="1",
                               STEPS=str(stop_step + 30))) == [0, 0]
    for rank in range(2):
        ref = record(ref_dir, "ref", rank)["losses"]
        restored = record(tmp_path, "restored", rank)["losses"]
        after = [str(s) for s in range(stop_step + 1, stop_step + 31)]
        assert sorted(restored, key=int) == after
        if device == "cpu":  # float32 on CPU: bit for bit
            assert [restored[s] for s in after] == [ref[s] for s in after]
        for s in after:
            assert restored[s] == pytest.approx(ref[s], rel=2e-2, abs=1e-3), s  # bf16 autocast tolerance on CUDA
        before = [str(s) for s in range(1, paused_at + 1)]
        assert all(live[rank]["losses"][s] == pytest.approx(ref[s], rel=2e-2, abs=1e-3) for s in before)


def nan_on_rank_one_pauses_both(tmp_path: Path, device: str) -> None:
    with agent(tmp_path, "--no-nvml") as url:
        procs = launch(tmp_path, url, "nan", device, NAN_AT="40", RECORD="nan")
        wait_for(lambda: state(url, "nan")["state"] == "paused" and len(state(url, "nan")["ranks"]) == 2, 120,
                 what="both paused by the guard")
        steps = {r["step"] for r in state(url, "nan")["ranks"]}
        assert len(steps) == 1 and steps.pop() >= 40
        http_json(f"{url}/v1/runs/nan/actions", {"action": "stop", "reason": "end"})
        assert wait_all(procs) == [STOP_EXIT_CODE] * 2
    recs = [record(tmp_path, "nan", r) for r in range(2)]
    pauses = [[a for a in rec["actions"] if a["action"] == "pause"] for rec in recs]
    assert len(pauses[0]) == 1 and pauses[0][0]["step"] == pauses[1][0]["step"]
