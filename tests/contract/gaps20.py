"""Forwards that write their own parameters in place, beyond hunt17's max-norm row, and a NaN made by a parameter's
own gradient formula (gaps20).

A Keras-style max-norm constraint written through ``.data`` (no version counter moves: learned by the parameters'
norms at the model's first call), the same constraint applied only once a row exceeds the limit (nothing written at
the first call: a strict xfail), and an ``nn.Embedding(max_norm=...)`` whose lookups renormalise its rows at every
call (a healthy idiom: calm and bit-identical). ``sqrt(|x * w|)`` at a zero batch: the gradient into the module's
input is not asked for (the batch needs none), only ``w``'s own formula makes 0 / 0; with ``ops=True`` its gradient
reached ``.grad`` reshaped from the sum that made it (another tensor on the same memory), and the tracer found no op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


class KerasMaxNorm(nn.Linear):
    """A Linear under Keras' ``max_norm`` constraint, ``w * (desired / (eps + norms))``, applied through ``.data`` at
    each training call (as ports of Keras code write it); ``always``: at every call, else once a row exceeds it."""

    def __init__(self, eps: float, always: bool) -> None:
        super().__init__(4, 3)
        self.eps, self.always = eps, always

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            norms = self.weight.detach().norm(dim=1, keepdim=True)
            if self.always or bool((norms > 1.0).any()):
                desired = norms.clamp(max=1.0)
                self.weight.data.mul_(desired / (self.eps + norms))  # producer: keras max norm
        return super().forward(x)


def _keras_max_norm(eps: float, always: bool) -> Scenario:
    """At step 2 row 1 of the weight is 0 (a pruned unit) and row 0 over the limit: 0 / 0 scales row 1 by NaN. With
    ``always``, the first call's rows are over the limit (weights scaled by 3): the write changes their norms."""
    torch.manual_seed(0)
    model = nn.Sequential(KerasMaxNorm(eps, always), nn.Tanh(), nn.Linear(3, 1))
    if always:
        with torch.no_grad():
            model[0].weight.mul_(3.0)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model[0].weight[1] = 0.0
                model[0].weight[0] = 2.0
        return (xs[step],)

    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def _embedding_max_norm() -> Scenario:
    """Lookups renormalise the rows they read (``embedding_renorm_``, in place): trained by SGD, calm."""
    torch.manual_seed(0)
    model = BagOfWords()
    with torch.no_grad():
        model.embed.weight.mul_(3.0)
    tokens = [torch.randint(0, 10, (5, 6)) for _ in range(4)]
    ys = _batches(5, 1)
    return _loop(model, lambda step: (tokens[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.1)


class RootOfScaled(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * self.w).abs() + self.eps).sqrt()  # producer: root of scaled


def _root_of_scaled(eps: float) -> Scenario:
    """At step 2 the batch is all zeros: sqrt's backward divides 0 by 0, NaN in ``w``'s gradient alone."""
    torch.manual_seed(0)
    model = nn.Sequential(RootOfScaled(eps), nn.Linear(4, 1))
    xs = [torch.rand(3, 4) * (step != 2) for step in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: out.pow(2).mean(), lr=0.0)


CONDITIONAL_WRITE_GAP = (
    "the forward writes its weight through .data only once a row exceeds the limit: its first call (under the limit) "
    "writes nothing, so the parameters it writes are not learned (hot/kept/parameter_writes.py learns them at a "
    "model's first call in each mode: a version counter moved, or a norm changed) and no value from before the "
    "failing call is kept; the replay starts from the NaN row the write left: op None, cause "
    "parameter-already-nonfinite, whose hint says it was written outside every watched step (wrong here). Learning "
    "from later calls would not help: a write through .data moves no version counter (gaps21 learns an input written "
    "in place that way, hot/kept/input_writes.py), and a norm per parameter per call would cost every healthy step; "
    "the first write is the failing call in any case. The op tracer (ops=True) sees the write"
)

CASES = [
    Case(
        "gaps20_keras_max_norm_through_data_of_a_zero_row",
        lambda: _keras_max_norm(0.0, True),
        Expect(
            "forward",
            "0",
            "KerasMaxNorm",
            step=2,
            op="aten.div.Tensor",
            marker="keras max norm",
            cause="division-by-zero",
        ),
    ),
    Case("gaps20_keras_max_norm_through_data_with_eps_healthy", lambda: _keras_max_norm(1e-7, True), None),
    Case(
        "gaps20_keras_max_norm_once_over_the_limit_of_a_zero_row",
        lambda: _keras_max_norm(0.0, False),
        Expect(
            "forward", "0", "KerasMaxNorm", step=2, op="aten.div.Tensor", marker="keras max norm", op_modes=("ops",)
        ),
        note=CONDITIONAL_WRITE_GAP,
    ),
    Case(
        "gaps20_keras_max_norm_once_over_the_limit_op_and_line",
        lambda: _keras_max_norm(0.0, False),
        Expect("forward", "0", "KerasMaxNorm", step=2, op="aten.div.Tensor", marker="keras max norm"),
        modes=("default", "defer", "full"),
        marks=(pytest.mark.xfail(strict=True, reason=CONDITIONAL_WRITE_GAP),),
    ),
    Case("gaps20_keras_max_norm_once_over_the_limit_with_eps_healthy", lambda: _keras_max_norm(1e-7, False), None),
    Case("gaps20_embedding_max_norm_renormalised_in_place_healthy", _embedding_max_norm, None),
    # (ops=True, ops+defer: op None, no line, before origins.reshaped_entry.)
    Case(
        "gaps20_parameters_own_gradient_formula_sqrt_at_a_zero_batch",
        lambda: _root_of_scaled(0.0),
        Expect(
            "backward", "0", "RootOfScaled", step=2, op="aten.div.Tensor", marker="root of scaled", cause="sqrt-domain"
        ),
    ),
    Case("gaps20_parameters_own_gradient_formula_with_eps_healthy", lambda: _root_of_scaled(1e-8), None),
]
