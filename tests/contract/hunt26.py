"""hunt26, layers and losses: reported incidents, each with its healthy twin (loops, optimizers, data: hunt26b).

Forward: a selective scan (Mamba) whose ``A`` lost its minus sign, ``exp(dt * A)`` overflowing on a batch of large
inputs; a KAN layer whose B-spline grid, refitted from a batch by the loop, collapsed onto one knot for a constant
feature (Cox-de Boor's ``0 / 0``); a diffusion timestep embedding two wide, ``downscale_freq_shift=1`` dividing by
``half - 1 = 0``; a -inf region bias upsampled bilinearly (``0 * -inf``). Loss code: ``F.soft_margin_loss``'s
``log1p(exp(-y x))`` of a confidently wrong logit; the k3 KL estimator of RLHF, ``exp(ref - logp)``, of a token the
policy has all but ruled out; Barron's general robust loss at ``alpha = 2`` without its epsilon; MASE over a series
whose history never changed (its naive error 0). Each with the fix its users apply: the twin must stay silent and
bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a selective scan whose A lost its sign
class SelectiveScan(nn.Module):
    """Mamba's S6 recurrence ``h = exp(dt A) h + dt B x`` with input-dependent ``dt = softplus(W x)``; ``A`` is kept
    as ``A_log`` and must be ``-exp(A_log)`` (the twin); the slip ``exp(A_log)`` makes every mode grow."""

    def __init__(self, negative: bool) -> None:
        super().__init__()
        self.inp, self.dt, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
        self.A_log = nn.Parameter(torch.log(torch.linspace(0.5, 1.0, 6)))
        self.negative = negative

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, dt = self.inp(x), F.softplus(self.dt(x))
        a = -self.A_log.exp() if self.negative else self.A_log.exp()
        h, states = torch.zeros_like(u[:, 0]), []
        for t in range(x.shape[1]):
            h = torch.exp(dt[:, t] * a) * h + dt[:, t] * u[:, t]  # producer: selective scan
            states.append(h)
        return self.out(torch.stack(states, 1))


class MambaBlock(nn.Module):
    def __init__(self, negative: bool) -> None:
        super().__init__()
        self.ssm, self.head = SelectiveScan(negative), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.ssm(x))


def _selective_scan(negative: bool) -> Scenario:
    """The batch of step 2 holds a spike of 300 (a sensor glitch): its ``dt`` is large and ``exp(dt * A)``
    overflows for a positive ``A``; with ``A < 0`` it decays to 0."""
    torch.manual_seed(0)
    model = MambaBlock(negative)
    xs, ys = _batches(2, 5, 4, steps=3), _batches(2, 5, 1, steps=3)
    xs[2][1, 3] = 300.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), steps=3, lr=1e-6)


# ---------------------------------------------------------------- a KAN grid refitted onto one knot
class KANLinear(nn.Module):
    """efficient-kan's layer: ``silu(x) W_b + B(x) W_s`` with cubic B-splines over a per-feature grid that
    ``update_grid`` refits from a batch, a blend ``eps * uniform + (1 - eps) * adaptive`` of quantile knots and
    a uniform grid over the batch's range; the twin keeps a minimal knot spacing."""

    def __init__(self, spacing: float, grid: int = 4, order: int = 3) -> None:
        super().__init__()
        self.order, self.spacing = order, spacing
        step = 2 / grid
        knots = torch.arange(-order, grid + order + 1) * step - 1
        self.register_buffer("grid", knots.expand(3, -1).contiguous())
        self.base = nn.Linear(3, 2)
        self.spline = nn.Parameter(torch.randn(2, 3, grid + order) * 0.1)

    def bases(self, x: torch.Tensor) -> torch.Tensor:
        g, x = self.grid, x.unsqueeze(-1)
        b = ((x >= g[:, :-1]) & (x < g[:, 1:])).to(x.dtype)
        for k in range(1, self.order + 1):
            b = ((x - g[:, :-(k + 1)]) / (g[:, k:-1] - g[:, :-(k + 1)]) * b[..., :-1]  # producer: cox de boor
                 + (g[:, k + 1:] - x) / (g[:, k + 1:] - g[:, 1:-k]) * b[..., 1:])
        return b

    @torch.no_grad()
    def update_grid(self, x: torch.Tensor, grid_eps: float = 0.02) -> None:
        size = self.grid.shape[1] - 2 * self.order - 1
        xs = x.sort(0).values
        adaptive = xs[torch.linspace(0, x.shape[0] - 1, size + 1).long()]
        step = ((xs[-1] - xs[0]) / size).clamp(min=self.spacing)
        uniform = torch.arange(size + 1)[:, None] * step + xs[0]
        inner = grid_eps * uniform + (1 - grid_eps) * adaptive
        ends = torch.arange(self.order, 0, -1)[:, None] * step
        self.grid.copy_(torch.cat((inner[:1] - ends, inner, inner[-1:] + ends.flip(0))).T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(F.silu(x)) + torch.einsum("bik,oik->bo", self.bases(x), self.spline)


class KAN(nn.Module):
    def __init__(self, spacing: float) -> None:
        super().__init__()
        self.kan = KANLinear(spacing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kan(x)


def _kan(spacing: float) -> Scenario:
    """The loop refits the grid after step 1 (as efficient-kan's examples do every few steps) from a batch whose
    feature 2 is constant (a sensor stuck at 0.5): every knot of that feature is 0.5, and step 2's spline bases divide
    by knot spacings of 0. The twin floors the spacing at 1e-2."""
    torch.manual_seed(0)
    model = KAN(spacing)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.rand(8, 3) * 2 - 1 for _ in range(4)], _batches(8, 2)
    xs[1][:, 2] = 0.5
    xs[2][:, 2] = 0.5

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                model.kan.update_grid(xs[step])
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a timestep embedding two wide
class TimestepEmbedding(nn.Module):
    """diffusers' ``get_timestep_embedding``: ``exp(-log(10000) * i / (half - downscale_freq_shift))``."""

    def __init__(self, dim: int, shift: float) -> None:
        super().__init__()
        self.half, self.shift = dim // 2, shift

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        exponent = -math.log(10000) * torch.arange(self.half, dtype=torch.float32)
        freqs = torch.exp(exponent / (self.half - self.shift))  # producer: timestep frequencies
        angles = t[:, None].float() * freqs[None]
        return torch.cat((angles.sin(), angles.cos()), -1)


class TinyDenoiser(nn.Module):
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.time, self.body = TimestepEmbedding(2, shift), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat((x, self.time(t)), -1))


