"""A training process whose Patrol may start the embedded agent: ``embedded_run.py URL RUN WORKDIR STEPS IDLE``.

Trains scripted steps of 20 ms on the CPU (a pause blocks in ``boundary``) and logs at INFO to stderr,
so a test reads every warning a user would see. A ``stop`` command ends it with the stop exit code; a
file ``WORKDIR/finish`` ends it as its last step would, so a test decides when a run ends."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

from trainpatrol import Patrol, PatrolConfig


def main(url: str, run: str, workdir: str, steps: int, idle: float) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = PatrolConfig(run=run, agent_url=url, embedded_agent=True, embedded_agent_idle_seconds=idle,
                       checkpoint_dir=str(Path(workdir) / "ckpt"), evidence_dir=str(Path(workdir) / "evidence"),
                       push_interval_seconds=0.2, pause_poll_seconds=0.05)
    finish = Path(workdir) / "finish"
    with Patrol(config=cfg, device="cpu") as patrol:
        print(f"started {run}", flush=True)
        for _ in range(steps):
            if finish.exists():
                break
            patrol.boundary()  # blocks while paused; exits the process on stop
            patrol.step(torch.tensor(1.0), batch_size=8)
            time.sleep(0.02)
    print(f"finished {run}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
