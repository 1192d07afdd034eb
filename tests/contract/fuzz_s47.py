"""fuzz_s47, what the incident fuzzer (tests/fuzz/) found, reduced: targets the loop standardises, in every mode.

The loop standardises each batch's targets by their own std (``y = (y - y.mean(0)) / y.std(0)``); at one step a
target column is constant (a sensor stuck at one reading): ``0 / 0``. The targets are "a tensor built in the loop
from outside data" (PRODUCT.md: phase ``data``, module None), and the watch says so where that line runs between an
optimizer step and the step's model call. It says ``forward`` (the loss code) where the same line runs after a
model call with no optimizer step since: after a validation pass at the end of the step before (fuzz seed 228),
on the second micro-batch of a gradient accumulation (seeds 178, 288: the recorded modes lose the op there too), or
after the model call (its own reduction). The rows hold the truth, as strict xfails where a mode says otherwise.
"""
from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario

MODES = ("default", "defer", "full", "ops", "ops-defer")


def _targets(stuck: bool, where: str) -> Scenario:
    """Three batches; batch 1's first target column is constant when ``stuck``. ``where``: ``"validated"`` (a
    no-grad validation call after each optimizer step), ``"accumulated"`` (one optimizer step per two batches),
    ``"late"`` (the targets standardised after the model call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]
    if stuck:
        data[1][1][:, 0] = 0.5
    held_out = torch.randn(4, 3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step, (x, y) in enumerate(data):
            if where == "late":
                out = model(x)
                y = (y - y.mean(0)) / y.std(0)  # producer: late standardise
            else:
                y = (y - y.mean(0)) / y.std(0)  # producer: standardise
                out = model(x)
            loss = (out - y).pow(2).mean()
            if where == "accumulated":
                (loss / 2).backward()
                if step % 2 == 1:
                    opt.step()
                    opt.zero_grad()
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.detach())
            if where == "validated":
                model.eval()
                with torch.no_grad():
                    model(held_out)
                model.train()
        return [*losses, *(p.detach().clone() for p in model.parameters())]

    return Scenario((model, opt), run)


def _data(step: int, marker: str) -> Expect:
    return Expect("data", None, step=step, op="aten.div.Tensor", marker=marker, kinds=frozenset({"nan"}))


SAYS_LOSS_CODE = "says forward (the loss code): the line ran after a model call with no optimizer step since"
LOST_OP = "names no op, at the loss line: the micro-batch's standardising ran in the loss region of the one before"

CASES = [
    Case("fuzz_s47_targets_standardised_after_a_validation_pass", lambda: _targets(True, "validated"),
         _data(1, "standardise"), gaps=tuple((mode, SAYS_LOSS_CODE) for mode in MODES)),
    Case("fuzz_s47_targets_standardised_after_a_validation_pass_healthy", lambda: _targets(False, "validated"), None),
    Case("fuzz_s47_targets_standardised_on_the_second_micro_batch", lambda: _targets(True, "accumulated"),
         _data(0, "standardise"), gaps=(("default", LOST_OP), ("full", LOST_OP), ("ops", SAYS_LOSS_CODE),
                                        ("ops-defer", SAYS_LOSS_CODE))),
    Case("fuzz_s47_targets_standardised_on_the_second_micro_batch_healthy", lambda: _targets(False, "accumulated"),
         None),
    Case("fuzz_s47_targets_standardised_after_the_model_call", lambda: _targets(True, "late"),
         _data(1, "late standardise"), gaps=tuple((mode, SAYS_LOSS_CODE) for mode in MODES)),
    Case("fuzz_s47_targets_standardised_after_the_model_call_healthy", lambda: _targets(False, "late"), None),
]
