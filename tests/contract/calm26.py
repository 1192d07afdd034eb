"""Healthy training that must stay silent in every mode, and leave the user's run exactly as it was unwatched.

Each row is a loop a user leaves the watch on for. Its ``run()`` returns the losses, then everything the user could
compare after the loop (parameters, gradients, buffers, optimizer state, the global RNG state) and a
:class:`Leftovers` of the model and optimizer: ``tests/test_contract.py`` compares a silent row's result with an
unwatched run's *after* the watch has exited, so that comparison reads the hooks and attributes left behind then.
``benign=0``: not even a benign event. This file: the harness, and the values a healthy program makes or meets
(fp8 rounding, infinite scalars and bounds, -inf masks in bf16, empty bags, a GP's Cholesky, optimizer options);
calm26_structure.py: what its structure does (sparse graphs, lazy and growing models, hooks, subclasses).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def state_of(*objs: Any) -> list[torch.Tensor]:
    """Parameters, gradients and buffers of a model; an optimizer's state and learning rates."""
    found: list[torch.Tensor] = []
    for obj in objs:
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                found += [p.detach().clone(), torch.empty(0) if p.grad is None else _dense(p.grad).clone()]
            found += [b.clone() for b in obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state_dict()["state"].values():
                found += [torch.as_tensor(v).clone() for v in state.values()
                          if isinstance(v, (torch.Tensor, int, float))]
            found += [torch.as_tensor(g["lr"]).clone() for g in obj.param_groups]
    return found


def _traces(obj: Any) -> list[Any]:
    if isinstance(obj, nn.Module):
        found: list[Any] = []
        for name, m in obj.named_modules():
            found.append((name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                          len(m._backward_pre_hooks), len(m._state_dict_hooks), sorted(vars(m))))
        for name, p in obj.named_parameters():
            found.append((name, len(p._backward_hooks or {}), type(p), p.requires_grad))
        return found
    if isinstance(obj, torch.optim.Optimizer):
        return [sorted(vars(obj)), len(obj._optimizer_step_pre_hooks), len(obj._optimizer_step_post_hooks)]
    return [sorted(vars(obj))]


class Leftovers:
    """Hooks and instance attributes on the user's objects, read when compared (after the watch has exited)."""

    def __init__(self, *objs: Any) -> None:
        self.objs = objs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Leftovers) and [_traces(o) for o in self.objs] == [_traces(o) for o in other.objs]

    __hash__ = None  # type: ignore[assignment]


def finish(losses: list[torch.Tensor], *held: Any) -> tuple[Any, ...]:
    """What a row's ``run()`` returns: losses, state, the RNG stream's state, and what is left on ``held``."""
    return losses, state_of(*held), torch.get_rng_state(), Leftovers(*held)


def training(model: nn.Module, loss_of, opt: torch.optim.Optimizer | None = None, steps: int = 3,
             targets: tuple[Any, ...] | None = None) -> Scenario:
    """``steps`` steps of ``loss_of(step)`` (SGD with momentum unless ``opt``)."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def run() -> tuple[Any, ...]:
        losses = []
        for step in range(steps):
            loss = loss_of(step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return finish(losses, model, opt)

    return Scenario(targets if targets is not None else (model, opt), run)


# -- values a healthy program makes or meets -------------------------------------------------------


class Fp8FakeQuant(nn.Module):
    """Simulated fp8 training: activations rounded through float8_e4m3fn (straight-through)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        q = h.clamp(-448, 448).to(torch.float8_e4m3fn)
        h = h + (q.to(h.dtype) - h).detach()
        return self.b(torch.relu(h))


class Fp8Cast(nn.Module):
    """Casts its input to a float8 dtype (fp8 activations handed on, as an fp8 matmul's input): its output is
    float8, which torch cannot reduce (no aminmax)."""

    def __init__(self, dtype: torch.dtype, scale: float = 1.0) -> None:
        super().__init__()
        self.dtype, self.scale = dtype, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).to(self.dtype)  # producer: fp8 cast


