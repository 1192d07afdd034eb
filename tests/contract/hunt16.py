"""Reported NaN incidents of shapes the other rows do not hold, each with the healthy twin its users apply (hunt16).

A hand-written ReLU RNN cell called once per time step, whose state overflows only on a long sequence (which of
its T calls: still the step of the optimizer), and the same through ``nn.RNN``; a VAE returning a dataclass whose
KL term, computed in its own forward, takes ``logvar.exp()`` of a logvar gone to 89; min-SNR loss weighting over a
zero-terminal-SNR schedule (0 / 0 at the last timestep); a Beta regression whose target reaches exactly 1 (-inf
inside torch.distributions); an action mask leaving a state no legal action (``Categorical(logits=...)`` of a row
of -inf); a GAN, two models and two optimizers, whose generator loss ``-log(D(G(z)))`` meets a certain
discriminator; a learning rate too high, diverging until the loss overflows at step 14; a siamese head called
twice per step, only its second call dividing by a zero norm; CTC over an utterance too short for its label;
a sqrt backward in micro-batch 3 of 4 accumulated ones; a temperature annealed to 0 by a counter buffer, at step
300; Adam with eps=0 and an embedding row never used (the optimizer phase); depth in millimetres cast to float16
in the data code; a pointer-generator's gold word of probability 0 in a decoder loop over time; class weights
with a class absent from the training set (a loss argument that is data); a hand-written BCE under bfloat16
autocast, where 1 - sigmoid rounds to 0; a validation pass after three steps; nn.TransformerEncoder's eval
fast path over a fully padded sequence; loops that skip a step whose loss or gradients are not finite; stochastic
depth whose keep probability reaches 0; an L2 normalise by a clamped rsqrt (the inf absorbed in forward, NaN in
backward); fused Adam; a log-magnitude STFT loss of a silent clip (complex tensors); ``torch.inference_mode``;
per-frame standardisation in a Dataset's ``__getitem__``; an optimizer per parameter stepped by
post-accumulate-grad hooks inside ``backward()``; a custom Function whose numpy backward divides by 0 (no op to
name: every mode names the module, none an op); a hand-written BatchNorm whose running variance of a last
batch of one is 0 / 0 (the NaN sits in a buffer until the validation pass); Adam's second moment overflowing on a
raw millisecond timestamp while the parameters stay finite; a running variance kept as a plain attribute (strict
xfail: no check reads it, the NaN shows a step late); a hand-written LARS whose trust ratio is 0 / 0 for a
parameter never used; a sparse embedding with SparseAdam; a TorchScript child; SAM's perturbation by a gradient
norm of 0 (two forward and backward passes a step); sampling at temperature 0 (``torch.multinomial`` raises); a
temperature annealed by a Python counter attribute to 0 at step 30; an L2 PGD attack normalising a zero input
gradient between model calls (autograd.grad by no parameter: loop code), and FGSM by a NaN input gradient;
``clip_grad_norm_(error_if_nonfinite=True)`` raising before the deferred check's optimizer step; distillation
from a float16 teacher that overflows; a reparameterised Gamma sample of a concentration 0 (its gradient's pole);
a shared head whose backward goes bad in its first call only; reentrant checkpointing (the block run under
no_grad, then again inside the backward), forward and backward producers.
Each with the fix its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef, TensorRole


# ---------------------------------------------------------------- a ReLU RNN cell, T calls per step
class ReluCell(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.ih, self.hh = nn.Linear(3, 4), nn.Linear(4, 4, bias=False)
        self.safe = safe

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.safe:
            return torch.tanh(self.ih(x) + self.hh(h))
        return torch.relu(self.ih(x) + self.hh(h))  # producer: hidden matmul


class Recurrent(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.cell, self.head = ReluCell(safe), nn.Linear(4, 1)

    def forward(self, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = seq.new_zeros(seq.shape[1], 4)
        for x in seq:
            h = self.cell(x, h)
        return self.head(h), h


def _rnn(safe: bool) -> Scenario:
    """The recurrent weight has a spectral radius of 3 (an unlucky init); sequences of 8 steps stay finite, the
    long sequence at step 2 (100 steps) overflows the state around its 80th call of the cell."""
    torch.manual_seed(0)
    model = Recurrent(safe)
    with torch.no_grad():
        model.cell.hh.weight.copy_(3 * torch.eye(4))
    seqs = [torch.rand(100 if step == 2 else 8, 2, 3) + 0.5 for step in range(4)]
    targets = _batches(2, 1)
    return _loop(model, lambda step: (seqs[step],), lambda out, step: F.mse_loss(out[0], targets[step]), lr=0.0)


# ---------------------------------------------------------------- a VAE's KL in its forward, in a dataclass
@dataclass
class VAEOutput:
    recon: torch.Tensor
    kl: torch.Tensor


class VAE(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar, self.dec = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 2), nn.Linear(2, 6)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> VAEOutput:
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        if self.safe:
            logvar = logvar.clamp(-30.0, 20.0)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()  # producer: kl exp
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return VAEOutput(self.dec(z), kl)


def _vae(safe: bool) -> Scenario:
    """At step 2 the logvar head's bias has drifted to 89: exp(89) is past float32's max."""
    torch.manual_seed(0)
    model = VAE(safe)
    xs = _batches(4, 6)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.logvar.weight.zero_()
                model.logvar.bias.fill_(89.0)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: out.kl + 1e-30 * F.mse_loss(out.recon, xs[step]), lr=0.0)


# ---------------------------------------------------------------- min-SNR weighting, zero terminal SNR
def _zero_terminal_snr_schedule(steps: int) -> torch.Tensor:
    """Lin et al.'s rescaled betas (diffusers' ``rescale_zero_terminal_snr``): the last alpha_bar is exactly 0."""
    betas = torch.linspace(1e-4, 0.2, steps)
    sqrt_bar = torch.cumprod(1 - betas, 0).sqrt()
    first, last = sqrt_bar[0].clone(), sqrt_bar[-1].clone()
    sqrt_bar = (sqrt_bar - last) * first / (first - last)
    return sqrt_bar ** 2


def _min_snr(safe: bool) -> Scenario:
    """Epsilon prediction with min-SNR-5 loss weights ``min(snr, 5) / snr``; at step 2 a sample draws the last
    timestep, whose SNR is 0: the weight is 0 / 0. Diffusers' fix sets the weight to 1 where snr == 0."""
    torch.manual_seed(0)
    steps = 10
    alpha_bar = _zero_terminal_snr_schedule(steps)
    model = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))
    x0s, noises = _batches(3, 4), _batches(3, 4)
    timesteps = [torch.randint(0, steps - 1, (3,)) for _ in range(4)]
    timesteps[2][1] = steps - 1

    def batch(step: int) -> tuple[torch.Tensor]:
        ab = alpha_bar[timesteps[step]][:, None]
        noisy = ab.sqrt() * x0s[step] + (1 - ab).sqrt() * noises[step]
        return (torch.cat([noisy, timesteps[step][:, None] / steps], 1),)

    def loss_fn(pred: torch.Tensor, step: int) -> torch.Tensor:
        snr = alpha_bar[timesteps[step]] / (1 - alpha_bar[timesteps[step]])
        weights = torch.stack([snr, 5 * torch.ones_like(snr)], 1).min(1)[0] / snr  # producer: min snr
        if safe:
            weights[snr == 0] = 1.0
        per_sample = F.mse_loss(pred, noises[step], reduction="none").mean(1)
        return (per_sample * weights).mean()
    return _loop(model, batch, loss_fn)


# ---------------------------------------------------------------- Beta regression of a target of exactly 1
class BetaHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha, beta = (F.softplus(self.lin(x)) + 1.0).unbind(-1)
        return alpha, beta


