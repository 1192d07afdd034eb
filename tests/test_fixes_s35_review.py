"""The review of fixes-s35 (a division by a std, variance or norm of 0): what it got wrong, each a user's case.

Was: (1) the eps trial added eps to a spread of 0 wherever it was 0 everywhere, and said "verified" with no warning
even where the numerator was not 0 (x / 0: ``mse / y.var()`` of equal targets, a Sharpe ratio of equal non-zero
returns): ``x / (var + 1.2e-7)`` is x * 8e6, and by hand the loss went 9e7, 5e18, 3e29, inf, nan. Now only a centred
0 / 0 gets eps added; x / 0 is clamped as before, "hidden, not fixed", and the hint says an eps does not fix it.
(2) the loss code's count of nothing read as a spread (``mask.sum().sqrt()``, ``mask.norm(p=1)``, std_mean's mean);
(3) in a model, std_mean's / var_mean's mean (their second output, the same autograd node) read as a std; now a
spread is a std or variance (their first output), a 2-norm, sqrt of a variance or of a mean or sum of squares.
(4) the hint's eps (1e-5) was not the edit's (1.2e-07); a probe's overflowed gradient read as "has a gradient".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fixes_s30_cases import fit
from fixes_s35_cases import SharpeHead, _sharpe_loss
from test_fixes_s33 import _trial
from torch import nn

import nan_magic
from nan_magic.fixes.probe import gradient_sums
from nan_magic.records import Report
from nan_magic.render.edits import suggested_edit

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "ops": {"ops": True},
                                    "ops-defer": {"ops": True, "defer": True}}


def watched(built: tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]], mode: str) -> Report:
    model, opt, loop = built
    try:
        with nan_magic.watch(model, opt, **MODES[mode], keep_last_good=True):
            loop()
    except nan_magic.NonFiniteError as error:
        return error.report
    raise AssertionError(f"{mode}: no event")


# ---------------------------------------------------------------- (1) x / 0: an eps added does not fix it
def nmse_loop() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A normalised MSE, ``mse / y.var()``, of a batch whose targets are all 3.0: x / 0 = inf (loss code)."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(5, 2), torch.full((5, 1), 3.0)

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            (((model(x) - y) ** 2).mean() / y.var()).backward()
            opt.step()
    return model, opt, loop


def flat_sharpe() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The Sharpe head (fixes_s35_cases) of a week of equal non-zero returns: -mean / std = -r / 0 (in the model)."""
    torch.manual_seed(0)
    data = {"x": torch.randn(1, 6).expand(5, 6).clone(), "r": torch.full((5, 4), 0.01), "y": torch.tensor(-1.0)}
    model, opt, loop, _data = fit(SharpeHead(), data, _sharpe_loss, lr=0.1, steps=3)
    return model, opt, loop


class ScaleOnly(nn.Module):
    """``h / h.std(0)`` (no centring) of a layer whose every row is its bias: a constant non-zero column, c / 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 6), nn.Linear(6, 1)
        nn.init.zeros_(self.lin.weight)
        nn.init.constant_(self.lin.bias, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.out(h / h.std(0))


def scale_only() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model, opt, loop, _data = fit(ScaleOnly(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=3)
    return model, opt, loop


NOT_ZERO_OVER_ZERO = {"nmse": (nmse_loop, ["default", "defer"]), "flat-sharpe": (flat_sharpe, list(MODES)),
                      "scale-only": (scale_only, ["default", "ops"])}


@pytest.mark.parametrize("name,mode", [(name, mode) for name, (_b, modes) in NOT_ZERO_OVER_ZERO.items()
                                       for mode in modes])
def test_an_eps_is_not_verified_as_a_fix_of_x_over_a_spread_of_zero(name: str, mode: str) -> None:
    """Was: "eps: its denominator plus 1.19e-7 -> verified" and the edit ``/ (y.var() + 1.2e-07)``; by hand that
    loss goes 9e7, 5e18, 3e29, inf. Now the clamp's verdict says the inf is hidden, not fixed, and the hint says why."""
    report = watched(NOT_ZERO_OVER_ZERO[name][0](), mode)
    trial = _trial(report, "eps")
    text = " ".join(report.to_text().split())
    assert trial.fact("form") != "add" and (trial.finite is not True or trial.fact("moved_all")), trial
    assert "+ 1.2e-07)" not in (suggested_edit(trial) or ""), suggested_edit(trial)
    if trial.finite:
        assert "(the inf is hidden, not fixed" in text, text
    if report.cause is not None and report.cause.reading == "spread-zero":
        assert "what it divides is not 0 there (x / 0): an eps added only makes it x / eps" in text, text
        assert "add eps to it" not in text


