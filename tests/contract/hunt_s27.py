"""hunt_s27, where a value is made that earlier hunts did not try (when: hunt_s27b), each incident with its twin.

Cross-attention written with ``nn.MultiheadAttention`` (its default ``need_weights=True`` takes the explicit softmax,
not SDPA's safe one) over a memory row fully masked; an LSQ quantiser's custom ``autograd.Function`` dividing by a
step size initialised, at step 0, from a zero-initialised weight; GeM pooling clamped at 0, its modules in a
``ModuleDict`` and exponents in a ``ParameterList``, whose backward at a black image reaches two pools (the later one's
backward runs first); an ALBERT-style block shared by two calls of one forward, only the second overflowing; a
``nn.Softmax`` built inside ``forward`` each call (never a child) over an empty document; DANN's normalised gradient
reversal, whose custom backward divides by the norm of a gradient the schedule's lambda of 0 made 0 at step 0. Each
twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- cross-attention over a fully masked memory
class CrossAttentionDecoder(nn.Module):
    """A captioner's decoder written by hand: self-attention-free, one cross-attention over the image memory with
    ``nn.MultiheadAttention``'s defaults (``need_weights=True``: the explicit softmax, not SDPA's safe one)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cross, self.head = nn.Embedding(7, 8), nn.MultiheadAttention(8, 2, batch_first=True), \
            nn.Linear(8, 7)

    def forward(self, tokens: torch.Tensor, memory: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q = self.embed(tokens)
        attended, _ = self.cross(q, memory, memory, key_padding_mask=pad)  # producer: cross attention
        return self.head(q + attended)


def _cross_attention(keep_one: bool) -> Scenario:
    """Region features padded to 4 per image; step 1's second image had no detected region (every slot padded):
    the softmax over four ``-inf`` is ``0 / 0``. The twin always keeps a global (first) slot, as captioners do."""
    torch.manual_seed(0)
    model = CrossAttentionDecoder()
    tokens, memories = [torch.randint(0, 7, (2, 3)) for _ in range(4)], _batches(2, 4, 8)
    pads = [torch.tensor([[False, False, True, True], [False, True, True, True]]) for _ in range(4)]
    pads[1][1] = True
    if keep_one:
        for pad in pads:
            pad[:, 0] = False
    targets = [torch.randint(0, 7, (2, 3)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step], memories[step], pads[step]),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1), targets[step].flatten()))


# ---------------------------------------------------------------- LSQ step size from a zero-initialised weight
class LSQRound(torch.autograd.Function):
    """Learned step size quantisation: ``round(clamp(w / s)) * s`` with the straight-through estimator."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        scaled = w / s  # producer: lsq divide
        ctx.save_for_backward(scaled)
        return torch.round(scaled.clamp(-8, 7)) * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (scaled,) = ctx.saved_tensors
        inside = (scaled >= -8) & (scaled <= 7)
        return grad * inside, (grad * (torch.round(scaled.clamp(-8, 7)) - scaled * inside)).sum()


class QuantLinear(nn.Linear):
    """The step size is initialised at the first forward from the weight, ``2 mean|w| / sqrt(Qp)`` (LSQ's paper)."""

    def __init__(self, n_in: int, n_out: int, floor: float) -> None:
        super().__init__(n_in, n_out)
        self.step_size, self.floor, self.ready = nn.Parameter(torch.ones(())), floor, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ready:
            with torch.no_grad():
                self.step_size.copy_((2 * self.weight.abs().mean() / math.sqrt(7)).clamp(min=self.floor))
            self.ready = True
        return F.linear(x, LSQRound.apply(self.weight, self.step_size), self.bias)


class QuantResidual(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.inp, self.proj, self.head = nn.Linear(4, 8), QuantLinear(8, 8, floor), nn.Linear(8, 2)
        with torch.no_grad():
            self.proj.weight.zero_()  # zero-initialised residual branch (a Fixup/ReZero habit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.head(h + self.proj(h))


def _lsq(floor: float) -> Scenario:
    """The quantised projection is zero-initialised, so its step size starts at 0 and the very first forward divides
    ``0 / 0`` (step 0: nothing is known good yet). The twin floors the step size at 1e-8."""
    torch.manual_seed(0)
    model = QuantResidual(floor)
    xs, ys = _batches(6, 4), _batches(6, 2)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- GeM pooling over a dead channel, in a ModuleDict
class GeM(nn.Module):
    """Generalised-mean pooling ``mean(x^p)^(1/p)``; the reference clamps at an eps, the slip clamps at 0."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor

    def forward(self, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=self.floor).pow(p).mean((-2, -1)).pow(1.0 / p)  # producer: gem root


class Retrieval(nn.Module):
    """Two stages, each pooled by its own GeM (a ``ModuleDict``), their exponents learned in a ``ParameterList``."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Conv2d(3, 4, 3, padding=1, bias=False),
                                     nn.Conv2d(4, 4, 3, padding=1, stride=2, bias=False)])
        self.pools = nn.ModuleDict({"fine": GeM(floor), "coarse": GeM(floor)})
        self.exponents = nn.ParameterList([nn.Parameter(torch.tensor(3.0)), nn.Parameter(torch.tensor(3.0))])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fine = torch.relu(self.stages[0](x))
        coarse = torch.relu(self.stages[1](fine))
        pooled = [self.pools["fine"](fine, self.exponents[0]), self.pools["coarse"](coarse, self.exponents[1])]
        return self.head(torch.cat(pooled, -1))


