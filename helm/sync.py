"""Copy the shipped rules and dashboards into the Helm chart, which can only read its own files.

    python helm/sync.py           # copy alerting/rules*.yml and dashboards/*.json into the chart
    python helm/sync.py --check   # exit 1, naming the files, when the chart's copies differ

The chart embeds the copies as they are (PrometheusRule spec, dashboard ConfigMaps), so the
copies are the contract; tests/helm/test_chart.py fails when they drift from the sources.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "trainpatrol"
RULES_SOURCE = ROOT / "alerting" / "rules.yml"
RULES_COPY = CHART / "files" / "rules.yml"
DCGM_RULES_SOURCE = ROOT / "alerting" / "rules-dcgm.yml"
DCGM_RULES_COPY = CHART / "files" / "rules-dcgm.yml"
DASHBOARDS_SOURCE = ROOT / "dashboards"
DASHBOARDS_COPY = CHART / "files" / "dashboards"


def wanted() -> dict[Path, bytes]:
    """Every file the chart must hold, with its content."""
    if not RULES_SOURCE.is_file():
        raise FileNotFoundError(f"Rules source {RULES_SOURCE} is missing: run alerting/generate.py first.")
    if not DCGM_RULES_SOURCE.is_file():
        raise FileNotFoundError(f"Rules source {DCGM_RULES_SOURCE} is missing: run alerting/generate.py first.")
    files = {RULES_COPY: RULES_SOURCE.read_bytes(), DCGM_RULES_COPY: DCGM_RULES_SOURCE.read_bytes()}
    dashboards = sorted(DASHBOARDS_SOURCE.glob("*.json"))
    if not dashboards:
        raise FileNotFoundError(f"No dashboards in {DASHBOARDS_SOURCE}: run dashboards/generate.py first.")
    for src in dashboards:
        files[DASHBOARDS_COPY / src.name] = src.read_bytes()
    return files


def differences() -> list[str]:
    """Chart files that are missing, different, or stale (a dashboard whose source is gone)."""
    want = wanted()
    problems = [f"{p.relative_to(ROOT)} differs from its source" for p, data in want.items()
                if not p.is_file() or p.read_bytes() != data]
    problems += [f"{p.relative_to(ROOT)} has no source" for p in sorted(DASHBOARDS_COPY.glob("*.json"))
                 if p not in want]
    return problems


def sync() -> list[Path]:
    """Write the copies; return the paths written or removed."""
    want = wanted()
    changed = []
    for path, data in want.items():
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            changed.append(path)
    for stale in sorted(DASHBOARDS_COPY.glob("*.json")):
        if stale not in want:
            stale.unlink()
            changed.append(stale)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report differences")
    args = parser.parse_args(argv)
    if args.check:
        problems = differences()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run: python helm/sync.py", file=sys.stderr)
        return 1 if problems else 0
    for path in sync():
        print(f"synced {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
