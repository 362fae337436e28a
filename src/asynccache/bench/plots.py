"""PNG plots for the benchmarks, with matplotlib's Agg renderer.

Figures are built with ``matplotlib.figure.Figure`` directly, not ``pyplot``: no GUI
backend is ever selected, no global figure registry keeps them alive, and importing
this module changes nothing for the rest of the process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

__all__ = ["Panel", "Series", "bars", "cdf", "lines"]

#: colour per role; asynccache solid, peers dashed
ROLE_STYLE = {
    "asynccache": {"linestyle": "-", "linewidth": 2.0},
    "dict": {"linestyle": ":", "linewidth": 1.5, "color": "0.35"},
    "naive": {"linestyle": "--", "linewidth": 1.5},
    "floor": {"linestyle": "--", "linewidth": 1.5},
    "aiocache": {"linestyle": "-.", "linewidth": 1.5},
}
MARKERS = "osD^vPX*<>"


@dataclass
class Series:
    role: str
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)

    def add(self, x: float, y: float | None) -> None:
        if y is not None and math.isfinite(y) and y > 0:
            self.xs.append(x)
            self.ys.append(y)


@dataclass
class Panel:
    title: str
    series: dict[str, Series]
    xticks: tuple[list[float], list[str]] | None = None


def _grid(n: int, columns: int | None) -> tuple[int, int]:
    cols = max(1, min(columns or n, n))
    return math.ceil(n / cols), cols


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def lines(
    path: Path,
    panels: Sequence[Panel],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    xticks: tuple[list[float], list[str]] | None = None,
    logy: bool = True,
    columns: int | None = None,
) -> Path:
    """One panel per entry, a line per series; the legend is shared below the panels."""
    rows, cols = _grid(len(panels), columns)
    fig = Figure(figsize=(max(9.5, 4.6 * cols), 3.6 * rows + 1.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, panel in zip(axes, panels):
        for k, (name, s) in enumerate(panel.series.items()):
            if not s.xs:
                continue
            style = dict(ROLE_STYLE.get(s.role, {}))
            (line,) = ax.plot(
                s.xs, s.ys, marker=MARKERS[k % len(MARKERS)], markersize=4, label=name, **style
            )
            handles.setdefault(name, line)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(xlabel)
        if ylabel:
            ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ticks = panel.xticks or xticks
        if ticks is not None:
            ax.set_xticks(ticks[0], ticks[1])
        ax.grid(alpha=0.3, which="both")
    return _finish(fig, axes, len(panels), title, handles, 4, path)


def _finish(fig: Any, axes: Any, used: int, title: str, handles: dict[str, Any],
            ncol: int, path: Path) -> Path:
    """Hide unused panels, add the title and one legend below, save."""
    for ax in axes[used:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncol=min(ncol, max(1, len(handles))),
        fontsize=8,
        frameon=False,
    )
    return _save(fig, path)


def bars(
    path: Path,
    groups: dict[str, dict[str, float]],
    *,
    title: str,
    xlabel: str,
    reference: float | None = 1.0,
) -> Path:
    """Horizontal bars: one block per group, a bar per entry (e.g. ratios to a floor)."""
    labels: list[str] = []
    values: list[float] = []
    colours: list[str] = []
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for g, (group, entries) in enumerate(groups.items()):
        for name, value in entries.items():
            labels.append(f"{group} · {name}")
            values.append(value)
            colours.append(palette[g % len(palette)])
    fig = Figure(figsize=(9, 0.32 * len(labels) + 1.6), layout="constrained")
    ax = fig.subplots()
    ax.barh(range(len(values)), values, color=colours)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    if reference is not None:
        ax.axvline(reference, color="black", linewidth=1)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def cdf(
    path: Path, panels: Sequence[Panel], *, title: str, xlabel: str, columns: int | None = None
) -> Path:
    """Latency CDFs: each series' ``xs`` are quantile values, ``ys`` the fractions."""
    rows, cols = _grid(len(panels), columns)
    fig = Figure(figsize=(max(9.5, 4.6 * cols), 3.6 * rows + 1.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, panel in zip(axes, panels):
        for name, s in panel.series.items():
            if not s.xs:
                continue
            (line,) = ax.plot(s.xs, s.ys, label=name, **ROLE_STYLE.get(s.role, {}))
            handles.setdefault(name, line)
        ax.set_xscale("log")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of items")
        ax.grid(alpha=0.3, which="both")
    return _finish(fig, axes, len(panels), title, handles, 3, path)
