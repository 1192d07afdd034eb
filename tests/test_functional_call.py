"""``torch.func.functional_call`` with fast weights (MAML's inner loop): the module runs on tensors the loop made,
not on its own parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import TensorRole
from tests.faults import marked_line
from tests.watching import FIVE_MODES as MODES
from tests.watching import LogWhenTold


def maml(options: dict, nan_in: str) -> nan_magic.Report:
    """Six outer steps; at the fourth, a NaN in the fast-weight forward, or an inf inner learning rate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogWhenTold(), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(6):
            params = dict(model.named_parameters())
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            inner = (functional_call(model, params, (x,)) - y).pow(2).mean()
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            lr = float("inf") if nan_in == "inner update" and step == 3 else 0.1
            fast = {name: p - g * lr for (name, p), g in zip(params.items(), grads)}  # producer: inner update
            model[1].fire = nan_in == "forward" and step == 3
            outer = (functional_call(model, fast, (x,)) - y).pow(2).mean()
            opt.zero_grad()
            outer.backward()
            opt.step()
    return caught.value.report


@pytest.mark.parametrize("options", MODES)
def test_a_nan_in_a_fast_weight_forward_is_named_at_its_module_op_and_line(options) -> None:
    report = maml(options, "forward")
    assert (report.phase, report.module, report.step, report.op) == ("forward", "1", 3, "aten.log.default")
    assert report.source is not None and report.source.lineno == marked_line("log when told", where=LogWhenTold)


@pytest.mark.parametrize("options", MODES)
def test_an_inf_inner_learning_rate_is_named_at_the_loops_update_line(options) -> None:
    # The fast weights are an input the loop's code made (p - g * inf), not the module's parameters.
    report = maml(options, "inner update")
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 3, "aten.mul.Tensor")
    assert report.source is not None and report.source.lineno == marked_line("inner update", where=maml)
    assert report.tensor.role is not TensorRole.PARAMETER
    assert "parameter-already-nonfinite" not in report.to_text()
    assert not any("already non-finite" in note or "wrote 0.weight" in note for note in report.notes)


@pytest.mark.parametrize("options", MODES)
def test_an_inf_inner_learning_rate_says_the_swapped_in_tensor_is_the_loops(options) -> None:
    # The text names 0.weight as the loop's tensor functional_call passed in its place, never as a module's
    # output or a parameter; ops mode's report (the tracer's op, no boundary row) says it in the note alone.
    report = maml(options, "inner update")
    text = str(report)
    assert "0.weight of code outside any watched module" not in text
    assert "module out" not in text and "parameter 0.weight" not in text
    assert ("note        torch.func.functional_call ran the model with a tensor of the loop's own code in 0.weight's "
            "place: it is no parameter of the model") in text
    row = "swapped in  the loop's tensor torch.func.functional_call passed as 0.weight: f32[4,4] 10 +inf, 6 -inf"
    assert (row in text) is not options.get("ops", False)

