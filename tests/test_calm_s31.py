"""Healthy models and values a user trains with the watch on (calm_s31), every mode.

Each row is a loop (tests/calm_s30.py: the harness, what is compared): activation checkpointing inside a custom
block (reentrant with dropout and a non-tensor argument, non-reentrant returning a tuple, checkpoint_sequential),
the user's own hooks that return something else (a forward hook scaling the output, a kwargs pre-hook, a gradient
reversal by a full backward hook, a backward pre-hook), models returning a dict, a dataclass, a namedtuple or a
tuple with None, MoE routing through a ModuleDict whose unused experts get no gradient, deliberate infinities
(finfo.min masks in bfloat16 and float16 that overflow to -inf, logsumexp over fully masked rows, nan_to_num in the
forward), losses over NaN labels masked on purpose, distributions with validate_args (a masked Categorical policy,
a VAE's Normal), a scripted loss, a child-sum tree-LSTM that recurses, deterministic algorithms.
Outputs also as a frozen slots dataclass, a plain object, a tuple with ints, strings and a bool mask; a
pointer network's -inf scores in the model's own output.
test_calm_s31_loops.py: loop shapes.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from calm_s30 import MODES, Row, check, steps
from torch import nn
from torch.distributions import Categorical, Independent, Normal, kl_divergence
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)

NEG_INF = float("-inf")


def _mlp(d_in: int = 6, d_out: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out))


def _data(n: int = 8, d_in: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, d_in), torch.randint(0, classes, (n,))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _classifier(model: nn.Module, opt: torch.optim.Optimizer | None = None, n: int = 3) -> Row:
    opt = opt or _sgd(model)
    x, y = _data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x), y), n))


# -- activation checkpointing inside the user's block ------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Dropout(0.2), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, h: torch.Tensor, scale: float) -> torch.Tensor:
        return self.norm(h + scale * self.ff(h))


class CheckpointedNet(nn.Module):
    """Each block is recomputed in the backward: reentrant (dropout replayed by the saved RNG state, a float
    argument) or not (the block returns a tuple: the hidden state and a detached statistic)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.reentrant = reentrant

    def _tupled(self, block: Block, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = block(h, 0.5)
        return out, out.detach().abs().mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.reentrant:
                h = checkpoint(block, h, 0.5, use_reentrant=True)
            else:
                h, _ = checkpoint(self._tupled, block, h, use_reentrant=False)
        return self.out(h)


def checkpoint_sequential_segments() -> Row:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 3))
    opt = _sgd(model)
    x, y = _data()

    def loss_of(step: int) -> torch.Tensor:
        return F.cross_entropy(checkpoint_sequential(model, 2, x, use_reentrant=False), y)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- the user's own hooks that change what flows -----------------------------------------------------------


def forward_hooks_that_return() -> Row:
    """A forward hook returns a scaled output (temperature), a kwargs pre-hook returns new args and kwargs."""
    model = _mlp()

    def temperature(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out / 2.0

    def noisy_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0] * 0.9,), kwargs

    model[2].register_forward_hook(temperature)
    model[0].register_forward_pre_hook(noisy_input, with_kwargs=True)
    return _classifier(model)