def _beta(safe: bool) -> Scenario:
    """Proportions in (0, 1) modelled by a Beta; at step 1 one target is exactly 1.0 (a share that reached 100%):
    Beta's support is the closed interval, so validation passes, and its log_prob holds (beta - 1) * log(1 - 1)."""
    torch.manual_seed(0)
    model = BetaHead()
    xs = _batches(4, 4)
    ys = [torch.rand(4) * 0.8 + 0.1 for _ in range(4)]
    ys[1][2] = 1.0

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        y = ys[step].clamp(1e-4, 1 - 1e-4) if safe else ys[step]
        return -torch.distributions.Beta(*out).log_prob(y).mean()  # producer: beta log_prob
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a state with no legal action
def _no_legal_action(safe: bool) -> Scenario:
    """Invalid-action masking: illegal logits filled with -inf; at step 2 state 1 is terminal and no action is
    legal: the Categorical normalises a row of -inf (logsumexp -inf, then -inf - -inf)."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    obs = _batches(3, 4)
    actions = [torch.tensor([0, 1, 2]) for _ in range(4)]
    legal = [torch.ones(3, 3, dtype=torch.bool) for _ in range(4)]
    legal[2][1] = False
    advantages = torch.tensor([0.5, -0.2, 1.0])

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        fill = torch.finfo(logits.dtype).min if safe else float("-inf")
        logits = logits.masked_fill(~legal[step], fill)
        dist = torch.distributions.Categorical(logits=logits, validate_args=False)  # producer: categorical
        return -(dist.log_prob(actions[step]) * advantages).mean() - 0.01 * dist.entropy().mean()
    return _loop(policy, lambda step: (obs[step],), loss_fn)


# ---------------------------------------------------------------- a GAN: two models, two optimizers
def _gan(safe: bool) -> Scenario:
    """D (ending in a Sigmoid, trained with BCELoss, which clamps its logs) and G (``-log(D(G(z)))`` by hand);
    at iteration 2 D has become certain: its last bias is -200 and D(G(z)) is exactly 0. Steps count both
    optimizers, one iteration a step (tests/test_steps.py): the G loss of iteration 2 is step 2."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    reals, zs = _batches(4, 4), _batches(4, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for it in range(4):
            if it == 2:
                with torch.no_grad():
                    disc[2].bias.fill_(-200.0)
            fake = gen(zs[it])
            d_loss = F.binary_cross_entropy(disc(reals[it]), torch.ones(4, 1)) + F.binary_cross_entropy(
                disc(fake.detach()), torch.zeros(4, 1))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            d_fake = disc(fake)
            if safe:  # noqa: SIM108  (the producer's line stands alone)
                g_loss = F.binary_cross_entropy(d_fake, torch.ones(4, 1))
            else:
                g_loss = -torch.log(d_fake).mean()  # producer: generator log
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            losses += [d_loss.detach(), g_loss.detach()]
        return losses
    return Scenario((gen, disc, opt_g, opt_d), run)


# ---------------------------------------------------------------- a learning rate too high
def _diverging(lr: float) -> Scenario:
    """Linear regression on unnormalised features (scale 10) with SGD at lr 0.1: each step multiplies the error
    by about -20; the squared error overflows at step 14 (at 1e-3 it converges)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    xs = [torch.randn(8, 4) * 10 for _ in range(40)]
    ys = [x.sum(1, keepdim=True) for x in xs]
    return _loop(model, lambda step: (xs[step],),
                 lambda pred, step: F.mse_loss(pred, ys[step]), steps=40, lr=lr)  # producer: mse


CASES = [
    Case("hunt16_relu_rnn_state_overflows_on_a_long_sequence", lambda: _rnn(False),
         Expect("forward", "cell.hh", "Linear", step=2, op="aten.mm.default", marker="hidden matmul",
                cause="overflow")),
    Case("hunt16_tanh_rnn_on_a_long_sequence_healthy", lambda: _rnn(True), None),
    Case("hunt16_vae_kl_of_a_logvar_of_89_in_a_dataclass_output", lambda: _vae(False),
         Expect("forward", "", "VAE", step=2, op="aten.exp.default", marker="kl exp", cause="exp-overflow")),
    Case("hunt16_vae_logvar_clamped_healthy", lambda: _vae(True), None),
    Case("hunt16_min_snr_weights_at_a_zero_terminal_snr", lambda: _min_snr(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="min snr", cause="division-by-zero")),
    Case("hunt16_min_snr_weights_set_to_one_at_zero_snr_healthy", lambda: _min_snr(True), None),
    Case("hunt16_beta_log_prob_of_a_target_of_one", lambda: _beta(False),
         Expect("forward", None, step=1, op="aten.xlogy.Tensor", marker="beta log_prob", cause="log-domain")),
    Case("hunt16_beta_targets_clamped_healthy", lambda: _beta(True), None),
    Case("hunt16_categorical_of_a_state_with_no_legal_action", lambda: _no_legal_action(False),
         Expect("forward", None, step=2, op="aten.logsumexp.default", marker="categorical", cause="masked-softmax")),
    Case("hunt16_categorical_masked_with_finfo_min_healthy", lambda: _no_legal_action(True), None),
    Case("hunt16_gan_generator_log_of_a_certain_discriminator", lambda: _gan(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="generator log", cause="log-domain")),
    Case("hunt16_gan_generator_bce_healthy", lambda: _gan(True), None),
    Case("hunt16_regression_diverging_at_a_learning_rate_too_high", lambda: _diverging(0.1),
         Expect("forward", None, step=14, op="aten.mse_loss.default", marker="mse", cause="learning-rate-too-high")),
    Case("hunt16_regression_at_a_lower_learning_rate_healthy", lambda: _diverging(1e-3), None),
]


# ================================================================ second round
# ---------------------------------------------------------------- a shared head called twice, a blank second view
class QuaternionHead(nn.Module):
    """Predicts a rotation as a unit quaternion, normalised by hand."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.zeros_(layer.bias)
        self.safe = safe

    def forward(self, view: torch.Tensor) -> torch.Tensor:
        q = self.mlp(view)
        if self.safe:
            return F.normalize(q, dim=-1)
        return q / q.norm(dim=-1, keepdim=True)  # producer: quaternion norm


class RelativePose(nn.Module):
    """A siamese pose model: the same head on both views (the module called twice per step)."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.head = QuaternionHead(safe)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return (self.head(first) * self.head(second)).sum(-1).abs()


def _siamese(safe: bool) -> Scenario:
    """At step 2 the second view of sample 1 is blank (a dropped frame, zeros): every bias is zero-initialised,
    so its quaternion is exactly 0, and only the head's second call divides 0 by 0."""
    torch.manual_seed(0)
    model = RelativePose(safe)
    firsts, seconds = _batches(3, 6), _batches(3, 6)
    seconds[2][1] = 0.0
    return _loop(model, lambda step: (firsts[step], seconds[step]), lambda dot, step: (1 - dot).mean(), lr=0.0)


# ---------------------------------------------------------------- CTC over an utterance too short for its label
class Acoustic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 4)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.proj(frames).log_softmax(-1)


def _ctc(zero_infinity: bool) -> Scenario:
    """At step 2 utterance 1 has 4 frames for the label "1 1 1" (a repeated label needs a blank between: 5
    frames): no alignment exists, its CTC loss is inf (``zero_infinity=True`` is the documented fix)."""
    torch.manual_seed(0)
    model = Acoustic()
    frames = [torch.randn(8, 2, 5) for _ in range(4)]
    labels = torch.tensor([[1, 2, 3], [1, 1, 1]])
    input_lengths = [torch.tensor([8, 4 if step == 2 else 8]) for step in range(4)]

    def loss_fn(log_probs: torch.Tensor, step: int) -> torch.Tensor:
        return F.ctc_loss(log_probs, labels, input_lengths[step], torch.tensor([3, 3]),  # producer: ctc
                          zero_infinity=zero_infinity)
    return _loop(model, lambda step: (frames[step],), loss_fn)


