"""Reported NaN incidents of families the other rows do not hold, each with the healthy twin its users apply (hunt23).

Architectures: a Mixture-of-Experts router whose capacity mask leaves a token no expert (softmax over a row of -inf);
a capsule network's squash of a zero capsule (``|s|^2 / (1 + |s|^2) * s / |s|``); BigVGAN's Snake activation
``x + sin^2(a x) / a`` whose alpha was initialised for the log-scale variant (zeros) and used linearly; compact
bilinear pooling's signed square root as a new-style ``autograd.Function`` (``setup_context``) whose hand-written
backward divides by the saved output of a blank sample; a block under ``checkpoint_sequential`` (non-reentrant and
reentrant) whose hand normalisation's backward meets a zero row; a diagonal state-space layer's zero-order hold
``(exp(dt A) - 1) / A`` at an eigenvalue initialised to 0; Gemma 2's attention soft-capping "disabled" by a cap of 0.0
(tanh absorbs the forward's infinities, the division's backward is 0 / 0). Hooks: a backward pre-hook and a full
backward hook, registered by the root on a head, rescaling a switched-off head's gradient by a norm of 0 (the hooked
module is named). Mixed precision on the CPU: a SAC policy under bfloat16 autocast recovering the pre-tanh action by
``atanh`` of an action that bfloat16 rounded to exactly 1; a model cast to float16 whole (``.half()``, no GradScaler)
whose summed MSE overflows 65504 on a batch in raw units; activations saved in float16 by ``saved_tensors_hooks``,
one of which overflows (the replays pack as the call did: SAVED_HOOKS).
Each with the fix its users apply: the twin must stay silent and bit-identical, in every mode. The loss code, the
loop's data and the optimizers: tests/contract/hunt23b.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- MoE: a token every expert is full for
class CapacityRouter(nn.Module):
    """Top-1 routing with an expert capacity: the experts already full for a token are masked with -inf before the
    softmax. A token late in a crowded batch finds every expert full: the softmax of a row of -inf is 0 / 0. The twin
    masks with the dtype's lowest finite value and drops that token (its routing weight 0), as Switch does."""

    def __init__(self, drop: bool) -> None:
        super().__init__()
        self.gate, self.drop = nn.Linear(8, 4), drop

    def forward(self, x: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.drop:
            probs = logits.masked_fill(full, torch.finfo(logits.dtype).min).softmax(-1)
            return probs * (~full).any(-1, keepdim=True)
        return logits.masked_fill(full, float("-inf")).softmax(-1)  # producer: router softmax


class MoeLayer(nn.Module):
    def __init__(self, drop: bool) -> None:
        super().__init__()
        self.router = CapacityRouter(drop)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        probs = self.router(x, full)
        weight, index = probs.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = index == e
            if bool(hit.any()):
                out = out.index_put((hit,), weight[hit, None] * expert(x[hit]))
        return x + out


class MoeNet(nn.Module):
    def __init__(self, drop: bool) -> None:
        super().__init__()
        self.embed, self.moe, self.head = nn.Linear(5, 8), MoeLayer(drop), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(torch.tanh(self.embed(x)), full))