class DomainAdversarial(nn.Module):
    """A gradient reversal layer made by a full backward hook on an identity module (DANN)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.reverse = nn.Identity()
        self.label, self.domain = nn.Linear(16, 3), nn.Linear(16, 2)
        self.reverse.register_full_backward_hook(lambda m, gi, go: tuple(-0.3 * g for g in gi))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.features(x)
        return self.label(h), self.domain(self.reverse(h))


def gradient_reversal() -> Row:
    model = DomainAdversarial()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    d = torch.randint(0, 2, (8,))

    def loss_of(step: int) -> torch.Tensor:
        label, domain = model(x)
        return F.cross_entropy(label, y) + F.cross_entropy(domain, d)

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


def backward_pre_hook_scales() -> Row:
    """A backward pre-hook on the head halves the gradient coming into it."""
    model = _mlp()
    model[2].register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,))
    return _classifier(model)


# -- what a model returns ----------------------------------------------------------------------------------


Output = collections.namedtuple("Output", ["logits", "hidden", "aux"])


@dataclasses.dataclass
class ModelOutput:
    logits: torch.Tensor
    hidden: torch.Tensor
    attentions: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenOutput:
    logits: torch.Tensor
    extra: tuple


class Prediction:
    """A plain object with tensors as attributes (no dataclass, no mapping)."""

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.logits, self.hidden = logits, hidden


class Returning(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Linear(16, 3)
        self.kind = kind

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        logits = self.head(h)
        if self.kind == "dict":
            return {"logits": logits, "hidden": h, "past": None}
        if self.kind == "dataclass":
            return ModelOutput(logits, h)
        if self.kind == "namedtuple":
            return Output(logits, h, None)
        if self.kind == "frozen":
            return FrozenOutput(logits, (None, 3, "layer"))
        if self.kind == "object":
            return Prediction(logits, h)
        if self.kind == "mixed":  # with an int, a string, a float, the predictions (int64) and a bool mask
            return logits, 3, "tag", 0.5, logits.argmax(-1), logits > 0, h
        return logits, None, h


def returning(kind: str) -> Row:
    model = Returning(kind)
    opt = _sgd(model)
    x, y = _data()

    def loss_of(step: int) -> torch.Tensor:
        out = model(x)
        if kind == "dict":
            logits, hidden = out["logits"], out["hidden"]
        elif kind in ("dataclass", "namedtuple", "object"):
            logits, hidden = out.logits, out.hidden
        elif kind == "frozen":
            logits, hidden = out.logits, out.logits
        elif kind == "mixed":
            logits, hidden = out[0], out[-1]
        else:
            logits, _, hidden = out
        return F.cross_entropy(logits, y) + 1e-3 * hidden.pow(2).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


class PointerHead(nn.Module):
    """A pointer network's scores: -inf at the positions it may not point to, in the model's own output, on
    purpose; cross_entropy over them is finite (their softmax is 0, so is their gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(6, 5)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~valid, NEG_INF)


def pointer_scores_with_neg_inf() -> Row:
    model = PointerHead()
    opt = _sgd(model)
    x = torch.randn(8, 6)
    valid = torch.rand(8, 5) > 0.5
    valid[:, 0] = True
    y = torch.zeros(8, dtype=torch.long)
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x, valid), y)))


# -- MoE routing where some experts get no token -----------------------------------------------------------


class TopOneMoE(nn.Module):
    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(6, experts)
        self.experts = nn.ModuleDict({f"e{i}": nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
                                      for i in range(experts)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        choice = gates.argmax(-1)
        out = x.new_zeros(x.shape[0], 3)
        for i, expert in enumerate(self.experts.values()):
            picked = (choice == i).nonzero().squeeze(-1)
            if picked.numel() == 0:  # this expert gets no token this step: its grads stay None
                continue
            out = out.index_add(0, picked, expert(x[picked]) * gates[picked, i:i + 1])
        return out


def moe_with_idle_experts() -> Row:
    torch.manual_seed(3)
    model = TopOneMoE()
    with torch.no_grad():
        model.router.weight[2:].zero_()
        model.router.bias[2:].fill_(-30.0)  # experts e2 and e3 are never chosen
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x), y)))


# -- infinities and NaNs the user makes and handles on purpose ---------------------------------------------


class MaskedAttention(nn.Module):
    """Additive padding and causal masks at finfo(dtype).min, summed (HF-style): where both mask a position the
    sum overflows to -inf, on purpose; the first key is never causally masked, so each row keeps a finite entry."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8 ** 0.5
        low = torch.finfo(scores.dtype).min
        padding = torch.zeros_like(scores).masked_fill(~keep[:, None, :], low)
        n = scores.shape[-1]
        causal = torch.full((n, n), low, dtype=scores.dtype).triu(1)
        weights = (scores + padding + causal).softmax(-1)
        return self.o(weights @ self.v(x)).mean(1)


def finfo_min_masks(dtype: torch.dtype) -> Row:
    model = MaskedAttention().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(3, 5, 8, dtype=dtype)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    target = torch.randn(3, 8, dtype=dtype)
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.mse_loss(model(x, keep), target).float()))


class SetPool(nn.Module):
    """Log-mean-exp pooling over a padded set; an empty set's logsumexp is -inf, the score -inf - -inf NaN,
    repaired by nan_to_num."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(6, 1)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        s = self.score(x).squeeze(-1).masked_fill(~present, NEG_INF)
        attn = torch.nan_to_num((s - s.logsumexp(-1, keepdim=True)).exp(), nan=0.0)
        return self.head((attn.unsqueeze(-1) * x).sum(1))


def logsumexp_of_empty_sets() -> Row:
    model = SetPool()
    opt = _sgd(model)
    x = torch.randn(4, 5, 6)
    present = torch.rand(4, 5) > 0.3
    present[2] = False
    y = torch.randint(0, 3, (4,))
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(x, present), y)))


