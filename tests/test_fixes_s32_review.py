"""The review of fixes-s32's verdicts (a clamp of a trained parameter at its boundary, ``frozen``; a lower learning
rate for one update of a diverged run, ``diverged_before``; a later model call's title), each as the user reads it.

Was: a loss of exactly 0 at an earlier step (a warmup weight) lost the user's NonFiniteError to a ZeroDivisionError
of the report's own sentence; a loss crossing 0, negative, or rising from a converged 1e-4 read "already diverged"
(the rule compared ``|loss|`` with the lowest ``|loss|``); a lowered update whose own loss was 2.68e37 read
"verified"; a parameter read through a transpose or one element (``w.mT``, ``scales[0]``) read "verified" where by
hand it never leaves 0; two models watched said "the step's other micro-batches".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from contract import all_cases
from contract.hunt26b import HeteroscedasticRegressor, _batches
from torch import nn

import nan_magic
from nan_magic.fixes.remedies.diverged import diverged_before, diverged_loss
from nan_magic.records import FixTrial, Phase, Report
from nan_magic.render.fixes import fix_lines, fixes_text, fixes_title
from nan_magic.step_records import StepSummary

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]  # (conftest.py: small models, torch on one thread)

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}
TIERED = ["default", "defer", "full"]  # (the lr trial needs the loss code: ops mode keeps none to run again)


def _report(model: nn.Module | tuple[nn.Module, ...], opt: torch.optim.Optimizer, loop: Any, mode: str,
            **options: Any) -> Report:
    models = model if isinstance(model, tuple) else (model,)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*models, opt, **MODES[mode], **options):
        loop()
    return caught.value.report


def _trial(report: Report, kind: str) -> FixTrial:
    found = [trial for trial in report.fixes if trial.kind == kind]
    assert found, [trial.kind for trial in report.fixes]
    return found[0]


def _text(report: Report) -> str:
    return " ".join(report.to_text().split())


# ------------------------------------------------------------------ 1: a loss of 0 before: the report, not a crash
@pytest.mark.parametrize("mode", TIERED)
def test_a_loss_of_0_at_an_earlier_step_keeps_the_users_error(mode: str) -> None:
    """A warmup weight ``min(1, step / 5)``: the loss is exactly 0 at step 0, SGD's lr 0.115 diverges at step 62.
    Was: ZeroDivisionError from the fixes section's sentence, raised from the watch's exit instead of the
    NonFiniteError. Now: the NonFiniteError, its report and its fixes section."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(8, 1), torch.randn(64, 8) * 3, torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.115)

    def loop() -> None:
        for step in range(400):
            opt.zero_grad()
            (min(1.0, step / 5) * F.mse_loss(model(x), y)).backward()
            opt.step()

    report = _report(model, opt, loop, mode, keep_last_good=True)
    assert report.cause is not None and report.cause.label == "learning-rate-too-high" and report.step == 62
    text = _text(report)
    assert "Fixes tried on a replay of step 62" in text and "lr: the previous update" in text


@pytest.mark.parametrize("facts", [
    (("diverged_before", (53, 1e36, 0, 0.0)),), (("diverged_before", (1, 2)),), (("diverged_before", "x"),),
    (("still_diverged", (3, None)),), (("frozen", 7),), (("frozen", (None, 3)),)])
def test_the_fixes_section_says_its_verdict_whatever_the_facts_hold(facts: tuple[tuple[str, object], ...]) -> None:
    """A fact of a loss 0, a tuple of the wrong length, a name that is not a string: the section still renders."""
    trial = FixTrial(kind="lr", finite=None, loss=float("inf"),
                     seconds=float("nan"), facts=facts)
    report = Report(phase=Phase.FORWARD, module="", module_type=None, step=3, nan=1, posinf=0, neginf=0, numel=1,
                    fixes=(trial,), model_call=2)
    assert "not a fix, though the step came out finite" in fixes_text(report)
    assert "-> not a fix" in fix_lines(report)[0][1] and "0 of 1 verified" in fixes_title(report)


# ------------------------------------------------------------------ 2: the divergence rule reads signs and scale
def _history(losses: list[float]) -> list[StepSummary]:
    return [StepSummary(step=index, loss=loss, absmax=None) for index, loss in enumerate(losses)]


