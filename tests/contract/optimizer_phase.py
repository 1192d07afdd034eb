"""Optimizer-phase producers (issue 27): the op inside the optimizer step and the user's ``opt.step()`` line.

The tiered watch sees a step's result (its parameters after it); at such an
event it replays the step on copies under the op tracer
(localize/replay/optimizer.py), so every mode names the op ``ops=True``
traces and the line that called the step. The deferred check reads a step
with wild hyperparameters (a NaN learning rate) at once, so it is reported
at its own step, in the optimizer phase, not as the next step's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef


def _huge_lr() -> Scenario:
    """SGD with lr = 1e38: every update of a gradient above 3.4 passes float32's max."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    x = torch.randn(8, 4)

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            (model(x).pow(2).sum() * 100).backward()
            opt.step()  # producer: huge lr step

    return Scenario((model, opt), run)


def _warmup_lr(optimizer: str) -> Scenario:
    """A linear warm-up over zero warm-up steps: lr = base * min(1, 0 / 0) = NaN at the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    base = [group["lr"] for group in opt.param_groups]
    warmup_steps = 0
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> None:
        for step in range(4):
            scale = torch.clamp(torch.tensor(float(step)) / warmup_steps, max=1.0).item()  # producer: warm-up scale
            for group, lr in zip(opt.param_groups, base):
                group["lr"] = lr * scale
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    return Scenario((model, opt), run)


def _adam_fp16_foreach() -> Scenario:
    """Adam's foreach implementation, float16, eps=1e-8 (0 in float16), over three steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8, foreach=True)
    tokens = torch.tensor([3, 7])

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            model(tokens).float().sum().backward()
            opt.step()  # producer: foreach adam step

    return Scenario((model, opt), run)


def _healthy_adam_fp16_eps() -> Scenario:
    """Float16 Adam with an eps float16 holds (1e-4): unbounded steps, checked every step, nothing to report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    tokens = torch.tensor([3, 7, 1])

    def run() -> list[torch.Tensor]:
        for _ in range(5):
            opt.zero_grad()
            model(tokens).float().sum().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _fp16_growth(foreach: bool, healthy: bool = False) -> Scenario:
    """A float16 weight near 65504 that each SGD step moves 1000 further: the update's addition overflows.

    The weight starts at 62000; the third step's ``p += -lr * grad`` reaches 66000, past float16's max
    (``healthy``: it starts at 52000 and stays below). A replay from the state the step left would start
    from 0 where the weight went infinite and stay finite: the step is replayed from a copy of the
    parameter kept before it, since its values came within a factor of the limit (step_checks.py's headroom).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[52000.0 if healthy else 62000.0, 0.5, -0.5, 0.25]]))
    opt = torch.optim.SGD(model.parameters(), lr=1e4, foreach=foreach)
    x = torch.full((8, 4), 0.1, dtype=torch.float16)

    def run() -> list[torch.Tensor]:
        for _ in range(5):
            opt.zero_grad()
            (-model(x).float().mean()).backward()
            opt.step()  # producer: fp16 growth step
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


CASES = [
    Case("optimizer_huge_learning_rate", _huge_lr,
         Expect("optimizer", "0", "Linear", op="aten.add_.Tensor", marker="huge lr step",
                tensor=TensorRef.parameter("0.weight"), cause="learning-rate-too-high")),
    # (The rate is a Python number the loop set from ``scale``, NaN: no op of the step made it; its line is named.)
    Case("optimizer_nan_warmup_lr_sgd", lambda: _warmup_lr("sgd"),
         Expect("optimizer", "0", "Linear", op=None, marker="warm-up scale",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}), cause="nonfinite-number")),
    Case("optimizer_nan_warmup_lr_adam", lambda: _warmup_lr("adam"),
         Expect("optimizer", "0", "Linear", op=None, marker="warm-up scale",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}), cause="nonfinite-number")),
    Case("optimizer_adam_fp16_eps_foreach", _adam_fp16_foreach,
         Expect("optimizer", "0", "Embedding", op="aten._foreach_addcdiv_.ScalarList", marker="foreach adam step",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}), cause="optimizer-eps-underflow")),
    Case("optimizer_fp16_adam_healthy_eps", _healthy_adam_fp16_eps, None),
    Case("optimizer_fp16_parameter_overflows_by_addition", lambda: _fp16_growth(foreach=False),
         Expect("optimizer", "0", "Linear", step=3, op="aten.add_.Tensor", marker="fp16 growth step",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"+inf"}))),
    Case("optimizer_fp16_parameter_overflows_by_addition_foreach", lambda: _fp16_growth(foreach=True),
         Expect("optimizer", "0", "Linear", step=3, op="aten._foreach_add_.List", marker="fp16 growth step",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"+inf"}))),
    Case("optimizer_fp16_parameter_near_the_limit_healthy", lambda: _fp16_growth(foreach=True, healthy=True), None),
]
