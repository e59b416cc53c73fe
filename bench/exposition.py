"""The /metrics body at 64 ranks, written by prometheus_client and by collectors.registry, in one
process: what a scrape costs apart from HTTP. Each rank's snapshot is a real Patrol's (bench/scrape.py),
moved as a second of training moves it between two bodies, so nothing is reused that a real scrape
could not reuse. Prints JSON: median milliseconds over ``--rounds`` of each part.

    python bench/exposition.py [--ranks 64] [--rounds 30]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

import scrape
from prometheus_client import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig
from trainpatrol.collectors.ranks import RankCollector
from trainpatrol.collectors.registry import text_format
from trainpatrol.protocol import RankSnapshot


class Families:
    def __init__(self, families: list[object]) -> None:
        self.families = families

    def collect(self) -> list[object]:
        return self.families


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    template = scrape.patrol_snapshot()
    agent = Agent(AgentConfig(nvml=False).load())
    sims = [scrape.RankSim(0, template, rank) for rank in range(args.ranks)]
    collector = RankCollector(agent.store)
    gc.freeze()  # as the agent's server does
    gc.set_threshold(10_000, 50, 100)
    times: dict[str, list[float]] = {"collect": [], "text_format": [], "generate_latest": [], "openmetrics": []}
    size = series = 0
    for _ in range(args.rounds):
        for sim in sims:
            agent.store.push(RankSnapshot.model_validate_json(sim.prepare(time.time())))
        started = time.perf_counter()
        families = Families(list(collector.collect()))
        times["collect"].append(time.perf_counter() - started)
        for name, write in (("text_format", lambda f: text_format(f.collect())), ("generate_latest", generate_latest),
                            ("openmetrics", openmetrics.generate_latest)):
            started = time.perf_counter()
            body = write(families)
            times[name].append(time.perf_counter() - started)
            if name == "text_format":
                size, series = len(body), sum(1 for line in body.splitlines() if not line.startswith(b"#"))
        assert text_format(families.collect()) == generate_latest(families)
    print(json.dumps({"bench": "exposition", "python": platform.python_version(), "ranks": args.ranks,
                      "series": series, "bytes": size, "rounds": args.rounds,
                      "median_ms": {k: round(statistics.median(v) * 1000, 2) for k, v in times.items()},
                      "p90_ms": {k: round(sorted(v)[int(len(v) * 0.9)] * 1000, 2) for k, v in times.items()}},
                     indent=2))


if __name__ == "__main__":
    main()