# ---------------------------------------------------------------- nn.RNN(nonlinearity="relu"): torch's own module
def _fused_rnn(nonlinearity: str) -> Scenario:
    """The same explosion as the hand-written cell, through ``nn.RNN`` (the root model): on the CPU its
    ``rnn_relu`` runs as a matmul per time step, one of which overflows; the line is the user's call of it."""
    torch.manual_seed(0)
    model = nn.RNN(3, 4, nonlinearity=nonlinearity)
    with torch.no_grad():
        model.weight_hh_l0.copy_(3 * torch.eye(4))
        model.weight_ih_l0.fill_(0.5)
        model.bias_ih_l0.zero_()
        model.bias_hh_l0.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seqs = [torch.rand(100 if step == 2 else 8, 2, 3) + 0.5 for step in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            output, _last = model(seqs[step])  # producer: nn.RNN call
            loss = output[-1].pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- accumulation: a backward in micro-batch 3 of 4
def _accumulated_sqrt(safe: bool) -> Scenario:
    """A metric-learning loss (anchor-positive distance by sqrt), accumulated over 4 micro-batches per step; at
    step 1 micro-batch 2's pair is one image twice (a duplicate in the loader): distance 0, sqrt's backward
    divides by 0. Its loss is finite; every micro-batch's backward runs before the one optimizer step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    anchors = [[torch.randn(2, 4) for _ in range(4)] for _ in range(3)]
    positives = [[torch.randn(2, 4) for _ in range(4)] for _ in range(3)]
    positives[1][2] = anchors[1][2].clone()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                a, p = model(anchors[step][micro]), model(positives[step][micro])
                squared = (a - p).pow(2).sum(-1)
                if safe:  # noqa: SIM108  (the producer's line stands alone)
                    distance = (squared + 1e-12).sqrt()
                else:
                    distance = squared.sqrt()  # producer: pair distance
                loss = distance.mean() / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a temperature annealed to 0 at step 300
class AnnealedSoftmax(nn.Module):
    """A soft assignment whose temperature anneals linearly over 300 calls, counted in a buffer its forward
    increments (as Gumbel-softmax quantisers and soft-argmax heads do)."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.lin, self.codebook = nn.Linear(4, 6), nn.Linear(6, 4, bias=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.floor = floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tau = (1 - self.calls / 300).clamp(min=self.floor)
        self.calls += 1
        return self.codebook(torch.softmax(self.lin(x) / tau, -1))  # producer: annealed temperature


def _annealed(floor: float) -> Scenario:
    """At step 300 the temperature reaches 0: logits / 0 is +-inf, and the softmax of +inf entries NaN. The
    twin keeps a floor of 0.05."""
    torch.manual_seed(0)
    model = AnnealedSoftmax(floor)
    xs = _batches(4, 4, steps=1)[0]
    return _loop(model, lambda step: (xs,), lambda out, step: out.pow(2).mean(), steps=302, lr=1e-3)


# ---------------------------------------------------------------- Adam with eps=0 and a row never used
def _adam_eps(eps: float) -> Scenario:
    """An embedding trained with Adam(eps=0) (set to match a paper's update exactly): row 9 is never in a batch,
    its gradient is 0, and the update m / sqrt(v) is 0 / 0 at the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    tokens = [torch.randint(0, 9, (6,)) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = model(tokens[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: adam step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_shared_head_second_call_of_a_blank_view", lambda: _siamese(False),
         Expect("forward", "head", "QuaternionHead", step=2, op="aten.div.Tensor", marker="quaternion norm",
                cause="division-by-zero")),
    Case("hunt16_shared_head_normalize_with_eps_healthy", lambda: _siamese(True), None),
    Case("hunt16_ctc_of_an_utterance_too_short_for_its_label", lambda: _ctc(False),
         Expect("forward", None, step=2, op="aten._ctc_loss.Tensor", marker="ctc", cause="ctc-infeasible")),
    Case("hunt16_ctc_zero_infinity_healthy", lambda: _ctc(True), None),
    Case("hunt16_fused_relu_rnn_overflows_on_a_long_sequence", lambda: _fused_rnn("relu"),
         Expect("forward", "", "RNN", step=2, op="aten.addmm.default", marker="nn.RNN call", cause="overflow")),
    Case("hunt16_fused_tanh_rnn_on_a_long_sequence_healthy", lambda: _fused_rnn("tanh"), None),
    Case("hunt16_accumulation_sqrt_backward_in_micro_batch_3", lambda: _accumulated_sqrt(False),
         Expect("backward", None, step=1, op="aten.div.Tensor", marker="pair distance", cause="sqrt-domain")),
    Case("hunt16_accumulation_sqrt_with_eps_healthy", lambda: _accumulated_sqrt(True), None),
    Case("hunt16_temperature_annealed_to_zero_at_step_300", lambda: _annealed(0.0),
         Expect("forward", "", "AnnealedSoftmax", step=300, op="aten.div.Tensor", marker="annealed temperature",
                cause="division-by-zero")),
    Case("hunt16_temperature_annealed_to_a_floor_healthy", lambda: _annealed(0.05), None),
    Case("hunt16_adam_eps_zero_and_a_row_never_used", lambda: _adam_eps(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten.addcdiv_.default", marker="adam step",
                cause="optimizer-eps-underflow")),
    Case("hunt16_adam_default_eps_healthy", lambda: _adam_eps(1e-8), None),
]


# ================================================================ third round
# ---------------------------------------------------------------- depth in millimetres cast to float16 in the loop
class HalfDepthNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1).half()

    def forward(self, depth: torch.Tensor) -> torch.Tensor:
        return self.lin(depth).float()


def _half_depth(scale_first: bool) -> Scenario:
    """Depth maps in millimetres (a LiDAR's uint16 range), cast to float16 in the loop, then scaled to metres; at
    step 2 a far return reads 70000 mm, past float16's max (65504): the cast is inf. Scaling in float32 first is
    the fix."""
    torch.manual_seed(0)
    model = HalfDepthNet()
    depths = [torch.rand(3, 6) * 5000 for _ in range(4)]
    depths[2][1, 4] = 70000.0
    targets = _batches(3, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if scale_first:
            return ((depths[step] / 1000).half(),)
        metres = depths[step].half() / 1000  # producer: half cast
        return (metres,)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, targets[step]), lr=0.0)


# ---------------------------------------------------------------- pointer-generator: a gold word with probability 0
class CopyDecoder(nn.Module):
    """One decoder step of a pointer-generator: p_gen mixes the vocabulary distribution (zeros over the extended
    vocabulary of source OOV words) with the copy attention over the source."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cell = nn.Embedding(8, 6), nn.GRUCell(6, 6)
        self.vocab, self.gen = nn.Linear(6, 8), nn.Linear(6, 1)

    def forward(self, token: torch.Tensor, h: torch.Tensor, source_ids: torch.Tensor,
                memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.cell(self.embed(token.clamp(max=7)), h)
        attention = torch.softmax((memory @ h[:, :, None]).squeeze(-1), -1)
        p_gen = torch.sigmoid(self.gen(h))
        extended = torch.cat([self.vocab(h).softmax(-1) * p_gen, h.new_zeros(len(h), 4)], -1)
        return extended.scatter_add(1, source_ids, attention * (1 - p_gen)), h


class SourceEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)

    def forward(self, source_ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed(source_ids))


def _pointer_generator(eps: float) -> Scenario:
    """Teacher forcing over 6 target tokens, the decoder called once per token; at step 1 target token 4 of
    sequence 0 is an OOV word (id 10) that its source does not hold: its probability is exactly 0 and
    -log(0) is inf (the original code's NaN loss; the fix adds an eps)."""
    torch.manual_seed(0)
    encoder, decoder = SourceEncoder(), CopyDecoder()
    opt = torch.optim.SGD([*encoder.parameters(), *decoder.parameters()], lr=0.01)
    sources = [torch.randint(0, 8, (2, 5)) for _ in range(3)]
    for source in sources:
        source[:, 2] = 9
    targets = [torch.randint(0, 8, (2, 6)) for _ in range(3)]
    targets[1][0, 4] = 10

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            memory = encoder(sources[step])
            h, token, loss = memory.mean(1), torch.zeros(2, dtype=torch.long), 0.0
            for t in range(6):
                dist, h = decoder(token, h, sources[step], memory)
                gold = dist.gather(1, targets[step][:, t:t + 1]).squeeze(1)
                loss = loss - torch.log(gold + eps).mean() / 6  # producer: gold log
                token = targets[step][:, t]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((encoder, decoder, opt), run)


# ---------------------------------------------------------------- inverse-frequency class weights with an absent class
def _class_weight_of_an_absent_class(safe: bool) -> Scenario:
    """Class weights computed once before training, ``n / (C * count)``; class 4 has no sample in the training
    set: its weight is inf. Cross-entropy alone never reads it (no target is 4), but label smoothing spreads mass
    over every class, and the loss is inf from the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))
    xs = _batches(6, 4)
    ys = [torch.randint(0, 4, (6,)) for _ in range(4)]
    counts = torch.bincount(torch.cat(ys), minlength=5).float()
    if safe:
        counts = counts.clamp(min=1)
    weight = counts.sum() / (5 * counts)
    return _loop(model, lambda step: (xs[step],),
                 lambda logits, step: F.cross_entropy(logits, ys[step], weight=weight,  # producer: class weights
                                                      label_smoothing=0.1))


# ---------------------------------------------------------------- bfloat16 autocast: 1 - sigmoid rounds to 0
def _bf16_bce(stable: bool) -> Scenario:
    """A hand-written BCE under CPU bfloat16 autocast: the logits are bfloat16, and sigmoid(7) = 0.99909 rounds
    to 1.0 in bfloat16 (8 bits of mantissa): log(1 - p) is -inf where float32 gives -7. At step 2 a positive
    logit reaches 7 on a negative sample."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = _batches(4, 4), [torch.tensor([[1.0], [0.0], [1.0], [0.0]]) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.bias.fill_(7.0 - float(model.weight @ xs[step][1]))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(xs[step])
                if stable:
                    loss = F.binary_cross_entropy_with_logits(logits, ys[step])
                else:
                    p = torch.sigmoid(logits)
                    loss = -(ys[step] * torch.log(p) + (1 - ys[step]) * torch.log(1 - p)).mean()  # producer: bf16
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach().float())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_depth_in_millimetres_cast_to_float16_in_the_loop", lambda: _half_depth(False),
         Expect("data", "", "HalfDepthNet", step=2, op="aten._to_copy.default", marker="half cast",
                cause="half-precision-overflow")),
    Case("hunt16_depth_scaled_in_float32_then_cast_healthy", lambda: _half_depth(True), None),
    Case("hunt16_pointer_generator_gold_word_of_probability_0", lambda: _pointer_generator(0.0),
         Expect("forward", None, step=1, op="aten.log.default", marker="gold log", cause="log-domain")),
    Case("hunt16_pointer_generator_log_with_eps_healthy", lambda: _pointer_generator(1e-12), None),
    Case("hunt16_class_weight_of_a_class_absent_from_the_training_set", lambda: _class_weight_of_an_absent_class(False),
         Expect("data", None, step=0, cause="bad-input-data", marker="class weights",
                tensor=TensorRef(TensorRole.INPUT, "aten.nll_loss_forward.default", "weight"),
                says=tuple((mode, "a class weight 1 / count of a class with no sample")
                           for mode in ("default", "defer", "full", "ops")))),
    Case("hunt16_class_weight_counts_clamped_healthy", lambda: _class_weight_of_an_absent_class(True), None),
    Case("hunt16_bf16_autocast_log_of_one_minus_a_rounded_sigmoid", lambda: _bf16_bce(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="bf16", cause="log-domain")),
    Case("hunt16_bf16_autocast_bce_with_logits_healthy", lambda: _bf16_bce(True), None),
]