def _moe(drop: bool) -> Scenario:
    torch.manual_seed(0)
    model = MoeNet(drop)
    xs, ys = _batches(6, 5), _batches(6, 1)
    fulls = [torch.zeros(6, 4, dtype=torch.bool) for _ in range(4)]
    fulls[1][4:, 2] = True  # expert 2 filled up early in the batch
    fulls[2][3:, :2] = True
    fulls[2][5] = True  # the last token of a crowded batch: every expert is at capacity
    return _loop(model, lambda step: (xs[step], fulls[step]), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- capsules: the squash of a zero capsule
class PrimaryCapsules(nn.Module):
    """8 capsules of 4 dimensions from a bias-free projection, squashed ``|s|^2 / (1 + |s|^2) * s / |s|``; a blank
    input makes every capsule exactly 0: 0 / 0. The twin puts eps under the root, as most implementations do."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.proj, self.eps = nn.Linear(12, 32, bias=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.proj(x).view(-1, 8, 4)
        n2 = (s * s).sum(-1, keepdim=True)
        return n2 / (1 + n2) * s / torch.sqrt(n2 + self.eps)  # producer: capsule squash


class CapsuleClassifier(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.caps, self.head = PrimaryCapsules(eps), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.caps(x).flatten(1))


def _capsule(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = CapsuleClassifier(eps)
    xs, labels = _batches(4, 12), [torch.randint(0, 3, (4,)) for _ in range(4)]
    xs[1][2] = 0.0  # a blank scan
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, labels[step]))


# ---------------------------------------------------------------- BigVGAN's Snake with alpha initialised to zeros
class Snake(nn.Module):
    """``x + sin^2(alpha x) / alpha`` per channel. BigVGAN initialises alpha to zeros when ``alpha_logscale`` is set
    and then uses ``exp(alpha)``; this copy kept the zeros and uses alpha as is: sin^2(0) / 0 is 0 / 0. The twin adds
    BigVGAN's ``no_div_by_zero`` (1e-9)."""

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.alpha, self.eps = nn.Parameter(torch.zeros(channels)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.alpha[None, :, None]
        return x + torch.sin(a * x) ** 2 / (a + self.eps)  # producer: snake


def _snake(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 4, 5, padding=2), Snake(4, eps), nn.Conv1d(4, 1, 5, padding=2))
    waves, targets = _batches(2, 1, 32), _batches(2, 1, 32)
    return _loop(model, lambda step: (waves[step],), lambda out, step: F.l1_loss(out, targets[step]))


# ---------------------------------------------------------------- bilinear pooling's signed sqrt, a new-style Function
class SignedSqrt(torch.autograd.Function):
    """``sign(x) sqrt(|x|)`` with its derivative by hand, ``g / (2 sqrt(|x|))``, from the saved output: a feature of
    exactly 0 divides by 0. Written in the new style (``setup_context``), as torch.func asks."""

    @staticmethod
    def forward(x: torch.Tensor, eps: float) -> torch.Tensor:
        return x.sign() * x.abs().sqrt()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(output)
        ctx.eps = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        return grad / (2 * out.abs() + ctx.eps), None  # producer: signed sqrt backward


class BilinearPool(nn.Module):
    """Compact bilinear pooling's power normalisation: signed square root, then L2. The twin: eps in the backward."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.project, self.eps = nn.Linear(6, 8, bias=False), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(SignedSqrt.apply(self.project(x), self.eps), dim=-1)


def _signed_sqrt(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(BilinearPool(eps), nn.Linear(8, 3))
    xs, labels = _batches(4, 6), [torch.randint(0, 3, (4,)) for _ in range(4)]
    xs[2][1] = 0.0  # a blank sample: every pooled feature is 0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, labels[step]))


# ---------------------------------------------------------------- checkpoint_sequential over a hand normalisation
class HandRowNorm(nn.Module):
    """``x / (sqrt(sum(x^2)) + 1e-6)``, eps outside the root: a zero row is finite forward, and sqrt's backward at 0
    is inf (0 * inf: NaN). The twin: ``F.normalize``."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.builtin = builtin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.builtin:
            return F.normalize(x, dim=-1)
        return x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6)  # producer: checkpointed row norm


