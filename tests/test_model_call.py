"""Which micro-batch of gradient accumulation a value came from: ``Report.model_call`` and the step row.

A deferred check (CUDA's default) judges a micro-batch's backward at the next micro-batch's model call, and the
optimizer's check comes after all of them: the step number alone does not say which of the step's batches to look
at. The report names the step's model call the value came from, from the 2nd on, in every mode.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from watching import raised

from nan_magic.render.words.counted import ordinal

MODES = {
    "default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
    "ops-defer": {"ops": True, "defer": True},
}


class Gate(nn.Module):
    """sqrt of its input: NaN where a batch makes it negative (the forward producer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()


def _accumulating(where: str, micro_bad: int, micro_batches: int = 4, steps: int = 3):
    """A loop of ``steps`` optimizer steps over ``micro_batches`` accumulated micro-batches each; at step 1's
    micro-batch ``micro_bad`` (0-based) the NaN is made ``where``: the data, the loss code, its backward, or a
    module's forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Softplus(), Gate(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(5, 4) for _ in range(steps * micro_batches)]
    bad = micro_batches + micro_bad
    if where == "data":
        batches[bad][1, 2] = float("nan")

    def run() -> None:
        for step in range(steps):
            opt.zero_grad()
            for micro in range(micro_batches):
                index = step * micro_batches + micro
                if where == "forward" and index == bad:
                    model[1].beta = -1.0  # a softplus of negative beta is negative: the gate's sqrt makes NaN
                out = model(batches[index])
                if where == "loss" and index == bad:
                    loss = (out * 0 - 1).log().mean()
                elif where == "backward" and index == bad:
                    loss = (out * 0).sqrt().sum()
                else:
                    loss = out.pow(2).mean()
                (loss / micro_batches).backward()
            opt.step()

    return model, opt, run


PHASES = {"data": "data", "loss": "forward", "backward": "backward", "forward": "forward"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["data", "loss", "backward", "forward"])
def test_the_micro_batch_of_an_accumulated_step_is_named(where: str, mode: str) -> None:
    model, opt, run = _accumulating(where, micro_bad=2)
    report = raised(run, model, opt, **MODES[mode])
    assert (str(report.phase), report.step) == (PHASES[where], 1)
    if where == "forward":
        assert report.module == "2"  # the gate
    assert report.model_call == 3
    # (no longer "... model call: with gradient accumulation, its 3rd micro-batch": test_user_s35.py's siamese pair)
    assert "step        1 (the step's 3rd model call)\n" in str(report)


@pytest.mark.parametrize("mode", MODES)
def test_the_first_micro_batch_is_the_step_alone(mode: str) -> None:
    """The 1st is not said (a check at once cannot tell it from a step of one call), in every mode alike."""
    model, opt, run = _accumulating("loss", micro_bad=0)
    report = raised(run, model, opt, **MODES[mode])
    assert (report.step, report.model_call) == (1, None)
    assert "  step        1\n" in str(report)


@pytest.mark.parametrize("mode", MODES)
def test_a_step_of_one_model_call_has_no_micro_batch(mode: str) -> None:
    model, opt, run = _accumulating("loss", micro_bad=0, micro_batches=1)
    report = raised(run, model, opt, **MODES[mode])
    assert (report.step, report.model_call) == (1, None)
    assert "micro-batch" not in str(report)


def test_ordinals_read_as_english() -> None:
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]


@pytest.mark.parametrize("mode", MODES)
def test_two_watched_models_count_both_and_say_no_micro_batch(mode: str) -> None:
    """An encoder and a head watched as two models, each called once a step: the head's NaN is the step's 2nd model
    call, and no micro-batch is claimed (the count takes in both models' calls)."""
    torch.manual_seed(0)
    encoder, head = nn.Linear(4, 8), nn.Sequential(nn.Softplus(), Gate())
    opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
    batches = [torch.randn(5, 4) for _ in range(3)]

    def run() -> None:
        for step, x in enumerate(batches):
            if step == 1:
                head[0].beta = -1.0  # a softplus of negative beta is negative: the gate's sqrt makes NaN
            loss = head(encoder(x)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, encoder, head, opt, **MODES[mode])
    assert (str(report.phase), report.step, report.model_call) == ("forward", 1, 2)
    assert "step        1 (the step's 2nd model call)\n" in str(report)
