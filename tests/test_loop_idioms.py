"""A realistic loop's idioms under the recorders of the code between the model calls (localize/outside/).

``loss.item()`` logged every step, ``bool(loss < best)``, ``torch.equal``: ops that return no tensor and
write none are let by unrecorded, as the profiler markers are (recorder.passes), in the loss, update and
data regions alike; what the user sees is unchanged: the producer of a NaN in that code is still named at
its op and line, in both timings, where a number such an op returned flows into it too.
benchmarks/hot_calls.py --idioms counts what each idiom costs.
"""

from __future__ import annotations

import sys

import faults
import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.localize.outside.recorder import passes
from nan_magic.patches.registry import installed

aten = torch.ops.aten


def _marked(key: str) -> int:
    return faults.marked_line(key, where=sys.modules[__name__])


@pytest.mark.parametrize(("func", "expected"), [
    (aten._local_scalar_dense.default, True),  # .item(), float(t), bool(t)
    (aten.equal.default, True),
    (aten.is_nonzero.default, True),
    (torch.ops.profiler._record_function_enter_new.default, True),
    (aten.mul.Tensor, False),
    (aten.max.dim, False),  # a tuple of tensors
    (aten.split.Tensor, False),  # a list of tensors
    (aten._foreach_zero_.default, False),  # returns nothing, but writes the gradients in place
    (aten.zero_.default, False),
])
def test_only_ops_that_return_no_tensor_and_write_none_pass_unrecorded(func: object, expected: bool) -> None:
    assert passes(func) is expected


@pytest.mark.parametrize("defer", [False, True])
def test_numbers_logged_from_the_loss_code_are_not_recorded_and_its_producer_is_still_named(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    logged: list[float] = []
    best = torch.tensor(float("inf"))
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer) as w:
        for step in range(3):
            scale = torch.tensor(1.0 if step < 2 else 0.0)
            loss = model(x).pow(2).mean() / scale  # producer: scaled loss
            recorded = w.outside.recorded()
            logged.append(loss.item())
            improved = bool(loss < best)  # one op recorded (lt); bool() reads it unrecorded
            same = torch.equal(loss, loss)
            assert w.outside.recorded() == recorded + 1
            if improved and same:
                best = loss.detach()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 2, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _marked("scaled loss")
    assert logged[2] == float("inf")  # the op let by still ran


@pytest.mark.parametrize("defer", [False, True])
def test_a_write_in_the_update_code_that_divides_by_a_number_read_with_item_is_named(defer: bool) -> None:
    # Clipping runs more ops than a cheap region: the update region is only watched from step 1 on, its
    # .item() not kept (nothing to replay); the write at step 2 is caught at its step, its op and line named.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
    x = torch.randn(16, 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        for step in range(4):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            total = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            spread = total.item() - total.item()
            if step == 2:
                with torch.no_grad():
                    model[2].weight.div_(spread)  # producer: divide by the spread
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "2", 2, "aten.div_.Tensor")
    assert report.source is not None and report.source.lineno == _marked("divide by the spread")


@pytest.mark.parametrize("defer", [False, True])
def test_a_write_after_a_grad_scalers_unscale_and_clipping_is_named(defer: bool) -> None:
    # unscale_ writes every gradient and found_inf in one op (two written arguments), clipping every gradient
    # again: the watched update region rules each out without walking the gradients, and still sees the row
    # renormalised in place at step 2, named at its op and line.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight[3] = 0.0
        model[0].bias[3] = -100.0  # unit 3 never fires: its row stays zero
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer):
        for step in range(4):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step == 2:
                with torch.no_grad():
                    weight = model[0].weight
                    weight.div_(weight.norm(dim=1, keepdim=True))  # producer: unit rows
            scaler.step(opt)
            scaler.update()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "0", 2, "aten.div_.Tensor")
    assert report.source is not None and report.source.lineno == _marked("unit rows")


@pytest.mark.parametrize("defer", [False, True])
def test_numbers_logged_from_the_data_code_are_not_recorded_and_its_producer_is_still_named(defer: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raw = [torch.randn(8, 4) for _ in range(3)]
    raw[2][:, 1] = 2.0  # a feature constant across the batch
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer) as w:
        for step, batch in enumerate(raw):
            x = (batch - batch.mean(0)) / batch.std(0)  # producer: standardise
            recorded = w.outside.recorded()
            spread = x.std().item()
            assert w.outside.recorded() == recorded + 1  # std; its .item() passes
            assert spread > 0 or step == 2
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("data", "", 2, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _marked("standardise")


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("zeroed_by", ["optimizer", "model"])
def test_zeroing_more_gradients_in_place_than_the_data_budget_leaves_the_data_code_recorded(
    defer: bool, zeroed_by: str
) -> None:
    # zero_grad(set_to_none=False) without foreach zeroes each gradient by its own op, in the data region: more
    # than DATA_BUDGET of them (a model of more than 64 parameters) would turn its recording off from the first
    # step. The recorder steps aside for zero_grad() (patches/zero_grad.py): its ops are neither recorded nor
    # counted, nor pay the dispatch mode's trampoline.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(40)))  # 80 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    owner = opt if zeroed_by == "optimizer" else model
    raw = [torch.randn(8, 4) for _ in range(3)]
    raw[2][:, 1] = 2.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, defer=defer) as w:
        for batch in raw:
            x = (batch - batch.mean(0)) / batch.std(0)  # producer: standardise after zeroing
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            owner.zero_grad(set_to_none=False)
    report = caught.value.report
    if not defer:  # stopped as step 2's batch entered the model: step 1's zero_grad zeroed every gradient
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert (report.phase, report.module, report.step, report.op) == ("data", "", 2, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == _marked("standardise after zeroing")
    assert w.outside.untraced == set()
    assert installed() == []  # the zero_grad patch is gone with the watch


def test_data_code_gone_unrecorded_is_said_in_a_data_event_s_report() -> None:
    # Data code of 80 ops a step (an augmentation op by op) overruns the data region's budget at the first step
    # after the entry's, which turns its recording off. The report says why no op is named.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(40)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raw = [torch.randn(8, 4) for _ in range(3)]
    raw[2][:, 1] = 2.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt) as w:
        for batch in raw:
            views = [batch.clone() for _ in range(80)]
            x = (views[-1] - batch.mean(0)) / batch.std(0)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 2, None) and w.outside.untraced == {"data"}
    assert ("the code outside the models (data) ran more ops a step than the watch records (512 for the loss, 64 "
            "for data code): its op and line are not named") in report.notes


def test_a_zero_grad_patched_after_the_watch_s_stays_the_user_s() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    with nan_magic.watch(model, opt):
        ours = torch.optim.Optimizer.zero_grad

        def theirs(self, *args, **kwargs):  # a user's (or a library's) patch, installed inside the watch
            calls.append(type(self).__name__)
            return ours(self, *args, **kwargs)

        torch.optim.Optimizer.zero_grad = theirs
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    try:
        assert torch.optim.Optimizer.zero_grad is theirs  # not put back over theirs
        opt.zero_grad()
        assert calls == ["SGD", "SGD"] and model.weight.grad is None
    finally:
        torch.optim.Optimizer.zero_grad = ours.__wrapped__  # torch's own (functools.wraps keeps it)
