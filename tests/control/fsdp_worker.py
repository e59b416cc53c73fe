"""One rank of a CPU (gloo) FSDP2 job with Patrol: a ``fully_shard`` model, AdamW and a scheduler, with
checkpoint, pause (resumed a second later), stop and restore asked for by the environment; records what it
did to OUT/RECORD-R.json at exit, and (DUMP) rank 0 writes the whole model state it ended with. BACKGROUND=1
writes checkpoints in the background; SLOW_WRITE=S makes each rank's storage take S seconds longer to write its
shards (a slow disk)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from trainpatrol import Patrol, PatrolConfig

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps every thread's stack of a stuck rank


def env_int(name: str) -> int:
    return int(os.environ.get(name, "0"))


def slow_storage(seconds: float) -> None:
    from torch.distributed.checkpoint import filesystem

    write_data = filesystem.FileSystemWriter.write_data

    def slow(self: object, *args: object, **kwargs: object) -> object:
        time.sleep(seconds)
        return write_data(self, *args, **kwargs)  # type: ignore[arg-type]
    filesystem.FileSystemWriter.write_data = slow  # type: ignore[method-assign]


def main() -> int:
    if os.environ.get("SLOW_WRITE"):
        slow_storage(float(os.environ["SLOW_WRITE"]))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, name = Path(os.environ["OUT"]), os.environ.get("RECORD", "rank")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    config = PatrolConfig(run="fsdp", agent_url="http://127.0.0.1:9", embedded_agent=False,
                          checkpoint_dir=os.environ["CKPT"], evidence_dir=str(out / "evidence"),
                          push_interval_seconds=3600, pause_poll_seconds=0.05, control_target_seconds=0.02,
                          guard_actions={}, background_checkpoints=bool(os.environ.get("BACKGROUND")))
    patrol = Patrol(model=model, optimizer=opt, scheduler=scheduler, config=config)
    restored = patrol.restore("latest") if os.environ.get("RESTORE") else None
    losses: dict[int, float] = {}
    seen_at: list[int] = []  # the step count when each action's outcome was first seen
    code = 0
    try:
        while patrol.step_count < env_int("STEPS"):
            patrol.boundary()
            time.sleep(0.01)  # a step long enough that the ranks agree on each request before the next one
            step = patrol.step_count + 1
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + step))
            loss = (model(x) - x.sum(dim=1, keepdim=True) / 4).pow(2).mean()
            loss.backward()
            patrol.step(loss, batch_size=8)
            opt.step()
            opt.zero_grad()
            scheduler.step()
            losses[step] = loss.item()
            seen_at += [patrol.step_count] * (len(patrol.actions) - len(seen_at))
            if rank == 0 and step == env_int("CHECKPOINT_AT"):
                patrol.request("checkpoint", "test")
            if rank == 0 and step == env_int("PAUSE_AT"):
                patrol.request("pause", "test")
                threading.Timer(1.0, lambda: patrol.request("resume", "test")).start()
            if rank == 0 and step == env_int("STOP_AT"):
                patrol.request("stop", "test")
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        if os.environ.get("DUMP"):  # every rank takes part in gathering the whole state
            whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(whole, out / f"{name}-model.pt")
        patrol.close()  # a checkpoint still being written is durable, and its outcome recorded, first
        record = {"rank": rank, "exit": code, "steps": patrol.step_count,
                  "restored": {"step": restored.step, "path": restored.path, "skipped": list(restored.skipped)}
                  if restored is not None else None,
                  "actions": [a.model_dump() for a in patrol.actions], "losses": losses, "seen_at": seen_at}
        (out / f"{name}-{rank}.json").write_text(json.dumps(record))
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