def _timestep(shift: float) -> Scenario:
    """A unit-test-sized config with a two-wide time embedding: ``half - 1`` is 0 and the frequency ``0 / 0``. The
    twin passes ``downscale_freq_shift=0`` (what the embedding of a dimension two needs)."""
    torch.manual_seed(0)
    model = TinyDenoiser(shift)
    xs, ts, noise = _batches(5, 4), [torch.randint(0, 1000, (5,)) for _ in range(4)], _batches(5, 4)
    return _loop(model, lambda step: (xs[step], ts[step]), lambda out, step: F.mse_loss(out, noise[step]))


# ---------------------------------------------------------------- soft margin loss of a confident mistake
def _soft_margin(stable: bool) -> Scenario:
    """``F.soft_margin_loss`` computes ``log1p(exp(-y x))``: a logit of about 100 on a sample labelled -1 (a label
    flipped at step 1) overflows the exp. The twin writes it as ``softplus(-y x)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.mul_(40.0)
    xs = _batches(6, 4)
    ys = [torch.sign(model(x).detach()).squeeze(-1) for x in xs]
    xs[1][2] = xs[1][2].abs() * 3 + 2
    logit = model(xs[1][2:3]).detach().item()
    ys[1][2] = -math.copysign(1.0, logit)
    xs[1][2] *= 100.0 / abs(logit) if abs(logit) < 100.0 else 1.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        if stable:
            return F.softplus(-ys[step] * out.squeeze(-1)).mean()
        return F.soft_margin_loss(out.squeeze(-1), ys[step])  # producer: soft margin
    return _loop(model, lambda step: (xs[step],), loss_fn, lr=1e-4)


# ---------------------------------------------------------------- RLHF's k3 KL estimator of a ruled-out token
class TinyPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(6, 8), nn.Linear(8, 6)
        with torch.no_grad():
            self.head.bias[3] = -100.0  # a token the policy has learned never to say

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(self.embed(tokens)), -1)


def _k3_kl(clamped: bool) -> Scenario:
    """GRPO's KL penalty ``exp(ref - logp) - (ref - logp) - 1`` per token, with the reference model's log
    probabilities computed beforehand: the completion of step 1 holds the token the policy rules out (its log
    probability about -100, the reference's about -2), and ``exp(98)`` overflows. The twin clamps the log ratio to
    [-20, 20]."""
    torch.manual_seed(0)
    model = TinyPolicy()
    prompts = [torch.randint(0, 6, (4, 5)) for _ in range(4)]
    completions = [torch.randint(0, 3, (4, 5)) for _ in range(4)]
    completions[1][2, 3] = 3
    ref_logps = [torch.full((4, 5), -1.8) for _ in range(4)]
    advantages = _batches(4, 1)

    def loss_fn(logps: torch.Tensor, step: int) -> torch.Tensor:
        logp = logps.gather(-1, completions[step][..., None]).squeeze(-1)
        ratio = ref_logps[step] - logp
        if clamped:
            ratio = ratio.clamp(-20.0, 20.0)
        kl = torch.exp(ratio) - ratio - 1  # producer: k3 kl
        return (-(advantages[step] * logp) + 0.04 * kl).mean()
    return _loop(model, lambda step: (prompts[step],), loss_fn)


# ---------------------------------------------------------------- a -inf attention bias upsampled bilinearly
class RegionAttention(nn.Module):
    """Attention over a 4x4 feature map's positions, restricted by a region bias built on a 2x2 grid (0 inside the
    region, -inf outside) and upsampled to 4x4: bilinearly (``0 * -inf`` where a source pixel weighs 0) or, the twin,
    by nearest neighbour."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.mode = mode

    def forward(self, x: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
        bias = F.interpolate(region, size=x.shape[-2:], mode=self.mode)  # producer: region upsample
        q, k, v = (f(x).flatten(2) for f in (self.q, self.k, self.v))
        scores = torch.einsum("bcn,bcm->bnm", q, k) / 2 + bias.flatten(2)
        return torch.einsum("bnm,bcm->bcn", scores.softmax(-1), v).view_as(x)


class RegionModel(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.attn, self.head = RegionAttention(mode), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.attn(x, region)).mean((2, 3)))


