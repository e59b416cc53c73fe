"""A checkpoint onto a full disk says so ("No space left on device", with the file) and leaves no
empty or partial ``step-…`` directory. The disk is a real one: a 300 KiB tmpfs mounted in a private
mount namespace (root, or a user namespace, is needed), so torch.save meets ENOSPC part-way through a
write, which it used to report as "unexpected pos 704 vs 598"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    import torch
    from trainpatrol import Patrol, PatrolConfig

    disk, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = PatrolConfig(run="full-disk", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=str(disk / "ckpt"), evidence_dir=str(out / "evidence"),
                          push_interval_seconds=0.1, pause_poll_seconds=0.05)
    patrol = Patrol(model=model, optimizer=opt, config=config)

    def train():
        while patrol.step_count < 10:
            patrol.boundary()
            x = torch.randn(16, 256)
            loss = (model(x) ** 2).mean()
            loss.backward()
            patrol.step(loss)
            opt.step()
            opt.zero_grad()

    threading.Thread(target=train, daemon=True).start()
    patrol.request("checkpoint", "onto a full disk")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not [a for a in patrol.actions if a.action == "checkpoint"]:
        time.sleep(0.05)
    actions = [{"outcome": a.outcome, "detail": a.detail} for a in patrol.actions if a.action == "checkpoint"]
    left = sorted(str(p.relative_to(disk)) for p in (disk / "ckpt").rglob("*")  # the run key stays: it is kept
                  if not p.name.startswith(".run-key-")) if (disk / "ckpt").exists() else []
    (out / "result.json").write_text(json.dumps({"actions": actions, "left": left}))
    os._exit(0)
""")


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_mount(),
                    reason="needs unshare and a mount namespace for a small tmpfs")
def test_a_checkpoint_onto_a_full_disk_names_enospc_and_leaves_no_step_directory(tmp_path: Path) -> None:
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    as_root = os.geteuid() == 0
    command = (f"mount -t tmpfs -o size=300k none {disk} && "
               f"exec {sys.executable} {tmp_path / 'script.py'} {disk} {out}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "exporter"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(["unshare", "-m" if as_root else "-rm", "--propagation", "private", "sh", "-c", command],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads((out / "result.json").read_text())
    assert [a["outcome"] for a in found["actions"]] == ["failed"], found
    detail = found["actions"][0]["detail"]
    assert "No space left on device" in detail and "unexpected pos" not in detail, detail
    assert "step-" in detail  # the file that could not be written is named
    assert found["left"] == [], found["left"]  # no empty or partial step-… directory, no temp file


ROOM_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys, threading, time
    from pathlib import Path
    import torch
    from trainpatrol import Patrol, PatrolConfig

    disk, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = PatrolConfig(run="room", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=str(disk / "ckpt"), evidence_dir=str(out / "evidence"),
                          push_interval_seconds=3600, guard_actions={})
    patrol = Patrol(model=model, optimizer=opt, config=config)

    def train():
        while True:
            patrol.boundary()
            loss = (model(torch.randn(16, 256)) ** 2).mean()
            loss.backward()
            patrol.step(loss)
            opt.step()
            opt.zero_grad()

    threading.Thread(target=train, daemon=True).start()
    free = []
    for n in range(2):  # the second fails, and leaves the run paused: a failed checkpoint does
        patrol.request("checkpoint", f"checkpoint {n + 1}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(patrol.actions) <= n:
            time.sleep(0.05)
        free.append(shutil.disk_usage(disk).free)
    actions = [{"outcome": a.outcome, "detail": a.detail, "step": a.step} for a in patrol.actions]
    complete = sorted(p.name for p in (disk / "ckpt").glob("step-*") if (p / "meta.json").is_file())
    left = sorted(str(p.relative_to(disk / "ckpt")) for p in (disk / "ckpt").rglob("*")
                  if not p.name.startswith(".run-key-"))
    (out / "result.json").write_text(json.dumps({"actions": actions, "complete": complete, "left": left,
                                                 "free": free}))
    os._exit(0)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_mount(),
                    reason="needs unshare and a mount namespace for a small tmpfs")
def test_a_checkpoint_that_would_not_fit_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A 1.2 MiB disk holds one 0.8 MiB checkpoint: the second is refused with a clear error before it writes a
    byte, so the disk is not filled and the first stays complete."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    (tmp_path / "script.py").write_text(ROOM_SCRIPT)
    as_root = os.geteuid() == 0
    command = (f"mount -t tmpfs -o size=1200k none {disk} && "
               f"exec {sys.executable} {tmp_path / 'script.py'} {disk} {out}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "exporter"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(["unshare", "-m" if as_root else "-rm", "--propagation", "private", "sh", "-c", command],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads((out / "result.json").read_text())
    assert [a["outcome"] for a in found["actions"]] == ["ok", "failed"], found
    detail = found["actions"][1]["detail"]
    assert "not enough free space for a checkpoint" in detail and "nothing was written" in detail, detail
    first = f"step-{found['actions'][0]['step']:08d}"
    assert found["complete"] == [first]
    assert found["left"] == sorted([first, f"{first}/meta.json", f"{first}/rank-00000.pt", f"{first}/state.bin"])
    assert found["free"][1] == found["free"][0]  # the refused checkpoint took no space
