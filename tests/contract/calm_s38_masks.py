"""Healthy rows (session 38, from the review of hunt-s38): a model that fills illegal logits with -inf, and loss code
whose backward is NaN only at those masked entries of the model output's gradient, which the model's
``masked_fill`` zeroes: every loss and every parameter gradient is finite, unwatched.

- a softmax over a fully masked row (0 / 0 there), the row then replaced by 0 (``torch.where``, ``nan_to_num``,
  ``masked_fill``): the softmax backward is NaN over that row;
- ``torch.where(legal, o ** 2, 0)`` and ``torch.where(legal, o * o.exp(), 0)``: 0 * inf in the untaken branch's
  backward at the masked entries.

The tiered watches (default, defer) take the NaN gradient into the output for the deliberate -inf fill their replay
meets and stay silent. The per-module and op-level watches stop these healthy loops (strict xfails below): they
judge the output's gradient before the mask's backward zeroes it.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


class _Masked(nn.Module):
    """Logits with the illegal entries filled by -inf (the model's deliberate infinity)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~legal, float("-inf"))


def _legal(fully_masked_row: bool) -> list[torch.Tensor]:
    legal = [torch.ones(4, 5, dtype=torch.bool) for _ in range(4)]
    for mask in legal:
        mask[0, 3:] = False
    if fully_masked_row:
        legal[2][1, :] = False  # step 2: a row with no legal entry
    return legal


def _softmax_zero_rows(how: str) -> Scenario:
    torch.manual_seed(0)
    model = _Masked()
    xs = _batches(4, 6)
    legal = _legal(True)
    target = [torch.rand(4, 5) for _ in range(4)]

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        p = o.softmax(-1)
        valid = legal[step].any(-1, keepdim=True)
        if how == "where":
            p = torch.where(valid, p, 0.0)
        elif how == "nan_to_num":
            p = p.nan_to_num(0.0)
        else:
            p = p.masked_fill(~valid, 0.0)
        return (p * target[step]).sum()

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


def _where_untaken(form: str) -> Scenario:
    torch.manual_seed(0)
    model = _Masked()
    xs = _batches(4, 6)
    legal = _legal(False)

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        if form == "pow":
            return torch.where(legal[step], o ** 2, 0.0).mean()
        return torch.where(legal[step], o * o.exp(), 0.0).sum()

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


_STOPS = ("a healthy loop stopped: the NaN gradient into the masked entries of the model's output (the loss code's "
          "backward at its -inf) is judged where it enters the output, before the model's masked_fill backward "
          "zeroes it; no parameter gradient is ever non-finite")
_STOPPING = (("full", _STOPS), ("ops", _STOPS), ("ops-defer", _STOPS))

CASES = [
    Case("calm_s38_softmax_of_a_fully_masked_row_replaced_by_where", lambda: _softmax_zero_rows("where"), None,
         gaps=_STOPPING),
    Case("calm_s38_softmax_of_a_fully_masked_row_replaced_by_nan_to_num", lambda: _softmax_zero_rows("nan_to_num"),
         None, gaps=_STOPPING),
    Case("calm_s38_softmax_of_a_fully_masked_row_replaced_by_masked_fill",
         lambda: _softmax_zero_rows("masked_fill"), None, gaps=_STOPPING),
    Case("calm_s38_where_of_the_square_of_masked_logits", lambda: _where_untaken("pow"), None, gaps=_STOPPING),
    Case("calm_s38_where_of_masked_logits_times_their_exp", lambda: _where_untaken("xexp"), None, gaps=_STOPPING),
]
