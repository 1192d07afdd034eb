"""Every fix verdict must be true: checked by applying the remedy by hand, apart from the package (session 43).

The audit: a contract incident's report says of each remedy whether it made the failing step finite. Here the
remedy is applied by our own function mode (tests/fix_by_hand.py ``ByHand``: the eps clamp, the max-subtracted
exp), at the trial's line, on the failing step only (the step counted by a global optimizer step hook), in a
fresh run of the case; the run then goes non-finite at that step or not. A "verified" remedy must leave the step
finite; a "still non-finite" one must not.

Found by the audit and fixed:
- A model that masks its logits with -inf (``masked_fill(~legal, -inf)``) and has a log of an exact 0 beside the
  mask: the eps clamp makes the step finite, but the trial judged the outputs by ``isfinite`` and said
  "still non-finite (forward)" of it (the mask's -inf). Now the deliberate -inf are told apart by the op tracer.
- A log inside a custom ``autograd.Function`` in the loss code, whose backward by hand is ``grad / p``: the trial
  reran the Function's forward ops with torch's derivative, so the clamp read "verified" while the user's backward
  stays inf. Now such a trial says it cannot tell.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from contract import all_cases
from fix_by_hand import failing_step, family_of
from fix_cases_s43 import LogNewStyle, LogViaHelper, MaskedLogits, masked_scenario, metric_loop
from torch import nn

import nan_magic
from nan_magic.fix_records import FixTrial
from nan_magic.records import Report
from nan_magic.render.fixes import fixes_text

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


def report_of(build: Callable[[], Any], **options: Any) -> Report:
    scenario = build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(
            *scenario.targets, **options, **scenario.options):
        scenario.run()
    return caught.value.report


def trial_line(report: Report, kind: str) -> str:
    (line,) = [line for line in fixes_text(report).splitlines() if line.lstrip().startswith(f"{kind}:")]
    return line


# ---------------------------------------------------------------- the audit, on a sample of the contract's rows
CASES = {case.name: case for case in all_cases()}
#: Rows whose eps or max-subtracted exp has a verdict, one of each function and form, both verdicts.
AUDITED = ("grad_scaler_unpassed_collapse_raises", "carried18_open_set_unknown_logit_over_no_class",
           "ppo_log_backward", "parent_own_division", "holdout_rmsnorm_without_eps_padding_row",
           "holdout_focal_loss_gamma_below_one", "hunt14_user_pre_hook_normalises_a_zero_input",
           "hunt15_swav_sinkhorn_max_subtracted_row_underflows", "hunt23b_psnr_loss_of_a_perfect_reconstruction",
           "calm_s40_model_output_minus_inf_from_log_of_zero", "hunt_s28b_vae_monte_carlo_kl_at_an_underflowed_sigma",
           "calm_s40_infinite_gradient_at_the_legal_entries_of_masked_logits")


#: Rows whose event stops the step before its loss code in the default mode, a mask's -inf in the outputs.
STAND_IN_MASKED = ("calm_s40_model_output_minus_inf_from_log_of_zero",)


@pytest.mark.parametrize("name", AUDITED)
@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_verdict_is_what_the_remedy_by_hand_gives(name: str, defer: bool) -> None:
    case = CASES[name]
    report = report_of(case.build, **({"defer": True} if defer else {}))
    judged = [trial for trial in report.fixes if trial.finite is not None and family_of(trial) is not None
              and trial.failed != "next forward"]
    if name in STAND_IN_MASKED and not defer:  # (the loss code did not run on the mask's kept -inf: no verdict)
        assert not judged and "deliberate infinities" in trial_line(report, "eps"), fixes_text(report)
        return
    assert judged, fixes_text(report)
    for trial in judged:
        failed_at = failing_step(case.build, trial, report.step)
        assert trial.finite == (failed_at != report.step), (trial.description, trial.finite, failed_at)
        # what the user reads says the same ("verified", or "finite but off the healthy scale" with its warning)
        line = trial_line(report, trial.kind)
        assert ("-> verified" in line or "-> finite" in line) == trial.finite, line
        assert ("-> still non-finite" in line) == (not trial.finite), line


# ---------------------------------------------------------------- logits masked with -inf beside a log of 0
@pytest.mark.parametrize("where_loss_ran", [{"defer": True}, {"keep_last_good": True, "zero_from": 1}],
                         ids=["defer", "last_loss_code"])
@pytest.mark.parametrize("how", ["fill", "where", "bias"])
def test_a_log_of_0_beside_a_mask_is_verified_by_its_eps(how: str, where_loss_ran: dict[str, Any]) -> None:
    """Where the trial ran the user's loss code on the remedied outputs (defer mode; or the default mode's last
    step's loss code kept by keep_last_good, the log reading 0 from step 1), which reads the mask's -inf and
    stays finite."""
    options = dict(where_loss_ran)
    zero_from = options.pop("zero_from", 0)
    build = lambda: masked_scenario(how, zero_from=zero_from)  # noqa: E731
    report = report_of(build, **options)
    assert (report.phase, report.op, report.cause.label if report.cause else None, report.step) == (
        "forward", "aten.log.default", "log-domain", zero_from)
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.finite is True, fixes_text(report)
    assert "eps: the operand of log clamped to at least 1.19e-7 (the float32 machine eps) -> verified" in (
        trial_line(report, "eps"))
    # by hand: the same clamp at the same line, on that step, and that step is finite (the next one, unremedied,
    # fails as this one did)
    assert failing_step(build, trial, report.step) == report.step + 1


@pytest.mark.parametrize("entropy", [False, True], ids=["benign_loss", "entropy_bonus"])
def test_a_masked_models_remedy_is_not_verified_from_a_stand_in_backward(entropy: bool) -> None:
    """Default mode, the log of 0 at step 0: the forward event stops the step before its loss code, and the
    trial's backward from ones goes through the mask as zeros. Whether the user's loss reads the kept -inf as
    NaN (the entropy bonus: by hand the clamped step is NaN) or not, only that loss can tell: no "verified"."""
    build = lambda: masked_scenario("fill", entropy=entropy)  # noqa: E731
    report = report_of(build)
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.finite is None, fixes_text(report)
    line = trial_line(report, "eps")
    assert "verified" not in line and "deliberate infinities (a mask's -inf)" in line, line
    assert "the step's loss code did not run on them" in line and "the trial cannot tell" in line
    assert "of 2 verified" in fixes_text(report) and "1 of 2 verified" not in fixes_text(report)
    assert (failing_step(build, trial, report.step) == report.step) == entropy


def test_a_masked_models_remedy_judged_by_an_entropy_bonus_is_not_verified() -> None:
    """The entropy twin in defer mode: the loss code ran on the remedied outputs and went NaN, as by hand."""
    build = lambda: masked_scenario("fill", entropy=True)  # noqa: E731
    report = report_of(build, defer=True)
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert (trial.finite, trial.failed) == (False, "loss"), fixes_text(report)
    assert "-> still non-finite (loss)" in trial_line(report, "eps")
    assert failing_step(build, trial, report.step) == report.step


def test_a_second_log_of_0_beside_the_mask_still_fails_the_trial() -> None:
    """The -inf the remedy did not reach (a log of 0 on another line) is no deliberate infinity: still non-finite."""
    report = report_of(lambda: masked_scenario("fill", two_logs=True))
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert (trial.finite, trial.failed) == (False, "forward"), fixes_text(report)
    assert "-> still non-finite" in trial_line(report, "eps")
    assert failing_step(lambda: masked_scenario("fill", two_logs=True), trial, report.step) == report.step


def test_the_masked_model_stays_silent_and_unchanged_when_healthy() -> None:
    """The healthy twin (no log of 0: ``p`` is 1) keeps its -inf mask and is neither reported nor changed."""
    class Healthy(MaskedLogits):
        def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
            return self.net(x).masked_fill(~legal, float("-inf"))

    def run(watched: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = Healthy("fill")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, legal = torch.randn(4, 6), torch.ones(4, 5, dtype=torch.bool)
        legal[:, 1] = False
        watch = nan_magic.watch(model, opt) if watched else contextlib.nullcontext()
        with watch:
            for _ in range(3):
                loss = torch.where(legal, model(x, legal), 0.0).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        assert not watched or watch.report is None
        return model.net[0].weight.detach().clone()

    assert torch.equal(run(True), run(False))


def test_the_deliberate_check_leaves_what_the_remedy_counted_as_the_step_had_it() -> None:
    """The second forward of the deliberate check runs with the remedy in place: its counts, lists and sets are
    put back as the step's (other_uses() reads the call ordinals, _powers the exponents)."""
    from types import SimpleNamespace

    from nan_magic.fixes.deliberate import held_remedy

    remedy = SimpleNamespace(calls=2, operands=["p1"], behind=[], exponents=set(), moved={"a": 1})
    with held_remedy(remedy, None):
        remedy.calls += 2
        remedy.operands.append("p2")
        remedy.behind.append("leaf")
        remedy.exponents.add(0.5)
        remedy.moved["b"] = 2
    assert vars(remedy) == {"calls": 2, "operands": ["p1"], "behind": [], "exponents": set(), "moved": {"a": 1}}


