"""Incidents of fixes-s34 (tests/test_fixes_s34.py): families the earlier audits did not try. Each builder takes
``fixed`` (the suggested edit written in by hand) and ``steps``, and gives ``(model, optimizer, run, data)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fixes_s30_cases import EPS, Built, fit
from torch import nn


# ---------------------------------------------------------------- float16 residual sum: each half finite, the sum not
class HalfResidual(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 4).half(), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 30000
        h = h.float() if self.fixed else h  # (the suggested edit, by hand: the sum's line in float32)
        return (h + h).mean(-1, keepdim=True) / 8e4  # producer: 40000 + 40000 > 65504 (a residual sum)


def half_residual(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(HalfResidual(fixed), {"x": torch.randn(8, 4).half(), "y": torch.randn(8, 1).half()}, lr=0.01,
               steps=steps)


# ---------------------------------------------------------------- a division by a learned scale that starts at 0
class LearnedScale(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 1), fixed
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.scale  # producer: h / 0


def learned_scale(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(LearnedScale(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- a learning rate of 10 (the quadratic diverges)
def lr_ten(fixed: bool = False, steps: int = 40) -> Built:
    torch.manual_seed(0)
    return fit(nn.Linear(4, 1), {"x": torch.randn(16, 4) * 3, "y": torch.randn(16, 1)}, lr=1.0 if fixed else 10.0,
               steps=steps)


# ---------------------------------------------------------------- a cube root of a negative (pow of 1/3)
class CubeRoot(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 4), nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.out(torch.pow(h.clamp_min(EPS) if self.fixed else h, 1 / 3))  # producer: (-0.5) ** (1/3)


def cube_root(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(CubeRoot(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- torch.where(h > 0, sqrt(h), 0): NaN in backward
class WhereSqrt(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 4), nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        root = torch.sqrt(h.clamp_min(EPS) if self.fixed else h)  # producer: sqrt(-0.3) (its branch not taken)
        return self.out(torch.where(h > 0, root, torch.zeros_like(h)))


def where_sqrt(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(WhereSqrt(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- log1p(-p) of a p that rounded to 1
class Survival(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.lin(x) * 40)
        return torch.log1p((-p).clamp_min(-1 + EPS) if self.fixed else -p)  # producer: log1p(-1) = -inf


def log1p_of_minus_one(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(Survival(fixed), {"x": torch.randn(8, 4) * 3, "y": torch.zeros(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- the same, a float16 model and the method form
class HalfSurvival(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed = nn.Linear(4, 2).half(), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = -torch.sigmoid(self.lin(x) * 30)
        low = -1 + torch.finfo(torch.float16).eps
        return (q.clamp_min(low) if self.fixed else q).log1p().sum(-1, keepdim=True)  # producer: log1p(-1) = -inf


def log1p_half_method(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(HalfSurvival(fixed), {"x": torch.randn(8, 4).half() * 3, "y": torch.zeros(8, 1).half()}, lr=0.01,
               steps=steps)


# ---------------------------------------------------------------- lgamma of an exact 0 (a ReLU's output)
class LogGamma(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 4), nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.lin(x))
        return self.out(torch.lgamma(h.clamp_min(EPS) if self.fixed else h))  # producer: lgamma(0) = inf


def lgamma_of_zero(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(LogGamma(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- log(expm1(h)): the inverse softplus of an exact 0
class InvSoftplus(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 4), nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.expm1(torch.relu(self.lin(x)))
        return self.out(torch.log(e.clamp_min(EPS) if self.fixed else e))  # producer: log(expm1(0)) = log(0)


def inverse_softplus(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(InvSoftplus(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- cosh of a large value: inf in float32, no remedy
class Cosh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cosh(self.lin(x) * 0 + 100) * 1e-40  # producer: cosh(100) = 1.3e43 > 3.4e38


def cosh_overflow() -> Built:
    torch.manual_seed(0)
    return fit(Cosh(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- a product of 64 factors of 10: no remedy
class Product(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.prod(self.lin(x) * 0 + 10, -1, keepdim=True) * 1e-60  # producer: 1e64 > 3.4e38


def prod_overflow() -> Built:
    torch.manual_seed(0)
    return fit(Product(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- a VAE's KL: exp(logvar) of a logvar of 100
class Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu, self.logvar = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.mu(x), self.logvar(x) * 0 + 100
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp())  # producer: exp(100) = 2.7e43 > 3.4e38
        return kl.sum(-1, keepdim=True)


def vae_kl() -> Built:
    torch.manual_seed(0)
    return fit(Vae(), {"x": torch.randn(8, 4), "y": torch.zeros(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- logit of a probability clamped to [0, 1]
class Logit(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.out, self.fixed = nn.Linear(4, 4), nn.Linear(4, 1), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.lin(x).clamp(0, 1)
        return self.out(torch.logit(p.clamp(EPS, 1 - EPS) if self.fixed else p))  # producer: logit(0) = -inf


def logit_of_edge(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(Logit(fixed), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01, steps=steps)


# ---------------------------------------------------------------- Adam at lr 10 (divergence under another optimizer)
def adam_lr_ten(fixed: bool = False, steps: int = 60) -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    data = {"x": torch.randn(16, 4), "y": torch.randn(16, 1)}
    opt = torch.optim.Adam(model.parameters(), lr=1.0 if fixed else 10.0)

    def run() -> None:
        for _ in range(steps):
            opt.zero_grad()
            torch.exp(F.mse_loss(model(data["x"]), data["y"])).backward()
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- float16 exp(12) whose scale is a Python number
class HalfScaledExp(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.lin, self.fixed, self.scale = nn.Linear(4, 2).half(), fixed, 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, scale, shift = self.lin(x), self.scale, 12.0
        h = h.float() if self.fixed else h  # (the suggested edit, by hand: the exp's line in float32)
        return torch.exp(torch.add(torch.mul(h, scale), shift)).mean(-1, keepdim=True) / 1e5  # producer: exp(12)


def half_scaled_exp(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(HalfScaledExp(fixed), {"x": torch.randn(8, 4).half(), "y": torch.randn(8, 1).half()}, lr=0.01,
               steps=steps)


# ---------------------------------------------------------------- the same with operators, the number first
class HalfScaledExpOps(HalfScaledExp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, scale, shift = self.lin(x), self.scale, 12.0
        h = h.float() if self.fixed else h  # (the suggested edit, by hand: the exp's line in float32)
        return (scale * h + shift).exp().sum(-1, keepdim=True) / 2e5  # producer: exp(12) > 65504


def half_scaled_exp_ops(fixed: bool = False, steps: int = 3) -> Built:
    torch.manual_seed(0)
    return fit(HalfScaledExpOps(fixed), {"x": torch.randn(8, 4).half(), "y": torch.randn(8, 1).half()}, lr=0.01,
               steps=steps)


CASES = {
    "half-residual": half_residual,
    "learned-scale": learned_scale,
    "lr-ten": lr_ten,
    "cube-root": cube_root,
    "where-sqrt": where_sqrt,
    "log1p-of-minus-one": log1p_of_minus_one,
    "log1p-half-method": log1p_half_method,
    "lgamma-of-zero": lgamma_of_zero,
    "inverse-softplus": inverse_softplus,
    "cosh-overflow": cosh_overflow,
    "prod-overflow": prod_overflow,
    "vae-kl": vae_kl,
    "logit-of-edge": logit_of_edge,
    "adam-lr-ten": adam_lr_ten,
    "half-scaled-exp": half_scaled_exp,
    "half-scaled-exp-ops": half_scaled_exp_ops,
}
