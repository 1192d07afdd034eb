"""Held-out healthy idioms: code that handles infinities on purpose, and must stay silent and bit-identical.

Attention masked with ``-inf`` where every query keeps a key (one mask
made by summing a causal and a padding mask), label
smoothing, ``inf`` as the start of a running minimum, ``nan_to_num`` of a
log feature, ``-inf`` scores of the beams a beam search starts without,
``torch.where`` guarding a log in both directions (the double where), a
GradScaler whose first steps overflow under ``unscale_`` and
``clip_grad_norm_`` (skipped: benign), gradient accumulation with an EMA
teacher, and the library forms of risky formulas (``F.kl_div`` of zero
targets, ``torch.cdist`` at zero distance, ``F.softplus`` of large inputs,
``F.cosine_similarity`` of a zero vector).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario


def sgd_steps(model: nn.Module, loss_of, steps: int = 3, lr: float = 0.01) -> Scenario:
    """``steps`` SGD steps of ``loss_of(model)``; run() returns the parameters after them."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> list[torch.Tensor]:
        for _ in range(steps):
            loss = loss_of(model)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


class CausalPaddedAttention(nn.Module):
    """Single-head attention masked with -inf for the future and for padding; query 0 always keeps key 0."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5
        future = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future | padding[:, None, :], float("-inf"))
        return scores.softmax(-1) @ v


def _masked_attention() -> Scenario:
    torch.manual_seed(0)
    model = CausalPaddedAttention()
    x = torch.randn(3, 5, 8)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True  # a short sequence: its first key stays
    return sgd_steps(model, lambda m: m(x, padding).pow(2).mean())


class BiasedAttention(nn.Module):
    """Attention given one additive float mask, made in the loop by summing a causal and a padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return (q @ k.transpose(-1, -2) / 8 ** 0.5 + mask).softmax(-1) @ v


def _summed_masks() -> Scenario:
    torch.manual_seed(0)
    model = BiasedAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 5, 8)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True

    def run() -> list[torch.Tensor]:
        for _ in range(3):
            causal = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
            pad = torch.zeros(3, 1, 5).masked_fill(padding[:, None, :], float("-inf"))
            mask = torch.stack(torch.broadcast_tensors(causal, pad)).sum(0)
            loss = model(x, mask).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _label_smoothing() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))

    def loss_of(m: nn.Module) -> torch.Tensor:
        logits = m(x)
        smooth = -logits.log_softmax(-1).mean(-1).mean()
        return F.cross_entropy(logits, y, label_smoothing=0.1) + 0.1 * smooth

    return sgd_steps(model, loss_of)


class FarthestPoints(nn.Module):
    """Farthest point sampling: the running minimum distance starts at +inf."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 3)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        points = self.embed(points)
        nearest = torch.full(points.shape[:1], float("inf"))
        chosen = [0]
        for _ in range(3):
            nearest = torch.minimum(nearest, (points - points[chosen[-1]]).pow(2).sum(-1))
            chosen.append(int(nearest.argmax()))
        return points[chosen]


def _inf_running_minimum() -> Scenario:
    torch.manual_seed(0)
    model = FarthestPoints()
    points = torch.randn(10, 3)
    return sgd_steps(model, lambda m: m(points).pow(2).mean())


class LogCounts(nn.Module):
    """A log feature of counts, where a zero count becomes 0 instead of -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(counts).nan_to_num(neginf=0.0))


def _nan_to_num_of_a_log_feature() -> Scenario:
    torch.manual_seed(0)
    model = LogCounts()
    counts = torch.randint(0, 5, (8, 3)).float()
    counts[0, 0] = 0.0
    y = torch.randn(8, 1)
    return sgd_steps(model, lambda m: F.mse_loss(m(counts), y))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(7, 8), nn.Linear(8, 7)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens).mean(1))).log_softmax(-1)


