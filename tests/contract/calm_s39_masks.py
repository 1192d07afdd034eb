"""Masked models whose loss code's backward is NaN only where the model's own backward drops it (session 39), and
the same models where the NaN survives the model's backward to a parameter (real incidents, every mode).

Healthy: the gradient check waits for the node that consumes a non-finite output gradient (hot/checks/consumed.py)
and finds every gradient it returns finite:

- logits filled by ``torch.where(legal, x, -inf)``, a softmax over a fully masked row replaced by 0;
- logits filled by ``finfo.min`` (finite), ``torch.where(legal, o ** 3, 0)``: the cube overflows in the untaken
  branch and its backward is 0 * inf there, which the fill's backward zeroes;
- a model ending in ``F.relu``, the loss ``torch.where(o > 0, o.log(), 0)``: 0 * inf at the zeros, dropped by the
  ReLU's backward.

Incidents: the NaN is not dropped, and reaches the first layer's weight gradient:

- an additive ``-inf`` mask bias (``x + bias``): the addition's backward passes the NaN of
  ``torch.where(legal, o ** 2, 0)`` at the masked entries on to the model;
- the masked model's log-softmax, ``torch.where(legal, q ** 2, 0)``: the log-softmax backward spreads the NaN at
  the masked entries over the whole row, legal entries too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


def _legal(fully_masked_row: bool) -> list[torch.Tensor]:
    legal = [torch.ones(4, 5, dtype=torch.bool) for _ in range(4)]
    for mask in legal:
        mask[0, 3:] = False
    if fully_masked_row:
        legal[2][1, :] = False  # step 2: a row with no legal entry
    return legal


class _WhereFilled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return torch.where(legal, self.net(x), float("-inf"))


def _where_filled_softmax() -> Scenario:
    torch.manual_seed(0)
    xs, legal = _batches(4, 6), _legal(True)
    target = [torch.rand(4, 5) for _ in range(4)]

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        p = torch.where(legal[step].any(-1, keepdim=True), o.softmax(-1), 0.0)
        return (p * target[step]).sum()

    return _loop(_WhereFilled(), lambda step: (xs[step], legal[step]), loss)


class _Lowest(_WhereFilled):
    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~legal, torch.finfo(torch.float32).min)


def _lowest_cubed() -> Scenario:
    torch.manual_seed(0)
    xs, legal = _batches(4, 6), _legal(False)
    return _loop(_Lowest(), lambda step: (xs[step], legal[step]),
                 lambda o, step: torch.where(legal[step], o ** 3, 0.0).mean())


class _Rectified(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin(x))


def _log_of_relu() -> Scenario:
    torch.manual_seed(0)
    xs = _batches(4, 6)
    return _loop(_Rectified(), lambda step: (xs[step],),
                 lambda o, step: -torch.where(o > 0, o.log(), 0.0).mean())


class _Biased(_WhereFilled):
    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(legal.shape).masked_fill(~legal, float("-inf"))
        return self.net(x) + bias


def _additive_bias() -> Scenario:
    torch.manual_seed(0)
    xs, legal = _batches(4, 6), _legal(False)
    return _loop(_Biased(), lambda step: (xs[step], legal[step]),
                 lambda o, step: torch.where(legal[step], o ** 2, 0.0).mean())  # producer: bias square


class _Filled(_WhereFilled):
    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~legal, float("-inf"))


def _log_softmax_squared() -> Scenario:
    torch.manual_seed(0)
    xs, legal = _batches(4, 6), _legal(False)

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        q = o.log_softmax(-1)
        return torch.where(legal[step], q ** 2, 0.0).sum()  # producer: log-softmax square

    return _loop(_Filled(), lambda step: (xs[step], legal[step]), loss)


_DEFERRED = ("a healthy loop stopped: the deferred check reads the model output's NaN gradient after backward, where "
             "the node that consumed it (and dropped the NaN) is gone; it judges that gradient as the immediate "
             "mode would have without waiting for its consumer")
_DEFER_STOPS = (("defer", _DEFERRED), ("ops-defer", _DEFERRED))
_TAKEN_FOR_THE_FILL = ("the NaN gradient into the model's output is taken for the model's deliberate -inf, so the NaN "
                       "it spreads to net.0.weight is reported later, at the SGD step (phase optimizer), as in "
                       "hunt_s38_kl_between_masked_categorical_policies")
_NO_OP = "the per-module watch names backward at step 0 but no op: its replay of the loss code finds no origin"
_INCIDENT_GAPS = (("default", _TAKEN_FOR_THE_FILL), ("defer", _TAKEN_FOR_THE_FILL), ("full", _NO_OP))

CASES = [
    Case("calm_s39_where_filled_softmax_of_a_fully_masked_row_replaced", _where_filled_softmax, None,
         gaps=(("ops-defer", _DEFERRED),)),
    Case("calm_s39_cube_of_logits_filled_with_finfo_min", _lowest_cubed, None, gaps=_DEFER_STOPS),
    Case("calm_s39_log_of_a_relu_output_where_positive", _log_of_relu, None, gaps=_DEFER_STOPS),
    Case("hunt_s39_square_of_logits_masked_by_an_additive_inf_bias", _additive_bias,
         Expect("backward", None, step=0, op="aten.mul.Tensor", marker="bias square"), gaps=_INCIDENT_GAPS),
    Case("hunt_s39_square_of_the_log_softmax_of_masked_logits", _log_softmax_squared,
         Expect("backward", None, step=0, op="aten.mul.Tensor", marker="log-softmax square"), gaps=_INCIDENT_GAPS),
]