# ================================================================ fourth round
# ---------------------------------------------------------------- a validation pass between training steps
class Embedder(nn.Module):
    """Embeddings normalised by hand to the unit sphere (a retrieval model)."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        nn.init.zeros_(self.lin.bias)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.lin(x)
        if self.safe:
            return F.normalize(e, dim=-1)
        return e / e.norm(dim=-1, keepdim=True)  # producer: embedding norm


def _validation(safe: bool) -> Scenario:
    """Three training steps, then a validation pass over 4 batches under ``no_grad`` in eval mode; validation
    batch 2 holds a blank sample (zeros; the bias is zero-initialised and training leaves it at 0 here, lr 0
    for it): its embedding is 0 and the norm divides 0 by 0. Three optimizer steps ran before: step 3, not
    3 + the validation batch's index."""
    torch.manual_seed(0)
    model = Embedder(safe)
    opt = torch.optim.SGD([model.lin.weight], lr=0.01)
    train, val = _batches(4, 4, steps=3), _batches(4, 4)
    val[2][1] = 0.0

    def run() -> list[torch.Tensor]:
        results = []
        model.train()
        for step in range(3):
            e = model(train[step])
            loss = (e @ e.T).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            results.append(loss.detach())
        model.eval()
        with torch.no_grad():
            for batch in val:
                results.append(model(batch).sum(-1))
        return results
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- nn.TransformerEncoder's fast path in eval
def _transformer_eval(pad_all: bool) -> Scenario:
    """Inference with ``nn.TransformerEncoder`` in eval mode under ``no_grad`` (its fast path); at call 2 one
    sequence of the batch is all padding (an empty document): its attention row masks every key."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    xs = _batches(2, 3, 8)
    masks = [torch.zeros(2, 3, dtype=torch.bool) for _ in range(4)]
    for mask in masks:
        mask[0, 2] = True
    if pad_all:
        masks[2][1] = True

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(xs[i], src_key_padding_mask=masks[i]) for i in range(4)]  # producer: encoder call
    return Scenario((model,), run)


CASES += [
    Case("hunt16_validation_pass_blank_sample_after_three_steps", lambda: _validation(False),
         Expect("forward", "", "Embedder", step=3, op="aten.div.Tensor", marker="embedding norm",
                cause="division-by-zero")),
    Case("hunt16_validation_pass_normalize_with_eps_healthy", lambda: _validation(True), None),
    Case("hunt16_transformer_encoder_eval_fast_path_fully_padded", lambda: _transformer_eval(True),
         Expect("forward", "layers.0", "TransformerEncoderLayer", step=2,
                op="aten._transformer_encoder_layer_fwd.default", marker="encoder call", cause="masked-softmax")),
    Case("hunt16_transformer_encoder_eval_fast_path_padded_healthy", lambda: _transformer_eval(False), None),
]


# ================================================================ fifth round
# ---------------------------------------------------------------- a loop that skips a step whose loss is not finite
class LogFeatures(nn.Module):
    """Log-transformed count features (log of a ReLU), a classic of tabular models."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(torch.relu(self.lin(x)) + self.eps))  # producer: log features


def _skip_nonfinite_loss(eps: float) -> Scenario:
    """The loop guards itself: ``if not torch.isfinite(loss): continue`` (no backward, no optimizer step). At
    step 2 a unit of the log's input is 0 for a sample: the model's output is -inf, the loss inf, and the loop
    skips it; the next iteration's optimizer step is the deferred check's first chance to read step 2."""
    torch.manual_seed(0)
    model = LogFeatures(eps)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = [torch.rand(3, 4) + 0.1 for _ in range(5)], _batches(3, 1, steps=5)
    xs[2][1, 3] = -1.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            loss = F.mse_loss(model(xs[step]), ys[step])
            losses.append(loss.detach())
            if not torch.isfinite(loss):
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loop that skips a step of non-finite gradients
def _skip_nonfinite_gradients(safe: bool) -> Scenario:
    """fairseq's guard: ``norm = clip_grad_norm_(...)``; ``if not torch.isfinite(norm): zero_grad; continue``.
    At step 2 a pair is one sample twice: sqrt's backward at 0 makes the gradients NaN, the loop drops them
    (``zero_grad`` frees them) and goes on; nothing non-finite is left for the deferred check to read but what
    it probed during the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    anchors, others = _batches(3, 4, steps=5), _batches(3, 4, steps=5)
    others[2][0] = anchors[2][0]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            squared = (model(anchors[step]) - model(others[step])).pow(2).sum(-1)
            if safe:  # noqa: SIM108  (the producer's line stands alone)
                distance = (squared + 1e-12).sqrt()
            else:
                distance = squared.sqrt()  # producer: skipped distance
            loss = distance.mean()
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            losses.append(loss.detach())
            if not torch.isfinite(norm):
                opt.zero_grad()
                continue
            opt.step()
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_loop_skips_a_nonfinite_loss_model_output_minus_inf", lambda: _skip_nonfinite_loss(0.0),
         Expect("forward", "", "LogFeatures", step=2, op="aten.log.default", marker="log features",
                cause="log-domain")),
    Case("hunt16_loop_skips_a_nonfinite_loss_log_with_eps_healthy", lambda: _skip_nonfinite_loss(1e-6), None),
    Case("hunt16_loop_skips_nonfinite_gradients_sqrt_backward", lambda: _skip_nonfinite_gradients(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="skipped distance", cause="sqrt-domain")),
    Case("hunt16_loop_skips_nonfinite_gradients_sqrt_with_eps_healthy", lambda: _skip_nonfinite_gradients(True), None),
]


# ---------------------------------------------------------------- stochastic depth whose drop rate reaches 1
class DropPathBlock(nn.Module):
    """A residual block with stochastic depth written by hand: a per-sample Bernoulli keep mask, scaled by
    1 / keep_prob (timm guards the division by ``keep_prob > 0``)."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.keep_prob = 1.0
        self.guarded = guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = torch.tanh(self.lin(x))
        if self.training:
            mask = torch.floor(self.keep_prob + torch.rand(len(x), 1))
            if not self.guarded or self.keep_prob > 0:
                branch = branch / self.keep_prob  # producer: drop path
            branch = branch * mask
        return x + branch


def _drop_path(guarded: bool) -> Scenario:
    """Progressive stochastic depth: the last block's drop rate rises with training, 0.5 a step, and reaches 1
    at step 2 (the schedule's end, meant as "always drop"): branch / 0 is inf, times a mask of 0 NaN. The mask
    is random: a replay must draw what the step drew."""
    torch.manual_seed(0)
    model = nn.Sequential(DropPathBlock(guarded), DropPathBlock(guarded), nn.Linear(4, 1))
    xs, ys = _batches(3, 4), _batches(3, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        model[1].keep_prob = max(0.0, 1.0 - 0.5 * step)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), steps=3)


