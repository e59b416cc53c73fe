"""Patrol's self-report on a GPU counts its host time as far as the device waited for the host: the share of
read-backs whose event had completed by the next step."""

from __future__ import annotations

from trainpatrol.probe.exposure import SAMPLES, Exposure


class Event:
    """A CUDA event as the exposure sees it (this machine has no GPU): done or not when queried."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_the_share_is_of_read_backs_the_device_had_finished_by_the_next_step() -> None:
    exposure = Exposure()
    assert exposure.share == 1.0  # nothing seen yet: all of it counts
    for done in (True, False, False, True):
        exposure.watch(Event(done))
        exposure.sample()
        exposure.sample()  # a step with no read-back queued since the last sample adds none
    assert exposure.share == 0.5


def test_the_share_is_over_the_recent_read_backs_only() -> None:
    exposure = Exposure()
    for done in [False] * SAMPLES + [True] * (SAMPLES - 1):
        exposure.watch(Event(done))
        exposure.sample()
    assert exposure.share == (SAMPLES - 1) / SAMPLES
