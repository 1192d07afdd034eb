"""hunt_s27d, incidents in the models people train now (Llama blocks, diffusion, MoE, RL, CLIP), each with its twin.

A Llama-style RMSNorm in a half-precision model whose squares underflow to 0 under an RWKV-style tiny embedding
init; rotary embeddings whose ``inv_freq`` is recomputed each forward from a base a config left at 0; SwiGLU's
``silu(gate) * up`` overflowing float16 under autocast at an activation outlier; a zero-terminal-SNR schedule
(Lin et al.'s rescale) whose EDM sigma ``sqrt((1 - a) / a)`` is 1 / 0 at t = T; a MoE load-balancing loss dividing by
the token count of a micro-batch that is all padding; discounted returns with gamma > 1 over a long episode; a CLIP
checkpoint trained in float32 without the clamp, fine-tuned under float16 autocast; SD3's ``sigma ** -2`` loss
weighting at a hand-drawn sigma of 0, in a model's ``loss`` method (k-diffusion's habit). Each twin applies its users'
fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- RMSNorm in float16 of a tiny embedding
class RMSNorm(nn.Module):
    """Llama's RMSNorm; HF's upcasts to float32 before the variance, the slip computes it in the model's dtype with
    lucidrains' eps of 1e-8 (0 in float16)."""

    def __init__(self, dim: int, upcast: bool) -> None:
        super().__init__()
        self.weight, self.eps, self.upcast = nn.Parameter(torch.ones(dim)), 1e-8, upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if self.upcast else x
        variance = h.pow(2).mean(-1, keepdim=True)
        normed = h * torch.rsqrt(variance + self.eps)  # producer: rms rsqrt
        return self.weight * normed.to(x.dtype)


class TinyEmbedLM(nn.Module):
    def __init__(self, upcast: bool) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(11, 8), RMSNorm(8, upcast), nn.Linear(8, 11)
        with torch.no_grad():
            self.embed.weight.uniform_(-1e-4, 1e-4)  # RWKV's small embedding init

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def _rmsnorm_half(upcast: bool) -> Scenario:
    """The model is ``.half()``: every square of a 1e-4 embedding is below float16's smallest subnormal, the
    variance is 0, the eps rounds to 0 and ``rsqrt(0)`` is inf at the very first forward. The twin upcasts."""
    torch.manual_seed(0)
    model = TinyEmbedLM(upcast).half()
    tokens, targets = [torch.randint(0, 11, (2, 5)) for _ in range(4)], [torch.randint(0, 11, (10,)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step],),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1).float(), targets[step]))


# ---------------------------------------------------------------- rotary inv_freq from a base of 0
class Rotary(nn.Module):
    """Rotary embeddings recomputed each forward (a dynamic-NTK habit: the base may change with the length)."""

    def __init__(self, dim: int, base: float) -> None:
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2).float() / self.dim
        inv_freq = 1.0 / (self.base ** exponents)  # producer: rope inv freq
        angles = torch.outer(torch.arange(x.shape[1]).float(), inv_freq)
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin


class RopeAttention(nn.Module):
    def __init__(self, base: float) -> None:
        super().__init__()
        self.qk, self.rope, self.head = nn.Linear(8, 16), Rotary(8, base), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        q, k = self.rope(q), self.rope(k)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
        return self.head(weights @ x).mean(1)


def _rope(base: float) -> Scenario:
    """A config's ``rope_theta`` left at 0 (``int(theta * factor)`` with a scaling factor read as 0): ``0 ** 0`` is 1
    but ``0 ** 0.25`` is 0, ``1 / 0`` is inf and position 0 times it NaN. The twin reads the default 10000."""
    torch.manual_seed(0)
    model = RopeAttention(base)
    xs, ys = _batches(2, 5, 8), _batches(2, 2)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- SwiGLU overflowing float16 under autocast
class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False), \
            nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate(x)) * self.up(x)  # producer: swiglu product
        return self.down(hidden)


class GluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.head = SwiGLU(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(x))


def _swiglu(dtype: torch.dtype) -> Scenario:
    """Step 1's batch holds an activation outlier of 1500 (LLMs' massive activations): gate and up are each a few
    hundred, finite in float16, and their product is past 65504. The twin autocasts to bfloat16, as Llama trains."""
    torch.manual_seed(0)
    model = GluBlock()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, ys = _batches(3, 8), _batches(3, 2)
    xs[1][1, 2] = 1500.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.autocast("cpu", dtype=dtype):
                out = model(xs[step])
            loss = F.mse_loss(out.float(), ys[step])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as Llama's recipe
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- EDM sigma at t = T of a zero-terminal-SNR schedule
def _zero_terminal_snr(steps: int) -> torch.Tensor:
    """Lin et al.'s ``rescale_zero_terminal_snr``: shifts and scales sqrt(alpha_bar) so its last value is exactly 0."""
    root = torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps), 0).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * first / (first - last)
    return root ** 2


class EdmDenoiser(nn.Module):
    """Karras' preconditioning of an epsilon-trained network, sigma read from the DDPM schedule."""

    def __init__(self, alpha_bar: torch.Tensor) -> None:
        super().__init__()
        self.net, self.alpha_bar = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4)), alpha_bar

    def forward(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar[t][:, None]
        sigma = ((1 - ab) / ab).sqrt()  # producer: edm sigma
        x_noisy = x0 + sigma * noise
        c_in, c_skip = 1 / (sigma ** 2 + 1).sqrt(), 1 / (sigma ** 2 + 1)
        c_out = sigma / (sigma ** 2 + 1).sqrt()
        return c_skip * x_noisy + c_out * self.net(torch.cat([c_in * x_noisy, sigma.log() / 4], -1))


def _edm(terminal: float | None) -> Scenario:
    """Step 1 samples t = T: alpha_bar is exactly 0 and sigma is ``1 / 0``. The twin sets the terminal alpha_bar to
    2 ** -24, as diffusers does after the rescale."""
    torch.manual_seed(0)
    alpha_bar = _zero_terminal_snr(10)
    if terminal is not None:
        alpha_bar[-1] = terminal
    model = EdmDenoiser(alpha_bar)
    xs, noises = _batches(4, 4), _batches(4, 4)
    ts = [torch.tensor([3, 7, 5, 1]), torch.tensor([2, 9, 6, 1]), torch.tensor([4, 0, 7, 2]),
          torch.tensor([1, 5, 8, 3])]
    return _loop(model, lambda step: (xs[step], noises[step], ts[step]),
                 lambda out, step: F.mse_loss(out, xs[step]))


# ---------------------------------------------------------------- MoE load-balancing loss of an all-padding micro-batch
class BalancedRouter(nn.Module):
    """Switch Transformer's auxiliary loss ``E * sum(f_i P_i)`` over the micro-batch's real (non-padding) tokens."""

    def __init__(self, experts: int, floor: int) -> None:
        super().__init__()
        self.gate, self.experts, self.floor = nn.Linear(8, experts), experts, floor

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(h), -1)
        chosen = F.one_hot(probs.argmax(-1), self.experts).float() * keep[:, None]
        count = keep.sum().clamp(min=self.floor)
        fraction = chosen.sum(0) / count  # producer: router token fraction
        mean_prob = (probs * keep[:, None]).sum(0) / count
        return probs, self.experts * (fraction * mean_prob).sum()


class MoE(nn.Module):
    def __init__(self, floor: int) -> None:
        super().__init__()
        self.router, self.experts = BalancedRouter(4, floor), nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs, aux = self.router(h, keep)
        out = sum(probs[:, i:i + 1] * expert(h) for i, expert in enumerate(self.experts))
        return out, aux


