"""Where the known gaps of the fifteenth round named the wrong place (gaps16): multi-loss steps, the gradient
penalty's double backward, update code that writes gradients.

A second loss computed after the first ``backward()`` (an auxiliary loss with its own backward, two accumulated
losses, a second output's loss): its code runs where the update region is recorded, and goes on as loss code when
its own ``backward()`` starts (localize/outside/loop_writes.py's ``loss_starts``). Each with a healthy twin that must
stay calm and compute what it computes unwatched.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


def _zeroed_at_2(out: torch.Tensor, step: int) -> torch.Tensor:
    """The output with its first row zeroed at step 2 (a dead sample): the norm of that row is 0."""
    return out * torch.tensor([[0.0], [1.0], [1.0]]) if step == 2 else out


# ---------------------------------------------------------------- a second loss, its own backward
def _second_output_loss(safe: bool) -> Scenario:
    """Two outputs, two losses, two backwards, no graph retained: the second loss (a row norm, sqrt's backward
    1 / 0 at the dead row of step 2) is computed after the first backward returned."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(2, 3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out_a, out_b = model(xs[step][0]), model(xs[step][1])
            opt.zero_grad()
            first = out_a.pow(2).mean()
            first.backward()
            rows = _zeroed_at_2(out_b, step).pow(2).sum(-1)
            second = (rows + 1e-12).sqrt().sum() if safe else rows.sqrt().sum()  # producer: second output sqrt
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


def _separate_forwards(safe: bool) -> Scenario:
    """Gradient accumulation over two forwards, each loss with its own backward: the second's sqrt at step 2."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(2, 3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            opt.zero_grad()
            first = model(xs[step][0]).pow(2).mean() / 2
            first.backward()
            rows = _zeroed_at_2(model(xs[step][1]), step).pow(2).sum(-1)
            second = (rows + 1e-12).sqrt().mean() / 2 if safe else rows.sqrt().mean() / 2  # producer: accumulated sqrt
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


def _auxiliary_log_after_backward(safe: bool) -> Scenario:
    """The main loss's backward keeps the graph; an auxiliary loss on the same output, computed after it, takes the
    log of a row's squared norm: -inf in the forward at step 2's dead row."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(3, 4) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = _zeroed_at_2(model(xs[step]), step)
            opt.zero_grad()
            main = out.pow(2).mean()
            main.backward(retain_graph=True)
            energy = out.pow(2).sum(-1)
            aux = -torch.log(energy.clamp_min(1e-12) if safe else energy).mean()  # producer: auxiliary log
            aux.backward()
            opt.step()
            losses += [main.detach(), aux.detach()]
        return losses
    return Scenario((model, opt), run)


def _auxiliary_loss_then_clipping(safe: bool) -> Scenario:
    """As the retained second loss, with gradient clipping after the second backward: the update region after it
    runs clipping's ops and writes no parameter, so the next steps' regions are watched, not recorded (only their
    last ops kept): the second loss's code is among them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs = [torch.randn(3, 4) for _ in range(5)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            out = model(xs[step])
            out = out * torch.tensor([[0.0], [1.0], [1.0]]) if step == 3 else out
            opt.zero_grad()
            main = out.pow(2).mean()
            main.backward(retain_graph=True)
            rows = out.pow(2).sum(-1)
            aux = (rows + 1e-12).sqrt().sum() if safe else rows.sqrt().sum()  # producer: clipped aux sqrt
            aux.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses += [main.detach(), aux.detach()]
        return losses
    return Scenario((model, opt), run)


CASES = [
    Case("gaps16_second_output_loss_after_the_first_backward", lambda: _second_output_loss(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="second output sqrt", cause="sqrt-domain")),
    Case("gaps16_second_output_loss_eps_healthy", lambda: _second_output_loss(True), None),
    Case("gaps16_accumulated_second_loss_of_a_second_forward", lambda: _separate_forwards(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="accumulated sqrt", cause="sqrt-domain")),
    Case("gaps16_accumulated_second_loss_eps_healthy", lambda: _separate_forwards(True), None),
    Case("gaps16_auxiliary_log_after_a_retained_backward", lambda: _auxiliary_log_after_backward(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="auxiliary log")),
    Case("gaps16_auxiliary_log_clamped_healthy", lambda: _auxiliary_log_after_backward(True), None),
    Case("gaps16_auxiliary_loss_then_clipping", lambda: _auxiliary_loss_then_clipping(False),
         Expect("backward", None, step=3, op="aten.div.Tensor", marker="clipped aux sqrt", cause="sqrt-domain")),
    Case("gaps16_auxiliary_loss_then_clipping_healthy", lambda: _auxiliary_loss_then_clipping(True), None),
]

