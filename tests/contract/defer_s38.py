"""A loss scaled by a Python number that is not finite: every mode names the op given it (defer-s38).

``loss = -objective * weight`` with ``weight = math.inf`` from a config: autograd's ``MulBackward0`` saves the number
as a 0-dim float64 tensor (torch's "wrapped number"). The immediate watches walked the loss code's saved tensors for
data the loss read and took it for a NaN-coded label: phase ``data``, ``other of MulBackward0``, cause
``bad-input-data`` (no data was bad). The deferred ones read the recorded ops' arguments, where the number is a
number, and named ``aten.mul.Tensor`` with the ``nonfinite-number`` cause; now every mode does (ops=True and its
deferred twin named different phases, ops and tensors). The ``+inf`` twin (a positive objective times ``inf``) is a
strict xfail in tests/test_defer_s38.py. Also: a fully masked row whose fill value is a 0-dim ``ones(()) * -inf``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop

STEPS = 4


def _weighted(weight: float, named: bool) -> Scenario:
    """A maximised objective's loss, ``-(out ** 2).mean() - 1`` (negative on any kernel), weighted by a number the
    config sets: ``weight`` at step 2, 1.0 at the others."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 4) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            scale = weight if step == 2 else 1.0
            objective = model(xs[step]).pow(2).mean() + 1
            opt.zero_grad()
            if named:
                loss = -objective * scale  # producer: named weight
                loss.backward()
                losses.append(loss.detach())
            else:
                (-objective * scale).backward()  # producer: temporary weight
            opt.step()
        return losses

    return Scenario((model, opt), run)


def _expect(marker: str) -> Expect:
    return Expect("forward", None, step=2, op="aten.mul.Tensor", marker=marker, cause="nonfinite-number",
                  kinds=frozenset({"-inf"}))


class _ZeroDimFill(nn.Module):
    """Attention whose mask's fill value is a 0-dim -inf made by a product (masked_fill takes only a 0-dim tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        neg = torch.ones(()) * -math.inf
        scores = (self.q(x) @ x.T).masked_fill(~keep, neg)
        return self.out(torch.softmax(scores, -1) @ x)  # producer: zero-dim fill softmax


def _zero_dim_fill(row: bool) -> Scenario:
    """A fully masked row at step 2 (``row``): the softmax's 0/0 is the fault, not the product that made the fill
    (the review of defer-s38 found a rule that named that product, cause nonfinite-number: taken back)."""
    torch.manual_seed(0)
    xs = _batches(5, 4)
    keeps = [torch.ones(5, 5, dtype=torch.bool) for _ in range(STEPS)]
    for step, keep in enumerate(keeps):
        keep[3, : 5 if row and step == 2 else 2] = False
    return _loop(_ZeroDimFill(), lambda step: (xs[step], keeps[step]), lambda out, _step: out.pow(2).mean())


CASES = [
    Case("defer_s38_fully_masked_row_with_a_zero_dim_fill_value", lambda: _zero_dim_fill(True),
         Expect("forward", "", "_ZeroDimFill", step=2, op="aten._softmax.default", marker="zero-dim fill softmax",
                cause="masked-softmax")),
    Case("defer_s38_zero_dim_fill_value_healthy", lambda: _zero_dim_fill(False), None),
    Case("defer_s38_loss_times_a_python_inf_weight_named", lambda: _weighted(math.inf, True), _expect("named weight")),
    Case("defer_s38_loss_times_a_python_inf_weight_temporary", lambda: _weighted(math.inf, False),
         _expect("temporary weight")),
    Case("defer_s38_loss_times_a_finite_weight_healthy", lambda: _weighted(1e3, True), None),
]
