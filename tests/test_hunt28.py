"""Localization gaps left by session 9 (issue 25, "never wrong about where"), in both timings.

1. A parameter the loop writes after ``opt.step()`` (a max-norm renorm, weight clipping, ``p.data.mul_``,
   ``p.copy_``) is named by the write: its op and line, the owning module, phase ``optimizer``, at the step it
   happened (the optimizer steps completed before it).
3. The report's frames from the user's code to a producer in a returned helper read in call order: the loop's
   line that called the helper, then the helper's line (not ``loss.backward()`` first).
2. The deferred check keeps a returned helper's frame (a loss function) where its tensors are small, so
   ``%debug`` opens at the producing line inside it with its locals; where they are large it lets the frame
   go (they are freed as unwatched) and the report says why %debug opens where the step was judged.

Each test asserts what the user sees: the report's phase, module, step, op, line, the frame ``%debug`` opens.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import TensorRef
from tests.faults import marked_line

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def producer_line(marker: str) -> int:
    return marked_line(marker, where=sys.modules[__name__])


def call_line(marker: str) -> int:
    return marked_line(marker, kind="call", where=sys.modules[__name__])


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, after_step: Callable[[int], None]) -> None:
    """A plain loop; ``after_step(step)`` runs after ``opt.step()``, before the next batch is made."""
    for step in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            after_step(step)


def _at_write(report: nan_magic.Report, op: str, marker: str, module: str, step: int, name: str) -> None:
    """The report names the write: op and line, its module, phase optimizer, the step, the parameter, the note."""
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", module, step, op)
    assert report.source is not None and report.source.lineno == producer_line(marker)
    assert report.tensor == TensorRef.parameter(name)
    assert f"the loop's own code wrote {name} after the optimizer step, before the next model call" in report.notes


# -- 1. parameters written after the optimizer step ------------------------------------------------------------


@pytest.mark.parametrize("options", TIMINGS)
def test_a_max_norm_renorm_after_the_step_is_named_by_the_write(options) -> None:
    def renorm(step: int) -> None:
        for layer in (model[0], model[2]):
            layer.weight.div_(layer.weight.norm() * (0 if step == 2 else 1))  # producer: max-norm renorm

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, renorm)
    report = caught.value.report
    # Step 2's optimizer step completed: the write after it belongs to step 3, which its next forward would open.
    _at_write(report, "aten.div_.Tensor", "max-norm renorm", "0", 3, "0.weight")
    assert (report.posinf + report.neginf, report.numel) == (64, 64)


@pytest.mark.parametrize("options", TIMINGS)
def test_debug_opens_at_a_renorm_helper_s_write_after_the_step(options) -> None:
    def renorm(step: int) -> None:
        weight = model[0].weight
        weight.div_(weight.norm() * (0 if step == 2 else 1))  # producer: renorm in a helper

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, renorm)
    report = caught.value.report
    last = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert (last.name, last.lineno) == ("renorm", producer_line("renorm in a helper"))
    assert report.debug_frame is not None and report.debug_frame.function == "renorm"
    assert report.debug_frame.lineno == producer_line("renorm in a helper")
    assert "weight" in dict(report.debug_locals)


@pytest.mark.parametrize("options", TIMINGS)
def test_weight_clipping_with_a_nan_bound_is_named_by_the_clamp(options) -> None:
    def clip(step: int) -> None:
        bound = float("nan") if step == 1 else 0.5
        for parameter in model.parameters():
            parameter.clamp_(-bound, bound)  # producer: weight clipping

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, clip)
    _at_write(caught.value.report, "aten.clamp_.default", "weight clipping", "0", 2, "0.weight")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_write_every_k_steps_is_named_at_the_step_it_made_the_parameter_non_finite(options) -> None:
    def every_third(step: int) -> None:
        if step % 3 == 0:  # steps 0 and 3 healthy; 6 divides by zero
            weight = model[2].weight
            weight.div_(weight.abs().max() * (0 if step == 6 else 1))  # producer: every third step

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 9, every_third)
    _at_write(caught.value.report, "aten.div_.Tensor", "every third step", "2", 7, "2.weight")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_write_through_dot_data_after_the_step_is_a_write_to_the_parameter(options) -> None:
    def shrink(step: int) -> None:
        scale = torch.tensor(0.0 if step == 1 else 1.0)
        model[2].weight.data.div_(scale)  # producer: through .data

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, shrink)
    _at_write(caught.value.report, "aten.div_.Tensor", "through .data", "2", 2, "2.weight")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_copy_into_the_parameter_is_named_by_the_op_that_made_what_it_copied(options) -> None:
    def project(step: int) -> None:
        weight = model[0].weight
        rows = weight.norm(dim=1, keepdim=True) * (0 if step == 2 else 1)
        weight.copy_(weight / rows)  # producer: projected copy

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, project)
    # The division made the non-finite values; copy_ only carried them into the parameter.
    _at_write(caught.value.report, "aten.div.Tensor", "projected copy", "0", 3, "0.weight")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_torch_nn_init_helper_writing_a_parameter_after_the_step_is_seen_at_that_step(options) -> None:
    def reset(step: int) -> None:
        if step == 1:
            nn.init.constant_(model[2].bias, float("nan"))  # producer: reset by nn.init

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, reset)
    _at_write(caught.value.report, "aten.fill_.Scalar", "reset by nn.init", "2", 2, "2.bias")


@pytest.mark.parametrize("options", TIMINGS)
def test_vector_to_parameters_after_the_step_is_named_by_the_op_that_made_the_vector(options) -> None:
    def load(step: int) -> None:
        vector = nn.utils.parameters_to_vector(model.parameters())
        nn.utils.vector_to_parameters(vector / (0 if step == 1 else 1), model.parameters())  # producer: loaded

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, load)
    # No op wrote the parameters (param.data was rebound): named as a write after step 1, by the op that made the
    # memory they are on now.
    _at_write(caught.value.report, "aten.div.Tensor", "loaded", "0", 2, "0.weight")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_write_in_the_last_iteration_is_named_as_the_watch_is_left(options) -> None:
    def renorm(step: int) -> None:
        weight = model[0].weight
        weight.div_(weight.norm() * (0 if step == 3 else 1))  # producer: last renorm

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        _train(model, opt, 4, renorm)
    _at_write(caught.value.report, "aten.div_.Tensor", "last renorm", "0", 4, "0.weight")


def _renorm_run(options: dict | None, loader: bool = False) -> tuple[list[torch.Tensor], nan_magic.Watch | None]:
    """Eight healthy steps with a max-norm renorm of every weight after each, watched (``options``) or not."""
    model, opt = _mlp()
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    batches = DataLoader(data, batch_size=4) if loader else [(x.unsqueeze(0), y) for x, y in data]

    def run() -> None:
        for step, (x, y) in enumerate(batches):
            x = (x - x.mean()) / (x.std() + 1e-6)
            loss = nn.functional.mse_loss(model(x), y.expand(x.shape[0], 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for layer in (model[0], model[2]):
                    norms = layer.weight.norm(dim=1, keepdim=True).clamp_min(1.0)
                    layer.weight.div_(norms)
            if step == 7:
                break

    watch = None
    if options is None:
        run()
    else:
        with nan_magic.watch(model, opt, **options) as watch:
            run()
    return [parameter.detach().clone() for parameter in model.parameters()], watch


@pytest.mark.parametrize("loader", [False, True], ids=["list", "DataLoader"])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_healthy_renorm_loop_is_silent_and_bit_identical_to_an_unwatched_one(options, loader: bool) -> None:
    expected, _ = _renorm_run(None, loader)
    got, watch = _renorm_run(options, loader)
    assert watch is not None and watch.report is None and not watch.events
    for value, unwatched in zip(got, expected, strict=True):
        assert torch.equal(value, unwatched)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_batch_the_loop_standardises_is_still_named_beside_a_renorm(options) -> None:
    # The data region both builds the batch and renormalises: a NaN batch is the data code's, at its line.
    model, opt = _mlp()
    raw = [torch.randn(4, 8) for _ in range(4)]
    raw[2][:, 3] = 1.0  # a constant column: std 0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for batch in raw:
            x = (batch - batch.mean(0)) / batch.std(0)  # producer: standardise beside renorm
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model[0].weight.div_(model[0].weight.norm().clamp_min(1.0))
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 2, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == producer_line("standardise beside renorm")


@pytest.mark.parametrize("batch_size", [4, 64])
@pytest.mark.parametrize("options", TIMINGS)
def test_a_renorm_in_a_dataloader_loop_is_named_by_the_write(options, batch_size: int) -> None:
    model, opt = _mlp()
    loader = DataLoader(TensorDataset(torch.randn(16 * batch_size, 8)), batch_size=batch_size)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options) as watch:
        for step, (x,) in enumerate(loader):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                weight = model[2].weight
                weight.div_(weight.norm() * (0 if step == 2 else 1))  # producer: renorm beside a loader
    _at_write(caught.value.report, "aten.div_.Tensor", "renorm beside a loader", "2", 3, "2.weight")
    # A batch of 64 ran step 1's data region over its budget: batches are fetched with the recorder aside since.
    assert watch.outside.untraced == set() and watch.outside.batches_aside == (batch_size == 64)


# -- 2. %debug in a returned helper, deferred ------------------------------------------------------------------

_LARGE: list = []  # weak references to a helper's large local, to see it freed


def small_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(out) * y
    return -torch.log(p).mean()  # producer: log in a helper


def large_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    scratch = torch.ones(400_000)  # 1.6 MB: more than a held tensor may be (KEEP_BYTES)
    _LARGE.append(weakref.ref(scratch))
    p = torch.sigmoid(out) * y * scratch[0]
    return -torch.log(p).mean()  # producer: log beside a large local


def _helper_loop(options: dict, loss_fn: Callable, probe: Callable[[], None] = lambda: None) -> NonFiniteError:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            x, y = torch.randn(8, 4), torch.ones(8, 1)
            if step == 2:
                y[0] = 0.0  # p = 0 there: log(0)
            loss = loss_fn(model(x), y)  # call: the loop calls the helper
            opt.zero_grad()
            loss.backward()
            probe()
            opt.step()
    return caught.value


@pytest.mark.parametrize("options", TIMINGS)
def test_debug_opens_in_a_returned_loss_helper_at_the_producing_line_with_its_locals(options) -> None:
    error = _helper_loop(options, small_loss)
    report = error.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("log in a helper")
    last = traceback.extract_tb(error.__traceback__)[-1]
    assert (last.name, last.lineno) == ("small_loss", producer_line("log in a helper"))
    assert report.debug_frame is not None
    assert (report.debug_frame.function, report.debug_frame.lineno) == ("small_loss", producer_line("log in a helper"))
    local = dict(report.debug_locals)
    assert set(local) == {"out", "y", "p"}
    assert (local["p"].zeros, local["p"].nan, local["p"].min) == (1, 0, 0.0)  # the zero log() was given
    assert not any("was let go" in note for note in report.notes)


def test_deferred_lets_go_of_a_helper_frame_holding_a_large_tensor_and_says_where_debug_opens() -> None:
    _LARGE.clear()
    freed: list[bool] = []
    error = _helper_loop({"defer": True}, large_loss, probe=lambda: freed.append(_LARGE[-1]() is None))
    report = error.report
    # The producer is still named, from the records; only the frame (and its large local) went.
    assert (report.phase, report.step, report.op) == ("forward", 2, "aten.log.default")
    assert report.source is not None and report.source.lineno == producer_line("log beside a large local")
    assert freed and all(freed)  # freed once backward() started, as unwatched
    assert report.debug_frame is not None and report.debug_frame.function == "_helper_loop"
    line = producer_line("log beside a large local")
    said = (f"opens where the step was judged, not in large_loss at line {line}: that function had returned and its "
            "frame was let go, its tensors too large to keep")  # (after pdb.pm() or %debug: test_report_debugger.py)
    assert any(note.endswith(said) for note in report.notes), report.notes


def test_immediate_opens_in_a_helper_holding_a_large_tensor() -> None:
    # Judged as backward() starts, before anything is let go: the frame is there, whatever it holds.
    error = _helper_loop({}, large_loss)
    report = error.report
    assert report.debug_frame is not None and report.debug_frame.function == "large_loss"
    assert report.debug_frame.lineno == producer_line("log beside a large local")
    assert not any("was let go" in note for note in report.notes)


# -- 3. the frames to a producer in a returned helper, in call order ----------------------------------------------


def nested_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return small_loss(out, y)  # call: the outer helper calls the inner one


def _frames(report: nan_magic.Report) -> list[tuple[str, int]]:
    return [(frame.function, frame.lineno) for frame in report.frames]


@pytest.mark.parametrize("options", TIMINGS)
def test_the_frames_to_a_loss_helper_read_in_call_order(options) -> None:
    report = _helper_loop(options, small_loss).report
    assert _frames(report)[-2:] == [("_helper_loop", call_line("the loop calls the helper")),
                                    ("small_loss", producer_line("log in a helper"))]
    text = report.to_text()
    block = text[text.index("Frames from your code to the producer:"):].splitlines()
    assert block[-4].endswith(f":{call_line('the loop calls the helper')}, in _helper_loop")
    assert block[-3].strip() == "loss = loss_fn(model(x), y)  # call: the loop calls the helper"
    assert block[-2].endswith(f":{producer_line('log in a helper')}, in small_loss")
    assert block[-1].strip() == "return -torch.log(p).mean()  # producer: log in a helper"
    assert not any("loss.backward()" in line for line in block)


@pytest.mark.parametrize("options", TIMINGS)
def test_the_frames_through_two_helpers_read_in_call_order(options) -> None:
    report = _helper_loop(options, nested_loss).report
    assert _frames(report)[-3:] == [("_helper_loop", call_line("the loop calls the helper")),
                                    ("nested_loss", call_line("the outer helper calls the inner one")),
                                    ("small_loss", producer_line("log in a helper"))]


@pytest.mark.parametrize("options", TIMINGS)
def test_the_frames_to_a_renorm_helper_after_the_step_read_in_call_order(options) -> None:
    def renorm(step: int) -> None:
        weight = model[0].weight
        weight.div_(weight.norm() * (0 if step == 2 else 1))  # producer: renorm called by the loop

    model, opt = _mlp()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                renorm(step)  # call: the loop calls renorm
    assert _frames(caught.value.report)[-2:] == [
        ("test_the_frames_to_a_renorm_helper_after_the_step_read_in_call_order", call_line("the loop calls renorm")),
        ("renorm", producer_line("renorm called by the loop"))]


_CELL = """\
import torch
from torch import nn

