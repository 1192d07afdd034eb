"""The incidents of the fixes-s31 audit (tests/test_fixes_s31*.py): each a small training loop that goes non-finite
for one cause not audited in fixes-s29 or fixes-s30, with the remedy a person would apply done by hand on a fresh
copy of the same model and batch.

``build()`` gives ``(model, optimizer, run, data)``; ``by_hand()`` gives ``(loss, finite)`` of the failing step with
the remedy applied by hand (None where no remedy a person would apply fits the trial's kinds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from fixes_s30_cases import EPS, Built, Incident, fit, hand_step
from torch import nn


# ---------------------------------------------------------------- acos of a cosine that rounds above 1
class Angle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = self.lin(a)
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        return torch.acos(cos)  # producer: a cosine of parallel vectors that rounded to 1 + 1e-7


def angle_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(data["a"], data["b"]).mean()


def _parallel() -> tuple[Angle, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Angle()
    a = torch.randn(8, 4)
    with torch.no_grad():
        b = model.lin(a) * 3.7  # (every b parallel to its lin(a): cosines 1 up to rounding)
        cos = (model.lin(a) * b).sum(-1) / (model.lin(a).norm(dim=-1) * b.norm(dim=-1))
    assert bool((cos > 1).any()), cos
    return model, {"a": a, "b": b}


def acos_above_one() -> Built:
    model, data = _parallel()
    return fit(model, data, angle_loss, lr=1e-3)


def acos_above_one_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = acos_above_one()

    def loss() -> torch.Tensor:
        a, b = model.lin(data["a"]), data["b"]
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        return torch.acos(cos.clamp(-1 + EPS, 1 - EPS)).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a softmax by hand: exp / sum(exp) overflows
class HandSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.lin(x))  # producer: exp of a logit above 88
        return e / e.sum(-1, keepdim=True)


def soft_ce(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"]), data["y"])


def softmax_by_hand() -> Built:
    torch.manual_seed(0)
    model = HandSoftmax()
    with torch.no_grad():
        model.lin.weight.mul_(100)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.softmax(torch.randn(8, 5), -1)}, soft_ce, lr=1e-3)


def softmax_by_hand_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = softmax_by_hand()
    return hand_step(model, opt, lambda: F.mse_loss(torch.softmax(model.lin(data["x"]), -1), data["y"]))


# ---------------------------------------------------------------- a BCE by hand: log(1 - sigmoid) of a saturated logit
def bce_by_hand(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    p = torch.sigmoid(model(data["x"]))
    y = data["y"]
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # producer: log(0) where p rounded to 1


def saturated_bce() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.mul_(100)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.randint(0, 2, (8, 1)).float()}, bce_by_hand, lr=1e-4)


def saturated_bce_by_hand() -> tuple[float, bool]:
    """The eps at the producer (the trial's remedy): ``log((1 - p).clamp_min(eps))`` and the same for ``log(p)``."""
    model, opt, _run, data = saturated_bce()

    def loss() -> torch.Tensor:
        p = torch.sigmoid(model(data["x"]))
        y = data["y"]
        return -(y * torch.log(p.clamp_min(EPS)) + (1 - y) * torch.log((1 - p).clamp_min(EPS))).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- an entropy bonus -(p log p) with p = 0
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x), -1)


def entropy_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    p = model(data["x"])
    entropy = -(p * torch.log(p)).sum(-1)  # producer: 0 * log(0) = 0 * -inf where a probability underflowed
    return F.mse_loss(p, data["y"]) - 0.01 * entropy.mean()


def entropy_of_zero() -> Built:
    torch.manual_seed(0)
    model = Policy()
    with torch.no_grad():
        model.lin.weight.mul_(200)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.softmax(torch.randn(8, 6), -1)}, entropy_loss, lr=1e-3)


def entropy_of_zero_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = entropy_of_zero()

    def loss() -> torch.Tensor:
        p = model(data["x"])
        entropy = -(p * torch.log(p.clamp_min(EPS))).sum(-1)
        return F.mse_loss(p, data["y"]) - 0.01 * entropy.mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a fully masked attention row
class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~keep[:, None, :], float("-inf"))
        return torch.softmax(scores, -1) @ v  # producer: softmax of a row of -inf (a padding-only sequence)


def attention_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"], data["keep"]), data["y"])


def masked_row() -> Built:
    torch.manual_seed(0)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1] = False  # (the second sequence is all padding)
    keep[2, 3:] = False
    return fit(MaskedAttention(), {"x": torch.randn(3, 5, 8), "keep": keep, "y": torch.randn(3, 5, 8)},
               attention_loss)


