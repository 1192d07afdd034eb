"""Matplotlib figures of a report: value histograms and the step history.

Figures are built on :class:`matplotlib.figure.Figure` with an Agg canvas,
never through ``pyplot``: pyplot keeps every figure in a global registry and
inline backends would display them a second time under the cell.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from functools import lru_cache

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from nan_magic.records import Sample, StepSummary
from nan_magic.render.common import finite_limit, history_fields, short_dtype

#: The dtype's limit lines are drawn when the data reach this fraction of
#: the limit; further away they would squash the histogram into one bar,
#: so the legend gives the headroom (limit / largest |value|) instead.
_LIMIT_VISIBLE = 0.25
#: Ratio of largest to smallest |activation| above which the history uses a log scale.
_DECADES = 100.0
_BINS = 60
_COLUMNS = 3
_DPI = 80
_BAR = "#4c72b0"
_LIMIT = "#d62728"


def histogram_figure(samples: Sequence[Sample]) -> Figure:
    """One histogram per sample, side by side (three per row).

    Parameters
    ----------
    samples
        Samples of finite values, e.g. the producer's inputs and output.

    Returns
    -------
    matplotlib.figure.Figure
        Counts on a log scale; the dtype's finite range marked (for example
        fp16's +-65504) so that values near an overflow stand out.
    """
    columns = max(1, min(_COLUMNS, len(samples)))
    rows = max(1, math.ceil(len(samples) / columns))
    figure = Figure(figsize=(4.4 * columns, 3.0 * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    if not samples:
        axes = figure.add_subplot()
        axes.set_axis_off()
        axes.text(0.5, 0.5, "no samples recorded", ha="center", va="center")
        return figure
    for position, sample in enumerate(samples, start=1):
        draw_histogram(figure.add_subplot(rows, columns, position), sample)
    return figure


def draw_histogram(axes: Axes, sample: Sample) -> None:
    """Draw one sample's histogram onto ``axes``."""
    dtype = short_dtype(sample.dtype)
    axes.set_title(
        f"{sample.label}\n{dtype}, {len(sample.values)} of {sample.numel} values",
        fontsize=9,
    )
    if not sample.values:
        axes.text(0.5, 0.5, "no finite values", ha="center", va="center",
                  transform=axes.transAxes, color=_LIMIT)
        axes.set_yticks([])
        return
    axes.hist(sample.values, bins=_BINS, color=_BAR, log=True)
    axes.set_ylabel("count (log)", fontsize=8)
    axes.tick_params(labelsize=8)
    limit = finite_limit(dtype)
    if limit is None:
        return
    absmax = max(abs(min(sample.values)), abs(max(sample.values)))
    label = f"{dtype} finite range \u00b1{limit:.5g}"
    if absmax >= _LIMIT_VISIBLE * limit:
        handle = axes.axvline(-limit, color=_LIMIT, linestyle="--", label=label)
        axes.axvline(limit, color=_LIMIT, linestyle="--")
        axes.set_xlim(-1.08 * limit, 1.08 * limit)
    else:
        # A legend entry that is not drawn on the axes: the limit is off scale.
        text = f"{label}: {limit / absmax:.3g}x the largest |value|" if absmax else label
        handle = Line2D([], [], linestyle="none", label=text)
    axes.legend(handles=[handle], fontsize=7, loc="upper right", handlelength=1.5)


def history_figure(history: tuple[StepSummary, ...]) -> Figure:
    """Loss, largest |activation| and what else was recorded, per step.

    Parameters
    ----------
    history
        The scalar history kept by the watch, oldest first.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per field of :func:`~nan_magic.render.common.history_fields`
        (loss and max |activation| always), sharing the step axis; non-finite
        steps marked in red; a log scale where a field spans decades.
    """
    fields = history_fields(history)
    figure = Figure(figsize=(8.0, 1.9 * len(fields) + 0.4), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(len(fields), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (field, label) in zip(panels, fields):
        points = [
            (entry.step, value)
            for entry in history
            if (value := getattr(entry, field)) is not None and math.isfinite(value)
        ]
        if points:
            steps, values = zip(*points)
            axes.plot(steps, values, marker=".", color=_BAR)
            # A log scale only helps when a value spans decades (a slow blow-up).
            if min(values) > 0 and max(values) > _DECADES * min(values):
                axes.set_yscale("log")
        axes.set_ylabel(label, fontsize=8)
        axes.tick_params(labelsize=8)
        for entry in history:
            if entry.nonfinite:
                axes.axvline(entry.step, color=_LIMIT, alpha=0.6)
    panels[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    panels[-1].set_xlabel("step (red: non-finite)", fontsize=8)
    return figure


def figure_png(figure: Figure) -> bytes:
    """Encode ``figure`` as PNG bytes."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


@lru_cache(maxsize=16)
def histogram_png(samples: tuple[Sample, ...]) -> bytes:
    """PNG of :func:`histogram_figure`, cached: the widget and the static
    HTML of one report draw the same samples."""
    return figure_png(histogram_figure(samples))


@lru_cache(maxsize=16)
def history_png(history: tuple[StepSummary, ...]) -> bytes:
    """PNG of :func:`history_figure`, cached like :func:`histogram_png`."""
    return figure_png(history_figure(history))