class Widen(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)


def _fp8_outputs(scale: float = 1.0) -> Scenario:
    """Modules whose outputs (and the gradients flowing into them) are float8_e4m3fn and float8_e5m2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Fp8Cast(torch.float8_e4m3fn), Widen(), nn.Linear(8, 8),
                          Fp8Cast(torch.float8_e5m2, scale), Widen(), nn.Linear(8, 2))
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


class MXQuant(nn.Module):
    """MX-style 4-bit codes: two per byte as packed float4_e2m1fn_x2, a power-of-two scale per row as
    float8_e8m0fnu (torch has neither a reduction nor a conversion for float4)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(1, keepdim=True).clamp(min=1e-6) / 7)))
        codes = (x / scale).round().clamp(-7, 7).to(torch.int8) + 8  # 1..15, one nibble
        packed = (codes[:, 0::2] * 16 + codes[:, 1::2]).to(torch.uint8)
        return packed.view(torch.float4_e2m1fn_x2), scale.to(torch.float8_e8m0fnu)


class MXDequant(nn.Module):
    def forward(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        byte = packed.view(torch.uint8).long()
        codes = torch.stack([byte // 16, byte % 16], -1).flatten(1).float() - 8
        return codes * scale.float()


def _mx4() -> Scenario:
    """Activations rounded through 4-bit MX codes (straight-through), the packed codes a module output."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 8), "q": MXQuant(), "dq": MXDequant(), "b": nn.Linear(8, 2)})
    x = torch.randn(6, 8)

    def loss_of(step: int) -> torch.Tensor:
        h = model["a"](x)
        h = h + (model["dq"](*model["q"](h.detach())) - h).detach()
        return model["b"](h).pow(2).mean()

    return training(model, loss_of)


def _fp8() -> Scenario:
    torch.manual_seed(0)
    model = Fp8FakeQuant()
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean())


def _grad_norm_logged() -> Scenario:
    """``clip_grad_norm_(max_norm=inf)``: the norm logged, nothing clipped; and the inf-norm, also logged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(6, 8)

    def run() -> tuple[Any, ...]:
        out = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
            top = nn.utils.clip_grad_norm_(model.parameters(), float("inf"), norm_type=float("inf"))
            opt.step()
            out += [loss.detach(), norm, top]
        return finish(out, model, opt)

    return Scenario((model, opt), run)


class MaxNormEmbedding(nn.Module):
    """``nn.Embedding(max_norm=1)``: the forward renormalises the rows it looks up, writing the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, max_norm=1.0, padding_idx=0)
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


def _max_norm_embedding() -> Scenario:
    torch.manual_seed(0)
    model = MaxNormEmbedding()
    with torch.no_grad():
        model.emb.weight.mul_(4)
    ids = torch.randint(0, 10, (5, 4))
    return training(model, lambda s: model(ids).pow(2).mean())


class Bags(nn.Module):
    """EmbeddingBag with empty bags (repeated offsets): max and mean of nothing are 0, per-sample weights sum."""

    def __init__(self) -> None:
        super().__init__()
        self.max = nn.EmbeddingBag(12, 6, mode="max")
        self.sum = nn.EmbeddingBag(12, 6, mode="sum")
        self.head = nn.Linear(12, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.max(ids, offsets), self.sum(ids, offsets, per_sample_weights=weights)], 1))


def _empty_bags() -> Scenario:
    torch.manual_seed(0)
    model = Bags()
    ids, offsets = torch.randint(0, 12, (7,)), torch.tensor([0, 2, 2, 5, 7])  # bags 1 and 4 are empty
    weights = torch.rand(7)
    return training(model, lambda s: model(ids, offsets, weights).pow(2).mean())


class GP(nn.Module):
    """An exact GP's negative marginal likelihood: RBF kernel, Cholesky with jitter, solve and log-det."""

    def __init__(self) -> None:
        super().__init__()
        self.log_length = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-2.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, x).pow(2)
        k = torch.exp(-0.5 * d / self.log_length.exp() ** 2)
        k = k + (self.log_noise.exp() + 1e-6) * torch.eye(len(x))
        chol = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], chol)
        return 0.5 * (y[:, None] * alpha).sum() + chol.diagonal().log().sum()


