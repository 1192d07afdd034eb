"""Incidents of fixes-s35 (tests/test_fixes_s35.py): divisions by a spread (a std, a variance, a norm) that is 0, told
from a count of nothing, each with the suggested edit written in by hand (``fixed``). Each builder takes ``fixed`` and
``steps`` and gives ``(model, optimizer, run, data)``; every zero is exact by construction (a zero-initialised layer,
an input of zeros, a batch of equal values), on any kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fixes_s30_cases import EPS, Built, fit
from torch import nn


# ---------------------------------------------------------------- a Sharpe ratio over a week of no returns
class SharpeHead(nn.Module):
    """Long-short weights of 4 assets; the output is the negative Sharpe ratio of the batch's daily returns."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(6, 4), fixed

    def forward(self, x: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        daily = (torch.tanh(self.lin(x)) * returns).sum(-1)
        if self.fixed:  # (the suggested edit, by hand: eps added to the std)
            return -daily.mean() / (daily.std() + EPS)
        return -daily.mean() / daily.std()  # producer: a holiday week: every return 0, std 0


def _sharpe_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"], data["r"]), data["y"])


def sharpe_holiday(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    data = {"x": torch.randn(5, 6), "r": torch.zeros(5, 4), "y": torch.tensor(-1.0)}
    return fit(SharpeHead(fixed), data, _sharpe_loss, lr=0.1, steps=steps)


# ---------------------------------------------------------------- a z-score of predictions from a zero-initialised head
class ZScored(nn.Module):
    """Predictions standardised over the batch (a ranking head); the last layer starts at zeros, so every prediction
    is its bias, 0, and their std is exactly 0."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.body, self.head, self.fixed = nn.Linear(4, 8), nn.Linear(8, 1), fixed
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.head(torch.tanh(self.body(x)))
        if self.fixed:
            return (p - p.mean()) / (p.std() + EPS)
        return (p - p.mean()) / p.std()  # producer: (0 - 0) / 0


def zscore_zero_head(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(ZScored(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a hand-written RMSNorm without eps, of a padding row
class HandRMS(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 8, bias=False), nn.Linear(8, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.fixed:  # (what the verdict leads to: the eps inside the sqrt)
            return self.out(h / h.pow(2).mean(-1, keepdim=True).add(EPS).sqrt())
        return self.out(h / h.pow(2).mean(-1, keepdim=True).sqrt())  # producer: a padding row of zeros: 0 / 0


def hand_rms_padding(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    x[4:] = 0.0  # (two padding rows)
    return fit(HandRMS(fixed), {"x": x, "y": torch.randn(6, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- the Sharpe ratio with sqrt(var) written out
class RootVarSharpe(SharpeHead):
    def forward(self, x: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        daily = (torch.tanh(self.lin(x)) * returns).sum(-1)
        if self.fixed:
            return -daily.mean() / torch.sqrt(daily.var() + EPS)
        return -daily.mean() / torch.sqrt(daily.var())  # producer: sqrt(var) of no returns: 0 / 0


def sharpe_root_var(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    data = {"x": torch.randn(5, 6), "r": torch.zeros(5, 4), "y": torch.tensor(-1.0)}
    return fit(RootVarSharpe(fixed), data, _sharpe_loss, lr=0.1, steps=steps)


# ---------------------------------------------------------------- unit vectors of an embedding whose ReLUs all died
class DeadUnit(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 6), nn.Linear(6, 1), fixed
        with torch.no_grad():
            self.lin.bias.fill_(-100.0)  # (every pre-activation below 0 for inputs this small)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        norm = h.norm(dim=-1, keepdim=True)
        if self.fixed:
            return self.out(h / (norm + EPS))
        return self.out(h / norm)  # producer: every ReLU dead: 0 / 0


def dead_unit(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(DeadUnit(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a masked mean whose mask is empty: a count, not a std
class MaskedPool(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).squeeze(-1) * mask
        count = mask.sum().clamp_min(1) if self.fixed else mask.sum()
        return (h.sum() / count).reshape(1)  # producer: a sum over nothing / a count of nothing


def _pool_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"], data["mask"]), data["y"])


def empty_mask_pool(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    data = {"x": torch.randn(6, 4), "mask": torch.zeros(6), "y": torch.randn(1)}
    return fit(MaskedPool(fixed), data, _pool_loss, lr=0.01, steps=steps)


# ---------------------------------------------------------------- per-row standardisation with one constant row
class RowStandardise(nn.Module):
    """Each row of features standardised before the head; a sensor row stuck at one value has a std of exactly 0
    (8 equal values: their mean is exact), the other rows do not: the divisor is 0 in one row of six."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.out, self.fixed = nn.Linear(8, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = x.std(-1, keepdim=True)
        if self.fixed:
            return self.out((x - x.mean(-1, keepdim=True)) / std.clamp_min(EPS))
        return self.out((x - x.mean(-1, keepdim=True)) / std)  # producer: the stuck row: 0 / 0


def stuck_row(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    x[2] = 0.5
    return fit(RowStandardise(fixed), {"x": x, "y": torch.randn(6, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- an RMS scale by rsqrt, of a padding row
class RsqrtScale(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 8, bias=False), nn.Linear(8, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        ms = h.pow(2).mean(-1, keepdim=True)
        if self.fixed:
            return self.out(h * torch.rsqrt(ms.clamp_min(EPS)))
        return self.out(h * torch.rsqrt(ms))  # producer: rsqrt(0) of the padding row: 0 * inf


def rsqrt_padding(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    x[5] = 0.0
    return fit(RsqrtScale(fixed), {"x": x, "y": torch.randn(6, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a division by a variance of one repeated sample
class VarianceScaled(nn.Module):
    """Scores divided by their variance over the batch (an inverse-variance weight); a batch of one sample repeated
    has every score equal, their variance exactly 0."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 2), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.lin(x)
        var = s.var(0, keepdim=True)
        if self.fixed:
            return (s - s.mean(0, keepdim=True)) / (var + EPS)
        return (s - s.mean(0, keepdim=True)) / var  # producer: (0 - 0) / 0


def repeated_sample(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    x = torch.randn(1, 4).expand(4, 4).clone()
    return fit(VarianceScaled(fixed), {"x": x, "y": torch.randn(4, 2)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- pairwise distances of a batch, the diagonal's sqrt(0)
class PairSpread(nn.Module):
    """The mean pairwise distance of the batch's embeddings (a spread regulariser): the diagonal is each point's
    distance to itself, sqrt(0), finite forward and 0 / 0 in sqrt's backward."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 3), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.lin(x)
        squared = (e[:, None] - e[None]).pow(2).sum(-1)
        if self.fixed:
            return torch.sqrt(squared.clamp_min(EPS)).mean().reshape(1)
        return torch.sqrt(squared).mean().reshape(1)  # producer: sqrt(0) on the diagonal: backward 0 / 0


def pair_spread(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(PairSpread(fixed), {"x": torch.randn(5, 4), "y": torch.tensor([3.0])}, lr=0.01, steps=steps)


CASES = {
    "sharpe-holiday": sharpe_holiday,
    "zscore-zero-head": zscore_zero_head,
    "hand-rms-padding": hand_rms_padding,
    "sharpe-root-var": sharpe_root_var,
    "dead-unit": dead_unit,
    "empty-mask-pool": empty_mask_pool,
    "stuck-row": stuck_row,
    "rsqrt-padding": rsqrt_padding,
    "repeated-sample": repeated_sample,
    "pair-spread": pair_spread,
}
#: The loss each incident's loop computes (the by-hand check runs the same).
LOSSES = {"sharpe-holiday": _sharpe_loss, "sharpe-root-var": _sharpe_loss, "empty-mask-pool": _pool_loss}
