"""hunt-c-s42: what the report says must be what the watch measured.

A NaN or infinite learning rate is the number itself, not a rate too high; a layer table's cells that were not
measured read as missing, not as NaN; a remedy that makes the step finite far off the healthy scale is not read as a
fix; a divisor gathered from a schedule is no per-row reduction. Each case has a healthy twin where it matters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from watching import raised

import nan_magic

# ---------------------------------------------------------------- a learning rate that is not finite


def _lr_loop(configure: Callable[[torch.optim.Optimizer], object], write: Callable[[int, torch.optim.Optimizer], None],
             literal_at: int | None = None) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], list[float]]]:
    """Six SGD steps; ``configure`` makes a scheduler (or nothing), ``write(step, opt)`` is lr code in a helper, and
    at step ``literal_at`` the loop itself writes a NaN rate as a literal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        scheduler = configure(opt)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> list[float]:
        losses = []
        for step in range(6):
            write(step, opt)
            if step == literal_at:
                opt.param_groups[0]["lr"] = float("nan")  # lr literal
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                with np.errstate(all="ignore"):
                    scheduler.step()
            losses.append(loss.item())
        return losses

    return model, opt, run


def _no_scheduler(_opt: torch.optim.Optimizer) -> None:
    return None


def _helper_nan(step: int, opt: torch.optim.Optimizer) -> None:
    if step == 2:
        opt.param_groups[0]["lr"] = float("nan")


def _untouched(_step: int, _opt: torch.optim.Optimizer) -> None:
    return None


def _warmup_of(steps: int) -> Callable[[torch.optim.Optimizer], object]:
    # A warm-up written with numpy numbers: 0 / 0 at step 0 when it lasts 0 steps (no ZeroDivisionError, a NaN).
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda epoch: float(min(np.float64(1.0), np.float64(epoch) / np.float64(steps))) if steps else float(
            np.float64(epoch) / np.float64(steps)))


def _assert_not_too_high(report: nan_magic.Report) -> str:
    assert report.cause is not None and report.cause.label == "nonfinite-number"
    text = report.to_text()
    assert "learning-rate-too-high" not in text and "usual range" not in text and "a tenth of its learning" not in text
    assert report.fixes == ()
    assert (f"no fix was tried: the learning rate is {report.optimizer_lr}, and a lower one (a tenth of it) is "
            f"{report.optimizer_lr} too") in text
    return text


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True}],
                         ids=["default", "defer", "full", "ops"])
def test_a_nan_rate_written_as_a_literal_is_not_a_rate_too_high(options: dict[str, object]) -> None:
    model, opt, run = _lr_loop(_no_scheduler, _untouched, literal_at=2)
    report = raised(run, model, opt, **options)
    assert (report.phase, report.step, report.module) == ("optimizer", 2, "0")
    assert math.isnan(report.optimizer_lr or 0.0)
    text = _assert_not_too_high(report)
    assert report.cause is not None and report.cause.reading == "optimizer-lr-nonfinite"
    line = next(n for n, source in enumerate(Path(__file__).read_text().splitlines(), 1)
                if source.endswith("# lr literal"))
    assert ("its learning rate lr = nan is not a number, not a rate too high, so every update lr · g is non-finite"
            in text)
    assert f"the loop's code has one line that writes a group's \"lr\", line {line} (" in text
    assert "whether it ran before this step is not known" in text


def test_a_warm_up_scheduler_over_zero_steps_is_named_as_where_the_nan_rate_came_from() -> None:
    model, opt, run = _lr_loop(_warmup_of(0), _untouched)
    report = raised(run, model, opt)
    assert (report.phase, report.step) == ("optimizer", 0)
    text = _assert_not_too_high(report)
    assert report.cause is not None and report.cause.reading == "optimizer-lr-scheduled"
    assert "written by the LambdaLR scheduler's step (last_epoch 0; initial_lr 0.1)" in text
    assert "a warm-up or decay over 0 steps" in text


def test_a_nan_rate_the_loop_writes_after_a_healthy_scheduler_is_not_the_scheduler_s() -> None:
    # The scheduler's last rate is finite: the NaN the step read was the loop's, so the scheduler is not named.
    model, opt, run = _lr_loop(_warmup_of(3), _untouched, literal_at=2)
    report = raised(run, model, opt)
    assert report.cause is not None and report.cause.reading == "optimizer-lr-nonfinite"
    assert "LambdaLR" not in report.to_text()


