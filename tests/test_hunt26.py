"""Idioms of real training loops that the watch got wrong, in both timings (immediate, and deferred as on CUDA).

Each test asserts what the user sees: the report's phase, module, step, op
and line, the user's own error, and a process left as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nan_magic
from nan_magic import NonFiniteError

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # producer: log


def log_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Log(), nn.Linear(8, 8), nn.Linear(8, 1))


def log_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(Log.forward)
    return start + next(i for i, line in enumerate(lines) if "producer: log" in line)


def dispatch_state() -> tuple[object, ...]:
    """What a dispatch mode pushed and popped out of step would leave changed (torch's thread-local key set)."""
    return str(torch._C._dispatch_tls_local_include_set()), torch._C._len_torch_dispatch_stack()


def train_then_evaluate(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    """Three training steps, then an evaluation under ``torch.inference_mode()``."""
    for _ in range(3):
        loss = model(torch.rand(4, 8) + 5).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    try:
        with torch.inference_mode():
            return model(batch)
    finally:
        model.train()


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_in_an_inference_mode_evaluation_is_named_and_leaves_torch_working(options) -> None:
    # The loop code's recorder, pushed after the optimizer step, was popped inside the block: the block's end
    # put torch's Python dispatch key back over an empty mode stack, and every op after it failed.
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = dispatch_state()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        train_then_evaluate(model, opt, torch.full((4, 8), -100.0))
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "0", 3, "aten.log.default")
    assert report.source is not None and report.source.lineno == log_line()
    assert dispatch_state() == before
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_inside_inference_mode_false_leaves_torch_working(options) -> None:
    # inference_mode(False) inside a loop that is not in inference mode restores the key set as well, and nothing
    # tells the block from outside: the watch puts the Python key off as it is left, before any op runs.
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = dispatch_state()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for _ in range(2):
            loss = model(torch.rand(4, 8) + 5).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.inference_mode(False):
            model(torch.full((4, 8), -100.0))
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "0", 2, "aten.log.default")
    assert dispatch_state() == before
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


@pytest.mark.parametrize("options", TIMINGS)
def test_the_users_error_inside_an_inference_mode_block_is_theirs(options) -> None:
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    before = dispatch_state()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), nan_magic.watch(model, opt, **options):
        train_then_evaluate(model, opt, torch.rand(4, 7) + 5)
    assert dispatch_state() == before
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


@pytest.mark.parametrize("options", TIMINGS)
def test_a_healthy_inference_mode_evaluation_between_steps_is_silent_and_identical(options) -> None:
    def run() -> list[torch.Tensor]:
        model = log_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        out = [train_then_evaluate(model, opt, torch.rand(4, 8) + 5) for _ in range(2)]
        return out + [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1)
    expected = run()
    torch.manual_seed(1)
    before = dispatch_state()
    with nan_magic.watch(**options) as w:  # the discovering watch: the model is built inside it
        got = run()
    assert w.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert dispatch_state() == before


