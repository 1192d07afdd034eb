"""``scale``: a GradScaler whose scale overflows the gradients, tried lower on a replay of the failing step.

The watch raises ``grad-scaler-collapse`` (hot/checks/optimizer/step_checks.py) when a scaler
keeps skipping steps because its scaled gradients overflow. Where the
initial scale was only too high, a lower one makes them finite; where the
gradients overflow unscaled, no scale does. The failing step is replayed
(fixes/step.py) with the gradient its backward starts from at a few lower
scales, the failing one divided by :data:`STRIDE` at a time down to 1,
highest first, until one comes out finite: a scaler keeps the most
precision at the highest scale that does not overflow (and grows by itself
from there). The parameters' gradients are unscaled before the replayed
optimizer step, as ``scaler.step`` does.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from nan_magic.fixes.step import FailingStep, StepOutcome, replay_step
from nan_magic.records import Report

__all__ = ["STRIDE", "TRIES", "collapsed_scale", "lower_scales", "scaled", "try_scales"]

#: Each scale tried is the one before it divided by this (2**8: a float16 gradient gains 8 bits of range).
STRIDE = 2.0**8
#: At most this many scales are tried.
TRIES = 4


def collapsed_scale(report: Report) -> float | None:
    """The scale a collapsing GradScaler ran the failing step at (the cause's fact), or None."""
    if report.cause is None or report.cause.label != "grad-scaler-collapse":
        return None
    scale = dict(report.cause.facts).get("scale")
    return float(scale) if isinstance(scale, (int, float)) else None


def lower_scales(scale: float) -> list[float]:
    """The scales tried below ``scale``: divided by :data:`STRIDE` each time, down to 1, highest first."""
    scales: list[float] = []
    while len(scales) < TRIES and scale > 1.0:
        scale = max(1.0, scale / STRIDE)
        scales.append(scale)
    return scales


def scaled(step: FailingStep, old: float, new: float) -> FailingStep:
    """``step`` replayed at the scale ``new``: a held output gradient carries ``old`` already (fixes/step.py)."""
    return dataclasses.replace(step, grad_scale=(new, old))


def try_scales(step: FailingStep, old: float) -> tuple[dict[str, Any], StepOutcome | None, float]:
    """``(facts, the outcome at the last scale tried, seconds)``: the first finite scale, or every one failing.

    ``step`` already carries ``old`` (``scaled(step, old, old)``).
    """
    start = time.perf_counter()
    tried: list[float] = []
    outcome = None
    for new in lower_scales(old):
        outcome = replay_step(scaled(step, old, new), None, None)
        tried.append(new)
        if outcome.failed is None:
            break
    facts = {"scale": old, "new_scale": tried[-1] if outcome is not None and outcome.failed is None else None,
             "tried": tuple(tried)}
    return facts, outcome, time.perf_counter() - start
