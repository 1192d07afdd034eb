"""Healthy training that must stay silent, third part: what the loop's own code does around the models.

The loop writes into the model's output (a forbidden class set to -inf by item assignment before the loss),
accumulates metrics into preallocated tensors with ``out=``, trains in pure float16 or bfloat16 parameters, wraps
the model in ``DataParallel`` on a machine without GPUs, samples from a model it trains. The harness is calm26.py's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish, training


def _forbidden_class_in_loss_code() -> Scenario:
    """Class 0 is never a target here: the loop sets its logit to -inf by item assignment before the loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randint(1, 4, (6,))

    def loss_of(step: int) -> torch.Tensor:
        logits = model(x)
        logits[:, 0] = float("-inf")
        return F.cross_entropy(logits, y)

    return training(model, loss_of)


def _metrics_out() -> Scenario:
    """Running sums kept in preallocated tensors with ``out=`` and in place, under no_grad, in the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    total, correct, best = torch.zeros(()), torch.zeros(()), torch.full((), float("inf"))

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                torch.add(total, loss, out=total)
                correct.add_((logits.argmax(1) == y).sum())
                torch.minimum(best, loss, out=best)
            losses.append(loss.detach())
        return (*finish(losses, model, opt), total.clone(), correct.clone(), best.clone())

    return Scenario((model, opt), run)


def _pure_half(dtype: torch.dtype):
    def build() -> Scenario:
        """Parameters and inputs in half precision, no autocast, no scaler (small model, small learning rate)."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2)).to(dtype)
        x = torch.randn(6, 8, dtype=dtype)
        return training(model, lambda s: model(x).float().pow(2).mean(),
                        opt=torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4))
    return build


def _data_parallel() -> Scenario:
    """``nn.DataParallel`` with no GPU runs its module directly (its names carry ``module.``)."""
    torch.manual_seed(0)
    model = nn.DataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


def _train_then_sample() -> Scenario:
    """A char-level model trained a step, then sampled from with temperature, top-k (-inf) and multinomial, the
    samples fed back: the RNG stream the sampling draws from must be the unwatched one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(12, 16), nn.Linear(16, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 12, (4, 6))

    def run() -> tuple[Any, ...]:
        out = []
        for _ in range(2):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
            with torch.no_grad():
                seq = ids[:, :1]
                for _ in range(5):
                    logits = model(seq)[:, -1] / 0.8
                    kth = logits.topk(3).values[:, -1:]
                    logits[logits < kth] = float("-inf")
                    seq = torch.cat([seq, torch.multinomial(logits.softmax(-1), 1)], 1)
                out.append(seq)
        return finish(out, model, opt)

    return Scenario((model, opt), run)


ROWS = {
    "forbidden-class-minus-inf-by-item-assignment": _forbidden_class_in_loss_code,
    "metrics-accumulated-with-out": _metrics_out,
    "pure-float16-parameters": _pure_half(torch.float16),
    "pure-bfloat16-parameters": _pure_half(torch.bfloat16),
    "data-parallel-without-gpus": _data_parallel,
    "train-then-sample-top-k": _train_then_sample,
}

CASES = [Case(f"calm26_{name}", build, None, benign=0) for name, build in ROWS.items()]