def _gem(floor: float) -> Scenario:
    """Step 1's batch holds a black (all-zero) image: the convolutions have no bias (a BatchNorm-era habit), every
    feature of it is 0, its pooled means are 0 and the gradient of ``0^(1/p)`` is inf (NaN once multiplied). The
    backward reaches the coarse stage's pool first. The twin clamps at 1e-6, as GeM's reference does."""
    torch.manual_seed(0)
    model = Retrieval(floor)
    xs, ys = _batches(3, 3, 12, 12), _batches(3, 4)
    xs[1][2] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- an ALBERT-style block shared by two calls
class SharedBlock(nn.Module):
    """A residual block with an exponential gate (``x + exp(W x)``); its output feeds its next call."""

    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.gate, self.clamped = nn.Linear(4, 4), clamped
        with torch.no_grad():
            self.gate.weight.copy_(torch.eye(4))
            self.gate.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.gate(x)
        if self.clamped:
            z = z.clamp(max=30.0)
        return x + torch.exp(z)  # producer: shared gate


class Albert(nn.Module):
    """ALBERT's parameter sharing: one block applied twice in a forward."""

    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.inp, self.layer, self.out = nn.Linear(4, 4), SharedBlock(clamped), nn.Linear(4, 1)
        with torch.no_grad():
            self.inp.weight.copy_(torch.eye(4) * 3.0)
            self.inp.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(2):
            h = self.layer(h)
        return self.out(torch.tanh(h))


def _albert(clamped: bool) -> Scenario:
    """Inputs of about 0.1 make the first call's gate about 0.3 and the second's below 60. Step 1 holds a spike of
    5: the first call's ``exp(15)`` is finite, 3.3e6, and the second call's ``exp(3.3e6)`` overflows: the same
    module, its second call. The twin clamps the gate at 30."""
    torch.manual_seed(0)
    model = Albert(clamped)
    xs, ys = [torch.randn(4, 4) * 0.1 for _ in range(4)], _batches(4, 1)
    xs[1][2, 1] = 5.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=1e-3)


