"""Healthy training that must stay silent in every mode (session 27): the idioms calm26* did not try.

This file: the harness (each ``run()`` returns what calm26.finish returns, the torch global settings as the loop
saw them at its end, and the weak references left on its models, counted after the watch has exited), gradients
computed another way (per-sample by torch.func, forward-mode AD, autograd.grad, LBFGS under strong Wolfe),
adapters and quantization (LoRA with a zero B, a QAT observer's inf/-inf buffers), and the infinities a healthy
program holds (a CRF's forbidden transitions and its Viterbi, Dijkstra, an infinite horizon, an empty segment's
or set's -inf, invalid candidates and actions, NaN-padded sensor data).
calm_s27_structure.py: what its structure does (complex weights, seeds in forward, hooks, dtype round trips,
swapped conversions, packed sequences, parameters reassigned).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Scenario
from contract.calm26 import finish, training


def torch_settings() -> tuple[Any, ...]:
    """The global switches a user's code may read: a watch that leaves one flipped changes the run."""
    return (torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
            torch.is_autocast_enabled("cpu"), torch.get_num_threads(),
            torch.__future__.get_swap_module_params_on_conversion())


class WeakRefs:
    """The weak references on a model's parameters and gradients, counted when compared (after the watch has
    exited): ``torch.utils.swap_tensors`` (``model.to()`` under the swap future) refuses a tensor that has one."""

    def __init__(self, *objs: Any) -> None:
        self.models = [obj for obj in objs if isinstance(obj, nn.Module)]

    def counts(self) -> list[int]:
        return [weakref.getweakrefcount(t) for model in self.models for p in model.parameters()
                for t in (p, p.grad) if t is not None]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeakRefs) and self.counts() == other.counts()

    __hash__ = None  # type: ignore[assignment]


def settled(scenario: Scenario) -> Scenario:
    """``scenario`` whose result also carries the global settings at the end of its loop, and the weak references
    left on its models."""
    run = scenario.run

    def run_and_read() -> tuple[Any, ...]:
        return run(), torch_settings(), WeakRefs(*scenario.targets)

    return Scenario(scenario.targets, run_and_read, scenario.options)


def _mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2))


# -- gradients computed another way -------------------------------------------------------------------


def _dp_sgd() -> Scenario:
    """DP-SGD: per-sample gradients from ``vmap(grad(functional_call))``, each clipped to norm 1, summed, Gaussian
    noise added (the RNG stream drawn every step), written to ``.grad`` by hand."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    func = torch.func

    def sample_loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = func.functional_call(model, params, (xi.unsqueeze(0),))
        return F.mse_loss(out, yi.unsqueeze(0))

    per_sample = func.vmap(func.grad(sample_loss), in_dims=(None, 0, 0))

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            params = {k: v.detach() for k, v in model.named_parameters()}
            grads = per_sample(params, x, y)
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
            factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
            opt.zero_grad()
            for name, p in model.named_parameters():
                clipped = torch.einsum("b,b...->...", factor, grads[name])
                p.grad = (clipped + 0.5 * torch.randn_like(clipped)) / len(x)
            opt.step()
            losses.append(F.mse_loss(model(x), y).detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _jvp_regulariser() -> Scenario:
    """A Jacobian penalty by forward-mode AD: ``torch.func.jvp`` of the model along a random direction (dual
    tensors through every module), its squared norm added to the loss."""
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    v = torch.randn(6, 8)

    def loss_of(step: int) -> torch.Tensor:
        out, tangent = torch.func.jvp(model, (x,), (v,))
        return F.mse_loss(out, y) + 0.01 * tangent.pow(2).mean()

    return training(model, loss_of)


def _autograd_grad_loop() -> Scenario:
    """``torch.autograd.grad`` instead of ``backward()`` (a parameter unused this step: ``allow_unused``, its
    gradient None made zeros), then a second loss backward'ed separately into the same parameters."""
    torch.manual_seed(0)
    trunk, head, spare = nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(16, 2)
    model = nn.ModuleDict({"trunk": trunk, "head": head, "spare": spare})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)

    def run() -> tuple[Any, ...]:
        losses = []
        params = list(model.parameters())
        for step in range(3):
            h = torch.relu(trunk(x))
            main = F.mse_loss(head(h), y)
            grads = torch.autograd.grad(main, params, retain_graph=True, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = torch.zeros_like(p) if g is None else g
            aux = (spare(h) if step % 2 else head(h)).pow(2).mean()
            aux.backward()
            opt.step()
            losses += [main.detach(), aux.detach()]
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _lbfgs_strong_wolfe() -> Scenario:
    """LBFGS with the strong-Wolfe line search: the closure evaluated several times a step, at trial points."""
    torch.manual_seed(0)
    model = _mlp(8)
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5, history_size=4, line_search_fn="strong_wolfe")
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def run() -> tuple[Any, ...]:
        losses = []

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(3):
            losses.append(opt.step(closure).detach())
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


# -- adapters and quantization ------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen base plus ``B @ A`` with B zero at the start: the adapter's output is exactly zero at step 0."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.drop(x))) * 2.0