def _gp() -> Scenario:
    torch.manual_seed(0)
    model = GP()
    x = torch.randn(12, 2)
    x[3] = x[2]  # a duplicate input: the kernel is singular without the noise
    y = torch.sin(x.sum(1))
    return training(model, lambda s: model(x, y), opt=torch.optim.Adam(model.parameters(), lr=0.05))


def _optimizer_options() -> Scenario:
    """Adam with a tensor learning rate over three groups: one frozen by lr 0, one with weight decay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    groups = [{"params": model[0].parameters(), "lr": 0.0},
              {"params": model[2].parameters(), "weight_decay": 0.1},
              {"params": model[4].parameters()}]
    opt = torch.optim.Adam(groups, lr=torch.tensor(0.01), foreach=False)
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean(), opt=opt)


def _fused_adamw() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x).pow(2).mean(), opt=opt)


class InPlaceViews(nn.Module):
    """In-place ops on views of an activation: a slice scaled, a diagonal shifted, a transposed column
    shifted, a narrowed ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).view(-1, 6, 6)
        h[:, :2].mul_(0.5)
        h.diagonal(dim1=1, dim2=2).add_(1.0)
        h.transpose(1, 2)[:, 0].add_(0.1)
        h.narrow(2, 3, 3).relu_()
        return self.b(h.view(-1, 6))


def _in_place_views() -> Scenario:
    torch.manual_seed(0)
    model = InPlaceViews()
    x = torch.randn(12, 6)
    return training(model, lambda s: model(x).pow(2).mean())


class Bf16FinfoMask(nn.Module):
    """Padding masked with float32's finfo.min under bf16 autocast: in bfloat16 that rounds to -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = (1.0 - keep[:, None, :].float()) * torch.finfo(torch.float32).min
        scores = q @ k.transpose(-1, -2) + bias.to(q.dtype)
        return self.out(scores.softmax(-1) @ v)


def _bf16_finfo_mask() -> Scenario:
    torch.manual_seed(0)
    model = Bf16FinfoMask()
    x = torch.randn(3, 5, 8)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 2:] = False

    def loss_of(step: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, keep).float().pow(2).mean()

    return training(model, loss_of)


def _token_normalised_accumulation() -> Scenario:
    """Accumulation as HF now does it: summed token losses over the step's token count; one micro-batch has
    every target ignored (its sum is 0, its gradient 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 20, (3, 2, 6))
    labels = torch.randint(0, 20, (3, 2, 6))
    labels[1] = -100

    def run() -> tuple[Any, ...]:
        losses = []
        for _ in range(2):
            tokens = (labels != -100).sum()
            opt.zero_grad()
            for micro in range(3):
                logits = model(ids[micro])
                loss = F.cross_entropy(logits.flatten(0, 1), labels[micro].flatten(), reduction="sum") / tokens
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return finish(losses, model, opt)

    return Scenario((model, opt), run)