class _OpNames(TorchDispatchMode):
    """The aten ops a block ran, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", TIMINGS)
def test_a_users_dispatch_mode_after_an_inference_mode_block_sees_the_ops(options) -> None:
    # The recorder pushed inside the block stayed on the stack past its end with the Python key off (the block
    # restores the key set it found): a mode the user entered next saw nothing (a FlopCounterMode counting 0).
    model = log_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, **options):
        train_then_evaluate(model, opt, torch.rand(4, 8) + 5)
        with _OpNames() as seen:
            torch.ones(2) + 1
    assert {"ones", "add"} <= set(seen.names)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_watch_inside_inference_mode_names_the_op(options) -> None:
    # Inference tensors have no version counter: the op tracer now knows their origins by identity alone.
    model = log_model()
    with torch.inference_mode(), pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.rand(4, 8) + 5)
        model(torch.full((4, 8), -100.0))
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "0", 1, "aten.log.default")
    assert report.source is not None and report.source.lineno == log_line()


def marked_line(marker: str) -> int:
    import inspect
    import sys

    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.rstrip().endswith(f"# producer: {marker}"))


def still_regression() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A linear model, an optimizer that leaves it as it is (lr 0) and one batch: each step computes the same."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(8, 4)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_left_in_the_namespace_is_not_the_data_of_a_loss_that_made_its_own(options) -> None:
    # The loss code was recorded in full: what it read is known, and a NaN kept from an earlier run (a notebook's
    # namespace, a list of past losses) is not what it read.
    earlier_losses = [torch.tensor(float("nan"))]
    model, opt, x = still_regression()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(2):
            out = model(x)
            penalty = torch.log(out[0] * 0 - 1).sum() if step == 1 else 0  # producer: penalty
            loss = out.pow(2).mean() + penalty
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, "aten.log.default")
    assert report.source is not None and report.source.lineno == marked_line("penalty")
    assert len(earlier_losses) == 1


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_label_read_before_the_second_model_call_of_a_loss_is_still_data(options) -> None:
    # The loss code is recorded from the second call's return only: what its first part read is found as before.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a, b, first_labels, second_labels = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 1), torch.randn(8, 1)
    first_labels[3] = float("nan")
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        first = nn.functional.mse_loss(model(a), first_labels)
        second = nn.functional.mse_loss(model(b), second_labels)
        opt.zero_grad()
        (first + second).backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", None, 0, "first_labels")
    assert (report.nan, report.numel) == (1, 8)


def lbfgs_steps(model: nn.Module, batches: list[torch.Tensor], max_iter: int) -> list[torch.Tensor]:
    """LBFGS steps, each evaluating its closure (forward and backward) up to ``max_iter`` times; the losses."""
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=max_iter)
    losses = []
    for batch in batches:
        def closure(batch: torch.Tensor = batch) -> torch.Tensor:
            opt.zero_grad()
            loss = model(batch).pow(2).mean()
            loss.backward()
            return loss

        losses.append(opt.step(closure).detach())
    return losses


@pytest.mark.parametrize("max_iter", [1, 4])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_in_an_lbfgs_closure_is_named_in_the_forward_not_the_step(options, max_iter: int) -> None:
    # The closure runs the forward and backward inside opt.step(), after the pre-hook's check: the deferred check
    # judged the parameters LBFGS then wrote before the forward that made its direction NaN.
    model = log_model()
    batches = [torch.rand(8, 8) + 5, torch.full((8, 8), -100.0)]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        lbfgs_steps(model, batches, max_iter)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "0", 1, "aten.log.default")
    assert report.source is not None and report.source.lineno == log_line()


@pytest.mark.parametrize("watched", [False, True], ids=["model", "model-and-optimizer"])
@pytest.mark.parametrize("max_iter", [1, 4])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_after_a_layer_in_an_lbfgs_closure_is_named_before_the_step_writes_the_layer(options, max_iter: int,
                                                                                       watched: bool) -> None:
    # The log reads a Linear's output (through a softplus, 0 below -104): judged after LBFGS wrote that Linear's
    # weight from the NaN direction (the step's post-hook), the closure's call was replayed on the NaN weight and
    # named "already non-finite".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Softplus(), Log(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=max_iter)
    batches = [torch.rand(8, 8), torch.full((8, 8), -1000.0)]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, *([opt] if watched else []), **options):
        for batch in batches:
            def closure(batch: torch.Tensor = batch) -> torch.Tensor:
                opt.zero_grad()
                loss = model(batch).pow(2).mean()
                loss.backward()
                return loss

            opt.step(closure)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "2", 1, "aten.log.default")
    assert report.source is not None and report.source.lineno == log_line()
    assert report.reproduced is True


class RootOfSquare(nn.Module):
    """sqrt(x ** 2) of a feature that is exactly 0: a finite forward, inf * 0 = NaN in its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x**2)  # producer: root of a square


@pytest.mark.parametrize("max_iter", [1, 4])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_gradient_in_an_lbfgs_closure_is_named_in_its_backward_not_in_the_step(options, max_iter: int) -> None:
    # The closure's gradients were checked only before the step (none yet): LBFGS applied the NaN ones, and the
    # report read "the LBFGS step made 0.weight non-finite", unclassified.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), RootOfSquare(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight[3].zero_()
        model[0].bias[3] = 0.0  # feature 3 is 0 for every batch
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=max_iter)
    batch = torch.rand(8, 8)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(batch).mean()
            loss.backward()
            return loss

        opt.step(closure)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.autograd_node) == ("backward", "1", 0, "SqrtBackward0")
    assert report.source is not None
    assert report.source.lineno == marked_line("root of a square")
    assert all(parameter.isfinite().all() for parameter in model.parameters())  # stopped before the step wrote


