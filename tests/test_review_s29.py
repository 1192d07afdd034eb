"""Regressions found by session 29's reviews of merged work, each asserting what the user reads."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.render.text import render_text


@pytest.mark.parametrize(("function", "threshold"), [
    ("exp", math.log(torch.finfo(torch.float32).max)),
    ("expm1", math.log(torch.finfo(torch.float32).max)),
    ("exp2", math.log2(torch.finfo(torch.float32).max)),
    ("sinh", math.log(2 * torch.finfo(torch.float32).max)),
    ("cosh", math.log(2 * torch.finfo(torch.float32).max)),
])
def test_an_exp_like_overflow_names_its_function_and_its_own_threshold(function: str, threshold: float) -> None:
    # Every exp-like op said "exp(x) is inf for x > 88.72": exp2 overflows past 128, sinh and cosh past 89.4.
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.mul_(100)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, ops=True):
        y = getattr(model(torch.randn(4, 3) * 10), function)()
        (y / y.sum()).mean().backward()
    report = caught.value.report
    assert report.op == f"aten.{function}.default"
    assert report.cause is not None and report.cause.label == "exp-overflow"
    assert report.cause.fact("threshold") == pytest.approx(threshold)
    x = "|x|" if function in ("sinh", "cosh") else "x"
    assert f"{function}(x) is inf for {x} > {threshold:.4g}" in " ".join(render_text(report).split())


@pytest.mark.parametrize("options", [{"defer": True}, {"ops": True, "defer": True}], ids=["defer", "ops-defer"])
def test_a_rate_computed_from_a_constant_tensor_is_not_set_at_the_constants_line(options: dict) -> None:
    # (review of defer-s29: the deferred check took the one tensor-valued name on the ``group["lr"] = ...`` line for
    # the rate the loop rebinds each step, and named ``base_lr = torch.tensor(0.01)``, a finite constant, with %debug
    # there: a name only counts where the line stores it as it is)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.01))
    base_lr = torch.tensor(0.01)
    constant_line = test_a_rate_computed_from_a_constant_tensor_is_not_set_at_the_constants_line.__code__.co_firstlineno
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(6):
            warm = float("nan") if step == 2 else 1.0
            opt.param_groups[0]["lr"] = base_lr * warm
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step) == ("optimizer", 2)
    assert report.source is None or "base_lr = torch.tensor" not in (report.source.line or "")
    assert report.source is None or report.source.lineno != constant_line + 7


class _RaisingRoot(torch.autograd.Function):
    """sqrt(|x|) whose backward raises once its denominator has no zero left (as a remedy's eps leaves it): any
    user backward that raises in a fix trial."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.abs().sqrt()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        out = grad * x.sign() / (2 * x.abs().sqrt())
        if bool((x == 0).any()) and bool(torch.isfinite(out).all()):
            raise RuntimeError("the denominator no longer matches x")
        return out


class _Rooted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 1)
        self.register_buffer("keep", torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_RaisingRoot.apply(self.lin(x) * self.keep))


@pytest.mark.parametrize("default_device", [False, True], ids=["no-mode", "set_default_device"])
def test_a_fix_trial_whose_custom_backward_raises_leaves_the_users_mode_stack(default_device: bool) -> None:
    # (review of fixes-s29: autograd restores the function-mode stack when a node raises; the trial's clean-up then
    # popped once more: the user's set_default_device mode was gone after the watch, or every trial was lost to
    # "trying to pop from empty mode stack")
    from torch.overrides import _get_current_function_mode_stack

    context = torch.device("cpu") if default_device else contextlib.nullcontext()
    with context:
        before = list(_get_current_function_mode_stack())
        torch.manual_seed(0)
        model = _Rooted()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt):
            for _ in range(3):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        assert list(_get_current_function_mode_stack()) == before
    trials = {trial.kind: trial for trial in caught.value.report.fixes}
    assert trials["eps"].finite is False and trials["eps"].failed == "raised"
    assert trials["eps"].error is not None and "no longer matches" in str(trials["eps"].error)


class _Powered(nn.Module):
    def __init__(self, exponent: float) -> None:
        super().__init__()
        self.lin, self.exponent = nn.Linear(4, 4), exponent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(self.exponent)


