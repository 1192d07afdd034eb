"""Forward producers: a module's own op, and a parent's own code between its children.

PRODUCT.md: the producer is where the *first* non-finite value appeared. A
child that receives a value its parent's own code made non-finite is a
propagator even when it makes a new kind of it (inf - inf = NaN in a Linear):
the parent is the producer, at the op and line of its own code.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


class DivParent(nn.Module):
    """The root's own division by a zero makes ±inf; its child ``b`` turns that into NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h / x[:, :1]  # producer: parent div
        return self.b(h)


class InPlaceDivParent(DivParent):
    """The same division, in place on the child's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h /= x[:, :1]  # producer: in-place div
        return self.b(h)


class ExpBlock(nn.Module):
    """A block whose own ``exp`` overflows; its ``proj`` makes NaN of the infinities."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        h = torch.exp(self.norm(x) * scale)  # producer: block exp
        return self.proj(h)


class MulBlock(nn.Module):
    """A block whose own ``mul`` overflows float16; its LayerNorm makes NaN of it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).half() * 60000.0  # producer: block mul
        return self.norm(h.float())


class Stack(nn.Module):
    """Blocks two levels deep, each block called with a keyword argument."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8)), nn.ModuleDict({"block": block})])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.embed(x))
        block = self.layers[1]["block"]
        h = block(h, scale=200.0) if isinstance(block, ExpBlock) else block(h)
        return self.head(h)


class Residual(nn.Module):
    """A residual block whose own code adds a log of its (sometimes negative) input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.log(x))  # producer: residual log


def _divide_by_a_zero(model_type: type[DivParent], row: int) -> Scenario:
    torch.manual_seed(0)
    model = model_type()
    x = torch.randn(3, 4)
    x[row, 0] = 0.0
    return Scenario((model,), lambda: model(x))


def _deep_exp() -> Scenario:
    torch.manual_seed(0)
    model = Stack(ExpBlock())
    x = torch.randn(4, 8)
    return Scenario((model,), lambda: model(x))


def _deep_mul() -> Scenario:
    torch.manual_seed(0)
    model = Stack(MulBlock())
    with torch.no_grad():
        model.layers[1]["block"].up.weight.mul_(10)
    x = torch.randn(4, 8)
    return Scenario((model,), lambda: model(x))


def _training_parent_div() -> Scenario:
    """The parent's division in the third training step (opt passed), with backward and step."""
    torch.manual_seed(0)
    model = DivParent()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(3, 4) + 3 for _ in range(4)]
    batches[2][2, 0] = 0.0

    def run() -> None:
        for x in batches:
            loss = F.mse_loss(model(x), torch.zeros(3, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


def _residual_in_sequential() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Residual(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    return Scenario((model,), lambda: model(x))


CASES = [
    Case("parent_own_division", lambda: _divide_by_a_zero(DivParent, 0),
         Expect("forward", "", "DivParent", op="aten.div.Tensor", marker="parent div")),
    Case("parent_in_place_division", lambda: _divide_by_a_zero(InPlaceDivParent, 1),
         Expect("forward", "", "InPlaceDivParent", op="aten.div_.Tensor", marker="in-place div")),
    Case("block_own_exp_two_levels_deep", _deep_exp,
         Expect("forward", "layers.1.block", "ExpBlock", op="aten.exp.default", marker="block exp")),
    Case("block_own_fp16_mul_before_layernorm", _deep_mul,
         Expect("forward", "layers.1.block", "MulBlock", op="aten.mul.Tensor", marker="block mul")),
    Case("parent_division_in_third_training_step", _training_parent_div,
         Expect("forward", "", "DivParent", step=2, op="aten.div.Tensor", marker="parent div")),
    Case("residual_block_own_log", _residual_in_sequential,
         Expect("forward", "1", "Residual", op="aten.log.default", marker="residual log")),
]