def test_a_nan_rate_a_chainable_scheduler_passed_on_is_not_its_formula_s() -> None:
    # ExponentialLR's step is group["lr"] * gamma: it carries the NaN the loop wrote before it (review of hunt-c-s42).
    # Its closed form from its finite base rates is finite, so the loop's store line is where to look, not its formula.
    model, opt, run = _lr_loop(lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99), _untouched,
                               literal_at=2)
    report = raised(run, model, opt)
    assert report.cause is not None and report.cause.reading == "optimizer-lr-nonfinite"
    text = _assert_not_too_high(report)
    assert "ExponentialLR" not in text and "its formula divides by zero" not in text
    assert "no torch learning-rate scheduler's formula made it" in text


def test_a_chainable_scheduler_whose_own_formula_makes_the_nan_is_named() -> None:
    model, opt, run = _lr_loop(lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=float("nan")),
                               _untouched)
    report = raised(run, model, opt)
    assert report.cause is not None and report.cause.reading == "optimizer-lr-scheduled"
    text = _assert_not_too_high(report)
    assert "written by the ExponentialLR scheduler's step (last_epoch 1; initial_lr 0.1)" in text


def test_a_nan_rate_a_helper_writes_is_not_said_to_come_from_the_loop_s_line() -> None:
    # The loop's one store into a group's "lr" never ran (a helper wrote the NaN): the line is offered as where to
    # look, never as the line that set it, and %debug / the report's line stay at the step.
    model, opt, run = _lr_loop(_no_scheduler, _helper_nan)
    report = raised(run, model, opt)
    text = _assert_not_too_high(report)
    assert "whether it ran before this step is not known: the rate may also have come from a helper" in text
    assert "set at line" not in text and report.source is not None and report.source.line == "opt.step()"


def test_a_constructor_given_an_infinite_rate_names_no_line_it_did_not_see() -> None:
    # No scheduler, no store into a group's "lr" in the loop: where it was set is not known, and it says so.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=float("inf"))

    def run() -> None:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()

    report = raised(run, model, opt)
    text = _assert_not_too_high(report)
    assert "its learning rate lr = inf is infinite, not a rate too high" in text
    assert "where it was set is not known" in text and "at line" not in report.cause.hint  # type: ignore[union-attr]


def test_a_healthy_warm_up_is_silent_and_bit_identical() -> None:
    model, opt, run = _lr_loop(_warmup_of(3), _untouched)
    with nan_magic.watch(model, opt) as watch:
        watched = run()
    assert watch.report is None
    plain_model, _plain_opt, plain_run = _lr_loop(_warmup_of(3), _untouched)
    assert plain_run() == watched
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters(), strict=True))


# ---------------------------------------------------------------- the layer table's missing numbers


