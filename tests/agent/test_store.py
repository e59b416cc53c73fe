"""The rank store: one record per rank, written by whole pushes and delta lines, never by a push
it refuses; ranks expire, and go down with the clock."""

from __future__ import annotations

from typing import Any

import pytest

from exposition_check import value
from fake_clock import T0, Clock
from trainpatrol.agent.bounds import Bounds, Refused
from trainpatrol.agent.store import NeedsWholeSnapshot, RankStore, StreamWrite, WrongRunKey
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.protocol import RankSnapshot, SnapshotDelta

UP_TTL, EXPIRE = 15.0, 600.0


def snap(rank: int = 0, loss: float = 1.5, step: int = 5, **extra: Any) -> RankSnapshot:
    return RankSnapshot.model_validate({
        "run": "r1", "rank": rank, "world_size": 4, "step": step, "instance": "a" * 16, **extra,
        "samples": [{"name": "trainpatrol_step_total", "value": float(step)},
                    {"name": "trainpatrol_loss", "value": loss},
                    {"name": "trainpatrol_guard_trips_total", "labels": {"guard": "nan"}, "value": 0.0}]})


def delta(changed: list[tuple[int, float]], rank: int = 0, **extra: Any) -> SnapshotDelta:
    return SnapshotDelta.model_validate({"run": "r1", "rank": rank, "world_size": 4, "step": 6,
                                         "instance": "a" * 16, "changed": changed, **extra})


def body(store: RankStore) -> bytes:
    return RankCollector(store).write()


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


def test_a_delta_line_assigns_the_slots_it_names_onto_the_streams_last_write() -> None:
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(loss=1.5, step=5), line=first)
    line = StreamWrite([(1, 0.25), (2, 3)], first.written)
    store.push(delta([(1, 0.25), (2, 3)]), line=line)
    assert first.written is not None and first.written.write.values == ["5.0", "1.5", "0.0"]  # as it was written
    assert line.written is not None and line.written.write.values == ["5.0", "0.25", "3.0"]
    text = body(store)
    labels = {"run": "r1", "rank": "0"}
    assert value(text, "trainpatrol_loss", labels) == 0.25
    assert value(text, "trainpatrol_step_total", labels) == 5.0  # not named: as the whole snapshot had it
    assert value(text, "trainpatrol_guard_trips_total", {**labels, "guard": "nan"}) == 3.0
    assert store.entries()[0].snapshot.step == 6  # every other field travels whole


def test_a_delta_builds_on_its_own_streams_last_line_whatever_was_pushed_in_between() -> None:
    """A Patrol's state change goes out as a single push; its stream's next delta names only what
    moved since the stream's last line, so the values it leaves out are that line's, not the push's."""
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(loss=1.5, step=5), line=first)
    store.push(snap(loss=1.0, step=5), key_digest=b"")  # off the stream: the loss moved and moves back
    store.push(delta([(0, 6.0)]), line=StreamWrite([(0, 6.0)], first.written))
    assert (loss(store), value(body(store), "trainpatrol_step_total", {"run": "r1", "rank": "0"})) == (1.5, 6.0)


def test_a_delta_applies_after_pushes_of_other_series_in_between_once_the_series_are_back() -> None:
    """A pause and a resume between two stream lines: the single pushes carry other series (the
    rank's state) and then the stream's own again, so its next delta still builds on its last line."""
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(loss=1.5, step=5), line=first)
    store.push(RankSnapshot.model_validate({"run": "r1", "rank": 0, "world_size": 4, "instance": "a" * 16,
                                            "samples": [{"name": "trainpatrol_loss", "value": 1.0}]}))
    store.push(snap(loss=1.0, step=5))
    line = StreamWrite([(0, 6.0)], first.written)
    store.push(delta([(0, 6.0)]), line=line)
    assert line.written is not None and line.written.write.values == ["6.0", "1.5", "0.0"]
    assert loss(store) == 1.5


