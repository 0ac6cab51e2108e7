"""The speedup plot as a reader reads it: axis ticks in the words of the table, each bar's value."""

from __future__ import annotations

from pathlib import Path

from tuner.offline.plots import pyplot, speedup_figure, speedup_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ticks(fig) -> list[str]:
    fig.canvas.draw()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    return [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]


def test_a_wide_range_reads_in_x_not_powers_of_two_and_every_bar_says_its_value():
    fig = speedup_figure(["a", "b", "c"], [1.0, 1.64, 4.37], title="t", groups=["x", "y", "z"])
    assert _ticks(fig) == ["1x", "2x", "4x"]  # a log axis, not 2^0 2^1 2^2
    assert [t.get_text() for t in fig.axes[0].texts] == ["1.00x", "1.64x", "4.37x"]
    pyplot().close(fig)


def test_a_narrow_range_has_few_ticks_and_the_baseline_rows_are_labelled(tmp_path: Path):
    fig = speedup_figure(["a", "b", "c"], [1.0, 1.0, 0.99], title="t")
    ticks = _ticks(fig)
    assert "1x" in ticks and len(ticks) <= 7 and all(t.endswith("x") for t in ticks)
    assert [t.get_text() for t in fig.axes[0].texts] == ["1.00x", "1.00x", "0.99x"]
    pyplot().close(fig)
    png = speedup_plot(["a"], [1.0], tmp_path / "p" / "s.png", title="t")
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_rows_at_or_below_1x_leave_room_right_of_1x_for_their_labels():
    fig = speedup_figure(["a", "b"], [1.0, 0.99], title="t")
    assert fig.axes[0].get_xlim()[1] > 1.0  # not cut at the bars' sticky edge, 1x
    pyplot().close(fig)