@pytest.mark.parametrize("options", TIMINGS)
def test_healthy_lbfgs_is_silent_and_identical(options) -> None:
    batches = [torch.rand(8, 8) + 5 for _ in range(3)]
    expected = lbfgs_steps(log_model(), batches, 4)
    model = log_model()
    with nan_magic.watch(model, **options) as w:
        got = lbfgs_steps(model, batches, 4)
    assert w.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class WithScripted(nn.Module):
    """A model holding a ``torch.jit.script``ed block (a norm layer with buffers among it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.block = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()))
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.block(self.a(x)))


@pytest.mark.parametrize("options", TIMINGS)
def test_a_scripted_submodule_is_watched_at_its_boundary(options) -> None:
    # Its buffers are a TorchScript dict (no ``get``, no iteration by name): the watch read them as a Python one.
    torch.manual_seed(0)
    model = WithScripted()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [torch.randn(4, 8) for _ in range(3)]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step, x in enumerate(batches):
            if step == 1:
                with torch.no_grad():
                    model.block[0].weight[0, 0] = float("inf")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    # The loop's write after the step is named by that write (phase optimizer, the weight's owner), the scripted
    # block's buffers read along the way.
    assert (report.phase, report.module, report.step) == ("optimizer", "block.0", 1)


def test_a_scripted_model_given_to_the_watch_is_a_one_line_error_and_one_found_by_discovery_runs_unwatched() -> None:
    torch.manual_seed(0)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    with pytest.raises(TypeError, match=r"cannot watch RecursiveScriptModule .*before torch.jit.script") as caught:
        nan_magic.watch(scripted)
    assert "\n" not in str(caught.value)
    x = torch.randn(4, 8)
    with nan_magic.watch() as w:
        out = scripted(x)
    assert w.report is None and torch.equal(out, scripted(x))


class KeywordModel(nn.Module):
    """A model called with keyword arguments only, returning its loss (the Hugging Face way)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        return {"loss": nn.functional.mse_loss(logits, labels), "logits": logits}


@pytest.mark.parametrize("bad_step", [0, 1])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_batch_given_by_keyword_is_data_on_every_step(options, bad_step: int) -> None:
    # Global pre-hooks never see keyword arguments: on a step that checks every module call, the immediate
    # mode found the NaN entering ``embed`` first and blamed the model's own code (phase forward, the root).
    torch.manual_seed(0)
    model = KeywordModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            batch = torch.randn(4, 8)
            if step == bad_step:
                batch[0, 0] = float("nan")
            out = model(input_ids=batch, labels=torch.randn(4, 1))
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, str(report.tensor)) == ("data", "", bad_step,
                                                                               "kwargs['input_ids']")
    assert (report.nan, report.numel) == (1, 32)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_nan_loss_given_to_torch_autograd_backward_is_judged_like_loss_backward(options) -> None:
    # A NaN term whose gradient is finite (log of a constant negative) shows only in the loss: a loop that calls
    # torch.autograd.backward(loss) instead of loss.backward() printed 'loss: nan' under a silent watch.
    model, opt, x = still_regression()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(2):
            out = model(x)
            offset = torch.log(out[0, 0] * 0 - 1) if step == 1 else 0  # producer: offset
            loss = out.pow(2).mean() + offset
            opt.zero_grad()
            torch.autograd.backward([loss])
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 1, "aten.log.default")
    assert report.source is not None and report.source.lineno == marked_line("offset")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_scripted_submodule_s_events_in_log_mode_are_recorded(options) -> None:
    """Log mode runs on past the loop's write: the running statistics it then makes inf were measured through a
    TorchScript buffer dict's ``get`` (it has none: AttributeError from our code), and the held data code's claim
    read a no_grad view of the written weight with grad on (RuntimeError). Now each event is recorded."""
    torch.manual_seed(0)
    model = WithScripted()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nan_magic.watch(model, opt, on_detect="log", **options) as w:
        for step, x in enumerate([torch.randn(4, 8) for _ in range(3)]):
            if step == 1:
                with torch.no_grad():
                    model.block[0].weight[0, 0] = float("inf")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    first = w.events[0]
    assert (first.phase, first.module, first.step) == ("optimizer", "block.0", 1)
    assert any(report.tensor.name == "block.1.running_var" for report in w.events)
