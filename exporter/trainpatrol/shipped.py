"""What the package ships besides code (rules, the Alertmanager example, dashboards, runbooks, the chart's
values guide), read from ``trainpatrol/data/`` and written out by ``trainpatrol export``. In a checkout
``data/`` holds symlinks to the sources, so nothing can drift; a built wheel holds the files themselves.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

Kind = Literal["rules", "dashboards", "alertmanager", "runbooks", "values"]
KINDS: dict[Kind, str] = {
    "rules": "rules.yml: the alerting and recording rules for Prometheus (rules-dcgm.yml reads GPUs from "
             "dcgm-exporter; rules-fast.yml is the demo's profile)",
    "dashboards": "the Grafana dashboards (JSON)",
    "alertmanager": "alertmanager.yml: the example routing of action alerts to the agent's webhook",
    "runbooks": "runbooks.md: one section per alert",
    "values": "kubernetes.md: the Helm chart's guide and the table of its values",
}
_FILES: dict[Kind, tuple[str, ...]] = {
    "rules": ("rules.yml", "rules-dcgm.yml", "rules-fast.yml"),
    "alertmanager": ("alertmanager.yml",),
    "runbooks": ("runbooks.md",),
    "values": ("kubernetes.md",),
}


def data() -> Traversable:
    return files("trainpatrol") / "data"


def resource(name: str) -> Traversable:
    """One shipped file by its name in ``data/``, e.g. ``rules-fast.yml``."""
    found = data() / name
    if not found.is_file():
        raise FileNotFoundError(f"trainpatrol's shipped file '{name}' is missing from {data()}: a broken install?")
    return found


def names(kind: Kind) -> list[str]:
    """The files of ``kind``, as named in ``data/``."""
    if kind == "dashboards":
        return sorted(f"dashboards/{d.name}" for d in (data() / "dashboards").iterdir() if d.name.endswith(".json"))
    return list(_FILES[kind])


def export(kind: Kind, out: Path) -> list[Path]:
    """Write every file of ``kind`` into ``out`` (created if needed); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names(kind):
        target = out / Path(name).name
        target.write_bytes(resource(name).read_bytes())
        written.append(target)
    return written