CASES += [
    Case("hunt16_stochastic_depth_keep_prob_reaches_0", lambda: _drop_path(False),
         Expect("forward", "1", "DropPathBlock", step=2, op="aten.div.Tensor", marker="drop path",
                cause="division-by-zero")),
    Case("hunt16_stochastic_depth_guarded_division_healthy", lambda: _drop_path(True), None),
]


# ---------------------------------------------------------------- an L2 normalise by rsqrt whose inf is clamped
class RsqrtNormalize(nn.Module):
    """L2 normalisation as Keras' torch backend wrote it: ``x * min(rsqrt(sum x^2), 1 / eps)``: the clamp fixes
    the forward value of a zero vector, not its derivative."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        nn.init.zeros_(self.proj.bias)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        square_sum = h.pow(2).sum(-1, keepdim=True)
        if self.safe:
            inverse = torch.rsqrt(square_sum.clamp(min=1e-12 ** 2))
        else:
            inverse = torch.minimum(torch.rsqrt(square_sum), torch.tensor(1e12))  # producer: clamped rsqrt
        return self.head(h * inverse)


def _rsqrt_normalize(safe: bool) -> Scenario:
    """At step 1 sample 0 is blank (zeros; the projection's bias is zero-initialised): rsqrt(0) is inf, the
    minimum makes it 1e12 (finite forward), and rsqrt's backward multiplies the 0 gradient the minimum passed
    it by inf: NaN."""
    torch.manual_seed(0)
    model = RsqrtNormalize(safe)
    xs, ys = _batches(3, 4), _batches(3, 1)
    xs[1][0] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES += [
    Case("hunt16_l2_normalize_by_a_clamped_rsqrt_of_a_zero_vector", lambda: _rsqrt_normalize(False),
         Expect("backward", "", "RsqrtNormalize", step=1, op="aten.pow.Tensor_Scalar", marker="clamped rsqrt",
                cause="sqrt-domain",
                says=(("full", "inputs      finite, but for an infinity absorbed in forward"),
                      ("default", "the 1 +inf came from aten.rsqrt.default"),
                      ("defer", "the 1 +inf came from aten.rsqrt.default")))),
    Case("hunt16_l2_normalize_clamped_before_rsqrt_healthy", lambda: _rsqrt_normalize(True), None),
]


# ================================================================ sixth round
# ---------------------------------------------------------------- fused Adam (one op for the whole step)
def _fused_adam(eps: float) -> Scenario:
    """The Adam(eps=0) row-never-used case with ``fused=True`` (one ``_fused_adam_`` op updates every parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps, fused=True)
    tokens = [torch.randint(0, 9, (6,)) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = model(tokens[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: fused adam step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a log-magnitude STFT loss of a silent clip
class Vocoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 64)

    def forward(self, mel: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(mel)) * gate


def _stft_loss(eps: float) -> Scenario:
    """A multi-resolution-STFT-style loss, ``|log |STFT(y_hat)| - log |STFT(y)||``, through complex tensors; at
    step 2 clip 1 is silence (the gate zeroes it, as a voice-activity mask does): every magnitude is 0 and the
    log is -inf (the vocoder fix: clamp the magnitude, ``log(mag.clamp(min=1e-7))``)."""
    torch.manual_seed(0)
    model = Vocoder()
    mels, targets = _batches(2, 16), _batches(2, 64)
    gates = [torch.ones(2, 1) for _ in range(4)]
    gates[2][1] = 0.0
    window = torch.hann_window(16)

    def loss_fn(audio: torch.Tensor, step: int) -> torch.Tensor:
        spec = torch.stft(audio, 16, hop_length=4, window=window, return_complex=True)
        reference = torch.stft(targets[step], 16, hop_length=4, window=window, return_complex=True)
        log_mag = torch.log(spec.abs().clamp(min=eps) if eps else spec.abs())  # producer: log magnitude
        return (log_mag - torch.log(reference.abs().clamp(min=1e-7))).abs().mean()
    return _loop(model, lambda step: (mels[step], gates[step]), loss_fn)


# ---------------------------------------------------------------- inference under torch.inference_mode()
class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.lin(x).softmax(-1)
        return (p * p.log()).sum(-1)  # producer: inference entropy


def _inference_mode(temperature: float) -> Scenario:
    """Scoring batches under ``torch.inference_mode()`` (tensors that cannot be saved for autograd or changed
    outside it); at call 2 the inputs are 1000 times larger: the softmax saturates to exact zeros, and
    p * log p is 0 * -inf."""
    torch.manual_seed(0)
    model = Scorer()
    xs = _batches(3, 4)
    xs[2] = xs[2] * 1000 * temperature

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [model(x) for x in xs]
    return Scenario((model,), run)


CASES += [
    Case("hunt16_fused_adam_eps_zero_and_a_row_never_used", lambda: _fused_adam(0.0),
         Expect("optimizer", "0", "Embedding", step=0, op="aten._fused_adam_.default", marker="fused adam step",
                cause="optimizer-eps-underflow")),
    Case("hunt16_fused_adam_default_eps_healthy", lambda: _fused_adam(1e-8), None),
    Case("hunt16_log_magnitude_stft_loss_of_a_silent_clip", lambda: _stft_loss(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="log magnitude", cause="log-domain")),
    Case("hunt16_log_magnitude_stft_loss_clamped_healthy", lambda: _stft_loss(1e-7), None),
    Case("hunt16_inference_mode_entropy_of_a_saturated_softmax", lambda: _inference_mode(1.0),
         Expect("forward", "", "Scorer", step=2, op="aten.log.default", marker="inference entropy",
                cause="log-domain")),
    Case("hunt16_inference_mode_entropy_healthy", lambda: _inference_mode(0.001), None),
]


# ---------------------------------------------------------------- per-image standardisation in a Dataset
class Frames(torch.utils.data.Dataset):
    """Each frame standardised by its own mean and std in ``__getitem__`` (instance normalisation of inputs)."""

    def __init__(self, safe: bool) -> None:
        torch.manual_seed(0)
        self.frames = torch.rand(12, 6)
        self.frames[9] = 0.5  # a blank frame (a dropped camera frame, one grey value)
        self.safe = safe

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, index: int) -> torch.Tensor:
        frame = self.frames[index]
        if self.safe:
            return (frame - frame.mean()) / (frame.std() + 1e-6)
        return (frame - frame.mean()) / frame.std()  # producer: frame std


def _dataset_standardise(safe: bool) -> Scenario:
    """A DataLoader (in-process, batches of 4, no shuffle) over the frames: batch 2 holds frame 9, whose std is
    0: 0 / 0 in ``__getitem__``, before any watched code runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Frames(safe), batch_size=4)

    def run() -> list[torch.Tensor]:
        losses = []
        for frames in loader:
            loss = model(frames).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_dataset_getitem_standardises_a_blank_frame", lambda: _dataset_standardise(False),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="frame std",
                cause="division-by-zero")),
    Case("hunt16_dataset_getitem_std_with_eps_healthy", lambda: _dataset_standardise(True), None),
]


# ================================================================ seventh round
# ---------------------------------------------------------------- the optimizer step fused into the backward
def _optimizer_in_backward(eps: float) -> Scenario:
    """PyTorch's recipe for saving memory: one optimizer per parameter, stepped by a post-accumulate-grad hook
    as soon as that gradient is ready, inside ``loss.backward()``; four optimizers step once each per
    iteration. At iteration 2 a sample's log feature meets a zero (the log's input is a ReLU): step 2."""
    torch.manual_seed(0)
    model = LogFeatures(eps)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    optimizers = {p: torch.optim.SGD([p], lr=0.0) for p in model.parameters()}
    xs, ys = [torch.rand(3, 4) + 0.1 for _ in range(4)], _batches(3, 1)
    xs[2][1, 3] = -1.0

    def step_now(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    def run() -> list[torch.Tensor]:
        handles = [p.register_post_accumulate_grad_hook(step_now) for p in model.parameters()]
        try:
            losses = []
            for step in range(4):
                loss = F.mse_loss(model(xs[step]), ys[step])
                loss.backward()
                losses.append(loss.detach())
            return losses
        finally:
            for handle in handles:
                handle.remove()
    return Scenario((model, *optimizers.values()), run)


# ---------------------------------------------------------------- a custom Function whose backward is numpy
class NumpySqrt(torch.autograd.Function):
    """sqrt through numpy, forward and backward: code that dispatches no aten op, as a C/CUDA extension's kernel
    does not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        root = torch.from_numpy(np.sqrt(x.detach().numpy()))
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (root,) = ctx.saved_tensors
        with np.errstate(divide="ignore", invalid="ignore"):
            derivative = 0.5 / root.numpy()
        return torch.from_numpy(grad.numpy() * derivative)


class RootFeatures(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(NumpySqrt.apply(self.lin(x).pow(2) + self.eps))  # producer: numpy sqrt


def _numpy_function(eps: float) -> Scenario:
    """At step 2 a feature of a sample is 0: the sqrt's input h^2 is 0 there, the forward finite (sqrt(0) = 0),
    the numpy backward 0.5 / 0 = inf, and pow's backward 2h * inf = 0 * inf NaN."""
    torch.manual_seed(0)
    model = RootFeatures(eps)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    xs, ys = [torch.rand(3, 4) + 0.1 for _ in range(4)], _batches(3, 1)
    xs[2][1, 3] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES += [
    Case("hunt16_optimizer_stepped_in_backward_hooks_log_at_iteration_2", lambda: _optimizer_in_backward(0.0),
         Expect("forward", "", "LogFeatures", step=2, op="aten.log.default", marker="log features",
                cause="log-domain")),
    Case("hunt16_optimizer_stepped_in_backward_hooks_healthy", lambda: _optimizer_in_backward(1e-6), None),
    Case("hunt16_custom_function_numpy_backward_divides_by_a_zero_root", lambda: _numpy_function(0.0),
         Expect("backward", "", "RootFeatures", step=2, op=None, cause="unclassified",
                says=tuple((mode, "the op tracer saw no op make it from finite values")
                           for mode in ("default", "defer", "ops")))),
    Case("hunt16_custom_function_numpy_sqrt_with_eps_healthy", lambda: _numpy_function(1e-6), None),
]


# ================================================================ eighth round
# ---------------------------------------------------------------- a running variance by hand, a last batch of one
class HandBatchNorm(nn.Module):
    """Batch normalisation written by hand: the batch's biased variance normalises, the unbiased one (Bessel's
    correction, as nn.BatchNorm does) updates the running variance the eval mode uses."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("running_var", torch.ones(4))
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return (x - self.running_mean) / (self.running_var + 1e-5).sqrt()
        mean, var = x.mean(0), x.var(0, correction=0)
        with torch.no_grad():
            if self.safe:  # noqa: SIM108  (the producer's line stands alone)
                unbiased = x.var(0, correction=0)
            else:
                unbiased = x.var(0)  # producer: bn var
            self.running_mean.mul_(0.9).add_(0.1 * mean)
            self.running_var.mul_(0.9).add_(0.1 * unbiased)
        return (x - mean) / (var + 1e-5).sqrt()


def _hand_batch_norm(safe: bool) -> Scenario:
    """The epoch's last batch (step 2) holds one sample: its unbiased variance is 0 / 0 and the running variance
    NaN, while the training output stays finite; the NaN surfaces in the validation pass after the epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), HandBatchNorm(safe), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(1, 3)]
    val = _batches(4, 3, steps=2)

    def run() -> list[torch.Tensor]:
        results = []
        model.train()
        for batch in batches:
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            results.append(loss.detach())
        model.eval()
        with torch.no_grad():
            results += [model(batch) for batch in val]
        return results
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Adam's second moment overflows, the parameters do not
def _adam_state_overflow(scale: float) -> Scenario:
    """A raw Unix time in milliseconds (1.7e12) as a feature, Adam: the gradient is about 1e24, its square
    (1 - beta2) * g^2 overflows float32 in exp_avg_sq, and the update m / sqrt(inf) is 0: the parameters stay
    finite and that weight stops learning, silently. Scaled to days (scale 1 / 8.64e7) it trains."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs = [torch.stack([torch.full((8,), 1.7e12) + torch.rand(8) * 1e9, torch.randn(8)], 1) * scale
          for _ in range(3)]
    ys = _batches(8, 1, steps=3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: adam state
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_hand_batch_norm_running_var_of_a_last_batch_of_one", lambda: _hand_batch_norm(False),
         Expect("forward", "1", "HandBatchNorm", step=2, op="aten.var.correction", marker="bn var",
                cause="division-by-zero", says=tuple(
                    (mode, "made the non-finite value that aten.add_.Tensor wrote into 1.running_var")
                    for mode in ("default", "defer", "full", "ops")))),
    Case("hunt16_hand_batch_norm_biased_running_var_healthy", lambda: _hand_batch_norm(True), None),
    Case("hunt16_adam_second_moment_overflows_parameters_finite", lambda: _adam_state_overflow(1.0),
         Expect("optimizer", "", "Linear", step=0, op="aten.addcmul_.default", marker="adam state",
                cause="bad-input-data", says=tuple(
                    (mode, "that parameter's update is 0 from now on")
                    for mode in ("default", "defer", "full", "ops")))),
    Case("hunt16_adam_on_scaled_time_healthy", lambda: _adam_state_overflow(1 / 8.64e7), None),
]


# ---------------------------------------------------------------- a running statistic kept as a plain attribute
class AttributeNorm(nn.Module):
    """A feature normaliser whose running variance is a plain tensor attribute, not a registered buffer (a
    common slip: it is then neither saved nor moved with ``.to()``), updated with Bessel's correction."""

    def __init__(self) -> None:
        super().__init__()
        self.running_var = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_var = 0.9 * self.running_var + 0.1 * x.var(0)  # producer: attribute var
            return (x - x.mean(0)) / (x.var(0, correction=0) + 1e-5).sqrt()
        return x / (self.running_var + 1e-5).sqrt()