@pytest.mark.parametrize(("exponent", "shown"), [(1 - 1e-13, "0.9999999999999"), (1 - 0.999, "0.001")])
def test_a_python_number_the_producer_read_is_shown_to_15_digits(exponent: float, shown: str) -> None:
    # (review of user-s29: to 12 digits, an exponent of 1 - 1e-13, which gives NaN on a negative base, read "1.0";
    # 15 digits still show Adam's 1 - beta2 as the 0.001 the user wrote)
    torch.manual_seed(0)
    model = _Powered(exponent)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, ops=True):
        for _ in range(2):
            model(torch.randn(2, 4))
    assert f"exponent: {shown} (a Python number)" in caught.value.report.to_text()


class _SpecialLogit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.logit(torch.sigmoid(self.lin(x) * 100))


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True}],
                         ids=["default", "defer", "full", "ops"])
def test_torch_special_logit_gets_the_clamp_like_torch_logit(options: dict) -> None:
    # (review of fixes-s29: "eps ... -> not tried: it found nothing to change at the producer's line", on a logit line)
    torch.manual_seed(0)
    model = _SpecialLogit()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _ in range(2):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    trials = {trial.kind: trial for trial in caught.value.report.fixes}
    assert trials["eps"].finite is True and trials["eps"].fact("function") == "logit"


def test_a_filtered_layer_table_still_names_the_model_of_each_row() -> None:
    # (review of user-s29: whether rows say "in G" was told from the rows shown: the widget's filter left one model's
    # rows, and they lost the model's name)
    from nan_magic.render.widget import LayersView

    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    discriminator = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid())
    with torch.no_grad():
        discriminator[2].weight.mul_(1e4)
        discriminator[2].bias.fill_(1e4)
    opt = torch.optim.SGD([*generator.parameters(), *discriminator.parameters()], lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(generator, discriminator, opt):
        for _ in range(3):
            opt.zero_grad()
            torch.log(1 - discriminator(generator(torch.randn(4, 8)))).mean().backward()
            opt.step()
    layers = tuple(caught.value.report.layers)
    models = sorted({layer.model for layer in layers if layer.model is not None})
    assert len(models) == 2
    view = LayersView(layers, 0, 100)
    view.filter.value = models[1].lower()
    shown = view.rows()
    assert shown and all(layer.model == models[1] for layer in shown if layer.model is not None)
    assert f"in {models[1]}" in view.table.value


_EVERY_MODE = pytest.mark.parametrize("options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True},
                                                  {"ops": True, "defer": True}],
                                      ids=["default", "defer", "full", "ops", "ops-defer"])


@_EVERY_MODE
def test_a_linear_probe_the_loop_applies_diverging_is_a_learning_rate_too_high(options: dict) -> None:
    # (review of cause-s29: a head applied in the loop's code, ``feats @ w`` with w trained at too high a rate over
    # a Tanh's bounded outputs, was read as "a value the loop computes itself ... a lower learning rate will not stop
    # it": only a single number the loop carries (a multiplier, a scale, a temperature) is such a value)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
    w = nn.Parameter(torch.randn(16, 1) * 0.1)
    opt = torch.optim.SGD([w], lr=2.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _ in range(200):
            loss = torch.nn.functional.mse_loss(model(torch.randn(32, 4)) @ w, torch.randn(32, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    cause = caught.value.report.cause
    assert cause is not None and (cause.label, cause.reading) == ("learning-rate-too-high", "diverging")
    assert "will not stop it" not in cause.hint


@_EVERY_MODE
def test_the_square_of_a_huge_output_is_not_called_a_value_the_model_did_not_grow(options: dict) -> None:
    # (review of cause-s29: ``(out - y).pow(2).mean()`` over outputs of 1e18 said the square "is 1.2e18x the largest
    # output ... so the model did not grow it: ... a target or label in the batch"; only a loss's target is such)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e17)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        squared = (model(torch.ones(4096, 4)) - torch.randn(4096, 1)).pow(2)
        squared.mean().backward()
    cause = caught.value.report.cause
    assert cause is not None and cause.fact("far_operand") is None
    assert "did not grow it" not in cause.hint and "a target or label" not in cause.hint