def _moe_aux(floor: int) -> Scenario:
    """Packed sequences split into micro-batches of 6 tokens; step 2's micro-batch is the tail, all padding: the
    count of real tokens is 0 and the fraction of tokens per expert ``0 / 0``. The twin clamps the count at 1."""
    torch.manual_seed(0)
    model = MoE(floor)
    hs, ys = _batches(6, 8), _batches(6, 8)
    keeps = [torch.ones(6, dtype=torch.bool) for _ in range(4)]
    keeps[1][4:] = False
    keeps[2][:] = False

    def loss(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        pred, aux = out
        keep = keeps[step][:, None]
        task = ((pred - ys[step]) ** 2 * keep).sum() / keep.sum().clamp(min=1)
        return task + 0.01 * aux
    return _loop(model, lambda step: (hs[step], keeps[step]), loss)


# ---------------------------------------------------------------- discounted returns with gamma > 1
def _returns(gamma: float) -> Scenario:
    """Returns of an episode by the vectorised discount ``flip(cumsum(flip(g^k r))) / g^t``; a config typo makes
    gamma 1.01 ("1 - 0.01" read as "1 + 0.01"). Episodes of 200 steps are finite; step 2's of 10000 makes
    ``1.01 ** t`` overflow past t = 8920 (then inf / inf). The twin's gamma is 0.99."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=1e-3)
    lengths = [200, 200, 10000, 200]
    states, rewards = [torch.randn(n, 4) for n in lengths], [torch.rand(n) * 0.01 for n in lengths]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            discount = gamma ** torch.arange(lengths[step])  # producer: discount powers
            returns = (discount * rewards[step]).flip(0).cumsum(0).flip(0) / discount
            loss = F.mse_loss(critic(states[step]).squeeze(-1), returns)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((critic, opt), run)


# ---------------------------------------------------------------- CLIP's unclamped scale under float16 autocast
class Clip(nn.Module):
    """CLIP's towers and learned ``logit_scale``; the reference clamps the scale at 100."""

    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.image, self.text, self.clamp = nn.Linear(6, 8), nn.Linear(5, 8), clamp
        # Resumed from a checkpoint trained in float32 without the clamp: exp(12.5) is 268337, finite there.
        self.logit_scale = nn.Parameter(torch.tensor(12.5))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        img, txt = F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)
        scale = self.logit_scale.clamp(max=math.log(100)).exp() if self.clamp else self.logit_scale.exp()
        sims = img @ txt.t()
        return scale * sims  # producer: clip scaled logits


def _clip_half(clamp: bool) -> Scenario:
    """Fine-tuned under float16 autocast: the similarities are float16, the 0-dim float32 scale does not promote
    them, and any similarity above 0.245 times 268337 is past 65504. The twin clamps the scale at 100."""
    torch.manual_seed(0)
    model = Clip(clamp)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    images, texts = _batches(4, 6), _batches(4, 5)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(images[step], texts[step])
            labels = torch.arange(4)
            loss = (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.float().t(), labels)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- flow matching's sigma ** -2 weighting at sigma = 0
