"""Forward producer localization on the fault library, in immediate and deferred mode."""

from __future__ import annotations

import pickle
import traceback
from typing import NamedTuple

import faults
import pytest
import torch
from faults import FORWARD_FAULTS, Fault
from torch import nn
from watching import raised

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import TensorRef, TensorRole


def run_fault(fault: Fault, **options) -> NonFiniteError:
    model, run = fault.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        run()
    return caught.value


@pytest.mark.parametrize("mode", ["tiered", "full"])
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("fault", FORWARD_FAULTS, ids=lambda f: f.name)
def test_reports_the_producer(fault: Fault, defer: bool, mode: str) -> None:
    report = run_fault(fault, defer=defer, mode=mode).report
    assert report.phase == fault.phase
    assert report.module == fault.module
    assert report.module_type == fault.module_type
    if fault.op is None:
        assert report.tensor == fault.tensor and report.module_output is None
    else:  # the replay named the op: its output is the report's tensor, the module's output is kept beside it
        assert report.tensor == TensorRef.op_output(fault.op)
        assert report.module_output is not None and report.module_output[0] == fault.tensor
    assert report.step == 0
    kinds = {kind for kind, count in report.counts.items() if count}
    assert kinds and kinds <= fault.kinds, f"counts {report.counts} do not match {fault.kinds}"
    assert report.numel > 0


@pytest.mark.parametrize("fault", FORWARD_FAULTS, ids=lambda f: f.name)
def test_producer_row_is_marked_and_nothing_before_it_is(fault: Fault) -> None:
    report = run_fault(fault).report
    producers = [row for row in report.layers if row.status == "producer"]
    assert len(producers) == 1
    assert producers[0].module == fault.module
    if "call_of_module" in fault.extra:
        calls = sorted({row.index for row in report.layers if row.module == fault.module})
        assert producers[0].index == calls[fault.extra["call_of_module"] - 1]
    # The calls that began before the producer, except the modules it ran inside (the table is in call
    # order: a parent's row comes first and holds the value its child made), were finite.
    producer = fault.module or ""
    inside = {producer.rsplit(".", depth)[0] for depth in range(1, producer.count(".") + 1)} | {""}
    before = [row for row in report.layers if row.index is not None and row.index < producers[0].index
              and row.module != fault.module and row.module not in inside and row.stats is not None]
    assert all(row.stats.nonfinite == 0 for row in before if row.stats.nan is not None)


def test_inputs_of_a_producer_are_finite_and_described() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    report = run_fault(fault, mode="full").report
    assert report.inputs_finite
    inputs = dict(report.input_stats)
    argument, operand = TensorRef.argument("input[0]"), TensorRef(TensorRole.OPERAND, "self")
    assert list(inputs) == [argument, operand]  # the module's input, then the op's (from the replay)
    assert inputs[argument].finite and inputs[argument].negatives > 0  # why log went NaN is visible
    assert report.nan == report.output_stats.nan > 0
    # The first NaN of LogLayer's output, found by running the same model unwatched.
    model, run = fault.build()
    seen: list[torch.Tensor] = []
    handle = model[1].register_forward_hook(lambda _module, _args, output: seen.append(output))
    run()
    handle.remove()
    assert report.first_bad_index == tuple(torch.isnan(seen[0]).nonzero()[0].tolist())


def test_propagators_are_marked_not_blamed() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    report = run_fault(fault).report
    statuses = {row.module: row.status for row in report.layers}
    assert statuses["1"] == "producer"
    # the root's output holds the NaN it received: a propagator, not a producer
    assert statuses[""] in ("ok", "propagated")


def test_functional_code_in_a_parent_forward_is_blamed_on_the_parent() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.log(self.a(x)))

    model = Net()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.randn(3, 4))
    report = caught.value.report
    assert (report.module, report.module_type) == ("", "Net")
    assert [row.status for row in report.layers if row.module == "b"] == ["propagated"]


def test_traceback_ends_on_the_line_that_ran_the_producing_op() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "shared_submodule")
    error = run_fault(fault, mode="full")  # tiered: tests/test_tiered.py
    entries = traceback.extract_tb(error.__traceback__)
    # the caller's line, then the frame the replay ran the op in: %debug opens there
    assert (entries[-2].filename, entries[-2].lineno) == (faults.__file__, faults.marked_line("shared", kind="caller"))
    last = entries[-1]
    assert (last.filename, last.lineno) == (faults.__file__, faults.marked_line("log"))
    assert error.report.debug_frame is not None
    assert (error.report.debug_frame.filename, error.report.debug_frame.lineno) == (last.filename, last.lineno)
    assert error.report.debug_frame.function == "forward"
    assert error.report.debug_frame.line == "return torch.log(x)  # producer: log"
    assert [name for name, _stats in error.report.debug_locals] == ["x"]
    # the frames listed run from this test down to that line, all user code
    assert [frame.function for frame in error.report.frames] == ["run_fault", "<lambda>", "forward", "forward"]


