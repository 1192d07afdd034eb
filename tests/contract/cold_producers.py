"""Producers the boundary checks see late or not at all: named at their op and line in every mode (issue 27).

Data made in a Dataset's ``__getitem__`` (its samples are fetched again,
localize/replay/samples.py), a logsumexp over a fully masked row in the loss code or
a model, a ``torch.library.custom_op`` whose registered backward divides by
zero, ``torch.multinomial`` raising on the NaN probabilities a temperature of
0 made (in a model and in the loop), and the ``div`` in log's backward in a
PPO-style loss; and the healthy versions of each idiom, which stay silent.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from contract import Case, Expect, Scenario


class Standardised(Dataset):
    """Rows standardised in __getitem__; row 21 is constant, so its std is zero."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.x, self.y = torch.randn(32, 4), torch.randn(32, 1)
        self.x[21] = 3.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.x[i]
        return (row - row.mean()) / row.std(), self.y[i]  # producer: standardise


def _regression(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _dataset_standardisation(workers: int = 0, healthy: bool = False) -> Scenario:
    model, opt = _regression()
    dataset = Standardised()
    if healthy:
        dataset.x[21] = torch.arange(4.0)
    loader = DataLoader(dataset, batch_size=8, num_workers=workers)

    def run() -> None:
        for features, labels in loader:
            loss = F.mse_loss(model(features), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


def _masked_loss(reduction: str, healthy: bool = False) -> Scenario:
    """A loss over scores masked with -inf; every class of row 2 is masked (one is left, ``healthy``)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(5, 4)
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[0, 3:] = True
    mask[2] = True
    mask[2, 2] = not healthy
    target = torch.tensor([[0], [1], [2], [0], [1]])

    def run() -> None:
        scores = model(x).masked_fill(mask, float("-inf"))
        if reduction == "log_softmax":
            loss = -scores.log_softmax(-1)[:, 0].mean()  # producer: masked log_softmax
        elif reduction == "logsumexp":
            loss = (scores.logsumexp(-1) - scores.gather(1, target).squeeze(1)).mean()  # producer: masked lse
        else:
            loss = -scores.logsumexp(-1).mean()  # producer: masked lse alone
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


class MaskedPool(nn.Module):
    """Pools token scores by logsumexp over the tokens a mask keeps."""

    def forward(self, scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~keep, float("-inf")).logsumexp(-1)  # producer: masked pool


class PooledScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score, self.pool = nn.Linear(4, 1), MaskedPool()

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.pool(self.score(tokens).squeeze(-1), keep)


def _masked_pool_in_a_model() -> Scenario:
    torch.manual_seed(0)
    model = PooledScorer()
    tokens = torch.randn(3, 5, 4)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1] = False  # a sequence with no token kept

    def run() -> torch.Tensor:
        return model(tokens, keep).sum()

    return Scenario((model,), run)


@torch.library.custom_op("nan_magic_contract::scaled_root", mutates_args=())
def scaled_root(x: torch.Tensor) -> torch.Tensor:
    return x.abs().sqrt()


@scaled_root.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_root_backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x, = ctx.saved_tensors
    return grad * x.sign() / (2 * x.abs().sqrt())  # producer: custom backward


def _scaled_root_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0])


scaled_root.register_autograd(_scaled_root_backward, setup_context=_scaled_root_setup)


class RootLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_root(x)


class RootScale(nn.Module):
    """Scales its input by the root of a parameter, through the custom op; one scale is zero."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.0, 0.0, 2.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * scaled_root(self.scale)


def _custom_op_backward(on_parameter: bool = False) -> Scenario:
    """The custom op's backward divides 0 by 0: at a zero input row, or at a zero scale parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RootScale() if on_parameter else RootLayer(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model[0].bias.zero_()
    x = torch.randn(8, 4)
    if not on_parameter:
        x[3] = 0.0  # a zero row: the root's derivative there is 0 / 0

    def run() -> None:
        loss = model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


class Policy(nn.Module):
    """Samples an action at a temperature; greedy decoding set it to 0."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.logits, self.temperature = nn.Linear(4, 5), temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.logits(x) / self.temperature, -1)  # producer: policy temperature
        return torch.multinomial(probs, 1)


def _multinomial_in_forward() -> Scenario:
    torch.manual_seed(0)
    model = Policy(temperature=0.0)
    x = torch.randn(3, 4)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return Scenario((model,), run)


def _multinomial_in_loop() -> Scenario:
    """Sampling from a language model's last logits in the loop, at temperature 0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    x = torch.randn(3, 4)
    temperature = 0.0

    def run() -> torch.Tensor:
        with torch.no_grad():
            logits = model(x)
        probs = torch.softmax(logits / temperature, -1)  # producer: loop temperature
        return torch.multinomial(probs, 1)

    return Scenario((model,), run)


def _healthy_multinomial() -> Scenario:
    torch.manual_seed(0)
    model = Policy(temperature=0.7)
    x = torch.randn(3, 4)

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(x) for _ in range(3)]

    return Scenario((model,), run)


def ppo_setup() -> tuple[nn.Linear, torch.optim.SGD, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A PPO-style policy, its optimizer, and a batch in which state 3 took the action its mask forbids:
    ``(policy, opt, states, invalid, actions, advantages)``."""
    torch.manual_seed(0)
    policy = nn.Linear(4, 3)
    opt = torch.optim.SGD(policy.parameters(), lr=0.01)
    states = torch.randn(6, 4)
    invalid = torch.zeros(6, 3, dtype=torch.bool)
    invalid[:, 2] = True
    actions = torch.tensor([[0], [1], [0], [2], [1], [0]])
    return policy, opt, states, invalid, actions, torch.randn(6)


def _ppo_log_backward() -> Scenario:
    policy, opt, states, invalid, actions, advantages = ppo_setup()

    def run() -> None:
        probs = policy(states).masked_fill(invalid, float("-inf")).softmax(-1)
        logp = torch.log(probs.gather(1, actions)).clamp(min=-20).squeeze(1)  # producer: ppo log
        loss = -(logp * advantages).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((policy, opt), run)


CASES = [
    Case("dataset_getitem_standardisation", _dataset_standardisation,
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="standardise")),
    Case("dataset_getitem_standardisation_in_a_worker", lambda: _dataset_standardisation(workers=1),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="standardise")),
    Case("loss_masked_log_softmax", lambda: _masked_loss("log_softmax"),
         Expect("forward", None, step=0, op="aten._log_softmax.default", marker="masked log_softmax")),
    Case("loss_masked_logsumexp_minus_target", lambda: _masked_loss("logsumexp"),
         Expect("forward", None, step=0, op="aten.logsumexp.default", marker="masked lse")),
    Case("loss_masked_logsumexp", lambda: _masked_loss("logsumexp alone"),
         Expect("forward", None, step=0, op="aten.logsumexp.default", marker="masked lse alone")),
    Case("masked_logsumexp_pool_in_a_model", _masked_pool_in_a_model,
         Expect("forward", "pool", "MaskedPool", step=0, op="aten.logsumexp.default", marker="masked pool")),
    Case("custom_op_backward", _custom_op_backward,
         Expect("backward", "1", "RootLayer", step=0, op="aten.div.Tensor", marker="custom backward",
                cause="division-by-zero")),
    Case("custom_op_parameter_backward", lambda: _custom_op_backward(on_parameter=True),
         Expect("backward", "1", "RootScale", step=0, op="aten.div.Tensor", marker="custom backward",
                op_modes=("default", "defer", "ops")),
         note="full: a parameter's own gradient formula is not replayed per module; its op is not named"),
    Case("multinomial_in_forward", _multinomial_in_forward,
         Expect("forward", "", "Policy", step=0, op="aten.div.Tensor", marker="policy temperature")),
    Case("multinomial_in_loop", _multinomial_in_loop,
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="loop temperature")),
    Case("healthy_dataset_with_workers", lambda: _dataset_standardisation(workers=1, healthy=True), None),
    Case("healthy_partly_masked_logsumexp", lambda: _masked_loss("logsumexp", healthy=True), None, benign=None),
    Case("healthy_multinomial", _healthy_multinomial, None),
    Case("ppo_log_backward", _ppo_log_backward,
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="ppo log")),
]
