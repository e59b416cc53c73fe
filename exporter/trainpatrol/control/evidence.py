"""Evidence bundles: what a person needs at 3 a.m. to see why a run was stopped.

``<evidence_dir>/<UTC time>-step<step>-<action>/`` holds ``manifest.json`` (rank 0),
``trigger.json`` (the alert or request), and per rank ``rank-00003/`` with ``history.json``,
``memory_stats.json``, ``memory_summary.txt``, ``memory_snapshot.pickle`` (when recording),
``stacks.txt`` (every Python thread, by name), ``nvml.json``, ``versions.json`` and
``config.json``. Each file is capped so a bundle stays small.

Rank 0 also renders the bundle's report page, whose matplotlib timeline takes a second or more of Python: a
thread hands the bundles, one at a time and in order, to a child process (``trainpatrol report``), so neither
the training thread nor its GIL waits for them (``wait`` does, before a stop's exit). A report that fails is
logged, never raised.
"""

from __future__ import annotations

import json
import logging
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import handshake
from .._version import __version__
from ..agent.config import DEFAULT_PORT

log = logging.getLogger("trainpatrol")
MAX_FILE_BYTES = 8 * 2**20
REPORTS_WAITING = 4
"""Reports waiting to be rendered, at most: a close (which waits for them) stays short, and memory bounded."""


def _write(path: Path, data: bytes | str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    if len(raw) > MAX_FILE_BYTES:
        raw = raw[:MAX_FILE_BYTES] + b"\n[truncated by trainpatrol: file over the size bound]\n"
    path.write_bytes(raw)


def _json(path: Path, value: Any) -> None:
    _write(path, json.dumps(value, indent=2, default=str))


def all_stacks() -> str:
    """Every Python thread's stack, by name, read through the interpreter's own locked view of its threads.
    ``faulthandler``'s dump is built for a crashing process and reads the thread list without that lock; a rank
    once hung inside it while writing its pause evidence."""
    current = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        head = "Current thread" if ident == current else "Thread"
        name = names.get(ident, "(not started by threading)")
        blocks.append(f"{head} 0x{ident:016x} \"{name}\" "
                      f"(most recent call last):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(blocks)


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


class EvidenceWriter:
    def __init__(self, directory: str | Path, rank: int, device: torch.device, *,
                 history: Callable[[], list[dict[str, Any]]], config: Callable[[], dict[str, Any]],
                 nvml: Callable[[], Any]) -> None:
        self._directory, self._rank, self._device = Path(directory), rank, device
        self._history, self._config, self._nvml = history, config, nvml
        self._queue: queue.Queue[Path] = queue.Queue(maxsize=REPORTS_WAITING)
        self._renderer: threading.Thread | None = None

    def bundle(self, clock: float, step: int, action: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(clock))
        return self._directory / f"{stamp}-step{step:08d}-{action}"

    def part(self, bundle: Path, extra: dict[str, Any], nvml: Any = None) -> None:
        """This rank's part; ``nvml``: what to write instead of asking the agent."""
        history = self._history()
        nvml = self._nvml() if nvml is None else nvml
        config, device = self._config(), self._device
        part = bundle / f"rank-{self._rank:05d}"
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

    def index(self, bundle: Path, manifest: dict[str, Any], trigger: dict[str, Any]) -> None:
        bundle.mkdir(parents=True, exist_ok=True)
        _json(bundle / "trigger.json", trigger)
        files = sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())
        _json(bundle / "manifest.json", {**manifest, "files": files})
        if self._renderer is None:
            self._renderer = threading.Thread(target=self._render_queued, name="trainpatrol-report", daemon=True)
            self._renderer.start()
        while True:
            try:
                self._queue.put_nowait(bundle)
                return
            except queue.Full:  # bundles come faster than reports render: the oldest waiting one gives way
                pass
            try:
                older = self._queue.get_nowait()
            except queue.Empty:
                continue
            self._queue.task_done()
            log.warning("trainpatrol: report for %s not rendered (%d newer waiting); `trainpatrol report %s` "
                        "renders it", older, REPORTS_WAITING, older)

    def wait(self) -> None:
        """Until every report asked for is written."""
        self._queue.join()

    def _render_queued(self) -> None:
        while True:
            bundle = self._queue.get()
            try:
                _render(bundle)
            finally:
                self._queue.task_done()


def _render(bundle: Path) -> None:
    """``trainpatrol report BUNDLE`` in a child process; this thread only waits for it (without the GIL)."""
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a chatty child never blocks on it
        try:
            code = subprocess.run([sys.executable, "-m", "trainpatrol", "report", str(bundle)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors, close_fds=True,
                                  check=False).returncode
        except OSError as exc:
            log.warning("trainpatrol: report for %s not written: %s", bundle, exc)
            return
        if code != 0:
            errors.seek(max(0, errors.seek(0, 2) - 2000))
            last = errors.read().decode(errors="replace").strip().splitlines()[-1:]
            log.warning("trainpatrol: report for %s not written: %s", bundle, last[0] if last else f"exit {code}")
