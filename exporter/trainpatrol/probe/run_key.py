"""The run's key: the secret every push of the run proves to the agent (agent.auth).

``TRAINPATROL_RUN_KEY`` when the launcher or chart gives every rank the same one; otherwise rank 0
takes the one it kept in the run's checkpoint directory (a file only its user can read) or makes one
and keeps it there, and, under torch.distributed, hands it to the other ranks once, at Patrol's
construction (one small broadcast, never per step). A run relaunched after a crash, by hand or by
torchrun's restarts, so proves the same key at once and is watched again from its first push. Ranks
of a larger world with no process group yet have no way to agree on one: they push without a key, and
say so. The key never leaves the job: the agent keeps a digest and never sends it back.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("trainpatrol")
ENV = "TRAINPATROL_RUN_KEY"


def run_key(configured: str, distributed: bool, device: torch.device, kept: Path | None = None) -> str:
    """``configured`` if set, else one key shared by every rank of the process group, kept by rank 0 in
    ``kept``. ``device``: the rank's own GPU, which NCCL carries the broadcast on (the current device
    may be another rank's)."""
    if configured:
        return configured
    first = not distributed or dist.get_rank() == 0
    key = _kept_key(kept) if first and kept is not None else secrets.token_hex(16)
    if distributed:
        shared = [key if dist.get_rank() == 0 else ""]
        on = device if dist.get_backend() == "nccl" else None
        dist.broadcast_object_list(shared, src=0, device=on)  # every rank constructs its Patrol: all meet here
        return str(shared[0])
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # ranks with keys of their own would lock each other out: the first to push binds its key
        log.warning("trainpatrol: WORLD_SIZE > 1 but torch.distributed is not initialised when Patrol is made, "
                    "so the ranks cannot agree on a run key and this run's pushes carry none: another process "
                    "could push as this run. Initialise the process group first, or give every rank the same %s.",
                    ENV)
        return ""
    return key


def _kept_key(path: Path) -> str:
    """The key kept at ``path``, or a new one kept there (readable by this user alone)."""
    try:
        key = path.read_text().strip()
        if len(key) == 32:
            return key
    except OSError:
        pass
    key = secrets.token_hex(16)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(key)
        os.replace(tmp, path)
    except OSError as exc:  # a relaunch will make a new key, and wait for the old ranks to go down
        log.warning("trainpatrol: could not keep the run key in %s (%s)", path, exc)
    return key