def _log_of_outputs(options: dict[str, object]) -> nan_magic.Report:
    """The loss code takes the log of the model's outputs at step 3 (some are negative): NaN in the loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> None:
        for step in range(5):
            out = model(x)
            loss = F.mse_loss(out.log() if step == 3 else out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return raised(run, model, opt, **options)


@pytest.mark.parametrize("options", [{}, {"mode": "full"}], ids=["default", "full"])
def test_numbers_not_measured_are_missing_never_nan_in_the_table_and_its_views(options: dict[str, object]) -> None:
    report = _log_of_outputs(options)
    table = report.table
    numbers = ["min", "max", "mean", "std", "absmax"]
    assert all(str(table[column].dtype) == "Float64" for column in numbers)
    # No cell of the DataFrame is a float NaN: a missing number is <NA> (a NaN tool's NaN reads as a finding).
    for column in table.columns:
        assert not any(isinstance(value, float) and math.isnan(value) for value in table[column].tolist()), column
    # The producer row is the log's own output (the headline's counts); the loss it reached is propagated, a NaN
    # scalar with no finite value to measure.
    producer = table[table["status"] == "producer"].iloc[0]
    assert producer["tensor"] == "output of aten.log.default" and producer[numbers].notna().all()
    loss = table[table["tensor"] == "loss"].iloc[0]
    assert loss["status"] == "propagated" and loss[numbers].isna().all()  # (no finite value to measure)
    legend = table.attrs["legend"]
    assert "Empty cells are missing numbers (report.table's <NA>), not NaN values" in legend
    assert "empty where the tensor held no finite value to measure" in legend
    unprobed = table[table["min"].notna() & table["mean"].isna()]
    if options:  # mode="full" read the other calls for min and max only: said, as not measured
        assert len(unprobed) and "empty mean and std were not measured" in legend
        assert "empty mean and std were not measured" in report.to_html()
    else:
        assert unprobed.empty and "mean and std were not measured" not in legend
    html, text = report.to_html(), report.to_text()
    assert ">nan<" not in html.lower() and "<NA>" not in html.split("Layers (")[1].split("</table>")[0]
    assert "Empty cells are missing numbers" in html and "Empty cells are missing numbers" in text
    assert "min, max and absmax are empty where the tensor held no finite value" in text  # (text shows no mean)


def test_a_table_with_every_number_measured_says_nothing_of_missing_cells() -> None:
    from nan_magic.render.layer_tree import missing_note

    report = _log_of_outputs({})
    measured = [layer for layer in report.layers if layer.stats is not None and layer.stats.min is not None]
    assert measured and missing_note(measured) == ""


# ---------------------------------------------------------------- a divisor gathered from a schedule


class _ScheduleDivided(nn.Module):
    """``h / alphas_cumprod[t]``: a diffusion schedule whose first entry is 0, gathered by timestep."""

    def __init__(self, first: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("alphas_cumprod", torch.cat([torch.full((1,), first), torch.linspace(0.9, 0.1, 9)]))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t].view(-1, 1)
        return self.lin(x) / a  # producer: schedule divisor


def _schedule_run(first: float) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], list[float]]]:
    torch.manual_seed(0)
    model = _ScheduleDivided(first)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(6, 8), torch.tensor(t)) for t in ([4, 2, 9, 1, 3, 5], [3, 0, 5, 2, 7, 1])]

    def run() -> list[float]:
        losses = []
        for x, t in batches:
            loss = model(x, t).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    return model, opt, run


@pytest.mark.parametrize("options", [{}, {"ops": True}], ids=["default", "ops"])
def test_a_divisor_gathered_from_a_schedule_is_not_called_a_per_row_reduction(options: dict[str, object]) -> None:
    model, opt, run = _schedule_run(0.0)
    report = raised(run, model, opt, **options)
    assert (report.phase, report.module, report.step, report.op) == ("forward", "", 1, "aten.div.Tensor")
    assert report.cause is not None and report.cause.label == "division-by-zero"
    hint = report.cause.hint
    assert "reduction" not in hint and "held 1 zero of 6, one value per row: 0 for 1 row)" in hint
    assert "if it is read from a table (a schedule's entry by timestep, alphas_cumprod[t]), the table holds a 0" in hint


def test_a_schedule_without_a_zero_entry_is_silent_and_bit_identical() -> None:
    model, opt, run = _schedule_run(0.99)
    with nan_magic.watch(model, opt) as watch:
        watched = run()
    assert watch.report is None
    plain_model, _opt, plain_run = _schedule_run(0.99)
    assert plain_run() == watched
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters(), strict=True))


# ---------------------------------------------------------------- a finite step far off the healthy scale


def test_an_eps_under_a_negative_power_is_finite_but_off_scale_not_verified() -> None:
    # GCN's deg.pow(-0.5) at an isolated node, read by the root term: the clamp makes (0 + eps) ** -0.5 = 2896 where
    # the op's other values are 0.707, and the node's output about 1e6: finite, not a fix.
    from contract.hunt_s41a import _gcn

    scenario = _gcn(True, False)
    report = raised(scenario.run, *scenario.targets)
    assert (report.phase, report.module, report.step, report.op) == ("forward", "conv", 2, "aten.pow.Tensor_Scalar")
    trial = next(trial for trial in report.fixes if trial.kind == "eps")
    assert trial.finite is True
    off = dict((what, (value, healthy)) for what, value, healthy in trial.fact("off_scale"))
    assert off["op"][0] == pytest.approx(torch.finfo(torch.float32).eps ** -0.5) and off["op"][1] == pytest.approx(
        0.5 ** 0.5)
    assert off["outputs"][0] > 1e5 and off["outputs"][1] < 10
    text = report.to_text()
    assert "0 of 1 verified, 1 finite but off the healthy scale" in text
    assert ("-> finite but off the healthy scale, not verified as a fix: its forward and a stand-in backward came "
            "out finite" in text)
    assert "but the remedied pow gives 2.9e3 where it was changed, where its other values are at most 0.707" in text
    assert "suggested edit" not in text.split("Fixes tried")[1].split("\n\n")[0]
    html = report.to_html()
    assert 'class="nm-unverified"' in html and 'class="nm-verified"' not in html
    # The cause no longer offers the eps that the trial found off scale; it says what eps ** p is.
    assert report.cause is not None and "(x + 1e-12) ** p" not in report.cause.hint
    assert "an eps added to the base only moves it to 1e6 (eps 1e-12)" in report.cause.hint
    assert "x.pow(p).masked_fill(x == 0, 0)" in report.cause.hint


class _LogOfCounts(nn.Module):
    """``log(counts / total)`` of a histogram with an empty bin: log(0) = -inf; eps makes it log(1.2e-7) = -15.9,
    in scale with the other log-frequencies (about -1 to -3)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.lin(x), -1) * (x > -9).float()
        return torch.log(p)  # producer: log of a frequency


