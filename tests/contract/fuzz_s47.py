"""fuzz_s47, what the incident fuzzer (tests/fuzz/) found, reduced: targets the loop standardises, in every mode.

The loop standardises each batch's targets by their own std (``y = (y - y.mean(0)) / y.std(0)``); at one step a
target column is constant (a sensor stuck at one reading): ``0 / 0``. Run between an optimizer step and the step's
model call, that line is the loop's data code (PRODUCT.md: phase ``data``, module None). So it is on the second
micro-batch of a gradient accumulation, after a backward with no optimizer step since (fuzz seeds 178, 288: the
immediate recorded modes lost the op, the per-module ones too, and ops mode said ``forward``). After a validation
call at the end of the step before (seed 228) every mode says ``forward``: the line runs in the no-grad call's loss
region (a strict xfail). After the step's own model call it is the loss code's, as class weights computed there are
(hunt15's rows): ``forward``.
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


def _data(step: int, marker: str, phase: str = "data") -> Expect:
    return Expect(phase, None, step=step, op="aten.div.Tensor", marker=marker, kinds=frozenset({"nan"}))


AFTER_VALIDATION = ("says forward: the line ran in the loss region of the no-grad validation call before it, though "
                    "it made the next training call's targets from outside data alone")



CASES = [
    Case("fuzz_s47_targets_standardised_after_a_validation_pass", lambda: _targets(True, "validated"),
         _data(1, "standardise"), gaps=tuple((mode, AFTER_VALIDATION) for mode in MODES)),
    Case("fuzz_s47_targets_standardised_after_a_validation_pass_healthy", lambda: _targets(False, "validated"), None),
    Case("fuzz_s47_targets_standardised_on_the_second_micro_batch", lambda: _targets(True, "accumulated"),
         _data(0, "standardise")),
    Case("fuzz_s47_targets_standardised_on_the_second_micro_batch_healthy", lambda: _targets(False, "accumulated"),
         None),
    Case("fuzz_s47_targets_standardised_after_the_model_call", lambda: _targets(True, "late"),
         _data(1, "late standardise", phase="forward")),
    Case("fuzz_s47_targets_standardised_after_the_model_call_healthy", lambda: _targets(False, "late"), None),
]
