"""A DataLoader worker forked after a Patrol was dropped never frees the Patrol's objects: on a GPU, a CUDA call in
a forked worker (an event destroyed, pinned memory freed) aborts it."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from resume_loops import config

from trainpatrol import Patrol


class _Freed:
    """A reference cycle that records which process freed it."""

    def __init__(self, record: Path) -> None:
        self.record = record
        self.cycle = self

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


class _CollectsInTheWorker(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


@pytest.mark.parametrize("parent_froze_objects", [False, True])
def test_a_forked_dataloader_worker_never_frees_the_garbage_its_parent_left(tmp_path: Path,
                                                                            parent_froze_objects: bool) -> None:
    record = tmp_path / "freed-by"
    if parent_froze_objects:  # as some Python builds do at startup
        gc.freeze()
    patrol = Patrol(config=config(tmp_path, "forks"), device="cpu")
    patrol.close()
    gc.disable()  # the cycle stays garbage until the worker forks
    try:
        _Freed(record)
        loader = torch.utils.data.DataLoader(_CollectsInTheWorker(), batch_size=2, num_workers=1,
                                             multiprocessing_context="fork")
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    finally:
        gc.enable()
        gc.unfreeze()
    gc.collect()
    assert record.read_text().split() == [str(os.getpid())]
