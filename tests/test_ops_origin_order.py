"""Under ops=True, a value that several origins reach carries the first-born one (the producer is where the
first non-finite value appeared), in both timings."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line


def producer_line(marker: str) -> int:
    return marked_line(marker, where=sys.modules[__name__])


class GaussianHead(nn.Module):
    """A Gaussian negative log-likelihood by hand: ``(x - mu)**2 / (2 var) + log(scale)``, written term by term."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        log_scale = torch.log(scale)  # producer: log of the scale
        return (x ** 2 / (2 * scale ** 2) + log_scale).mean()


@pytest.mark.parametrize("options", [pytest.param({"ops": True}, id="ops"),
                                     pytest.param({"ops": True, "defer": True}, id="ops-deferred")])
def test_under_ops_a_value_two_origins_reach_carries_the_first_born(options) -> None:
    # scale 0: log(0) = -inf first, then x**2 / 0 = +inf; their sum is NaN at the loss. The op tracer used to
    # name the origin of the sum's first operand (the division); the log was born first.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    head = GaussianHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            scale = torch.full((8, 4), 0.0 if step == 2 else 1.0)
            loss = head(model(torch.randn(8, 4)), scale)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("forward", 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("log of the scale")


@pytest.mark.parametrize("options", [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred"),
                                     pytest.param({"ops": True}, id="ops"),
                                     pytest.param({"ops": True, "defer": True}, id="ops-deferred")])
def test_of_several_overflowed_gradients_the_first_computed_is_named(options) -> None:
    # A float16 model whose input jumps to 6e4: both weights' gradients overflow in one backward, which
    # computes the last layer's first. The optimizer's check used to name the first in its parameter order
    # (0.weight) under ops=True; the default watch's replay named 1.weight, the first born.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 4), nn.Linear(4, 1)).to(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            x = torch.rand(3, 64, dtype=torch.float16) * (6e4 if step == 2 else 1)
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.module, report.op) == ("backward", 2, "1", "aten.mm.default")
    assert str(report.tensor) == "gradient of 1.weight"


class SaturatedFeatures(nn.Module):
    """Features ``sigmoid(exp(100 h))`` (the exp overflows, the sigmoid makes it 1) beside the log of a scale."""

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        saturated = torch.sigmoid(torch.exp(h.detach() * 100.0))
        features = torch.cat([saturated, scale.log()], dim=1)  # producer: cat of saturated and log
        return (features * h.sum(1, keepdim=True)).mean()


@pytest.mark.parametrize("options", [pytest.param({"ops": True}, id="ops"), pytest.param({"mode": "full"}, id="full"),
                                     pytest.param({}, id="default")])
def test_a_finite_value_a_passive_op_made_of_an_origin_carries_it_no_further(options) -> None:
    """``sigmoid`` of an overflowed ``exp`` is 1, finite; the tracer carried the exp's origin onto it (a passive op
    passes its input's on), and ``cat`` of it beside a ``log(0)`` carried the first-born of its inputs' origins: the
    exp's, born first, though none of the output's non-finite values came from it. Only an input holding a
    non-finite value passes its origin on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    head = SaturatedFeatures()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            scale = torch.full((8, 1), 0.0 if step == 2 else 1.0)
            loss = head(model(torch.randn(8, 4) * 10), scale)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("forward", 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("cat of saturated and log")
