"""A training loop as notebooks write it, not the benchmarks' minimal step (issue 25, the loop's idioms).

The loop logs ``loss.item()`` and an accuracy's ``.item()`` every step,
computes the accuracy in the loss code, accumulates two micro-batches per
optimizer step (the loss halved), clips the gradients, steps a warm-up
scheduler, zeroes the gradients in place (``zero_grad(set_to_none=False)``),
moves a float64 batch to the device as float32 and augments it (standardised
per batch, then noised). Each idiom adds ops to the regions the loss-code
recorder sees (localize/outside/recorder.py, loop_writes.py); a NaN made in
the loss code, the data code or the update code of this loop is still named
at its op and line, and the healthy loop stays silent and computes the same.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef

#: Micro-batches per optimizer step, and optimizer steps in a run.
MICRO, STEPS = 2, 4


def _realistic_loop(producer: str | None) -> Scenario:
    """The loop of the module docstring; ``producer`` ("loss", "data", "update") makes a NaN there at step 2.

    loss: a temperature schedule reaches 0 (logits / 0); data: a feature constant across the batch is
    standardised (0 / 0); update: the first layer's rows renormalised in place from step 2, one of them dead
    (a zero row under a ReLU that never fires: 0 / 0).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight[2] = 0.0
        model[0].bias[2] = -100.0  # unit 2 never fires: its row's gradient, and Adam's update of it, are zero
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    batches = [(torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 4, (6,))) for _ in range(MICRO * STEPS)]
    if producer == "data":
        batches[MICRO * 2][0][:, 5] = 1.5  # one feature constant across step 2's first micro-batch
    logged: list[float] = []

    def run() -> tuple[list[torch.Tensor], list[float]]:
        for iteration, (features, labels) in enumerate(batches):
            step = iteration // MICRO
            x, y = features.to("cpu", torch.float32), labels.to("cpu")
            x = (x - x.mean(0)) / x.std(0)  # producer: standardise
            x = x + 0.01 * torch.randn_like(x)
            logits = model(x)
            temperature = torch.tensor(1.0 - step / 2 if producer == "loss" else 1.0)
            loss = F.cross_entropy(logits / temperature, y)  # producer: temperature
            accuracy = (logits.argmax(-1) == y).float().mean()
            (loss / MICRO).backward()
            if iteration % MICRO < MICRO - 1:
                continue
            logged.append(loss.item())
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if producer == "update" and step >= 2:
                with torch.no_grad():
                    weight = model[0].weight
                    weight.div_(weight.norm(dim=1, keepdim=True))  # producer: renormalise
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=False)
            logged.append(accuracy.item())
        return [p.detach().clone() for p in model.parameters()], logged

    return Scenario((model, opt), run)


CASES = [
    Case("realistic_loop_healthy", lambda: _realistic_loop(None), None),
    Case("realistic_loop_temperature_reaches_zero_in_the_loss", lambda: _realistic_loop("loss"),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="temperature")),
    Case("realistic_loop_constant_feature_standardised_in_the_loop", lambda: _realistic_loop("data"),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="standardise")),
    Case("realistic_loop_dead_row_renormalised_after_clipping", lambda: _realistic_loop("update"),
         Expect("optimizer", "0", "Linear", step=2, op="aten.div_.Tensor", marker="renormalise",
                tensor=TensorRef.parameter("0.weight"), cause="division-by-zero")),
]
