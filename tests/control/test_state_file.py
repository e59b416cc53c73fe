"""The replicated state's file: what goes in comes back exactly, and a damaged file is refused by name."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from trainpatrol.control import checkpoint as ckpt
from trainpatrol.control import state_file


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def a_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "odd": [torch.tensor(3.5), (torch.zeros(0, 3), "text"), torch.randn(5, dtype=torch.bfloat16),
                    torch.tensor([True, False]), torch.randn(6, 4).t(), torch.arange(7, dtype=torch.int64)[::2]],
            "ordered": collections.OrderedDict(b=torch.ones(2, dtype=torch.float16), a=None), "step": 12}


def test_every_tensor_and_value_comes_back_exactly(tmp_path: Path) -> None:
    state = a_state()
    ckpt.write_state(tmp_path, state)
    back = state_file.read(tmp_path / state_file.NAME)
    assert same(state, back)
    assert back["odd"][4].is_contiguous()  # a transposed tensor is written in its logical order


def test_a_file_cut_short_is_refused_with_what_is_missing(tmp_path: Path) -> None:
    ckpt.write_state(tmp_path, a_state())
    path = tmp_path / state_file.NAME
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"state.bin' is cut short: \d+ of \d+ bytes of tensor data"):
        state_file.read(path)


def test_a_file_that_is_not_a_state_file_is_refused(tmp_path: Path) -> None:
    torch.save({"x": torch.ones(1)}, tmp_path / "state.bin")
    with pytest.raises(ValueError, match="is not a trainpatrol state file"):
        state_file.read(tmp_path / "state.bin")


def test_a_checkpoint_of_an_earlier_version_with_state_pt_still_loads(tmp_path: Path) -> None:
    state = a_state()
    torch.save(state, tmp_path / "state.pt")
    (tmp_path / "meta.json").write_text('{"step": 3, "world_size": 1}')
    meta, replicated, _ = ckpt.load(tmp_path, 0)
    assert meta["step"] == 3 and same(state, replicated)