def _attribute_norm() -> Scenario:
    """As the hand-written BatchNorm, its statistic a plain attribute that no check reads: the epoch's last batch
    (step 2) of one sample makes it NaN, which shows only in the validation pass after the epoch (step 3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), AttributeNorm(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches, val = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(1, 3)], _batches(4, 3, steps=2)

    def run() -> list[torch.Tensor]:
        results = []
        model.train()
        for batch in batches:
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            results.append(loss.detach())
        model.eval()
        with torch.no_grad():
            results += [model(batch) for batch in val]
        return results
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- LARS without its guards, a parameter never used
class Lars(torch.optim.Optimizer):
    """LARS (You et al.) written by hand: each parameter's step scaled by the trust ratio |w| / |g|, without the
    ``torch.where`` guards of the reference implementations."""

    def __init__(self, params, lr: float, guarded: bool) -> None:
        super().__init__(params, {"lr": lr})
        self.guarded = guarded

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w_norm, g_norm = p.norm(), p.grad.norm()
                if self.guarded:
                    trust = torch.where((w_norm > 0) & (g_norm > 0), w_norm / g_norm, torch.ones_like(w_norm))
                else:
                    trust = w_norm / g_norm  # producer: trust ratio
                p.add_(p.grad * trust, alpha=-group["lr"])


class TwoHeads(nn.Module):
    """A shared trunk and two heads; the auxiliary head's zero-initialised bias gets a zero gradient while the
    auxiliary loss weight is 0 (a warm-up that switches it on later)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.main, self.aux = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
        nn.init.zeros_(self.aux.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.main(h), self.aux(h)


def _lars(guarded: bool) -> Scenario:
    """From step 0 the aux head's bias has w = 0 and g = 0 (its loss weighted 0): the trust ratio is 0 / 0."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = Lars(model.parameters(), lr=0.1, guarded=guarded)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            main, aux = model(xs[step])
            loss = F.mse_loss(main, ys[step]) + 0.0 * aux.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_running_var_as_a_plain_attribute_last_batch_of_one", _attribute_norm,
         Expect("forward", "1", "AttributeNorm", step=2, op="aten.var.correction", marker="attribute var"),
         marks=(pytest.mark.xfail(strict=True, reason=(
             "a plain tensor attribute is no boundary and no buffer (optimizer/running_stats.py reads registered "
             "buffers): its NaN shows first in the validation call that reads it, so every mode names "
             "AttributeNorm at step 3, op None, cause unclassified (the replay's tracer takes the attribute for a "
             "value from outside); naming step 2's var needs the attributes a forward writes read like buffers")),)),
    Case("hunt16_lars_trust_ratio_of_a_parameter_never_used", lambda: _lars(False),
         Expect("optimizer", "aux", "Linear", step=0, op="aten.div.Tensor", marker="trust ratio",
                cause="division-by-zero")),
    Case("hunt16_lars_with_its_guards_healthy", lambda: _lars(True), None),
]


# ================================================================ ninth round
# ---------------------------------------------------------------- sparse gradients: an embedding with SparseAdam
class SparseRecommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.items(ids)))


def _sparse_embedding(eps: float) -> Scenario:
    """A recommender's item embedding with sparse gradients (SparseAdam) and a dense head (Adam); a hand-written
    BCE; at step 2 the head's bias has been pushed to 120 (a positive-only stream of clicks): sigmoid is exactly
    1 and log(1 - p) of a negative sample is -inf."""
    torch.manual_seed(0)
    model = SparseRecommender()
    sparse = torch.optim.SparseAdam(list(model.items.parameters()), lr=1e-3)
    dense = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    ids = [torch.randint(0, 20, (6,)) for _ in range(4)]
    clicks = [torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]).unsqueeze(1) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.head.bias.fill_(120.0)
            p = model(ids[step])
            y = clicks[step]
            loss = -(y * torch.log(p + eps) + (1 - y) * torch.log(1 - p + eps)).mean()  # producer: sparse bce
            sparse.zero_grad()
            dense.zero_grad()
            loss.backward()
            sparse.step()
            dense.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, sparse, dense), run)


# ---------------------------------------------------------------- a TorchScript child module
class ScriptedLogNorm(nn.Module):
    """Scripted with torch.jit.script (a legacy model's custom layer): its code runs in the TorchScript
    interpreter, no Python frame of it."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.lin(x)) + self.eps)


class WithScriptedChild(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.norm = torch.jit.script(ScriptedLogNorm(eps))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # producer: scripted call


def _scripted(eps: float) -> Scenario:
    """At step 2 a unit of the scripted layer's ReLU is 0 for a sample (its input pushed below the bias): the
    scripted log is -inf; no Python line of the log exists, the parent's call of it is the user's line."""
    torch.manual_seed(0)
    model = WithScriptedChild(eps)
    with torch.no_grad():
        model.norm.lin.weight.copy_(torch.eye(4))
        model.norm.lin.bias.zero_()
    xs, ys = [torch.rand(3, 4) + 0.1 for _ in range(4)], _batches(3, 1)
    xs[2][1, 3] = -1.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES += [
    Case("hunt16_sparse_embedding_sparse_adam_log_of_a_saturated_click", lambda: _sparse_embedding(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="sparse bce", cause="log-domain")),
    Case("hunt16_sparse_embedding_sparse_adam_healthy", lambda: _sparse_embedding(1e-7), None),
    Case("hunt16_torchscript_child_log_of_a_zero", lambda: _scripted(0.0),
         Expect("forward", "norm", step=2, op="aten.log.default", marker="scripted call", cause="log-domain")),
    Case("hunt16_torchscript_child_log_with_eps_healthy", lambda: _scripted(1e-6), None),
]


# ---------------------------------------------------------------- SAM: a perturbation by a gradient norm of 0
def _sam(eps: float) -> Scenario:
    """Sharpness-aware minimisation written by hand: backward, perturb each weight by rho * g / |g|, forward and
    backward again, restore, step. A hinge loss; at step 2 every sample clears the margin (the batch is easy): the
    loss is 0, every gradient 0, and rho / |g| is 0.05 / 0 (davda54/sam adds 1e-12)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(6, 4)
    ys = [torch.sign(torch.randn(6, 1)) for _ in range(4)]
    with torch.no_grad():  # batch 2: each sample 10 units along the weight, on its label's side
        xs[2] = ys[2] * 10 * model.weight / model.weight.pow(2).sum()

    def hinge(step: int) -> torch.Tensor:
        return torch.relu(1 - ys[step] * model(xs[step])).mean()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = hinge(step)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                grad_norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                scale = 0.05 / (grad_norm + eps)  # producer: sam scale
                perturbations = [p.grad * scale for p in model.parameters()]
                for p, e in zip(model.parameters(), perturbations):
                    p.add_(e)
            opt.zero_grad()
            hinge(step).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), perturbations):
                    p.sub_(e)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_sam_perturbation_by_a_zero_gradient_norm", lambda: _sam(0.0),
         Expect("optimizer", "", "Linear", step=2, op="aten.reciprocal.default", marker="sam scale",
                cause="division-by-zero")),
    Case("hunt16_sam_perturbation_with_eps_healthy", lambda: _sam(1e-12), None),
]


# ================================================================ eleventh round
# ---------------------------------------------------------------- sampling at temperature 0
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(12, 8), nn.Linear(8, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)).mean(1))


def _sample_at_temperature(temperature: float) -> Scenario:
    """Decoding by sampling, the temperature from a config; at 0 (meant as greedy) ``logits / 0`` is +-inf, the
    softmax of +inf entries NaN, and ``torch.multinomial`` raises "probability tensor contains either inf, nan
    or element < 0" at the first token."""
    torch.manual_seed(0)
    model = TinyLM()
    prompt = torch.randint(0, 12, (2, 3))

    def run() -> torch.Tensor:
        tokens = prompt
        with torch.no_grad():
            for _ in range(4):
                logits = model(tokens)
                probs = torch.softmax(logits / temperature, -1)  # producer: temperature
                tokens = torch.cat([tokens, torch.multinomial(probs, 1)], 1)
        return tokens
    return Scenario((model,), run)


CASES += [
    Case("hunt16_sampling_at_temperature_0", lambda: _sample_at_temperature(0.0),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="temperature")),
    Case("hunt16_sampling_at_temperature_0_7_healthy", lambda: _sample_at_temperature(0.7), None),
]


# ---------------------------------------------------------------- a temperature annealed by a Python counter
class CountedSoftmax(nn.Module):
    """As AnnealedSoftmax, the calls counted in a plain Python int attribute (no buffer): a replay of the call
    must start from the count the call saw, not the one it left."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.lin, self.codebook = nn.Linear(4, 6), nn.Linear(6, 4, bias=False)
        self.calls = 0
        self.floor = floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tau = max(self.floor, 1 - self.calls / 30)
        self.calls += 1
        return self.codebook(torch.softmax(self.lin(x) / tau, -1))  # producer: counted temperature


def _counted(floor: float) -> Scenario:
    """At step 30 the temperature is the Python number 0.0: logits / 0.0 is +-inf, the softmax NaN."""
    torch.manual_seed(0)
    model = CountedSoftmax(floor)
    xs = _batches(4, 4, steps=1)[0]
    return _loop(model, lambda step: (xs,), lambda out, step: out.pow(2).mean(), steps=32, lr=1e-3)


CASES += [
    Case("hunt16_temperature_annealed_by_a_python_counter_to_0", lambda: _counted(0.0),
         Expect("forward", "", "CountedSoftmax", step=30, op="aten.div.Tensor", marker="counted temperature",
                cause="division-by-zero")),
    Case("hunt16_temperature_annealed_by_a_python_counter_floor_healthy", lambda: _counted(0.05), None),
]


# ---------------------------------------------------------------- L2 PGD: a gradient of 0 normalised
def _pgd(eps: float) -> Scenario:
    """Adversarial training with an L2 PGD attack in the loop: three attack iterations per step, each a model
    call and ``torch.autograd.grad`` of the loss by the perturbation, normalised per sample. At step 2 sample 0
    lies where every ReLU of the first layer is off (its features far negative): its input gradient is exactly
    0, and g / |g| is 0 / 0; the perturbed batch enters the training forward NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.abs_()
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = [torch.rand(4, 4) for _ in range(4)], [torch.randint(0, 3, (4,)) for _ in range(4)]
    xs[2][0] = -5.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x, y = xs[step], ys[step]
            delta = torch.zeros_like(x, requires_grad=True)
            for _ in range(3):
                attack = F.cross_entropy(model(x + delta), y)
                (g,) = torch.autograd.grad(attack, delta)
                step_dir = g / (g.norm(dim=1, keepdim=True) + eps)  # producer: pgd normalise
                delta = (delta + 0.1 * step_dir).detach().requires_grad_(True)
            loss = F.cross_entropy(model(x + delta.detach()), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_l2_pgd_normalises_a_zero_input_gradient", lambda: _pgd(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="pgd normalise",
                cause="division-by-zero")),
    Case("hunt16_l2_pgd_normalise_with_eps_healthy", lambda: _pgd(1e-12), None),
]


