"""Evidence bundles: what a person needs at 3 a.m. to see why a run was stopped.

``<evidence_dir>/<UTC time>-step<step>-<action>/`` holds ``manifest.json`` (rank 0),
``trigger.json`` (the alert or request), and per rank ``rank-00003/`` with ``history.json``,
``memory_stats.json``, ``memory_summary.txt``, ``memory_snapshot.pickle`` (when recording),
``stacks.txt`` (all threads, via faulthandler), ``nvml.json``, ``versions.json`` and
``config.json``. Each file is capped so a bundle stays small.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import platform
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import torch

from .. import handshake
from .._version import __version__
from ..agent.config import DEFAULT_PORT

log = logging.getLogger("trainpatrol")
MAX_FILE_BYTES = 8 * 2**20


def bundle_name(clock: float, step: int, action: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(clock))
    return f"{stamp}-step{step:08d}-{action}"


def _write(path: Path, data: bytes | str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > MAX_FILE_BYTES:
        raw = raw[:MAX_FILE_BYTES] + b"\n[truncated by trainpatrol: file over the size bound]\n"
    path.write_bytes(raw)


def _json(path: Path, value: Any) -> None:
    _write(path, json.dumps(value, indent=2, default=str))


def all_stacks() -> str:
    with tempfile.TemporaryFile(mode="w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def fetch_nvml(agent_url: str, token: str) -> Any:
    """The agent's last NVML sample, asked for once the agent proved itself (trainpatrol.handshake)."""
    parsed = urllib.parse.urlparse(agent_url)
    try:
        conn = handshake.connect(parsed.hostname or "127.0.0.1", parsed.port or DEFAULT_PORT, token, 2.0)
        try:
            conn.request("GET", "/v1/nvml", headers={"Authorization": f"Bearer {token}"} if token else {})
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()
    except Exception as exc:
        return {"available": False, "reason": f"agent did not answer: {exc}"}


def write_rank_part(bundle: Path, rank: int, *, history: list[dict[str, Any]], device: torch.device,
                    nvml: Any, config: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    part = bundle / f"rank-{rank:05d}"
    part.mkdir(parents=True, exist_ok=True)
    _json(part / "history.json", history)
    if device.type == "cuda":
        _json(part / "memory_stats.json", torch.cuda.memory_stats(device))
        _write(part / "memory_summary.txt", torch.cuda.memory_summary(device))
        if _recording():
            import pickle

            _write(part / "memory_snapshot.pickle", pickle.dumps(torch.cuda.memory._snapshot()))
    else:
        _write(part / "memory_summary.txt", f"device {device}: no CUDA caching allocator on this rank\n")
    _write(part / "stacks.txt", all_stacks())
    _json(part / "nvml.json", nvml)
    _json(part / "versions.json", {
        "trainpatrol": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version, "platform": platform.platform(), "argv": sys.argv,
    })
    _json(part / "config.json", config)
    if extra:
        _json(part / "extra.json", extra)
    return part


def write_manifest(bundle: Path, manifest: dict[str, Any], trigger: dict[str, Any]) -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    _json(bundle / "trigger.json", trigger)
    files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
    _json(bundle / "manifest.json", {**manifest, "files": files})


def _recording() -> bool:
    try:
        return bool(torch.cuda.memory._record_memory_history_enabled())  # type: ignore[attr-defined]
    except Exception:
        return _RECORDING[0]


_RECORDING = [False]


def set_recording(enabled: bool, max_entries: int = 100_000) -> None:
    """Switch CUDA memory-history recording on or off (config or on demand)."""
    if not torch.cuda.is_available():
        return
    torch.cuda.memory._record_memory_history(enabled="all" if enabled else None, max_entries=max_entries)
    _RECORDING[0] = enabled
