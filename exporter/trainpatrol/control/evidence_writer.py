"""Writes one rank's part of an evidence bundle, and on rank 0 its index (manifest and report).

The report page draws a timeline with matplotlib, which takes a second or more of Python: a thread hands the
bundles, one at a time and in order, to a child process (``trainpatrol report``), so neither the training
thread nor its GIL waits for them (``wait`` does, before a stop's exit). A report that fails is logged, never
raised.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .evidence import bundle_name, write_manifest, write_rank_part

log = logging.getLogger("trainpatrol")
REPORTS_WAITING = 4
"""Reports waiting to be rendered, at most: a close (which waits for them) stays short, and memory bounded."""


class EvidenceWriter:
    def __init__(self, directory: str | Path, rank: int, device: torch.device, *,
                 history: Callable[[], list[dict[str, Any]]], config: Callable[[], dict[str, Any]],
                 nvml: Callable[[], Any]) -> None:
        self._directory, self._rank, self._device = Path(directory), rank, device
        self._history, self._config, self._nvml = history, config, nvml
        self._queue: queue.Queue[Path] = queue.Queue(maxsize=REPORTS_WAITING)
        self._renderer: threading.Thread | None = None

    def bundle(self, clock: float, step: int, action: str) -> Path:
        return self._directory / bundle_name(clock, step, action)

    def part(self, bundle: Path, extra: dict[str, Any], nvml: Any = None) -> None:
        """This rank's part; ``nvml``: what to write instead of asking the agent."""
        write_rank_part(bundle, self._rank, history=self._history(), device=self._device,
                        nvml=self._nvml() if nvml is None else nvml, config=self._config(), extra=extra)

    def index(self, bundle: Path, manifest: dict[str, Any], trigger: dict[str, Any]) -> None:
        write_manifest(bundle, manifest, trigger)
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