def _lora_zero_b() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(nn.Linear(8, 16)), nn.GELU(), LoRALinear(nn.Linear(16, 2)))
    x = torch.randn(6, 8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return training(model, lambda s: model(x).pow(2).mean(), opt)


def _qat_observer() -> Scenario:
    """Quantization-aware training with torch.ao's FakeQuantize: its observers' ``min_val``/``max_val`` buffers
    start at +inf/-inf (torch's own initial values) and become finite on the first observed batch."""
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), FakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255),
                          nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


# -- infinities a healthy program holds ---------------------------------------------------------------


class CRF(nn.Module):
    """A linear-chain CRF whose forbidden transitions are -inf (a buffer added to the learned scores): the
    forward algorithm's logsumexp runs over them; ``decode`` is Viterbi, max over -inf scores."""

    def __init__(self, tags: int = 4) -> None:
        super().__init__()
        self.trans = nn.Parameter(torch.randn(tags, tags) * 0.1)
        forbidden = torch.zeros(tags, tags)
        forbidden[0, 3] = forbidden[3, 1] = float("-inf")
        self.register_buffer("forbidden", forbidden)

    def nll(self, emissions: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        trans = self.trans + self.forbidden
        alpha = emissions[:, 0]
        score = emissions[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for t in range(1, emissions.shape[1]):
            alpha = torch.logsumexp(alpha.unsqueeze(2) + trans, 1) + emissions[:, t]
            score = score + trans[tags[:, t - 1], tags[:, t]] + emissions[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
        return (torch.logsumexp(alpha, 1) - score).mean()

    @torch.no_grad()
    def decode(self, emissions: torch.Tensor) -> torch.Tensor:
        trans = self.trans + self.forbidden
        best, back = emissions[:, 0], []
        for t in range(1, emissions.shape[1]):
            best, idx = (best.unsqueeze(2) + trans).max(1)
            best = best + emissions[:, t]
            back.append(idx)
        path = [best.argmax(1)]
        for idx in reversed(back):
            path.append(idx.gather(1, path[-1].unsqueeze(1)).squeeze(1))
        return torch.stack(path[::-1], 1)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Linear(8, 4)
        self.crf = CRF()

    def forward(self, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.crf.nll(self.emit(x), tags)


def _crf_viterbi() -> Scenario:
    """CRF training over allowed tag paths, then a Viterbi decode in the same cell."""
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(3, 5, 8)
    tags = torch.tensor([[0, 1, 2, 0, 0], [1, 2, 3, 0, 1], [2, 2, 1, 0, 2]])

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(3):
            loss = model(x, tags)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        losses.append(model.crf.decode(model.emit(x)))
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


def _dijkstra(weights: torch.Tensor) -> torch.Tensor:
    """Shortest distances from node 0; unreachable nodes stay inf."""
    n = weights.shape[0]
    dist = torch.full((n,), float("inf"))
    dist[0] = 0.0
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(n):
        u = int(torch.where(done, torch.full_like(dist, float("inf")), dist).argmin())
        if math.isinf(float(dist[u])):
            break
        done[u] = True
        dist = torch.minimum(dist, dist[u] + weights[u])
    return dist


def _dijkstra_loss() -> Scenario:
    """A graph model whose loss weights each node by its shortest-path distance (Dijkstra over inf edge costs,
    unreachable nodes inf, their weight exp(-inf) = 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    feats = torch.randn(5, 4)
    inf = float("inf")
    weights = torch.tensor([[inf, 1.0, 4.0, inf, inf], [inf, inf, 2.0, inf, inf], [inf, inf, inf, inf, inf],
                            [inf, inf, inf, inf, 1.0], [inf, inf, inf, 1.0, inf]])

    def loss_of(step: int) -> torch.Tensor:
        with torch.no_grad():
            importance = torch.exp(-_dijkstra(weights))
        return (model(feats).squeeze(1).pow(2) * importance).sum()

    return training(model, loss_of)


class Horizon(nn.Module):
    """A discount over an "infinite" horizon: the horizon is a buffer holding inf, time clamped to it."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(8, 1)
        self.register_buffer("horizon", torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        steps = torch.minimum(t, self.horizon)
        return self.value(x).squeeze(1) * torch.pow(0.9, steps)


def _inf_horizon() -> Scenario:
    torch.manual_seed(0)
    model = Horizon()
    x, t = torch.randn(6, 8), torch.arange(6.0)
    return training(model, lambda s: model(x, t).pow(2).mean())


def _scatter_amax_empty() -> Scenario:
    """Graph max-pooling as torch_scatter does it: a -inf start, ``scatter_reduce(amax)``, an empty graph's -inf
    replaced by 0 before the head."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"node": nn.Linear(4, 8), "head": nn.Linear(8, 1)})
    feats, graph = torch.randn(7, 4), torch.tensor([0, 0, 1, 1, 1, 3, 3])  # graph 2 has no node

    def loss_of(step: int) -> torch.Tensor:
        h = model["node"](feats)
        pooled = torch.full((4, 8), float("-inf")).scatter_reduce(0, graph.unsqueeze(1).expand_as(h), h, "amax")
        pooled = torch.where(torch.isinf(pooled), torch.zeros_like(pooled), pooled)
        return model["head"](pooled).pow(2).mean()

    return training(model, loss_of)


def _nan_padded_sensors() -> Scenario:
    """Sensor series padded with NaN: normalised with nanmean/nansum statistics, NaN made 0 before the model,
    the loss masked with ``torch.where`` over the valid targets (no NaN reaches a module or a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    x[2:, 6:] = float("nan")
    y[3:, 5:] = float("nan")
    valid = ~torch.isnan(y)

    def loss_of(step: int) -> torch.Tensor:
        mean = torch.nanmean(x, 0, keepdim=True)
        var = torch.nansum((x - mean) ** 2, 0, keepdim=True) / (~torch.isnan(x)).sum(0, keepdim=True)
        inputs = torch.nan_to_num((x - mean) / (var + 1e-5).sqrt())
        err = torch.where(valid, model(inputs) - y, 0.0)
        return err.pow(2).sum() / valid.sum()

    return training(model, loss_of)


class SetPool(nn.Module):
    """Max-pooling over a padded set: an empty set's row is -inf (masked_fill with -inf, then amax), its module's
    output; the parent replaces it with 0 before the head."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)


class SetNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(4, 8), SetPool(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(self.enc(x), mask)
        return self.head(torch.where(torch.isinf(pooled), torch.zeros_like(pooled), pooled))


def _set_pool_empty_set() -> Scenario:
    torch.manual_seed(0)
    model = SetNet()
    x, mask = torch.randn(4, 5, 4), torch.rand(4, 5) > 0.3
    mask[2] = False
    return training(model, lambda s: model(x, mask).pow(2).mean())


class Scorer(nn.Module):
    """Log-scores of the candidates, -inf for the invalid ones (``torch.where`` with an infinite scalar)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, self.fc(x).squeeze(-1), float("-inf"))


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = Scorer()

    def forward(self, x: torch.Tensor, valid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.score(x, valid), target)


def _listwise_ranking() -> Scenario:
    """A listwise ranking loss (softmax cross-entropy over each list) with invalid candidates at -inf."""
    torch.manual_seed(0)
    model = Ranker()
    x, valid = torch.randn(3, 6, 8), torch.rand(3, 6) > 0.3
    valid[:, 0] = True
    target = torch.zeros(3, dtype=torch.long)
    return training(model, lambda s: model(x, valid, target))


class Policy(nn.Module):
    """Invalid-action masking inside the policy's forward: its output holds -inf at the illegal actions."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))).masked_fill(~legal, float("-inf"))


def _ppo_action_mask() -> Scenario:
    """A PPO update over ``Categorical(logits=...)`` of the masked logits: sampled actions, the clipped ratio, an
    entropy bonus (torch clamps the -inf logits to finfo.min for it)."""
    torch.manual_seed(0)
    model = Policy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, legal = torch.randn(6, 8), torch.rand(6, 5) > 0.4
    legal[:, 0] = True

    def run() -> tuple[Any, ...]:
        out = []
        for _ in range(3):
            dist = torch.distributions.Categorical(logits=model(x, legal))
            action = dist.sample()
            old = dist.log_prob(action).detach()
            ratio = torch.exp(dist.log_prob(action) - old)
            advantage = torch.randn(6)
            loss = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean()
            loss = loss - 0.01 * dist.entropy().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out += [loss.detach(), action]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


ROWS = {
    "dp-sgd-vmap-per-sample": _dp_sgd,
    "jvp-jacobian-penalty": _jvp_regulariser,
    "autograd-grad-then-second-backward": _autograd_grad_loop,
    "lbfgs-strong-wolfe": _lbfgs_strong_wolfe,
    "lora-zero-b": _lora_zero_b,
    "qat-fake-quantize-observer": _qat_observer,
    "crf-forbidden-transitions-viterbi": _crf_viterbi,
    "dijkstra-weighted-loss": _dijkstra_loss,
    "inf-horizon-buffer": _inf_horizon,
    "scatter-amax-empty-graph": _scatter_amax_empty,
    "nan-padded-sensors": _nan_padded_sensors,
}

CASES = [
    *(Case(f"calm_s27_{name}", lambda build=build: settled(build()), None, benign=0) for name, build in ROWS.items()),
    # A module output holding a deliberate -inf (masked_fill / where with an infinite scalar): one benign event.
    Case("calm_s27_set-pool-empty-set-neginf-output", lambda: settled(_set_pool_empty_set()), None, benign=1),
    Case("calm_s27_listwise-ranking-invalid-candidates", lambda: settled(_listwise_ranking()), None, benign=1),
    # The policy's -inf output at every step's root-output check: one benign event per watch in every mode (the
    # tiered watch replays it each step, and records its place once, as the op tracer does).
    Case("calm_s27_ppo-action-mask-in-policy", lambda: settled(_ppo_action_mask()), None, benign=1),
]
