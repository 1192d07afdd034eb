"""A physics-informed net whose Laplacian is ``torch.func.vmap(torch.func.hessian(u))`` in the loss code.

The net's polar features take ``r = sqrt(x^2 + y^2)`` by hand; at step 2 a collocation point is the centre, where
the derivative of ``r`` is 0 / 0: the Hessian holds NaN, the loss is NaN. Under ``ops=True`` the op tracer read the
memory of a value torch.func made (no storage to read: "Attempted to access the data pointer on an invalid python
storage") and the watch raised that RuntimeError out of the user's ``loss.backward()`` instead of its report.
"""
from __future__ import annotations

import pytest
import torch
from contract import MODE_OPTIONS
from contract.hunt_s47b import PolarFeatures
from test_contract import same
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Phase


def _pinn(eps: float):
    torch.manual_seed(0)
    model = nn.Sequential(PolarFeatures(eps), nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    points = [torch.rand(16, 2) * 2 - 1 for _ in range(4)]
    points[2][5] = 0.0

    def u_of(point: torch.Tensor) -> torch.Tensor:
        return model(point[None]).squeeze()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            hessians = torch.func.vmap(torch.func.hessian(u_of))(points[step])
            laplacian = hessians.diagonal(dim1=-2, dim2=-1).sum(-1)
            loss = ((laplacian - 1.0) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return model, opt, run


@pytest.mark.parametrize("mode", ["ops", "ops-defer"])
def test_ops_mode_reports_the_nan_hessian_instead_of_raising_its_own_error(mode: str) -> None:
    model, opt, run = _pinn(0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        run()
    report = caught.value.report
    assert (report.phase, report.step) == (Phase.BACKWARD, 2), report.message


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_the_radius_with_eps_is_silent_and_bit_identical(mode: str) -> None:
    expected = _pinn(1e-12)[2]()
    model, opt, run = _pinn(1e-12)
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        got = run()
    assert w.report is None and same(got, expected)


@pytest.mark.parametrize("mode", ["default", "defer", "full"])
@pytest.mark.xfail(strict=True, reason=(
    "the recorded modes report the NaN Hessian as data (a tensor 'no watched code produced' that entered the loss "
    "code, cause bad-input-data: 'check how the targets ... were made'), where it is a derivative of the model "
    "(PolarFeatures' sqrt at the centre), phase backward: at backward's start the walk of the loss's graph for data "
    "the loss code read (outside/entering.py) finds a NaN tensor a node torch.func made saved, which no watched "
    "code saw, and takes it for data"))
def test_the_recorded_modes_do_not_blame_the_data_for_a_nan_derivative(mode: str) -> None:
    model, opt, run = _pinn(0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        run()
    report = caught.value.report
    assert report.phase != Phase.DATA and report.cause is not None and report.cause.label != "bad-input-data"
