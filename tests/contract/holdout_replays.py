"""Held-out incidents that test the replay itself: torch's own modules, random draws, checkpointing, bf16.

A backward inf inside a torch module (``nn.LPPool1d``'s root of a zero window)
that torch itself discards (silent); a stochastic depth written by hand that divides by the fraction of samples its
random draw kept (NaN only for an unlucky draw: the replay must draw the
same); a block under ``torch.utils.checkpoint`` whose backward divides by
zero; and a softmax in bfloat16 whose tiny probabilities round to 0 before a log.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from contract import Case, Expect, Scenario
from contract.holdout_healthy import sgd_steps


def _lppool_of_a_silent_window() -> Scenario:
    """LPPool1d(2) is sqrt(sum x²) per window: at a window of exact zeros (a zero-padded stretch of the signal,
    through a Conv1d without bias) its pow has an infinite derivative, which torch's relu(abs(.)) inside
    lp_pool then discards: a healthy run, silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 2, 3, padding=1, bias=False), nn.LPPool1d(2, 2), nn.Flatten(),
                          nn.Linear(16, 1))
    x = torch.randn(4, 1, 16)
    x[1, :, 8:] = 0.0  # a clip shorter than the window, padded with zeros
    y = torch.randn(4, 1)
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y), steps=1)


class DropPath(nn.Module):
    """Stochastic depth that rescales by the fraction of samples its draw actually kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1) > 0.6).float()
        return x * keep / keep.mean()  # producer: drop path


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.drop = nn.Linear(4, 4), DropPath()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.body(x))


def _drop_path_of_an_unlucky_draw() -> Scenario:
    """Batches of 2: some step's draw keeps neither sample, and keep.mean() is 0."""
    torch.manual_seed(0)
    model = nn.Sequential(Residual(), nn.Linear(4, 1))
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y), steps=12)


class NormBlock(nn.Module):
    """Normalises each row by its L2 norm, written by hand; run under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h / h.pow(2).sum(-1, keepdim=True).sqrt().clamp_min(1e-6)  # producer: checkpointed norm


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = NormBlock(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def _checkpointed_norm_backward() -> Scenario:
    """A zero row: the clamp keeps the forward finite, but sqrt's derivative at 0 is inf (inf·0 in the chain)."""
    torch.manual_seed(0)
    model = Checkpointed()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    x[3] = 0.0
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y), steps=1)


class Bf16Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.lin(x).softmax(-1)
        return torch.log(probs)  # producer: bf16 log


def _bf16_log_of_softmax() -> Scenario:
    """In bfloat16, probabilities below 1e-38-ish round to 0: log(softmax) instead of log_softmax."""
    torch.manual_seed(0)
    model = Bf16Classifier().bfloat16()
    with torch.no_grad():
        model.lin.weight.mul_(60.0)
    x = torch.randn(4, 8).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    y = torch.tensor([1, 2, 3, 4])

    def run() -> None:
        loss = F.nll_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


CASES: list[Case] = [
    Case("holdout_healthy_lppool_of_a_silent_window", _lppool_of_a_silent_window, None, benign=0),
    Case("holdout_drop_path_of_an_unlucky_draw", _drop_path_of_an_unlucky_draw,
         Expect("forward", "0.drop", "DropPath", step=5, op="aten.div.Tensor", marker="drop path",
                cause="division-by-zero")),
    Case("holdout_checkpointed_norm_backward", _checkpointed_norm_backward,
         Expect("backward", "block", "NormBlock", op="aten.div.Tensor", marker="checkpointed norm",
                cause="sqrt-domain")),
    Case("holdout_bf16_log_of_softmax", _bf16_log_of_softmax,
         Expect("forward", "", "Bf16Classifier", op="aten.log.default", marker="bf16 log", cause="log-domain")),
]