@pytest.mark.parametrize(("losses", "upto"), [
    ([3.0, 1.0, 0.001, -1.0, -2.0, -2.0], 4),  # an NLL crossing 0: step 5 is the lowest of the run
    ([-1.0, -10.0, -200.0, -2000.0, -2100.0], 3),  # an RL objective (-reward) improving
    ([0.0, 0.6, 0.5, 0.4, 0.3], 3),  # a warmup weight of 0 at step 0
    ([5.0, 1.0, 0.01, 1e-4, 1e-4, 0.2], 4),  # converged near 1e-4, a bump to 0.2
    ([0.0] * 6 + [3.0], 5),  # a warmup of 0 for 6 steps: no scale to read
])
def test_a_loss_crossing_0_negative_or_near_0_is_not_a_divergence(losses: list[float], upto: int) -> None:
    """Was: ``(5, 2.0, 2, 0.001)`` for the NLL crossing 0, ``(4, 2100, 0, 1.0)`` for the improving reward: "already
    diverged". Now: a rise above the lowest signed loss against the run's first losses' magnitude."""
    assert diverged_before(_history(losses), upto) is None


def test_a_loss_1000_times_the_runs_scale_above_its_lowest_is_a_divergence() -> None:
    assert diverged_before(_history([3.15, 2.0, 1.0, 50.0, 1e5, 1.6e36]), 4) == (5, 1.6e36, 2, 1.0)
    assert diverged_before(_history([1e4, 1.0, 1.0, 1e9]), 2) == (3, 1e9, 1, 1.0)
    assert diverged_loss(_history([-0.5, -0.6, -0.7]), 2, 2.68e37) == (2, -0.7)
    assert diverged_loss(_history([-0.5, -0.6, -0.7]), 2, 100.0) is None


def _spiked(offset: float, spike: float) -> Any:
    """``w^2 + offset``, SGD: 20 steps at lr 0.1 (to w near 0), 7 at 1.6 (a rise: w grows 2.2x a step), one at
    ``spike``, which overflows the next forward."""
    lrs = [0.1] * 20 + [1.6] * 7 + [spike] + [0.1] * 10

    class W(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(3.0))

        def forward(self) -> torch.Tensor:
            return self.w * self.w

    model = W()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop() -> None:
        for lr in lrs:
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
            (model() + offset).backward()
            opt.step()

    return model, opt, loop


@pytest.mark.parametrize("mode", TIERED)
def test_a_loss_that_crossed_0_is_not_read_as_diverged_before(mode: str) -> None:
    """``w^2 - 0.655``: the loss crosses 0 at step 24 (-6.6e-6), rises to 73.8 at step 27, and one update at lr 1e19
    overflows. Was: "the state it was redone from had already diverged (the loss at step 27 was 73.8, 1.12e7x the
    lowest, 6.62e-6 at step 24)": the lowest was -0.655, and 73.8 is 9 times the run's first loss. Now the trial's
    verdict is its own loss's: at a tenth, 1e18, the update still overflows the run (loss 2.98e38)."""
    report = _report(*_spiked(-0.655, 1e19), mode, keep_last_good=True)
    trial = _trial(report, "lr")
    assert trial.fact("diverged_before") is None and trial.finite is None and trial.fact("still_diverged") is not None
    assert "already diverged" not in _text(report)


@pytest.mark.parametrize("mode", TIERED)
def test_a_lowered_update_whose_own_loss_diverges_is_not_a_fix(mode: str) -> None:
    """3: ``w^2 + 1``: a plateau at 1, a 7-step rise to 76, one update at lr 3e18. Was: "lr: ... -> verified: the
    step came out finite, loss 2.68e37", 1 of 1 verified, with a lower learning rate suggested. Now: not a fix, the
    trial's own loss far above the lowest."""
    report = _report(*_spiked(1.0, 3e18), mode, keep_last_good=True)
    trial = _trial(report, "lr")
    assert trial.finite is None and trial.loss is not None and trial.loss > 1e30
    assert trial.fact("still_diverged") == (20, pytest.approx(1.0, rel=1e-2))
    text = _text(report)
    assert "0 of 1 verified" in text and "suggested edit" not in text
    assert "not a fix, though the step came out finite (loss 2.68e37): that loss is still far above the lowest " \
           "before it, 1 at step 20" in text


