"""What the assignment rule (localize/outside/assigned.py) costs a loop that writes its gradients in place.

A region that *assigns* a gradient (``p.grad = total / count``) is recorded every step, so that its first gradients'
ops are still held when the step judges them. A region that only writes gradients in place (``p.grad.div_(2.0)``
per parameter, per-parameter clipping, ``p.grad.sub_(mean)``) must not be taken for one: the in-place op returns
the gradient itself, and counting it doubled the watch's Python calls a healthy step (565 -> 1001 on a 13-parameter
MLP, the review of assign-s40). The rule is asked as the first recorded region ends; its answer decides the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic.localize.outside import loop_writes


def _loop(update: Callable[[nn.Module], None]) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def run() -> None:
        for _ in range(5):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            update(model)
            opt.step()

    return model, opt, run


def _halved_in_place(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.div_(2.0)


def _centred_in_place(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.sub_(p.grad.mean())


def _halved_by_assignment(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = p.grad / 2.0


@pytest.mark.parametrize(("update", "assigns"), [(_halved_in_place, False), (_centred_in_place, False),
                                                 (_halved_by_assignment, True)])
def test_only_a_region_that_assigns_a_gradient_is_taken_for_one(update: Callable[[nn.Module], None], assigns: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[bool] = []
    asked = loop_writes.assigned_gradient

    def spy(*args: object) -> bool:
        answers.append(asked(*args))  # type: ignore[arg-type]
        return answers[-1]

    monkeypatch.setattr(loop_writes, "assigned_gradient", spy)
    model, opt, run = _loop(update)
    with nan_magic.watch(model, opt) as w:
        run()
    assert w.report is None
    assert answers and answers[0] is assigns
    if not assigns:  # watched after the first step: asked once, not every step
        assert answers == [False]
