"""Writes one rank's part of an evidence bundle, and on rank 0 its index (manifest and report).

The report page draws a timeline with matplotlib, which takes a second or more: it is rendered on a thread
of its own, one at a time, so the training loop does not wait for it (``wait`` does, before a stop's exit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..report import write_report_quietly
from .evidence import bundle_name, write_manifest, write_rank_part


class EvidenceWriter:
    def __init__(self, directory: str | Path, rank: int, device: torch.device, *,
                 history: Callable[[], list[dict[str, Any]]], config: Callable[[], dict[str, Any]],
                 nvml: Callable[[], Any]) -> None:
        self._directory, self._rank, self._device = Path(directory), rank, device
        self._history, self._config, self._nvml = history, config, nvml
        self._report: threading.Thread | None = None

    def bundle(self, clock: float, step: int, action: str) -> Path:
        return self._directory / bundle_name(clock, step, action)

    def part(self, bundle: Path, extra: dict[str, Any], nvml: Any = None) -> None:
        """This rank's part; ``nvml``: what to write instead of asking the agent."""
        write_rank_part(bundle, self._rank, history=self._history(), device=self._device,
                        nvml=self._nvml() if nvml is None else nvml, config=self._config(), extra=extra)

    def index(self, bundle: Path, manifest: dict[str, Any], trigger: dict[str, Any]) -> None:
        write_manifest(bundle, manifest, trigger)
        self.wait()
        self._report = threading.Thread(target=write_report_quietly, args=(bundle,), name="trainpatrol-report",
                                        daemon=True)
        self._report.start()

    def wait(self) -> None:
        """Until the report being rendered is written."""
        if self._report is not None:
            self._report.join()
            self._report = None
