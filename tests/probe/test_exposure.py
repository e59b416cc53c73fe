"""Patrol's self-report on a GPU counts its host time as far as the device waited for the host: the share of
sampled steps in which the device ran out of queued work while Patrol's code ran."""

from __future__ import annotations

from trainpatrol.probe.exposure import SAMPLES, Exposure


class Device:
    """A device queue as the exposure sees it (this machine has no GPU): each ``record`` queues the event behind the
    work queued so far; ``drains`` says, sample by sample, whether the device finished that work by the query."""

    def __init__(self) -> None:
        self.made = 0
        self.recorded = 0
        self.drains: list[bool] = []

    def new_event(self) -> Device:
        self.made += 1
        return self

    def record(self) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.drains.pop(0)


def run(exposure: Exposure, device: Device, drained: list[bool], steps_per_readback: int = 3) -> None:
    """Steps as the recorder runs them: a read-back every few steps makes the next step a sample."""
    for drain in drained:
        device.drains.append(drain)
        exposure.due()
        for _ in range(steps_per_readback):
            exposure.begin()
            exposure.end()


def test_the_share_is_of_sampled_steps_whose_device_finished_its_queue_while_patrol_ran() -> None:
    device = Device()
    exposure = Exposure(device.new_event)
    assert exposure.share == 1.0  # nothing seen yet: all of it counts
    run(exposure, device, [True, False, False, True])
    assert exposure.share == 0.5
    assert device.recorded == 4  # one sample a read-back, not one a step
    assert device.made == 1  # one event, recorded again for each sample


def test_a_step_with_no_read_back_since_the_last_sample_records_and_queries_nothing() -> None:
    device = Device()
    exposure = Exposure(device.new_event)
    exposure.begin()
    exposure.end()
    assert (device.made, device.recorded, exposure.share) == (0, 0, 1.0)


def test_the_share_is_over_the_recent_samples_only() -> None:
    device = Device()
    exposure = Exposure(device.new_event)
    run(exposure, device, [False] * SAMPLES + [True] * (SAMPLES - 1), steps_per_readback=1)
    assert exposure.share == (SAMPLES - 1) / SAMPLES