def test_report_is_frozen_picklable_and_holds_no_tensors() -> None:
    report = run_fault(FORWARD_FAULTS[1]).report
    clone = pickle.loads(pickle.dumps(report))
    assert clone == report
    with pytest.raises(AttributeError):
        report.module = "x"  # type: ignore[misc]
    assert not list(_tensors_in(report))
    error = pickle.loads(pickle.dumps(NonFiniteError(report)))
    assert error.report.module == report.module and isinstance(error, FloatingPointError)


def _tensors_in(value, depth=0):
    """Every torch.Tensor reachable from a record (there must be none)."""
    import dataclasses

    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and depth < 8:
        for item in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, item.name), depth + 1)
    elif isinstance(value, (tuple, list)) and depth < 8:
        for item in value:
            yield from _tensors_in(item, depth + 1)


def test_nested_outputs_of_every_shape_are_checked() -> None:
    from dataclasses import dataclass

    @dataclass
    class Out:
        hidden: torch.Tensor
        extra: list

    class Nested(nn.Module):
        def forward(self, x: torch.Tensor) -> Out:
            return Out(hidden=x, extra=[x.long(), {"deep": (x, x / 0)}])

    model = nn.Sequential(nn.Linear(4, 4), Nested())
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(torch.randn(2, 4))
    report = caught.value.report
    assert report.tensor == TensorRef.op_output("aten.div.Tensor")
    deep = TensorRef.output("output.extra[1]['deep'][1]")
    assert report.module_output is not None and report.module_output[0] == deep


class Pair(NamedTuple):
    values: torch.Tensor
    scale: torch.Tensor


@pytest.mark.parametrize("options", [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")])
def test_a_named_tuple_output_is_walked_by_its_fields(options: dict) -> None:
    class Splits(nn.Module):
        def forward(self, x: torch.Tensor) -> Pair:
            return Pair(x, x.sqrt())

    model = nn.Sequential(nn.Linear(4, 4), Splits())
    x = torch.randn(2, 4)
    with torch.no_grad():
        negatives = int((model[0](x) < 0).sum())  # sqrt makes NaN of each of them
    assert negatives > 0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(x).scale.sum().backward()
    report = caught.value.report
    assert (report.module, report.module_type, str(report.phase)) == ("1", "Splits", "forward")
    assert report.module_output is not None and report.module_output[0] == TensorRef.output("output[1]")
    assert report.counts == {"nan": negatives, "+inf": 0, "-inf": 0}


@pytest.mark.parametrize(("bad", "path"), [
    ("last_hidden_state", "output['last_hidden_state']"),
    ("hidden_states", "output['hidden_states'][1]"),  # inside the tuple a ModelOutput holds
])
def test_hugging_face_model_output_is_walked(bad: str, path: str) -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    class Encoder(nn.Module):
        def forward(self, x: torch.Tensor) -> BaseModelOutput:
            if bad == "last_hidden_state":
                return BaseModelOutput(last_hidden_state=x.sqrt(), hidden_states=(x, x))
            return BaseModelOutput(last_hidden_state=x, hidden_states=(x, x.sqrt()))

    model = nn.Sequential(nn.Linear(4, 4), Encoder())
    x = torch.randn(2, 4)
    with torch.no_grad():
        negatives = int((model[0](x) < 0).sum())  # sqrt makes NaN of each of them
    assert negatives > 0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(x)
    report = caught.value.report
    assert report.tensor == TensorRef.op_output("aten.sqrt.default")
    assert report.module_output is not None and report.module_output[0] == TensorRef.output(path)
    assert (report.module, report.module_type) == ("1", "Encoder")
    assert report.counts == {"nan": negatives, "+inf": 0, "-inf": 0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_floating_dtype(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Identity(), LogOf())
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        model(-torch.ones(3, dtype=dtype))
    assert caught.value.report.dtype == str(dtype).removeprefix("torch.")
    assert caught.value.report.nan == 3


class LogOf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


@pytest.mark.parametrize(("mode", "meta_reads"), [("full", 2), ("tiered", 1)])
def test_non_float_outputs_never_crash_the_hook(mode: str, meta_reads: int) -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor):
            return (
                x.long(),
                x > 0,
                torch.complex(x, x),
                torch.empty(0),
                x.to_sparse(),
                torch.empty(2, device="meta"),
                "text",
                None,
                3.5,
            )

    model = nn.Sequential(nn.Linear(3, 3), Odd())
    with nan_magic.watch(model, mode=mode) as w:
        model(torch.randn(2, 3))
    assert w.report is None and w.events == []
    # The meta tensor is the only one it cannot read (the complex and sparse ones are read, finite):
    # the full watch skips it in Odd's output, then again in the root's, which returns the same tuple;
    # the tiered watch reads the root's output only.
    assert dict(w.skipped) == {"meta": meta_reads}


def test_kinds_option_ignores_the_other_kind() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "fp16_overflow")
    model, run = fault.build()
    with nan_magic.watch(model, kinds=["nan"]) as w:
        run()  # only +inf is produced
    assert w.report is None


def test_include_exclude_and_types_select_modules() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    # The LogLayer is excluded: the NaN is first seen in the root's output.
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, exclude=["1"]):
        run()
    assert caught.value.report.module == ""
    model, run = fault.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, types=["LogLayer"]):
        run()
    assert caught.value.report.module == "1"
    assert {row.module for row in caught.value.report.layers} <= {"", "1"}
    model, run = fault.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, include=["0", "2"]):
        run()
    assert caught.value.report.module == ""