class FlowDenoiser(nn.Module):
    """A rectified-flow velocity network with k-diffusion's habit: the loss is a method of the model, not a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_t, sigma], -1))

    def loss(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        x_t = (1 - sigma) * x0 + sigma * noise
        weighting = sigma ** -2.0  # producer: sigma sqrt weighting
        return (weighting * (self(x_t, sigma) - (noise - x0)) ** 2).mean()


def _flow_matching(offset: int) -> Scenario:
    """SD3's ``sigma_sqrt`` loss weighting ``sigma ** -2`` with sigma = t / 1000 for a hand-drawn timestep index:
    step 1 draws index 0, sigma is 0 and its weight ``0 ** -2`` is inf. The twin draws sigma = (t + 1) / 1000, as
    diffusers' flow-matching scheduler's timesteps start at 1."""
    torch.manual_seed(0)
    model = FlowDenoiser()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, noises = _batches(4, 4), _batches(4, 4)
    ts = [torch.tensor([310, 7, 950, 512]), torch.tensor([77, 0, 640, 233]), torch.tensor([12, 999, 400, 58]),
          torch.tensor([801, 5, 66, 320])]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            sigma = ((ts[step] + offset) / 1000)[:, None]
            loss = model.loss(xs[step], noises[step], sigma)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # SD3's scripts' max_grad_norm
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s27d_half_rmsnorm_variance_of_a_tiny_embedding_underflows", lambda: _rmsnorm_half(False),
         Expect("forward", "norm", "RMSNorm", step=0, op="aten.rsqrt.default", marker="rms rsqrt",
                cause="division-by-zero")),
    Case("hunt_s27d_half_rmsnorm_upcast_to_float32_healthy", lambda: _rmsnorm_half(True), None),
    Case("hunt_s27d_rotary_inv_freq_from_a_base_of_0", lambda: _rope(0.0),
         Expect("forward", "rope", "Rotary", step=0, op="aten.reciprocal.default", marker="rope inv freq",
                cause="division-by-zero")),
    Case("hunt_s27d_rotary_inv_freq_base_10000_healthy", lambda: _rope(10000.0), None),
    Case("hunt_s27d_swiglu_product_overflows_float16_autocast", lambda: _swiglu(torch.float16),
         Expect("forward", "mlp", "SwiGLU", step=1, op="aten.mul.Tensor", marker="swiglu product",
                cause="half-precision-overflow")),
    Case("hunt_s27d_swiglu_bfloat16_autocast_healthy", lambda: _swiglu(torch.bfloat16), None),
    Case("hunt_s27d_edm_sigma_at_t_T_of_a_zero_terminal_snr_schedule", lambda: _edm(None),
         Expect("forward", "", "EdmDenoiser", step=1, op="aten.div.Tensor", marker="edm sigma",
                cause="division-by-zero")),
    Case("hunt_s27d_edm_sigma_terminal_alpha_bar_2_pow_minus_24_healthy", lambda: _edm(2.0 ** -24), None),
    Case("hunt_s27d_moe_load_balancing_loss_of_an_all_padding_micro_batch", lambda: _moe_aux(0),
         Expect("forward", "router", "BalancedRouter", step=2, op="aten.div.Tensor", marker="router token fraction",
                cause="division-by-zero")),
    Case("hunt_s27d_moe_load_balancing_count_clamped_healthy", lambda: _moe_aux(1), None),
    Case("hunt_s27d_returns_with_gamma_above_1_over_a_long_episode", lambda: _returns(1.01),
         # The loop built the returns from its own numbers and the rollout's rewards, no parameter nor model
         # output: data (PRODUCT.md: phase), which the recorded modes tell by RegionRecords.claimed_from_data.
         # ops=True tells it by the op tracer's taint (localize/ops/derived.py).
         Expect("data", None, step=2, op="aten.pow.Scalar", marker="discount powers", cause="overflow")),
    Case("hunt_s27d_returns_with_gamma_0_99_healthy", lambda: _returns(0.99), None),
    Case("hunt_s27d_clip_unclamped_scale_overflows_float16_autocast", lambda: _clip_half(False),
         Expect("forward", "", "Clip", step=0, op="aten.mul.Tensor", marker="clip scaled logits",
                cause="half-precision-overflow")),
    Case("hunt_s27d_clip_scale_clamped_at_100_healthy", lambda: _clip_half(True), None),
    Case("hunt_s27d_flow_matching_sigma_sqrt_weighting_at_sigma_0", lambda: _flow_matching(0),
         # The weight is built from the drawn sigma alone, no parameter nor model output (the model's call comes
         # after it in the same method): data (PRODUCT.md: phase), as the recorded modes tell.
         Expect("data", None, step=1, op="aten.pow.Tensor_Scalar", marker="sigma sqrt weighting",
                cause="pow-domain")),
    Case("hunt_s27d_flow_matching_sigma_from_t_plus_1_healthy", lambda: _flow_matching(1), None),
]