# ---------------------------------------------------------------- FGSM: a NaN input gradient's sign
def _fgsm(eps: float) -> Scenario:
    """Adversarial training with FGSM: ``x + 0.1 * g.sign()`` of ``g = torch.autograd.grad(attack, delta)``, the
    attack a mean distance of the outputs to anchors. At step 2 sample 0's output is its anchor: sqrt's backward at
    0 makes the input gradient NaN (its sign too), and the adversarial batch enters the training forward NaN. The
    attack's grad is by no parameter (not the step's loss backward): its loss is judged and its output gradient
    checked as a backward's, named in the loss code's backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = [torch.rand(4, 4) for _ in range(4)], [torch.randint(0, 3, (4,)) for _ in range(4)]
    with torch.no_grad():
        anchors = [torch.rand(4, 3) for _ in range(4)]
        anchors[2][0] = model(xs[2])[0]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x, y = xs[step], ys[step]
            delta = torch.zeros_like(x, requires_grad=True)
            attack = ((model(x + delta) - anchors[step]).pow(2).sum(1) + eps).sqrt().mean()  # producer: fgsm sqrt
            (g,) = torch.autograd.grad(attack, delta)
            loss = F.cross_entropy(model(x + 0.1 * g.sign()), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_fgsm_sign_of_a_nan_input_gradient", lambda: _fgsm(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="fgsm sqrt", cause="sqrt-domain")),
    Case("hunt16_fgsm_distance_with_eps_healthy", lambda: _fgsm(1e-12), None),
]


# ---------------------------------------------------------------- clip_grad_norm_(error_if_nonfinite=True)
def _clip_raises(eps: float) -> Scenario:
    """The loop clips with ``error_if_nonfinite=True``: at step 2 a pair's distance is 0 and sqrt's backward
    makes the gradients NaN; the clip raises its RuntimeError before the optimizer step, where the deferred check
    reads the step's probes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    anchors, others = _batches(3, 4), _batches(3, 4)
    others[2][0] = anchors[2][0]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            squared = (model(anchors[step]) - model(others[step])).pow(2).sum(-1)
            loss = (squared + eps).sqrt().mean()  # producer: clipped distance
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES += [
    Case("hunt16_clip_grad_norm_error_if_nonfinite_after_a_sqrt_backward", lambda: _clip_raises(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="clipped distance", cause="sqrt-domain")),
    Case("hunt16_clip_grad_norm_error_if_nonfinite_sqrt_with_eps_healthy", lambda: _clip_raises(1e-12), None),
]


