"""A sharded model (FSDP2's ``fully_shard``) on CPU with gloo: every rank writes its shards through
torch.distributed.checkpoint; checkpoint, pause and stop are agreed and saved; a new job restores and continues
bit for bit on the same world size, restores the same weights on another, and passes over a checkpoint that
lost a rank's shards. In the background, each rank's shards are staged at the step and written while training goes
on (DCP's async_save), and the checkpoint holds that step's state."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from servers import free_port, python_env
from trainpatrol import STOP_EXIT_CODE
from trainpatrol.control import state_file

WORKER = Path(__file__).parent / "fsdp_worker.py"


def run(out: Path, world: int, ckpt: Path, record: str, **env: str) -> list[int]:
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(world):
        e = python_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OUT=str(out), CKPT=str(ckpt), RECORD=record,
                       OMP_NUM_THREADS="1", **env)
        log = open(out / f"{record}-{rank}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=e, stdout=log, stderr=subprocess.STDOUT))
    try:
        return [p.wait(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # every thread's stack of the ranks still running, into their logs
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        logs = "\n".join(f"--- rank {r} ---\n" + (out / f"{record}-{r}.log").read_text(errors="replace")[-4000:]
                          for r in range(world))
        raise AssertionError(f"{record}: ranks still running after 240 s\n{logs}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def records(out: Path, record: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{record}-{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_checkpoint_pause_stop_then_restore_continues_bit_for_bit(tmp_path: Path, world: int) -> None:
    assert run(tmp_path / "ref", world, tmp_path / "ref-ckpt", "ref", STEPS="30") == [0] * world
    ckpt = tmp_path / "ckpt"
    assert run(tmp_path, world, ckpt, "live", STEPS="30", CHECKPOINT_AT="4", PAUSE_AT="10",
               STOP_AT="18") == [STOP_EXIT_CODE] * world
    live = records(tmp_path, "live", world)
    done = [[(a["action"], a["outcome"], a["step"]) for a in r["actions"]] for r in live]
    assert all(d == done[0] for d in done), done  # every rank did the same at the same steps
    assert [a for a, _, _ in done[0]] == ["checkpoint", "pause", "resume", "stop"]
    assert all(outcome == "ok" for _, outcome, _ in done[0]), done[0]
    stop = live[0]["steps"]
    meta = json.loads((ckpt / f"step-{stop:08d}" / "meta.json").read_text())
    assert meta["format"] == "dcp" and meta["pinned"] is True and meta["finite"] is True
    assert meta["world_size"] == world and sorted(meta["shards"]) == sorted(
        [".metadata"] + [f"__{r}_0.distcp" for r in range(world)])
    assert [p.name for p in (ckpt / f"step-{stop:08d}").glob("dcp-*")] == [meta["dcp"]]
    assert not (ckpt / f"step-{stop:08d}" / "state.bin").exists() or "model" not in state_file.read(
        ckpt / f"step-{stop:08d}" / "state.bin")

    assert run(tmp_path, world, ckpt, "restored", STEPS="30", RESTORE="1") == [0] * world
    ref, restored = records(tmp_path / "ref", "ref", world), records(tmp_path, "restored", world)
    for rank in range(world):
        assert restored[rank]["restored"]["step"] == stop
        assert sorted(restored[rank]["losses"], key=int) == [str(s) for s in range(stop + 1, 31)]
        for s in range(1, stop + 1):
            assert live[rank]["losses"][str(s)] == ref[rank]["losses"][str(s)]
        for s in range(stop + 1, 31):  # exact float equality
            assert restored[rank]["losses"][str(s)] == ref[rank]["losses"][str(s)], (rank, s)


def test_an_fsdp2_checkpoint_of_two_ranks_restores_the_same_weights_on_four(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert run(tmp_path, 2, ckpt, "two", STEPS="30", STOP_AT="6", DUMP="1") == [STOP_EXIT_CODE] * 2
    assert run(tmp_path, 4, ckpt, "four", STEPS="0", RESTORE="1", DUMP="1") == [0] * 4
    assert records(tmp_path, "four", 4)[0]["restored"]["step"] == records(tmp_path, "two", 2)[0]["steps"]
    saved, loaded = torch.load(tmp_path / "two-model.pt"), torch.load(tmp_path / "four-model.pt")
    assert sorted(saved) == sorted(loaded)
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


def test_a_checkpoint_that_lost_a_rank_shards_is_passed_over(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert run(tmp_path, 2, ckpt, "live", STEPS="40", CHECKPOINT_AT="20", STOP_AT="28") == [STOP_EXIT_CODE] * 2
    live = records(tmp_path, "live", 2)
    first = next(a["step"] for a in live[0]["actions"] if a["action"] == "checkpoint")
    stop = live[0]["steps"]
    assert first < stop
    newest = ckpt / f"step-{stop:08d}"
    (newest / json.loads((newest / "meta.json").read_text())["dcp"] / "__1_0.distcp").unlink()
    assert run(tmp_path, 2, ckpt, "restored", STEPS="0", RESTORE="1") == [0] * 2
    for r in records(tmp_path, "restored", 2):
        assert r["restored"]["step"] == first
        assert r["restored"]["skipped"] == [f"step-{stop:08d}: shard files missing or cut short (__1_0.distcp)"]


def test_fsdp2_shards_written_in_the_background_hold_the_state_of_their_step(tmp_path: Path) -> None:
    """A 1.5 s slower disk: training takes steps while the shards are written, and a new job restored from that
    checkpoint continues bit for bit as the run that never stopped."""
    assert run(tmp_path / "ref", 2, tmp_path / "ref-ckpt", "ref", STEPS="100") == [0, 0]
    ckpt = tmp_path / "ckpt"
    assert run(tmp_path, 2, ckpt, "live", STEPS="100", CHECKPOINT_AT="4", BACKGROUND="1", SLOW_WRITE="1.5") == [0, 0]
    live = records(tmp_path, "live", 2)
    at = live[0]["actions"][0]["step"]  # agreed at the ranks' next control exchange after step 4
    for r in live:
        assert [(a["action"], a["outcome"], a["step"]) for a in r["actions"]] == [("checkpoint", "ok", at)], r
        durable = r["seen_at"][0] if r["seen_at"] else r["steps"]  # or only at close, after the last step
        assert durable >= at + 10, (at, r["seen_at"])  # durable only after training went on for steps
    meta = json.loads((ckpt / f"step-{at:08d}" / "meta.json").read_text())
    assert meta["format"] == "dcp" and sorted(meta["shards"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("step-")] == [f"step-{at:08d}"]

    assert run(tmp_path, 2, ckpt, "restored", STEPS="100", RESTORE="1") == [0, 0]
    ref, restored = records(tmp_path / "ref", "ref", 2), records(tmp_path, "restored", 2)
    for rank in range(2):
        assert restored[rank]["restored"]["step"] == at
        for s in range(at + 1, 101):  # exact float equality
            assert restored[rank]["losses"][str(s)] == ref[rank]["losses"][str(s)], (rank, s)