def _region_bias(mode: str) -> Scenario:
    """Each sample's region is a 2x2 grid of 0 (attend) and -inf (ignore) cells; bilinear upsampling weighs a -inf
    cell 0 at the positions aligned with its neighbour, and ``0 * -inf`` is NaN: the attention's softmax rows hold it.
    The twin upsamples by nearest neighbour, every position copying one cell."""
    torch.manual_seed(0)
    model = RegionModel(mode)
    xs, ys = _batches(2, 4, 4, 4), [torch.randint(0, 2, (2,)) for _ in range(4)]
    regions = [torch.zeros(2, 1, 2, 2) for _ in range(4)]
    regions[1][0, 0, 1, 1] = float("-inf")
    return _loop(model, lambda step: (xs[step], regions[step]), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- Barron's general robust loss at alpha = 2
def _robust(shifted: bool) -> Scenario:
    """Barron's general robust loss ``|a-2|/a * (((x/c)^2 / |a-2| + 1)^(a/2) - 1)`` written as the formula, its shape
    ``a`` a schedule annealed from 0 (Cauchy-like) to 2 (L2), reached at step 2: ``(x/c)^2 / 0``. The twin shifts
    ``|a - 2|`` by an epsilon, as the reference implementation does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xs, ys = _batches(6, 4), _batches(6, 1)
    alphas, c = [0.5, 1.25, 2.0, 2.0], 0.5

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        a = alphas[step]
        b = abs(a - 2) + (1e-5 if shifted else 0.0)
        scaled = ((out - ys[step]) / c) ** 2 / b  # producer: robust loss
        return (b / a * ((scaled + 1) ** (a / 2) - 1)).mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- MASE over a series that never changed
def _mase(floored: bool) -> Scenario:
    """MASE as the training loss of a forecaster: the forecast's mean absolute error over the in-sample naive
    forecast's, ``mean|y_t - y_{t-1}|`` of each series' history; a series whose history is constant (a product whose
    price never moved, at step 1) has a naive error of 0: ``x / 0``. The twin floors the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    histories, futures = _batches(5, 8), _batches(5, 2)
    histories[1][3] = 1.5

    def loss_fn(forecast: torch.Tensor, step: int) -> torch.Tensor:
        scale = (histories[step][:, 1:] - histories[step][:, :-1]).abs().mean(1, keepdim=True)
        if floored:
            scale = scale.clamp(min=1e-3)
        return ((forecast - futures[step]).abs() / scale).mean()  # producer: mase
    return _loop(model, lambda step: (histories[step],), loss_fn)


CASES = [
    Case("hunt26_selective_scan_exp_of_a_positive_a_overflows_on_a_spike", lambda: _selective_scan(False),
         Expect("forward", "ssm", "SelectiveScan", step=2, op="aten.exp.default", marker="selective scan",
                cause="exp-overflow")),
    Case("hunt26_selective_scan_a_negative_healthy", lambda: _selective_scan(True), None),
    Case("hunt26_kan_grid_refitted_onto_one_knot_for_a_constant_feature", lambda: _kan(0.0),
         Expect("forward", "kan", "KANLinear", step=2, op="aten.div.Tensor", marker="cox de boor",
                cause="division-by-zero")),
    Case("hunt26_kan_grid_minimal_spacing_healthy", lambda: _kan(1e-2), None),
    Case("hunt26_timestep_embedding_two_wide_with_freq_shift_1", lambda: _timestep(1.0),
         Expect("forward", "time", "TimestepEmbedding", step=0, op="aten.div.Tensor",
                marker="timestep frequencies", cause="division-by-zero")),
    Case("hunt26_timestep_embedding_freq_shift_0_healthy", lambda: _timestep(0.0), None),
    Case("hunt26_soft_margin_loss_of_a_confident_mistake_overflows", lambda: _soft_margin(False),
         Expect("forward", None, step=1, op="aten.soft_margin_loss.default", marker="soft margin",
                cause="exp-overflow")),
    Case("hunt26_soft_margin_as_softplus_healthy", lambda: _soft_margin(True), None),
    Case("hunt26_k3_kl_estimator_of_a_token_the_policy_ruled_out", lambda: _k3_kl(False),
         Expect("forward", None, step=1, op="aten.exp.default", marker="k3 kl", cause="exp-overflow")),
    Case("hunt26_k3_kl_estimator_log_ratio_clamped_healthy", lambda: _k3_kl(True), None),
    Case("hunt26_region_bias_of_minus_inf_upsampled_bilinearly", lambda: _region_bias("bilinear"),
         Expect("forward", "attn", "RegionAttention", step=1, op="aten.upsample_bilinear2d.default",
                marker="region upsample", cause="masked-softmax")),
    Case("hunt26_region_bias_upsampled_by_nearest_neighbour_healthy", lambda: _region_bias("nearest"), None),
    Case("hunt26_barron_robust_loss_at_alpha_2_without_its_epsilon", lambda: _robust(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="robust loss", cause="division-by-zero")),
    Case("hunt26_barron_robust_loss_alpha_shifted_by_epsilon_healthy", lambda: _robust(True), None),
    Case("hunt26_mase_over_a_series_whose_history_never_changed", lambda: _mase(False),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="mase", cause="division-by-zero")),
    Case("hunt26_mase_scale_floored_healthy", lambda: _mase(True), None),
]