def masked_row_by_hand() -> tuple[float, bool]:
    """The mask fix by hand: the fully masked row's probabilities set to 0 (``nan_to_num`` after the softmax)."""
    model, opt, _run, data = masked_row()

    def loss() -> torch.Tensor:
        q, k, v = model.qkv(data["x"]).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~data["keep"][:, None, :], float("-inf"))
        return F.mse_loss(torch.softmax(scores, -1).nan_to_num(0.0) @ v, data["y"])

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a NaN feature in one sample before a BatchNorm
def nan_sample_batchnorm() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(8, 4)
    x[5, 2] = float("nan")  # (one sample's feature; the BatchNorm's mean spreads it to every sample)
    return fit(model, {"x": x, "y": torch.randn(8, 1)}, steps=2)


def nan_sample_batchnorm_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = nan_sample_batchnorm()
    keep = torch.isfinite(data["x"]).all(-1)
    return hand_step(model, opt, lambda: F.mse_loss(model(data["x"][keep]), data["y"][keep]))


# ---------------------------------------------------------------- a NaN label read by a loss the model call feeds
def nan_label() -> Built:
    torch.manual_seed(0)
    y = torch.randn(8, 1)
    y[2] = float("nan")
    return fit(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), {"x": torch.randn(8, 4), "y": y})


def nan_label_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = nan_label()
    keep = torch.isfinite(data["y"]).all(-1)
    return hand_step(model, opt, lambda: F.mse_loss(model(data["x"][keep]), data["y"][keep]))


# ---------------------------------------------------------------- log of a probability from a half model
class HalfClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(x), -1)


def half_nll(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    p = model(data["x"]).gather(1, data["y"][:, None])
    return -torch.log(p).mean()  # producer: log(0) of a float16 probability that underflowed (float32 has 1e-12)


def half_probability() -> Built:
    torch.manual_seed(0)
    model = HalfClassifier()
    with torch.no_grad():
        model.lin.weight.copy_(torch.tensor([[9.0, 0, 0, 0], [0, 0, 0, 0], [-9.0, 0, 0, 0]]))
        model.lin.bias.zero_()
    model.half()
    x = torch.zeros(8, 4)
    x[:, 0] = 3.0  # (logits 27, 0, -27: class 2's probability 3.5e-24, 0 in float16, 1.8e-12 in float32... )
    return fit(model, {"x": x.half(), "y": torch.tensor([0, 0, 1, 0, 2, 0, 0, 1])}, half_nll, lr=1e-3)


def half_probability_by_hand() -> tuple[float, bool]:
    """The eps at the producer (the trial's remedy): ``log(p.clamp_min(eps))`` in float16, eps its own."""
    model, opt, _run, data = half_probability()
    return hand_step(model, opt, lambda: -torch.log(model(data["x"]).gather(1, data["y"][:, None]).clamp_min(
        torch.finfo(torch.float16).eps)).mean())


# ---------------------------------------------------------------- a warmup whose peak is 1e3 by a typo
def warmup_typo() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(step + 1, 3) * 1e6 / 3)  # (1e3 for 1e-3)
    x, y = torch.randn(16, 4), torch.randn(16, 1) * 10

    def run() -> None:
        for _ in range(30):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            schedule.step()

    return model, opt, run, {"x": x, "y": y}


# ---------------------------------------------------------------- Adam eps=0 on a head used from step 2
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.aux = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (0.0 * self.aux(h) if aux else 0.0)  # (aux's gradient: exactly 0 once it is used)


def adam_zero_grad() -> Built:
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def run() -> None:
        for step in range(4):
            opt.zero_grad()
            F.mse_loss(model(x, step >= 2), y).backward()
            opt.step()  # producer at step 2: aux's 0 / (sqrt(0) + 0)

    return model, opt, run, {"x": x, "y": y}


# ---------------------------------------------------------------- a Gumbel-softmax whose uniform noise holds a 0
class Gumbel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g = -torch.log(-torch.log(u))  # producer: log(-log(1)) = log(0) = -inf, a Gumbel of +inf
        return torch.softmax(self.lin(x) + g, -1)


def gumbel_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"], data["u"]), data["y"])


def gumbel_zero() -> Built:
    torch.manual_seed(0)
    u = torch.rand(8, 3)
    u[4, 1] = 1.0  # (noise drawn as 1 - torch.rand(...): torch.rand can return exactly 0)
    return fit(Gumbel(), {"x": torch.randn(8, 4), "u": u, "y": torch.softmax(torch.randn(8, 3), -1)}, gumbel_loss)


def gumbel_zero_by_hand() -> tuple[float, bool]:
    """The eps at the producer's line (the trial's remedy): each log's operand clamped, as the edit writes."""
    model, opt, _run, data = gumbel_zero()

    def loss() -> torch.Tensor:
        g = -torch.log((-torch.log(data["u"].clamp_min(EPS))).clamp_min(EPS))
        return F.mse_loss(torch.softmax(model.lin(data["x"]) + g, -1), data["y"])

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a layer norm by hand: rsqrt of a zero variance
class HandLayerNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return self.out(centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True)))  # producer: rsqrt(0) = inf