# ---------------------------------------------------------------- a log in a custom autograd.Function of the loss code
class LogByHand(torch.autograd.Function):
    """log, its backward by hand reading the operand the forward saved: ``grad / p``."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(p)
        return torch.log(p)  # the producer: p holds an exact 0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (p,) = ctx.saved_tensors
        return grad / p


def _probabilities_loop(log: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Softmax probabilities of which step 1's first row underflows to an exact 0 in one class, logged in the loss
    code by ``log``."""
    from contract import Scenario

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 4) for _ in range(3)]
    xs[1][0] = torch.tensor([2000.0, -2000.0, 2000.0, -2000.0])

    def run() -> None:
        for step in range(3):
            p = model(xs[step]).softmax(-1)
            loss = -log(p).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


def _log_of_p(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p)  # the producer, without a Function


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_clamp_inside_a_functions_forward_is_not_verified(defer: bool) -> None:
    build = lambda: _probabilities_loop(LogByHand.apply)  # noqa: E731
    report = report_of(build, **({"defer": True} if defer else {}))
    assert (report.phase, report.module, report.op, report.step) == ("forward", None, "aten.log.default", 1)
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.finite is None and trial.untried is not None, fixes_text(report)
    line = trial_line(report, "eps")
    assert "verified" not in line and "LogByHand, a custom autograd.Function" in line, line
    assert "not LogByHand.backward's" in line
    # by hand: the clamp in the forward leaves LogByHand.backward's grad / p inf, at the same step
    by_hand = FixTrial(kind="eps", source=trial.source, facts=(("function", "log"),))
    assert failing_step(build, by_hand, report.step) == report.step