@pytest.mark.parametrize("case", ["no base", "another instance", "index outside"])
def test_a_delta_without_its_base_is_refused_and_changes_nothing(case: str) -> None:
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(loss=1.5), line=first)
    changed = [(3, 9.0)] if case == "index outside" else [(1, 9.0)]
    line = StreamWrite(changed, None if case == "no base" else first.written)
    before = body(store)
    with pytest.raises(NeedsWholeSnapshot, match="outside the 3 samples" if case == "index outside"
                       else "needs a whole snapshot of run 'r1' rank 0 earlier on the same stream; send one"):
        store.push(delta(changed, instance="b" * 16 if case == "another instance" else "a" * 16), line=line)
    assert line.written is None and body(store) == before


def histogram(count: float, total: float) -> dict[str, Any]:
    """``count`` steps, all in the 25-50 ms bucket, taking ``total`` seconds."""
    return {"counts": [0.0] * 5 + [count] * 11, "sum": total}


def test_a_delta_line_writes_its_histogram_in_place_of_the_bases() -> None:
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(histogram=histogram(5, 0.2)), line=first)
    store.push(delta([(1, 0.25)], histogram=histogram(9, 0.36)), line=StreamWrite([(1, 0.25)], first.written))
    text, labels = body(store), {"run": "r1", "rank": "0"}
    assert (value(text, "trainpatrol_step_duration_seconds_count", labels),
            value(text, "trainpatrol_step_duration_seconds_sum", labels),
            value(text, "trainpatrol_step_duration_seconds_bucket", {**labels, "le": "0.05"}),
            value(text, "trainpatrol_step_duration_seconds_bucket", {**labels, "le": "0.025"}),
            value(text, "trainpatrol_loss", labels)) == (9.0, 0.36, 9.0, 0.0, 0.25)


@pytest.mark.parametrize("base_has_one", [True, False])
def test_a_delta_line_that_adds_or_drops_the_histogram_is_refused_and_changes_nothing(base_has_one: bool) -> None:
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(**({"histogram": histogram(5, 0.2)} if base_has_one else {})), line=first)
    before = body(store)
    line = StreamWrite([(1, 0.25)], first.written)
    with pytest.raises(NeedsWholeSnapshot, match="step histogram needs a whole snapshot of run 'r1' rank 0"):
        store.push(delta([(1, 0.25)], **({} if base_has_one else {"histogram": histogram(9, 0.36)})), line=line)
    assert line.written is None and body(store) == before


def test_a_stream_line_kept_out_as_late_is_still_the_base_of_that_streams_next_delta() -> None:
    """A state change's single push overtakes a stream line still waiting for its batch: the store
    keeps the newer push, and the stream's next delta names only what moved since the late line."""
    store = RankStore(clock=Clock())
    first = StreamWrite(None, None)
    store.push(snap(loss=1.5, step=5, seq=5), line=first)
    store.push(snap(loss=0.9, step=7, seq=7))
    late = StreamWrite([(1, 1.0), (0, 6.0)], first.written)
    assert store.push(delta([(1, 1.0), (0, 6.0)], seq=6), line=late) == []
    assert loss(store) == 0.9  # the newer push stands
    store.push(delta([(0, 8.0)], seq=8), line=StreamWrite([(0, 8.0)], late.written))
    assert (loss(store), value(body(store), "trainpatrol_step_total", {"run": "r1", "rank": "0"})) == (1.0, 8.0)


def test_refused_pushes_leave_the_record_as_it_was() -> None:
    clock = Clock()
    store = RankStore(clock=clock, bounds=Bounds(max_series=4))
    store.push(snap(loss=1.5, step=5, seq=5), key_digest=b"k1")
    before = body(store)
    line = StreamWrite(None, None)
    assert store.push(snap(loss=9.0, step=4, seq=4), key_digest=b"k1", line=line) == []  # late, reordered
    assert line.written is not None and line.written.write.values == ["4.0", "9.0", "0.0"]  # its stream's base
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