def test_warn_and_log_modes_record_and_continue(tmp_path) -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    log_file = tmp_path / "events.jsonl"
    expected = r"first non-finite value in forward step 0: 1 \(LogLayer\), op aten.log.default"
    with pytest.warns(RuntimeWarning, match=expected), nan_magic.watch(
        model, on_detect="warn", log_file=str(log_file)
    ) as w:
        run()
        run()
    assert w.report is not None and w.report.module == "1"
    assert [event.step for event in w.events] == [0, 1]
    lines = log_file.read_text().splitlines()
    assert len(lines) == 2
    import json

    first = json.loads(lines[0])
    assert first["module"] == "1" and first["phase"] == "forward" and first["nan"] > 0

    model, run = fault.build()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nan_magic.watch(model, on_detect="log") as w:
            out = run()
    assert torch.isnan(out).any() and len(w.events) == 1


def test_a_log_file_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tmp_path) -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    missing = tmp_path / "no such folder" / "events.jsonl"
    with pytest.warns(nan_magic.NanMagicWarning, match="could not write the event log"), nan_magic.watch(
        model, on_detect="log", log_file=str(missing)
    ) as w:
        out = run()
    assert torch.isnan(out).any() and len(w.events) == 1 and not missing.exists()


@pytest.mark.parametrize("mode", ["tiered", "full"])
def test_warn_mode_warns_each_event_once_and_only_the_first_as_first(mode: str) -> None:
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogOf(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, nan_magic.watch(model, opt, on_detect="warn", mode=mode) as w:
        warnings.simplefilter("always")
        loss = model(torch.randn(8, 4)).mean()  # log of negatives in model[1]
        opt.zero_grad()
        loss.backward()
        opt.step()  # applies the NaN gradients: the run goes on, as asked
    messages = [str(warning.message) for warning in caught if warning.category is RuntimeWarning]
    # The forward producer once (the optimizer's gradient check meets it again and adds nothing), then what followed.
    assert (w.events[0].phase, w.events[0].module) == ("forward", "1")
    assert len(w.events) == len({(e.step, e.phase, e.module, e.op, e.tensor) for e in w.events})
    assert len(messages) == len(w.events) >= 2
    assert messages[0].startswith("first non-finite value in forward step 0: 1 (LogOf)")
    # Each later one names the first by where it was found, held as data (the first's reference), not its sentence.
    first = w.events[0]
    assert first.follows is None and all(event.follows == first.ref for event in w.events[1:])
    assert (first.ref.step, first.ref.phase, first.ref.module, first.ref.module_type) == (0, "forward", "1", "LogOf")
    after = f", after the first event (forward step 0: 1 (LogOf), op {first.op})"
    assert first.op is not None and all(m.startswith("non-finite ") and m.endswith(after) for m in messages[1:])
    assert w.report is w.events[0]


def test_step_counts_forward_passes_without_an_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), LogOf())
    x = torch.ones(2, 4).abs()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model):
        for scale in (1.0, 1.0, -1.0):
            with torch.no_grad():
                model[0].weight.fill_(scale)
                model[0].bias.zero_()
            model(x)
    assert caught.value.report.step == 2


def test_report_samples_the_layers_before_the_producer_for_histograms() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    report = run_fault(fault, mode="full").report  # tiered: tests/test_tiered.py
    producer = [sample.label for sample in report.samples if sample.producer]
    others = [sample for sample in report.samples if not sample.producer]
    # the module's input, the op's operand and output (from the replay), then the module's output
    assert producer == ["input[0]", "self", "output of aten.log.default", "1 output"]
    output = next(sample for sample in report.samples if sample.label == "output of aten.log.default")
    assert len(output.values) == report.numel - report.nonfinite  # its finite values only
    # the batch; Linear 0's output is the producer's input[0], drawn once, under that name
    assert [sample.label for sample in others] == ["(root) input[0]"]
    assert all(0 < len(sample.values) <= 1024 for sample in others)
    # Each sample names its tensor by a typed reference and the module whose call it is of; render titles it.
    assert [(sample.module, sample.tensor) for sample in others] == [("", TensorRef.argument("input[0]"))]
    assert output.module is None and output.tensor == TensorRef.op_output("aten.log.default")


def test_a_parent_returning_its_child_s_output_is_not_sampled_again_under_its_own_name() -> None:
    # nn.Sequential returns its last child's output: one tensor, sampled once, as the child's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(8, 4)

    def run() -> None:
        for step in range(3):
            out = model(x)
            loss = (out - 1).pow(2).mean() if step < 1 else torch.log(out.mean() - 100)  # producer: the loss code
            loss.backward()

    report = raised(run, model)
    assert (report.phase, report.module, report.op) == ("forward", None, "aten.log.default")
    others = [sample.label for sample in report.samples if not sample.producer]
    assert others == ["(root) input[0]", "2 output"]