def test_an_eps_that_keeps_the_step_in_scale_is_still_verified() -> None:
    torch.manual_seed(0)
    model = _LogOfCounts()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(3, 4), torch.randn(3, 4), torch.tensor([[0.1, -10.0, 0.3, 0.2], [0.5, 0.1, 0.2, 0.3],
                                                                    [0.2, 0.3, 0.1, 0.4]])]

    def run() -> None:
        for x in batches:
            loss = model(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt)
    assert (report.op, report.step) == ("aten.log.default", 2)
    trial = next(trial for trial in report.fixes if trial.kind == "eps")
    assert trial.finite is True and trial.fact("off_scale") is None
    text = report.to_text()
    assert "-> verified through the model only: its forward and a stand-in backward came out finite" in text
    # (session 46: the title no longer counts it among the verified: the step with its own loss never ran)
    assert ": 0 of 2 verified, 1 through the model only (no loss of its own computed)" in text


def test_a_remedy_off_scale_is_ranked_below_one_finite_and_in_scale() -> None:
    from nan_magic.fixes.trial_facts import verified_first
    from nan_magic.records import FixTrial

    off = FixTrial("eps", finite=True, facts=(("off_scale", (("op", 2896.0, 0.7),)),))
    hidden = FixTrial("mask", finite=True, facts=(("moved_all", 4),))
    fixed = FixTrial("float32", finite=True)
    failed = FixTrial("stable", finite=False)
    assert [trial.kind for trial in verified_first([off, failed, hidden, fixed])] == [
        "float32", "mask", "eps", "stable"]


def test_a_remedy_finite_through_the_model_only_is_ranked_below_one_verified_on_the_whole_step() -> None:
    from nan_magic.fixes.trial_facts import verified_first
    from nan_magic.records import FixTrial

    stand_in = FixTrial("eps", finite=True, facts=(("backward_from", "ones"),))
    whole = FixTrial("clamp", finite=True, loss=0.7)
    failed = FixTrial("stable", finite=False)
    assert [trial.kind for trial in verified_first([stand_in, failed, whole])] == ["clamp", "eps", "stable"]


def test_a_tenth_of_a_rate_too_high_that_leaves_a_huge_update_is_not_verified() -> None:
    # lr = 1e37 with a gradient of 100: the step overflows; at a tenth it is finite but moves the weight by 1e38.
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(4):
            if step == 2:
                opt.param_groups[0]["lr"] = 1e37
            loss = model(torch.ones(1, 1)).sum() * 100
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, keep_last_good=True)
    assert report.cause is not None and (report.cause.label, report.step) == ("learning-rate-too-high", 2)
    trial = next(trial for trial in report.fixes if trial.kind == "lr")
    assert trial.finite is True
    [(what, update, before)] = trial.fact("off_scale")
    assert what == "update" and update == pytest.approx(1e38, rel=1e-3) and before == pytest.approx(1.0)
    text = report.to_text()
    assert "0 of 1 verified, 1 finite but off the healthy scale" in text
    assert "it moves a parameter by 1e38, where the parameters were at most 1 before it" in text
    assert "a tenth is not enough: the rate is still far too high" in text


class LogOfMaskedSoftmax(nn.Module):
    """Returns its own loss (HF-style): -log of a softmax whose masked entry is 0 (a sum over the batch, or a mean
    scaled up); the eps clamp of log's operand is the in-scale remedy."""

    def __init__(self, reduction: str, scale: float = 1.0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reduction, self.scale = reduction, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.lin(x), -1) * (x > -9).float()
        return -torch.log(p).sum() if self.reduction == "sum" else -self.scale * torch.log(p).mean()


@pytest.mark.parametrize(("reduction", "scale", "sizes"), [("sum", 1.0, (3, 1)), ("mean", 100.0, ())],
                         ids=["sum-after-a-one-row-batch", "step-0-loss-of-100"])
def test_a_whole_step_total_off_the_last_step_s_is_no_verdict_on_the_remedy(
        reduction: str, scale: float, sizes: tuple[int, ...]) -> None:
    # Review of hunt-c-s42: the loss, the gradient norm or a scalar output against an earlier step (a sum over 512
    # rows after a batch of 1; step 0 with no earlier step, "at most 0") moved 100x for reasons that are not the
    # remedy: the eps clamp stays verified.
    torch.manual_seed(0)
    model = LogOfMaskedSoftmax(reduction, scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = torch.randn(512, 4).clamp(-3, 3)
    big[7, 1] = -10.0
    batches = [torch.randn(size, 4) for size in sizes] + [big]

    def run() -> None:
        for x in batches:
            loss = model(x)
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt)
    eps = next(trial for trial in report.fixes if trial.kind == "eps")
    assert eps.finite is True and eps.fact("off_scale") is None, eps
    text = report.to_text()
    assert "off the healthy scale" not in text and "at most 0" not in text
