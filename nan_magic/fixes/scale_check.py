"""Whether a remedy that made the replayed step finite left it on the healthy step's scale.

Finite is not fixed: clamping the degree of an isolated node under ``deg.pow(-0.5)`` makes ``(0 + eps) ** -0.5``
= 2896 where the op's other values are 0.7, and the node's output 1e6. The model's outputs where the unremedied
replay was non-finite are set against that replay's finite outputs of the same call; past :data:`OFF_SCALE` times
those (or 1, where that is smaller) the trial carries the ``off_scale`` fact, with the remedied op's own size where it
moved the operand against the op's other values (DomainFix's ``op_sizes``): render/fixes.py says it with the
numbers, and trial_facts.verified_first ranks it below a remedy that is finite and in scale. The op's size alone is
no verdict: a huge value the step never reads (the weight of an absent class) or reads as 0 (``0 * rsqrt(eps)``) is
harmless.
"""
from __future__ import annotations

import math

import torch

from nan_magic.fixes.step import StepOutcome

__all__ = ["OFF_SCALE", "off_scale"]

#: How many times its healthy counterpart (or 1) a value of the remedied step must be to be off the healthy scale:
#: healthy steps move their loss and outputs by a few-fold; a clamp to eps multiplies by 1e3 to 1e7.
OFF_SCALE = 100.0

#: One comparison that failed: ``(what, the remedied step's value, the healthy value)``; ``what`` is ``"op"`` (the
#: remedied op's output where it moved the operand), ``"outputs"``, ``"loss"`` or ``"gradient norm"``.
Off = tuple[str, float, float]


def off_scale(outcome: StepOutcome, base: StepOutcome | None = None,
              op_sizes: tuple[float, float] | None = None) -> tuple[Off, ...]:
    """The comparisons of a finite ``outcome`` that are off the healthy scale (empty: in scale, or not finite).

    Only what the step itself holds is compared: where the unremedied replay's outputs were non-finite, the remedied
    ones against that replay's finite outputs of the same call. A whole-step total (the loss, the gradient norm)
    against an earlier step is no measure of the remedy: a sum-reduced loss of a larger batch, a term annealed in, a
    GAN's or an RL loss move 100x between healthy steps (review of hunt-c-s42); and where the call has no finite
    output to compare with (a model that returns its scalar loss, every value non-finite) nothing is said."""
    if outcome.failed is not None or base is None:
        return ()
    outputs = _repaired_outputs(base, outcome)
    if outputs is None or outputs[1] == 0.0:
        return ()
    value, reference = outputs
    if not (math.isfinite(value) and value > OFF_SCALE * max(reference, 1.0)):
        return ()
    off: list[Off] = [("outputs", value, reference)]
    if op_sizes is not None and op_sizes[0] > OFF_SCALE * max(op_sizes[1], 1.0):
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
