"""The incidents of the fixes-s30 audit (tests/test_fixes_s30*.py): each a small training loop that goes non-finite
for one cause, with the remedy a person would apply done by hand on a fresh copy of the same model and batch.

``build()`` gives ``(model, optimizer, run, data)``; ``by_hand()`` gives ``(loss, finite)`` of the failing step with
the remedy applied by hand (None where no remedy a person would apply fits the trial's kinds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EPS = torch.finfo(torch.float32).eps
Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None], dict[str, torch.Tensor]]
LossOf = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def hand_step(model: nn.Module, opt: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor]
              ) -> tuple[float, bool]:
    """One step by hand: its loss, and whether its gradients and updated parameters are all finite."""
    opt.zero_grad()
    loss = loss_of()
    loss.backward()
    grads = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    opt.step()
    return float(loss.detach()), grads and all(bool(torch.isfinite(p).all()) for p in model.parameters())


def mse(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(data["x"]), data["y"])


def fit(model: nn.Module, data: dict[str, torch.Tensor], loss_of: LossOf = mse, lr: float = 0.1, steps: int = 3
        ) -> Built:
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> None:
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_of(model, data)
            loss.backward()
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- x / x.norm() of an all-zero row
class RowNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x / x.norm(dim=-1, keepdim=True))  # producer: 0 / 0 on the zero row


def zero_row_norm() -> Built:
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    x[3] = 0.0
    return fit(RowNorm(), {"x": x, "y": torch.randn(8, 1)})


def zero_row_norm_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = zero_row_norm()
    x = data["x"]
    return hand_step(model, opt, lambda: F.mse_loss(
        model.out(x / x.norm(dim=-1, keepdim=True).clamp_min(EPS)), data["y"]))


# ---------------------------------------------------------------- torch.log(softmax) for log_softmax
class LogSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.lin(x), dim=-1))  # producer: log(0) where a probability underflowed


def nll(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return -(model(data["x"]) * data["y"]).sum(-1).mean()  # soft targets: every class's log-probability counts


def log_of_softmax() -> Built:
    torch.manual_seed(0)
    model = LogSoftmax()
    with torch.no_grad():
        model.lin.weight.mul_(200)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.softmax(torch.randn(8, 5), -1)}, nll, lr=0.01)


def log_of_softmax_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = log_of_softmax()
    return hand_step(model, opt, lambda: -(F.log_softmax(model.lin(data["x"]), -1) * data["y"]).sum(-1).mean())


# ---------------------------------------------------------------- sqrt of E[x^2] - E[x]^2 < 0 by rounding
class RoundedStd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2
        return self.out(x * torch.pow(var, 0.5))  # producer: a variance that rounded below 0


def rounded_variance() -> Built:
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    x[5] = 1.3  # (a constant row: its E[x^2] - E[x]^2 rounds to -4.8e-7 in float32)
    return fit(RoundedStd(), {"x": x, "y": torch.randn(8, 1)})


def rounded_variance_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = rounded_variance()
    x = data["x"]

    def loss() -> torch.Tensor:
        var = (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2
        return F.mse_loss(model.out(x * torch.pow(var.clamp_min(EPS), 0.5)), data["y"])

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- cosine similarity without F.normalize
class Cosine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = self.lin(a)
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # producer: 0 / 0 where b is all zeros


def cosine_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return (1 - model(data["a"], data["b"])).mean()


def cosine_of_zero() -> Built:
    torch.manual_seed(0)
    b = torch.randn(8, 4)
    b[6] = 0.0
    return fit(Cosine(), {"a": torch.randn(8, 4), "b": b}, cosine_loss)


def cosine_of_zero_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = cosine_of_zero()

    def loss() -> torch.Tensor:
        a, b = model.lin(data["a"]), data["b"]
        return (1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(EPS)).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- model.half(): a float16 matmul overflows
def half_matmul() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(30)
        model[2].weight.mul_(300)
    model.half()
    return fit(model, {"x": (torch.randn(8, 16) * 40).half(), "y": torch.randn(8, 1).half()}, lr=1e-6)


def half_matmul_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = half_matmul()
    model.float()  # (the optimizer holds the same parameters: .float() changes them in place)
    return hand_step(model, opt, lambda: F.mse_loss(model(data["x"].float()), data["y"].float()))


# ---------------------------------------------------------------- log(1 + exp(x)): a softplus by hand
class SoftplusByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.log(1 + torch.exp(self.lin(x))))  # producer: exp overflows float32


def exp_activation() -> Built:
    torch.manual_seed(0)
    model = SoftplusByHand()
    with torch.no_grad():
        model.lin.weight.mul_(100)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=1e-4)


def exp_activation_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = exp_activation()
    return hand_step(model, opt, lambda: F.mse_loss(model.out(F.softplus(model.lin(data["x"]))), data["y"]))


# ---------------------------------------------------------------- a focal loss by hand with p = 0
def focal(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    p = torch.softmax(model(data["x"]), -1).gather(1, data["y"][:, None]).squeeze(1)
    return -((1 - p) ** 2 * torch.log(p)).mean()  # producer: log(0) where the true class underflowed


def focal_of_zero() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.mul_(200)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))}, focal, lr=1e-3)


def focal_of_zero_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = focal_of_zero()

    def loss() -> torch.Tensor:
        p = torch.softmax(model(data["x"]), -1).gather(1, data["y"][:, None]).squeeze(1)
        return -((1 - p) ** 2 * torch.log(p.clamp_min(EPS))).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- std over one element (n - 1 = 0)
class OneStd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h / (1 + h.std(0))  # producer: the unbiased std of a batch of one, 0 / 0


def one_sample_std() -> Built:
    torch.manual_seed(0)
    return fit(OneStd(), {"x": torch.randn(1, 4), "y": torch.randn(1, 4)})


def one_sample_std_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = one_sample_std()

    def loss() -> torch.Tensor:
        h = model.lin(data["x"])
        return F.mse_loss(h / (1 + h.std(0, correction=0)), data["y"])

    return hand_step(model, opt, loss)


def standardized(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(data["x"])
    return (((out - data["y"]) / out.std(0)) ** 2).mean()  # producer: a std of a batch of one in the loss code


def one_sample_std_loss() -> Built:
    torch.manual_seed(0)
    return fit(nn.Linear(4, 4), {"x": torch.randn(1, 4), "y": torch.randn(1, 4)}, standardized)


def one_sample_std_loss_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = one_sample_std_loss()

    def loss() -> torch.Tensor:
        out = model(data["x"])
        return (((out - data["y"]) / out.std(0, correction=0)) ** 2).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- attention scaled by 1/sqrt(0): a head-dim typo
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.head_dim = torch.tensor(0.0)  # (a typo: 8 // 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) * torch.rsqrt(self.head_dim)  # producer: rsqrt(0) = inf
        return torch.softmax(scores, -1) @ v


def zero_head_dim() -> Built:
    torch.manual_seed(0)
    return fit(Attention(), {"x": torch.randn(2, 5, 8), "y": torch.randn(2, 5, 8)})


def zero_head_dim_by_hand() -> tuple[float, bool]:
    """The trial's eps by hand: finite, with every score scaled by 1/sqrt(eps) (the report says the inf is hidden)."""
    model, opt, _run, data = zero_head_dim()

    def loss() -> torch.Tensor:
        q, k, v = model.qkv(data["x"]).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) * torch.rsqrt(model.head_dim.clamp_min(EPS))
        return F.mse_loss(torch.softmax(scores, -1) @ v, data["y"])

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- an RNN exploding over a long sequence
def exploding_rnn() -> Built:
    torch.manual_seed(0)
    model = nn.RNN(4, 8, nonlinearity="relu", batch_first=True)
    with torch.no_grad():
        model.weight_hh_l0.copy_(torch.eye(8) * 3)

    def rnn_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(data["x"])[0][:, -1], data["y"])

    return fit(model, {"x": torch.rand(2, 100, 4), "y": torch.randn(2, 8)}, rnn_loss)


