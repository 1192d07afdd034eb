"""Facts are typed: a report names its tensors by role, name and path, and stores as plain data.

Each test stands for a place that once read a fact back out of a label the
package wrote ("parameter fc.weight".removeprefix, "input[" prefixes, the
"(before)" suffix of an in-place op's operand): the typed field carries it.
"""

from __future__ import annotations

import json

import pytest
import torch
from faults import FORWARD_FAULTS
from torch import nn
from watching import raised

from nan_magic import TensorRef, TensorRole
from nan_magic.plain import from_plain, to_plain
from nan_magic.records import Report
from nan_magic.render.common import labelled_samples


@pytest.mark.parametrize(("ref", "label"), [
    (TensorRef.output(), "output"),
    (TensorRef.output("output['logits']"), "output['logits']"),
    (TensorRef.argument("kwargs['mask']"), "kwargs['mask']"),
    (TensorRef(TensorRole.INPUT, "blocks.0.proj", "input[0]"), "input[0] of blocks.0.proj"),
    (TensorRef.op_output("aten.div.Tensor"), "output of aten.div.Tensor"),
    (TensorRef(TensorRole.OPERAND, "self", before=True), "self (before)"),
    (TensorRef(TensorRole.OUTPUT_GRADIENT, None, "input[1]"), "grad of input[1]"),
    (TensorRef(TensorRole.OUTPUT_GRADIENT, "", "output"), "grad of model output"),
    (TensorRef(TensorRole.OUTPUT_GRADIENT, "enc", "output[0]"), "grad of enc output[0]"),
    (TensorRef.gradient("fc.weight"), "gradient of fc.weight"),
    (TensorRef.parameter("fc.weight"), "parameter fc.weight"),
    (TensorRef(TensorRole.BUFFER, "attn.causal"), "buffer attn.causal"),
    (TensorRef(TensorRole.OPTIMIZER_STATE, "fc.weight", "exp_avg_sq"), "state exp_avg_sq of fc.weight"),
    (TensorRef(TensorRole.LOSS), "loss"),
])
def test_every_role_has_its_label(ref: TensorRef, label: str) -> None:
    assert str(ref) == label
    assert TensorRef(**to_plain(ref)) == ref  # a role given as its value is the role


def test_a_role_that_is_none_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="'weight' is not a valid TensorRole"):
        TensorRef("weight", "fc.weight")  # type: ignore[arg-type]


class _Adam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_parameter_the_optimizer_made_non_finite_is_named_by_its_reference() -> None:
    # optim.py took the parameter's name from the label's last word, and its owner from the name.
    model = _Adam()
    opt = torch.optim.SGD(model.parameters(), lr=1e38)

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            model(torch.full((2, 4), 1e3)).square().sum().backward()
            opt.step()

    report = raised(run, model, opt)
    assert report.phase == "optimizer" and report.tensor.role is TensorRole.PARAMETER
    assert report.tensor.name in ("fc.weight", "fc.bias") and report.module == "fc"
    assert report.tensor.name in report.cause.hint  # the cause names the parameter, not "parameter fc.weight"


def test_the_producer_s_inputs_say_which_are_the_module_s_arguments_and_which_the_op_s_operands() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = raised(run, model, mode="full")
    roles = {ref.role for ref, _stats in report.input_stats}
    assert roles == {TensorRole.INPUT, TensorRole.OPERAND}
    # The op's operand's histogram is titled by the user's expression, the argument by the module.
    titles = [sample.label for sample in labelled_samples(report) if sample.producer]
    assert any(title.endswith("of 1 (LogLayer)") and title.startswith("input[0]") for title in titles), titles
    assert all(sample.tensor is not None for sample in report.samples if sample.producer)


def test_an_in_place_op_s_operand_before_it_is_marked_not_suffixed() -> None:
    model = nn.Sequential(nn.Linear(3, 3))

    class DivInPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone().div_(torch.zeros_like(x))

    model.append(DivInPlace())
    report = raised(lambda: model(torch.ones(2, 3)), model, ops=True)
    before = [ref for ref, _stats in report.input_stats if ref.before]
    assert before and all(ref.role is TensorRole.OPERAND and ref.name == "self" for ref in before)


def test_a_report_is_plain_data_both_ways() -> None:
    fault = next(f for f in FORWARD_FAULTS if f.name == "log_negative")
    model, run = fault.build()
    report = raised(run, model)
    plain = to_plain(report)
    assert plain["tensor"] == {"role": "op output", "name": report.op, "path": "output", "before": False}
    back = from_plain(Report, plain)
    assert back.tensor == report.tensor and back.input_stats == report.input_stats
    assert back.layers == report.layers and back.message == report.message
    assert json.loads(report.to_json())["tensor"]["role"] == "op output"
