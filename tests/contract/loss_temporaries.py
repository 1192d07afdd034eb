"""Loss code whose loss is a temporary: ``(-lse.mean()).backward()``, ``loss_fn(out, y).backward()`` (issue 27).

The deferred check (CUDA; ``defer=True`` here) judges the loss at the
optimizer step, after a temporary loss was freed: its recorded ops are found
by the id the loss had when ``backward()`` started (localize/outside/recorder.py), so every
mode names the producer's op and line as it does for a named ``loss``. The
producer may sit in a helper the loop calls, in one of two temporaries
added together, or under autocast; it may also be a backward op.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.cold_producers import ppo_setup


def _masked_lse_temporary() -> Scenario:
    """``(-lse.mean()).backward()`` over scores whose row 2 is masked entirely."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(5, 4)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[2] = True

    def run() -> None:
        for _ in range(2):
            lse = model(x).masked_fill(mask, float("-inf")).logsumexp(-1)  # producer: lse temporary
            opt.zero_grad()
            (-lse.mean()).backward()
            opt.step()

    return Scenario((model, opt), run)


def masked_mse(out: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A mean squared error over the kept rows; no row kept makes 0 / 0."""
    return ((out - y).pow(2).sum(-1) * keep).sum() / keep.sum()  # producer: masked mean


def _loss_fn_temporary(two_terms: bool = False, autocast: bool = False, healthy: bool = False) -> Scenario:
    """``loss_fn(out, y).backward()`` with a mask that keeps no row at step 1 (``healthy``: one row)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    keeps = [torch.ones(6), torch.zeros(6), torch.ones(6)]
    if healthy:
        keeps[1][3] = 1.0

    def run() -> list[torch.Tensor]:
        for keep in keeps:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
                if two_terms:
                    (0.01 * out.float().pow(2).mean() + masked_mse(out.float(), y, keep)).backward()
                else:
                    masked_mse(out.float(), y, keep).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _ppo_temporary() -> Scenario:
    """The PPO-style log of a zero probability, its loss a temporary: log's backward divides by 0."""
    policy, opt, states, invalid, actions, advantages = ppo_setup()

    def run() -> None:
        probs = policy(states).masked_fill(invalid, float("-inf")).softmax(-1)
        logp = torch.log(probs.gather(1, actions)).clamp(min=-20).squeeze(1)  # producer: ppo log temporary
        opt.zero_grad()
        (-(logp * advantages).mean()).backward()
        opt.step()

    return Scenario((policy, opt), run)


def _cross_entropy_temporary() -> Scenario:
    """``F.cross_entropy(model(x), y).backward()`` with a NaN in the logits' input: the model makes it, not the loss."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])

    def run() -> None:
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return Scenario((model, opt), run)


CASES = [
    Case("loss_temporary_masked_logsumexp", _masked_lse_temporary,
         Expect("forward", None, step=0, op="aten.logsumexp.default", marker="lse temporary")),
    Case("loss_temporary_from_a_loss_fn", _loss_fn_temporary,
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="masked mean", cause="empty-reduction")),
    Case("loss_temporary_of_two_terms", lambda: _loss_fn_temporary(two_terms=True),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="masked mean", cause="empty-reduction")),
    Case("loss_temporary_under_autocast", lambda: _loss_fn_temporary(autocast=True),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="masked mean", cause="empty-reduction")),
    Case("loss_temporary_backward_producer", _ppo_temporary,
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="ppo log temporary")),
    Case("healthy_loss_temporaries", lambda: _loss_fn_temporary(two_terms=True, autocast=True, healthy=True), None),
    Case("healthy_cross_entropy_temporary", _cross_entropy_temporary, None),
]
