"""The report's "what next" comes from the runbooks the package ships, named as such, not by a path on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from servers import REPO
from trainpatrol import __version__
from trainpatrol.report import write_report


def test_the_report_reads_the_packaged_runbooks_and_names_no_checkout_path(
        bundle_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINPATROL_RUNBOOKS", raising=False)
    monkeypatch.chdir(tmp_path)
    page = write_report(bundle_copy).read_text()
    next_steps = page[page.index('<section id="next">'):page.index('<section id="timeline">')]
    # the NaN's loss or grad guard names the section, whichever tripped first on the rank that wrote the bundle
    assert (f"From the runbooks of trainpatrol {__version__} (docs/runbooks.md), section “TrainPatrolNonFinite"
            in next_steps), next_steps
    assert str(REPO) not in next_steps
