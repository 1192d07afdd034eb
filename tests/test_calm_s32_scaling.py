"""Loss scaling by hand (calm_s32, taken back in calm-s32-fix): ``(loss * 2**k).backward()`` without a GradScaler.

The calm_s32 merge held the backward event of such a loss and recorded it benign at the next step boundary no
optimizer step preceded. Its review (calm-s32-fix) found it hid or misreported REAL backward NaNs, each below in
every mode (default, defer, full, ops, ops-defer), each failing on main 502cd50:

1. the loop's own error (``clip_grad_norm_(error_if_nonfinite=True)``, or the loop raising on a non-finite norm)
   lost the held event: no report, the user saw torch's RuntimeError (so did a GradScaler's held event, since before
   calm_s32: it is now raised as found on such an exit, nan_magic/hot/cycle_exit.py);
2. gradient accumulation and LBFGS: a micro-batch's or a closure iteration's forward was taken as a skip (a false
   benign event, then a report naming the wrong module, or the forward phase);
3. a constant power-of-two loss weight and a finiteness guard hid every NaN (no report, all events benign);
4. it worked only when the optimizer was passed to ``watch`` (the same loop raised with ``watch(model)``);
5. a user's double backward failed inside our code (reading the multiply's saved operand) instead of torch's.

Nothing yet tells a loop that backs off its scale from one that hides a real NaN, so the rule was taken back: each
of these reports the NaN where it was born (backward, step 1, the root module, ``aten.div.Tensor``, the sqrt's line)
as BASE did. The skipped overflow of a float16 loop with loss scaling by hand stays raised (a strict xfail below).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: why)

MODES = ["default", "defer", "full", "ops", "ops-defer"]
SQRT_LINE = "r = z.sqrt()"


class Root(nn.Module):
    """The square root of an exact 0 when ``bad``: its backward is inf * 0 (a real NaN), the forward finite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        h = self.lin(x)
        z = h * 0 if bad else h.abs() + 1
        r = z.sqrt()
        return self.head(r)


def _root(lbfgs: bool = False) -> tuple[Root, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = Root()
    opt = (torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2) if lbfgs
           else torch.optim.SGD(model.parameters(), lr=0.01))
    return model, opt, torch.randn(8, 4)


def _assert_born_at_the_sqrt(caught: pytest.ExceptionInfo, events: list) -> None:
    report = caught.value.report
    assert (report.phase, report.step, report.module, str(report.op), report.benign) == (
        "backward", 1, "", "aten.div.Tensor", False)
    assert report.source.line.strip() == SQRT_LINE
    assert report.nan + report.posinf + report.neginf > 0
    assert [event.benign for event in events] == [False]  # (no false benign event before it)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exit_by", ["clip_error", "loop_raises"])
def test_1_a_real_nan_the_loop_raises_its_own_error_on_is_reported(mode: str, exit_by: str) -> None:
    model, opt, x = _root()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        for step in range(3):
            opt.zero_grad()
            (model(x, bad=step == 1).pow(2).mean() * 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=exit_by == "clip_error")
            if not torch.isfinite(norm):
                raise RuntimeError("non-finite gradient norm")
            opt.step()
    _assert_born_at_the_sqrt(caught, w.events)


@pytest.mark.parametrize("mode", MODES)
def test_1_a_real_nan_a_grad_scaler_held_when_the_loop_raised_its_own_error_is_reported(mode: str) -> None:
    """The same exit under a GradScaler (held until ``scaler.step``, BASE's rule): the held event was lost too."""
    model, opt, x = _root()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(x, bad=step == 1).pow(2).mean()).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            scaler.step(opt)
            scaler.update()
    _assert_born_at_the_sqrt(caught, w.events)


@pytest.mark.parametrize("mode", MODES)
def test_2_a_real_nan_in_a_micro_batch_of_gradient_accumulation_is_reported(mode: str) -> None:
    model, opt, x = _root()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        for step in range(3):
            opt.zero_grad()
            for micro in range(2):
                (model(x, bad=step == 1 and micro == 0).pow(2).mean() * 4).backward()
            opt.step()
    _assert_born_at_the_sqrt(caught, w.events)