def rsqrt_zero_var() -> Built:
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    x[1] = 0.5  # (a constant row: its variance is exactly 0)
    return fit(HandLayerNorm(), {"x": x, "y": torch.randn(8, 1)})


def rsqrt_zero_var_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = rsqrt_zero_var()
    x = data["x"]

    def loss() -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return F.mse_loss(model.out(centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True).clamp_min(EPS))),
                          data["y"])

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- atanh of a tanh that rounded to 1
class Squash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.atanh(torch.tanh(self.lin(x)))  # producer: atanh(1) = inf where tanh saturated


def atanh_of_one() -> Built:
    torch.manual_seed(0)
    model = Squash()
    with torch.no_grad():
        model.lin.weight.mul_(20)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.randn(8, 2)}, lr=1e-4)


def atanh_of_one_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = atanh_of_one()
    return hand_step(model, opt, lambda: F.mse_loss(
        torch.atanh(torch.tanh(model.lin(data["x"])).clamp(-1 + EPS, 1 - EPS)), data["y"]))


# ---------------------------------------------------------------- a KL by hand with q = 0
def kl_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    q = torch.softmax(model(data["x"]), -1)
    p = data["p"]
    return (p * torch.log(p / q)).sum(-1).mean()  # producer: p / 0 = inf where q underflowed


def kl_of_zero() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    with torch.no_grad():
        model.weight.mul_(200)
    return fit(model, {"x": torch.randn(8, 4), "p": torch.softmax(torch.randn(8, 5), -1)}, kl_loss, lr=1e-3)


def kl_of_zero_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = kl_of_zero()

    def loss() -> torch.Tensor:
        q = torch.softmax(model(data["x"]), -1)
        p = data["p"]
        return (p * torch.log(p / q.clamp_min(EPS))).sum(-1).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a softplus by hand in the loss code: log(1 + exp(-z))
def logistic_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    z = model(data["x"]) * data["sign"]
    return torch.log(1 + torch.exp(-z)).mean()  # producer: exp(-z) overflows for a confidently wrong logit


def logistic_overflow() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.mul_(100)
    return fit(model, {"x": torch.randn(8, 4), "sign": torch.randint(0, 2, (8, 1)).float() * 2 - 1},
               logistic_loss, lr=1e-4)


def logistic_overflow_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = logistic_overflow()
    return hand_step(model, opt, lambda: F.softplus(-model(data["x"]) * data["sign"]).mean())


# ---------------------------------------------------------------- a normalisation by the batch's max of a zero batch
class MaxScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x / x.abs().amax())  # producer: 0 / 0, the batch is all zeros (a padding batch)


def zero_batch_max() -> Built:
    torch.manual_seed(0)
    return fit(MaxScale(), {"x": torch.zeros(8, 4), "y": torch.randn(8, 1)})


def zero_batch_max_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = zero_batch_max()
    x = data["x"]
    return hand_step(model, opt, lambda: F.mse_loss(model.lin(x / x.abs().amax().clamp_min(EPS)), data["y"]))


INCIDENTS: dict[str, Incident] = {
    "acos-above-one": Incident(acos_above_one, acos_above_one_by_hand, "eps", 4.8828125e-4),
    "softmax-by-hand": Incident(softmax_by_hand, softmax_by_hand_by_hand, "stable", 0.0),
    "saturated-bce": Incident(saturated_bce, saturated_bce_by_hand, "eps", 0.0),
    "entropy-of-zero": Incident(entropy_of_zero, entropy_of_zero_by_hand, "eps", 0.0),
    "masked-row": Incident(masked_row, masked_row_by_hand, "mask", 0.0),
    "nan-sample-batchnorm": Incident(nan_sample_batchnorm, nan_sample_batchnorm_by_hand, "skip-batch", None),
    "nan-label": Incident(nan_label, nan_label_by_hand, None, None),
    "half-probability": Incident(half_probability, half_probability_by_hand, "eps", 0.0),
    "warmup-typo": Incident(warmup_typo, None, None, None),
    "adam-zero-grad": Incident(adam_zero_grad, None, "eps", None),
    "gumbel-zero": Incident(gumbel_zero, gumbel_zero_by_hand, "eps", 0.0),
    "rsqrt-zero-var": Incident(rsqrt_zero_var, rsqrt_zero_var_by_hand, "eps", 0.0),
    "atanh-of-one": Incident(atanh_of_one, atanh_of_one_by_hand, "eps", 0.34657),
    "kl-of-zero": Incident(kl_of_zero, kl_of_zero_by_hand, "eps", 0.0),
    "logistic-overflow": Incident(logistic_overflow, logistic_overflow_by_hand, "stable", 0.0),
    "zero-batch-max": Incident(zero_batch_max, zero_batch_max_by_hand, "eps", None),
}

__all__ = ["INCIDENTS", "Callable"]
