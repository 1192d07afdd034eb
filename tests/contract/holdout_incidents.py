"""Held-out incidents: NaNs people hit in real training code, written after the engine, as its exam.

Each case is a small version of a reported incident (an RMSNorm of a padding
row, a hand-written cosine similarity of a zero vector, a softplus written as
``log1p(exp(x))``, a BatchNorm-like layer dividing by the std of a last batch
of one, a focal loss with gamma < 1, a KL divergence with zero targets, a
Gumbel noise of ``log(0)``, weight norm over a pruned row, a
``nn.MultiheadAttention`` whose padding mask hides a whole sequence, a
center loss whose sqrt has no derivative at zero distance, a cross entropy
over a micro-batch whose labels are all ignored, a Dataset taking the log of
a zero count, fp16 generation whose MLP overflows at a later token), with
the producer a user must be shown.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from contract import Case, Expect, Scenario

# The tiered default records the loss code's ops and replays them; mode="full" does not record them.
LOSS_CODE_OPS = ("default", "defer", "ops")
LOSS_CODE_NOTE = "full: the loss code is not recorded; its op is not named"


def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn, lr: float = 0.01):
    """A plain SGD loop over ``batches``; returns the run() of a Scenario."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> list[torch.Tensor]:
        for x, y in batches:
            loss = loss_fn(model(x), y)  # producer: model call
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return opt, run


class RMSNorm(nn.Module):
    """RMSNorm written without an eps (as some ports of LLaMA did)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # producer: rms
        return x * scale * self.weight


class TokenEncoder(nn.Module):
    """Embedding whose padding row is all zeros (padding_idx), then an RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.norm = RMSNorm(8)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens))).mean(1)


def _rmsnorm_padding_row() -> Scenario:
    torch.manual_seed(0)
    model = TokenEncoder()
    batches = [(torch.randint(1, 10, (4, 5)), torch.randn(4, 1)) for _ in range(3)]
    batches[1][0][2, 3:] = 0  # the second batch holds padded sequences
    opt, run = _train(model, batches, F.mse_loss)
    return Scenario((model, opt), run)


class PairSimilarity(nn.Module):
    """Cosine similarity of two projections, written by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        u, v = F.relu(self.proj(a)), F.relu(self.proj(b))
        return (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))  # producer: cosine


def _cosine_of_a_zero_vector() -> Scenario:
    torch.manual_seed(0)
    model = PairSimilarity()
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    with torch.no_grad():
        model.proj.bias.fill_(-0.5)
    b[5] = -10.0 * model.proj.weight.sum(0).sign()  # every ReLU of row 5 off: a zero vector
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        loss = (1 - model(a, b)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


class NaiveSoftplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.exp(x))  # producer: softplus exp


def _naive_softplus_overflow() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NaiveSoftplus(), nn.Linear(4, 1))
    x = torch.randn(6, 4)
    x[4] = 500.0 * model[0].weight.detach()[1].sign()  # an outlier row: exp of its pre-activation overflows
    opt, run = _train(model, [(x, torch.randn(6, 1))], F.mse_loss)
    return Scenario((model, opt), run)


class BatchStandardise(nn.Module):
    """A BatchNorm-like layer written by hand: standardise by the batch's own mean and std."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / (x.std(0) + 1e-5)  # producer: batch std


def _batch_std_of_a_last_batch_of_one() -> Scenario:
    """A loader without drop_last: 9 samples in batches of 4 leave a last batch of one, whose std is NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), BatchStandardise(), nn.Linear(4, 1))
    x, y = torch.randn(9, 3), torch.randn(9, 1)
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 9, 4)]
    opt, run = _train(model, batches, F.mse_loss)
    return Scenario((model, opt), run)


def focal_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float = 0.5) -> torch.Tensor:
    p = torch.sigmoid(logits)
    pt = torch.where(target > 0, p, 1 - p)
    return (-(1 - pt) ** gamma * torch.log(pt)).mean()  # producer: focal pow


def _focal_loss_gamma_below_one() -> Scenario:
    """(1 - pt) ** 0.5 has an infinite derivative where a sample is classified perfectly (pt == 1)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), (torch.rand(8, 1) > 0.5).float()
    x[2] = 40.0 * model.weight.detach()[0].sign()
    y[2] = 1.0  # sigmoid(~40) rounds to exactly 1 in float32
    opt, run = _train(model, [(x, y)], focal_loss)
    return Scenario((model, opt), run)


def _kl_with_zero_targets() -> Scenario:
    """KL(target || model) written by hand; a target distribution puts zero mass on a class."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    target = torch.softmax(torch.randn(5, 3), -1)
    target[1] = torch.tensor([0.5, 0.5, 0.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        logp = model(x).log_softmax(-1)
        loss = (target * (target.log() - logp)).sum(-1).mean()  # producer: kl target log
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


class GumbelSoftmax(nn.Module):
    """Gumbel-softmax with a quantised uniform noise, which is sometimes exactly 1: -log(-log(1)) is +inf."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        u = torch.rand_like(logits).mul(64).ceil().div(64)
        gumbel = -torch.log(-torch.log(u))  # producer: gumbel log
        return torch.softmax((logits + gumbel) / 0.5, -1)


