"""A child's code run without a module call (gaps21): the module named is the one whose own code ran the op.

``self.act.forward(h)`` runs no module hook, so the watch's stack still says the caller; PRODUCT.md's module is the
innermost watched module whose own code ran the op. The variants: a method other than ``forward``, a helper
function that calls ``layer.forward(x)``, a library module (``nn.Linear``) whose ``forward`` is called directly, a
``super().forward`` (the module's own code, named as before), and a healthy twin, bit-identical.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario


class LogMethod(nn.Module):
    fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 10) if self.fire else torch.tanh(x)  # producer: method log


class SuperLog(LogMethod):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().squash(x) * 2


def run_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.forward(x)


class Direct(nn.Module):
    """Calls ``act`` without ``__call__``: ``how`` is ``method``, ``helper`` or ``super`` (``act`` is a SuperLog)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = SuperLog() if how == "super" else LogMethod()
        self.out = nn.Linear(4, 1)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.how == "method":
            h = self.act.squash(h)
        elif self.how == "helper":
            self.act.forward = self.act.squash  # type: ignore[method-assign]  # (an instance attribute: no call)
            h = run_forward(self.act, h)
        else:
            h = self.act(h)
        return self.out(h)


class DirectLinear(nn.Module):
    """``self.big.forward(x)``: a library module's forward run directly; its addmm overflows at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.big = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.big.forward(self.lin(x)))  # producer: direct linear


def _steps(model: nn.Module, before, steps: int = 4) -> Scenario:
    torch.manual_seed(0)
    xs = [torch.randn(3, 4) for _ in range(steps)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            before(step)
            loss = model(xs[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _direct(how: str, fire_at: int | None) -> Scenario:
    torch.manual_seed(0)
    model = Direct(how)

    def before(step: int) -> None:
        model.act.fire = step == fire_at

    return _steps(model, before)


def _direct_linear(big_at: int | None) -> Scenario:
    torch.manual_seed(0)
    model = DirectLinear()

    def before(step: int) -> None:
        if step == big_at:
            with torch.no_grad():
                model.big.weight.fill_(3e38)

    return _steps(model, before)


def _expect(module: str, module_type: str, marker: str, op: str = "aten.log.default") -> Expect:
    return Expect("forward", module, module_type, step=2, op=op, marker=marker)


CASES = [
    Case(
        "gaps21_child_method_other_than_forward",
        lambda: _direct("method", 2),
        _expect("act", "LogMethod", "method log"),
    ),
    Case(
        "gaps21_child_forward_through_a_helper_calling_forward",
        lambda: _direct("helper", 2),
        _expect("act", "LogMethod", "method log"),
    ),
    Case("gaps21_child_super_method", lambda: _direct("super", 2), _expect("act", "SuperLog", "method log")),
    Case("gaps21_child_method_healthy", lambda: _direct("method", None), None),
    Case(
        "gaps21_library_module_forward_called_directly",
        lambda: _direct_linear(2),
        _expect("big", "Linear", "direct linear", op="aten.addmm.default"),
    ),
    Case("gaps21_library_module_forward_called_directly_healthy", lambda: _direct_linear(None), None),
]


# ---------------------------------------------------------------- a direct child's backward
class SqrtAbs(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * x)  # producer: direct sqrt


class DirectBackward(nn.Module):
    """``self.act.forward(h)``: at step 2 ``lin`` is zeroed, sqrt(0)'s backward divides by 0 inside ``act``."""

    def __init__(self, twins: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = SqrtAbs()
        self.other = SqrtAbs() if twins else nn.Identity()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act.forward(self.lin(x)))


def _direct_backward(zero_at: int | None, twins: bool = False) -> Scenario:
    torch.manual_seed(0)
    model = DirectBackward(twins)

    def before(step: int) -> None:
        if step == zero_at:
            with torch.no_grad():
                model.lin.weight.zero_()
                model.lin.bias.zero_()

    return _steps(model, before)


#: How a direct child's backward is told from a twin of its class below the same parent (gaps22: the parent was
#: named in every mode before).
TWO_OF_THE_CLASS = (
    "the node's forward line is SqrtAbs.forward, and two SqrtAbs lie below the parent: the node's record holds the id "
    "of the method's self (sources.NodeSources.owner_of), which names act, not other"
)


# ---------------------------------------------------------------- a forward that starts writing its input later
class NormalisesInPlaceFrom(nn.Module):
    """Normalises its input rows in place from step ``start`` on (a flag the loop sets: a warm-up that ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.in_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            x /= x.norm(dim=1, keepdim=True)  # producer: later in-place norm
        return self.lin(x)


def _in_place_from(start: int, blank_at: int | None) -> Scenario:
    """From step ``start`` the forward writes its input; at step ``blank_at`` one row is all 0 (0 / 0)."""
    torch.manual_seed(0)
    model = NormalisesInPlaceFrom()
    xs = [torch.randn(5, 6) for _ in range(4)]
    if blank_at is not None:
        xs[blank_at][3] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            model.in_place = step >= start
            loss = model(xs[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


#: Why a forward whose first in-place write of its input is the failing call is named without its op.
FIRST_WRITE_FAILS = (
    "the forward's first in-place write of its input is the failing call: nothing was kept before it "
    "(hot/kept/input_writes.py learns a writer from a call that moved its input's version counter, and copies from "
    "the next call on), so the replay starts from the values the write left: op None, the input said modified in "
    "place; the op tracer (ops=True) sees the write"
)

CASES += [
    Case(
        "gaps21_forward_writes_its_input_from_step_1_blank_row_at_2",
        lambda: _in_place_from(1, 2),
        Expect(
            "forward",
            "",
            "NormalisesInPlaceFrom",
            step=2,
            op="aten.div_.Tensor",
            marker="later in-place norm",
            op_modes=("default", "defer", "full", "ops"),
        ),
        note="learned at step 1's call (its input's version moved), copied from step 2's: the tiered replay and the "
        "per-module watch's replay name the op (hunt19.IN_PLACE_INPUT)",
    ),
    Case(
        "gaps21_forward_first_writes_its_input_at_the_failing_step",
        lambda: _in_place_from(2, 2),
        Expect(
            "forward",
            "",
            "NormalisesInPlaceFrom",
            step=2,
            op="aten.div_.Tensor",
            marker="later in-place norm",
            op_modes=("ops",),
        ),
        note=FIRST_WRITE_FAILS,
    ),
    Case("gaps21_forward_writes_its_input_from_step_1_healthy", lambda: _in_place_from(1, None), None),
]

CASES += [
    Case(
        "gaps21_direct_child_backward_sqrt_of_zero",
        lambda: _direct_backward(2),
        Expect("backward", "act", "SqrtAbs", step=2, op="aten.div.Tensor", marker="direct sqrt"),
    ),
    Case(
        "gaps21_direct_child_backward_beside_a_twin_of_its_class",
        lambda: _direct_backward(2, twins=True),
        Expect("backward", "act", "SqrtAbs", step=2, op="aten.div.Tensor", marker="direct sqrt"),
        note=TWO_OF_THE_CLASS,
    ),
    Case("gaps21_direct_child_backward_healthy", lambda: _direct_backward(None), None),
]
