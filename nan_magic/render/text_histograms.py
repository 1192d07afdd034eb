"""The report's histograms in plain text: one row per value the producer read or made, for a terminal.

The figures (plots.py) are the widget's and the HTML's; a terminal, a log or ``print(report)`` had none, only each
input's range. Here each of the producer's samples (its op's operands and output, its module's inputs and output,
in the order render/common.py's ``labelled_samples`` tells them) is one row: its finite values in bins, each bin a
bar of eight heights on a log scale as the figures' axes, and its non-finite counts apart, as the red bars.
Stdlib only, as text.py.
"""

from __future__ import annotations

import math

from nan_magic.records import Report, Sample
from nan_magic.render.common import fmt_number, labelled_samples

__all__ = ["TEXT_BINS", "histograms_text"]

#: Bins of a text histogram: its row fits an 80-column terminal beside its counts.
TEXT_BINS = 24
#: An empty bin, then eight heights.
_BARS = " \u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"


def histograms_text(report: Report) -> str:
    """The "Histograms" section of the text report; empty where no sample of the producer was recorded.

    Each value is two lines: its label as the figures title it (whole: the user's expression comes first, the op or
    module it belongs to last), then its bars and its counts.
    """
    samples = [sample for sample in labelled_samples(report) if sample.producer]
    if not samples:
        return ""
    lines = [f"Histograms of the producer's values (finite values in {TEXT_BINS} bins, log scale; non-finite apart):"]
    for sample in samples:
        lines.append(f"  {sample.label}")
        lines.append(f"      {_bars(sample)}   {_counts(sample)}")
    return "\n".join(lines)


def _finite(sample: Sample) -> int:
    return sample.numel - sum(count or 0 for count in (sample.nan, sample.posinf, sample.neginf))


def _bars(sample: Sample) -> str:
    """``-1.28 |▁▃▆█▅▂ ▁| 1.28``: the finite values' bins; a tensor of one value or none says so."""
    values = sample.values
    if not values:
        return "no finite value"
    low, high = min(values), max(values)
    if low == high:
        return f"every finite value is {fmt_number(low)}"
    # The values are a strided sample: weighed back to the tensor's counts, as the figures do.
    weight = max(_finite(sample), len(values)) / len(values)
    counts = [0] * TEXT_BINS
    span = high - low
    for value in values:
        counts[min(int((value - low) / span * TEXT_BINS), TEXT_BINS - 1)] += 1
    top = math.log1p(max(counts) * weight)
    heights = [0 if count == 0 else max(1, round(math.log1p(count * weight) / top * 8)) for count in counts]
    return f"{fmt_number(low)} |{''.join(_BARS[height] for height in heights)}| {fmt_number(high)}"


def _counts(sample: Sample) -> str:
    """``float32, 20 finite of 32; 12 nan``: what the bars count and what they leave out."""
    bad = [
        f"{count} {kind}"
        for kind, count in (("nan", sample.nan), ("+inf", sample.posinf), ("-inf", sample.neginf))
        if count
    ]
    zeros = f", {sample.zeros} exactly 0" if sample.zeros else ""
    return f"{sample.dtype}, {_finite(sample)} finite of {sample.numel}{zeros}" + (f"; {', '.join(bad)}" if bad else "")
