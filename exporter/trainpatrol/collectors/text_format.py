"""The text format (0.0.4) of prometheus_client's families, as its ``generate_latest`` writes it, but
with each series' ``name{labels}`` head written once and kept: from one scrape to the next only the
values change. prometheus_client's writer escapes every label of every sample at every scrape, which
at 64 ranks took 38 ms of the 25 ms a scrape may take (docs/benchmarks.md); this takes about 8 ms.
tests/exposition_check.py holds it to ``generate_latest`` byte for byte."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

_EXPOSED = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
            "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}


class Labels(dict[str, str]):
    """A series' labels with their block as the text format writes it (``a="x",b="y"``), made once: a
    collector that keeps its series' labels from scrape to scrape (collectors.ranks) saves the writer
    escaping them again. prometheus_client's own writers read it as the dict it is."""

    __slots__ = ("block",)

    def __init__(self, labels: dict[str, str]) -> None:
        super().__init__(labels)
        self.block = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def text_format(families: Iterable[Metric]) -> bytes:
    out: list[str] = []
    for family in families:
        suffix, kind = _EXPOSED.get(family.type, ("", family.type))
        out.append(_header(family.name + suffix, kind, family.documentation))
        for s in family.samples:
            if s.timestamp is not None or s.name.endswith(("_created", "_gsum", "_gcount")):
                raise ValueError(f"{s.name}: timestamps and OpenMetrics-only samples are not written here")
            block = getattr(s.labels, "block", None)
            head = f"{s.name}{{{block}}} " if block else _head(s.name, tuple(s.labels.items()))
            out.append(f"{head}{floatToGoString(s.value)}\n")
    return "".join(out).encode()


@functools.lru_cache(maxsize=256)
def _header(name: str, kind: str, help_: str) -> str:
    escaped = help_.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


@functools.lru_cache(maxsize=1 << 16)
def _head(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    """A series' line up to its value; the cache is bounded (the agent's series are: agent.limits)."""
    if not labels:
        return name + " "
    block = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{block}}} "


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
