"""The evidence report: ``<bundle>/report.html``, one self-contained page per incident.

It shows what happened, every rank's recent history on one step axis, the GPU readings, the
allocator, the stacks, the DataLoader audit and what to do next (from docs/runbooks.md). Plots need
matplotlib (the ``report`` extra); ``trainpatrol report DIR`` regenerates the page.
"""

from __future__ import annotations

from .page import REPORT_NAME, write_report

__all__ = ["REPORT_NAME", "write_report"]
