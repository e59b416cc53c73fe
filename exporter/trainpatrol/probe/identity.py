"""Who this rank is: rank, world, host, device and its GPU uuid, and the versions in play."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from .._version import __version__
from .workload import Workload


@dataclass(frozen=True)
class Identity:
    rank: int
    local_rank: int
    world_size: int
    host: str
    device: torch.device
    gpu_uuid: str

    def info_labels(self, workload: Workload) -> dict[str, str]:
        return {"launcher": workload.launcher, "launcher_job": workload.launcher_job,
            "local_rank": str(self.local_rank), "world_size": str(self.world_size), "host": self.host,
            "gpu_uuid": self.gpu_uuid, "device": str(self.device), "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda or "", "trainpatrol_version": __version__,
        }


def gpu_uuid(device: torch.device) -> str:
    """NVML-style uuid ("GPU-..."), so rank metrics join GPU metrics whatever CUDA_VISIBLE_DEVICES says."""
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return ""
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def detect(device: torch.device | None) -> Identity:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return Identity(rank, local_rank, world, socket.gethostname(), device, gpu_uuid(device))
