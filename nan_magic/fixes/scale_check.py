"""Whether a remedy that made the replayed step finite left it on the healthy step's scale.

Finite is not fixed: clamping the degree of an isolated node under ``deg.pow(-0.5)`` makes ``(0 + eps) ** -0.5``
= 2896 where the op's other values are 0.7, and the node's output 1e6. Each number of the step the trial measured is
set against its healthy counterpart: the model's outputs where the unremedied replay was non-finite against its
finite ones and the last healthy step's, the loss against the last healthy step's loss, and the gradient norm (a
backward from the loss only) against the last healthy step's. Past :data:`OFF_SCALE` times the healthy value (or 1,
where that is smaller) the trial carries the ``off_scale`` fact, with the remedied op's own size where it moved the
operand against the op's other values (DomainFix's ``op_sizes``): render/fixes.py says it with the numbers, and
trial_facts.verified_first ranks it below a remedy that is finite and in scale. The op's size alone is no verdict:
a huge value the step never reads (the weight of an absent class) or reads as 0 (``0 * rsqrt(eps)``) is harmless.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from nan_magic.fixes.step import StepOutcome
from nan_magic.records import Report

__all__ = ["OFF_SCALE", "off_scale"]

#: How many times its healthy counterpart (or 1) a value of the remedied step must be to be off the healthy scale:
#: healthy steps move their loss and outputs by a few-fold; a clamp to eps multiplies by 1e3 to 1e7.
OFF_SCALE = 100.0

#: One comparison that failed: ``(what, the remedied step's value, the healthy value)``; ``what`` is ``"op"`` (the
#: remedied op's output where it moved the operand), ``"outputs"``, ``"loss"`` or ``"gradient norm"``.
Off = tuple[str, float, float]


def off_scale(report: Report, outcome: StepOutcome, base: StepOutcome | None = None,
              op_sizes: tuple[float, float] | None = None) -> tuple[Off, ...]:
    """The comparisons of a finite ``outcome`` that are off the healthy scale (empty: in scale, or not finite)."""
    if outcome.failed is not None:
        return ()
    healthy = next((step for step in reversed(report.history) if not step.nonfinite and step.step < report.step),
                   None)
    found: list[Off] = []
    if base is not None and (outputs := _repaired_outputs(base, outcome)) is not None:
        reference = max(outputs[1], healthy.absmax if healthy is not None and healthy.absmax is not None else 0.0)
        found.append(("outputs", outputs[0], reference))
    if outcome.loss is not None and healthy is not None and healthy.loss is not None:
        found.append(("loss", abs(outcome.loss), abs(healthy.loss)))
    if (outcome.loss_from is not None and outcome.grads and healthy is not None and healthy.grad_norm is not None
            and healthy.scale is None):  # (a GradScaler's step holds scaled gradients: no common scale)
        found.append(("gradient norm", _norm(outcome.grads.values()), healthy.grad_norm))
    off = [(what, value, reference) for what, value, reference in found
           if math.isfinite(value) and value > OFF_SCALE * max(reference, 1.0)]
    if off and op_sizes is not None and op_sizes[0] > OFF_SCALE * max(op_sizes[1], 1.0):
        # The op's own size, said where what the step made of it is off scale: alone it proves nothing (a weight
        # 1 / eps of a class no sample has, 0 * rsqrt(eps) of a padding row: never read, or read as 0).
        off.insert(0, ("op", *op_sizes))
    return tuple(off)


def _repaired_outputs(base: StepOutcome, outcome: StepOutcome) -> tuple[float, float] | None:
    """The largest ``|output|`` of the remedied step where the unremedied replay's was non-finite, and the largest of
    the unremedied replay's finite ones; None where no output was non-finite there (or none was compared)."""
    repaired = healthy = 0.0
    seen = False
    for path, before in base.outputs.items():
        after = outcome.outputs.get(path)
        if after is None or after.shape != before.shape:
            continue
        with torch.no_grad():
            bad = ~torch.isfinite(before)
            if bool(bad.any()):
                seen = True
                repaired = max(repaired, float(after.double().abs()[bad].max()))
            if bool((~bad).any()):
                healthy = max(healthy, float(before.double().abs()[~bad].max()))
    return (repaired, healthy) if seen else None


def _norm(grads: Iterable[torch.Tensor | None]) -> float:
    """The total L2 norm of the gradients (None: a parameter that got none), as the optimizer check reads it."""
    with torch.no_grad():
        return math.sqrt(sum(float(grad.double().pow(2).sum()) for grad in grads if grad is not None))