# ---------------------------------------------------------------- NaN only in a validation batch
def validation_nan() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, val = torch.randn(8, 4), torch.randn(8, 1), torch.randn(6, 4)
    val[2, 1] = float("nan")
    data = {"x": x, "y": y, "val": val}

    def run() -> None:
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model(val)  # producer: the validation batch's NaN

    return model, opt, run, data


# ---------------------------------------------------------------- 1 / class_count with an empty class
def class_weighted(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    counts = torch.bincount(data["y"], minlength=3).float()
    weight = 1.0 / counts  # producer: 1 / 0 for the class no sample has
    per_class = torch.zeros(3).index_add(0, data["y"], F.cross_entropy(model(data["x"]), data["y"],
                                                                      reduction="none"))
    return (weight * per_class).sum()


def empty_class() -> Built:
    torch.manual_seed(0)
    return fit(nn.Linear(4, 3), {"x": torch.randn(8, 4), "y": torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])}, class_weighted)


def empty_class_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = empty_class()

    def loss() -> torch.Tensor:
        counts = torch.bincount(data["y"], minlength=3).float()
        per_class = torch.zeros(3).index_add(0, data["y"], F.cross_entropy(model(data["x"]), data["y"],
                                                                          reduction="none"))
        return (1.0 / counts.clamp_min(EPS) * per_class).sum()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a warmup schedule computing 0 / 0
def warmup_zero() -> Built:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warmup = torch.tensor(0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(torch.tensor(float(step)) / warmup)
                                                 if step < 5 else 1.0)  # producer: 0 / 0 at step 0
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            schedule.step()

    return model, opt, run, {"x": x, "y": y}


# ---------------------------------------------------------------- log(sigmoid(z)) for logsigmoid
class LogSigmoid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(self.lin(x)))  # producer: log(0) where the sigmoid underflowed