def loss_fn(out, y):
    p = torch.sigmoid(out) * y
    return -torch.log(p).mean()

torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x, y = torch.randn(8, 4), torch.ones(8, 1)
    if step == 2:
        y[0] = 0.0
    loss = loss_fn(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("flags", ["", "--defer"], ids=["immediate", "deferred"])
def test_a_cell_s_traceback_and_short_error_read_in_call_order(ip, flags: str) -> None:
    # In a cell the loop's frame is not the traceback's first entry: its entry moves to the line that called the
    # helper, so %tb and %debug's `up` agree with the short error.
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        result = ip.run_cell(f"%%nantrace {flags}\n" + _CELL)
    assert isinstance(result.error_in_exec, NonFiniteError)
    entries = [(entry.name, entry.lineno, entry.line) for entry in traceback.extract_tb(sys.last_traceback)]
    user = [entry for entry in entries if entry[2] in {"loss = loss_fn(model(x), y)", "return -torch.log(p).mean()",
                                                       "loss.backward()", "opt.step()"}]
    # (The cell's lines count from the magic's: the call is line 16, the log line 7.)
    assert [(line, text) for _name, line, text in user] == [(16, "loss = loss_fn(model(x), y)"),
                                                            (7, "return -torch.log(p).mean()")]
    short = (captured.stdout + captured.stderr).splitlines()
    frames = short[short.index("    loss = loss_fn(model(x), y)") - 1:]
    assert frames[0].endswith("line 16") and frames[1] == "    loss = loss_fn(model(x), y)"
    assert frames[2].startswith("producer: ") and frames[2].endswith("line 7, in loss_fn")
    assert frames[3] == "    return -torch.log(p).mean()"
    assert not any("loss.backward()" in line or "opt.step()" in line for line in short)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_large_dataloader_batch_normalised_in_the_loop_is_still_named(options) -> None:
    # A batch of 64 from a DataLoader: the data region's normalisation in the loop is named by its op and line,
    # the DataLoader's own fetch run with the recorder aside once it overran the region's budget.
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64 * 4, 8)
    data[64 * 2:64 * 3, 5] = 3.0  # batch 2: a constant column, std 0
    loader = DataLoader(TensorDataset(data), batch_size=64)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options) as watch:
        for (x,) in loader:
            x = (x - x.mean(0)) / x.std(0)  # producer: normalise a large batch
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 2, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == producer_line("normalise a large batch")
    assert watch.outside.untraced == set() and watch.outside.batches_aside


