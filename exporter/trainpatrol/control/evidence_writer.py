"""Writes one rank's part of an evidence bundle, and on rank 0 its index (manifest and report).

The report page draws a timeline with matplotlib, which takes a second or more of Python: it is rendered
by a child process (``trainpatrol report``), one at a time, so neither the training thread nor its GIL
waits for it (``wait`` does, before a stop's exit). A report that fails is logged, never raised.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from .evidence import bundle_name, write_manifest, write_rank_part

log = logging.getLogger("trainpatrol")


class EvidenceWriter:
    def __init__(self, directory: str | Path, rank: int, device: torch.device, *,
                 history: Callable[[], list[dict[str, Any]]], config: Callable[[], dict[str, Any]],
                 nvml: Callable[[], Any]) -> None:
        self._directory, self._rank, self._device = Path(directory), rank, device
        self._history, self._config, self._nvml = history, config, nvml
        self._report: tuple[Path, subprocess.Popen[bytes], IO[bytes]] | None = None

    def bundle(self, clock: float, step: int, action: str) -> Path:
        return self._directory / bundle_name(clock, step, action)

    def part(self, bundle: Path, extra: dict[str, Any], nvml: Any = None) -> None:
        """This rank's part; ``nvml``: what to write instead of asking the agent."""
        write_rank_part(bundle, self._rank, history=self._history(), device=self._device,
                        nvml=self._nvml() if nvml is None else nvml, config=self._config(), extra=extra)

    def index(self, bundle: Path, manifest: dict[str, Any], trigger: dict[str, Any]) -> None:
        write_manifest(bundle, manifest, trigger)
        self.wait()
        errors = tempfile.TemporaryFile()  # noqa: SIM115 -- kept until wait(); a file, so a chatty child never blocks
        try:
            renderer = subprocess.Popen([sys.executable, "-m", "trainpatrol", "report", str(bundle)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
                                        close_fds=True)
        except OSError as exc:
            errors.close()
            log.warning("trainpatrol: report for %s not written: %s", bundle, exc)
            return
        self._report = (bundle, renderer, errors)

    def wait(self) -> None:
        """Until the report being rendered is written."""
        if self._report is None:
            return
        (bundle, renderer, errors), self._report = self._report, None
        with errors:
            if renderer.wait() != 0:
                errors.seek(max(0, errors.seek(0, 2) - 2000))
                last = errors.read().decode(errors="replace").strip().splitlines()[-1:]
                log.warning("trainpatrol: report for %s not written: %s", bundle,
                            last[0] if last else f"exit {renderer.returncode}")
