"""The checkpoint's finiteness check names every non-finite tensor whatever its dtype, and passes over empty ones
(an FSDP rank may hold no shard of a small tensor)."""

from __future__ import annotations

import math

import torch

from trainpatrol.control.checkpoint import nonfinite_entries


def test_every_nonfinite_tensor_is_named_across_dtypes_and_empty_ones_pass() -> None:
    ones = torch.ones(3)
    state = {
        "model": {"w": ones.clone(), "inf": torch.tensor([1.0, math.inf]),
                  "half": torch.tensor([math.nan, 1.0]).bfloat16(), "empty": torch.empty(0),
                  "steps": torch.tensor([7]), "cplx": torch.tensor([1 + 1j, complex(0, math.inf)])},
        "optimizer": {"state": {0: {"exp_avg": torch.tensor([-math.inf]), "exp_avg_sq": ones.double()}}},
    }
    assert sorted(nonfinite_entries(state)) == ["model:cplx", "model:half", "model:inf", "optimizer:state.0.exp_avg"]
    assert nonfinite_entries({"model": {"w": ones, "empty": torch.empty(0, 4)}, "optimizer": {}}) == []
