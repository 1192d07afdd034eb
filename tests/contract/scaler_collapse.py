"""A GradScaler whose scale keeps collapsing: the op and line of the gradient that keeps overflowing (issue 27).

The collapse is raised on the last skipped step (15 in a row); the report
names the backward producer of that step's non-finite gradient, as a backward
event would: inside a model (the step replay), or in the loss code (its
recorded ops replayed with their backward, also by the deferred check, after
the loss was freed), in every mode. Inside the model, the full mode's replay
of the module cannot compute the gradient of a tensor the module made inside
(a call is replayed from its arguments): it names the module, and says so.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario

FULL = ("full: the module replay names the module only: the tensor whose gradient overflowed (1.proj output) "
         "is made inside it, not passed to it")


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        return self.out(h) * 64.0  # producer: head output


def collapsing(loss_factor: float, unscale_and_clip: bool = False) -> Scenario:
    """float16 autocast, large output weights: a gradient overflows float16 at every scale down to 4.

    ``unscale_and_clip``: ``scaler.unscale_`` and gradient clipping run between backward and the step.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Head())
    with torch.no_grad():
        model[1].out.weight.fill_(30.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def run() -> None:
        for _ in range(40):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() - y).pow(2).mean() * loss_factor  # producer: scaled loss
            opt.zero_grad()
            scaler.scale(loss).backward()
            if unscale_and_clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()

    return Scenario((model, opt), run)


CASES = [
    # The gradient into the head's output is finite at the last scales; its matmul's backward overflows.
    Case("grad_scaler_collapse_inside_the_model", lambda: collapsing(1.0),
         Expect("backward", "1", "Head", op="aten.mm.default", marker="head output", cause="grad-scaler-collapse",
                benign_events=15, op_modes=("default", "defer", "ops"),
                says=(("full", "the tensor whose gradient is not finite was computed inside 1, not passed to it"),)),
         note=FULL),
    # A loss 1000 times larger: the cast back to float16 in the loss code's backward overflows first.
    Case("grad_scaler_collapse_in_the_loss_code", lambda: collapsing(1000.0),
         Expect("backward", None, op="aten._to_copy.default", marker="scaled loss", cause="grad-scaler-collapse",
                benign_events=15)),
]
