"""The exact op and source line: by replay in the default mode, at the op in ops mode."""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable
from typing import Any

import faults
import pytest
import torch
from faults import FORWARD_FAULTS, Fault, GuardedExp
from torch import nn
from torch.nn import functional as F
from watching import raised

import nan_magic
from nan_magic.locations import name_location
from nan_magic.records import TensorRef

OP_FAULTS = [fault for fault in FORWARD_FAULTS if fault.op is not None]


def marker_line(key: str) -> int:
    """Line of ``# at: key`` in this file."""
    return faults.marked_line(key, "at", where=marker_line)



@pytest.mark.parametrize("mode", ["replay", "ops", "deferred"])
@pytest.mark.parametrize("fault", OP_FAULTS, ids=lambda f: f.name)
def test_forward_fixtures_name_op_and_line(fault: Fault, mode: str) -> None:
    model, run = fault.build()
    # deferred: judged after the forward returned (as on CUDA), replayed from the arguments the call kept
    report = raised(run, model, ops=(mode == "ops"), defer=(mode == "deferred"))
    assert report.op == fault.op
    assert report.source is not None
    assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line(fault.marker))
    assert (report.phase, report.module, report.module_type) == (fault.phase, fault.module, fault.module_type)
    assert report.nonfinite > 0


def test_ops_mode_stops_at_the_boundary_and_debug_opens_where_the_op_ran() -> None:
    # An op's non-finite output is an event only once it reaches a boundary
    # (PRODUCT.md), so ops mode raises at the producing module's output; the
    # report's source is the op's line, and %debug opens in the frame that ran
    # the op (kept with its origin), as the default mode opens its replay's.
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = raised(run, model, ops=True)
    assert report.source is not None and report.source.lineno == faults.marked_line("log")
    assert report.debug_frame is not None
    assert (report.debug_frame.filename, report.debug_frame.function) == (faults.__file__, "forward")
    assert report.debug_frame.lineno == faults.marked_line("log")
    assert "x" in [name for name, _stats in report.debug_locals]


