"""Loop code that writes a parameter between ``backward()`` and the next step (issue 27).

A hand-written optimizer over ``model.parameters()`` (no ``torch.optim``), and
a hand-written update of a tied embedding beside an optimizer: the parameter
they make non-finite is reported at the step it happened, phase optimizer
(the user's update code is the optimizer), its owner as the module, with the
op and line that made it, in every mode (localize/outside/loop_writes.py). Healthy
versions of both stay silent and compute the same numbers.

Loop code that writes parameters only now and then (a max-norm renormalisation
every 10th step; a hand-written decay applied only while the loss is above a
threshold) is caught at the step it writes, not a step late: an update region
that ran no op stays recorded. One that ran ops and wrote nothing (gradient
clipping, a scheduler) is only watched, for its cost, until it writes a
parameter: a renormalisation after clipping, and a tied update after clipping
and a scheduler's step (whose division ran before the write), are caught at
their step with op and line in every mode. A write into one row of a parameter
(a view) is caught at its step too, except by ``ops=True`` (a step late).
"""

from __future__ import annotations

import torch
from torch import nn

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef


def _momentum_sgd_by_hand(dead_first_layer: bool) -> Scenario:
    """SGD with momentum written by hand, each gradient divided by its norm: a zero gradient makes 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if dead_first_layer:
        with torch.no_grad():
            model[0].bias.fill_(-100.0)  # every ReLU off: the first layer's gradients are all zero
    momentum = [torch.zeros_like(p) for p in model.parameters()]
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def run() -> list[torch.Tensor]:
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for parameter, buffer in zip(model.parameters(), momentum):
                    buffer.mul_(0.9).add_(parameter.grad / parameter.grad.norm())  # producer: normalised gradient
                    parameter.sub_(0.01 * buffer)
                    parameter.grad = None
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model,), run)


class TiedLM(nn.Module):
    """A tiny language model whose output projection is its embedding (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embed(tokens))) @ self.embed.weight.t()


def _tied_update_by_hand(every_token_seen: bool, clip_and_schedule: bool = False) -> Scenario:
    """The tied embedding is updated by hand, its gradient averaged over each token's count; the rest by SGD.

    ``clip_and_schedule``: the gradients are clipped and a scheduler steps first, and the update begins at
    step 2 (a warm-up): the update region ran many ops and wrote nothing on the steps before.
    """
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.mix.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    tokens = torch.tensor([0, 1, 2, 3, 4, 5] if every_token_seen else [0, 1, 2, 2])

    def run() -> list[torch.Tensor]:
        for step in range(4 if clip_and_schedule else 3):
            loss = nn.functional.cross_entropy(model(tokens), tokens)
            opt.zero_grad()
            model.embed.weight.grad = None
            loss.backward()
            if clip_and_schedule:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not clip_and_schedule or step >= 2:  # a warm-up keeps the embedding for two steps
                counts = torch.bincount(tokens, minlength=6).float().unsqueeze(1)
                with torch.no_grad():
                    model.embed.weight.sub_(0.1 * model.embed.weight.grad / counts)  # producer: tied update
            opt.step()
            if clip_and_schedule:
                scheduler.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


def _renormalised_every(period: int, clip: bool) -> Scenario:
    """Embedding rows renormalised to unit norm every ``period`` steps; the padding row is zero: 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.tensor([0, 1, 2, 3, 5])

    def run() -> None:
        for step in range(period + 2):
            opt.zero_grad()
            model(tokens).pow(2).mean().backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step % period == period - 1:
                with torch.no_grad():
                    weight = model[0].weight
                    weight.div_(weight.norm(dim=1, keepdim=True))  # producer: renormalise
            opt.step()

    return Scenario((model, opt), run)


def _one_row_renormalised_after_clipping() -> Scenario:
    """Clipping, then from step 2 one row of the embedding (a view of it) renormalised in place; that row is 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with torch.no_grad():
        model[0].weight[3] = 0.0
    tokens = torch.tensor([0, 1, 2, 3, 5])

    def run() -> None:
        for step in range(4):
            opt.zero_grad()
            model(tokens).pow(2).mean().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step >= 2:
                with torch.no_grad():
                    row = model[0].weight[3]
                    row.div_(row.norm())  # producer: one row
            opt.step()

    return Scenario((model, opt), run)


def _decay_while_high(healthy: bool) -> Scenario:
    """A hand-written decay of the output weight applied only while the loss is above 1, by 1 / (loss - 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.01)
    x = torch.randn(16, 4)
    targets = [0.0, 0.0, 0.0, 3.0, 0.0]

    def run() -> list[torch.Tensor]:
        for target in targets:
            opt.zero_grad()
            loss = (model(x) - target).pow(2).mean()
            loss.backward()
            if loss.item() > 1.0:
                margin = loss.detach() - (1.0 if healthy else loss.detach())
                with torch.no_grad():
                    model[2].weight.mul_(1.0 - 0.1 / margin)  # producer: decay while high
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return Scenario((model, opt), run)


CASES = [
    Case("loop_momentum_sgd_by_hand_zero_gradient_norm", lambda: _momentum_sgd_by_hand(True),
         Expect("optimizer", "0", "Linear", op="aten.div.Tensor", marker="normalised gradient",
                tensor=TensorRef.parameter("0.weight"), kinds=frozenset({"nan"}), cause="division-by-zero")),
    Case("loop_momentum_sgd_by_hand_healthy", lambda: _momentum_sgd_by_hand(False), None),
    Case("loop_tied_embedding_update_zero_count", lambda: _tied_update_by_hand(False),
         Expect("optimizer", "embed", "Embedding", op="aten.div.Tensor", marker="tied update",
                tensor=TensorRef.parameter("embed.weight"), cause="division-by-zero")),
    Case("loop_tied_embedding_update_healthy", lambda: _tied_update_by_hand(True), None),
    Case("loop_tied_update_after_clipping_and_warm_up", lambda: _tied_update_by_hand(False, clip_and_schedule=True),
         Expect("optimizer", "embed", "Embedding", step=2, op="aten.div.Tensor", marker="tied update",
                tensor=TensorRef.parameter("embed.weight"), cause="division-by-zero")),
    Case("loop_tied_update_after_clipping_and_warm_up_healthy",
         lambda: _tied_update_by_hand(True, clip_and_schedule=True), None),
    Case("loop_renormalise_every_10th_step", lambda: _renormalised_every(10, clip=False),
         Expect("optimizer", "0", "Embedding", step=9, op="aten.div_.Tensor", marker="renormalise",
                tensor=TensorRef.parameter("0.weight"))),
    Case("loop_renormalise_every_3rd_step_after_clipping", lambda: _renormalised_every(3, clip=True),
         Expect("optimizer", "0", "Embedding", step=2, op="aten.div_.Tensor", marker="renormalise",
                tensor=TensorRef.parameter("0.weight"))),
    Case("loop_one_row_renormalised_after_clipping", _one_row_renormalised_after_clipping,
         Expect("optimizer", "0", "Embedding", step=2, op="aten.div_.Tensor", marker="one row",
                tensor=TensorRef.parameter("0.weight"), cause="division-by-zero")),
    Case("loop_decay_only_while_the_loss_is_high", lambda: _decay_while_high(False),
         Expect("optimizer", "2", "Linear", step=3, op="aten.reciprocal.default", marker="decay while high",
                tensor=TensorRef.parameter("2.weight"))),
    Case("loop_decay_only_while_the_loss_is_high_healthy", lambda: _decay_while_high(True), None),
]