def _beam_search() -> Scenario:
    """Beam search from one start token: beams 1..3 start at -inf so the first step expands beam 0 only."""
    torch.manual_seed(0)
    model = Decoder()
    beams = 4

    def run() -> torch.Tensor:
        tokens = torch.zeros(beams, 1, dtype=torch.long)
        scores = torch.full((beams,), float("-inf"))
        scores[0] = 0.0
        with torch.no_grad():
            for _ in range(4):
                total = (scores[:, None] + model(tokens)).flatten()
                scores, index = total.topk(beams)
                tokens = torch.cat([tokens[index // 7], (index % 7)[:, None]], 1)
        return tokens

    return Scenario((model,), run)


class SafeLog(nn.Module):
    """log(x) where x > 0, else 0: the inner where keeps log's backward finite at x <= 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positive = x > 0
        return torch.where(positive, torch.log(torch.where(positive, x, torch.ones_like(x))), torch.zeros_like(x))


def _double_where_log() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SafeLog(), nn.Linear(4, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    return sgd_steps(model, lambda m: F.mse_loss(m(x), y))


def _scaler_unscale_clip_skip() -> Scenario:
    """fp16 autocast with a GradScaler whose initial scale overflows: unscale_, clip, step skip the first 3 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = torch.randn(16, 8) * 4, torch.randn(16, 1)

    def run() -> list[torch.Tensor]:
        for _ in range(10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _accumulation_with_ema_teacher() -> Scenario:
    """A student trained over 4 micro-batches per step, distilled from an EMA teacher updated after each step."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4))
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    micro = [torch.randn(4, 6) for _ in range(8)]

    def run() -> list[torch.Tensor]:
        for i, x in enumerate(micro):
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = F.kl_div(student(x).log_softmax(-1), target, reduction="batchmean") / 4
            loss.backward()
            if i % 4 == 3:
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    for t, s in zip(teacher.parameters(), student.parameters()):
                        t.mul_(0.99).add_(s, alpha=0.01)
        return [p.detach().clone() for p in teacher.parameters()]

    return Scenario((student, teacher, opt), run)


def _library_forms_of_risky_formulas() -> Scenario:
    """KL of zero targets (xlogy), distances to itself (cdist), softplus of 500, cosine of a zero vector."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(6, 4)
    x[2] = 0.0
    target = torch.softmax(torch.randn(6, 4), -1)
    target[1] = torch.tensor([0.5, 0.5, 0.0, 0.0])

    def loss_of(m: nn.Module) -> torch.Tensor:
        h = m(x)
        kl = F.kl_div(h.log_softmax(-1), target, reduction="batchmean")
        spread = torch.cdist(h, h).mean()
        big = F.softplus(500.0 * h).mean() * 1e-3
        cosine = F.cosine_similarity(x, h, dim=-1).mean()
        return kl + spread + big + cosine

    return sgd_steps(model, loss_of)


CASES: list[Case] = [
    Case("holdout_healthy_causal_padded_attention", _masked_attention, None, benign=0),
    Case("holdout_healthy_masks_combined_by_a_sum", _summed_masks, None),
    Case("holdout_healthy_label_smoothing", _label_smoothing, None, benign=0),
    Case("holdout_healthy_inf_running_minimum", _inf_running_minimum, None, benign=0),
    Case("holdout_healthy_nan_to_num_of_a_log_feature", _nan_to_num_of_a_log_feature, None, benign=0),
    Case("holdout_healthy_beam_search_neginf_beams", _beam_search, None, benign=0),
    Case("holdout_healthy_double_where_log", _double_where_log, None, benign=0),
    Case("holdout_healthy_scaler_unscale_clip_skips", _scaler_unscale_clip_skip, None, benign=3),
    Case("holdout_healthy_accumulation_with_ema_teacher", _accumulation_with_ema_teacher, None, benign=0),
    Case("holdout_healthy_library_forms_of_risky_formulas", _library_forms_of_risky_formulas, None, benign=0),
]
