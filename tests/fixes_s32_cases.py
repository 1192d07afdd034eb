"""The incidents of the fixes-s32 audit (tests/test_fixes_s32*.py): remedies that could come out finite and be wrong
or useless. ``build()`` gives ``(model, optimizer, run, data)`` as in fixes_s30_cases.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fixes_s30_cases import EPS, Built, fit, hand_step
from torch import nn


# ---------------------------------------------------------------- sqrt of a learned scale that reached exactly 0
class SqrtScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.sqrt(self.scale)  # producer (backward): d sqrt / d scale at 0 is inf


def sqrt_of_zero_param() -> Built:
    torch.manual_seed(0)
    return fit(SqrtScale(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)})


# ---------------------------------------------------------------- every sample NaN, a summed loss
def summed(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"]), data["y"], reduction="sum")


def all_samples_nan() -> Built:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    x[:, 1] = float("nan")
    return fit(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), {"x": x, "y": torch.randn(8, 1)}, summed)


def all_samples_nan_mean() -> Built:
    torch.manual_seed(0)
    x = torch.full((8, 4), float("nan"))
    return fit(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), {"x": x, "y": torch.randn(8, 1)})


# ---------------------------------------------------------------- a half model fed a NaN in the data
def half_model_nan_data() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).half()
    x = torch.randn(8, 4).half()
    x[2, 0] = float("nan")
    data = {"x": x, "y": torch.randn(8, 1).half()}

    def loss_of(m: nn.Module, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(m(d["x"]).float(), d["y"].float())

    return fit(model, data, loss_of, lr=0.01)


# ---------------------------------------------------------------- gradient accumulation: log(0) in micro-batch 3 of 4
class LogOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.lin(x)))  # producer: log(0) where the relu cut


def accumulated() -> Built:
    torch.manual_seed(0)
    model = LogOut()
    with torch.no_grad():
        model.lin.bias.fill_(5.0)
    xs = torch.randn(4, 2, 4)
    with torch.no_grad():
        xs[2] = -100.0 * model.lin.weight.sign()  # (micro-batch 2: every relu cuts)
    data = {"xs": xs, "y": torch.randn(4, 2, 1)}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for _ in range(2):
            opt.zero_grad()
            for i in range(4):
                (F.mse_loss(model(data["xs"][i]), data["y"][i]) / 4).backward()
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- a torch.compile'd loss with log(0)
def compiled_loss() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)

    @torch.compile(backend="eager")
    def loss_of(m: nn.Module, d: dict[str, torch.Tensor]) -> torch.Tensor:
        p = torch.softmax(m(d["x"]) * 1000, -1)
        return -(d["y"] * torch.log(p)).sum(-1).mean()

    return fit(model, {"x": torch.randn(8, 4), "y": torch.softmax(torch.randn(8, 3), -1)}, loss_of, lr=0.01)


# ---------------------------------------------------------------- BatchNorm before a log of a relu
class BnLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.log(torch.relu(self.bn(self.lin(x)))))  # producer: log(0), half the bn outputs < 0


def batchnorm_log() -> Built:
    torch.manual_seed(0)
    return fit(BnLog(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- a shared (tied) weight, div by a zero norm
class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight  # (tied)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(h / h.norm(dim=-1, keepdim=True))  # producer: 0 / 0 for the zero row


def tied_zero_row() -> Built:
    torch.manual_seed(0)
    model = Tied()
    with torch.no_grad():
        model.emb.weight[0] = 0.0
    return fit(model, {"x": torch.tensor([0, 1, 2, 3]), "y": torch.randn(4, 5)}, lr=0.01)


# ---------------------------------------------------------------- Adam eps=0 with a zero gradient at the first step
class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 0 * self.gate  # (gate's gradient is exactly 0)


def adam_eps_zero_first() -> Built:
    torch.manual_seed(0)
    model = Unused()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    data = {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(data["x"]), data["y"]).backward()
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- a long divergence: lr slightly too high
def long_divergence() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x = torch.randn(64, 8) * 3
    return fit(model, {"x": x, "y": torch.randn(64, 1)}, lr=0.115, steps=400)


# ---------------------------------------------------------------- padded query rows fully masked on purpose
class PaddedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        both = keep[:, :, None] & keep[:, None, :]  # (a padded query sees no key: its row is masked by intent)
        weights = torch.softmax(scores.masked_fill(~both, float("-inf")), -1)  # producer: 0 / 0 on padded rows
        return (weights @ x) * keep[:, :, None]


def padded_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"], data["keep"]), data["y"])


def padded_rows() -> Built:
    torch.manual_seed(0)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 3:] = False
    return fit(PaddedAttention(), {"x": torch.randn(2, 5, 4), "keep": keep, "y": torch.randn(2, 5, 4)}, padded_loss,
               lr=0.01)


def padded_rows_by_hand() -> tuple[float, bool]:
    """The mask fix by hand: the fully masked rows' weights made 0 (``nan_to_num``), as the padding meant."""
    model, opt, _run, data = padded_rows()

    def loss() -> torch.Tensor:
        x, keep = data["x"], data["keep"]
        scores = model.q(x) @ model.k(x).transpose(-1, -2)
        both = keep[:, :, None] & keep[:, None, :]
        weights = torch.softmax(scores.masked_fill(~both, float("-inf")), -1).nan_to_num(0.0)
        return F.mse_loss((weights @ x) * keep[:, :, None], data["y"])

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a temperature learned to exactly 0
class Temp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.t = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.t  # producer: x / 0