# ---------------------------------------------------------------- a Softmax module built inside forward
class AttentionPool(nn.Module):
    """Attention pooling over a padded sequence; the softmax is a fresh ``nn.Softmax`` each call (never a child)."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.score, self.fill = nn.Linear(4, 1), fill

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.score(x).squeeze(-1).masked_fill(~mask, self.fill)
        weights = nn.Softmax(dim=-1)(scores)  # producer: fresh softmax
        return (weights.unsqueeze(-1) * x).sum(1)


class PooledClassifier(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.enc, self.pool, self.head = nn.Linear(4, 4), AttentionPool(fill), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.tanh(self.enc(x)), mask))


def _fresh_softmax(fill: float) -> Scenario:
    """Step 2's batch holds an empty document (every position padding): the softmax of a row of ``-inf`` is NaN.
    The twin fills with ``finfo.min``."""
    torch.manual_seed(0)
    model = PooledClassifier(fill)
    xs, ys = _batches(3, 5, 4), [torch.randint(0, 2, (3,)) for _ in range(4)]
    masks = [torch.ones(3, 5, dtype=torch.bool) for _ in range(4)]
    for mask in masks:
        mask[1, 3:] = False
    masks[2][0] = False
    return _loop(model, lambda step: (xs[step], masks[step]), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- DANN's normalised gradient reversal at step 0
class NormalisedReversal(torch.autograd.Function):
    """A gradient reversal layer that also normalises the reversed gradient (a DANN variant that keeps the domain
    gradient's scale apart from the task's): ``-g / |g|``, the twin ``-g / (|g| + eps)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        ctx.eps = eps
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return -grad / (grad.norm() + ctx.eps), None  # producer: reversal backward


class DomainAdversarial(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.features, self.label, self.domain = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.features(x))
        return self.label(h), self.domain(NormalisedReversal.apply(h, self.eps))


def _dann(eps: float) -> Scenario:
    """DANN's schedule ``lambda = 2 / (1 + exp(-10 p)) - 1`` weighs the domain loss, and is exactly 0 at step 0: the
    gradient reaching the reversal is 0 and its normalisation ``0 / 0``, in the very first backward."""
    torch.manual_seed(0)
    model = DomainAdversarial(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys, ds = _batches(6, 4), [torch.randint(0, 2, (6,)) for _ in range(4)], [torch.rand(6, 1) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            lam = 2 / (1 + math.exp(-10 * step / 4)) - 1
            label, domain = model(xs[step])
            loss = F.cross_entropy(label, ys[step]) + lam * F.binary_cross_entropy_with_logits(domain, ds[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s27_cross_attention_need_weights_over_a_fully_masked_memory", lambda: _cross_attention(False),
         Expect("forward", "cross", "MultiheadAttention", step=1, op="aten._softmax.default", marker="cross attention",
                cause="masked-softmax")),
    Case("hunt_s27_cross_attention_keeps_a_global_slot_healthy", lambda: _cross_attention(True), None),
    Case("hunt_s27_lsq_step_size_from_a_zero_initialised_weight_at_step_0", lambda: _lsq(0.0),
         Expect("forward", "proj", "QuantLinear", step=0, op="aten.div.Tensor", marker="lsq divide",
                cause="division-by-zero")),
    Case("hunt_s27_lsq_step_size_floored_healthy", lambda: _lsq(1e-8), None),
    Case("hunt_s27_gem_pool_in_a_module_dict_clamped_at_0_backward_of_a_black_image", lambda: _gem(0.0),
         Expect("backward", "pools.coarse", "GeM", step=1, op="aten.pow.Tensor_Tensor", marker="gem root",
                cause="pow-domain")),
    Case("hunt_s27_gem_pool_clamped_at_eps_healthy", lambda: _gem(1e-6), None),
    Case("hunt_s27_albert_shared_block_overflows_on_its_second_call", lambda: _albert(False),
         Expect("forward", "layer", "SharedBlock", step=1, op="aten.exp.default", marker="shared gate",
                cause="exp-overflow")),
    Case("hunt_s27_albert_shared_block_gate_clamped_healthy", lambda: _albert(True), None),
    Case("hunt_s27_softmax_module_built_inside_forward_over_an_empty_document", lambda: _fresh_softmax(-math.inf),
         Expect("forward", "pool", "AttentionPool", step=2, op="aten._softmax.default", marker="fresh softmax",
                cause="masked-softmax")),
    Case("hunt_s27_softmax_module_built_inside_forward_finfo_min_healthy",
         lambda: _fresh_softmax(torch.finfo(torch.float32).min), None),
    Case("hunt_s27_dann_normalised_gradient_reversal_at_lambda_0_of_step_0", lambda: _dann(0.0),
         Expect("backward", "", "DomainAdversarial", step=0, op="aten.div.Tensor", marker="reversal backward",
                cause="division-by-zero")),
    Case("hunt_s27_dann_normalised_gradient_reversal_eps_healthy", lambda: _dann(1e-12), None),
]
