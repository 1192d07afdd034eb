"""literal_s46: the loop writes a non-finite Python number into a parameter by indexing, each with its healthy twin.

``w[0, 0] = float("nan")``, ``w[1] = math.inf``, ``w[:, 2] = torch.tensor(nan)``, ``w.data[i, j] = v``: Python lifts
the number into a 0-dim tensor (``aten.lift_fresh``) and copies it into a view of the parameter. Before session 46
the default and deferred modes named no op ("unclassified", the op unknown) and ``ops=True`` said "forward" with
``parameter-already-nonfinite`` at the next forward; a ``masked_fill_`` or ``fill_`` of the same number was named.
Now every mode names the lift at the line that wrote the number, phase ``optimizer`` (the loop's own code is the
optimizer), at the step the write happened: after a step, between ``backward()`` and the step, or before a forward.
A healthy twin writes a finite number (a unit reset to 0).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches

STEPS = 5
WRITTEN_AT = 2


def _edit(model: nn.Sequential, how: str, value: float) -> None:
    weight = model[0].weight
    with torch.no_grad():
        if how == "element":
            weight[0, 0] = value  # producer: element written
        elif how == "row":
            weight[1] = value  # producer: row written
        elif how == "column":
            weight[:, 2] = torch.tensor(value)  # producer: column written
        elif how == "through data":
            weight.data[3, 1] = value  # producer: data written


def _loop(how: str, when: str, value: float) -> Scenario:
    """A two-layer MLP and Adam; the loop writes ``value`` into the first layer's weight at step 2: ``when`` is
    ``"after"`` (after the optimizer step), ``"between"`` (between backward and the step) or ``"before"`` (before
    the step's forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            if step == WRITTEN_AT and when == "before":
                _edit(model, how, value)
            loss = F.cross_entropy(model(xs[step % len(xs)]), ys[step])
            opt.zero_grad()
            loss.backward()
            if step == WRITTEN_AT and when == "between":
                _edit(model, how, value)
            opt.step()
            if step == WRITTEN_AT and when == "after":
                _edit(model, how, value)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _rows() -> list[Case]:
    cases = []
    for how, marker, value in (("element", "element written", math.nan), ("row", "row written", math.inf),
                               ("column", "column written", math.nan), ("through data", "data written", -math.inf)):
        for when, step in (("after", WRITTEN_AT + 1), ("between", WRITTEN_AT), ("before", WRITTEN_AT)):
            name = f"literal_s46_{how.replace(' ', '_')}_written_{when}_the_step"
            cases.append(Case(name, lambda how=how, when=when, value=value: _loop(how, when, value),
                              Expect("optimizer", "0", "Linear", step=step, op="aten.lift_fresh.default",
                                     marker=marker, cause="nonfinite-number")))
        cases.append(Case(f"literal_s46_{how.replace(' ', '_')}_written_finite_healthy",
                          lambda how=how: _loop(how, "after", 0.0), None))
    return cases


CASES = _rows()