class DivideThenHead(nn.Module):
    """The root's own code makes the NaN, then hands it to a child: ops mode raises inside the child's call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        r = h / (h - h)  # producer: divide by itself minus itself
        return self.head(r)


@pytest.mark.parametrize("ops", [False, True], ids=["default", "ops"])
def test_debug_opens_on_the_producers_line_while_its_frame_ran_on_to_the_next(ops: bool) -> None:
    # In ops mode the frame that ran the op is still on the traceback (the value is caught entering
    # ``head``), at the next line: %debug must open on the op's line, as the default's replay does.
    torch.manual_seed(0)
    model = DivideThenHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        loss = model(torch.randn(8, 4)).mean()
        loss.backward()
    report = caught.value.report
    line = faults.marked_line("divide by itself minus itself", where=sys.modules[__name__])
    assert (report.phase, report.module, report.step, report.op) == ("forward", "", 0, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == line
    assert report.debug_frame is not None
    assert (report.debug_frame.function, report.debug_frame.lineno) == ("forward", line)
    assert "h" in [name for name, _stats in report.debug_locals]
    assert traceback.extract_tb(caught.value.__traceback__)[-1].lineno == line


# -- backward and optimizer ------------------------------------------------------


def test_backward_op_names_the_forward_line_that_created_its_node() -> None:
    torch.manual_seed(0)
    embed = nn.Linear(8, 4)
    anchor = torch.randn(3, 8)

    def step() -> None:
        faults.distance(embed(anchor), embed(anchor.clone())).sum().backward()

    report = raised(step, embed, ops=True)
    assert (report.phase, report.module, report.op) == ("backward", None, "aten.div.Tensor")  # sqrt's grad / (2 * 0)
    assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line("distance"))
    assert any("SqrtBackward0" in note for note in report.notes)


class DivideInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad / torch.zeros_like(grad)  # producer: custom backward divides by zero


class CustomBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(DivideInBackward.apply(self.inner(x)))


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_a_custom_functions_python_backward_is_named_at_its_own_line(ops: bool) -> None:
    # The op ran in the Function's backward, whose frame is on the stack: that line, not the forward
    # line that created the node (``return x * 2`` holds no division), is where it ran.
    torch.manual_seed(0)
    model = CustomBackward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        loss = model(torch.randn(8, 4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    line = faults.marked_line("custom backward divides by zero", where=sys.modules[__name__])
    assert (report.phase, report.module, report.step, report.op) == ("backward", "", 0, "aten.div.Tensor")
    assert report.autograd_node == "DivideInBackwardBackward"
    assert report.source is not None and (report.source.function, report.source.lineno) == ("backward", line)
    assert any("ran in a Python backward of DivideInBackwardBackward" in note for note in report.notes)
    assert report.debug_frame is not None
    assert (report.debug_frame.function, report.debug_frame.lineno) == ("backward", line)


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_where_with_an_overflowing_branch_is_silent_until_its_backward_multiplies_the_inf(ops: bool) -> None:
    # exp's +inf is discarded by torch.where: no forward event (PRODUCT.md).
    # Its backward computes grad * exp(x) = 0 * inf: that op is the producer,
    # and the report names the absorbed exp.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), GuardedExp(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(100.0)
    x = torch.randn(3, 4)
    with nan_magic.watch(model, ops=ops) as w:
        out = model(x)
    assert w.report is None and torch.isfinite(out).all()
    report = raised(lambda: model(x).sum().backward(), model, ops=ops)
    assert (report.phase, report.module, report.op) == ("backward", "1", "aten.mul.Tensor")
    guarded = (faults.__file__, faults.marked_line("guarded exp"))
    assert (report.source.filename, report.source.lineno) == guarded
    assert report.nan == 12
    assert report.absorbed is not None
    assert (report.absorbed.op, report.absorbed.module, report.absorbed.posinf) == ("aten.exp.default", "1", 12)
    assert (report.absorbed.source.filename, report.absorbed.source.lineno) == guarded
    assert report.cause is not None and report.cause.evidence[0].startswith("absorbed in forward: aten.exp.default")
    rows = [line.split() for line in str(report).splitlines()]
    assert any(row[:4] == ["absorbed", "aten.exp.default", "at", name_location(*guarded)] for row in rows)


class SqrtAtZeroInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x) * 0
        return self.l2(torch.sqrt(h))  # producer: sqrt at zero under a reentrant checkpoint


class ReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = SqrtAtZeroInside()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True)


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_a_reentrant_checkpoints_backward_op_is_named_at_the_forward_line_it_recomputed(ops: bool) -> None:
    # The checkpoint recomputes ``a``'s forward inside backward: its nodes' forward lines are noted there
    # (grad is enabled), and that model call is no boundary of the loss code, whose recorder must not
    # take the backward's ops for loss code (it named AddmmBackward0 at the loop's line).
    torch.manual_seed(0)
    model = ReentrantCheckpoint()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4, requires_grad=True)  # a reentrant checkpoint needs an input that requires grad
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    line = faults.marked_line("sqrt at zero under a reentrant checkpoint", where=sys.modules[__name__])
    assert (report.phase, report.module, report.step) == ("backward", "a", 0)
    assert (report.op, report.autograd_node) == ("aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == line
    # The default watch's step replay runs the checkpointed block inline (torch refuses autograd.grad
    # through a reentrant checkpoint), and sees the same event.
    assert report.reproduced is (None if ops else True)


def test_adam_fp16_step_is_an_optimizer_op() -> None:
    model, opt, step = faults.fp16_adam_step()
    report = raised(step, model, opt, ops=True)
    assert (report.phase, report.module, report.module_type) == ("optimizer", "0", "Embedding")
    assert report.op == "aten.addcdiv_.default"
    assert report.tensor == TensorRef.parameter("0.weight")
    assert "the Adam step made 0.weight non-finite" in report.notes
    assert (report.source.filename, report.source.lineno) == (faults.__file__, faults.marked_line("adam"))


@pytest.mark.parametrize("ops", [False, True], ids=["default", "ops"])
def test_a_gradient_norm_that_overflows_on_finite_gradients_is_a_warning_not_an_event(ops: bool) -> None:
    # Our own read (the optimizer's gradient norm, aten._foreach_norm) is never judged by the op tracer.
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    x = torch.randn(4, 16)
    with nan_magic.watch(model, opt, ops=ops) as w:
        loss = (model(x) * 1e25).sum()  # gradient elements near 1e25: their squares overflow float32
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
    assert w.report is None and w.events == []
    overflow = [warning for warning in w.warnings if warning.kind == "grad-norm-overflow"]
    assert [(warning.step, warning.value) for warning in overflow] == [(0, math.inf)]
    assert "weight" in overflow[0].message and "SGD" in overflow[0].message


def _log_of_a_product_by_zero(out: torch.Tensor) -> torch.Tensor:
    return torch.log(out.abs().mean() * 0.0)  # producer: log of a product by 0.0


def _sum_of_a_product_by_3e38(out: torch.Tensor) -> torch.Tensor:
    return (out * 3e38).sum()  # producer: sum of a product by 3e38


@pytest.mark.parametrize("ops", [False, True], ids=["default", "ops"])
@pytest.mark.parametrize(
    ("loss_fn", "op", "marker"),
    [(_log_of_a_product_by_zero, "aten.log.default", "log of a product by 0.0"),
     (_sum_of_a_product_by_3e38, "aten.mul.Tensor", "sum of a product by 3e38")],
    ids=["log", "overflow"],
)
def test_loss_code_multiplying_by_a_python_float_is_named_in_both_modes(
    ops: bool, loss_fn: Callable[[torch.Tensor], torch.Tensor], op: str, marker: str
) -> None:
    # ``out * 0.0`` saves 0.0 as a wrapped-number tensor, which reaches a dispatch mode as a
    # Python float: the op tracer must still run ops on it (the loss's saved tensors are read
    # for data given to the loss, under the tracer in ops mode) instead of failing inside the watch.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, ops=ops):
        loss = loss_fn(model(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 0, op)
    assert report.source is not None
    assert report.source.lineno == faults.marked_line(marker, where=sys.modules[__name__])


# -- deliberate infinities -------------------------------------------------------------


class Mask(nn.Module):
    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(mask, float("-inf"))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = Mask()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.mask(scores, mask))


def _masks(full_row: bool) -> torch.Tensor:
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 2:] = True  # partly masked row
    if full_row:
        mask[1, :] = True  # every key masked: softmax of all -inf is NaN
    return mask


@pytest.mark.parametrize("options", [{"mode": "full"}, {}, {"ops": True}], ids=["full", "tiered", "ops"])
def test_partly_masked_rows_are_benign(options: dict) -> None:
    model = Attention()
    with nan_magic.watch(model, **options) as w:
        out = model(torch.randn(2, 4), _masks(full_row=False))
    assert torch.isfinite(out).all()
    assert w.report is None
    if options == {"mode": "full"}:  # the module-level watch saw -inf leave Mask: recorded as benign
        assert [(event.module, event.benign) for event in w.events] == [("mask", True)]
    elif not options:  # the tiered watch checks the model's output only, and it is finite
        assert w.events == []


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_a_fully_masked_row_makes_the_softmax_the_producer(ops: bool) -> None:
    model = Attention()
    report = raised(lambda: model(torch.randn(2, 4), _masks(full_row=True)), model, ops=ops)
    assert (report.module, report.module_type) == ("softmax", "Softmax")
    assert report.op == "aten._softmax.default"
    assert report.nan == 4  # the fully masked row


# -- in place, dropout, batch norm ---------------------------------------------------------


class InPlaceDiv(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        return h.div_(0)  # at: div_


class InPlaceOnInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.div_(0)  # at: input div_


@pytest.mark.parametrize("ops", [False, True], ids=["replay", "ops"])
def test_in_place_division_counts_the_prior_value(ops: bool) -> None:
    model = nn.Sequential(nn.Linear(3, 3), InPlaceDiv())
    report = raised(lambda: model(torch.randn(2, 3)), model, ops=ops)
    assert (report.module, report.op) == ("1", "aten.div_.Tensor")
    assert report.source.lineno == marker_line("div_")


def test_a_module_dividing_its_own_input_in_place_is_still_the_producer() -> None:
    model = nn.Sequential(nn.Linear(3, 3), InPlaceOnInput())
    report = raised(lambda: model(torch.randn(2, 3)), model, mode="full")
    # its input was finite before the call, though it is not any more
    assert (report.module, report.inputs_finite) == ("1", True)
    assert report.op is None  # the values it received are gone: no replay of the module alone
    assert any("changed its input in place" in note for note in report.notes)
    for options in ({"ops": True}, {}):  # op tracing, and the tiered replay of the whole call
        report = raised(lambda: model(torch.randn(2, 3)), model, **options)
        assert (report.module, report.op) == ("1", "aten.div_.Tensor")
        assert report.source.lineno == marker_line("input div_")


class DropoutLog(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(F.dropout(x, p=0.5, training=self.training))  # at: dropout


def test_replay_draws_the_same_dropout_mask() -> None:
    model = nn.Sequential(nn.Identity(), DropoutLog()).train()
    x = torch.rand(64, 64) + 0.5  # positive: only dropped elements give log(0) = -inf
    torch.manual_seed(123)
    report = raised(lambda: model(x), model, mode="full")
    assert report.op == "aten.log.default"
    assert report.source.lineno == marker_line("dropout")
    # the replay's -inf count is the original's: the same elements were dropped
    assert f"replay reproduced 0 nan, 0 +inf, {report.neginf} -inf" in " ".join(report.notes)
    # and the user's random stream continues as if nothing had been replayed
    after_watch = torch.rand(3)
    torch.manual_seed(123)
    F.dropout(x, p=0.5, training=True)
    assert torch.equal(after_watch, torch.rand(3))


class NormThenLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.norm(x))


def test_replay_leaves_batchnorm_running_stats_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NormThenLog()).train()
    reference = nn.Sequential(nn.Linear(4, 4), NormThenLog()).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 4)
    report = raised(lambda: model(x), model)
    assert report.module == "1" and report.op == "aten.log.default"
    reference(x)  # one unwatched forward: the running stats move exactly once
    norm, expected = model[1].norm, reference[1].norm
    assert torch.equal(norm.running_mean, expected.running_mean)
    assert torch.equal(norm.running_var, expected.running_var)
    assert norm.num_batches_tracked == expected.num_batches_tracked == 1


def test_replay_that_stays_finite_says_so_instead_of_guessing() -> None:
    class Flaky(nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Flaky.calls += 1
            return x / 0 if Flaky.calls == 1 else x  # not reproducible on replay

    model = nn.Sequential(nn.Linear(2, 2), Flaky())
    report = raised(lambda: model(torch.randn(1, 2)), model, mode="full")
    assert report.op is None
    assert any("stayed finite; the op is unknown" in note for note in report.notes)
