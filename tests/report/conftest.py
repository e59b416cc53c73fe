"""Fixtures: the real evidence bundle of a NaN incident (see report_run.py), made once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from report_run import make_real_bundle


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_real_bundle(tmp_path_factory.mktemp("report-run"))


@pytest.fixture
def bundle_copy(real_bundle: Path, tmp_path: Path) -> Path:
    """A private copy of the real bundle, for tests that edit it."""
    target = tmp_path / real_bundle.name
    shutil.copytree(real_bundle, target)
    (target / "report.html").unlink(missing_ok=True)
    return target