# ---------------------------------------------------------------- distillation: the float16 teacher overflows
class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.out = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.body(x / 6e4)))


def _distillation(scale: float) -> Scenario:
    """A float16 teacher (cast with ``.half()`` to save memory) under ``no_grad``, a float32 student, both
    watched; the batch is raw sensor counts up to 6e4 (fits float16); the teacher's first Linear sums four of
    them times weights near 1: past 65504 at step 2, where the readings saturate."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).half()
    with torch.no_grad():
        teacher[0].weight.copy_(torch.ones(16, 4))
    student = Student()
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    xs = [torch.rand(3, 4) * 1e4 for _ in range(4)]
    xs[2] = torch.full((3, 4), 6e4) * scale

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.no_grad():
                soft = teacher(xs[step].half()).float().softmax(-1)  # producer: teacher call
            loss = F.kl_div(student(xs[step]).log_softmax(-1), soft, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((teacher, student, opt), run)


CASES += [
    Case("hunt16_distillation_float16_teacher_overflows", lambda: _distillation(1.0),
         Expect("forward", "0", "Linear", step=2, op="aten.addmm.default", marker="teacher call",
                cause="half-precision-overflow")),
    Case("hunt16_distillation_float16_teacher_in_range_healthy", lambda: _distillation(0.2), None),
]


# ---------------------------------------------------------------- a reparameterised Gamma sample of a concentration 0
class GammaEncoder(nn.Module):
    """A Dirichlet/Gamma VAE's encoder: Gamma concentrations from softplus."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.floor = floor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.lin(x)) + self.floor


def _gamma_rsample(floor: float) -> Scenario:
    """Topic proportions drawn by ``Gamma(alpha, 1).rsample()`` (implicit reparameterisation), normalised; at step
    2 one concentration has underflowed to exactly 0 (softplus of -200, no floor): the sample is 0 and the
    sampler's gradient in alpha is not finite. The draw is random: a replay must draw what the step drew."""
    torch.manual_seed(0)
    model = GammaEncoder(floor)
    xs, targets = _batches(4, 4), [torch.softmax(torch.randn(4, 3), -1) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.lin.bias[1] = -200.0
                model.lin.weight[1] = 0.0
        return (xs[step],)

    def loss_fn(alpha: torch.Tensor, step: int) -> torch.Tensor:
        dist = torch.distributions.Gamma(alpha, torch.ones_like(alpha), validate_args=False)
        sample = dist.rsample()  # producer: gamma rsample
        theta = sample / sample.sum(-1, keepdim=True).clamp(min=1e-12)
        return (theta - targets[step]).pow(2).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


CASES += [
    Case("hunt16_gamma_rsample_of_a_concentration_of_0", lambda: _gamma_rsample(0.0),
         Expect("backward", None, step=2, op="aten._standard_gamma_grad.default", marker="gamma rsample",
                cause="log-domain")),
    Case("hunt16_gamma_rsample_with_a_floor_healthy", lambda: _gamma_rsample(1e-3), None),
]


# ---------------------------------------------------------------- a shared head's backward, only its first call bad
class NormHead(nn.Module):
    """Embeds a view and returns its length by hand, sqrt(sum h^2) (a magnitude feature)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        nn.init.zeros_(self.lin.bias)
        self.eps = eps

    def forward(self, view: torch.Tensor) -> torch.Tensor:
        h = self.lin(view)
        return torch.sqrt(h.pow(2).sum(-1) + self.eps)  # producer: view length


class TwoViews(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.head = NormHead(eps)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return self.head(first) - self.head(second)


def _shared_backward(eps: float) -> Scenario:
    """At step 1 the first view of sample 0 is blank: its length is sqrt(0) = 0 (finite), and sqrt's backward
    at 0 divides by 0, in the head's first call only; the second call's backward is finite."""
    torch.manual_seed(0)
    model = TwoViews(eps)
    firsts, seconds, ys = _batches(3, 6), _batches(3, 6), _batches(3)
    firsts[1][0] = 0.0
    return _loop(model, lambda step: (firsts[step], seconds[step]),
                 lambda diff, step: F.mse_loss(diff, ys[step]), lr=0.0)


CASES += [
    Case("hunt16_shared_head_backward_of_its_first_call_only", lambda: _shared_backward(0.0),
         Expect("backward", "head", "NormHead", step=1, op="aten.div.Tensor", marker="view length",
                cause="sqrt-domain")),
    Case("hunt16_shared_head_backward_sqrt_with_eps_healthy", lambda: _shared_backward(1e-12), None),
]


# ---------------------------------------------------------------- reentrant checkpointing (the old default)
class ReentrantBlock(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        nn.init.zeros_(self.lin.bias)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h / (h.pow(2).sum(-1, keepdim=True) + self.eps).sqrt()  # producer: reentrant norm


class ReentrantNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.block, self.head = ReentrantBlock(eps), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True))


def _reentrant(eps: float) -> Scenario:
    """``checkpoint(..., use_reentrant=True)``: the block's forward runs under no_grad, then again inside the
    backward (a nested backward of its own). At step 1 sample 0 is blank: its row's norm is 0, its forward 0 / 0
    NaN, seen at the block's first (no_grad) call."""
    torch.manual_seed(0)
    model = ReentrantNet(eps)
    xs, ys = _batches(3, 4), _batches(3, 1)
    for x in xs:
        x.requires_grad_(True)  # (reentrant checkpointing needs an input that requires grad)
    xs[1].data[0] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES += [
    Case("hunt16_reentrant_checkpoint_norm_of_a_blank_row", lambda: _reentrant(0.0),
         Expect("forward", "block", "ReentrantBlock", step=1, op="aten.div.Tensor", marker="reentrant norm",
                cause="division-by-zero")),
    Case("hunt16_reentrant_checkpoint_norm_with_eps_healthy", lambda: _reentrant(1e-12), None),
]


# ---------------------------------------------------------------- reentrant checkpointing, a backward-only NaN
class ReentrantLength(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        nn.init.zeros_(self.lin.bias)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.sqrt(h.pow(2).sum(-1, keepdim=True) + self.eps)  # producer: reentrant length


class ReentrantLengthNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.block, self.head = ReentrantLength(eps), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True))


def _reentrant_backward(eps: float) -> Scenario:
    """As the reentrant norm, the block returning the row's length: sqrt(0) = 0 is finite in forward; its
    backward, run inside the checkpoint's recomputation in the outer backward, divides by 0."""
    torch.manual_seed(0)
    model = ReentrantLengthNet(eps)
    xs, ys = _batches(3, 4), _batches(3, 1)
    for x in xs:
        x.requires_grad_(True)
    xs[1].data[0] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


CASES += [
    Case("hunt16_reentrant_checkpoint_sqrt_backward_of_a_blank_row", lambda: _reentrant_backward(0.0),
         Expect("backward", "block", "ReentrantLength", step=1, op="aten.div.Tensor", marker="reentrant length",
                cause="sqrt-domain")),
    Case("hunt16_reentrant_checkpoint_sqrt_with_eps_healthy", lambda: _reentrant_backward(1e-12), None),
]
