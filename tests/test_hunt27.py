"""Localization gaps of issue #25 and idioms of real loops, in both timings (immediate, and deferred as on CUDA).

Each test asserts what the user sees: the report's phase, module, step, op
and line, a silent watch on a healthy loop, and results left as they were.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def producer_line(marker: str) -> int:
    import sys

    return marked_line(marker, where=sys.modules[__name__])


def still_regression() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A linear model, an optimizer that leaves it as it is (lr 0) and one batch: each step computes the same."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(8, 4)


def grads_set_by_hand(loss: torch.Tensor, model: nn.Module) -> None:
    params = list(model.parameters())
    for parameter, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
        parameter.grad = grad


def two_losses_backward(loss: torch.Tensor, other: torch.Tensor) -> None:
    torch.autograd.backward([other, loss])


def two_losses_backward_nan_first(loss: torch.Tensor, other: torch.Tensor) -> None:
    torch.autograd.backward([loss, other])


BACKWARDS = {
    "autograd.grad": lambda loss, other, model: grads_set_by_hand(loss + other, model),
    "backward([other, nan])": lambda loss, other, model: two_losses_backward(loss, other),
    "backward([nan, other])": lambda loss, other, model: two_losses_backward_nan_first(loss, other),
}


@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_loss_given_to_autograd_grad_or_several_to_backward_is_the_loss_codes(options, backward: str) -> None:
    # A NaN term whose gradient is finite (log of a constant negative) shows only in the loss: these calls started
    # a backward the watch did not see, and the loop ran on with a NaN loss under a silent watch.
    model, opt, x = still_regression()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(2):
            out = model(x)
            offset = torch.log(out[0, 0] * 0 - 1) if step == 1 else 0  # producer: offset
            loss = out.pow(2).mean() + offset
            opt.zero_grad()
            BACKWARDS[backward](loss, out.abs().mean(), model)
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("offset")


def penalized_training(steps: int) -> list[torch.Tensor]:
    """A critic trained with a gradient penalty (WGAN-GP): ``autograd.grad(create_graph=True)`` inside the loss."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    seen = []
    for _ in range(steps):
        x = torch.randn(16, 4, requires_grad=True)
        score = critic(x)
        (slope,) = torch.autograd.grad(score.sum(), x, create_graph=True)
        loss = score.mean() + 10 * (slope.norm(dim=1) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(loss.detach())
    return seen + [p.detach().clone() for p in critic.parameters()]


@pytest.mark.parametrize("options", TIMINGS)
def test_a_gradient_penalty_is_silent_and_identical(options) -> None:
    expected = penalized_training(3)
    with nan_magic.watch(**options) as w:
        got = penalized_training(3)
    assert w.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def long_loss(out: torch.Tensor, labels: torch.Tensor, terms: int = 600) -> torch.Tensor:
    """A loss code of more ops than the recorder's budget (512): an MSE and many small terms."""
    loss = nn.functional.mse_loss(out, labels)
    for _ in range(terms):
        loss = loss + 0.0
    return loss


@pytest.mark.parametrize("options", TIMINGS)
def test_a_stale_nan_beside_a_loss_code_too_long_to_record_is_a_suspect_not_the_data(options) -> None:
    # The loss code ran over the recorder's budget: nothing told what it read, and a NaN kept from an earlier run
    # in the namespace was reported as the step's data (phase data, the variable's name).
    earlier_losses = [torch.tensor(float("nan"))]
    model, opt, x = still_regression()
    labels = torch.randn(8, 1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(2):
            out = model(x)
            penalty = torch.log(out[0] * 0 - 1).sum() if step == 1 else 0
            loss = long_loss(out, labels) + penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("forward", None, 1, "loss")
    text = report.to_text()
    assert "earlier_losses[0], among your code's variables, is non-finite too;" in text
    assert "ran more ops a step than the watch records (512 for the loss" in text
    assert len(earlier_losses) == 1


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_label_read_by_a_loss_code_too_long_to_record_is_data_or_a_suspect(options) -> None:
    # Immediate: the event walks the loss code's nodes, and MseLossBackward0 saved the labels (600 nodes deep).
    # Deferred: backward has freed them by the check, and the walk at backward start stops at 256 nodes (each step
    # pays it): the labels are named as a suspect beside the loss code, not as data.
    earlier_losses = [torch.tensor(float("nan"))]
    model, opt, x = still_regression()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(2):
            labels = torch.randn(8, 1)
            if step == 1:
                labels[2] = float("nan")
            loss = long_loss(model(x), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    if options:
        assert (report.phase, report.module, report.step, str(report.tensor)) == ("forward", None, 1, "loss")
        assert "earlier_losses[0] and labels, among your code's variables, are non-finite too;" in report.to_text()
    else:
        assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", None, 1, "labels")
        assert (report.nan, report.numel) == (1, 8)
    assert len(earlier_losses) == 1


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # producer: log


def log_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Log(), nn.Linear(8, 8), nn.Linear(8, 1))


def train_and_evaluate(model: nn.Module, opt: torch.optim.Optimizer, bad: tuple[int, int] | None) -> list[float]:
    """Three epochs of a step and two evaluation batches under ``torch.inference_mode()``; the evaluation means.

    ``bad``: the (epoch, batch) whose evaluation batch is negative (log of it: NaN).
    """
    torch.manual_seed(1)
    means = []
    for epoch in range(3):
        loss = model(torch.rand(4, 8) + 5).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        with torch.inference_mode():
            for batch in range(2):
                x = torch.rand(4, 8) + 5
                if (epoch, batch) == bad:
                    x = -x
                means.append(model(x).mean().item())
        model.train()
    return means


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_in_a_later_inference_mode_evaluation_batch_is_named(options) -> None:
    # The recorder pushed after the optimizer step stays on the stack, inert, through the evaluation blocks.
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        train_and_evaluate(model, opt, bad=(2, 1))
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "0", 3, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("log")


@pytest.mark.parametrize("options", TIMINGS)
def test_inference_mode_evaluations_between_steps_are_silent_and_identical(options) -> None:
    unwatched = log_model()
    expected = train_and_evaluate(unwatched, torch.optim.SGD(unwatched.parameters(), lr=0.01), None)
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options) as w:
        got = train_and_evaluate(model, opt, None)
    assert w.report is None
    assert got == expected


def zero_grad_bound_early(options: dict, bound_before: bool) -> nan_magic.Report:
    """40 layers (80 gradients), ``zero_grad(set_to_none=False)`` at the top of the loop; step 3's batch: log of <0."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    zero = opt.zero_grad  # bound before the watch patches zero_grad
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            (zero if bound_before else opt.zero_grad)(set_to_none=False)
            raw = torch.rand(8, 4) + (5 if step < 3 else -5)
            x = torch.log(raw)  # producer: batch
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
    return caught.value.report


@pytest.mark.parametrize("bound_before", [False, True])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_zero_grad_bound_before_the_watch_leaves_the_data_code_recorded(options, bound_before: bool) -> None:
    # Its 80 zero_ ops were recorded as the data code's, past that region's budget of 64: its recording went off
    # for the rest of the watch, and the NaN batch was named without its op and line.
    report = zero_grad_bound_early(options, bound_before)
    assert (report.phase, report.step, report.op) == ("data", 3, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("batch")
    assert not any("ran more ops a step than the watch records" in note for note in report.notes)


class OpNames(TorchDispatchMode):
    """The aten ops a block ran, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def three_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for x in batches:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("options", TIMINGS)
def test_a_users_dispatch_mode_around_the_watch_sees_only_the_loops_ops(options) -> None:
    # It saw the watch's reads too: an aminmax and an item per module output, the optimizer check's norms.
    batches = [torch.rand(4, 8) + 5 for _ in range(4)]
    model = log_model()
    with OpNames() as unwatched:
        three_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches)
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with OpNames() as watched:
        with nan_magic.watch(model, opt, **options) as w:
            three_steps(model, opt, batches)
        depth = torch._C._len_torch_dispatch_stack()
    assert w.report is None
    assert watched.names == unwatched.names
    assert depth == 1 and torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_under_a_users_dispatch_mode_is_named_and_the_mode_sees_none_of_the_watchs_replay(options) -> None:
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.rand(4, 8) + 5, torch.rand(4, 8) + 5, -torch.rand(4, 8) - 5]
    with OpNames() as seen:
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
            three_steps(model, opt, batches)
        depth = torch._C._len_torch_dispatch_stack()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "0", 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("log")
    assert depth == 1 and torch._C._len_torch_dispatch_stack() == 0
    assert "aten.aminmax.default" not in seen.names and "aten._local_scalar_dense.default" not in seen.names
    assert seen.names.count("aten.log.default") == 3  # the loop's three forwards, not the replay's


