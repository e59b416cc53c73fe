"""The run's key: the secret every push of the run proves to the agent (agent.auth).

``TRAINPATROL_RUN_KEY`` when the launcher or chart gives every rank the same one; otherwise rank 0
makes one and, under torch.distributed, hands it to the other ranks once, at Patrol's construction
(one small broadcast, never per step). A single process makes its own. Ranks of a larger world with
no process group yet have no way to agree on one: they push without a key, and say so. The key never leaves the job:
the agent keeps a digest and never sends it back.
"""

from __future__ import annotations

import logging
import os
import secrets

import torch
import torch.distributed as dist

log = logging.getLogger("trainpatrol")
ENV = "TRAINPATROL_RUN_KEY"


def run_key(configured: str, distributed: bool, device: torch.device) -> str:
    """``configured`` if set, else one key shared by every rank of the process group. ``device``: the
    rank's own GPU, which NCCL carries the broadcast on (the current device may be another rank's)."""
    if configured:
        return configured
    key = secrets.token_hex(16)
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