@pytest.mark.parametrize("mode", MODES)
def test_2_a_real_nan_in_an_lbfgs_closure_is_reported(mode: str) -> None:
    model, opt, x = _root(lbfgs=True)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        for step in range(3):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = model(x, bad=step == 1).pow(2).mean()
                (loss * 2).backward()
                return loss

            opt.step(closure)
    _assert_born_at_the_sqrt(caught, w.events)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weight", [2, 4])
def test_3_a_constant_power_of_two_weight_and_a_finiteness_guard_hide_no_nan(mode: str, weight: int) -> None:
    model, opt, x = _root()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        for step in range(8):
            opt.zero_grad()
            (weight * model(x, bad=step % 3 == 1).pow(2).mean()).backward()
            if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)):
                opt.step()
    _assert_born_at_the_sqrt(caught, w.events)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("passed", [True, False])
def test_4_a_loop_that_backs_off_its_scale_reports_the_same_whether_the_optimizer_is_passed(
        mode: str, passed: bool) -> None:
    model, opt, x = _root()
    targets = (model, opt) if passed else (model,)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*targets, **MODE_OPTIONS[mode]) as w:
        scale = 2.0 ** 16
        for step in range(4):
            opt.zero_grad()
            (model(x, bad=step == 1).pow(2).mean() * scale).backward()
            if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)):
                scale /= 2
                continue
            for p in model.parameters():
                p.grad /= scale
            opt.step()
    _assert_born_at_the_sqrt(caught, w.events)


@pytest.mark.parametrize("mode", MODES)
def test_5_a_double_backward_fails_in_torch_not_in_the_watch(mode: str) -> None:
    model, opt, x = _root()
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as caught, \
            nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        loss = model(x).pow(2).mean() * 4
        loss.backward()
        loss.backward()
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert frames[-1].line == "loss.backward()" and Path(frames[-1].filename).name == Path(__file__).name, frames
    assert not any(Path(frame.filename).match("nan_magic/hot/checks/*.py") for frame in frames), frames


# -- a float16 loop with loss scaling by hand ------------------------------------------------------------------------


def _half_model() -> tuple[nn.Module, list[torch.Tensor], torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    return model, master, torch.optim.SGD(master, lr=0.05), torch.randn(8, 6).half(), torch.randint(0, 3, (8,))


def _train(model, master, opt, x, y, *, skip: bool, steps: int, scale: float) -> None:
    """The loop a user writes; ``skip``: a step whose clip norm is not finite is skipped and the scale lowered."""
    for _ in range(steps):
        loss = F.cross_entropy(model(x).float(), y)
        model.zero_grad()
        (loss * scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, error_if_nonfinite=False)
        if skip and not torch.isfinite(norm):
            scale /= 2.0 ** 8
            continue
        for m, p in zip(master, model.parameters(), strict=True):
            m.grad = p.grad.float() / scale
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters(), strict=True):
                p.copy_(m)


@pytest.mark.xfail(strict=True, reason="a float16 overflow of a loss scaled by hand whose step the loop skips (and "
                                       "backs off its scale) is raised at step 0: the calm_s32 rule that held it hid "
                                       "real NaNs and was taken back; no rule yet takes the loop's back-off as "
                                       "evidence")
def test_a_skipped_overflow_of_a_loss_scaled_by_hand_is_benign() -> None:
    model, master, opt, x, y = _half_model()
    with nan_magic.watch(model, opt) as w:
        _train(model, master, opt, x, y, skip=True, steps=4, scale=2.0 ** 24)
    assert w.report is None and len(w.events) == 1 and w.events[0].benign


@pytest.mark.parametrize("mode", MODES)
def test_the_same_overflow_applied_by_the_loop_is_named_in_backward(mode: str) -> None:
    model, master, opt, x, y = _half_model()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        _train(model, master, opt, x, y, skip=False, steps=2, scale=2.0 ** 24)
    report = caught.value.report
    assert (report.phase, report.step, report.module, report.benign) == ("backward", 0, None, False)
    assert report.cause.label == "half-precision-overflow" and report.source.line.strip() == (
        "loss = F.cross_entropy(model(x).float(), y)")
    assert (report.posinf, report.neginf) == (16, 8)
