"""Session 29's wrong likely causes, each as the incident that showed it: the label, and the key words of the hint
(the tensor, the line, the number, the advice) a user reads, in every mode."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nan_magic

sys.path.insert(0, str(Path(__file__).parent))
from contract import MODE_OPTIONS, Case, Scenario, cause_s29, hunt_s29, source_line
from contract.loops import batches

MODES = ("default", "defer", "full", "ops", "ops-defer")


def _report(scenario: Scenario, mode: str) -> nan_magic.Report:
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(
            *scenario.targets, **{**scenario.options, **MODE_OPTIONS[mode]}):
        scenario.run()
    return caught.value.report


def _case(cases: list[Case], name: str) -> Case:
    return next(case for case in cases if case.name == name)


@pytest.mark.parametrize("mode", MODES)
def test_a_multiplier_the_loop_grows_is_not_read_as_a_learning_rate_too_high(mode: str) -> None:
    """``lam = lam * torch.exp(violation)`` under no_grad after each step overflows at step 3, and the loss
    ``mse + lam * violation`` rose with it. Every mode read learning-rate-too-high ("lower the learning rate"), though
    the model's outputs stayed near 5 while ``lam`` reached 2e25: the overflow is the loop's own value, outside the
    model. The report names it, its line and its size, and advises bounding it."""
    report = _report(hunt_s29._lagrange(math.inf), mode)
    case = _case(hunt_s29.CASES, "hunt_s29_multiplicative_lagrange_multiplier_overflows")
    _file, line = source_line(case, "multiplier")
    assert report.cause is not None
    assert (report.cause.label, report.cause.reading, report.step) == ("overflow", "outside-growth", 3)
    assert report.source is not None and report.source.lineno == line
    hint = report.cause.hint
    assert f"hunt_s29.py:{line}" in hint and "in the loop's code outside the model" in hint
    assert "`lam` = 1.97e25" in hint and "the largest output the model made" in hint
    assert "the loss rose to 6.36e26 at step 2" in hint and "to 5.15 at step 2" in hint
    assert "a lower learning rate will not stop it" in hint and "clamp it to a cap" in hint and "log space" in hint
    assert "lower the learning rate (e.g. 10x)" not in hint and "learning-rate-too-high" not in str(report.cause.label)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_made_huge_by_the_loss_code_point_at_the_loss_not_a_learning_rate(mode: str) -> None:
    """A diffusion loss ``(x_t - sqrt(1 - ab) eps) / sqrt(ab)`` with ab = 5.7e-31 is 5e29 in one step and Adam's
    exp_avg_sq overflows: the report said to clip the gradients (defer: lower the learning rate, the loss having
    "risen" 1e28-fold in one step). It says the loss was 5.18e29 while the model's outputs stayed near 1, so the
    loss's own code made it, and to bound the divisor."""
    report = _report(cause_s29._diffusion(0.0), mode)
    assert report.cause is not None and (report.phase, report.step) == ("optimizer", 1)
    assert (report.cause.label, report.cause.reading) == ("overflow", "optimizer-state-overflow-wide")
    hint = report.cause.hint
    assert "exp_avg_sq of 0.weight" in hint and "the loss was 5.22e29 in step 1 (0.0364 at step 0)" in hint
    assert "the model's outputs stayed within 1.6 " in hint and "the loss's own code after the model" in hint
    assert "alpha_bar.sqrt()" in hint and "clamp the divisor" in hint and "lower the learning rate" not in hint


@pytest.mark.parametrize("mode", MODES)
def test_a_temperature_the_loop_anneals_to_1e_24_is_named_not_the_learning_rate(mode: str) -> None:
    """``logits / tau`` with ``tau *= 1e-6`` each step: the gradients grow by 1/tau, the weights with them, and the
    loss rose 1e22-fold, so every mode read learning-rate-too-high. The divisor is named, with 1/tau against the
    model's first outputs, and the advice is a floor for it."""
    report = _report(cause_s29._temperature(0.0), mode)
    _file, line = source_line(_case(cause_s29.CASES, "cause_s29_temperature_annealed_by_1e_6_a_step"), "temperature")
    assert report.cause is not None and (report.cause.label, report.cause.reading) == ("overflow", "outside-growth")
    assert report.source is not None and report.source.lineno == line and report.step == 4
    hint = report.cause.hint
    assert f"cause_s29.py:{line}" in hint and "it divided by `tau` = 1e-24; 1 / `tau` = 1e24" in hint
    assert "a lower learning rate will not stop it" in hint and "give that divisor a floor" in hint
    assert "lower the learning rate (e.g. 10x)" not in hint


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_scale_the_loop_multiplies_each_step_is_named_not_the_learning_rate(mode: str) -> None:
    """A hand-made loss scale ``scale = scale * 1e5`` after each step (no GradScaler) overflows at step 8; the scaled
    loss had risen each step, read as divergence. The scale is named with its value and the advice is to cap it."""
    report = _report(cause_s29._loss_scale(math.inf), mode)
    _file, line = source_line(_case(cause_s29.CASES, "cause_s29_hand_made_loss_scale_grown_1e5_a_step"), "scale")
    assert report.cause is not None and (report.cause.label, report.cause.reading) == ("overflow", "outside-growth")
    assert report.source is not None and report.source.lineno == line and report.step == 8
    hint = report.cause.hint
    assert f"cause_s29.py:{line}" in hint and "`scale` = 1e35 is" in hint
    assert "the largest output the model made" in hint
    assert "a lower learning rate will not stop it" in hint and "clamp it to a cap" in hint
    assert "lower the learning rate (e.g. 10x)" not in hint


@pytest.mark.parametrize("mode", MODES)
def test_a_target_far_larger_than_the_model_outputs_is_named_not_a_growth(mode: str) -> None:
    """``mse_loss(out, y)`` with a target of 3e20 (a data export's "unknown") overflows at step 2: the hint told the
    user to find what grew the values and lower the learning rate. It names the target, its size against the model's
    outputs, and says the learning rate is not the cause."""
    report = _report(cause_s29._sentinel_target(False), mode)
    _file, line = source_line(_case(cause_s29.CASES, "cause_s29_regression_target_3e20_sentinel_squared"), "sentinel")
    assert report.cause is not None and (report.cause.label, report.cause.reading) == ("overflow", "wide-overflow")
    assert report.source is not None and report.source.lineno == line and report.step == 2
    hint = report.cause.hint
    assert "`target` = 3e20 is" in hint and "the largest output the model made in this step" in hint
    assert "a target or label in the batch" in hint and "the learning rate is not the cause" in hint
    assert "lower the learning rate" not in hint


def _diverging_weighted_loss() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    xs, ys = batches(8, 4, steps=60), batches(8, 1, steps=60)

    def run() -> None:
        for step in range(60):
            loss = ((model(xs[step]) - ys[step]) ** 2).sum() * 1e3
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


@pytest.mark.parametrize("mode", ["default", "full", "ops"])
def test_a_learning_rate_too_high_whose_overflow_is_in_the_loss_code_stays_a_learning_rate(mode: str) -> None:
    """The guard of the rules above: SGD at lr=2 diverges and the loss code's square overflows outside the model;
    its operand is the model's own output, which grew with the loss, so the reading stays the learning rate."""
    report = _report(_diverging_weighted_loss(), mode)
    assert report.cause is not None and report.module is None and report.op == "aten.pow.Tensor_Scalar"
    assert (report.cause.label, report.cause.reading) == ("learning-rate-too-high", "diverging")
    assert "the loss rose to 1.58e32 at step 3" in report.cause.hint and "lower the learning rate" in report.cause.hint
