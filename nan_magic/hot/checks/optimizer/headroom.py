"""Copies, before an optimizer step, of the half-precision parameters that came near their dtype's limit.

A float16 parameter that a step pushes past 65504 by addition
(``p.add_(update)``) is infinite after it, and its finite value before is
gone: the replay that names the step's op (localize/replay/optimizer.py)
would start from 0 there and stay finite. Keeping a copy of every parameter
before every step would cost every healthy step a pass over the model; only
a parameter whose norm, read by the step check after the last step (step_checks.py,
no extra read), came within a factor of :data:`HEADROOM` of its dtype's
largest value is copied, before each step until it moves away from it. A
parameter far from the limit can only overflow by an update near the limit
itself, which the replay from 0 reproduces (a huge learning rate).
Float32 and float64 parameters are never copied (their limit is 3.4e38).
"""

from __future__ import annotations

import math

import torch

from nan_magic.hot.checks.optimizer.step_layout import StepResult

__all__ = ["HEADROOM", "Headroom"]

#: A parameter whose norm is within this factor of its dtype's largest finite value is at risk.
HEADROOM = 4.0


class Headroom:
    """Which half-precision parameters of each optimizer are near their limit, and their copies before a step."""

    def __init__(self) -> None:
        #: id(optimizer) -> parameters near the limit (read before :meth:`copies`: empty, the usual, costs no call).
        self.at_risk: dict[int, list[torch.Tensor]] = {}

    def observe(self, result: StepResult, values: list[float]) -> None:
        """A step's result judged finite: note its parameters whose norm (``values``) came near the limit."""
        opt = id(result.optimizer)
        if result.layout.wide:  # float32 and float64 only
            self.at_risk.pop(opt, None)
            return
        near = [
            parameter
            for (_name, parameter), value in zip(result.layout.named, values)
            if parameter.dtype.is_floating_point and parameter.dtype.itemsize < 4
            # A norm that overflowed its own dtype (inf, of finite values) is near the limit too.
            and not value < torch.finfo(parameter.dtype).max / HEADROOM
            and not math.isnan(value)
        ]
        if near:
            self.at_risk[opt] = near
        else:
            self.at_risk.pop(opt, None)

    def copies(self, opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
        """Copies of ``opt``'s parameters near the limit, by parameter id, taken now (before its step)."""
        at_risk = self.at_risk.get(id(opt))
        if not at_risk:
            return {}
        with torch.no_grad():
            return {id(parameter): parameter.detach().clone() for parameter in at_risk}