def _gumbel_log_of_zero() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), GumbelSoftmax(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    opt, run = _train(model, [(x, y)] * 3, F.mse_loss)
    return Scenario((model, opt), run)


def _weight_norm_of_a_pruned_row() -> Scenario:
    """Weight norm over a Linear whose third output row was pruned to zero: g * v / ||v|| is 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[2] = 0.0
    nn.utils.parametrizations.weight_norm(model[0])
    opt, run = _train(model, [(torch.randn(6, 4), torch.randn(6, 1))], F.mse_loss)
    return Scenario((model, opt), run)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h, _ = self.attn(h, h, h, key_padding_mask=padding)
        return self.head(h).mean(1)


def _mha_fully_padded_sequence() -> Scenario:
    """A batch holds an empty sequence: its key_padding_mask hides every key."""
    torch.manual_seed(0)
    model = Encoder()
    tokens = torch.randint(0, 12, (3, 5))
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    padding[2] = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        loss = model(tokens, padding).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


class CenterLoss(nn.Module):
    """Distance of each feature to its class center; the centers start at the first batch's features."""

    def __init__(self, features: torch.Tensor) -> None:
        super().__init__()
        self.centers = nn.Parameter(features.detach().clone())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((features - self.centers) ** 2).sum(-1)).mean()  # producer: center distance


class WithCenters(nn.Module):
    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.center = CenterLoss(self.body(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.center(self.body(x))


def _center_loss_sqrt_at_zero() -> Scenario:
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    model = WithCenters(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        loss = model(x)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


def _accumulated_micro_batch_all_ignored() -> Scenario:
    """4 micro-batches per step; in the second step, the third micro-batch's labels are all ignore_index."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro = [(torch.randn(4, 6), torch.randint(0, 5, (4,))) for _ in range(12)]
    micro[6][1].fill_(-100)

    def run() -> None:
        for i, (x, y) in enumerate(micro):
            loss = F.cross_entropy(model(x), y, ignore_index=-100) / 4  # producer: all ignored
            loss.backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()

    return Scenario((model, opt), run)


class CountFeatures(Dataset):
    """Log-transformed count features; item 13 never occurred (count 0)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.counts = torch.randint(1, 50, (24, 3)).float()
        self.counts[13, 1] = 0.0
        self.y = torch.randn(24, 1)

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.log(self.counts[i]), self.y[i]  # producer: log count


def _dataset_log_of_zero_count() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    loader = DataLoader(CountFeatures(), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


class TinyLM(nn.Module):
    """A one-block language model in float16: mean of the context, then an MLP, then the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).cumsum(1)  # the residual grows with the context
        h = h + self.fc2(F.relu(self.fc1(h)))  # producer: fc1 overflow
        return self.out(h[:, -1])


def _fp16_generation_overflows_later() -> Scenario:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        model.embed.weight.mul_(1000.0)
        model.fc1.weight.mul_(16.0)  # fc1's output crosses 65504 at the sixth token
    model.half()
    prompt = torch.tensor([[3, 5]])

    def run() -> torch.Tensor:
        tokens = prompt
        with torch.no_grad():
            for _ in range(6):
                logits = model(tokens)
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
        return tokens

    return Scenario((model,), run)


CASES: list[Case] = [
    Case("holdout_rmsnorm_without_eps_padding_row", _rmsnorm_padding_row,
         Expect("forward", "norm", "RMSNorm", step=1, op="aten.rsqrt.default", marker="rms")),
    Case("holdout_hand_cosine_of_a_zero_vector", _cosine_of_a_zero_vector,
         Expect("forward", "", "PairSimilarity", op="aten.div.Tensor", marker="cosine")),
    Case("holdout_softplus_as_log1p_exp", _naive_softplus_overflow,
         Expect("forward", "1", "NaiveSoftplus", op="aten.exp.default", marker="softplus exp")),
    Case("holdout_batch_std_of_a_last_batch_of_one", _batch_std_of_a_last_batch_of_one,
         Expect("forward", "1", "BatchStandardise", step=2, op="aten.std.correction", marker="batch std")),
    Case("holdout_focal_loss_gamma_below_one", _focal_loss_gamma_below_one,
         Expect("backward", None, op="aten.pow.Tensor_Scalar", marker="focal pow", op_modes=LOSS_CODE_OPS),
         note=LOSS_CODE_NOTE),
    Case("holdout_kl_with_zero_targets", _kl_with_zero_targets,
         Expect("forward", None, op="aten.log.default", marker="kl target log", op_modes=LOSS_CODE_OPS),
         note=LOSS_CODE_NOTE),
    Case("holdout_gumbel_noise_log_of_zero", _gumbel_log_of_zero,
         Expect("forward", "1", "GumbelSoftmax", op="aten.log.default", marker="gumbel log")),
    Case("holdout_weight_norm_of_a_pruned_row", _weight_norm_of_a_pruned_row,
         Expect("forward", "0.parametrizations.weight.0", "_WeightNorm", op="aten._weight_norm_interface.default",
                marker="model call", cause="division-by-zero")),
    Case("holdout_mha_fully_padded_sequence", _mha_fully_padded_sequence,
         Expect("forward", "attn", "MultiheadAttention", op="aten._softmax.default")),
    Case("holdout_center_loss_sqrt_at_zero_distance", _center_loss_sqrt_at_zero,
         Expect("backward", "center", "CenterLoss", op="aten.div.Tensor", marker="center distance")),
    Case("holdout_accumulation_micro_batch_all_ignored", _accumulated_micro_batch_all_ignored,
         Expect("forward", None, step=1, op="aten.nll_loss_forward.default", marker="all ignored",
                op_modes=LOSS_CODE_OPS), note=LOSS_CODE_NOTE),
    Case("holdout_dataset_log_of_zero_count", _dataset_log_of_zero_count,
         Expect("data", "", "Sequential", step=2, op="aten.log.default", marker="log count")),
    Case("holdout_fp16_generation_overflows_later", _fp16_generation_overflows_later,
         Expect("forward", "fc1", "Linear", step=5, op="aten.addmm.default", marker="fc1 overflow",
                cause="half-precision-overflow")),
]
