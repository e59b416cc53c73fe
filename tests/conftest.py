"""Shared fixtures. Real servers come from tests/servers.py; fakes stand in only for hardware."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "control"))

from servers import ALERTMANAGER, PROMETHEUS, PROMTOOL

# The machine running the tests (a CI pod, say) is not the workload under test: its own Kubernetes
# identity must not land on the series that tests compare; tests of the identity set it themselves.
os.environ["TRAINPATROL_KUBERNETES"] = "0"
for _key in ("NAMESPACE", "POD", "CONTAINER", "NODE", "LAUNCHER", "LAUNCHER_JOB"):
    os.environ.pop(f"TRAINPATROL_{_key}", None)
for _key in ("SLURM_JOB_ID", "JOBSET_NAME", "PYTORCHJOB_NAME", "TORCHELASTIC_RUN_ID"):
    os.environ.pop(_key, None)

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed")
needs_alertmanager = pytest.mark.skipif(ALERTMANAGER is None, reason="alertmanager binary not installed")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")


@pytest.fixture(autouse=True)
def _quiet_trainpatrol_logs() -> None:
    logging.getLogger("trainpatrol").setLevel(logging.ERROR)
