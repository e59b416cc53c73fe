"""bench/scrape.py on two source trees side by side, in one run on one host: each configuration
(pushing ranks by scrapes a second) runs on every tree in turn before the next configuration, so that
both see the same machine in the same minutes. Prints one JSON document:

    python bench/scrape_compare.py --tree before=/path/to/old/checkout --tree after=. \
        [--ranks 8,64] [--scrape-hz 1,10] [--seconds 20] [--hostile 0]

A tree is a checkout root holding ``bench/scrape.py`` and ``exporter/``; each runs its own bench
against its own package, so a tree from before a change is measured as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_KEPT = ("ranks", "scrape_hz", "transport", "cpu_core_share", "scrape_ms_p50", "scrape_ms_p99", "rss_mb_peak",
         "scrape_ms_max", "exposition_bytes", "scrapes", "pushes_per_second")


def run_tree(root: Path, ranks: int, hz: float, seconds: float, hostile: float) -> dict[str, Any]:
    """One configuration of ``root``'s own bench/scrape.py, with ``root``'s package first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "exporter"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(root / "bench" / "scrape.py"), "--ranks", str(ranks), "--scrape-hz", str(hz),
           "--seconds", str(seconds)]
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
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--scrape-hz", default="1,10")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--hostile", type=float, default=0.0)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for hz in (float(h) for h in args.scrape_hz.split(",")):
            row: dict[str, Any] = {"ranks": ranks, "scrape_hz": hz}
            for name, root in trees.items():
                row[name] = run_tree(Path(root), ranks, hz, args.seconds, args.hostile)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "scrape_compare", "machine": {"cpus": os.cpu_count()},
                      "seconds_per_config": args.seconds, "trees": trees, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