def test_the_same_log_without_a_function_is_verified() -> None:
    """Its twin: the log written in the loss code itself, whose derivative the trial runs as the step does."""
    build = lambda: _probabilities_loop(_log_of_p)  # noqa: E731
    report = report_of(build)
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.finite is True, fixes_text(report)
    assert "-> verified" in trial_line(report, "eps")
    assert failing_step(build, trial, report.step) != report.step


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
@pytest.mark.parametrize("function", [LogViaHelper, LogNewStyle], ids=["helper", "setup_context"])
def test_a_function_on_the_losss_path_is_found_in_any_form(function: Any, defer: bool) -> None:
    """A forward that calls a helper to run the log, or a new-style one (``forward(p)`` and ``setup_context``):
    the trial cannot tell (by hand, the clamp leaves the step non-finite: the backward is ``grad / p``)."""
    build = lambda: _probabilities_loop(function.apply)  # noqa: E731
    report = report_of(build, **({"defer": True} if defer else {}))
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.finite is None, fixes_text(report)
    assert f"{function.__name__}, a custom autograd.Function" in trial_line(report, "eps")
    by_hand = FixTrial(kind="eps", source=trial.source, facts=(("function", "log"),))
    assert failing_step(build, by_hand, report.step) == report.step


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "output_unread"])
def test_a_function_off_the_losss_path_leaves_the_verdicts(grad: bool, defer: bool) -> None:
    """A metric's Function under no_grad, or with grad on but its output not read by the loss: no derivative of
    it is in the step, so the trials stand ("verified", and by hand the clamp makes the step finite)."""
    build = lambda: metric_loop(grad)  # noqa: E731
    report = report_of(build, **({"defer": True} if defer else {}))
    text = fixes_text(report)
    assert "Sharpen" not in text and "2 of 2 verified" in text, text
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.finite is True and failing_step(build, trial, report.step) != report.step


