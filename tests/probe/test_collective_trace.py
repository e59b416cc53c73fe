"""The collective trace of a stall capture: the rank behind in its collectives is named, and Patrol sizes the Flight
Recorder only where the user did not."""

from __future__ import annotations

import os

import pytest

from trainpatrol.probe.collective_trace import behind_ranks, collective_trace, enable_flight_recorder


def trace(**last: int) -> dict[str, object]:
    return {"available": True, "last": {group: {"seq": seq, "op": "gloo:all_reduce", "state": "started"}
                                        for group, seq in last.items()}}


def test_the_rank_whose_newest_collective_is_older_than_the_others_is_behind() -> None:
    assert behind_ranks({0: trace(g0=31), 1: trace(g0=31), 2: trace(g0=30), 3: trace(g0=31)}) == [2]
    assert behind_ranks({0: trace(g0=31), 1: trace(g0=31)}) == []
    # each group on its own: a rank outside a subgroup is not behind in it
    assert behind_ranks({0: trace(g0=5, g1=9), 1: trace(g0=5), 2: trace(g0=5, g1=8)}) == [2]


def test_without_a_process_group_the_trace_says_why() -> None:
    assert collective_trace() == {"available": False, "reason": "no process group"}


def test_the_flight_recorder_is_sized_only_where_the_user_did_not(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    enable_flight_recorder()
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the user turned it off: it stays off
    enable_flight_recorder()
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ and os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
