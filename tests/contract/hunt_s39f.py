"""hunt_s39f, incidents where the user's code sidesteps what the watch hooks: ``.data =`` and ``model.forward(x)``.

A class-incremental classifier whose rows the loop renormalises by assigning ``weight.data = weight.data / norm``
(not in place): the new rows appended as zeros are ``0 / 0``. A model called as ``model.forward(x)`` (the root's own
hooks never run) whose forward takes ``log`` of a feature that one sample holds at exactly 0.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


class CosineClassifier(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.weight = nn.Parameter(F.normalize(torch.randn(classes, 8), dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 10.0 * F.linear(F.normalize(self.body(x), dim=-1), self.weight)


def _renormalised_by_data(random_rows: bool) -> Scenario:
    """At step 2 two classes arrive, their rows appended as zeros (a new optimizer over the grown model); the loop keeps
    each row at unit norm by ``model.weight.data = model.weight.data / norm`` before the step: ``0 / 0`` for the new
    rows. The twin initialises them at random."""
    torch.manual_seed(0)
    model = CosineClassifier(3)
    xs = _batches(6, 6)
    ys = [torch.randint(0, 3, (6,)) for _ in range(2)] + [torch.randint(0, 5, (6,)) for _ in range(2)]
    grown = torch.randn(2, 8) if random_rows else torch.zeros(2, 8)
    holder: dict[str, torch.optim.Optimizer] = {"opt": torch.optim.SGD(model.parameters(), lr=0.05)}

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                model.weight = nn.Parameter(torch.cat([model.weight.detach(), grown]))
                holder["opt"] = torch.optim.SGD(model.parameters(), lr=0.05)
            model.weight.data = model.weight.data / model.weight.data.norm(dim=1, keepdim=True)  # producer: data rows
            loss = F.cross_entropy(model(xs[step]), ys[step])
            holder["opt"].zero_grad()
            loss.backward()
            holder["opt"].step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


class LogFeatures(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.log(x.abs() + self.floor))  # producer: forward log


def _forward_called(floor: float) -> Scenario:
    """The loop calls ``model.forward(x)``, so the root's hooks never run (its children's do). Step 2 holds a sample
    with a feature of exactly 0: ``log(0)`` is ``-inf``, in the root's own code. The twin adds a floor of 1e-6."""
    torch.manual_seed(0)
    model = LogFeatures(floor)
    xs, ys = _batches(5, 4), [torch.randint(0, 2, (5,)) for _ in range(4)]
    xs[2][1, 2] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model.forward(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


#: Was a known limit (session 39): with the root's hooks bypassed, its own code was taken for the loop's data code,
#: and the report said phase data at net's input. The op's frames are now asked whether one is a watched module's
#: ``forward`` (localize/forward_called.py).
_FORWARD_CALLED = "model.forward(x): the root's own log(0) is its forward's, not the loop's data code"

CASES = [
    Case("hunt_s39f_class_incremental_zero_rows_renormalised_by_data_assignment", lambda: _renormalised_by_data(False),
         # (Before session 40 only ops=True named the op: the replay read the replaced weight as ``.data =`` left it,
         # already NaN; the registration now keeps an alias of its memory then: loop_writes.on_registered.)
         Expect("optimizer", "", "CosineClassifier", step=2, op="aten.div.Tensor", marker="data rows",
                cause="division-by-zero")),
    Case("hunt_s39f_class_incremental_random_rows_renormalised_by_data_healthy", lambda: _renormalised_by_data(True),
         None),
    Case("hunt_s39f_log_of_a_zero_feature_in_a_model_called_by_forward", lambda: _forward_called(0.0),
         Expect("forward", "", "LogFeatures", step=2, op="aten.log.default", marker="forward log", cause="log-domain"),
         note=_FORWARD_CALLED),
    Case("hunt_s39f_log_with_a_floor_in_a_model_called_by_forward_healthy", lambda: _forward_called(1e-6), None),
]