# ---------------------------------------------------------------- remedies that tempt but must not be verified
def _mlp_loop(xs: list[torch.Tensor], ys: list[torch.Tensor], lr: float = 0.1,
              drop: tuple[int, int] | None = None) -> Any:
    """An MLP trained by SGD on ``xs``/``ys``; ``drop``: ``(step, row)`` left out of that step's batch (by hand)."""
    from contract import Scenario

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> list[float]:
        losses = []
        for step, (x, y) in enumerate(zip(xs, ys)):
            if drop is not None and drop[0] == step:
                keep = torch.arange(x.shape[0]) != drop[1]
                x, y = x[keep], y[keep]
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses
    return Scenario((model, opt), run)


def _nan_batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(1)
    xs, ys = [torch.randn(8, 4) for _ in range(4)], [torch.randn(8, 1) for _ in range(4)]
    xs[2][3, 1] = float("nan")  # a corrupt record in step 2's batch
    return xs, ys


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_nan_in_the_data_is_fixed_by_leaving_the_sample_out_not_by_a_lower_lr(defer: bool) -> None:
    xs, ys = _nan_batch()
    report = report_of(lambda: _mlp_loop(xs, ys), keep_last_good=True, **({"defer": True} if defer else {}))
    assert (report.phase, report.step, report.cause.label if report.cause else None) == (
        "data", 2, "bad-input-data")
    assert {trial.kind for trial in report.fixes if trial.finite} == {"skip-batch"}, fixes_text(report)
    assert not [trial for trial in report.fixes if trial.kind in ("lr", "eps", "float32")], fixes_text(report)
    assert "skip-batch: the batch without its 1 of 8 samples holding non-finite values (row 3) -> verified" in (
        trial_line(report, "skip-batch"))
    # by hand: the step without row 3 is finite; at a tenth of the learning rate it is not
    assert all(map(torch.isfinite, map(torch.tensor, _mlp_loop(xs, ys, drop=(2, 3)).run())))
    assert not torch.isfinite(torch.tensor(_mlp_loop(xs, ys, lr=0.01).run()[2]))


def test_an_outlier_batchs_update_is_not_called_a_learning_rate_too_high() -> None:
    """One batch 1e12 times too large makes one huge update, and the next forward overflows: the learning rate
    trains every other step well, so the cause is the overflow (not learning-rate-too-high) and no remedy is
    verified."""
    torch.manual_seed(0)
    xs, ys = [torch.randn(8, 4) for _ in range(8)], [torch.randn(8, 1) for _ in range(8)]
    xs[4] = xs[4] * 1e12
    report = report_of(lambda: _mlp_loop(xs, ys, lr=0.01), keep_last_good=True)
    assert report.step == 5 and report.cause is not None and report.cause.label == "overflow", report.message
    assert "inputs that are not normalised" in report.cause.hint
    assert not [trial for trial in report.fixes if trial.finite], fixes_text(report)


def test_a_clamp_that_replaces_every_value_of_a_zero_norm_is_not_a_plain_fix() -> None:
    """``sqrt`` of a sum of squares of an all-zero layer: the NaN is in the gradient (clipping it afterwards keeps it
    NaN). The eps clamp makes the step finite by replacing every value: the report says the NaN is hidden."""
    from contract import Scenario

    class Length(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).pow(2).sum(-1).sqrt()

    def build() -> Any:
        torch.manual_seed(0)
        model = Length()
        with torch.no_grad():
            model.lin.weight.zero_()
            model.lin.bias.zero_()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4)

        def run() -> None:
            for _ in range(2):
                loss = model(x).mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
        return Scenario((model, opt), run)

    report = report_of(build)
    assert (report.phase, report.cause.label if report.cause else None) == ("backward", "sqrt-domain")
    # the one remedy is the clamp, worded as hiding the NaN: nothing else (clipping, a lower lr) is offered
    assert [trial.kind for trial in report.fixes] == ["eps"], fixes_text(report)
    line = trial_line(report, "eps")
    assert "every value of the operand was out of the domain and was replaced" in line, line
    assert "the NaN is hidden, not fixed" in line, line


