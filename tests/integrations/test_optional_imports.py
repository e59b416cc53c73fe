"""Issue 9: importing trainpatrol, its Patrol and its integrations package never imports transformers or lightning."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import trainpatrol, trainpatrol.integrations
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.agent.app import Agent
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "lightning", "pytorch_lightning",
                                                              "accelerate"))
assert not heavy, heavy
"""


def test_trainpatrol_imports_without_the_frameworks() -> None:
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
