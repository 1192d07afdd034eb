"""What the user reads, said the same in every mode and without small lies (polish-s27).

Each test asserts the words or fields the user sees: a benign event's step and count in every mode, an uncounted
tensor's note, a cell's source repr, the float32 remedy's description where the op already ran in float32, and a
fix trial's line where the step stopped before its loss code ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS
from contract.calm_s27 import _ppo_action_mask
from torch import nn

import nan_magic
from nan_magic.records import SourcePointer


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_a_deliberate_infinity_every_step_is_one_benign_event_at_step_0_in_every_mode(mode: str) -> None:
    # Before: the tiered watch (default, defer) recorded the policy's masked_fill(-inf) output at each step's
    # root-output check (3 events, steps 0, 1, 2), full and ops once (step 0). PRODUCT.md's mask rule and the op
    # tracer record a deliberate infinity once per place per watch, at the step it was first seen.
    scenario = _ppo_action_mask()
    with nan_magic.watch(*scenario.targets, **MODE_OPTIONS[mode], **scenario.options) as w:
        scenario.run()
    assert w.report is None
    assert [(e.benign, e.step, e.phase, e.module) for e in w.events] == [(True, 0, "forward", "")], [
        e.message for e in w.events]


def test_an_uncounted_benign_output_names_its_kind_without_a_question_mark() -> None:
    # ops+defer: the policy's output was freed before the deferred check made the report; its probe kept the kind.
    # Before: "(? -inf of 30, not counted: the tensor was freed before the report was made; the check kept only that
    # it was not finite)" - a "?" where a count should be, and a clause the "-inf" beside it contradicts.
    scenario = _ppo_action_mask()
    with nan_magic.watch(*scenario.targets, ops=True, defer=True) as w:
        scenario.run()
    (event,) = w.events
    assert event.message.endswith(
        "(-inf among 30 values, not counted: the tensor was freed before the report was made)"), event.message
    text = event.to_text()
    assert "?" not in text.splitlines()[0]
    assert "non-finite  -inf among 30 elements (not counted: the tensor was freed before the report was made)" in text


def test_a_cells_source_repr_says_the_cell_and_keeps_its_fields(ip: Any) -> None:
    filename = ip.compile.cache("y = x / 0\n", 3)
    source = SourcePointer(filename, 1, "<module>", "y = x / 0")
    assert str(source) == "Cell In[3], line 1, in <module>"
    assert repr(source) == (f"SourcePointer(filename={filename!r} (Cell In[3]), lineno=1, function='<module>', "
                            "line='y = x / 0')")
    assert source.filename == filename  # (the field is what reopens it: unchanged)
    # A file that is no cell keeps the dataclass's repr.
    plain = SourcePointer("/src/model.py", 4, "forward")
    assert repr(plain) == "SourcePointer(filename='/src/model.py', lineno=4, function='forward', line=None)"


class Float32Overflow(nn.Module):
    """Under float16 autocast, an op autocast leaves in float32 (a product with a Python scalar) overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).float()
        return h * 1e30 * 1e30


def test_the_float32_remedy_of_an_op_that_ran_in_float32_says_what_it_tries() -> None:
    # Before: "the producer's line computed in float32 with autocast (cpu) off (it ran in float32)".
    torch.manual_seed(0)
    model = Float32Overflow()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 4)).mean()
        loss.backward()
    report = raised.value.report
    assert report.dtype == "float32"
    (trial,) = [trial for trial in report.fixes if trial.kind == "float32"]
    assert trial.description == ("the producer's line computed in float32 with autocast (cpu) off: the op already "
                                 "ran in float32, so this tries the line's other calls in float32")
    assert "(it ran in float32)" not in report.to_text()


class LogOfRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.fc(x)))


def test_a_forward_failures_trial_says_briefly_why_it_has_no_loss() -> None:
    # Before: "loss not computed: the forward failed before this step's loss code ran, and no earlier step ran
    # backward() watched (the backward started from ones into the model's outputs)".
    torch.manual_seed(0)
    model = LogOfRelu()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt):
        torch.nn.functional.cross_entropy(model(torch.randn(3, 4)), torch.arange(3)).backward()
    report = raised.value.report
    assert (report.phase, report.step) == ("forward", 0)
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    assert trial.fact("before_loss_code") is True
    text = report.to_text()
    assert ("no loss: the failing step stopped before its loss code ran (the backward started from ones into the "
            "model's outputs)") in text
    assert "no earlier step ran backward() watched" not in text


def test_a_forward_failures_unverified_trial_says_briefly_why_it_cannot_tell() -> None:
    # Before: "still non-finite (next forward), but its backward started from ones into the model's outputs, standing
    # for the loss (loss not computed: the forward failed before this step's loss code ran, and no earlier step ran
    # backward() watched): the trial cannot tell whether the step with its own loss would be finite".
    from contract import hunt21
    from test_fixes_s27 import _report

    report = _report(hunt21, "hunt21_yeo_johnson_learned_lambda_of_0", "default")
    text = report.to_text()
    assert ("still non-finite (next forward), but its backward started from ones into the model's outputs "
            "(the failing step stopped before its loss code ran): the trial cannot tell whether the step with its own "
            "loss would be finite") in text, text
    assert "no earlier step ran backward() watched" not in text


def test_an_op_of_the_optimizer_step_is_said_to_run_in_that_step_not_in_the_parameters_module() -> None:
    # Before: "aten.div.Tensor in head_b (Linear) divided by zero", read as head_b's forward; the op ran in the LAMB
    # step's trust ratio of head_b.weight.
    from contract import hunt_s27b

    (case,) = [c for c in hunt_s27b.CASES if c.name == "hunt_s27_lamb_trust_ratio_of_a_zero_update_at_step_0"]
    scenario = case.build()
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(*scenario.targets, **scenario.options):
        scenario.run()
    report = raised.value.report
    assert (report.phase, report.module, report.op) == ("optimizer", "head_b", "aten.div.Tensor")
    assert report.cause is not None
    assert "aten.div.Tensor in the Lamb step of head_b.weight divided by zero" in report.cause.hint, report.cause.hint
    assert "in head_b (Linear)" not in report.to_text()
