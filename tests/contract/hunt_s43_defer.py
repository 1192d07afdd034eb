"""hunt_s43_defer (1 of 2), incidents checked for op, line, phase and step in every mode, immediate and deferred.

A rotary embedding whose dynamic-NTK base overflows float16; a mixture of experts whose capacity drops a token
(its gate weights, summed by ``scatter_add_``, are 0: ``0 / 0`` after the ``index_add_`` combine); a custom
``autograd.Function`` whose backward divides by zero inside a non-reentrant checkpoint, at the 3rd of 4 accumulated
micro-batches; a loss normalised by a token count that is 0 in one micro-batch; a linear recurrent cell whose hidden
state overflows late in a long sequence; constrained decoding whose vocabulary mask leaves a row nothing
(``log_softmax`` of all ``-inf``); an inverse-square-root warmup lambda that is ``0 / 0`` at step 0; Adam with
``eps=0`` over an embedding whose ``padding_idx`` row always has a zero gradient; a matmul past bfloat16's range
under CPU autocast; an in-place ``x /= x.norm()`` inside a checkpointed block (both checkpoints). Every mode already
said the same here; the optimizer's step hooks did not (hunt_s43_defer_hooks.py). Each with a healthy twin: the same
code with an eps, a guard, or healthy data.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop

LOSS_CODE_OPS = ("default", "defer", "ops")


# ---------------------------------------------------------------- rotary embedding, dynamic NTK base in float16
class DynamicRope(nn.Module):
    """Rotary position embedding with dynamic NTK scaling: past ``max_positions`` the base grows by
    ``scale ** (d / (d - 2))``; the base is a float16 buffer (kept in the model's half precision)."""

    def __init__(self, dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.max_positions = dim, max_positions
        self.register_buffer("base", torch.tensor(10000.0, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        scale = max(1.0, t / self.max_positions)
        base = self.base * scale ** (self.dim / (self.dim - 2))  # producer: ntk base
        exponents = torch.arange(0, self.dim, 2, dtype=base.dtype) / self.dim
        inv_freq = torch.exp(-torch.log(base) * exponents)
        angles = torch.arange(t, dtype=base.dtype)[:, None] * inv_freq
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RopeModel(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed, self.rope, self.head = nn.Linear(4, 4), DynamicRope(4, 8, dtype), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rope(self.embed(x))).mean(1)


def _rope(dtype: torch.dtype) -> Scenario:
    """Sequences of 8 positions, then at step 2 one of 32 (scale 4): the base is 10000 * 16, past float16's 65504.
    Twin: the base buffer in float32."""
    torch.manual_seed(0)
    model = RopeModel(dtype)
    xs = [torch.randn(2, 32 if step == 2 else 8, 4) for step in range(4)]
    ys = _batches(2, 1)
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- MoE: a token its capacity drops
class CapacityMoE(nn.Module):
    """Top-1 routing with an expert capacity of 2 tokens; each expert's output is combined by ``index_add_``, and
    the combined output normalised by each token's total gate weight (``scatter_add_`` of the kept gates)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.router = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        weight, choice = gates.max(-1)
        out = torch.zeros_like(x)
        kept = torch.zeros(x.shape[0], dtype=x.dtype)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)[:2]  # capacity: the first 2 tokens
            out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
            kept = kept.scatter_add(0, rows, weight[rows])
        return out / (kept[:, None] + self.eps)  # producer: moe combine


class MoEModel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.moe, self.head = CapacityMoE(eps), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def _moe(eps: float, crowded: bool) -> Scenario:
    """Batches of 6 tokens over 3 experts; at step 1 every token of the batch picks expert 0 (a collapsed router):
    4 are dropped, their kept weight is 0, ``0 / 0``. Twin: an eps (dropped tokens are 0), or a spread batch."""
    torch.manual_seed(0)
    model = MoEModel(eps)
    xs, ys = _batches(6, 4), _batches(6, 1)
    with torch.no_grad():
        model.moe.router.weight.zero_()
        model.moe.router.bias.copy_(torch.tensor([0.0, 0.0, 0.1]))
        model.moe.router.weight[:, 0] = torch.tensor([1.0, -1.0, 0.0]) * 4
    for step in range(4):
        xs[step][:, 0] = torch.tensor([2.0, 2.0, -2.0, -2.0, 0.0, 0.0]) if step != 1 or not crowded else 3.0
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- a custom Function's backward in a checkpoint
class StraightThroughRound(torch.autograd.Function):
    """Rounds to a grid of ``step``; its backward rescales the gradient by the input's magnitude relative to the
    grid (a learned-step quantiser's gradient), dividing by ``|x|``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.eps = eps
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * torch.round(x * 4) / (4 * x.abs() + ctx.eps), None  # producer: quantiser backward


class QuantBlock(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.fc = eps, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(StraightThroughRound.apply(x, self.eps))


class CheckpointedQuant(nn.Module):
    def __init__(self, eps: float, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed, self.block, self.head = nn.Linear(4, 4, bias=False), QuantBlock(eps), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, self.embed(x), use_reentrant=self.reentrant))


def _accumulated(model: nn.Module, xs: list[list[torch.Tensor]], ys: list[list[torch.Tensor]],
                 steps: int = 3) -> Scenario:
    """Gradient accumulation over 4 micro-batches per step, one SGD step after them."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(steps):
            opt.zero_grad()
            for micro in range(4):
                loss = F.mse_loss(model(xs[step][micro]), ys[step][micro]) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses

    return Scenario((model, opt), run)


def _quant(eps: float, reentrant: bool) -> Scenario:
    """At step 1 the 3rd micro-batch holds a blank sample: the embedding (no bias) gives exactly 0, and the
    quantiser's backward divides 0 by 0. Twin: an eps."""
    torch.manual_seed(0)
    model = CheckpointedQuant(eps, reentrant)
    xs = [[torch.randn(3, 4) for _ in range(4)] for _ in range(3)]
    ys = [[torch.randn(3, 1) for _ in range(4)] for _ in range(3)]
    xs[1][2][0] = 0.0
    return _accumulated(model, xs, ys)


# ---------------------------------------------------------------- a token count that is 0 in one micro-batch
def _token_count(floor: int) -> Scenario:
    """A tagger's loss summed over the labelled tokens and divided by their count, over 4 micro-batches; at step 1
    the 3rd micro-batch has no labelled token (all ``-100``): ``0 / 0``. Twin: the count clamped to 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    xs = [[torch.randn(6, 4) for _ in range(4)] for _ in range(3)]
    labels = [[torch.randint(0, 5, (6,)) for _ in range(4)] for _ in range(3)]
    labels[1][2][:] = -100

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                y = labels[step][micro]
                per_token = F.cross_entropy(model(xs[step][micro]), y, ignore_index=-100, reduction="none")
                count = (y != -100).sum().clamp_min(floor)
                loss = per_token.sum() / count / 4  # producer: token mean
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a linear recurrent cell over a long sequence
class LinearCell(nn.Module):
    """A linear recurrence ``h = h W + x U`` (an SSM-like cell without a gate)."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.eye(4) * gain)
        self.U = nn.Parameter(torch.randn(4, 4) * 0.1)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h @ self.W + x @ self.U  # producer: recurrence


class Recurrent(nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.cell, self.head = LinearCell(gain), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 4)
        for t in range(x.shape[1]):
            h = self.cell(h, x[:, t])
        return self.head(h.tanh())


def _recurrent(gain: float) -> Scenario:
    """Sequences of 12, then at step 2 one of 120: the hidden state grows by 2.5 a step and passes float32's max
    late in it. Twin: a gain of 0.9."""
    torch.manual_seed(0)
    model = Recurrent(gain)
    xs = [torch.randn(2, 120 if step == 2 else 12, 4) for step in range(4)]
    ys = _batches(2, 1)
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- constrained decoding: a row with no allowed token
class ConstrainedHead(nn.Module):
    """Logits restricted to the tokens a grammar allows at each position (``-inf`` elsewhere), as log-probs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x).masked_fill(~allowed, float("-inf"))
        return logits.log_softmax(-1)  # producer: constrained log-probs


def _constrained(dead_end: bool) -> Scenario:
    """At step 2 the grammar reaches a dead end for one row: no token allowed, ``log_softmax`` of all ``-inf``.
    Twin: the row allows its end token."""
    torch.manual_seed(0)
    model = ConstrainedHead()
    xs, ys = _batches(4, 4), [torch.zeros(4, dtype=torch.long) for _ in range(4)]
    allowed = [torch.rand(4, 6) > 0.5 for _ in range(4)]
    for mask in allowed:
        mask[:, 0] = True
    allowed[2][1] = False
    if not dead_end:
        allowed[2][1, 0] = True

    def loss_fn(logp: torch.Tensor, step: int) -> torch.Tensor:
        return -logp.gather(1, ys[step][:, None]).mean()

    return sgd_loop(model, lambda step: (xs[step], allowed[step]), loss_fn)


# ---------------------------------------------------------------- an inverse-square-root warmup at step 0
def _inverse_sqrt(offset: int) -> Scenario:
    """``LambdaLR`` with ``min(1, s / w) / sqrt(s / w)`` written in numpy (the lengths from a config): at ``s = 0``
    it is ``0 / 0``, a NaN lr, and the first SGD step makes every parameter NaN. Twin: steps counted from 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    warmup = np.float64(4)
    with np.errstate(invalid="ignore", divide="ignore"):
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: float(min(1.0, (s + offset) / warmup) / np.sqrt((s + offset) / warmup)))
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: nan lr step
            with np.errstate(invalid="ignore", divide="ignore"):
                sched.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Adam eps=0 over a padding_idx row
def _padding_adam(eps: float) -> Scenario:
    """An embedding with ``padding_idx=0``: that row's gradient is always exactly 0, and Adam with ``eps=0``
    divides its zero moment by ``sqrt(0)`` at the first step. Twin: eps 1e-8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=0), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    ids = [torch.randint(0, 6, (5,)) for _ in range(3)]
    ys = _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(ids[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: padding adam step
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- CPU bfloat16 autocast: a matmul past the range
class Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w  # producer: bf16 matmul


def _autocast(peak: float) -> Scenario:
    """The forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``; at step 2 the batch is scaled by ``peak``
    (an unnormalised sensor batch): each of the four products is finite in bfloat16, their sum is not. Twin: peak 1e3.
    """
    torch.manual_seed(0)
    model = nn.Sequential(Projection(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = [torch.rand(3, 4) + 1.0 for _ in range(3)], _batches(3, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xs[step] * (peak if step == 2 else 1.0))
            loss = F.mse_loss(out.float(), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- in-place normalisation inside a checkpoint
class NormalisedBlock(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps, self.fc = eps, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h /= h.norm(dim=-1, keepdim=True) + self.eps  # producer: in-place unit norm
        return h


class CheckpointedNorm(nn.Module):
    def __init__(self, eps: float, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block, self.head = NormalisedBlock(eps), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _in_place_norm(eps: float, reentrant: bool) -> Scenario:
    """At step 2 one sample is blank and the first layer's bias 0: its row's norm is 0, ``0 / 0``. Twin: an eps."""
    torch.manual_seed(0)
    model = CheckpointedNorm(eps, reentrant)
    with torch.no_grad():
        model.block.fc.bias.zero_()
    xs, ys = _batches(3, 4), _batches(3, 1)
    xs[2][1] = 0.0
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES = [
    Case("hunt_s43_rope_dynamic_ntk_base_overflows_float16", lambda: _rope(torch.float16),
         Expect("forward", "rope", "DynamicRope", step=2, op="aten.mul.Tensor", marker="ntk base")),
    Case("hunt_s43_rope_dynamic_ntk_base_float32_healthy", lambda: _rope(torch.float32), None),
    Case("hunt_s43_moe_capacity_drops_tokens_combine_0_over_0", lambda: _moe(0.0, True),
         Expect("forward", "moe", "CapacityMoE", step=1, op="aten.div.Tensor", marker="moe combine")),
    Case("hunt_s43_moe_capacity_drops_tokens_eps_healthy", lambda: _moe(1e-9, True), None),
    Case("hunt_s43_moe_capacity_spread_batch_healthy", lambda: _moe(0.0, False), None),
    Case("hunt_s43_function_backward_in_checkpoint_third_micro_batch", lambda: _quant(0.0, False),
         Expect("backward", "block", "QuantBlock", step=1, op="aten.div.Tensor", marker="quantiser backward")),
    Case("hunt_s43_function_backward_in_reentrant_checkpoint_third_micro_batch", lambda: _quant(0.0, True),
         Expect("backward", "block", "QuantBlock", step=1, op="aten.div.Tensor", marker="quantiser backward")),
    Case("hunt_s43_function_backward_in_checkpoint_healthy", lambda: _quant(1e-6, False), None),
    Case("hunt_s43_function_backward_in_reentrant_checkpoint_healthy", lambda: _quant(1e-6, True), None),
    Case("hunt_s43_token_count_0_in_third_micro_batch", lambda: _token_count(0),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="token mean", op_modes=LOSS_CODE_OPS)),
    Case("hunt_s43_token_count_clamped_healthy", lambda: _token_count(1), None),
    Case("hunt_s43_linear_recurrence_overflows_late_in_a_long_sequence", lambda: _recurrent(2.5),
         Expect("forward", "cell", "LinearCell", step=2, op="aten.mm.default", marker="recurrence")),
    Case("hunt_s43_linear_recurrence_contracting_healthy", lambda: _recurrent(0.9), None),
    Case("hunt_s43_constrained_decoding_row_with_no_allowed_token", lambda: _constrained(True),
         Expect("forward", "", "ConstrainedHead", step=2, op="aten._log_softmax.default",
                marker="constrained log-probs")),
    Case("hunt_s43_constrained_decoding_healthy", lambda: _constrained(False), None),
    Case("hunt_s43_inverse_sqrt_warmup_0_over_0_at_step_0", lambda: _inverse_sqrt(0),
         Expect("optimizer", "0", "Linear", step=0, op="aten.add_.Tensor", marker="nan lr step")),
    Case("hunt_s43_inverse_sqrt_warmup_from_1_healthy", lambda: _inverse_sqrt(1), None),
    Case("hunt_s43_adam_eps_0_padding_idx_row", lambda: _padding_adam(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker="padding adam step")),
    Case("hunt_s43_adam_padding_idx_row_healthy", lambda: _padding_adam(1e-8), None),
    Case("hunt_s43_cpu_bfloat16_autocast_matmul_overflows", lambda: _autocast(8e37),
         Expect("forward", "0", "Projection", step=2, op="aten.mm.default", marker="bf16 matmul")),
    Case("hunt_s43_cpu_bfloat16_autocast_matmul_healthy", lambda: _autocast(1e3), None),
    Case("hunt_s43_in_place_unit_norm_in_checkpoint", lambda: _in_place_norm(0.0, False),
         Expect("forward", "block", "NormalisedBlock", step=2, op="aten.div_.Tensor", marker="in-place unit norm")),
    Case("hunt_s43_in_place_unit_norm_in_reentrant_checkpoint", lambda: _in_place_norm(0.0, True),
         Expect("forward", "block", "NormalisedBlock", step=2, op="aten.div_.Tensor", marker="in-place unit norm")),
    Case("hunt_s43_in_place_unit_norm_in_checkpoint_healthy", lambda: _in_place_norm(1e-6, False), None),
]