class Temperature(nn.Module):
    """Softmax at a temperature the caller may set to inf (uniform weights), clamps with infinite bounds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = self.lin(x).clamp(min=float("-inf"), max=float("inf"))
        weights = F.softmax(logits / temperature, -1)
        return (weights * logits).sum(-1) + F.hardtanh(logits, float("-inf"), 1.0).mean(-1)


def _infinite_scalars() -> Scenario:
    torch.manual_seed(0)
    model = Temperature()
    x = torch.randn(6, 8)
    return training(model, lambda s: model(x, float("inf") if s % 2 else 1.0).pow(2).mean())


def _gumbel_hard() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    target = torch.randn(4)
    return training(model, lambda s: (F.gumbel_softmax(model(x), tau=0.5, hard=True) * target).sum(-1).pow(2).mean())


class NonPersistentMask(nn.Module):
    """A causal -inf mask held as a non-persistent buffer (not in the state_dict), applied in the module's code."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.register_buffer("mask", torch.full((5, 5), float("-inf")).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return (q @ k.transpose(-1, -2) + self.mask).softmax(-1) @ v


def _non_persistent_mask() -> Scenario:
    torch.manual_seed(0)
    model = NonPersistentMask()
    x = torch.randn(3, 5, 8)
    return training(model, lambda s: model(x).pow(2).mean())


class BiasedAttention(nn.Module):
    """Attention given one additive ``attn_bias`` (xformers' and MPT's name): ALiBi's distance penalty with the
    causal -inf folded in."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out((q @ k.transpose(-1, -2) / 8 ** 0.5 + attn_bias).softmax(-1) @ v)


def _alibi_attn_bias() -> Scenario:
    torch.manual_seed(0)
    model = BiasedAttention()
    x = torch.randn(3, 5, 8)
    distance = torch.arange(5)[None, :] - torch.arange(5)[:, None]
    bias = (-0.5 * distance.abs().float()).masked_fill(distance > 0, float("-inf"))
    return training(model, lambda s: model(x, attn_bias=bias).pow(2).mean())


class Cox(nn.Module):
    """Survival analysis (Cox partial likelihood): risk scores sorted by time, logcumsumexp of the risk set."""

    def __init__(self) -> None:
        super().__init__()
        self.risk = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
        r = self.risk(x).squeeze(-1)
        log_risk_set = torch.logcumsumexp(r.flip(0), 0).flip(0)
        return -((r - log_risk_set) * event).sum() / event.sum().clamp(min=1)


def _cox() -> Scenario:
    torch.manual_seed(0)
    model = Cox()
    x, event = torch.randn(10, 4), (torch.rand(10) > 0.4).float()
    return training(model, lambda s: model(x, event))


ROWS = {
    "fp8-fake-quant": _fp8,
    "fp8-module-outputs": _fp8_outputs,
    "mx-float4-codes-and-e8m0-scales": _mx4,
    "grad-norm-logged-max-norm-inf": _grad_norm_logged,
    "embedding-max-norm-renorm": _max_norm_embedding,
    "embedding-bag-empty-bags": _empty_bags,
    "gp-cholesky-jitter": _gp,
    "adam-tensor-lr-frozen-group": _optimizer_options,
    "fused-adamw": _fused_adamw,
    "in-place-views": _in_place_views,
    "bf16-finfo-min-mask": _bf16_finfo_mask,
    "token-normalised-accumulation": _token_normalised_accumulation,
    "infinite-scalars": _infinite_scalars,
    "gumbel-hard": _gumbel_hard,
    "non-persistent-inf-mask-buffer": _non_persistent_mask,
    "cox-logcumsumexp": _cox,
}

CASES = [
    *(Case(f"calm26_{name}", build, None, benign=0) for name, build in ROWS.items()),
    # Named as an attention bias, the ALiBi's causal -inf is deliberate (localize/ops/masks.py): one benign event.
    Case("calm26_alibi-attn-bias", _alibi_attn_bias, None, benign=1),
    # The broken twin of fp8-module-outputs: 1e6 overflows float8_e5m2 (max 57344) to +-inf, named at the cast.
    Case("calm26_fp8-cast-overflows", lambda: _fp8_outputs(1e6),
         Expect("forward", "4", "Fp8Cast", op="aten._to_copy.default", marker="fp8 cast",
                kinds=frozenset({"+inf", "-inf"}))),
]
