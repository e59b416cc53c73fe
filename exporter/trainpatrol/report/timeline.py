"""The timeline: every rank's recent history on one shared step axis, as stacked matplotlib panels, rendered
to inline SVG. Non-finite values leave a gap in the line and a red mark on the step; the action's step
is a dashed line. SVG ids (gid) name each panel and each rank's line so a browser test can find them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._html import value_label
from .bundle import RankPart, ranks_text, spans

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.transforms import Transform

GIB = 2.0**30
NONFINITE_COLOR = "#d62728"


@dataclass(frozen=True)
class Panel:
    key: str
    title: str
    unit: str
    values: Callable[[RankPart], list[float | None]]
    connect_samples: bool = False
    """Memory is sampled on a time budget (NaN between samples): join the samples instead of leaving gaps."""
    memory: bool = False
    """Plots the allocator's readings, which a ``memory_reader`` may simulate."""


def _field(name: str, scale: float = 1.0) -> Callable[[RankPart], list[float | None]]:
    return lambda part: [None if v is None else v / scale for v in part.series(name)]


def _wait_ratio(part: RankPart) -> list[float | None]:
    out: list[float | None] = []
    for wait, step in zip(part.series("loader_wait_seconds"), part.series("step_seconds"), strict=True):
        ok = wait is not None and step is not None and math.isfinite(wait) and math.isfinite(step) and step > 0
        out.append(min(max(wait / step, 0.0), 1.0) if ok else None)  # type: ignore[operator]
    return out


PANELS = (
    Panel("loss", "loss", "", _field("loss")),
    Panel("grad_norm", "grad norm", "", _field("grad_norm")),
    Panel("learning_rate", "learning rate", "param group 0", _field("learning_rate")),
    Panel("step_seconds", "step time", "s", _field("step_seconds")),
    Panel("loader_wait_ratio", "loader wait ratio", "wait / step", _wait_ratio),
    Panel("allocated", "allocated", "GiB", _field("allocated_bytes", GIB), connect_samples=True, memory=True),
    Panel("reserved", "reserved", "GiB", _field("reserved_bytes", GIB), connect_samples=True, memory=True),
    Panel("fragmentation", "fragmentation", "unusable at peak / reserved", _field("fragmentation_ratio"),
          connect_samples=True, memory=True),
)


