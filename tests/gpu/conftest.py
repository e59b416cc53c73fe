"""GPU tests: skipped without CUDA; run on the lent H200s (see docs/benchmarks.md for the record)."""

from __future__ import annotations

import os

import pytest
import torch

# cuBLAS needs this before its first handle for deterministic algorithms (bit-identical resume tests)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
