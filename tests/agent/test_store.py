"""The rank store: one record per rank, written by its pushes, never by a push it refuses; ranks
expire, and go down with the clock."""

from __future__ import annotations

from typing import Any

import pytest

from exposition_check import text, value
from fake_clock import T0, Clock
from trainpatrol.agent.limits import Bounds, Refused
from trainpatrol.agent.store import RankStore, WrongRunKey
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.protocol import RankSnapshot

UP_TTL, EXPIRE = 15.0, 600.0


def snap(rank: int = 0, loss: float = 1.5, step: int = 5, **extra: Any) -> RankSnapshot:
    return RankSnapshot.model_validate({
        "run": "r1", "rank": rank, "world_size": 4, "step": step, "instance": "a" * 16, **extra,
        "samples": [{"name": "trainpatrol_step_total", "value": float(step)},
                    {"name": "trainpatrol_loss", "value": loss},
                    {"name": "trainpatrol_guard_trips_total", "labels": {"guard": "nan"}, "value": 0.0}]})


def body(store: RankStore) -> bytes:
    return text(RankCollector(store))


def loss(store: RankStore, rank: int = 0) -> float | None:
    return value(body(store), "trainpatrol_loss", {"run": "r1", "rank": str(rank)})


def test_a_whole_push_replaces_every_value() -> None:
    store = RankStore(clock=Clock())
    store.push(snap(loss=1.5, step=5))
    store.push(snap(loss=0.5, step=9))
    text = body(store)
    assert (value(text, "trainpatrol_loss", {"run": "r1", "rank": "0"}),
            value(text, "trainpatrol_step_total", {"run": "r1", "rank": "0"})) == (0.5, 9.0)


def test_a_push_of_other_series_is_written_with_its_own_series_only() -> None:
    store = RankStore(clock=Clock())
    store.push(snap())
    store.push(RankSnapshot.model_validate({"run": "r1", "rank": 0, "world_size": 4, "instance": "a" * 16,
                                            "samples": [{"name": "trainpatrol_grad_norm", "value": 2.0}]}))
    text = body(store)
    assert value(text, "trainpatrol_grad_norm", {"run": "r1", "rank": "0"}) == 2.0
    assert value(text, "trainpatrol_loss", {"run": "r1", "rank": "0"}) is None


def test_refused_pushes_leave_the_record_as_it_was() -> None:
    clock = Clock()
    store = RankStore(clock=clock, bounds=Bounds(max_series=4))
    store.push(snap(loss=1.5, step=5, seq=5), key_digest=b"k1")
    before = body(store)
    assert store.push(snap(loss=9.0, step=4, seq=4), key_digest=b"k1") == []  # late, reordered
    with pytest.raises(WrongRunKey):
        store.push(snap(loss=8.0, seq=6), key_digest=b"k2")
    with pytest.raises(Refused):  # a new rank would bring the agent to 6 series
        store.push(snap(rank=1, loss=7.0, seq=6), key_digest=b"k1")
    assert body(store) == before
    assert loss(store) == 1.5


def test_ranks_expire_after_their_ttl_and_a_newcomer_at_their_place_is_written() -> None:
    clock = Clock()
    store = RankStore(UP_TTL, EXPIRE, clock=clock)
    store.push(snap(0))
    store.push(snap(1))
    clock.now = T0 + EXPIRE / 2
    store.push(snap(0, loss=0.5))
    clock.now = T0 + EXPIRE + 0.001
    assert (loss(store, 0), loss(store, 1)) == (0.5, None)
    store.push(snap(2, loss=0.75))
    assert (loss(store, 0), loss(store, 1), loss(store, 2)) == (0.5, None, 0.75)
    clock.now = T0 + EXPIRE + 0.001 + EXPIRE + 1
    assert [ln for ln in body(store).splitlines() if not ln.startswith(b"#")] == []


def test_up_flips_with_the_clock_and_back_with_a_push() -> None:
    clock = Clock()
    store = RankStore(UP_TTL, EXPIRE, clock=clock)
    store.push(snap(0))
    clock.now = T0 + 5
    store.push(snap(1))
    version = store.state()[0]
    assert store.state() == (version, (True, True))
    clock.now = T0 + UP_TTL  # the TTL itself still counts as up
    assert store.state() == (version, (True, True))
    clock.now = T0 + UP_TTL + 0.001
    assert store.state() == (version, (False, True))
    assert value(body(store), "trainpatrol_rank_up", {"run": "r1", "rank": "0"}) == 0.0
    store.push(snap(0))
    assert store.state()[1] == (True, True)
    assert value(body(store), "trainpatrol_rank_up", {"run": "r1", "rank": "0"}) == 1.0
