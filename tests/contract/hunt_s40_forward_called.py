"""hunt_s40, a watched module's ``forward`` called as a method by the loop: its code is the module's (phase forward).

``module.forward(x)`` bypasses that module's hooks, so the watch sees its code run where the loop's code runs, and
what it makes reaches the next watched call as a batch would. PRODUCT.md's phase says where the producer ran: a
module's forward. Variants of hunt_s39f's row: the op in a helper method the forward calls; a submodule's forward
called by the loop (the module is named by its path); the op after the forward's last child call, which reaches the
loss as the loss code's op would (it was named with no module). Healthy twins: the same loops with the guard in
place. And a loop whose own data code (outside every module) makes its batch non-finite before ``model.forward``:
data, as before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches


class Scaled(nn.Module):
    """Normalises each sample by its sum in a helper method (0 / 0 for an all-zero sample), then classifies."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def _shares(self, x: torch.Tensor) -> torch.Tensor:
        x = x.abs()
        return x / (x.sum(-1, keepdim=True) + self.eps)  # producer: helper shares

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._shares(x))


def _helper_method(eps: float) -> Scenario:
    """``model.forward(x)``; at step 1 a sample is all zeros: ``0 / 0`` in the forward's helper. Twin: eps 1e-6."""
    torch.manual_seed(0)
    model = Scaled(eps)
    xs, ys = _batches(5, 4), [torch.randint(0, 3, (5,)) for _ in range(3)]
    xs[1][3] = 0.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.cross_entropy(model.forward(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


class Pooled(nn.Module):
    """A set encoder: the mean over a sample's members with a count that may be 0."""

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return x.sum(1) / count[:, None]  # producer: encoder mean


class SetModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Pooled()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x, count))


def _submodule_forward(empty: bool) -> Scenario:
    """The loop runs the encoder by ``model.encoder.forward(x, count)`` and the head itself; at step 2 a sample's
    set is empty (count 0, members 0): ``0 / 0`` in the encoder's forward. Twin: count clamped to 1 by the data."""
    torch.manual_seed(0)
    model = SetModel()
    xs = [torch.randn(3, 5, 4) for _ in range(4)]
    counts = [torch.full((3,), 5.0) for _ in range(4)]
    xs[2][1] = 0.0
    counts[2][1] = 0.0 if empty else 1.0
    ys = [torch.randint(0, 2, (3,)) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            pooled = model.encoder.forward(xs[step], counts[step])
            loss = F.cross_entropy(model.head(pooled), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


def _loop_normalises(eps: float) -> Scenario:
    """The loop's own code (outside every module) divides the batch by its per-sample sum before ``model.forward``:
    with eps 0 that is data (PRODUCT.md: built in the loop from outside data), as before; with eps 1e-6, healthy."""
    torch.manual_seed(0)
    model = Scaled(1e-6)
    xs, ys = _batches(5, 4), [torch.randint(0, 3, (5,)) for _ in range(3)]
    xs[2][0] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            x = xs[step].abs()
            x = x / (x.sum(-1, keepdim=True) + eps)  # producer: loop shares
            loss = F.cross_entropy(model.forward(x), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


class LogProbabilities(nn.Module):
    """Log-probabilities as the log of ReLU'd scores: an all-negative row's log is -inf, after the last child call."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.net(x)
        return torch.log(scores.relu() + self.eps)  # producer: forward tail


def _forward_tail(eps: float) -> Scenario:
    """``F.nll_loss(model.forward(x), y)``: the scores of step 0 hold zeros after the ReLU. Twin: eps 1e-3."""
    torch.manual_seed(0)
    model = LogProbabilities(eps)
    xs, ys = _batches(5, 4), [torch.randint(0, 3, (5,)) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.nll_loss(model.forward(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s40_forward_called_log_after_its_last_child_call", lambda: _forward_tail(0.0),
         Expect("forward", "", "LogProbabilities", step=0, op="aten.log.default", marker="forward tail",
                cause="log-domain")),
    Case("hunt_s40_forward_called_log_after_its_last_child_call_with_eps_healthy", lambda: _forward_tail(1e-3), None),
    Case("hunt_s40_forward_called_helper_method_divides_an_all_zero_sample", lambda: _helper_method(0.0),
         Expect("forward", "", "Scaled", step=1, op="aten.div.Tensor", marker="helper shares")),
    Case("hunt_s40_forward_called_helper_method_with_eps_healthy", lambda: _helper_method(1e-6), None),
    Case("hunt_s40_submodule_forward_called_pools_an_empty_set", lambda: _submodule_forward(True),
         Expect("forward", "encoder", "Pooled", step=2, op="aten.div.Tensor", marker="encoder mean")),
    Case("hunt_s40_submodule_forward_called_over_a_nonempty_set_healthy", lambda: _submodule_forward(False), None),
    Case("hunt_s40_loop_code_before_forward_called_stays_data", lambda: _loop_normalises(0.0),
         Expect("data", "head", "Sequential", step=2, op="aten.div.Tensor", marker="loop shares")),
    Case("hunt_s40_loop_code_before_forward_called_with_eps_healthy", lambda: _loop_normalises(1e-6), None),
]
