"""The NVML test double: ``fake.FakeNvml`` serving ``nvml_h200.json``, readings recorded on a real H200."""

from pathlib import Path

FIXTURE = Path(__file__).parent / "nvml_h200.json"
"""What ``--nvml-fake`` takes: the agent loads ``fake.py`` from beside it."""
