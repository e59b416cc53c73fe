"""The host_memory_leak guard on scripted resident-set readings, one a second as the publisher takes them.

It must trip on steady growth that reaches the limit soon (the incident: 507 to 2,576 MiB in 35 s, then the
OOM killer) or on a resident set close to the limit, and stay quiet on a steady run with noise, on a run
whose memory grows once at the start and then stays, and on growth too slow to matter soon.
"""

from __future__ import annotations

import random

from trainpatrol.probe.guards import GuardConfig, Guards
from trainpatrol.probe.host_memory import HostMemory, HostMemoryReading

MIB = 2.0**20
GIB = 2.0**30


def reading(t: float, resident: float, limit: float, workers_growth: float = 0.0) -> HostMemoryReading:
    return HostMemoryReading(time=t, resident=resident, workers={}, workers_growth=workers_growth, limit=limit,
                             budget=limit)


def first_trip(series: list[tuple[float, float]], limit: float, config: GuardConfig | None = None) -> float | None:
    """The time of the first reading at which the guard trips, or None."""
    guards = Guards(config or GuardConfig(), clock=lambda: 0.0)
    for t, resident in series:
        if guards.check_host_memory(reading(t, resident, limit)):
            assert guards.active["host_memory_leak"] and guards.trips["host_memory_leak"] == 1
            return t
    return None


def test_the_incident_leak_trips_well_before_the_oom_killer() -> None:
    start, end, seconds = 507 * MIB, 2576 * MIB, 35
    series = [(float(t), start + (end - start) * t / seconds) for t in range(seconds + 1)]
    tripped = first_trip(series, limit=2600 * MIB)
    assert tripped is not None and tripped <= seconds - 15, tripped  # evidence with 15 s or more to spare


def test_a_steady_resident_set_with_noise_stays_quiet() -> None:
    rng = random.Random(0)
    series = [(float(t), 3 * GIB + rng.gauss(0, 20 * MIB)) for t in range(3600)]
    assert first_trip(series, limit=4 * GIB) is None


def test_memory_that_grows_once_at_the_start_then_stays_keeps_it_quiet() -> None:
    rng = random.Random(1)
    ramp = [(float(t), 500 * MIB + t * 150 * MIB) for t in range(8)]  # 1.2 GiB in 8 s: loading, workers
    plateau = [(float(t), 1700 * MIB + rng.gauss(0, 10 * MIB)) for t in range(8, 1800)]
    assert first_trip(ramp + plateau, limit=4 * GIB) is None


def test_a_second_step_up_later_in_the_run_keeps_it_quiet() -> None:
    """An evaluation or a checkpoint that takes memory once, in one step, is not a trend."""
    series = [(float(t), 2 * GIB + (600 * MIB if t >= 100 else 0.0)) for t in range(400)]
    assert first_trip(series, limit=4 * GIB) is None


def test_growth_that_reaches_the_limit_only_after_the_horizon_stays_quiet() -> None:
    series = [(float(t), 1 * GIB + t * 1 * MIB) for t in range(300)]  # 1 MiB/s, 60 GiB of headroom
    assert first_trip(series, limit=64 * GIB) is None


def test_a_slow_leak_trips_once_the_limit_comes_within_the_horizon() -> None:
    config = GuardConfig(host_memory_horizon_seconds=600.0)
    series = [(float(t), 1 * GIB + t * 4 * MIB) for t in range(1200)]  # 4 MiB/s toward 4 GiB
    tripped = first_trip(series, limit=4 * GIB, config=config)
    eta = (3 * GIB / (4 * MIB))  # seconds until the limit
    assert tripped is not None and eta - 600 - 2 <= tripped <= eta - 590, (tripped, eta)


def test_a_resident_set_close_to_the_limit_trips_without_a_trend() -> None:
    series = [(float(t), 3.5 * GIB) for t in range(3)] + [(3.0, 3.7 * GIB)]
    assert first_trip(series, limit=4 * GIB) == 3.0  # over 0.9 of the limit


def test_the_guard_trips_once_per_episode_and_clears_when_the_growth_stops() -> None:
    guards = Guards(GuardConfig(), clock=lambda: 0.0)
    trips = 0
    for t in range(60):
        trips += len(guards.check_host_memory(reading(float(t), 1 * GIB + t * 50 * MIB, 8 * GIB)))
    assert trips == 1 and guards.active["host_memory_leak"]
    for t in range(60, 200):  # it stops growing: the trend flattens within the window
        guards.check_host_memory(reading(float(t), 1 * GIB + 59 * 50 * MIB, 8 * GIB))
    assert not guards.active["host_memory_leak"] and guards.trips["host_memory_leak"] == 1


def test_workers_count_by_their_growth_not_by_the_pages_they_share_with_the_rank() -> None:
    """A forked worker's resident set counts every page it shares with the rank; what it adds is its growth."""
    rss = {0: 2 * GIB, 201: 2 * GIB, 202: 2 * GIB}  # 0: the rank itself
    host = HostMemory(limit_override=16 * GIB, read_resident=lambda pid: rss.get(pid or 0), read_limit=lambda: None)
    first = host.read([201, 202], now=0.0)
    assert first is not None and first.workers == {0: 2 * GIB, 1: 2 * GIB} and first.judged == 2 * GIB
    rss[202] = 2 * GIB + 300 * MIB
    again = host.read([201, 202], now=1.0)
    assert again is not None and again.judged == 2 * GIB + 300 * MIB
    rss[203] = 2 * GIB + 10 * MIB  # a new epoch's worker (new pid) starts from its own first reading
    fresh = host.read([201, 203], now=2.0)
    assert fresh is not None and fresh.workers == {0: 2 * GIB, 1: 2 * GIB + 10 * MIB}
    assert fresh.judged == 2 * GIB


def test_pushes_ten_times_a_second_judge_the_same_trend() -> None:
    """The trend keeps readings half a second apart, so short push intervals cost no more and judge alike."""
    start, end, seconds = 507 * MIB, 2576 * MIB, 35
    series = [(t / 10, start + (end - start) * t / 10 / seconds) for t in range(10 * seconds + 1)]
    guards = Guards(GuardConfig(), clock=lambda: 0.0)
    tripped = next((t for t, v in series if guards.check_host_memory(reading(t, v, 2600 * MIB))), None)
    assert tripped is not None and 15.0 <= tripped <= 16.0, tripped
    assert len(guards._host_trend.points) <= 2 * 30 + 1


def test_a_leak_that_pauses_and_grows_again_trips_once_until_the_memory_is_freed() -> None:
    """A loaded machine slows the leaking loop for a while: the growth pauses and resumes, the same leak. The
    guard trips (and captures) once; only memory given back below the level it tripped at re-arms it."""
    guards = Guards(GuardConfig(), clock=lambda: 0.0)
    limit, level, t = 4 * GIB, 1 * GIB, 0.0
    trips = []
    for rate, seconds in ((20 * MIB, 30), (0.0, 20), (20 * MIB, 30), (-60 * MIB, 20), (20 * MIB, 30)):
        for _ in range(seconds):
            t, level = t + 1, level + rate
            if guards.check_host_memory(reading(t, level, limit)):
                trips.append(t)
    assert len(trips) == 2 and trips[0] < 30 and trips[1] > 100, trips  # the leak, then after the memory fell
