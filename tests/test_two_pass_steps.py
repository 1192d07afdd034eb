"""Steps that run the model more than once per optimizer step: LBFGS (forward and backward inside
``opt.step(closure)``, several times) and a SAM-style step (a second forward at perturbed weights). The step is the
loop's iteration, the module and op are the producer's, and the healthy runs are silent, in every mode."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.watching import FIVE_MODES as MODES
from tests.watching import LogWhenTold


def lbfgs(options: dict, nan_at: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogWhenTold(), nn.Linear(4, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with nan_magic.watch(model, opt, **options):
        for step in range(6):
            model[1].fire = step == nan_at

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)


def sam(options: dict, nan_at: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogWhenTold(), nn.Linear(4, 1))
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, base, **options):
        for step in range(6):
            x = torch.randn(8, 4)
            model[1].fire = False
            model(x).pow(2).mean().backward()
            with torch.no_grad():  # to the worst nearby weights, w + e(w)
                eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps):
                    p.add_(e)
            base.zero_grad()
            model[1].fire = step == nan_at  # the second pass's forward
            model(x).pow(2).mean().backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps):
                    p.sub_(e)
            base.step()
            base.zero_grad()


@pytest.mark.parametrize("run", [lbfgs, sam], ids=["lbfgs", "sam"])
@pytest.mark.parametrize("options", MODES)
def test_a_nan_in_a_step_that_runs_the_model_twice_is_named_at_its_iteration(options, run) -> None:
    with pytest.raises(NonFiniteError) as caught:
        run(options, nan_at=3)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "1", 3, "aten.log.default")


@pytest.mark.parametrize("run", [lbfgs, sam], ids=["lbfgs", "sam"])
@pytest.mark.parametrize("options", MODES)
def test_healthy_steps_that_run_the_model_twice_are_silent(options, run) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", nan_magic.NanMagicWarning)  # no early warning either
        run(options, nan_at=None)