class CheckpointedStack(nn.Module):
    """A stack run by ``checkpoint_sequential`` in two segments: the first (where the norm is) runs without keeping
    its activations and is recomputed inside the backward; the last segment runs as usual."""

    def __init__(self, builtin: bool, reentrant: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8, bias=False), HandRowNorm(builtin), nn.Linear(8, 8), nn.Tanh())
        self.head, self.reentrant = nn.Linear(8, 1), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint_sequential(self.body, 2, x, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpoint_sequential(builtin: bool, reentrant: bool) -> Scenario:
    torch.manual_seed(0)
    model = CheckpointedStack(builtin, reentrant)
    xs, ys = _batches(5, 4), _batches(5, 1)
    for x in xs:
        x.requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
    xs[2].data[3] = 0.0  # a blank record: every bias-free layer maps it to 0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- bfloat16 autocast: atanh of a rounded tanh
class TanhGaussianPolicy(nn.Module):
    """SAC's squashed Gaussian policy; its log-probability needs the pre-tanh action, which this copy recovers as
    ``atanh(a)``. Under bfloat16 autocast the action is bfloat16, and tanh of anything past ~3.8 rounds to exactly 1:
    atanh(1) is inf. The twin keeps the pre-tanh sample."""

    def __init__(self, keep_pre: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh())
        self.mu, self.log_std, self.keep_pre = nn.Linear(32, 2), nn.Linear(32, 2), keep_pre

    def forward(self, obs: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        mu, log_std = self.mu(h), self.log_std(h).clamp(-5.0, 2.0)
        u = mu + log_std.exp() * noise
        a = torch.tanh(u)
        pre = u if self.keep_pre else torch.atanh(a)  # producer: recovered pre-tanh
        logp = (-0.5 * ((pre - mu) / log_std.exp()) ** 2 - log_std - 0.919).sum(-1)
        return a, logp - torch.log(1 - a * a + 1e-6).sum(-1)


def _bf16_atanh(keep_pre: bool) -> Scenario:
    torch.manual_seed(0)
    model = TanhGaussianPolicy(keep_pre)
    with torch.no_grad():
        model.mu.weight.mul_(8.0)  # a policy already confident in its actions
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    obs, noises = _batches(4, 6), _batches(4, 2)
    obs[2][1] *= 6.0  # an observation far outside the replay buffer's range
    q_weight = torch.tensor([0.5, -0.3])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                a, logp = model(obs[step], noises[step])
                loss = (0.2 * logp - (a * q_weight).sum(-1)).float().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a float16 model whose summed loss overflows
def _half_sum_loss(in_float: bool) -> Scenario:
    """A regressor cast to float16 whole (``.half()``, run on the CPU, no GradScaler) and an MSE with
    ``reduction="sum"``; the batch of step 2 holds targets in raw units (centimetres for metres): the sum of squared
    errors passes 65504. The twin takes the loss in float32, as mixed precision does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).half()
    xs = [x.half() for x in _batches(8, 8)]
    ys = [y.half() for y in _batches(8, 4)]
    ys[2] = ys[2] * 100  # this shard's targets were exported in centimetres

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        if in_float:
            return F.mse_loss(out.float(), ys[step].float(), reduction="sum")
        return F.mse_loss(out, ys[step], reduction="sum")  # producer: fp16 summed loss
    return _loop(model, lambda step: (xs[step],), loss_fn, lr=1e-5)


# ---------------------------------------------------------------- a backward pre-hook normalising a head's gradient
class UnitGradientHeads(nn.Module):
    """Two task heads on a shared trunk; a backward pre-hook the root registers on each head rescales the gradient
    flowing into it to unit norm, so that neither task dominates the trunk. A task switched off by a loss weight of
    0.0 sends an all-zero gradient: 0 / 0 in the hook. The twin adds eps to the norm."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(5, 16), nn.Tanh())
        self.seg, self.depth, self.eps = nn.Linear(16, 3), nn.Linear(16, 1), eps
        for head in (self.seg, self.depth):
            head.register_full_backward_pre_hook(self.unit)

    def unit(self, module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        (g,) = grad_output
        return (g / (g.norm() + self.eps),)  # producer: unit gradient

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.seg(h), self.depth(h)


class MaxScaledInput(nn.Module):
    """A backward hook the root registers on its head (``register_full_backward_hook``) rescales the gradient the
    head passes back to the trunk by its largest magnitude; a batch whose loss does not reach the head (a loss weight
    of 0.0) passes back zeros: 0 / 0. The twin adds eps."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.trunk, self.head, self.eps = nn.Sequential(nn.Linear(5, 16), nn.Tanh()), nn.Linear(16, 1), eps
        self.head.register_full_backward_hook(self.scale)

    def scale(self, module: nn.Module, grad_input: tuple[torch.Tensor, ...],
              grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        (g,) = grad_input
        return (g / (g.abs().max() + self.eps),)  # producer: max-scaled gradient

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return h.mean(-1, keepdim=True), self.head(h)


def _unit_gradient(eps: float, post: bool = False) -> Scenario:
    torch.manual_seed(0)
    if post:
        model: nn.Module = MaxScaledInput(eps)
        xs, ys = _batches(6, 5), _batches(6, 1)
        weights = [1.0, 1.0, 0.0, 0.0]
        return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out[0], ys[step]) + weights[
            step] * F.mse_loss(out[1], ys[step]))
    model = UnitGradientHeads(eps)
    xs, labels, depths = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(4)], _batches(6, 1)
    weights = [1.0, 1.0, 0.0, 0.0]  # the depth task is switched off from step 2 (its labels ran out)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        return F.cross_entropy(out[0], labels[step]) + weights[step] * F.mse_loss(out[1], depths[step])
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- activations saved in float16 by saved_tensors_hooks
def _pack_half(t: torch.Tensor) -> torch.Tensor:
    return t.half()  # producer: fp16 pack


def _pack_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def _saved_half(bf16: bool) -> Scenario:
    """Activation memory halved by ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves is packed
    to float16 and unpacked to float32 in the backward. A batch with a feature in raw units makes the first hidden
    layer's ReLU output pass 65504: the copy saved for the second Linear's weight gradient is inf, a value no forward
    boundary holds, and the weight's gradient is inf * 0. The twin packs to bfloat16 (float32's range)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(200.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    xs, ys = _batches(8, 4), _batches(8, 1)
    xs[2][:, 0] += 3000.0  # a shard exported without its scaling
    pack = _pack_bf16 if bf16 else _pack_half

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a diagonal SSM's zero-order hold at eigenvalue 0
class DiagonalSsm(nn.Module):
    """A diagonal state-space layer (S4D-real) discretised by zero-order hold, ``B_bar = (exp(dt A) - 1) / A * B``,
    scanned over time. S4D-real initialises ``A = -(n + 1)``; this copy wrote ``-n``, so the first state's eigenvalue
    is exactly 0: (1 - 1) / 0. The twin keeps A negative as S4D and Mamba do, ``A = -exp(A_log)``."""

    def __init__(self, log_param: bool) -> None:
        super().__init__()
        n = torch.arange(4, dtype=torch.float32)
        self.log_param = log_param
        self.a = nn.Parameter(torch.log(n + 1) if log_param else -n)
        self.b, self.c = nn.Parameter(torch.randn(4) * 0.5), nn.Parameter(torch.randn(4) * 0.5)
        self.log_dt = nn.Parameter(torch.full((4,), -1.0))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        a = -torch.exp(self.a) if self.log_param else self.a
        dt = self.log_dt.exp()
        a_bar = torch.exp(dt * a)
        b_bar = (a_bar - 1) / a * self.b  # producer: zoh discretisation
        h, ys = torch.zeros(u.shape[0], 4), []
        for t in range(u.shape[1]):
            h = a_bar * h + b_bar * u[:, t, None]
            ys.append((h * self.c).sum(-1))
        return torch.stack(ys, 1)


def _ssm(log_param: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(DiagonalSsm(log_param), nn.Tanh(), nn.Linear(6, 1))
    xs, ys = _batches(3, 6), _batches(3, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- attention logit soft-capping "disabled" by 0.0
class SoftCappedAttention(nn.Module):
    """Gemma 2's attention logit soft-capping, ``cap * tanh(scores / cap)``, applied whenever the cap is not None; a
    config that turns it off by ``0.0`` divides by 0: the forward is finite (tanh absorbs the infinities, and
    ``0 * +-1`` is 0), and the division's backward is 0 / 0. The twin's config says None."""

    def __init__(self, cap: float | None) -> None:
        super().__init__()
        self.qkv, self.out, self.cap = nn.Linear(8, 24), nn.Linear(8, 8), cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 8 ** 0.5
        if self.cap is not None:
            scores = self.cap * torch.tanh(scores / self.cap)  # producer: soft cap
        return self.out(scores.softmax(-1) @ v)


def _soft_cap(cap: float | None) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), SoftCappedAttention(cap), nn.Linear(8, 1))
    xs, ys = _batches(2, 6, 5), _batches(2, 6, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


#: How the replays name the float16 pack's op (gaps24: they ran the forward again outside the user's
#: saved_tensors_hooks, saved the activations unpacked and stayed finite: op and line None).
SAVED_HOOKS = (
    "torch.autograd.graph.saved_tensors_hooks is a thread-local stack that the loop's `with` left before the "
    "backward; while a watch is active, the contexts entered are listed (patches/saved_hooks.py) and each kept "
    "top-level call notes the one it started under (hot/kept/saved_hooks.py, a list's truth: no call a step), so the "
    "step replay (default, defer) and the per-module watch's replay of its kept calls (full) pack as the call did; "
    "ops=True traces the real backward"
)

CASES = [
    Case("hunt23_moe_router_token_with_every_expert_full", lambda: _moe(False),
         Expect("forward", "moe.router", "CapacityRouter", step=2, op="aten._softmax.default",
                marker="router softmax")),
    Case("hunt23_moe_router_lowest_finite_and_drop_healthy", lambda: _moe(True), None),
    Case("hunt23_capsule_squash_of_a_zero_capsule", lambda: _capsule(0.0),
         Expect("forward", "caps", "PrimaryCapsules", step=1, op="aten.div.Tensor", marker="capsule squash")),
    Case("hunt23_capsule_squash_eps_under_the_root_healthy", lambda: _capsule(1e-8), None),
    Case("hunt23_snake_activation_alpha_zeros_used_linearly", lambda: _snake(0.0),
         Expect("forward", "1", "Snake", step=0, op="aten.div.Tensor", marker="snake")),
    Case("hunt23_snake_activation_no_div_by_zero_healthy", lambda: _snake(1e-9), None),
    Case("hunt23_signed_sqrt_function_backward_of_a_blank_sample", lambda: _signed_sqrt(0.0),
         Expect("backward", "0", "BilinearPool", step=2, op="aten.div.Tensor", marker="signed sqrt backward")),
    Case("hunt23_signed_sqrt_function_eps_in_backward_healthy", lambda: _signed_sqrt(1e-6), None),
    Case("hunt23_checkpoint_sequential_hand_norm_backward_of_a_zero_row", lambda: _checkpoint_sequential(False, False),
         Expect("backward", "body.1", "HandRowNorm", step=2, op="aten.div.Tensor", marker="checkpointed row norm")),
    Case("hunt23_checkpoint_sequential_normalize_healthy", lambda: _checkpoint_sequential(True, False), None),
    Case("hunt23_checkpoint_sequential_reentrant_hand_norm_backward_of_a_zero_row",
         lambda: _checkpoint_sequential(False, True),
         Expect("backward", "body.1", "HandRowNorm", step=2, op="aten.div.Tensor", marker="checkpointed row norm")),
    Case("hunt23_checkpoint_sequential_reentrant_normalize_healthy", lambda: _checkpoint_sequential(True, True),
         None),
    Case("hunt23_bf16_autocast_sac_atanh_of_an_action_rounded_to_1", lambda: _bf16_atanh(False),
         Expect("forward", "", "TanhGaussianPolicy", step=2, op="aten.atanh.default", marker="recovered pre-tanh")),
    Case("hunt23_bf16_autocast_sac_keeps_the_pre_tanh_sample_healthy", lambda: _bf16_atanh(True), None),
    Case("hunt23_half_model_summed_mse_overflows_on_raw_units", lambda: _half_sum_loss(False),
         Expect("forward", None, step=2, op="aten.mse_loss.default", marker="fp16 summed loss")),
    Case("hunt23_half_model_loss_in_float32_healthy", lambda: _half_sum_loss(True), None),
    Case("hunt23_backward_pre_hook_unit_gradient_of_a_switched_off_task", lambda: _unit_gradient(0.0),
         Expect("backward", "depth", "Linear", step=2, op="aten.div.Tensor", marker="unit gradient")),
    Case("hunt23_backward_pre_hook_unit_gradient_with_eps_healthy", lambda: _unit_gradient(1e-12), None),
    Case("hunt23_full_backward_hook_max_scaled_gradient_of_a_switched_off_head", lambda: _unit_gradient(0.0, True),
         Expect("backward", "head", "Linear", step=2, op="aten.div.Tensor", marker="max-scaled gradient")),
    Case("hunt23_full_backward_hook_max_scaled_gradient_with_eps_healthy", lambda: _unit_gradient(1e-12, True),
         None),
    Case("hunt23_saved_tensors_packed_to_float16_overflow", lambda: _saved_half(False),
         Expect("backward", "2", "Linear", step=2, op="aten.mm.default", marker="fp16 pack"), modes=("ops",)),
    Case("hunt23_saved_tensors_packed_to_float16_overflow_replayed", lambda: _saved_half(False),
         Expect("backward", "2", "Linear", step=2, op="aten.mm.default", marker="fp16 pack"),
         modes=("default", "defer", "full"), note=SAVED_HOOKS),
    Case("hunt23_saved_tensors_packed_to_bfloat16_healthy", lambda: _saved_half(True), None),
    Case("hunt23_diagonal_ssm_zero_order_hold_at_an_eigenvalue_of_0", lambda: _ssm(False),
         Expect("forward", "0", "DiagonalSsm", step=0, op="aten.div.Tensor", marker="zoh discretisation")),
    Case("hunt23_diagonal_ssm_negative_log_parametrised_healthy", lambda: _ssm(True), None),
    Case("hunt23_attention_soft_cap_disabled_by_0_backward", lambda: _soft_cap(0.0),
         Expect("backward", "1", "SoftCappedAttention", step=0, op="aten.div.Tensor", marker="soft cap")),
    Case("hunt23_attention_soft_cap_none_healthy", lambda: _soft_cap(None), None),
]