def _log_scale_fits(values: list[float]) -> bool:
    pos = sorted(v for v in values if math.isfinite(v))
    if not pos or pos[0] <= 0:
        return False
    return pos[-1] / max(pos[len(pos) // 2], 1e-300) > 50


def render_svg(ranks: list[RankPart], action_step: int | None, action: str) -> tuple[str, dict[str, int]]:
    """The timeline as an ``<svg>`` element, and the count of plotted points per panel."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    counts: dict[str, int] = {}
    with rc_context({"svg.hashsalt": "trainpatrol", "svg.fonttype": "none", "font.size": 9,
                     "axes.spines.top": False, "axes.spines.right": False}):
        fig = Figure(figsize=(11, 1.55 * len(PANELS) + 0.6), layout="constrained")
        axes = fig.subplots(len(PANELS), 1, sharex=True)
        colors = [_color(i, len(ranks)) for i in range(len(ranks))]
        bad_steps: set[int] = set()
        for ax, panel in zip(axes, PANELS, strict=True):
            ax.set_gid(f"panel-{panel.key}")
            counts[panel.key] = 0
            everything: list[float] = []
            top = blended_transform_factory(ax.transData, ax.transAxes)
            panel_bad: dict[int, list[tuple[int, float]]] = {}
            simulated = False
            for part, color in zip(ranks, colors, strict=True):
                n, bad = _plot_rank(ax, panel, part, color, top)
                counts[panel.key] += n
                simulated |= bool(n) and panel.memory and part.simulated_memory
                for s, v in bad:
                    panel_bad.setdefault(s, []).append((part.rank, v))
                everything += [v for v in panel.values(part) if v is not None]
            _label_nonfinite(ax, panel_bad, top)
            bad_steps.update(panel_bad)
            ax.set_ylabel(panel.title + (f"\n[{panel.unit}]" if panel.unit and len(panel.unit) < 12 else ""))
            if panel.unit and len(panel.unit) >= 12:
                ax.set_title(panel.unit, loc="right", fontsize=7, color="#666")
            if panel.key in ("loss", "grad_norm") and _log_scale_fits(everything):
                ax.set_yscale("log")
            if simulated:  # on the plot itself, so a copied figure still says it
                ax.text(0.995, 0.97, "simulated: no CUDA allocator", transform=ax.transAxes, ha="right", va="top",
                        fontsize=7.5, color="#a05a00", gid=f"simulated-{panel.key}")
            if counts[panel.key] == 0:
                ax.text(0.5, 0.5, "no values in this bundle", transform=ax.transAxes, ha="center", va="center",
                        color="#888", gid=f"empty-{panel.key}")
            ax.grid(True, color="#e5e5e5", linewidth=0.6)
        for ax in axes:
            for lo, hi in spans(sorted(bad_steps)):
                ax.axvspan(lo - 0.5, hi + 0.5, color=NONFINITE_COLOR, alpha=0.12, linewidth=0)
            if action_step is not None:
                ax.axvline(action_step, color="#333", linestyle="--", linewidth=1)
        if action_step is not None:
            axes[0].annotate(f"{action} @ step {action_step}", (action_step, 1.0),
                             xycoords=axes[0].get_xaxis_transform(), xytext=(-4, 2), textcoords="offset points",
                             ha="right", va="bottom", fontsize=8)
        axes[-1].set_xlabel("step (shared by every rank)")
        legend = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
        handles, labels = list(legend.values()), list(legend)
        if handles:
            fig.legend(handles[:16], labels[:16], loc="outside upper center", ncols=min(len(handles), 8),
                       frameon=False, title=None if len(handles) <= 16 else f"first 16 of {len(handles)} ranks")
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg"):], counts


def _plot_rank(ax: Axes, panel: Panel, part: RankPart, color: str,
               top: Transform) -> tuple[int, list[tuple[int, float]]]:
    """One rank's line on one panel; returns the plotted point count and the non-finite steps."""
    steps, values = part.steps, panel.values(part)
    xs: list[float] = []
    ys: list[float] = []
    bad: list[tuple[int, float]] = []
    for s, v in zip(steps, values, strict=True):
        if v is None or (panel.connect_samples and math.isnan(v)):
            continue
        if not math.isfinite(v):
            bad.append((s, v))
        xs.append(s)
        ys.append(v if math.isfinite(v) else math.nan)  # matplotlib breaks the line at a NaN: the gap is the point
    finite = sum(1 for y in ys if math.isfinite(y))
    if finite:
        (line,) = ax.plot(xs, ys, color=color, linewidth=1.2, label=f"rank {part.rank}",
                          marker="o" if finite < 40 else None, markersize=2.5)
        line.set_gid(f"line-{panel.key}-rank{part.rank}")
    if bad:
        bx = [s for s, _ in bad]
        (marks,) = ax.plot(bx, [0.96] * len(bx), linestyle="none", marker="x", markersize=7, markeredgewidth=2,
                           color=NONFINITE_COLOR, transform=top, clip_on=False)
        marks.set_gid(f"nonfinite-{panel.key}-rank{part.rank}")
    return finite, bad


def _label_nonfinite(ax: Axes, bad: dict[int, list[tuple[int, float]]], top: Transform) -> None:
    """One label per run of non-finite steps: what the value was and on which ranks."""
    for lo, hi in spans(list(bad)):
        kinds = sorted({value_label(v) for _, v in bad[lo]})
        ranks = sorted({r for s in range(lo, hi + 1) for r, _ in bad.get(s, [])})
        where = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        ax.text(lo, 0.84, f" {'/'.join(kinds)} at {where}, {ranks_text(ranks)}", transform=top, color=NONFINITE_COLOR,
                fontsize=7.5, fontweight="bold", ha="left", va="top")


def _color(i: int, n: int) -> str:
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    if n <= 10:
        return to_hex(colormaps["tab10"](i))
    return to_hex(colormaps["viridis"](i / max(n - 1, 1)))
