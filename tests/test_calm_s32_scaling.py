"""Loss scaling by hand (calm_s32): ``(loss * 2**24).backward()`` on a float16 model without a GradScaler, the loop
skipping a step whose clip norm is not finite and lowering its scale (apex's, fairseq's, DeepSpeed's way).

Before: the watch raised the first overflowed scaled gradient at once, a half-precision overflow at step 0, although
the loop skipped that step by design (test_calm_s32_loops.py's ``manual_fp16_loss_scaling`` row, every mode). Now
its backward event is held as a GradScaler's is (nan_magic/hot/checks/loss_scale.py) and recorded as a benign skip
with its scale. Still raised, as found: the same overflow where the loop applies it after all, a backward NaN the
loop skips until it has skipped COLLAPSE_SKIPS steps in a row, one the watch is left on before the loop decided, and
a loss multiplied by a number that is not a power of two.
"""

from __future__ import annotations

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic.hot.checks.loss_scale import loss_scale_of
from nan_magic.hot.checks.optim import COLLAPSE_SKIPS

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: why)

MODES = ["default", "defer", "ops"]


def _half_model() -> tuple[nn.Module, list[torch.Tensor], torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    return model, master, torch.optim.SGD(master, lr=0.05), torch.randn(8, 6).half(), torch.randint(0, 3, (8,))


def _train(model, master, opt, x, y, *, skip: bool, steps: int, scale: float, backoff: float = 2.0 ** 8,
           extra=None) -> list[float]:
    """The loop a user writes; ``skip``: a step whose clip norm is not finite is skipped and the scale lowered."""
    norms = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).float(), y)
        if extra is not None:
            loss = loss + extra(model, x)
        model.zero_grad()
        (loss * scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, error_if_nonfinite=False)
        norms.append(float(norm))
        if skip and not torch.isfinite(norm):
            scale /= backoff
            continue
        for m, p in zip(master, model.parameters(), strict=True):
            m.grad = p.grad.float() / scale
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters(), strict=True):
                p.copy_(m)
    return norms


@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_overflow_of_a_loss_scaled_by_hand_is_a_benign_event_with_its_scale(mode: str) -> None:
    model, master, opt, x, y = _half_model()
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w:
        norms = _train(model, master, opt, x, y, skip=True, steps=4, scale=2.0 ** 24)
    assert norms[0] != norms[0] and all(n == n and n < float("inf") for n in norms[1:]), norms
    assert w.report is None
    assert len(w.events) == 1 and w.events[0].benign and w.events[0].step == 0
    assert w.events[0].phase == "backward" and (w.events[0].posinf, w.events[0].neginf) == (16, 8)
    assert any("the loop skipped this step: its gradients, of a loss it scaled by 1.67772e+07 itself, were "
               "non-finite (1 skipped in a row)" in note for note in w.events[0].notes), w.events[0].notes


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


def _zero_sqrt(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A backward NaN every step: the square root of an exact zero (its gradient inf, times 0)."""
    return (model(x).float()[:, 0] * 0).abs().sqrt().sum()


def test_a_backward_nan_the_loop_keeps_skipping_is_raised_once_the_skips_collapse() -> None:
    model, master, opt, x, y = _half_model()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt) as w:
        _train(model, master, opt, x, y, skip=True, steps=COLLAPSE_SKIPS + 5, scale=2.0 ** 40, backoff=2.0,
               extra=_zero_sqrt)
    report = caught.value.report
    assert (report.phase, report.step, report.benign) == ("backward", 0, False)
    assert report.nan > 0
    assert len(w.events) == COLLAPSE_SKIPS and all(event.benign for event in w.events[:-1])


def test_an_overflow_the_watch_is_left_on_before_the_loop_decided_is_raised() -> None:
    model, _, _, x, y = _half_model()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model):
        (F.cross_entropy(model(x).float(), y) * 2.0 ** 24).backward()
    assert (caught.value.report.phase, caught.value.report.step) == ("backward", 0)


def test_only_a_power_of_two_of_at_least_two_on_the_cpu_is_a_loss_scale() -> None:
    assert loss_scale_of(torch.tensor(2.0 ** 16)) == 65536.0
    assert loss_scale_of(torch.tensor(1024)) == 1024.0
    assert [loss_scale_of(v) for v in (torch.tensor(1000.0), torch.tensor(1.0), torch.tensor(0.5),
                                        torch.tensor(float("inf")), torch.ones(2) * 4, None)] == [None] * 6
    model, _, _, x, y = _half_model()
    with pytest.raises(nan_magic.NonFiniteError), nan_magic.watch(model):  # not a scale: raised as found
        for _ in range(2):
            model.zero_grad()
            (F.cross_entropy(model(x).float(), y) * 3.0e7).backward()