# ---------------------------------------------------------------- remedies that work and must be verified
class HandSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.lin(x) * 100
        e = torch.exp(scores)  # overflows past 88.7
        return e / e.sum(-1, keepdim=True)


def _softmax_loop() -> Any:
    from contract import Scenario

    torch.manual_seed(0)
    model = HandSoftmax()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4) * 3, torch.rand(8, 5)

    def run() -> None:
        for _ in range(3):
            loss = (model(x) * y).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Scenario((model, opt), run)


@pytest.mark.parametrize("defer", [False, True], ids=["default", "defer"])
def test_a_softmax_by_hand_is_fixed_by_subtracting_the_max(defer: bool) -> None:
    report = report_of(_softmax_loop, **({"defer": True} if defer else {}))
    assert (report.op, report.cause.label if report.cause else None) == ("aten.exp.default", "exp-overflow")
    (trial,) = [trial for trial in report.fixes if trial.kind == "stable"]
    assert trial.finite is True
    assert "stable: the exp max-subtracted (exp(x - x.amax(-1, keepdim=True))) -> verified" in (
        trial_line(report, "stable"))
    assert failing_step(_softmax_loop, trial, report.step) != report.step


def test_a_collapsing_grad_scaler_is_fixed_by_the_lower_scale_it_names() -> None:
    """float16 gradients overflow at an initial scale of 2**40: the scaler halves it on each skipped step, and
    collapses (15 in a row) before it reaches one that fits. The trial names a lower scale; by hand, a scaler
    built with it skips no step."""
    def build(init_scale: float) -> tuple[nn.Module, torch.optim.Optimizer, Any, Callable[[], int]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        x, y = torch.randn(32, 8), torch.randn(32, 4)
        skipped = [0]

        def run() -> int:
            for _ in range(20):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = (out.float() - y).pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped[0] += scaler.get_scale() < before
            return skipped[0]
        return model, opt, scaler, run

    model, opt, scaler, run = build(2.0**40)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, scaler):
        run()
    report = caught.value.report
    assert report.cause is not None and report.cause.label == "grad-scaler-collapse"
    (trial,) = [trial for trial in report.fixes if trial.kind == "scale"]
    assert trial.finite is True and "-> verified" in trial_line(report, "scale"), fixes_text(report)
    lower = trial.fact("new_scale")
    assert lower is not None and lower < 2.0**40
    assert build(lower)[3]() == 0  # by hand: no step skipped at that scale


def test_a_learning_rate_lowered_after_the_run_diverged_is_not_called_a_fix() -> None:
    """Linear regression at lr 0.05 on inputs of scale 10 diverges slowly; by the failing step the state is far
    gone, and one update redone at a tenth of the rate leaves a finite but enormous loss: "not a fix"."""
    from contract import Scenario

    def build(lowered_at: int | None = None) -> Any:
        torch.manual_seed(0)
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(64, 8) * 10, torch.randn(64, 1)

        def run() -> list[float]:
            losses = []
            for step in range(30):
                for group in opt.param_groups:
                    group["lr"] = 0.005 if step == lowered_at else 0.05
                loss = F.mse_loss(model(x), y)
                losses.append(float(loss))
                opt.zero_grad()
                loss.backward()
                opt.step()
            return losses
        return Scenario((model, opt), run)

    report = report_of(build, keep_last_good=True)
    (trial,) = [trial for trial in report.fixes if trial.kind == "lr"]
    line = trial_line(report, "lr")
    assert trial.finite is not True and "-> not a fix, though the step came out finite" in line, line
    # by hand: the update before the failing step at a tenth of the rate; the failing step's loss is finite, and
    # still past 1e30
    loss = build(lowered_at=report.step - 1).run()[report.step]
    assert math.isfinite(loss) and loss > 1e30
