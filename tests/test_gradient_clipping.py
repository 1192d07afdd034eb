"""A non-finite gradient that clipping rewrote before the optimizer's check: still named where backward made it.

``clip_grad_norm_`` multiplies every gradient by ``max_norm / total``: where the total
is inf the factor is 0 (an inf element becomes NaN, a NaN stays NaN, finite ones 0),
where it is NaN every element becomes NaN. The check before the optimizer step sees
those gradients; the step's replay makes the ones backward made, which differ in
their counts but not in where they came from.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient's first feature by ``gain / 0``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, gain: float) -> torch.Tensor:
        ctx.gain = gain  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = torch.tensor([0.0, 1.0, 1.0, 1.0])
        return grad * ctx.gain / scale, None  # type: ignore[attr-defined]  # producer: gradient over scale


class _GradientFault(nn.Module):
    """Passes its input on; at the step it is armed for, its backward divides the first feature's gradient by 0."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledGradient.apply(x, self.gain) if self.armed else x


def _train(gain: float, clip: bool, options: dict[str, bool], layers_before: int = 1) -> nan_magic.Report:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers_before)], _GradientFault(gain), nn.Linear(4, 1))
    fault = model[layers_before]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            fault.armed = step == 2
            loss = model(torch.randn(2, 4)).mean()
            opt.zero_grad()
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return caught.value.report


def _assert_named_at_the_fault(report: nan_magic.Report, module: str) -> None:
    assert (report.phase, report.module, report.step, report.op) == ("backward", module, 2, "aten.div.Tensor")
    assert str(report.tensor) == "grad of input[0]"
    assert report.source is not None
    assert report.source.lineno == marked_line("gradient over scale", where=sys.modules[__name__])
    assert report.reproduced is True


@pytest.mark.parametrize("options", TIMINGS)
@pytest.mark.parametrize("clip", [False, True], ids=["unclipped", "clipped"])
def test_an_inf_gradient_that_sums_to_nan_and_inf_is_named_where_backward_made_it(options, clip) -> None:
    # The weight's gradient sums the products of an inf feature over the batch: some elements +-inf, some
    # inf - inf = NaN; clipping (total norm inf) turns them all into NaN and the finite ones into 0.
    report = _train(1.0, clip, options)
    _assert_named_at_the_fault(report, "1")
    assert report.cause is not None and report.cause.label == "division-by-zero"


@pytest.mark.parametrize("options", TIMINGS)
@pytest.mark.parametrize("clip", [False, True], ids=["unclipped", "clipped"])
def test_a_nan_gradient_that_clipping_spread_to_every_element_is_named_where_backward_made_it(options, clip) -> None:
    # 0 / 0 in one feature's gradient: NaN in one row of the weight before it, the rest finite. Total norm
    # NaN: clipping multiplies every gradient by NaN, the finite elements and the layers the NaN never reached
    # too.
    report = _train(0.0, clip, options)
    _assert_named_at_the_fault(report, "1")
    assert report.cause is not None and report.cause.label == "division-by-zero"
