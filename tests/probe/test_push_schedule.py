"""Patrol's periodic pushes fall on whole multiples of the interval, so the ranks of a node push together."""

from __future__ import annotations

import time

import pytest

from trainpatrol.probe.publisher import Publisher, next_push_delay


@pytest.mark.parametrize(("interval", "now", "delay"), [
    (1.0, 1000.25, 0.75),
    (1.0, 1000.0, 1.0),
    (1.0, 1000.95, 1.05),  # 0.05 s to the next second is under a tenth: the one after
    (1.0, 1000.9, 0.1),  # exactly a tenth is kept (within rounding)
    (0.5, 10.3, 0.2),
    (5.0, 12.0, 3.0),
])
def test_next_push_delay(interval: float, now: float, delay: float) -> None:
    assert next_push_delay(interval, now) == pytest.approx(delay, abs=1e-9)


def test_periodic_pushes_wait_for_the_grid_and_failures_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    pub = Publisher("http://127.0.0.1:9", dict, lambda c: None, interval=0.5, max_backoff=1.5)
    outcomes = iter([True, True, False, False, False, True])
    waits: list[tuple[float, float]] = []

    class Wake:
        """The publisher's wake-up event, recording each wait instead of waiting."""

        def wait(self, seconds: float) -> bool:
            waits.append((time.time(), seconds))
            if len(waits) == 6:
                pub._stop.set()
            return False

        def clear(self) -> None:
            pass

        def set(self) -> None:
            pass

    monkeypatch.setattr(pub, "push_now", lambda: next(outcomes))
    monkeypatch.setattr(pub, "_wake", Wake())
    pub._loop()
    grid = [(at + seconds) / 0.5 for at, seconds in (waits[0], waits[1], waits[5])]
    assert all(abs(g - round(g)) < 1e-3 for g in grid), grid  # after a push: the next multiple of 0.5 s
    assert [seconds for _, seconds in waits[2:5]] == [1.0, 1.5, 1.5]  # after a failure: backoff, capped
    pub.stop(final_push=False)
