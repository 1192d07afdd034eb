"""Masked models (session 40): more healthy fills whose NaN gradient the fill's own backward drops, and incidents
whose non-finite gradient reaches a weight, which every mode must still name.

Healthy (every loss and parameter gradient finite, unwatched; the NaN gradient into the model output sits only at
entries where that output holds the model's deliberate -inf):

- ``torch.where(legal, logits, -inf)`` (a where fill, not a masked_fill), a softmax over a fully masked row
  replaced by 0;
- logits masked then upcast (``.double()``): the fill is reached through the copy's backward;
- a masked mean over an empty set in the loss: a softmax-weighted mean ``(p * v).sum() / p.sum()`` of a row with no
  legal entry (0 / 0), replaced by 0;
- an additive ``-inf`` mask bias whose loss's backward stays finite (a log-softmax over rows that each keep a legal
  target): no non-finite gradient at all.

Incidents (``net.2.weight``'s gradient non-finite unwatched):

- the masked model's loss adds ``sqrt(where(legal, o - o.detach(), 1))``: an infinite gradient at the legal
  entries (sqrt at 0), beside the healthy NaN at the masked ones;
- an additive ``-inf`` bias (``logits + mask_bias``) under a softmax over a fully masked row replaced by 0: the
  add's backward hands the NaN on to the logits, where a fill's backward would drop it;
- a model output whose -inf is a ``log(0)``, not a fill: the forward names it.
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


def _legal(fully_masked_row: bool) -> list[torch.Tensor]:
    legal = [torch.ones(4, 5, dtype=torch.bool) for _ in range(4)]
    for mask in legal:
        mask[0, 3:] = False
    if fully_masked_row:
        legal[1][2, :] = False  # step 1: a row with no legal entry
    return legal


class _Filled(nn.Module):
    """Logits with the illegal entries set to -inf: by ``how`` ("where", "double", "bias" or "log0")."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        if self.how == "where":
            return torch.where(legal, logits, float("-inf"))
        if self.how == "double":
            return logits.masked_fill(~legal, float("-inf")).double()
        if self.how == "bias":
            mask_bias = torch.zeros(legal.shape).masked_fill(~legal, float("-inf"))
            return logits + mask_bias
        # "log0": the last logit's -inf is a log of an exact 0, not a fill
        zero = logits[:, 4:] - logits[:, 4:].detach()
        return torch.cat([logits[:, :4], zero.log()], -1).masked_fill(~legal, float("-inf"))  # producer: log0


def _softmax_rows(how: str) -> Scenario:
    """A softmax over each row, the rows with no legal entry replaced by 0."""
    torch.manual_seed(0)
    model = _Filled(how)
    xs = _batches(4, 6)
    legal = _legal(True)
    target = [torch.rand(4, 5) for _ in range(4)]

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        p = torch.where(legal[step].any(-1, keepdim=True), o.softmax(-1), 0.0)  # producer: bias
        return (p * target[step]).sum()

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


def _masked_mean() -> Scenario:
    """A softmax-weighted mean of values over the legal entries; a row with none is 0 / 0, replaced by 0."""
    torch.manual_seed(0)
    model = _Filled("where")
    xs = _batches(4, 6)
    legal = _legal(True)
    values = [torch.rand(4, 5) for _ in range(4)]

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        p = o.exp()
        mean = (p * values[step]).sum(-1) / p.sum(-1)
        return torch.where(legal[step].any(-1), mean, 0.0).sum()

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


def _additive_finite() -> Scenario:
    """An additive -inf mask bias under a log-softmax NLL whose targets are legal: every gradient finite."""
    torch.manual_seed(0)
    model = _Filled("bias")
    xs = _batches(4, 6)
    legal = _legal(False)
    ys = [torch.zeros(4, dtype=torch.long) for _ in range(4)]  # column 0 is legal in every row
    return _loop(model, lambda step: (xs[step], legal[step]),
                 lambda o, step: nn.functional.nll_loss(o.log_softmax(-1), ys[step]))


def _sqrt_at_legal() -> Scenario:
    torch.manual_seed(0)
    model = _Filled("where")
    xs = _batches(4, 6)
    legal = _legal(False)

    def loss(o: torch.Tensor, step: int) -> torch.Tensor:
        healthy = torch.where(legal[step], o ** 2, 0.0).mean()
        return healthy + torch.where(legal[step], o - o.detach(), 1.0).sqrt().sum()  # producer: sqrt

    return _loop(model, lambda step: (xs[step], legal[step]), loss)


def _log0() -> Scenario:
    torch.manual_seed(0)
    model = _Filled("log0")
    xs = _batches(4, 6)
    legal = _legal(False)
    return _loop(model, lambda step: (xs[step], legal[step]),
                 lambda o, step: torch.where(legal[step], o ** 2, 0.0).mean())


_LATE = ("a NaN gradient that an additive -inf mask bias's backward hands on to the logits is reported at the "
         "optimizer step, as net.0.weight's non-finite gradient (phase optimizer, no op): the step replay takes the "
         "gradient into the output for the bias's deliberate -inf (as before session 40: the fill rule does not "
         "apply to an add)")

CASES = [
    Case("calm_s40_where_fill_softmax_of_a_fully_masked_row_replaced_by_zero", lambda: _softmax_rows("where"), None),
    Case("calm_s40_masked_logits_upcast_softmax_of_a_fully_masked_row", lambda: _softmax_rows("double"), None),
    Case("calm_s40_masked_mean_over_an_empty_set_in_the_loss", _masked_mean, None),
    Case("calm_s40_additive_mask_bias_under_a_legal_target_nll", _additive_finite, None),
    Case("calm_s40_infinite_gradient_at_the_legal_entries_of_masked_logits", _sqrt_at_legal,
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="sqrt",
                cause="sqrt-domain")),
    Case("calm_s40_additive_mask_bias_softmax_of_a_fully_masked_row", lambda: _softmax_rows("bias"),
         Expect("backward", None, step=1, op="aten._softmax_backward_data.default", marker="bias",
                op_modes=("ops",)),
         note="full names no op of the loss code's backward (op_modes)", gaps=(("default", _LATE), ("defer", _LATE))),
    Case("calm_s40_model_output_minus_inf_from_log_of_zero", _log0,
         Expect("forward", "", step=0, op="aten.log.default", marker="log0", cause="log-domain")),
]