def two_losses_one_graph(kind: str, loss_a: torch.Tensor, loss_b: torch.Tensor, model: nn.Module) -> None:
    """Two losses from one forward, each with its own backward over the kept graph."""
    if kind == "backward":
        loss_a.backward(retain_graph=True)
        loss_b.backward()
    else:  # per-task gradients (PCGrad-like), summed by hand
        params = list(model.parameters())
        first = torch.autograd.grad(loss_a, params, retain_graph=True)
        second = torch.autograd.grad(loss_b, params)
        for parameter, a, b in zip(params, first, second, strict=True):
            parameter.grad = a + b


@pytest.mark.parametrize("kind", ["backward", "autograd.grad"])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_in_the_second_loss_of_a_retained_graph_is_named(options, kind: str) -> None:
    # The immediate mode let the loss code's records go as the first backward ended: the second loss, NaN, was
    # reported without its op and line (the deferred mode named them).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            out = model(torch.randn(4, 8))
            first = out[:, 0].pow(2).mean()
            second = out[:, 1].abs().mean() + (torch.log(out[0, 1] * 0 - 1) if step == 2 else 0)  # producer: second
            opt.zero_grad()
            two_losses_one_graph(kind, first, second, model)
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("second")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_parameter_the_loop_renormalizes_after_the_step_is_named_by_the_write(options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                weight = model[0].weight
                weight.div_(weight.norm() * (0 if step == 2 else 1))  # producer: renorm
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 3, "aten.div_.Tensor")
    assert report.source is not None and report.source.lineno == producer_line("renorm")


@pytest.mark.parametrize("options", [*TIMINGS, pytest.param({"ops": True}, id="ops")])
def test_a_flop_counter_around_the_watch_counts_the_same_and_leaves_no_mode(options) -> None:
    # In ops mode the watch's op tracer comes and goes across its callbacks: the callbacks do not step beside the
    # user's modes there (the stack was left without the tracer to pop).
    from torch.utils.flop_counter import FlopCounterMode

    batches = [torch.rand(4, 8) + 5 for _ in range(3)]
    model = log_model()
    with FlopCounterMode(display=False) as unwatched:
        three_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), batches)
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with FlopCounterMode(display=False) as watched, nan_magic.watch(model, opt, **options) as w:
        three_steps(model, opt, batches)
    assert w.report is None
    assert watched.get_total_flops() == unwatched.get_total_flops() > 0
    assert torch._C._len_torch_dispatch_stack() == 0
