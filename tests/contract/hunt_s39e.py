"""hunt_s39e, incidents of fine-tuning and optimizer code written the way libraries write it, with healthy twins.

Supervised fine-tuning with the loss summed over tokens and divided by the accumulation window's count of label
tokens (the gradient-accumulation fix of HF's Trainer): a window whose responses the truncation cut away has every
label -100, ``0 / 0``. An RMSprop written with ``torch._foreach_*`` ops (as torch's own foreach optimizers are) without
eps, over an embedding whose rows outside the batch have a gradient of exactly 0. Healthy: an entropy bonus of
sparsemax attention guarded by ``torch.where(p > 0, p * log p, 0)``, whose backward is ``0 * -inf`` where sparsemax
put exactly 0 (the where's untaken branch still differentiates), a NaN the sparsemax's own clamp then drops.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.calm_s39 import sparsemax
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a token-count normaliser of an all-prompt window
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _token_count(clamped: bool) -> Scenario:
    """Two micro-batches per optimizer step; the loss of each is ``cross_entropy(reduction="sum")`` divided by the
    window's number of label tokens. Step 2's window holds prompts whose responses the max length cut away: every
    label is -100, the count is 0, and ``0 / 0`` is NaN. The twin divides by the count clamped to at least 1."""
    torch.manual_seed(0)
    model = TinyLM()
    ids = [[torch.randint(0, 20, (2, 6)) for _ in range(2)] for _ in range(4)]
    labels = [[i.clone() for i in window] for window in ids]
    for window in labels:
        for lab in window:
            lab[:, :3] = -100  # the prompt's tokens
    for lab in labels[2]:
        lab.fill_(-100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            count = sum(lab.ne(-100).sum() for lab in labels[step])
            if clamped:
                count = count.clamp_min(1)
            for x, lab in zip(ids[step], labels[step]):
                total = F.cross_entropy(model(x).flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
                loss = total / count  # producer: token count
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a foreach RMSprop without eps
class ForeachRMSprop(torch.optim.Optimizer):
    """RMSprop by ``torch._foreach_*`` ops over each group's parameters at once."""

    def __init__(self, params, lr: float = 1e-3, alpha: float = 0.99, eps: float = 0.0) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr, "alpha": alpha, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            squares = [self.state[p].setdefault("square_avg", torch.zeros_like(p)) for p in params]
            torch._foreach_mul_(squares, group["alpha"])
            torch._foreach_addcmul_(squares, grads, grads, value=1 - group["alpha"])
            denom = torch._foreach_sqrt(squares)
            if group["eps"]:
                torch._foreach_add_(denom, group["eps"])
            updates = torch._foreach_div(grads, denom)  # producer: foreach div
            torch._foreach_add_(params, updates, alpha=-group["lr"])


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(12, 6), nn.Linear(6, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def _foreach_rmsprop(eps: float) -> Scenario:
    """The batches use token ids 0..7 only: the embedding's rows 8..11 get a gradient of exactly 0 and a square average
    of 0, ``0 / sqrt(0)``. The twin adds eps."""
    torch.manual_seed(0)
    model = BagClassifier()
    ids, ys = [torch.randint(0, 8, (4, 5)) for _ in range(4)], [torch.randint(0, 2, (4,)) for _ in range(4)]
    return _loop(model, lambda step: (ids[step],), lambda out, step: F.cross_entropy(out, ys[step]),
                 opt=ForeachRMSprop(model.parameters(), eps=eps))


# ---------------------------------------------------------------- an entropy bonus over sparsemax, by torch.where
class SparseEntropyAttention(nn.Module):
    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.clamped = nn.Linear(8, 24), nn.Linear(8, 3), clamped

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, -1)
        p = sparsemax(4.0 * q @ k.transpose(-1, -2))
        plogp = p * p.clamp_min(1e-12).log() if self.clamped else torch.where(p > 0, p * p.log(), 0.0)
        return self.out((p @ v).mean(1)), -plogp.sum(-1).mean()


def _where_entropy(clamped: bool) -> Scenario:
    """The loss adds 0.01 times the attention's entropy, guarded by ``torch.where(p > 0, ...)``: the forward is
    finite, and the backward of ``p * log p`` at the weights sparsemax set to exactly 0 is ``0 * log 0``, NaN, which
    the where does not stop; but sparsemax's own ``clamp_min(0)`` drops it (exactly there, z - tau < 0): healthy, and
    must stay silent, as must the form that clamps p before the log."""
    torch.manual_seed(0)
    model = SparseEntropyAttention(clamped)
    xs, ys = _batches(3, 5, 8), [torch.randint(0, 3, (3,)) for _ in range(4)]

    def loss(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        logits, entropy = out
        return F.cross_entropy(logits, ys[step]) - 0.01 * entropy

    return _loop(model, lambda step: (xs[step],), loss)


CASES = [
    Case("hunt_s39e_token_count_of_a_window_with_every_label_ignored", lambda: _token_count(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="token count",
                cause="empty-reduction")),
    Case("hunt_s39e_token_count_clamped_healthy", lambda: _token_count(True), None),
    Case("hunt_s39e_foreach_rmsprop_without_eps_over_unused_embedding_rows", lambda: _foreach_rmsprop(0.0),
         Expect("optimizer", "embed", "Embedding", step=0, op="aten._foreach_div.List", marker="foreach div",
                cause="optimizer-eps-underflow")),
    Case("hunt_s39e_foreach_rmsprop_with_eps_healthy", lambda: _foreach_rmsprop(1e-8), None),
    Case("hunt_s39e_sparsemax_entropy_guarded_by_where_healthy", lambda: _where_entropy(False), None),
    Case("hunt_s39e_sparsemax_entropy_of_clamped_p_healthy", lambda: _where_entropy(True), None),
]
