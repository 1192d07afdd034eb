"""Incidents of fixes-s33 (tests/test_fixes_s33.py): remedies that could come out finite and be wrong or useless."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fixes_s30_cases import EPS, Built, fit
from torch import nn


# ---------------------------------------------------------------- float16 exp of 100: inf in float32 too
class HalfExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x) + 100)  # producer: exp(100) overflows float16, and float32 (3.4e38) too


def half_exp_still_inf() -> Built:
    torch.manual_seed(0)
    return fit(HalfExp(), {"x": torch.randn(8, 4).half(), "y": torch.randn(8, 1).half()}, lr=0.01)


# ---------------------------------------------------------------- a masked mean guarded later by torch.where
class GuardedMean(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 4), fixed

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        count = mask.sum(1, keepdim=True)
        count = count.clamp_min(EPS) if self.fixed else count  # (the suggested edit, by hand)
        mean = (h * mask).sum(1, keepdim=True) / count  # producer (backward): 0 / 0 where a row masks everything
        return torch.where(count > 0, mean, torch.zeros_like(mean))  # (the user's guard of the empty rows)


def guarded_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"], data["mask"]), data["y"])


def guarded_mean(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    mask = torch.ones(6, 4)
    mask[2] = 0.0
    return fit(GuardedMean(fixed), {"x": torch.randn(6, 4), "mask": mask, "y": torch.randn(6, 1)}, guarded_loss,
               lr=0.01, steps=steps)


# ---------------------------------------------------------------- a NaN in the data under Adam (lr cannot help)
def nan_input_adam(fixed: bool = False, steps: int = 4) -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)
    x[3, 1] = float("nan")
    data = {"x": x, "y": torch.randn(8, 1)}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> None:
        for step in range(steps):
            opt.zero_grad()
            batch, targets = (data["x"] if step >= 3 else data["x"].nan_to_num()), data["y"]
            if fixed:  # (the suggested edit, by hand)
                keep = torch.isfinite(batch).flatten(1).all(1)
                batch, targets = batch[keep], targets[keep]
            F.mse_loss(model(batch), targets).backward()
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- the bad sample is the only one of its class
def per_class_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    errors = (model(data["x"]) - data["y"]).pow(2).squeeze(1)
    losses = [errors[data["c"] == c].sum() / (data["c"] == c).sum() for c in range(3)]
    return torch.stack(losses).mean()


def only_positive_bad() -> Built:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    x[5, 0] = float("nan")  # (the only sample of class 2)
    c = torch.tensor([0, 0, 0, 1, 1, 2, 1, 0])
    return fit(nn.Linear(4, 1), {"x": x, "y": torch.randn(8, 1), "c": c}, per_class_loss, lr=0.01)


# ---------------------------------------------------------------- BatchNorm in eval mode, running_var 0, eps 0
class EvalBn(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 4), fixed
        self.bn = nn.BatchNorm1d(4, eps=0.0)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.lin(x)))
        return self.out(torch.log(h.clamp_min(EPS) if self.fixed else h))  # producer: log(0)


def eval_batchnorm_log(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    model = EvalBn(fixed)
    with torch.no_grad():
        model.bn.running_mean.fill_(0.1)
        model.bn.running_var.fill_(2.0)
    model.eval()
    return fit(model, {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- dropout before a log: the replay's RNG
class DropLog(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 8), fixed
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.lin(x)))
        return self.out(torch.sqrt(h.clamp_min(EPS) if self.fixed else h))  # producer (backward): sqrt'(0)


def dropout_sqrt(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(DropLog(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a NaN in Adam's second moment (a bad checkpoint)
def adam_state_nan() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}

    def run() -> None:
        for step in range(4):
            opt.zero_grad()
            F.mse_loss(model(data["x"]), data["y"]).backward()
            if step == 2:
                opt.state[model.weight]["exp_avg_sq"][0, 1] = float("nan")  # (a checkpoint loaded with a NaN)
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- log(1 + sum exp): a null class by design
class NullClass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x) * 60.0
        return torch.log(1 + torch.exp(z).sum(-1, keepdim=True)) - z[:, :1]  # producer: exp overflows


def null_class() -> Built:
    torch.manual_seed(0)
    return fit(NullClass(), {"x": torch.randn(8, 4) * 3, "y": torch.zeros(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- the std of a batch of one
class OneStd(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 4), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        std = h.std(0, correction=0) if self.fixed else h.std(0)  # producer: std of 1 sample (n - 1 = 0)
        return ((h - h.mean(0)) / (std + 1e-5)).sum(-1, keepdim=True)


def std_of_one(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(OneStd(fixed), {"x": torch.randn(1, 4), "y": torch.randn(1, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a helper's operand, the edit's scope
def entropy(p: torch.Tensor, fixed: bool = False) -> torch.Tensor:
    return -(p * (p.clamp_min(EPS) if fixed else p).log()).sum(-1)  # producer: 0 * log(0)


class Router(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 3), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return entropy(torch.relu(self.lin(x)).softmax(-1) * (x[:, :3] > 0), self.fixed).unsqueeze(-1)


def helper_scope(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(Router(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a bf16 model: float32 at the producer
class BfPow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * 1e30).pow(2)  # producer: 1e60 is inf in bfloat16 and in float32


def bf16_pow() -> Built:
    torch.manual_seed(0)
    return fit(BfPow(), {"x": torch.randn(8, 4).bfloat16(), "y": torch.randn(8, 1).bfloat16()}, lr=0.01)


# ---------------------------------------------------------------- float16 exp(12): finite in float32
class HalfExp12(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 1).half(), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h.float() if self.fixed else h  # (the suggested edit, by hand: the exp's line in float32)
        return torch.exp(h * 0.5 + 12).mean(-1, keepdim=True) / 1e5  # producer: exp(12) = 1.6e5 > 65504


def half_exp_12(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(HalfExp12(fixed), {"x": torch.randn(8, 4).half(), "y": torch.randn(8, 1).half()}, lr=0.01, steps=steps)


CASES = {
    "half-exp-still-inf": half_exp_still_inf,
    "guarded-mean": guarded_mean,
    "nan-input-adam": nan_input_adam,
    "only-positive-bad": only_positive_bad,
    "eval-batchnorm-log": eval_batchnorm_log,
    "dropout-sqrt": dropout_sqrt,
    "adam-state-nan": adam_state_nan,
    "null-class": null_class,
    "std-of-one": std_of_one,
    "helper-scope": helper_scope,
    "bf16-pow": bf16_pow,
    "half-exp-12": half_exp_12,
}


# ---------------------------------------------------------------- a square of a large negative: no domain to clamp
class NegSquare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * 0 - 1e30).pow(2) * 1e-30  # producer: 1e60 is inf in bfloat16; its operand is negative


def negative_square() -> Built:
    torch.manual_seed(0)
    return fit(NegSquare(), {"x": torch.randn(8, 4).bfloat16(), "y": torch.randn(8, 1).bfloat16()}, lr=0.01)


CASES["negative-square"] = negative_square
