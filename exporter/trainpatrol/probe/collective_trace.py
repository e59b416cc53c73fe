"""The collectives a rank last entered, from PyTorch's Flight Recorder, for a stall capture.

Each process group records its collectives (sequence number, operation, state: scheduled, started, completed) in a
bounded ring buffer that torch dumps on request; NCCL's and, in recent torch, gloo's groups record. In a hung
lock-step job the ranks that wait have entered one more collective than the rank they wait for: the rank behind
in its sequence number is the one to look at. Read from Patrol's publisher thread, never from the training thread.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DEFAULT_BUFFER = "2000"
"""Entries each rank keeps when the user set no size: torch's own default where it records by default."""
KEPT_ENTRIES = 16
"""The newest entries written into a capture (the buffer holds thousands)."""


def enable_flight_recorder() -> None:
    """Turns the Flight Recorder on with a bounded buffer unless the user sized it. torch reads the size when the
    first process group is created, so this takes effect only before ``init_process_group``."""
    if not any(v in os.environ for v in BUFFER_VARIABLES):
        os.environ[BUFFER_VARIABLES[1]] = DEFAULT_BUFFER


def collective_trace() -> dict[str, Any]:
    """Per process group the newest collective this rank entered (``last``: sequence number, operation, state),
    the newest raw entries, or ``available: False`` with the reason."""
    if not (dist.is_available() and dist.is_initialized()):
        return {"available": False, "reason": "no process group"}
    backend = str(dist.get_backend())
    c10d = torch._C._distributed_c10d
    name = "_dump_nccl_trace_json" if "nccl" in backend else "_dump_fr_trace_json"  # also "cpu:gloo,cuda:nccl"
    dump = getattr(c10d, name, None)
    if dump is None:
        return {"available": False, "reason": f"torch {torch.__version__} cannot dump a {backend} trace"}
    try:
        raw = json.loads(dump(includeCollectives=True, onlyActive=False))
    except Exception as exc:  # a torch without the trace for this backend raises its own error types
        return {"available": False, "reason": f"{name}: {exc}"}
    entries = [e for e in raw.get("entries", []) if not e.get("is_p2p")]
    if not entries:
        size = next((os.environ[v] for v in BUFFER_VARIABLES if v in os.environ), "torch's default")
        return {"available": False, "reason": f"no collective recorded ({backend}; buffer size {size})"}
    last: dict[str, dict[str, Any]] = {}
    for e in entries:
        group = str((e.get("process_group") or [e.get("pg_id", "")])[0])
        seq = int(e.get("collective_seq_id", 0))
        if seq >= last.get(group, {}).get("seq", -1):
            last[group] = {"seq": seq, "op": e.get("profiling_name", ""), "state": e.get("state", "")}
    kept = [{k: e.get(k) for k in ("process_group", "collective_seq_id", "profiling_name", "state",
                                   "time_created_ns", "input_sizes")} for e in entries[-KEPT_ENTRIES:]]
    return {"available": True, "backend": backend, "last": last, "entries": kept}


def behind_ranks(traces: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks whose newest collective in a process group is older than another rank's in the same group."""
    newest: dict[str, int] = {}
    for trace in traces.values():
        for group, last in trace.get("last", {}).items():
            newest[group] = max(newest.get(group, -1), int(last["seq"]))
    return sorted(r for r, trace in traces.items()
                  if any(int(last["seq"]) < newest[group] for group, last in trace.get("last", {}).items()))
