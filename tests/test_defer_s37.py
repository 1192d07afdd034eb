"""The deferred watch (``defer=True``, every GPU user's) names what the immediate one names (defer-s37).

scripts/defer_diff.py lists the contract rows whose reports differ between the two timings; these hold fixed the
ones where the deferred report was the worse: an optimizer step that made its state non-finite from its own huge
gradient (the deferred check replayed it with the next step's gradient and named no op).
"""

from __future__ import annotations

import pytest
import torch
from contract import Case, all_cases
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Report

_ROWS = {case.name: case for case in all_cases()}


def _report(case: Case, **options: object) -> Report:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    return caught.value.report


# -- 1. a step whose own huge gradient overflowed its state: read while that gradient is in place --------------------

def test_the_deferred_check_names_the_op_of_a_step_whose_state_its_own_gradient_overflowed() -> None:
    """x0 / sqrt(alpha_bar = 5.7e-31): gradients of 1e28, whose square overflows Adam's exp_avg_sq at step 1. The
    deferred check replayed the step at step 2 with step 2's gradient (finite square): no op. Now it names Adam's
    ``addcmul_`` at the loop's ``opt.step()``, as the immediate watch does."""
    case = _ROWS["cause_s29_diffusion_x0_over_sqrt_alpha_bar_5_7e_31"]
    now, late = _report(case), _report(case, defer=True)
    assert now.op == "aten.addcmul_.default"
    assert (late.phase.value, late.module, late.step, late.op) == ("optimizer", "0", 1, "aten.addcmul_.default")
    assert late.source is not None and now.source is not None
    assert (late.source.lineno, late.source.line) == (now.source.lineno, now.source.line)
    assert "opt.step()" in late.source.line


def _huge_gradient_step(make: type[torch.optim.Optimizer], **hyper: float) -> tuple[nn.Module, object, list[int]]:
    """A loss scaled by 1e22 at step 1 (a hand-made scale gone wrong): a gradient of about 1e22, squared 1e44, past
    float32's max on any kernel; the other steps are ordinary, so a replay with their gradient stays finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = make(model.parameters(), **hyper)
    xs = [torch.rand(8, 4) + 0.5 for _ in range(4)]
    lines: list[int] = []

    def run() -> None:
        import inspect
        for step in range(4):
            loss = model(xs[step]).sum() * (1e22 if step == 1 else 1.0)
            opt.zero_grad()
            loss.backward()
            lines.append(inspect.currentframe().f_lineno + 1)  # type: ignore[union-attr]
            opt.step()

    return model, opt, run, lines  # type: ignore[return-value]


@pytest.mark.parametrize(("make", "hyper"), [
    (torch.optim.RMSprop, {"lr": 1e-3}),  # square_avg.addcmul_(grad, grad)
    (torch.optim.Adagrad, {"lr": 1e-2}),  # state_sum.addcmul_(grad, grad)
    (torch.optim.AdamW, {"lr": 1e-3, "foreach": False}),  # exp_avg_sq, as the diffusion row's Adam
])
def test_a_huge_gradients_step_is_replayed_with_its_own_gradient_deferred(make: type, hyper: dict) -> None:
    reports = []
    for options in ({}, {"defer": True}):
        model, opt, run, lines = _huge_gradient_step(make, **hyper)
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
            run()
        reports.append((caught.value.report, lines[-1]))
    (now, _), (late, line) = reports
    assert (now.phase.value, now.step, now.op) == ("optimizer", 1, "aten.addcmul_.default")
    assert (late.phase.value, late.module, late.step, late.op) == (now.phase.value, now.module, 1, now.op)
    assert late.source is not None and late.source.lineno == line