class LogFeatures(nn.Module):
    """log of count features (zeros: -inf), repaired in the forward by nan_to_num(neginf=0)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.net(torch.nan_to_num(counts.log(), neginf=0.0))


def nan_to_num_in_the_forward() -> Row:
    model = LogFeatures()
    opt = _sgd(model)
    counts = torch.randint(0, 4, (8, 6)).float()
    y = torch.randint(0, 3, (8,))
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: F.cross_entropy(model(counts), y)))


def multitask_missing_labels() -> Row:
    """Targets with NaN where a task has no label: each task's nanmean over a where-masked error, then their
    mean; a task with no label in the batch (all NaN) is dropped by nansum/count."""
    model = _mlp(6, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 6)
    y = torch.randn(8, 4)
    y[torch.rand(8, 4) < 0.3] = float("nan")
    y[:, 3] = float("nan")

    def loss_of(step: int) -> torch.Tensor:
        known = ~y.isnan()
        err = torch.where(known, model(x) - y.nan_to_num(), float("nan")).pow(2)
        per_task = err.nanmean(0)
        return per_task.nansum() / per_task.isfinite().sum()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- distributions -----------------------------------------------------------------------------------------


def masked_policy_gradient() -> Row:
    """REINFORCE with illegal actions masked at finfo.min, Categorical(validate_args=True), an entropy bonus."""
    policy = _mlp(6, 5)
    opt = torch.optim.Adam(policy.parameters(), lr=0.01)
    obs = torch.randn(8, 6)
    legal = torch.rand(8, 5) > 0.4
    legal[:, 0] = True
    returns = torch.randn(8)

    def loss_of(step: int) -> torch.Tensor:
        logits = policy(obs).masked_fill(~legal, torch.finfo(torch.float32).min)
        dist = Categorical(logits=logits, validate_args=True)
        action = dist.sample()
        return -(dist.log_prob(action) * returns).mean() - 0.01 * dist.entropy().mean()

    return Row((policy, opt), (policy, opt), steps(policy, opt, loss_of))


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 8), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Normal]:
        mu, log_var = self.enc(x).chunk(2, -1)
        q = Normal(mu, (0.5 * log_var).exp(), validate_args=True)
        return self.dec(q.rsample()), q


def vae_with_validated_normal() -> Row:
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 6)
    prior = Independent(Normal(torch.zeros(4), torch.ones(4), validate_args=True), 1)

    def loss_of(step: int) -> torch.Tensor:
        recon, q = model(x)
        return F.mse_loss(recon, x) + kl_divergence(Independent(q, 1), prior).mean()

    return Row((model, opt), (model, opt), steps(model, opt, loss_of))


# -- scripted loss, recursion, determinism -----------------------------------------------------------------


@torch.jit.script
def focal_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1).gather(1, target.unsqueeze(1)).squeeze(1)
    return (-(1 - logp.exp()).pow(gamma) * logp).mean()


def scripted_focal_loss() -> Row:
    model = _mlp()
    opt = _sgd(model)
    x, y = _data()
    return Row((model, opt), (model, opt), steps(model, opt, lambda s: focal_loss(model(x), y, 2.0)))


class ChildSumTreeLSTM(nn.Module):
    """Tai et al.'s child-sum tree-LSTM: ``node`` calls itself on each child, then the cell runs once per node."""

    def __init__(self, d_in: int = 6, d: int = 8) -> None:
        super().__init__()
        self.d = d
        self.iou = nn.Linear(d_in + d, 3 * d)
        self.f_x, self.f_h = nn.Linear(d_in, d), nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, 3)

    def node(self, tree: tuple, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index, children = tree
        states = [self.node(child, x) for child in children]
        h_kids = torch.stack([h for h, _ in states]) if states else x.new_zeros(1, self.d)
        c_kids = torch.stack([c for _, c in states]) if states else x.new_zeros(1, self.d)
        xi = x[index]
        i, o, u = self.iou(torch.cat([xi, h_kids.sum(0)])).chunk(3)
        f = torch.sigmoid(self.f_x(xi) + self.f_h(h_kids))
        c = torch.sigmoid(i) * torch.tanh(u) + (f * c_kids).sum(0)
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, x: torch.Tensor, tree: tuple) -> torch.Tensor:
        return self.head(self.node(tree, x)[0])


def tree_lstm() -> Row:
    model = ChildSumTreeLSTM()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    trees = [(0, [(1, [(3, []), (4, [])]), (2, [])]), (0, [(1, []), (2, [(3, [(4, [])])])])]
    xs = [torch.randn(5, 6) for _ in trees]
    ys = [torch.tensor(1), torch.tensor(2)]

    def loss_of(step: int) -> torch.Tensor:
        t = step % 2
        return F.cross_entropy(model(xs[t], trees[t]).unsqueeze(0), ys[t].unsqueeze(0))

    return Row((model, opt), (model, opt), steps(model, opt, loss_of, 4))


class ScatterPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.msg, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        pooled = x.new_zeros(int(graph.max()) + 1, 8).index_add(0, graph, self.msg(x))
        return self.head(torch.relu(pooled))


def deterministic_algorithms_on() -> Row:
    """The user turns on deterministic algorithms for the run (index_add, scatter) and off again after."""
    model = ScatterPool()
    opt = _sgd(model)
    x = torch.randn(12, 6)
    graph = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    y = torch.randint(0, 3, (4,))
    inner = steps(model, opt, lambda s: F.cross_entropy(model(x, graph), y))

    def run(watching) -> list[torch.Tensor]:
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return inner(watching)
        finally:
            torch.use_deterministic_algorithms(before)

    return Row((model, opt), (model, opt), run)


ROWS = {
    "checkpoint_reentrant_dropout_block": lambda: _classifier(CheckpointedNet(True)),
    "checkpoint_non_reentrant_tuple_block": lambda: _classifier(CheckpointedNet(False)),
    "checkpoint_sequential_segments": checkpoint_sequential_segments,
    "forward_hook_and_kwargs_pre_hook_return": forward_hooks_that_return,
    "gradient_reversal_full_backward_hook": gradient_reversal,
    "backward_pre_hook_scales_grad_output": backward_pre_hook_scales,
    "model_returns_dict_with_none": lambda: returning("dict"),
    "model_returns_dataclass": lambda: returning("dataclass"),
    "model_returns_namedtuple_with_none": lambda: returning("namedtuple"),
    "model_returns_tuple_with_none": lambda: returning("tuple"),
    "model_returns_frozen_slots_dataclass": lambda: returning("frozen"),
    "model_returns_plain_object": lambda: returning("object"),
    "model_returns_ints_strings_and_bool_mask": lambda: returning("mixed"),
    "pointer_scores_neg_inf_in_model_output": pointer_scores_with_neg_inf,
    "moe_moduledict_idle_experts": moe_with_idle_experts,
    "finfo_min_mask_bfloat16": lambda: finfo_min_masks(torch.bfloat16),
    "finfo_min_mask_float16_overflows": lambda: finfo_min_masks(torch.float16),
    "logsumexp_empty_set_nan_to_num": logsumexp_of_empty_sets,
    "nan_to_num_log_features_in_forward": nan_to_num_in_the_forward,
    "multitask_nan_labels_nanmean": multitask_missing_labels,
    "masked_categorical_policy_validate_args": masked_policy_gradient,
    "vae_normal_validate_args_kl": vae_with_validated_normal,
    "jit_scripted_focal_loss": scripted_focal_loss,
    "child_sum_tree_lstm_recursive": tree_lstm,
    "deterministic_algorithms_index_add": deterministic_algorithms_on,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ROWS))
def test_models_and_values_are_calm_and_identical(name: str, mode: str) -> None:
    check(ROWS[name], mode)


def test_the_rows_really_meet_what_they_handle() -> None:
    # (A row that stopped meeting its infinity, NaN or idle expert would pass without testing anything.)
    torch.manual_seed(0)
    row = finfo_min_masks(torch.float16)
    model = row.held[0]
    x = torch.randn(3, 5, 8, dtype=torch.float16)
    low = torch.finfo(torch.float16).min
    assert torch.isinf(model.q(x).sum() * 0 + low + low)
    pool = SetPool()
    present = torch.zeros(1, 5, dtype=torch.bool)
    s = pool.score(torch.randn(1, 5, 6)).squeeze(-1).masked_fill(~present, NEG_INF)
    assert torch.isnan(s - s.logsumexp(-1, keepdim=True)).all()
    assert torch.isinf(torch.tensor([0.0, 1.0]).log()).any()
    row = pointer_scores_with_neg_inf()
    assert row.held[0](torch.randn(8, 6), torch.rand(8, 5) > 0.5).isneginf().any()
    row = multitask_missing_labels()
    row.run(lambda: __import__("contextlib").nullcontext())
    assert all(p.grad is not None and p.grad.isfinite().all() for p in row.held[0].parameters())
    row = moe_with_idle_experts()
    row.run(lambda: __import__("contextlib").nullcontext())
    moe = row.held[0]
    grads = [e[0].weight.grad for e in moe.experts.values()]
    assert grads[3] is None and any(g is not None for g in grads)
