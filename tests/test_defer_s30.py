"""The deferred watch (what a GPU runs) names what the immediate one names: round 30's fixes.

- A producer inside a library module (a spectral-norm parametrization) of a model called in a helper: the eps trial
  applies at the report's line, the one that called the module, also where the trial runs from the deferred check
  (``opt.step()``'s line), not only where it runs inside that line.
- An optimizer step's result judged as the watch is left (the loop's last step): ``%debug`` opens at the line
  that called ``opt.step()``, in the loop's frame, not at the ``with`` statement.
- An optimizer step whose replay cannot make the value again (the deferred check has only a later step's gradient):
  the report still names the line that called the step.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def _report(build, options):  # type: ignore[no-untyped-def]
    targets, run = build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets, **options):
        run()
    return caught.value.report


def _line(pointer) -> tuple[str, int] | None:  # type: ignore[no-untyped-def]
    return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)


def _marker(key: str) -> int:
    with open(__file__) as source:
        return next(n for n, text in enumerate(source, 1) if text.rstrip().endswith(f"# here: {key}"))


def _spectral():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    nn.init.zeros_(model[2].weight)
    nn.utils.parametrizations.spectral_norm(model[2])  # W / sigma(W): 0 / 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(6, 4)

    def loss_of(m: nn.Module) -> torch.Tensor:
        return F.softplus(-m(x)).mean()  # here: helper call

    def run() -> None:
        for _ in range(3):
            loss = loss_of(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return (model, opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_library_module_producer_fix_is_tried_at_the_line_that_called_it(options: dict) -> None:
    report = _report(_spectral, options)
    assert (report.module, report.op, report.phase) == ("2.parametrizations.weight.0", "aten.div.Tensor", "forward")
    assert _line(report.source) == ("test_defer_s30.py", _marker("helper call"))
    eps = [fix for fix in report.fixes if fix.kind == "eps"]
    assert eps and eps[0].finite is True, report.to_text()


def _adam_last_step():  # type: ignore[no-untyped-def]
    """Adam(eps=0) over an auxiliary head whose loss joins at the last step with weight 0: its first update is
    ``0 / sqrt(0)``, made by the last ``opt.step()``."""
    torch.manual_seed(0)
    trunk, aux = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"trunk": trunk, "aux": aux})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, foreach=False)
    xs = [torch.randn(5, 4) for _ in range(3)]

    def run() -> None:
        for step in range(3):
            h = trunk(xs[step])
            loss = h.pow(2).mean() + (0.0 * aux(h).mean() if step == 2 else 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()  # here: last step
    return (model, opt), run


#: The same loop at a cell's (a script's) top level: the frame that called opt.step() is the module's.
_ADAM_CELL = """
torch.manual_seed(0)
trunk, aux = nn.Linear(4, 4), nn.Linear(4, 1)
model = nn.ModuleDict({"trunk": trunk, "aux": aux})
opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, foreach=False)
xs = [torch.randn(5, 4) for _ in range(3)]
with nan_magic.watch(model, opt, **options):
    for step in range(3):
        h = trunk(xs[step])
        loss = h.pow(2).mean() + (0.0 * aux(h).mean() if step == 2 else 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


@pytest.mark.parametrize("options", TIMINGS)
def test_last_steps_optimizer_event_at_a_cells_top_level_opens_debug_at_the_step(options: dict) -> None:
    """A cell's loop: %debug opens at ``opt.step()`` in the cell's frame, with that step's locals."""
    namespace = {"torch": torch, "nn": nn, "nan_magic": nan_magic, "options": options}
    with pytest.raises(NonFiniteError) as caught:
        exec(compile(_ADAM_CELL, "<cell>", "exec"), namespace)
    report = caught.value.report
    assert (report.module, report.phase, report.step, report.op) == ("aux", "optimizer", 2, "aten.addcdiv_.default")
    assert (report.debug_frame.filename, report.debug_frame.lineno) == ("<cell>", 13), report.to_text()


@pytest.mark.parametrize("options", [
    TIMINGS[0], pytest.param({"defer": True}, id="deferred", marks=pytest.mark.xfail(strict=True, reason=(
        "the function running the loop returned before the watch was left: holding its frame for %debug would "
        "keep its locals (the batch, the logits) alive into the next step on every step, so the check's exit is "
        "where %debug opens (tests/test_defer_s27.py's _CARRIED)")))])
def test_last_steps_optimizer_event_opens_debug_at_the_step(options: dict) -> None:
    report = _report(_adam_last_step, options)
    assert (report.module, report.phase, report.step, report.op) == ("aux", "optimizer", 2, "aten.addcdiv_.default")
    assert _line(report.source) == ("test_defer_s30.py", _marker("last step"))
    assert _line(report.debug_frame) == ("test_defer_s30.py", _marker("last step")), report.to_text()


def _huge_gradient():  # type: ignore[no-untyped-def]
    """A loss term divided by a near-zero number at step 1 (1e-30): gradients of ~1e25 overflow Adam's
    ``exp_avg_sq`` in that step; step 2 is healthy again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs = [torch.randn(4, 4) for _ in range(4)]
    scales = [1.0, 1e-15, 1.0, 1.0]

    def run() -> None:
        for step in range(4):
            loss = (model(xs[step]) / scales[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # here: overflowing step
    return (model, opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_optimizer_state_overflow_names_the_steps_line(options: dict) -> None:
    report = _report(_huge_gradient, options)
    assert (report.phase, report.step) == ("optimizer", 1), report.to_text()
    assert report.tensor.role.name == "OPTIMIZER_STATE", report.tensor
    assert _line(report.source) == ("test_defer_s30.py", _marker("overflowing step")), report.to_text()


def _second_optimizer():  # type: ignore[no-untyped-def]
    """A body optimizer (SGD) and a norm's Adam(eps=0), stepped one after the other; the norm's gradient is 0 at
    step 0 (the head is 0), so Adam's first update is ``0 / 0``: judged deferred at step 1's first ``step()``."""
    torch.manual_seed(0)
    norm, head = nn.LayerNorm(4), nn.Linear(4, 1)
    nn.init.zeros_(head.weight)
    model = nn.Sequential(norm, head)
    body_opt = torch.optim.SGD(head.parameters(), lr=0.05)
    norm_opt = torch.optim.Adam(norm.parameters(), lr=1e-3, eps=0.0, foreach=False)
    xs = [torch.randn(6, 4) for _ in range(3)]

    def run() -> None:
        for step in range(3):
            loss = model(xs[step]).pow(2).mean()
            body_opt.zero_grad()
            norm_opt.zero_grad()
            loss.backward()
            body_opt.step()
            norm_opt.step()  # here: norm step
    return (model, body_opt, norm_opt), run


@pytest.mark.parametrize("options", TIMINGS)
def test_second_optimizers_event_opens_debug_at_its_step_not_the_next_check(options: dict) -> None:
    report = _report(_second_optimizer, options)
    assert (report.module, report.phase, report.step) == ("0", "optimizer", 0), report.to_text()
    assert _line(report.source) == ("test_defer_s30.py", _marker("norm step"))
    assert _line(report.debug_frame) == ("test_defer_s30.py", _marker("norm step")), report.to_text()
