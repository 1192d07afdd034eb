"""The step counter (PRODUCT.md "step"): training iterations, whoever's optimizer, nested watches."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from nan_magic import NonFiniteError


def _model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, bad_at: int | None = None) -> None:
    x = torch.randn(8, 4)
    for step in range(steps):
        shift = -100.0 if step == bad_at else 100.0
        loss = torch.log(model(x) + shift).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_nested_watch_over_the_same_model_keeps_the_outer_count() -> None:
    model, opt = _model_and_opt()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt) as outer:
        _train(model, opt, 2)
        with nan_magic.watch(model, opt) as inner:
            _train(model, opt, 3)
        assert inner.step == 3 and outer.step == 5
        _train(model, opt, 2, bad_at=1)
    assert caught.value.report.step == 6


def test_an_optimizer_not_passed_is_counted_beside_one_passed() -> None:
    model, opt = _model_and_opt()
    other = nn.Linear(4, 1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with nan_magic.watch(model, opt) as w:
        for _ in range(3):
            other(x).sum().backward()
            other_opt.step()  # never passed, steps three times: three iterations
    assert w.step == 3 and w.steps_taken == 3


def test_inference_steps_are_forward_calls_started() -> None:
    model, _opt = _model_and_opt()
    with torch.no_grad(), nan_magic.watch(model) as w:
        assert w.steps_taken == 0 and w.step == 0
        for _ in range(4):
            model(torch.randn(2, 4))
    assert (w.step, w.steps_taken) == (3, 4)


def test_history_names_each_inference_step_once() -> None:
    model, _opt = _model_and_opt()
    with torch.no_grad(), nan_magic.watch(model) as w:
        for _ in range(3):
            model(torch.randn(2, 4))
    assert [summary.step for summary in w.history] == [0, 1, 2]


def test_history_names_each_training_step_once() -> None:
    model, opt = _model_and_opt()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with nan_magic.watch(model) as w:
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [summary.step for summary in w.history] == [0, 1, 2]


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, z: torch.Tensor, bad: bool = False) -> torch.Tensor:
        h = self.lin(z)
        return torch.sqrt(h - h.detach()) + h if bad else h  # sqrt at 0: its backward makes inf


def _gan_fault_step(bad_at: int, pass_optimizers: bool) -> int:
    """A GAN loop, the discriminator stepped first; the generator's backward fails in iteration ``bad_at``."""
    torch.manual_seed(0)
    g, d = _Generator(), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)
    targets = (g, d, opt_g, opt_d) if pass_optimizers else (g, d)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*targets):
        for iteration in range(4):
            fake = g(torch.randn(5, 4), bad=iteration == bad_at)
            loss_d = F.softplus(d(fake.detach())).mean() + F.softplus(-d(torch.randn(5, 4))).mean()
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = F.softplus(-d(fake)).mean()
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
    report = caught.value.report
    assert (report.phase, report.module_type, report.op, report.reproduced) == (
        "backward", "_Generator", "aten.div.Tensor", True)
    # The replay ran from the optimizer's hook: the library frame it ran under says nothing, and is not shown.
    assert not any(note.startswith("inside ") for note in report.notes), report.notes
    return report.step


@pytest.mark.parametrize("bad_at", [0, 2])
def test_a_gan_event_after_the_discriminators_step_is_in_the_same_iteration(bad_at: int) -> None:
    # Both optimizers step once an iteration: the generator's backward in iteration k is step k, not k + 1.
    assert _gan_fault_step(bad_at, pass_optimizers=True) == bad_at


def test_a_gan_whose_optimizers_were_not_passed_learns_its_iteration_from_the_first_one() -> None:
    # Unpassed, the generator's optimizer is unknown until it first steps: iteration 0 runs one ahead
    # (optimizer/iterations.py); from then on, in step. Either way the producer is named (_gan_fault_step):
    # in iteration 0 the generator's call, made while no optimizer had stepped, is kept while its output lives.
    assert _gan_fault_step(2, pass_optimizers=False) == 2
    assert _gan_fault_step(0, pass_optimizers=False) == 1


def _indexes(sequence: str, passed: str = "") -> list[int]:
    """The iteration index each optimizer step of ``sequence`` (one letter per optimizer) is counted in."""
    from nan_magic.hot.checks.optimizer.iterations import Iterations

    optimizers = {name: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for name in set(sequence + passed)}
    iterations = Iterations(optimizers[name] for name in passed)
    return [iterations.stepped(optimizers[name]) for name in sequence]


def test_iterations_are_counted_when_every_optimizer_taking_part_has_stepped() -> None:
    assert _indexes("AAAA") == [0, 1, 2, 3]
    assert _indexes("DGDGDG", passed="DG") == [0, 0, 1, 1, 2, 2]
    assert _indexes("DGDGDG") == [0, 0, 1, 1, 2, 2]  # the generator joins at its first step
    # A probe optimizer stepped once among a single optimizer's steps: one iteration of lag, then in step again.
    assert _indexes("AAPAAAA") == [0, 1, 1, 2, 3, 4, 5]
    # An optimizer passed but never stepped does not hold the count back after the first iteration.
    assert _indexes("AAAA", passed="AB") == [0, 1, 2, 3]


@pytest.mark.parametrize(("sequence", "passed", "completed"), [
    # A body optimizer stepping every 3rd iteration beside the head's every one: one iteration's lag, once.
    ("H H HB H H HB H H HB H", "HB", [0, 0, 2, 3, 4, 5, 6, 7, 8, 9]),
    # The head alone for two iterations, then the body alone: the body takes the head's place, the count goes on.
    ("HB H H B B B B", "HB", [0, 1, 1, 3, 3, 5, 6]),
    # Unpassed, the body joins at its first step (iteration 1), is left out at iteration 2, occasional from then on.
    ("H HB H HB H HB H", "", [0, 1, 2, 2, 4, 5, 6]),
])
def test_an_optimizer_that_skips_iterations_does_not_close_them(sequence: str, passed: str,
                                                                 completed: list[int]) -> None:
    """Iterations completed as each iteration (space-separated, its optimizers' steps by letter) starts."""
    from nan_magic.hot.checks.optimizer.iterations import Iterations

    optimizers = {name: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for name in "HB"}
    iterations, seen = Iterations(optimizers[name] for name in passed), []
    for steps in sequence.split():
        seen.append(iterations.completed)
        for name in steps:
            iterations.stepped(optimizers[name])
    assert seen == completed