# ------------------------------------------------------------------ 4: a parameter read through a view or an element
class _Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.eps: float | None = None
        self.lin = nn.Linear(4, 2)
        self.w = nn.Parameter(torch.zeros(2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * torch.sqrt(_clamped(self.w.transpose(0, 1), self.eps))).sum(-1, keepdim=True)


class _OneElement(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.eps: float | None = None
        self.lin = nn.Linear(4, 1)
        self.scales = nn.Parameter(torch.tensor([0.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.sqrt(_clamped(self.scales[0], self.eps)) + self.scales[1]


class _OneZeroOfAVector(nn.Module):  # (the zero element is one of the operand's: the others train)
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor([0.0, 1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * torch.sqrt(self.scale)).sum(-1, keepdim=True)


def _clamped(operand: torch.Tensor, eps: float | None) -> torch.Tensor:
    return operand if eps is None else operand.clamp_min(eps)


def _fit(cls: type[nn.Module], steps: int = 1, clamp: bool = False) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model, x, y = cls(), torch.randn(8, 4), torch.randn(8, 1)
    model.eps = 1.2e-07 if clamp else None  # (the suggested edit by hand: sqrt's operand .clamp_min(1.2e-07))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loop() -> None:
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    return model, opt, loop


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("cls", "parameter"), [(_Transposed, "w"), (_OneElement, "scales")])
def test_a_parameter_read_through_a_view_or_one_element_is_frozen(cls: type[nn.Module], parameter: str,
                                                                   mode: str) -> None:
    """``sqrt(self.w.transpose(0, 1))`` with w all 0; ``sqrt(self.scales[0])`` with scales[0] 0 and scales[1]
    trained. Was: "eps: ... -> verified" and the clamp suggested; by hand, 5 steps, w (scales[0]) stays 0. Now: not a
    fix, the parameter named."""
    report = _report(*_fit(cls), mode)
    trial = _trial(report, "eps")
    assert trial.finite is None and trial.fact("frozen") == (parameter,), trial
    assert "the operand is the trained parameter " + parameter in _text(report)
    model, _opt, loop = _fit(cls, steps=5, clamp=True)
    loop()
    read = model.w if cls is _Transposed else model.scales[:1]  # type: ignore[union-attr,index]
    assert bool((read == 0).all())


@pytest.mark.parametrize("mode", ["default", "ops"])
def test_one_zero_element_of_a_vector_parameter_stays_verified(mode: str) -> None:
    report = _report(*_fit(_OneZeroOfAVector), mode)
    assert _trial(report, "eps").finite is True and _trial(report, "eps").fact("frozen") is None


# ------------------------------------------------------------------ 0: SAM's clamp of log(scale), by hand
def test_sams_clamp_of_a_scale_pushed_below_0_does_not_train_by_hand() -> None:
    """hunt26's SAM row (test_defer_s27 expects its eps trial not a fix now, in both checks): the clamp applied by
    hand to the same loop, 20 steps. The scale's gradient at step 0 is 0 (every value the line reads was clamped),
    and the run is thrown to a scale of 1e18 a step later: the old "verified" was wrong."""
    report = _report(*_sam_row(), "default")
    assert [(trial.kind, trial.finite) for trial in report.fixes] == [("stable", None), ("eps", None)]
    assert _trial(report, "eps").fact("frozen") == ("scale",)
    torch.manual_seed(0)
    model = HeteroscedasticRegressor(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = _batches(6, 4, steps=20), _batches(6, 1, steps=20)

    def nll(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        log_scale = model.scale.expand(x.shape[0], 1).clamp_min(1.19e-7).log()
        return (0.5 * ((y - model.body(x)) / log_scale.exp()) ** 2 + log_scale).mean()

    first = None
    for step in range(20):
        opt.zero_grad()
        nll(xs[step], ys[step]).backward()
        with torch.no_grad():
            grads = [parameter.grad for parameter in model.parameters()]
            norm = torch.stack([grad.norm() for grad in grads if grad is not None]).norm()
            ascent = [0.1 * grad / (norm + 1e-12) for grad in grads if grad is not None]
            for parameter, push in zip(model.parameters(), ascent):
                parameter.add_(push)
        opt.zero_grad()
        nll(xs[step], ys[step]).backward()
        first = float(model.scale.grad) if first is None else first  # type: ignore[arg-type]
        with torch.no_grad():
            for parameter, push in zip(model.parameters(), ascent):
                parameter.sub_(push)
        opt.step()
    assert first == 0.0 and float(model.scale.detach()) > 1e6


def _sam_row() -> tuple[tuple[nn.Module, ...], torch.optim.Optimizer, Any]:
    case = next(case for case in all_cases() if case.name == "hunt26_sam_second_forward_log_of_a_scale_pushed_below_0")
    torch.manual_seed(0)
    scenario = case.build()
    *models, opt = scenario.targets
    return tuple(models), opt, scenario.run


# ------------------------------------------------------------------ 5: two models watched: the title
class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.log(torch.relu(h)))


@pytest.mark.parametrize("mode", list(MODES))
def test_two_models_watched_the_title_says_the_other_model_calls(mode: str) -> None:
    """``watch(enc, dec, opt)``, log(0) in dec, the step's 2nd model call. Was: "(the step's other micro-batches
    were not replayed)", with no micro-batch in the loop. Now: "the step's other model calls"."""
    torch.manual_seed(0)
    enc, dec = nn.Linear(4, 4), _Decoder()
    opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loop() -> None:
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(dec(enc(x)), y).backward()
            opt.step()

    report = _report((enc, dec), opt, loop, mode)
    assert report.model_call == 2
    text = _text(report)
    assert "Fixes tried on a replay of step 0's 2nd model call alone (the step's other model calls were not " \
           "replayed; on copies: your model, optimizer and data are untouched)" in text and "micro-batches" not in text