def zero_temperature() -> Built:
    torch.manual_seed(0)
    return fit(Temp(), {"x": torch.randn(8, 4), "y": torch.randn(8, 3)}, lr=0.01)


# ---------------------------------------------------------------- a Gaussian NLL whose learned variance reached 0
class LearnedVariance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.var = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 0.5 * torch.log(self.var)  # producer: log(0) of the learned variance


def zero_variance() -> Built:
    torch.manual_seed(0)
    return fit(LearnedVariance(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)


def zero_variance_by_hand(steps: int = 5) -> torch.Tensor:
    """The suggested edit (``torch.log(self.var.clamp_min(1.2e-07))``) by hand: var after ``steps`` steps."""
    model, opt, _run, data = zero_variance()
    assert isinstance(model, LearnedVariance)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model.lin(data["x"]) + 0.5 * torch.log(model.var.clamp_min(EPS)), data["y"]).backward()
        opt.step()
    return model.var.detach().clone()


# ---------------------------------------------------------------- dropout before log: the replay's RNG
class DropLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.log(self.drop(self.lin(x).abs())))  # producer: log(0) where dropout zeroed


def dropout_log() -> Built:
    torch.manual_seed(0)
    return fit(DropLog(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- pow of a negative base to a fractional exponent
class Gamma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) ** 0.5  # producer: a negative base (the user meant a signed power)


def negative_pow() -> Built:
    torch.manual_seed(0)
    return fit(Gamma(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=0.01)


# ---------------------------------------------------------------- an inf sample in a summed, masked loss
def inf_target_sum() -> Built:
    torch.manual_seed(0)
    y = torch.randn(8, 1)
    y[:] = float("inf")
    return fit(nn.Linear(4, 1), {"x": torch.randn(8, 4), "y": y}, summed, lr=0.01)


def sqrt_of_zero_param_by_hand(steps: int = 5) -> torch.Tensor:
    """The suggested edit (``torch.sqrt(self.scale.clamp_min(1.2e-07))``) by hand: scale after ``steps`` steps."""
    model, opt, _run, data = sqrt_of_zero_param()
    assert isinstance(model, SqrtScale)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model.lin(data["x"]) * torch.sqrt(model.scale.clamp_min(EPS)), data["y"]).backward()
        opt.step()
    return model.scale.detach().clone()


def zero_temperature_by_hand(steps: int = 2) -> torch.Tensor:
    """The suggested edit (``self.lin(x) / self.t.clamp_min(1.2e-07)``) by hand: t after ``steps`` steps."""
    model, opt, _run, data = zero_temperature()
    assert isinstance(model, Temp)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model.lin(data["x"]) / model.t.clamp_min(EPS), data["y"]).backward()
        opt.step()
    return model.t.detach().clone()


def batchnorm_log_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = batchnorm_log()
    assert isinstance(model, BnLog)
    return hand_step(model, opt, lambda: F.mse_loss(
        model.out(torch.log(torch.relu(model.bn(model.lin(data["x"]))).clamp_min(EPS))), data["y"]))


def tied_zero_row_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = tied_zero_row()
    assert isinstance(model, Tied)

    def loss() -> torch.Tensor:
        h = model.emb(data["x"])
        return F.mse_loss(model.head(h / h.norm(dim=-1, keepdim=True).clamp_min(EPS)), data["y"])

    return hand_step(model, opt, loss)


def half_model_nan_data_by_hand() -> tuple[float, bool]:
    """Sample 2 left out of the model call and the targets."""
    model, opt, _run, data = half_model_nan_data()
    keep = torch.arange(8) != 2
    return hand_step(model, opt, lambda: F.mse_loss(model(data["x"][keep]).float(), data["y"][keep].float()))


def negative_pow_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = negative_pow()
    assert isinstance(model, Gamma)
    return hand_step(model, opt, lambda: F.mse_loss(model.lin(data["x"]).clamp_min(EPS) ** 0.5, data["y"]))


def compiled_loss_by_hand() -> tuple[float, bool]:
    """The stable form: log_softmax."""
    model, opt, _run, data = compiled_loss()
    return hand_step(model, opt, lambda: -(data["y"] * torch.log_softmax(model(data["x"]) * 1000, -1)).sum(-1).mean())


def long_divergence_lowered(lr: float = 0.0115, steps: int = 400) -> bool:
    """The learning rate lowered for the whole run, by hand: whether every step's loss is finite."""
    model, _opt, _run, data = long_divergence()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(data["x"]), data["y"])
        if not torch.isfinite(loss):
            return False
        loss.backward()
        opt.step()
    return True


CASES = {
    "sqrt-of-zero-param": sqrt_of_zero_param, "all-samples-nan-sum": all_samples_nan,
    "all-samples-nan-mean": all_samples_nan_mean, "half-model-nan-data": half_model_nan_data,
    "accumulated": accumulated, "compiled-loss": compiled_loss, "batchnorm-log": batchnorm_log,
    "tied-zero-row": tied_zero_row, "adam-eps-zero-first": adam_eps_zero_first, "long-divergence": long_divergence,
    "padded-rows": padded_rows, "zero-temperature": zero_temperature, "zero-variance": zero_variance,
    "dropout-log": dropout_log, "negative-pow": negative_pow, "inf-target-sum": inf_target_sum,
}
