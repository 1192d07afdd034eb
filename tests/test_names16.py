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
