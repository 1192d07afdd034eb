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
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator
from PIL import Image

from nan_magic.records import Sample, StepSummary
from nan_magic.render.common import finite_limit, history_value, plotted_history_fields
from nan_magic.render.words.counted import counted as counted_words

#: The dtype's limit lines are drawn when the data reach this fraction of
#: the limit; further away they would squash the histogram into one bar,
#: so the legend gives the headroom (limit / largest |value|) instead.
_LIMIT_VISIBLE = 0.25
#: Ratio of largest to smallest |activation| above which the history uses a log scale.
_DECADES = 100.0
_BINS = 60
#: Two panels a row at 100 dpi: 860 px, the width of a notebook's output, so that
#: the image is not scaled down and no label is smaller than 10 px (8 pt at 100 dpi is 11 px).
_COLUMNS = 2
_DPI = 100
_PANEL = (4.3, 3.0)
_SMALL = 8
_TITLE = 9
_BAR = "#4c72b0"
_LIMIT = "#d62728"
_ZERO = "#2ca02c"


def histogram_figure(samples: Sequence[Sample], zeros: bool = False) -> Figure:
    """One histogram per sample, side by side (three per row).

    Parameters
    ----------
    samples
        Samples of one tensor each, e.g. the producing op's operands and
        output, then the producer module's input and output.
    zeros
        Whether the cause is about zeros (``log(0)``, ``0/0``): each
        histogram then says how many elements are exactly zero.

    Returns
    -------
    matplotlib.figure.Figure
        Element counts on a log scale; the nan/+inf/-inf counts as red,
        hatched bars at the ends; the dtype's finite range marked (for
        example fp16's +-65504) so that values near an overflow stand out.
    """
    columns = max(1, min(_COLUMNS, len(samples)))
    rows = max(1, math.ceil(len(samples) / columns))
    figure = Figure(figsize=(_PANEL[0] * columns, _PANEL[1] * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    if not samples:
        return _saying(figure, "no samples recorded")
    for position, sample in enumerate(samples, start=1):
        draw_histogram(figure.add_subplot(rows, columns, position), sample, zeros)
    return figure


def _saying(figure: Figure, text: str) -> Figure:
    """``figure`` with nothing to plot: one panel without axes that says why."""
    axes = figure.add_subplot()
    axes.set_axis_off()
    axes.text(0.5, 0.5, text, ha="center", va="center")
    return figure


def draw_histogram(axes: Axes, sample: Sample, zeros: bool = False) -> None:
    """Draw one sample's histogram, its non-finite bars and its dtype's range onto ``axes``."""
    dtype = sample.dtype
    bad = {"-inf": sample.neginf or 0, "+inf": sample.posinf or 0, "nan": sample.nan or 0}
    finite_count = sample.numel - sum(bad.values())
    counted = "; ".join(f"{count} {kind}" for kind, count in bad.items() if count)
    axes.set_title(
        f"{sample.label}\n{dtype}, {finite_count} finite of {sample.numel}"
        + (f"; {counted}" if counted else ""),
        fontsize=_TITLE,
    )
    axes.tick_params(labelsize=_SMALL)
    axes.set_ylabel("elements (log)", fontsize=_SMALL)
    axes.set_yscale("log")
    if sample.values:
        low, high = min(sample.values), max(sample.values)
        # The values are a strided sample: weigh them back to the tensor's counts.
        weight = max(finite_count, len(sample.values)) / len(sample.values)
        if low == high:  # one value: a visible bar around it, not matplotlib's unit range
            half = max(abs(low) * 0.05, 1e-3)
            bins: Any = [low - half, low + half]
            low, high = low - 4 * half, high + 4 * half
        else:
            bins = _BINS
        counts, _, _ = axes.hist(
            sample.values, bins=bins, color=_BAR, weights=[weight] * len(sample.values)
        )
        tallest = max(float(max(counts)), 1.0)
        axes.set_xlabel("value (finite elements)", fontsize=_SMALL)
    else:
        low, high = -1.0, 1.0
        tallest = 1.0
        axes.set_xlabel("no finite value to draw", fontsize=_SMALL)
        axes.set_xticks([])
        kinds = [kind for kind, count in bad.items() if count]
        if len(kinds) == 1:
            every = "its one element is" if sample.numel == 1 else f"all {sample.numel} elements are"
            why = f"no finite values: {every} {kinds[0]}"
        else:
            why = f"no finite values: {counted or 'none counted'}"
        axes.text(0.45, 0.6, why, ha="center", va="center", transform=axes.transAxes,
                  color=_LIMIT, fontsize=_SMALL)
    handles: list[Any] = []
    limit = finite_limit(dtype)
    absmax = max(abs(low), abs(high))
    # An infinity alone does not draw the range: a masked_fill(-inf) beside scores of about 1 would squash
    # every finite value into one bar out of sight. Without a finite value there is nothing to squash.
    infinite_only = not sample.values and bool(sample.posinf or sample.neginf)
    if limit is not None and (absmax >= _LIMIT_VISIBLE * limit or infinite_only):
        label = f"{dtype} finite range \u00b1{limit:.5g}"
        handles.append(axes.axvline(-limit, color=_LIMIT, linestyle="--", label=label))
        axes.axvline(limit, color=_LIMIT, linestyle="--")
        low, high = min(low, -limit), max(high, limit)
    elif limit is not None and (largest := max((abs(value) for value in sample.values), default=0.0)):
        # A legend entry that is not drawn on the axes: the limit is off scale. Measured from the values, not the
        # drawn range: that is padded around a single value (all zeros: 8.5e40x) and is -1..1 where no value is finite
        # (3.4e38x a largest |value| that does not exist); without a nonzero finite value there is no ratio to give.
        text = f"{dtype} limit \u00b1{limit:.3g}: {limit / largest:.3g}x the largest |value|"
        handles.append(Line2D([], [], linestyle="none", label=text))
    # Few, short tick labels: a float16 axis spans -65504..65504 and long ones run into each other.
    axes.xaxis.set_major_locator(MaxNLocator(5))
    axes.xaxis.set_major_formatter(FuncFormatter(_tick_label))
    tallest = max([tallest, *bad.values()])
    span = (high - low) or max(abs(high), 1.0)
    _draw_nonfinite(axes, bad, low, high, span)
    if zeros and sample.zeros:
        handles.append(axes.axvline(0.0, color=_ZERO, linestyle=":", linewidth=1.5,
                                    label=counted_words(sample.zeros, "exact zero")))
    # Room above the bars for the legend: a log axis needs decades of it.
    axes.set_ylim(0.5, tallest * 60)
    if handles:
        axes.legend(handles=handles, fontsize=_SMALL, loc="upper left", handlelength=1.5,
                    framealpha=0.9)


_ENGINEERING = EngFormatter(sep="")


def _tick_label(value: float, position: int | None = None) -> str:
    """``40k``, ``2.5m`` as engineering prefixes; past them (a float32 range's ``2e38``) in plain exponent form.

    EngFormatter's largest prefix is Q (1e30): float32's range read ``-2e+08Q``.
    """
    if abs(value) >= 1e15:
        return str(_ENGINEERING.fix_minus(f"{value:.3g}".replace("e+", "e")))
    return str(_ENGINEERING(value, position))


def _draw_nonfinite(axes: Axes, bad: dict[str, int], low: float, high: float, span: float) -> None:
    """The nan/+inf/-inf counts as hatched red bars beyond the finite range."""
    width = span / 12
    places = {"-inf": low - span / 6, "+inf": high + span / 6, "nan": high + span / 3}
    drawn = {kind: count for kind, count in bad.items() if count}
    for kind, count in drawn.items():
        axes.bar(places[kind], count, width=width, color=_LIMIT, hatch="//",
                 edgecolor="white", linewidth=0)
        axes.annotate(f"{kind}\n{count}", (places[kind], count), ha="center", va="bottom",
                      fontsize=_SMALL, color=_LIMIT, xytext=(0, 2), textcoords="offset points")
    left = places["-inf"] - width if "-inf" in drawn else low - span / 20
    right = (places["nan"] if "nan" in drawn else places["+inf"] if "+inf" in drawn else high + span / 20 - width)
    axes.set_xlim(left, right + width)


def history_figure(
    history: tuple[StepSummary, ...], failing_step: int | None = None, producer: str | None = None
) -> Figure:
    """Loss, largest |activation| and what else was recorded, per step.

    Parameters
    ----------
    history
        The scalar history kept by the watch, oldest first.
    failing_step
        The report's step. The watch records a step's summary when the step
        ends, so the failing step is often missing from ``history``: it is
        marked all the same.
    producer
        The producer's module: its largest ``|output|`` on the per-module
        steps is drawn beside the model's, where those steps measured it.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per field of
        :func:`~nan_magic.render.common.plotted_history_fields` (those with
        at least two finite steps), sharing the step axis; the failing step
        a red point (at the top edge, marked, where its value is not
        finite); headroom to overflow on a log axis, others where they
        span decades.
    """
    fields = plotted_history_fields(history)
    figure = Figure(figsize=(8.0, 1.8 * max(1, len(fields)) + 0.5), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    if not fields:
        return _saying(figure, "fewer than two steps recorded: nothing to plot")
    panels = figure.subplots(len(fields), 1, sharex=True, squeeze=False)[:, 0]
    failing = {entry.step: entry for entry in history if entry.nonfinite}
    if failing_step is not None and failing_step not in failing:
        failing[failing_step] = StepSummary(step=failing_step, loss=None, absmax=None, nonfinite=True)
    for axes, (field, label) in zip(panels, fields):
        _draw_history_panel(axes, history, field, label, tuple(failing.values()), producer)
    panels[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    panels[-1].set_xlabel("step (red: the step with the non-finite value)", fontsize=_SMALL)
    return figure


def _draw_history_panel(
    axes: Axes,
    history: tuple[StepSummary, ...],
    field: str,
    label: str,
    failing: tuple[StepSummary, ...],
    producer: str | None = None,
) -> None:
    points = [
        (entry.step, value, entry.full)
        for entry in history
        if (value := history_value(entry, field)) is not None and math.isfinite(value)
    ]
    steps, values, _ = zip(*points)
    if field == "absmax":
        # Two measures in one panel, each its own line: a full-check step's value is not the next step's.
        full = [(step, value) for step, value, every in points if every]
        if full:
            axes.plot(*zip(*full), "s-", color=_BAR, markersize=6, label="every module's output")
        if len(full) < len(points):
            axes.plot(*zip(*[(s, v) for s, v, every in points if not every]), "o--", mfc="white", color=_BAR,
                      markersize=6, label="the model's outputs only")
        layer = [(entry.step, value) for entry in history for name, value, _dtype, _path in entry.layers
                 if name == producer]
        if layer:
            axes.plot(*zip(*layer), "D:", color=_LIMIT, markersize=6, label=f"{producer or '(root)'} (the producer)")
            values = (*values, *(value for _step, value in layer))
        axes.legend(fontsize=_SMALL, loc="upper left", framealpha=0.9)
    else:
        axes.plot(steps, values, marker=".", color=_BAR)
    positive = min(values) > 0
    # Headroom is a ratio: its approach to 1 (overflow) reads on a log axis only.
    if positive and (field == "headroom" or max(values) > _DECADES * min(values)):
        axes.set_yscale("log")
    if field == "headroom":
        axes.axhline(1.0, color=_LIMIT, linestyle="--", linewidth=1)
        axes.annotate("1: overflow", (0.0, 1.0), xycoords=("axes fraction", "data"),
                      xytext=(4, 3), textcoords="offset points", fontsize=_SMALL, color=_LIMIT)
    axes.set_ylabel(label, fontsize=_SMALL)
    axes.tick_params(labelsize=8)
    for entry in failing:
        value = history_value(entry, field)
        if value is not None and math.isfinite(value):
            axes.plot([entry.step], [value], "o", color=_LIMIT, markersize=7)
        else:
            # Not finite (or not recorded): a marker at the top edge says which step.
            axes.plot([entry.step], [1.0], "v", color=_LIMIT, markersize=8,
                      transform=axes.get_xaxis_transform(), clip_on=False)
            axes.annotate(
                f"step {entry.step}: non-finite", (entry.step, 1.0),
                xycoords=axes.get_xaxis_transform(), xytext=(-8, -10), textcoords="offset points",
                fontsize=_SMALL, color=_LIMIT, ha="right",
            )


#: Colours of a saved figure's palette: these plots use a handful, and a
#: palette PNG is about a third of a true-colour one. Every report saved in
#: a notebook carries its figures, so their size is the notebook's size.
_PALETTE = 64


def figure_png(figure: Figure) -> bytes:
    rendered = io.BytesIO()
    figure.savefig(rendered, format="png")
    rendered.seek(0)
    image = Image.open(rendered).convert("RGB").quantize(_PALETTE, method=Image.Quantize.MEDIANCUT)
    encoded = io.BytesIO()
    image.save(encoded, format="png", optimize=True)
    return encoded.getvalue()


@lru_cache(maxsize=16)
def histogram_png(samples: tuple[Sample, ...], zeros: bool = False) -> bytes:
    """PNG of :func:`histogram_figure`, cached: the widget and the static
    HTML of one report draw the same samples."""
    return figure_png(histogram_figure(samples, zeros))


@lru_cache(maxsize=16)
def history_png(
    history: tuple[StepSummary, ...], failing_step: int | None = None, producer: str | None = None
) -> bytes:
    return figure_png(history_figure(history, failing_step, producer))
