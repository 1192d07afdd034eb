"""The same tensor in the same words in every mode (names16): what a user comparing two runs reads.

Each test runs one incident in the five modes (tests/watching.py's FIVE_MODES) and asserts the words of the
report's text, not only its typed facts: the modes record different tensors (the tiered watch only the model's
boundaries, the per-module watch every call) and must still name each alike.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from watching import FIVE_MODES, raised

from nan_magic.records import TensorRef, TensorRole

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


def _sqrt_of_a_dead_output() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A model whose last ReLU outputs only 0: the loss's sqrt is 0, its gradient into the model output +inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    return model, torch.optim.SGD(model.parameters(), lr=0.0), torch.randn(2, 4)


@pytest.mark.parametrize("options", FIVE_MODES)
def test_the_gradient_into_the_model_output_is_the_model_s_in_every_mode(options: dict) -> None:
    # Before names16 ops+defer named it by the innermost module that returned it ("grad of 1 output"), the
    # other modes by the model: the tiered watch records only the model's output.
    model, opt, x = _sqrt_of_a_dead_output()

    def run() -> None:
        for _ in range(2):
            loss = model(x).sqrt().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, **options)
    text = report.to_text()
    assert (report.phase, report.module, report.op) == ("backward", None, "aten.div.Tensor")
    assert text.startswith("nan_magic: first non-finite grad of model output in backward step 0"), text
    rows = [line for line in text.splitlines() if "code outside any watched module  backward" in line]
    assert rows and all("grad of model output" in row for row in rows), rows
    assert "grad of 1 output" not in text and "grad of 0 output" not in text


def test_data_the_loss_code_read_is_named_by_the_forward_op_s_argument_with_its_line_in_every_mode() -> None:
    # Before names16: "weight of aten.nll_loss_forward.default" with no line in the default, deferred and full
    # watch, "other of MulBackward0" (a view label smoothing took of it) with ops=True and "weight of
    # NllLossBackward0" with ops+defer. The contract row asserts the typed reference and the line per mode; this
    # asserts the words a user reads, the same in the five.
    from contract import MODE_OPTIONS, hunt16

    (case,) = [c for c in hunt16.CASES if c.name == "hunt16_class_weight_of_a_class_absent_from_the_training_set"]
    heads = set()
    for options in MODE_OPTIONS.values():
        scenario = case.build()
        report = raised(scenario.run, *scenario.targets, **options)
        assert report.source is not None and report.source.filename.endswith("hunt16.py")
        heads.add(report.to_text().splitlines()[0])
    line = report.source.lineno
    assert heads == {"nan_magic: first non-finite weight of aten.nll_loss_forward.default in data step 0: code outside "
                     f"any watched module at tests/contract/hunt16.py:{line} (1 +inf of 5)"}, heads


class _Root(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()  # sqrt(0) = 0; its backward's division by 2 * sqrt(0) is +inf


class _RootNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.root, self.head = nn.Linear(4, 4), _Root(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.root(self.lin(x)))


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_backward_producer_s_counts_say_which_tensor_they_are_of_in_every_mode(options: dict) -> None:
    # ops=True and the tiered watch report the module's gradient, mode="full" and ops+defer the op's own output
    # (the module's gradient is freed by the deferred check): the numbers may differ, so the message says whose.
    torch.manual_seed(0)
    model = _RootNet()
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.rand(3, 4) + 0.1 for _ in range(3)]
    xs[1][1, 3] = 0.0

    def run() -> None:
        for x in xs:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, **options)
    assert (report.phase, report.module, report.step, report.op) == ("backward", "root", 1, "aten.div.Tensor")
    head = report.to_text().splitlines()[0]
    if report.tensor == TensorRef.op_output("aten.div.Tensor"):
        assert options in ({"mode": "full"}, {"ops": True, "defer": True})
        assert head.endswith("(1 +inf of 12 in the op's output)"), head
    else:
        assert report.tensor == TensorRef(TensorRole.OUTPUT_GRADIENT, None, "input[0]")
        assert head.endswith("(1 +inf of 12 in grad of input[0])"), head


def test_counts_a_deferred_check_could_not_read_say_why_they_are_missing() -> None:
    # Before names16, ops+defer said "(non-finite values of 12)" and "non-finite   of 12 elements (0%)" of a
    # gradient a custom Function's numpy backward made NaN: no op to replay, and the gradient freed by the check.
    from contract import hunt16

    (case,) = [c for c in hunt16.CASES if c.name == "hunt16_custom_function_numpy_backward_divides_by_a_zero_root"]
    scenario = case.build()
    report = raised(scenario.run, *scenario.targets, ops=True, defer=True)
    text = report.to_text()
    # (polish-s27: the kind alone, no "?" in place of its count; test_polish_s27.py)
    assert "(nan among 12 values, not counted: the tensor was freed before the report was made)" in text.splitlines()[0]
    assert "non-finite  nan among 12 elements (not counted: the tensor was freed" in text, text
    assert "(0%)" not in text
    # Where the counts were read, they show as before.
    scenario = case.build()
    assert "(1 nan of 12)" in raised(scenario.run, *scenario.targets, ops=True).to_text().splitlines()[0]
