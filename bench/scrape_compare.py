"""bench/scrape.py on two source trees side by side, in one run on one host: each load (pushing
ranks, seconds between scrapes) runs on every tree in turn, ``--rounds`` times, before the next load,
so that both see the same machine in the same minutes. Prints one JSON document:

    python bench/scrape_compare.py --tree before=/path/to/old/checkout --tree after=. \
        [--load 8x15,64x5] [--seconds 60] [--rounds 2] [--hostile 0]

A tree is a checkout root holding ``bench/scrape.py`` and ``exporter/``; each runs its own bench
against its own package (and its own rank transport), so a tree from before a change is measured as
it was. A bench from before ``--load`` is given ``--ranks`` and ``--scrape-hz``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_KEPT = ("ranks", "transport", "cpu_core_share", "scrape_ms_p50", "scrape_ms_p99", "rss_mb_peak",
         "scrape_ms_max", "exposition_bytes", "scrapes", "pushes_per_second", "push_errors", "hostile_answers")


def run_tree(root: Path, ranks: int, every: float, seconds: float, hostile: float) -> dict[str, Any]:
    """One load on ``root``'s own bench/scrape.py, with ``root``'s package first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "exporter"), os.environ.get("PYTHONPATH", "")])}
    bench = root / "bench" / "scrape.py"
    load = (["--load", f"{ranks}x{every:g}"] if "--load" in bench.read_text()
            else ["--ranks", str(ranks), "--scrape-hz", str(1.0 / every)])
    cmd = [sys.executable, str(bench), *load, "--seconds", str(seconds)]
    if hostile:
        cmd += ["--hostile", str(hostile)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds * 4 + hostile + 120,
                          check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    result: dict[str, Any] = json.loads(done.stdout)["results"][0]
    return {k: result[k] for k in _KEPT if k in result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=ROOT")
    parser.add_argument("--load", default="8x15,64x5", help="RANKSxSECONDS between scrapes, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hostile", type=float, default=0.0)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    rows = []
    for load in args.load.split(","):
        ranks, every = int(load.split("x")[0]), float(load.split("x")[1])
        for round_ in range(args.rounds):
            row: dict[str, Any] = {"ranks": ranks, "scrape_every_seconds": every, "round": round_}
            for name, root in trees.items():
                row[name] = run_tree(Path(root), ranks, every, args.seconds, args.hostile)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "scrape_compare", "machine": {"cpus": os.cpu_count()},
                      "seconds_per_config": args.seconds, "trees": trees, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
