"""fuzz_s47, what the incident fuzzer (tests/fuzz/) found, reduced: targets the loop standardises, in every mode.

The loop standardises each batch's targets by their own std (``y = (y - y.mean(0)) / y.std(0)``); at one step a
target column is constant (a sensor stuck at one reading): ``0 / 0``. Run between an optimizer step and the step's
model call, that line is the loop's data code (PRODUCT.md: phase ``data``, module None). So it is on the second
micro-batch of a gradient accumulation, after a backward with no optimizer step since (fuzz seeds 178, 288, 380: the
immediate recorded modes named no op, and ops mode said ``forward``), and after a validation call at the end of the
step before (seeds 228, 360, 361, 468, 565: every mode said ``forward``, the line taken for that call's loss code).
After the step's own model call it is the loss code's, as class weights computed there are (hunt15's rows).
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


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



CASES = [
    Case("fuzz_s47_targets_standardised_after_a_validation_pass", lambda: _targets(True, "validated"),
         _data(1, "standardise")),
    Case("fuzz_s47_targets_standardised_after_a_validation_pass_healthy", lambda: _targets(False, "validated"), None),
    Case("fuzz_s47_targets_standardised_on_the_second_micro_batch", lambda: _targets(True, "accumulated"),
         _data(0, "standardise")),
    Case("fuzz_s47_targets_standardised_on_the_second_micro_batch_healthy", lambda: _targets(False, "accumulated"),
         None),
    Case("fuzz_s47_targets_standardised_after_the_model_call", lambda: _targets(True, "late"),
         _data(1, "late standardise", phase="forward")),
    Case("fuzz_s47_targets_standardised_after_the_model_call_healthy", lambda: _targets(False, "late"), None),
]


# ---------------------------------------------------------------- no-grad calls that are not a validation
def _soft_targets(temperature: float, teacher_kind: str) -> Scenario:
    """Distillation: soft targets from a watched no-grad call in eval mode, divided by a temperature annealed to 0 at
    step 1. ``teacher_kind``: ``"frozen"`` (its own weights, no gradient), ``"ema"`` (a copy of the student that no
    optimizer trains, its parameters still requiring a gradient). Not a validation call: the division is the loss
    code's (forward, module None), the teacher's output no outside data."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    teacher = copy.deepcopy(student) if teacher_kind == "ema" else nn.Sequential(nn.Linear(3, 2)).requires_grad_(False)
    teacher.eval()
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    xs = [torch.randn(4, 3) for _ in range(3)]
    temperatures = [1.0, temperature, 1.0]

    def run() -> list[torch.Tensor]:
        losses = []
        for step, x in enumerate(xs):
            with torch.no_grad():
                logits = teacher(x)
            soft = (logits / temperatures[step]).softmax(-1)  # producer: teacher temperature
            loss = F.kl_div(student(x).log_softmax(-1), soft, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [*losses, *(p.detach().clone() for p in student.parameters())]

    return Scenario((student, teacher, opt), run)


def _soft(marker: str) -> Expect:
    return Expect("forward", None, step=1, op="aten.div.Tensor", marker=marker)


CASES += [
    Case("fuzz_s47_frozen_teacher_soft_targets_at_temperature_zero", lambda: _soft_targets(0.0, "frozen"),
         _soft("teacher temperature")),
    Case("fuzz_s47_frozen_teacher_soft_targets_healthy", lambda: _soft_targets(0.5, "frozen"), None),
    Case("fuzz_s47_ema_teacher_soft_targets_at_temperature_zero", lambda: _soft_targets(0.0, "ema"),
         _soft("teacher temperature")),
    Case("fuzz_s47_ema_teacher_soft_targets_healthy", lambda: _soft_targets(0.5, "ema"), None),
]