@pytest.mark.parametrize("options", TIMINGS)
def test_a_batch_normalised_in_the_region_that_ran_over_its_budget_says_why_no_op_is_named(options) -> None:
    # Step 1's data region fetched a batch of 64 with the recorder on and ran over its budget: its records are
    # gone, so the report names no op, and says why (the next data region is recorded again, batches aside).
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(64 * 4, 8)
    data[64:64 * 2, 5] = 3.0  # batch 1: a constant column, std 0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for (x,) in DataLoader(TensorDataset(data), batch_size=64):
            x = (x - x.mean(0)) / x.std(0)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 1, None)
    assert ("the code outside the models (data) ran more ops a step than the watch records (512 for the loss, 64 "
            "for data code): its op and line are not named") in report.notes


@pytest.mark.parametrize("options", TIMINGS)
def test_a_renorm_after_the_step_beside_a_hand_written_update_is_named_by_the_renorm(options) -> None:
    model, _ = _mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                model[2].weight.sub_(0.01 * model[2].weight.grad)  # a hand-written update of the head
            opt.step()
            with torch.no_grad():
                weight = model[0].weight
                weight.div_(weight.norm() * (0 if step == 1 else 1))  # producer: renorm beside a hand update
    _at_write(caught.value.report, "aten.div_.Tensor", "renorm beside a hand update", "0", 2, "0.weight")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_hand_written_update_beside_a_renorm_after_the_step_is_named_by_the_update(options) -> None:
    # The converse: the data region's write (held first, judged before the step's calls) is finite; the update
    # region's, judged after the calls, is the producer.
    model, _ = _mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                model[2].weight.sub_(model[2].weight.grad / (0 if step == 2 else 100))  # producer: update by a renorm
            opt.step()
            with torch.no_grad():
                weight = model[0].weight
                weight.div_(weight.norm())
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("optimizer", "2", 2, "aten.div.Tensor")
    assert report.source is not None and report.source.lineno == producer_line("update by a renorm")
    assert report.tensor == TensorRef.parameter("2.weight")
    assert ("the loop's own code wrote 2.weight between backward() and the next step (a hand-written update)"
            in report.notes)


@pytest.mark.parametrize("options", TIMINGS)
def test_writes_after_the_step_of_more_than_a_mebibyte_are_not_followed(options) -> None:
    # An EMA teacher's update writes the whole teacher after every step: copying and measuring it every step would
    # cost more than the step's gradient check, so after the first such step the writes are not followed; a NaN
    # written there is found by the next forward, unnamed (the behaviour before writes after the step were
    # followed).
    from nan_magic.localize.outside.param_writes import FOLLOWED_BYTES

    torch.manual_seed(0)
    student, teacher = nn.Linear(1024, 512), nn.Linear(1024, 512).requires_grad_(False)
    assert teacher.weight.numel() * 4 > FOLLOWED_BYTES
    opt = torch.optim.SGD(student.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(student, teacher, opt, **options):
        for step in range(4):
            x = torch.randn(4, 1024)
            loss = (student(x) - teacher(x)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.mul_(float("nan") if step == 2 else 0.99).add_(s, alpha=0.01)
    report = caught.value.report
    assert (report.phase, report.step, report.model, report.op) == ("forward", 3, "Linear#2", None)  # the teacher
    assert str(report.tensor) == "parameter weight"