# ---------------------------------------------------------------- (2) the loss code's counts are not spreads
def masked_loss(divisor: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A masked squared error over a batch with no valid target (mask all 0), divided by a count of it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y, mask = torch.randn(6, 4), torch.randn(6), torch.zeros(6)

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            err = (model(x).squeeze(-1) - y) ** 2
            if divisor == "sqrt":
                loss = (err * mask).sum() / mask.sum().sqrt()
            elif divisor == "norm1":
                loss = (err * mask).sum() / mask.norm(p=1)
            else:  # (std_mean's second output: the mask's mean, the fraction of valid targets)
                loss = (err * mask).mean() / torch.std_mean(mask)[1]
            loss.backward()
            opt.step()
    return model, opt, loop


@pytest.mark.parametrize("mode", ["default", "defer"])
@pytest.mark.parametrize("divisor", ["sqrt", "norm1", "std_mean-mean"])
def test_a_count_of_nothing_in_loss_code_is_not_a_spread(divisor: str, mode: str) -> None:
    """Was: "divided by a norm of 0 ... the values it measures were all 0 ... add eps" (std_mean's mean: "a std")."""
    report = watched(masked_loss(divisor), mode)
    assert report.cause is not None and report.cause.reading == "empty-quotient", report.cause
    text = report.to_text()
    assert "count.clamp_min(1)" in text and "divided by a norm of 0" not in text and "a std of 0" not in text


# ---------------------------------------------------------------- (3) in a model: only a spread's own output
class DividedBy(nn.Module):
    """Dead ReLUs (every unit 0) divided by a reduction of them: 0 / 0 where the reduction is 0."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.out, self.kind = nn.Linear(4, 6), nn.Linear(6, 1), kind
        nn.init.constant_(self.lin.bias, -100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        if self.kind == "std_mean-mean":
            divisor = torch.std_mean(h, dim=-1, keepdim=True)[1]
        elif self.kind == "var_mean-mean":
            divisor = torch.var_mean(h, dim=-1, keepdim=True)[1]
        elif self.kind == "sqrt-mean":  # (the root of a gate's mean: not of squares)
            divisor = torch.sqrt(h.mean(-1, keepdim=True))
        elif self.kind == "norm0":  # (the number of active units)
            divisor = h.norm(p=0, dim=-1, keepdim=True)
        else:  # (std_mean's first output: a std, as before)
            divisor = torch.std_mean(h, dim=-1, keepdim=True)[0]
        return self.out(h / divisor)


@pytest.mark.parametrize("kind", ["std_mean-mean", "var_mean-mean", "sqrt-mean", "norm0", "std_mean-std"])
def test_only_a_spreads_own_output_reads_as_a_spread_in_a_model(kind: str) -> None:
    """Was: ``h / std_mean(h)[1]`` (a mean) "divided by a std of 0"; ``h / h.norm(p=0)`` a norm."""
    torch.manual_seed(0)
    model, opt, loop, _data = fit(DividedBy(kind), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)
    report = watched((model, opt, loop), "default")
    assert report.cause is not None
    assert (report.cause.reading == "spread-zero") is (kind == "std_mean-std"), report.cause
    if kind == "std_mean-std":
        assert "divided by a std of 0" in report.to_text()


# ---------------------------------------------------------------- (4) one eps; a probe that overflows
def test_the_hints_eps_is_the_edits() -> None:
    """Was: the hint "x / (std + 1e-5)" and, below it, the edit ``(p.std() + 1.2e-07)``."""
    from fixes_s35_cases import CASES

    model, opt, loop, _data = CASES["zscore-zero-head"]()
    report = watched((model, opt, loop), "default")
    edit = suggested_edit(_trial(report, "eps"))
    text = " ".join(report.to_text().split())
    assert edit is not None and "(p.std() + 1.2e-07)" in edit
    assert "x / (std + 1.2e-07)" in text and "1e-5" not in text, text


def test_a_probe_gradient_that_overflows_is_probed_again_scaled_down() -> None:
    """A centred float16 output (ones map to 0) whose random-direction backward overflows: was a sum of inf, then
    (fixes-fix-s35) 0.0, "no gradient", though the parameter has one (review): the direction scaled down gives it."""
    w = torch.ones(4, 1, dtype=torch.float16, requires_grad=True)
    x = torch.full((512, 4), 12000.0, dtype=torch.float16) * torch.linspace(-1, 1, 512, dtype=torch.float16)[:, None]
    p = x @ w
    z = p - p.mean()
    (ones,) = torch.autograd.grad([z], [w], grad_outputs=[torch.ones_like(z)], retain_graph=True)
    assert not bool(ones.any())
    (total,) = gradient_sums((ones,), [z], [w], ones=True)
    assert total is not None and 0.0 < total < float("inf")


class Float16Variance(nn.Module):
    """Scores ~1e-4 apart, all different, divided by their float16 variance (~5e-9 in float32), which is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        with torch.no_grad():
            self.lin.weight.fill_(4e-5)
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h - h.mean(0)) / h.var(0)


