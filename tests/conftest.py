"""Shared fixtures. Real servers come from tests/servers.py; fakes stand in only for hardware."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "control"))

from servers import ALERTMANAGER, PROMETHEUS, PROMTOOL

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed")
needs_alertmanager = pytest.mark.skipif(ALERTMANAGER is None, reason="alertmanager binary not installed")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")


@pytest.fixture(autouse=True)
def _quiet_trainpatrol_logs() -> None:
    logging.getLogger("trainpatrol").setLevel(logging.ERROR)
