"""Session 35's healthy rows (tests/contract/calm_s35*.py): their harness can fail, and the scaler fix they found.

A :class:`~contract.calm_s35.Footprint` must tell each trace a watch could leave (a global hook, a patched torch
function, a bumped version counter, an attribute on a parameter, a draw from Python's random stream, a mode left
on the stack): each is left here by hand, and the footprint must differ from a clean run's.

The fix: a GradScaler whose scale makes the scaled loss itself overflow float32 (a finite loss times the scale
past 3.4e38, as a scale grown over a long run or set by the user's schedule does) skips that step, which is
benign (PRODUCT.md). Before, the watch raised on the scaled loss in every mode (ops=True: torch's mul in
``GradScaler.scale`` was taken for nan_magic's own op and its origin dropped). A loss already non-finite before
it was scaled is still an event, raised at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS
from contract.calm_s35 import Footprint
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError


def _run(leave: Callable[[nn.Module, torch.optim.Optimizer], Any] | None) -> Footprint:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    footprint = Footprint((model, opt))
    random.seed(0)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    if leave is not None:
        leave(model, opt)
    return footprint.end()


def _bump_version(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        model[0].weight.add_(0)


def _patch_tensor(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    original = torch.Tensor.sum
    torch.Tensor.sum = lambda self, *args, **kwargs: original(self, *args, **kwargs)  # type: ignore[method-assign]


_TRACES: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Any]] = {
    "global forward hook": lambda m, o: nn.modules.module.register_module_forward_hook(lambda *a: None),
    "patched Tensor method": _patch_tensor,
    "version counter bumped": _bump_version,
    "attribute on a parameter": lambda m, o: setattr(m[0].weight, "_seen", True),
    "gradient hook on a parameter": lambda m, o: m[2].bias.register_hook(lambda g: g),
    "draw from Python's random": lambda m, o: random.random(),
    "optimizer group key": lambda m, o: o.param_groups[0].setdefault("_watched", True),
    "module class swapped": lambda m, o: setattr(m[1], "__class__", type("Tanh", (nn.Tanh,), {})),
}


@pytest.mark.parametrize("trace", list(_TRACES))
def test_the_footprint_tells_each_trace_left(trace: str) -> None:
    undo = {"patched Tensor method": torch.Tensor.sum}
    try:
        clean, again = _run(None), _run(None)
        assert clean == again
        left = _run(_TRACES[trace])
        assert left != again
    finally:
        torch.Tensor.sum = undo["patched Tensor method"]  # type: ignore[method-assign]
        nn.modules.module._global_forward_hooks.clear()


def _scaled(overflow_before_scale: bool) -> Callable[[], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126, backoff_factor=2.0**-16)
    x, y = torch.randn(6, 8) * 4, torch.randn(6, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(x), y) * 64
            if overflow_before_scale and step == 2:
                loss = torch.exp(loss * 100)  # (e^5000: +inf in float32 on any kernel)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        return losses

    return run


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_a_scaled_loss_that_overflows_is_a_benign_skip(mode: str) -> None:
    expected = _scaled(False)()
    run = _scaled(False)
    with nan_magic.watch(**MODE_OPTIONS[mode]) as w:
        got = run()
    assert w.report is None, w.report.message if w.report else ""
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    skipped = [event for event in w.events if event.benign]
    assert len(skipped) == 1 and skipped[0].step == 0, [event.message for event in w.events]
    assert "skipped" in skipped[0].to_text()


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_a_loss_infinite_before_it_was_scaled_is_still_raised(mode: str) -> None:
    run = _scaled(True)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(**MODE_OPTIONS[mode]):
        run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.benign) == ("forward", None, 1, False), report.message


# The hold is narrow (review of session 35): only the very tensor ``GradScaler.scale`` returned for a finite loss is
# held, and a held loss is raised after all when the optimizer step runs (the scaler did not skip). Before, any mul
# of two finite operands, one a single number >= 1, under an active scaler was held, and dropped when the step ran:
# a user's own overflowing loss went unreported in every mode (or raised many steps late).
def _user_loss(form: str) -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-40)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100 if form == "scaled" else 2.0**16)
    x, w = torch.randn(8, 4), torch.tensor(1e10)

    def run() -> None:
        for step in range(3):
            m = model(x).abs().mean()
            if form == "square":  # (~1e21)^2 = +inf at step 1; gradients 2n * scale ~ 1e26 stay finite
                n = m + (1e21 if step == 1 else 0.0)
                loss = n * n  # the loss line
            elif form == "weight":  # a loss weight held in a tensor: (1e30 + m) * 1e10 = +inf at step 1
                loss = (m + (1e30 if step == 1 else 0.0)) * w  # the loss line
            elif form == "every step":  # +inf from step 0 on; the scaler skips while its gradients overflow
                n = m * 1e13 + 1e20
                loss = n * n  # the loss line
            else:  # "scaled": finite loss (1e10), the scale (2**100) overflows it; its gradients stay finite
                loss = model(x).mean() * 1e-3 + (1e10 if step == 1 else 0.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    return run


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
@pytest.mark.parametrize(("form", "step"), [("square", 1), ("weight", 1), ("every step", 0), ("scaled", 1)])
def test_a_users_own_infinite_loss_under_a_scaler_is_raised_at_its_step(form: str, step: int, mode: str) -> None:
    run = _user_loss(form)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(**MODE_OPTIONS[mode]) as w:
        run()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.benign) == ("forward", None, step, False), report.message
    assert not any(event.benign for event in w.events), [event.message for event in w.events]
    if not MODE_OPTIONS[mode].get("ops"):  # (ops=True names no op for a loss's mul, as before the hold)
        assert report.op == "aten.mul.Tensor", report.message
        line = "scaler.scale(loss).backward()" if form == "scaled" else "# the loss line"
        assert report.source is not None and line in report.source.line, report.message


def _two_losses(form: str) -> Callable[[], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126, backoff_factor=2.0**-16)
    x, y = torch.randn(6, 8) * 4, torch.randn(6, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for _step in range(3):
            out = model(x)
            l1, l2 = F.mse_loss(out, y) * 64, out.pow(2).mean() * 64
            opt.zero_grad()
            if form == "list":
                torch.autograd.backward(scaler.scale([l1, l2]))
            elif form == "sum":
                scaler.scale(l1 + l2).backward()
            else:  # "sum after": the sum of two scaled losses, its add's node the only trace of the scales
                (scaler.scale(l1) + scaler.scale(l2)).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(l1.detach())
        return losses

    return run


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
@pytest.mark.parametrize("form", ["list", "sum", "sum after"])
def test_two_losses_scaled_past_float32_are_a_benign_skip(form: str, mode: str) -> None:
    expected = _two_losses(form)()
    run = _two_losses(form)
    with nan_magic.watch(**MODE_OPTIONS[mode]) as w:
        got = run()
    assert w.report is None, w.report.message if w.report else ""
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [event.step for event in w.events if event.benign] == [0], [event.message for event in w.events]


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_a_float16_loss_added_in_place_to_a_scaled_one_is_raised_not_held(mode: str) -> None:
    """``s = scaler.scale(finite); s += fp16_loss`` (inf at step 2): ``s`` has the scale's storage and shape, but not
    its value; it was held as the scale's benign skip in every mode (review of calm-fix-s35). The output's version
    at ``scale`` is kept: an in-place op after it is not the scale's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(6, 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x) * (1000.0 if step == 2 else 1.0)
                loss = (out * out).sum()  # float16: inf at step 2
            opt.zero_grad()
            s = scaler.scale(out.float().pow(2).mean())
            s += loss
            s.backward()
            scaler.step(opt)
            scaler.update()
    report = caught.value.report
    assert (report.step, report.op, report.benign) == (2, "aten.mul.Tensor", False), report.message
    assert report.source is not None and report.source.line.strip().startswith("loss = (out * out).sum()")