def test_a_float16_variance_that_underflowed_is_not_said_to_be_of_equal_values() -> None:
    torch.manual_seed(0)
    model = Float16Variance().half()
    data = {"x": torch.randn(8, 4).half(), "y": torch.randn(8, 1).half()}
    with torch.no_grad():
        assert model.lin(data["x"]).unique().numel() == 8  # (all different)
    model, opt, loop, _data = fit(model, data, lr=0.01, steps=2)
    report = watched((model, opt, loop), "default")
    text = " ".join(report.to_text().split())
    assert report.cause is not None and report.cause.reading == "spread-zero", report.cause
    assert "or closer together than float16 can square (its variance rounds to 0)" in text, text


@pytest.mark.parametrize("batch", [5, 6, 7, 12])
def test_a_z_score_of_one_sample_repeated_is_centred_whatever_the_mean_rounds_to(batch: int) -> None:
    """``(h - h.mean(0)) / h.std(0)`` over a batch of one sample repeated: the std is exactly 0, and ``h - h.mean(0)``
    is 0 or the mean's rounding noise (1e-7) in each feature, by batch size: a 0 / 0 at every size. With a test for
    exact zeros the eps trial clamped ("hidden, not fixed") under a hint that said to add eps (review of
    fixes-fix-s35; all four sizes fail without the tolerance here)."""

    class ZScored(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.o = nn.Linear(4, 16), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.o((h - h.mean(0)) / h.std(0))

    torch.manual_seed(0)
    model = ZScored()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(1, 4).expand(batch, 4).clone(), torch.randn(batch, 1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for _ in range(2):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    (trial,) = [trial for trial in caught.value.report.fixes if trial.kind == "eps"]
    edit = suggested_edit(trial) if trial.finite else None
    assert edit is not None and edit.endswith("(h - h.mean(0)) / (h.std(0) + 1.2e-07))"), edit
