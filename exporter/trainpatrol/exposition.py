"""The Prometheus text format (0.0.4), written as prometheus_client's ``generate_latest`` writes it.

The one writer of the /metrics body: every collector formats its lines with these functions and
hands the agent bytes (``Collector``). tests/exposition_check.py holds the writer to
``generate_latest`` byte for byte and to ``promtool check metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

_INF = float("inf")


class Collector(Protocol):
    """A part of the /metrics body that knows when it has something new."""

    def changed(self) -> bool:
        """Is there something new since the last ``write``? Cheap: asked on every scrape."""

    def write(self) -> bytes:
        """This collector's families in the text format; raises when it has nothing valid to say."""


def go_float(value: float) -> str:
    """``value`` as Go's strconv writes it, which is what prometheus_client's ``floatToGoString`` gives."""
    if -_INF < value < 1e6:  # the common case: ``repr`` is Go's text here (negatives always)
        return repr(float(value))
    if value != value:
        return "NaN"
    if value == _INF:
        return "+Inf"
    if value == -_INF:
        return "-Inf"
    text = repr(float(value))
    dot = text.find(".")
    if dot > 6:  # Go writes an exponent from 1e21 down to 1e6 where Python still writes digits
        return f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.") + f"e+{dot - 1:02d}"
    return text


def go_floats(values: Sequence[float]) -> list[str]:
    """``go_float`` of each float in one pass: a rank's record or a family of byte counts, most of
    them written as ``repr`` writes them or in Go's exponent form above 1e6."""
    return [go_float(v) if t[-1] in "nf" else  # nan, inf: a finite repr ends in a digit
            f"{t[0]}.{t[1:d]}{t[d + 1:]}".rstrip("0.") + _EXPONENT[d] if (d := t.find(".")) > 6 and t[0] != "-" else t
            for v, t in zip(values, map(repr, values), strict=True)]


_EXPONENT = tuple(f"e+{dot - 1:02d}" for dot in range(24))
"""Go's exponent for a repr whose dot is at this index (a repr without an exponent has at most 17 digits)."""


def escape_label(value: str) -> str:
    """A label value inside its double quotes."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def escape_help(text: str) -> str:
    """A HELP text: backslashes and newlines escaped, quotes as they are."""
    return text.replace("\\", r"\\").replace("\n", r"\n")


def label_block(labels: Mapping[str, str]) -> str:
    """``a="x",b="y"``: the labels sorted by name, their values escaped."""
    return ",".join([f'{name}="{escape_label(labels[name])}"' for name in sorted(labels)])


def head(name: str, labels: Mapping[str, str]) -> str:
    """A sample line up to its value: ``name{labels} ``."""
    return f"{name}{{{label_block(labels)}}} " if labels else f"{name} "


def line(name: str, labels: Mapping[str, str], value: float) -> str:
    """One sample line."""
    return f"{head(name, labels)}{go_float(value)}\n"


def exposed(name: str, kind: str) -> str:
    """The family's name as exposed: a counter's ``_total`` and an info's ``_info`` added where
    missing, as ``generate_latest`` does."""
    if kind == "counter" and not name.endswith("_total"):
        return name + "_total"
    if kind == "info" and not name.endswith("_info"):
        return name + "_info"
    return name


def header(name: str, kind: str, help_: str) -> str:
    """A family's ``# HELP`` and ``# TYPE`` lines; an info is a gauge of value 1."""
    name = exposed(name, kind)
    return f"# HELP {name} {escape_help(help_)}\n# TYPE {name} {'gauge' if kind == 'info' else kind}\n"


def family(name: str, kind: str, help_: str, rows: Sequence[tuple[Mapping[str, str], float]]) -> str:
    """A whole family of plain samples (no histogram): its header and a line per (labels, value)."""
    sample = exposed(name, kind)
    return header(name, kind, help_) + "".join(
        [line(sample, labels, 1.0 if kind == "info" else value) for labels, value in rows])
