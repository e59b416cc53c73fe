"""Shared fixtures. Real servers come from tests/servers.py; fakes stand in only for hardware."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

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


# `make test` runs the suite on parallel workers (pytest-xdist, `-n 4 --dist loadfile`): most of it waits on
# processes and sockets, so more workers than the 2 cores pay. The scheduler below makes each test file one unit
# of work, so its module fixtures (the image build, the install venvs, a live Prometheus) are made once; files
# that share a session fixture are one unit; and the longest units start first. Every test takes free ports
# (the kernel's ephemeral range) but `make demo-stack`, whose preferred ports 9402, 9090 and 9093 lie outside it
# and whose two tests are in one file, so no two units contend for a port.
TESTS = Path(__file__).resolve().parent
SHARED_UNITS = {
    # the real NaN run behind the report tests is a session fixture: made once, on one worker
    "report/": "report",
}
LONGEST_FIRST = [  # measured on the 2-core machine, longest first; the units not listed follow in collection order
    "integration/test_make_demo_stack.py",
    "test_install.py",
    "image/test_agent_image.py",
    "control/test_ddp_same_step.py",
    "integration/test_demo_stack.py",  # not among the first three: their pip installs and image build hog the CPU
    "dashboards/test_dashboards.py",
    "control/test_lockstep_straggler.py",
    "control/test_hang_forensics.py",
    "integration/test_remote_write.py",
    "integration/test_control_across_agents.py",
    "probe/test_host_memory.py",
    "probe/test_embedded_agent.py",
    "alerting/test_rules.py",
    "helm/test_chart.py",
    "integrations/test_huggingface.py",
    "integrations/test_lightning.py",
    "integration/test_alert_loop.py",
    "control/test_ddp_restore.py",
    "agent/test_openapi_fuzz.py",
    "integration/test_rank_down_alert.py",
    "test_demo.py",
    "report",
    "control/test_loop_without_loader.py",
]


def unit_of(path: str) -> str:
    """The unit of work of the test file at ``path`` (relative to tests/)."""
    return next((unit for prefix, unit in SHARED_UNITS.items() if path.startswith(prefix)), path)


def _unit(item: pytest.Item) -> str:
    return unit_of(Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: the items of one file stay together and in order, so module fixtures are still made once
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """For ``--dist loadfile``: xdist's own per-file scheduling, with the shared units above, in collection order.

    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8 renames the node
    ids it groups by in a way pytest 9.2 no longer reads, so its groups are silently ignored.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rootdir = Path(str(config.rootpath)).resolve()
    prefix = TESTS.relative_to(rootdir).as_posix() + "/"

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::", 1)[0].removeprefix(prefix))

    config.option.loadscopereorder = False  # keep the longest-first order of the collection
    return FileUnits(config, log)


@pytest.fixture(autouse=True)
def _quiet_trainpatrol_logs() -> None:
    logging.getLogger("trainpatrol").setLevel(logging.ERROR)
