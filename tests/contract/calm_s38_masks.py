"""Healthy rows (session 38, from the review of hunt-s38): a model that fills illegal logits with -inf, and loss code
whose backward is NaN only at those masked entries of the model output's gradient, which the model's
``masked_fill`` zeroes: every loss and every parameter gradient is finite, unwatched.

- a softmax over a fully masked row (0 / 0 there), the row then replaced by 0 (``torch.where``, ``nan_to_num``,
  ``masked_fill``): the softmax backward is NaN over that row;
- ``torch.where(legal, o ** 2, 0)`` and ``torch.where(legal, o * o.exp(), 0)``: 0 * inf in the untaken branch's
  backward at the masked entries;
- a ListNet ranking loss over an empty candidate list; attention pooling over an empty sample inside the model (the
  per-module watches judge the scorer's output gradient).

A non-finite gradient into a model output whose every non-finite entry sits where that output holds the -inf the
forward judged deliberate, made by a fill whose backward drops it (a masked_fill, a where), is no event in any mode
(backward/filled.py, session 40). Earlier attempts were taken back: reading the output's ``MaskedFillBackward0``
mask (60a2df14: a saved tensor that activation checkpointing packs is unpacked once, and the user's backward then
raised), and judging what the consuming node returns (masks-s39: a dead ReLU's backward drops an infinite gradient
into a model output, which is an event). The attention pooling row still stops in full and ops-defer (its output is
freed before its gradient is judged: strict xfails below).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

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


class _Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, items: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.net(items).squeeze(-1).masked_fill(~valid, float("-inf"))


def _listnet() -> Scenario:
    """ListNet over padded candidate lists; at step 2 one query's list came back empty (every item padding)."""
    torch.manual_seed(0)
    items = _batches(3, 6, 4)
    valid = [torch.ones(3, 6, dtype=torch.bool) for _ in range(4)]
    for mask in valid:
        mask[0, 4:] = False
    valid[2][2] = False
    relevance = [torch.rand(3, 6) for _ in range(4)]

    def listnet(scores: torch.Tensor, step: int) -> torch.Tensor:
        target = relevance[step].masked_fill(~valid[step], float("-inf")).softmax(-1)
        per_item = torch.where(valid[step], target * scores.log_softmax(-1), 0.0)
        has_items = valid[step].any(-1)
        return torch.where(has_items, -per_item.sum(-1), 0.0).sum() / has_items.sum()

    return _loop(_Ranker(), lambda step: (items[step], valid[step]), listnet)


class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.lin(x).squeeze(-1).masked_fill(~keep, float("-inf"))


class _Pool(nn.Module):
    def forward(self, scores: torch.Tensor, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        weights = torch.where(keep.any(-1, keepdim=True), scores.softmax(-1), 0.0)
        return (weights.unsqueeze(-1) * x).sum(1)


class _Pooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scorer, self.pool, self.head = _Scorer(), _Pool(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = torch.where(keep.unsqueeze(-1), x, 0.0)
        return self.head(self.pool(self.scorer(x, keep), x, keep))


def _pooling() -> Scenario:
    """Attention pooling over the items of each sample; at step 2 one sample has none."""
    torch.manual_seed(0)
    xs = _batches(3, 4, 8)
    keep = [torch.ones(3, 4, dtype=torch.bool) for _ in range(4)]
    for mask in keep:
        mask[0, 2:] = False
    keep[2][1] = False
    ys = [torch.randint(0, 3, (3,)) for _ in range(4)]
    return _loop(_Pooling(), lambda step: (xs[step], keep[step]), lambda out, step: F.cross_entropy(out, ys[step]))


class _CheckpointedScorer(_Masked):
    """:class:`_Masked`, its forward run under non-reentrant activation checkpointing."""

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, legal, use_reentrant=False)


def _checkpointed() -> Scenario:
    """``torch.where(legal, o ** 2, 0)`` over a scorer run under non-reentrant activation checkpointing."""
    torch.manual_seed(0)
    xs = _batches(4, 6)
    legal = _legal(False)
    return _loop(_CheckpointedScorer(), lambda step: (xs[step], legal[step]),
                 lambda o, step: torch.where(legal[step], o ** 2, 0.0).mean())


_FREED = ("a healthy loop stopped: the scorer's -inf-filled output is a temporary of the model's forward that nothing "
          "holds (the softmax after it saves its own output), so when the NaN gradient into it is judged (full: in "
          "backward; ops-defer: at the check) the output is gone, and which entries were filled cannot be told; the "
          "watch keeps no output alive to tell it (hot/checks/backward/filled.py)")

CASES = [
    Case("calm_s38_softmax_of_a_fully_masked_row_replaced_by_where", lambda: _softmax_zero_rows("where"), None),
    Case("calm_s38_softmax_of_a_fully_masked_row_replaced_by_nan_to_num", lambda: _softmax_zero_rows("nan_to_num"),
         None),
    Case("calm_s38_softmax_of_a_fully_masked_row_replaced_by_masked_fill",
         lambda: _softmax_zero_rows("masked_fill"), None),
    Case("calm_s38_where_of_the_square_of_masked_logits", lambda: _where_untaken("pow"), None),
    Case("calm_s38_where_of_masked_logits_times_their_exp", lambda: _where_untaken("xexp"), None),
    Case("calm_s38_where_of_the_square_of_checkpointed_masked_logits", _checkpointed, None),
    Case("calm_s38_listnet_over_an_empty_candidate_list", _listnet, None),
    Case("calm_s38_attention_pooling_over_an_empty_sample", _pooling, None,
         gaps=(("full", _FREED), ("ops-defer", _FREED))),
]