def log_of_sigmoid() -> Built:
    torch.manual_seed(0)
    model = LogSigmoid()
    with torch.no_grad():
        model.lin.weight.mul_(100)
    return fit(model, {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, lr=1e-4)


def log_of_sigmoid_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = log_of_sigmoid()
    return hand_step(model, opt, lambda: F.mse_loss(F.logsigmoid(model.lin(data["x"])), data["y"]))


# ---------------------------------------------------------------- sqrt of a sum of squares at 0: NaN in backward
class Distance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        diff = self.lin(x) - anchor
        return torch.sqrt((diff * diff).sum(-1))  # producer (backward): d sqrt(s)/ds = 1 / (2 sqrt(0))


def distance_loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(data["x"], data["anchor"]).mean()


def zero_distance() -> Built:
    torch.manual_seed(0)
    model = Distance()
    x = torch.randn(8, 4)
    with torch.no_grad():
        anchor = model.lin(x)
        anchor[:4] += torch.randn(4, 4)  # (the last four samples sit on their anchor: distance exactly 0)
    return fit(model, {"x": x, "anchor": anchor}, distance_loss)


def zero_distance_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = zero_distance()

    def loss() -> torch.Tensor:
        diff = model.lin(data["x"]) - data["anchor"]
        return torch.sqrt((diff * diff).sum(-1).clamp_min(EPS)).mean()

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- a masked mean over an all-zero mask
def masked_mean(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    per_sample = ((model(data["x"]) - data["y"]) ** 2).squeeze(1)
    return (per_sample * data["mask"]).sum() / data["mask"].sum()  # producer: 0 / 0, no sample kept


def empty_mask() -> Built:
    torch.manual_seed(0)
    return fit(nn.Linear(4, 1), {"x": torch.randn(8, 4), "y": torch.randn(8, 1), "mask": torch.zeros(8)},
               masked_mean)


def empty_mask_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = empty_mask()

    def loss() -> torch.Tensor:
        per_sample = ((model(data["x"]) - data["y"]) ** 2).squeeze(1)
        return (per_sample * data["mask"]).sum() / data["mask"].sum().clamp_min(EPS)

    return hand_step(model, opt, loss)


# ---------------------------------------------------------------- an inf in the targets the loss code reads
def bad_targets() -> Built:
    torch.manual_seed(0)
    y = torch.randn(8, 1)
    y[4] = float("inf")
    return fit(nn.Linear(4, 1), {"x": torch.randn(8, 4), "y": y})


@dataclass(frozen=True)
class Incident:
    """One audited incident: how to build it, the remedy by hand, the trial kind it should verify (None: none a
    person would apply fits the tool's remedies), and the trial's output_change (0.0 where the remedy leaves the
    outputs the unremedied replay had finite as they were; None where none were compared)."""

    build: Callable[[], Built]
    by_hand: Callable[[], tuple[float, bool]] | None
    kind: str | None
    change: float | None = 0.0


INCIDENTS: dict[str, Incident] = {
    "zero-row-norm": Incident(zero_row_norm, zero_row_norm_by_hand, "eps"),
    "log-of-softmax": Incident(log_of_softmax, log_of_softmax_by_hand, "stable"),
    "cosine-of-zero": Incident(cosine_of_zero, cosine_of_zero_by_hand, "eps"),
    "half-matmul": Incident(half_matmul, half_matmul_by_hand, "float32"),  # (its own tests)
    "exp-activation": Incident(exp_activation, exp_activation_by_hand, "stable"),  # (F.softplus, fixes-s31)
    "focal-of-zero": Incident(focal_of_zero, focal_of_zero_by_hand, "eps"),
    "one-sample-std": Incident(one_sample_std, one_sample_std_by_hand, "stable", None),
    "one-sample-std-loss": Incident(one_sample_std_loss, one_sample_std_loss_by_hand, None),  # (inf by hand too)
    "zero-head-dim": Incident(zero_head_dim, zero_head_dim_by_hand, "eps", None),
    "exploding-rnn": Incident(exploding_rnn, None, None),
    "validation-nan": Incident(validation_nan, None, "skip-batch"),  # (its own test)
    "empty-class": Incident(empty_class, empty_class_by_hand, "eps"),
    "warmup-zero": Incident(warmup_zero, None, None),
    "rounded-variance": Incident(rounded_variance, rounded_variance_by_hand, "eps"),
    "log-of-sigmoid": Incident(log_of_sigmoid, log_of_sigmoid_by_hand, "stable"),
    "zero-distance": Incident(zero_distance, zero_distance_by_hand, "eps"),
    "empty-mask": Incident(empty_mask, empty_mask_by_hand, "eps"),
    "bad-targets": Incident(bad_targets, None, None),
}

__all__ = ["EPS", "INCIDENTS", "Built", "Incident", "fit", "hand_step", "math"]
