"""Plots people would rather look at than read: speedup per problem, against the baseline."""

from __future__ import annotations

import io
import math
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tuner.core.atomic import write_atomic


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


TITLE_WIDTH = 80  # characters per title line at the figure's width


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display on servers or CI). Slow to
    import: only when a plot is made, not on ``import tuner.offline.plots`` (the CLI imports it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def preload() -> None:
    """Import matplotlib in a background thread, while a long run waits on its workers: the
    plot at its end then starts at once."""
    threading.Thread(target=pyplot, name="preload-matplotlib", daemon=True).start()


def speedup_plot(
    labels: Sequence[str],
    speedups: Sequence[float],
    path: str | Path,
    *,
    title: str,
    groups: Sequence[str] | None = None,
    floor: float | None = 0.98,
) -> Path:
    """Horizontal bars of speedup (baseline time / tuned time) per problem, 1.0 marked, saved as
    a PNG at ``path`` (``speedup_figure`` draws it) in one rename: a plot cut short leaves the
    one before whole."""
    plt = pyplot()
    path = Path(path)
    fig = speedup_figure(labels, speedups, title=title, groups=groups, floor=floor)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110, bbox_inches="tight")  # the legend outside included
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, png.getvalue())
    return path


def speedup_figure(
    labels: Sequence[str],
    speedups: Sequence[float],
    *,
    title: str,
    groups: Sequence[str] | None = None,
    floor: float | None = 0.98,
) -> Any:
    """The figure of ``speedup_plot``. ``groups`` colours the bars (e.g. the winning source);
    ``floor`` draws the no-regression line."""
    plt = pyplot()
    from matplotlib.patches import Patch

    n = len(labels)
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.22 * n + 1.5)))
    palette = plt.get_cmap("tab10")
    names = list(dict.fromkeys(groups)) if groups else []
    colors = [palette(names.index(g) % 10) for g in groups] if groups else ["tab:blue"] * n
    ax.barh(range(n), [s - 1.0 for s in speedups], left=1.0, color=colors)  # bars grow from 1x
    # each bar's end marked too: a row at 1.00x (the baseline kept) has no bar to see
    ax.scatter(speedups, range(n), c=colors, marker="|", s=60, zorder=3)
    ax.set_yticks(range(n), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    if floor is not None:
        ax.axvline(
            floor, color="red", linestyle=":", linewidth=1,
            label=f"{floor}x: no tuned winner below this",
        )  # fmt: skip
    _speedup_axis(ax, speedups)
    lo, hi = min(speedups, default=float("nan")), max(speedups, default=float("nan"))
    wrapped = "\n".join(textwrap.wrap(title, TITLE_WIDTH))  # a long device name stays in the figure
    ax.set_title(f"{wrapped}\ngeomean {geomean(speedups):.3f}x, min {lo:.3f}x, max {hi:.3f}x")
    handles, _ = ax.get_legend_handles_labels()
    # an empty barh() has no patch to take a colour from: legend entries need explicit patches
    handles += [Patch(color=palette(i % 10), label=name) for i, name in enumerate(names)]
    if handles:  # outside the axes: inside, it hides the ends of the bars under it
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _speedup_axis(ax: Any, speedups: Sequence[float]) -> None:
    """The x axis in the words of the title and the table ("2x", not "2^1"), and each bar's
    speedup written at its end: a reader should not have to estimate 1.64x against a grid."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    wide = bool(speedups) and max(speedups) / max(min(speedups), 1e-9) > 4
    if wide:  # a log axis only where the range needs it: a narrow one would show a single tick
        ax.set_xscale("log", base=2)
    else:  # ticks as "0.995x" side by side would run into one another
        ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    # room for the values written beside the longest bars; the bars' sticky edge at 1x would
    # otherwise end the axis there when no row is faster, and its "1.00x" labels fall outside
    ax.use_sticky_edges = False
    ax.margins(x=0.1)
    ax.set_xlabel(f"speedup over baseline ({'log scale; ' if wide else ''}>1 is faster)")
    for y, s in enumerate(speedups):
        ax.annotate(
            f"{s:.2f}x", (s, y), xytext=(4 if s >= 1 else -4, 0), textcoords="offset points",
            ha="left" if s >= 1 else "right", va="center", fontsize=6,
        )  # fmt: skip
