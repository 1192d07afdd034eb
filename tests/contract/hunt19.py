"""Reported NaN incidents of families the other rows do not hold, each with the healthy twin its users apply (hunt19).

An orthogonal Procrustes layer taking the polar factor ``U @ Vh`` of an identity-initialised weight by
``torch.linalg.svd`` (repeated singular values: the SVD's backward is 0 / 0); a perspective spatial transformer
whose homogeneous divide meets a projective coordinate of 0 before ``F.grid_sample``; a rank-Gauss feature transform
in the data code, ``Normal(0, 1).icdf`` of an empirical CDF of exactly 1; DP-SGD by ``torch.func.vmap(grad)``
clipping per-sample gradients by a norm of 0 (a padded sample of weight 0); a linear-chain CRF with forbidden
transitions at -inf scoring a mislabelled gold path; a VAE's ``kl_divergence`` of a ``Normal`` whose softplus scale
underflowed; ``Categorical(probs=softmax * legal)`` of a state with no legal action (0 / 0 inside torch's
normalisation); a masked MSE by ``torch.where`` over targets whose missing values are coded as NaN (the where hides
the forward, not the backward); a heteroscedastic Gaussian NLL by hand of a variance underflowed to 0; a learned
noise variance initialised to 0 and read through ``sqrt`` (an inf gradient that ``clip_grad_norm_`` turns into NaN);
float16 autocast on CPU with a GradScaler whose layer overflows in the forward; an entropy bonus by
``torch.special.entr`` of a saturated softmax (forward 0, backward NaN). Each with the fix its users apply: the twin
must stay silent and bit-identical, in every mode. Near misses that must stay calm: ``F.scaled_dot_product_attention``
over a fully masked query row (a boolean mask and an additive -inf one: torch returns zeros), and a phase loss of
``torch.angle`` over silent bins of a complex spectrum (angle and abs of 0 have gradient 0).

Then shapes of data and of the step: an empty batch after a quality filter (``mse_loss`` of nothing); class weights
of 0 over a batch of only that class; a tensor subclass (``__torch_function__``) through the model; an ensemble by
``vmap(functional_call)`` inside the forward; a backward producer under ``save_on_cpu``; a model cast to float16
whole, stepped by Adam whose eps rounds to 0; missing labels as NaN averaged by ``nanmean`` (its backward leaks them
as the where's does: both are phase data, at the line that read the label into the graph); a forward normalising its
own input in place over a blank row; a static input buffer (the CUDA-graphs idiom) whose first micro-batch held a NaN;
linear probing by ``backward(inputs=head params)``. Healthy: missing features as NaN imputed by the model itself
(strict xfail: judged as data where they enter), and running statistics whose 'not seen yet' sentinel is NaN.
Last, a hand-written HMM forward in log space whose ``logaddexp`` of two unreachable states (-inf, exact in the
forward) is NaN in the backward, and MAML's inner step by ``autograd.grad(create_graph=True)`` whose NaN gradient
(a sqrt's backward at 0) reaches the query loss through ``functional_call`` (strict xfail in the tiered modes);
a DQN's bootstrap target over a terminal state with no legal action, ``(1 - done) * max(q.masked_fill(-inf))``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributions import Categorical, Normal, kl_divergence
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef, TensorRole


# ---------------------------------------------------------------- Procrustes: the SVD's polar factor of the identity
class Procrustes(nn.Module):
    """A learned rotation kept orthogonal by its polar factor ``U @ Vh`` (orthogonal Procrustes alignment of two
    embedding spaces), initialised to the identity; the twin takes the polar factor by Newton-Schulz iterations."""

    def __init__(self, svd: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(4))
        self.head = nn.Linear(4, 1)
        self.svd = svd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.svd:
            u, _, vh = torch.linalg.svd(self.weight)  # producer: polar svd
            rotation = u @ vh
        else:
            rotation = self.weight / self.weight.norm()
            for _ in range(6):
                rotation = 1.5 * rotation - 0.5 * rotation @ rotation.t() @ rotation
        return self.head(x @ rotation.t())


def _procrustes(svd: bool) -> Scenario:
    """The identity's four singular values are equal: the SVD's backward divides by s_i^2 - s_j^2 = 0 at step 0."""
    torch.manual_seed(0)
    model = Procrustes(svd)
    xs, ys = _batches(6, 4), _batches(6, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a perspective spatial transformer's divide by w = 0
class PerspectiveWarp(nn.Module):
    """A spatial transformer predicting a homography, sampling a 4x4 image through it. The twin divides as
    kornia's ``convert_points_from_homogeneous`` does: by ``w + eps`` where ``|w| > eps``, else by 1."""

    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.loc = nn.Linear(16, 8)
        self.head = nn.Linear(16, 1)
        self.guarded = guarded
        with torch.no_grad():
            self.loc.weight.zero_()
            self.loc.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 4), torch.linspace(-1, 1, 4), indexing="ij")
        self.register_buffer("base", torch.stack([xs, ys, torch.ones_like(xs)], -1).view(16, 3))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        n = image.shape[0]
        homography = torch.cat([self.loc(image.flatten(1)), image.new_ones(n, 1)], 1).view(n, 3, 3)
        points = self.base @ homography.transpose(1, 2)
        w = points[..., 2:]
        if self.guarded:
            w = torch.where(w.abs() > 1e-8, w + 1e-8, torch.ones_like(w))
        grid = (points[..., :2] / w).view(n, 4, 4, 2)  # producer: homogeneous divide
        return self.head(F.grid_sample(image, grid, align_corners=False).flatten(1))


def _perspective(guarded: bool) -> Scenario:
    """At step 2 the predicted perspective term is 1 (a loss spike the step before): w = 1 + x is 0 on the
    grid's first column, x / 0 is inf, and grid_sample of an inf coordinate is NaN."""
    torch.manual_seed(0)
    model = PerspectiveWarp(guarded)
    images, ys = _batches(3, 1, 4, 4), _batches(3, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.loc.bias[6] = 1.0
        return (images[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- rank-Gauss in the data code: icdf(1)
def _rank_gauss(clamped: bool) -> Scenario:
    """Features mapped to a normal through an empirical CDF fitted on a reference sample (as tabular pipelines'
    ``QuantileTransformer(output_distribution='normal')``); at step 2 a reading lies above every reference value:
    its CDF is exactly 1 and ``icdf(1)`` is inf. The fix: clip the CDF to [0.5 / n, 1 - 0.5 / n]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    reference = torch.sort(torch.randn(50, 3) * 2 + 5, dim=0).values.t().contiguous()
    raw = [torch.rand(6, 3) * 2 + 4 for _ in range(4)]
    raw[2][1, 0] = 100.0
    ys = _batches(6, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        cdf = torch.searchsorted(reference, raw[step].t().contiguous()).t().float() / reference.shape[1]
        if clamped:
            cdf = cdf.clamp(0.5 / reference.shape[1], 1 - 0.5 / reference.shape[1])
        return (Normal(0.0, 1.0).icdf(cdf),)  # producer: rank gauss
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- DP-SGD: per-sample clipping by a norm of 0
def _dp_sgd(opacus_form: bool) -> Scenario:
    """Per-sample gradients by ``torch.func.vmap(grad(...))`` over ``functional_call``, each clipped to norm 1 as
    written by hand, ``g * min(norm, C) / norm``; at step 2 the batch is padded to its fixed size with a sample of
    weight 0 (Poisson sampling's padding): its gradient is 0, its norm 0, 0 / 0. Opacus's form,
    ``(C / (norm + 1e-6)).clamp(max=1)``, is the twin."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = _batches(5, 4), _batches(5, 1)
    weights = [torch.ones(5) for _ in range(4)]
    weights[2][4] = 0.0

    def sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
        out = torch.func.functional_call(model, params, (x[None],))
        return w * F.mse_loss(out, y[None])

    per_sample_grads = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0, 0))

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            params = {name: p.detach() for name, p in model.named_parameters()}
            grads = per_sample_grads(params, xs[step], ys[step], weights[step])
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
            if opacus_form:  # noqa: SIM108 (the producer's marker goes on the hand-written division's own line)
                factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
            else:
                factor = norms.clamp(max=1.0) / norms  # producer: dp clip
            for name, p in model.named_parameters():
                p.grad = torch.einsum("b,b...->...", factor, grads[name]) / weights[step].sum()
            opt.step()
            losses.append(norms.sum())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a CRF's forbidden transition on a mislabelled path
class LinearChainCrf(nn.Module):
    """Emission scores and tag transitions (tags O, B, I), the BIO constraint O -> I forbidden by a fill of
    ``forbidden`` (-inf as written; AllenNLP's CRF fills -10000 instead); returns the sequence's NLL."""

    def __init__(self, forbidden: float) -> None:
        super().__init__()
        self.emit = nn.Linear(4, 3)
        self.transitions = nn.Parameter(torch.zeros(3, 3))
        allowed = torch.ones(3, 3, dtype=torch.bool)
        allowed[0, 2] = False
        self.register_buffer("allowed", allowed)
        self.forbidden = forbidden

    def forward(self, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        trans = self.transitions.masked_fill(~self.allowed, self.forbidden)
        emissions = self.emit(x)
        alpha = emissions[0]
        for t in range(1, x.shape[0]):
            alpha = torch.logsumexp(alpha[:, None] + trans + emissions[t][None], 0)
        log_z = torch.logsumexp(alpha, 0)
        gold = emissions[torch.arange(x.shape[0]), tags].sum() + trans[tags[:-1], tags[1:]].sum()  # producer: gold
        return log_z - gold


def _crf(forbidden: float) -> Scenario:
    """At step 2 an annotation error puts I right after O: the gold path's score is -inf, its NLL +inf."""
    torch.manual_seed(0)
    model = LinearChainCrf(forbidden)
    xs = _batches(6, 4)
    tags = [torch.tensor([0, 1, 2, 2, 0, 1]) for _ in range(4)]
    tags[2] = torch.tensor([0, 1, 2, 0, 2, 0])
    return _loop(model, lambda step: (xs[step], tags[step]), lambda nll, step: nll)


# ---------------------------------------------------------------- a VAE's kl_divergence of an underflowed scale
class GaussianEncoder(nn.Module):
    """A VAE encoder returning the posterior's mean and scale, the scale by ``softplus`` (+ ``eps``)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.mu, self.raw_scale = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.decoder = nn.Linear(2, 6)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        mu, scale = self.mu(h), F.softplus(self.raw_scale(h)) + self.eps
        return self.decoder(mu + scale * torch.randn_like(mu)), mu, scale


def _vae_kl(eps: float) -> Scenario:
    """At step 2 the scale head's bias is -120: softplus(-120) underflows to 0 and the KL to the prior takes
    log(0) inside torch.distributions (validation off, as many training scripts set it for speed)."""
    torch.manual_seed(0)
    model = GaussianEncoder(eps)
    xs = _batches(5, 6)
    prior = Normal(torch.zeros(2), torch.ones(2))

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.raw_scale.weight.zero_()
                model.raw_scale.bias.fill_(-120.0)
        return (xs[step],)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        recon, mu, scale = out
        kl = kl_divergence(Normal(mu, scale, validate_args=False), prior).sum(-1).mean()  # producer: kl normal
        return F.mse_loss(recon, xs[step]) + kl
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- Categorical(probs=softmax * legal), no legal action
def _masked_probs(no_op_action: bool) -> Scenario:
    """An actor masking illegal actions by multiplying the softmax's probabilities; torch's Categorical
    normalises ``probs / probs.sum()``: 0 / 0 for the state at step 2 with no legal action. The environment's fix:
    a no-op action that is always legal (column 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    obs = _batches(3, 4)
    legal = [torch.tensor([[True, True, False, True], [False, True, True, False], [True, False, True, True]])
             for _ in range(4)]
    legal[2] = legal[2].clone()
    legal[2][1] = torch.tensor([no_op_action, False, False, False])
    actions, advantages = torch.tensor([0, 1, 2]), torch.tensor([0.5, -0.2, 1.0])

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        probs = torch.softmax(logits, -1) * legal[step]
        dist = Categorical(probs=probs, validate_args=False)  # producer: masked probs
        return -(dist.log_prob(actions) * advantages).mean()
    return _loop(model, lambda step: (obs[step],), loss_fn)


# ---------------------------------------------------------------- a where-masked MSE over NaN-coded missing targets
def _missing_targets(zero_filled: bool) -> Scenario:
    """Multi-task regression whose missing labels are stored as NaN (as molecular property sets are), masked by
    ``torch.where`` in the loss: the forward is finite, but the where's backward multiplies the masked (NaN)
    branch's gradient, 0, by ``2 * (out - y)`` = NaN. Step 2's batch is the first with a missing label. The fix:
    fill the missing targets before the subtraction (the double where)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    xs, ys = _batches(6, 5), _batches(6, 3)
    ys[2][1, 2] = float("nan")
    ys[2][4, 0] = float("nan")

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        y = ys[step]
        known = ~torch.isnan(y)
        if zero_filled:
            y = torch.where(known, y, 0.0)
        squared = torch.where(known, (out - y) ** 2, 0.0)  # producer: missing where
        return squared.sum() / known.sum()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a heteroscedastic Gaussian NLL of a variance 0
class MeanVariance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.mean, self.log_var = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.mean(h), self.log_var(h).exp()


def _gaussian_nll(library: bool) -> Scenario:
    """At step 2 the log-variance head's bias is -120: exp underflows to 0, log(0) is -inf. The library's
    ``F.gaussian_nll_loss`` clamps the variance at eps (under no_grad) first."""
    torch.manual_seed(0)
    model = MeanVariance()
    xs, ys = _batches(5, 4), _batches(5, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.log_var.weight.zero_()
                model.log_var.bias.fill_(-120.0)
        return (xs[step],)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        mean, var = out
        if library:
            return F.gaussian_nll_loss(mean, ys[step], var)
        return (0.5 * (torch.log(var) + (ys[step] - mean) ** 2 / var)).mean()  # producer: gaussian nll
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- sqrt of a variance initialised to 0, then clipping
class NoisyHead(nn.Module):
    """A regression head with learned output noise, its std read as ``sqrt(var)``; ``var`` starts at 0 (no noise
    at first). The twin reads ``sqrt(var + 1e-8)``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.var = nn.Parameter(torch.zeros(1))
        self.eps = eps

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (self.var + self.eps).sqrt() * noise  # producer: noise std


def _noise_std(eps: float) -> Scenario:
    """sqrt's gradient at 0 is inf (step 0's backward); ``clip_grad_norm_`` then scales every gradient by
    1 / inf = 0, and the inf one by 0 becomes NaN before the step."""
    torch.manual_seed(0)
    model = NoisyHead(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, noises, ys = _batches(6, 4), _batches(6, 1), _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step], noises[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- float16 autocast on CPU with a GradScaler
def _autocast_fp16(dtype: torch.dtype) -> Scenario:
    """A model trained under ``torch.autocast('cpu', dtype)`` with a GradScaler; at step 2 a batch of raw,
    unscaled readings (a feature in the thousands) makes the first Linear's float16 output overflow (65504) in
    the forward, which no scaler can skip. The twin runs the same under bfloat16 (its range is float32's).
    The scaler skips the optimizer step of iteration 0 (its first scale, 65536, overflows the float16
    gradients, a benign skip): one optimizer step completed before the overflow, so PRODUCT.md's step is 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    xs, ys = _batches(5, 4), _batches(5, 1)
    xs[2][3] = torch.tensor([30000.0, 30000.0, 20000.0, 100.0])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(xs[step]).float(), ys[step])  # producer: autocast forward
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an entropy bonus by torch.special.entr
def _entropy_bonus(form: str) -> Scenario:
    """A policy-gradient loss with an entropy bonus; at step 2 a state's logits saturate (a probability of exactly
    0). ``torch.special.entr(p)`` is 0 there (its forward is safe), its backward ``-(1 + log p)`` is inf, and the
    softmax's backward makes it NaN. The twin takes the entropy from log_softmax, ``-(p * log_p)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    obs = _batches(4, 4)
    actions, advantages = torch.tensor([0, 1, 2, 0]), torch.tensor([0.3, -0.5, 1.0, 0.2])

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model[2].weight.zero_()
                model[2].bias.copy_(torch.tensor([60.0, 0.0, -60.0]))
        return (obs[step],)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        log_p = torch.log_softmax(logits, -1)
        p = log_p.exp()
        entropy = torch.special.entr(p).sum(-1) if form == "entr" else -(p * log_p).sum(-1)  # producer: entr
        pg = -(log_p.gather(1, actions[:, None]).squeeze(1) * advantages)
        return (pg - 0.01 * entropy).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- near misses: SDPA over fully masked query rows
class PaddedAttention(nn.Module):
    """Self-attention by ``F.scaled_dot_product_attention`` with a padding mask over queries and keys (pad x pad),
    so a padding query attends to no key: torch (2.5 on) returns zeros for such a row, in either mask form."""

    def __init__(self, additive: bool) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 1)
        self.additive = additive

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = (keep[:, :, None] & keep[:, None, :])[:, None]
        if self.additive:
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h.transpose(1, 2).reshape(x.shape[0], x.shape[1], 8)).squeeze(-1)


def _sdpa_padded_queries(additive: bool) -> Scenario:
    torch.manual_seed(0)
    model = PaddedAttention(additive)
    xs, ys = _batches(2, 5, 8), _batches(2, 5)
    keep = torch.tensor([[True, True, True, False, False], [True, True, True, True, False]])
    return _loop(model, lambda step: (xs[step], keep),
                 lambda out, step: F.mse_loss(out[keep], ys[step][keep]))


# ---------------------------------------------------------------- near miss: a phase loss over silent bins
class ComplexSpectrum(nn.Module):
    """A model predicting a complex spectrum; bins the gate marks silent are exactly 0 + 0j."""

    def __init__(self) -> None:
        super().__init__()
        self.re, self.im = nn.Linear(6, 5), nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return torch.complex(self.re(x), self.im(x)) * gate


def _phase_loss() -> Scenario:
    """``torch.angle`` and ``abs`` of 0 + 0j are 0 with gradient 0 (torch defines both): calm."""
    torch.manual_seed(0)
    model = ComplexSpectrum()
    xs, gate = _batches(4, 6), (torch.rand(4, 5) > 0.4).float()
    targets = [torch.complex(torch.randn(4, 5), torch.randn(4, 5)) * gate for _ in range(4)]

    def loss_fn(spec: torch.Tensor, step: int) -> torch.Tensor:
        phase = (torch.angle(spec) - torch.angle(targets[step])).pow(2).mean()
        return phase + F.l1_loss(spec.abs(), targets[step].abs())
    return _loop(model, lambda step: (xs[step], gate), loss_fn)


# ---------------------------------------------------------------- an empty batch after a quality filter
def _empty_batch(skip_empty: bool) -> Scenario:
    """The loop keeps only the samples whose quality flag is set; at step 2 no sample passes: the model runs on 0
    rows and ``F.mse_loss`` of two empty tensors is the mean of nothing, NaN. The fix: skip an empty batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 4), _batches(6, 1)
    quality = [torch.rand(6) > 0.3 for _ in range(4)]
    quality[2] = torch.zeros(6, dtype=torch.bool)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            keep = quality[step]
            if skip_empty and not keep.any():
                continue
            loss = F.mse_loss(model(xs[step][keep]), ys[step][keep])  # producer: empty batch
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- class weights of 0 over a batch of only those
def _zero_class_weights(ignore_index: bool) -> Scenario:
    """Segmentation-style cross entropy whose class 0 (background, 'void') is switched off by a weight of 0;
    at step 2 every pixel of the batch is void: the weighted mean is 0 / 0. The fix: ``ignore_index`` (torch's
    mean over no target is then NaN too, so the loop also skips a batch without a counted target)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(8, 5)
    targets = [torch.randint(0, 3, (8,)) for _ in range(4)]
    targets[2] = torch.zeros(8, dtype=torch.long)
    weight = torch.tensor([0.0, 1.0, 2.0])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logits = model(xs[step])
            if ignore_index:
                if not (targets[step] != 0).any():
                    continue
                loss = F.cross_entropy(logits, targets[step], weight=weight, ignore_index=0)
            else:
                loss = F.cross_entropy(logits, targets[step], weight=weight)  # producer: void weights
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a tensor subclass through the model
class Spectrogram(torch.Tensor):
    """A tensor subclass carrying its type through every op (``__torch_function__``), as torchvision's
    ``tv_tensors`` and audio libraries' typed tensors are."""


class LogMel(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.filters, self.head = nn.Linear(6, 4), nn.Linear(4, 1)
        self.eps = eps

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        mel = torch.relu(self.filters(spec))
        return self.head(torch.log(mel + self.eps))  # producer: log mel


def _subclass(eps: float) -> Scenario:
    """At step 0 some filter outputs are dead (ReLU 0): log(0) is -inf, in a Spectrogram subclass."""
    torch.manual_seed(0)
    model = LogMel(eps)
    xs, ys = [b.as_subclass(Spectrogram) for b in _batches(5, 6)], _batches(5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out.as_subclass(torch.Tensor), ys[step]),
                 lr=0.0)


# ---------------------------------------------------------------- an ensemble by torch.func.vmap inside the forward
class Ensemble(nn.Module):
    """Five members stacked by ``torch.func.stack_module_state`` and run by ``vmap(functional_call)`` (the
    torch.func ensembling tutorial), each member's output a log-scale ``log(softplus-free) rate``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        members = [nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)) for _ in range(5)]
        params, _buffers = torch.func.stack_module_state(members)
        self.params = nn.ParameterDict({name.replace(".", "_"): nn.Parameter(p) for name, p in params.items()})
        self.names = list(params)
        self.base = [copy.deepcopy(members[0]).to("meta")]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def member(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.base[0], params, (x,))
        stacked = {name: self.params[name.replace(".", "_")] for name in self.names}
        rates = torch.func.vmap(member, in_dims=(0, None))(stacked, x)
        return torch.log(torch.relu(rates + 10.0) + self.eps).mean(0)  # producer: ensemble log


def _ensemble(eps: float) -> Scenario:
    """At step 2 member 3's last bias is -50: its ReLU rate is 0 for every sample, log(0) = -inf."""
    torch.manual_seed(0)
    model = Ensemble(eps)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.params["2_bias"][3] = -80.0
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- a backward producer under save_on_cpu
class SignedRoot(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(torch.sign(h) * torch.sqrt(h.abs() + self.eps))  # producer: offloaded root


def _offloaded(eps: float) -> Scenario:
    """Activations offloaded by ``torch.autograd.graph.save_on_cpu()`` (pack hooks) around the forward; at step 2
    a hidden unit is exactly 0: sqrt's backward at 0 is inf, times sign's 0 ... NaN in the backward."""
    torch.manual_seed(0)
    model = SignedRoot(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.lin.weight[1].zero_()
                    model.lin.bias[1] = 0.0
            with torch.autograd.graph.save_on_cpu():
                loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- pure float16 parameters with Adam's eps 1e-8
def _half_adam(eps: float) -> Scenario:
    """A model cast to float16 whole (``model.half()``, no master weights) trained by Adam: its eps of 1e-8
    rounds to 0 in float16, and a parameter whose gradient is 0 (a dead unit's row) is stepped by 0 / 0. The
    users' fix: eps=1e-4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)).half()
    with torch.no_grad():
        model[0].bias[2] = -100.0
        model[0].weight[2] = 0.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    xs, ys = [b.half() for b in _batches(5, 4)], [b.half() for b in _batches(5, 1)]
    return _loop_with(model, opt, xs, ys)


def _loop_with(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor], ys: list[torch.Tensor]):
    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: half adam
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- NaN-coded missing features imputed in the model
class ImputingNet(nn.Module):
    """Tabular features whose missing values arrive as NaN, imputed inside the forward by a learned fill and a
    missingness indicator (as tabular deep models do it): ``torch.where(isnan(x), fill, x)``."""

    def __init__(self, double_where: bool) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(5))
        self.body = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 1))
        self.double_where = double_where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        missing = torch.isnan(x)
        filled = torch.where(missing, self.fill.expand_as(x), x)
        return self.body(torch.cat([filled, missing.float()], -1))


def _imputed_features() -> Scenario:
    """Every batch misses some values (NaN); the model imputes them before any arithmetic: calm, every step."""
    torch.manual_seed(0)
    model = ImputingNet(True)
    xs, ys = _batches(6, 5), _batches(6, 1)
    for x in xs:
        x[torch.rand(6, 5) < 0.2] = float("nan")
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


class NanSentinelNormalizer(nn.Module):
    """A running observation normalizer whose statistics start as NaN ('not seen yet', replaced at the first
    batch by ``torch.where(isnan(mean), batch_mean, ema)``), before a policy head."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((4,), float("nan")))
        self.head = nn.Linear(4, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                batch_mean = obs.mean(0)
                self.mean.copy_(torch.where(torch.isnan(self.mean), batch_mean, 0.99 * self.mean + 0.01 * batch_mean))
        return self.head(obs - self.mean)


def _nan_sentinel() -> Scenario:
    torch.manual_seed(0)
    model = NanSentinelNormalizer()
    xs, ys = _batches(6, 4), _batches(6, 2)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- nanmean over NaN-coded missing targets
def _nanmean_targets(indexed: bool) -> Scenario:
    """Missing labels stored as NaN, averaged away by ``torch.nanmean``: its forward skips them, its backward
    gives them a gradient of 0, which the square's backward multiplies by ``2 * (out - y)`` = NaN. The fix:
    select the known labels by a boolean index first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    xs, ys = _batches(6, 5), _batches(6, 3)
    ys[1][2, 1] = float("nan")

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        y = ys[step]
        if indexed:
            known = ~torch.isnan(y)
            return F.mse_loss(out[known], y[known])
        return ((out - y) ** 2).nanmean()  # producer: nanmean
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a forward normalising its input in place
class CosineClassifier(nn.Module):
    """A cosine classifier over raw features, normalising its input rows in place (``x /= x.norm(...)``)."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 6))
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            x /= x.norm(dim=1, keepdim=True)  # producer: in-place input norm
        else:
            x = F.normalize(x, dim=1)
        return 10 * x @ F.normalize(self.weight, dim=1).t()


def _in_place_input(in_place: bool) -> Scenario:
    """At step 2 one sample's features are all 0 (a blank record): 0 / 0 written into the caller's batch."""
    torch.manual_seed(0)
    model = CosineClassifier(in_place)
    xs, labels = _batches(5, 6), [torch.randint(0, 3, (5,)) for _ in range(4)]
    xs[2][3] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, labels[step]))


# ---------------------------------------------------------------- a static input buffer refilled between micro-batches
def _static_buffer(bad: bool) -> Scenario:
    """The CUDA-graphs idiom: one preallocated input buffer, each micro-batch copied into it (``copy_``); two
    micro-batches accumulated per optimizer step. At step 1 the first micro-batch holds a NaN feature (a corrupt
    record); the second overwrites the buffer before ``opt.step()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    micro = [_batches(5, 4, steps=2) for _ in range(4)]
    ys = [_batches(5, 1, steps=2) for _ in range(4)]
    if bad:
        micro[1][0][2, 1] = float("nan")
    static = torch.empty(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            opt.zero_grad()
            for k in range(2):
                static.copy_(micro[step][k])
                loss = F.mse_loss(model(static), ys[step][k]) / 2
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- backward(inputs=...) into the head only
class RootHead(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.lin(h).pow(2) + self.eps)  # producer: head root


def _backward_inputs(eps: float) -> Scenario:
    """Linear probing by ``loss.backward(inputs=list(head.parameters()))`` (the body gets no gradient, without
    freezing it); at step 2 the head's output is exactly 0 for a sample: sqrt's backward at 0, 0 * inf."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    model = nn.Sequential(body, RootHead(eps))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.0)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[1].lin.weight.zero_()
                    model[1].lin.bias.zero_()
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward(inputs=list(model[1].parameters()))
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an HMM forward in log space by logaddexp
class LogSpaceAligner(nn.Module):
    """A left-to-right HMM (or CTC-like) forward algorithm written by hand in log space: each state stays or advances,
    ``alpha_t(s) = logaddexp(alpha(s) + stay, alpha(s - 1) + advance) + emit_t(s)``, starting in state 0 with the
    others at ``start`` (-inf as written; a large finite negative in the twin). A state not reachable yet is
    ``logaddexp(-inf, -inf) = -inf`` in the forward, exact; its backward is ``exp(-inf - (-inf))``, NaN, times a
    gradient of 0: NaN into every parameter."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.emit = nn.Linear(4, 4)
        self.stay, self.advance = nn.Parameter(torch.tensor(-0.3)), nn.Parameter(torch.tensor(-1.2))
        self.start = start

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        emissions = torch.log_softmax(self.emit(frames), -1)
        alpha = torch.cat([emissions[0, :1], torch.full((3,), self.start)])
        for t in range(1, frames.shape[0]):
            moved = torch.cat([torch.full((1,), self.start), alpha[:-1] + self.advance])
            alpha = torch.logaddexp(alpha + self.stay, moved) + emissions[t]  # producer: hmm logaddexp
        return -torch.logsumexp(alpha, 0)


def _hmm(start: float) -> Scenario:
    """Every sequence: at t = 1 states 2 and 3 are unreachable (NaN in the first backward, step 0)."""
    torch.manual_seed(0)
    model = LogSpaceAligner(start)
    xs = _batches(5, 4)
    return _loop(model, lambda step: (xs[step],), lambda nll, step: nll)


# ---------------------------------------------------------------- MAML: an inner step by autograd.grad, functional_call
class RootFeatures(nn.Module):
    """A feature layer with a signed square root (``sign(h) * sqrt(|h| + eps)``), then a linear head."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(torch.sign(h) * torch.sqrt(h.abs() + self.eps))  # producer: maml root


def _maml(eps: float) -> Scenario:
    """MAML: the inner step adapts the weights by ``autograd.grad(create_graph=True)`` on the support set, the outer
    loss runs ``functional_call`` with the adapted weights on the query set. At step 2 a hidden unit is exactly 0 on
    the support set: the inner gradient is NaN (sqrt's backward at 0, times sign's 0), the adapted weights NaN."""
    torch.manual_seed(0)
    model = RootFeatures(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    support, query = _batches(5, 4), _batches(5, 4)
    ys_support, ys_query = _batches(5, 1), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.lin.weight[1].zero_()
                    model.lin.bias[1] = 0.0
            params = dict(model.named_parameters())
            inner = F.mse_loss(model(support[step]), ys_support[step])
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
            outer = F.mse_loss(torch.func.functional_call(model, fast, (query[step],)), ys_query[step])
            opt.zero_grad()
            outer.backward()
            opt.step()
            losses.append(outer.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- DQN's bootstrap of no legal action, times (1 - done)
def _dqn(where: bool) -> Scenario:
    """DQN with action masking: the bootstrap target takes the max over the next state's legal actions (illegal ones
    filled with -inf), times ``(1 - done)``. At step 2 a terminal next state has no legal action: its max is -inf and
    ``0 * -inf`` is NaN. The fix: ``torch.where(done, 0, next_max)``."""
    torch.manual_seed(0)
    online, target = nn.Linear(4, 3), nn.Linear(4, 3)
    target.load_state_dict(online.state_dict())
    opt = torch.optim.SGD(online.parameters(), lr=0.01)
    obs, next_obs = _batches(5, 4), _batches(5, 4)
    actions, rewards = torch.tensor([0, 1, 2, 1, 0]), torch.rand(5)
    done = [torch.zeros(5, dtype=torch.bool) for _ in range(4)]
    legal = [torch.ones(5, 3, dtype=torch.bool) for _ in range(4)]
    done[2][3] = True
    legal[2][3] = False

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            q = online(obs[step]).gather(1, actions[:, None]).squeeze(1)
            with torch.no_grad():
                next_max = target(next_obs[step]).masked_fill(~legal[step], float("-inf")).max(1).values
                if where:  # noqa: SIM108 (the producer's marker goes on the product's own line)
                    bootstrap = torch.where(done[step], 0.0, next_max)
                else:
                    bootstrap = (1 - done[step].float()) * next_max  # producer: dqn bootstrap
                y = rewards + 0.99 * bootstrap
            loss = F.smooth_l1_loss(q, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((online, opt), run)


#: How a forward that writes its own input in place is named with its op (gaps23: the per-module watch's replay
#: started from the values the write left, op None, the input said modified in place).
IN_PLACE_INPUT = (
    "the forward writes its own input in place (x /= x.norm(...)): the watch learns that from a call that moved its "
    "input's version counter and keeps a copy of that model's input from the next call on (hot/kept/input_writes.py, "
    "the step's kept top-level calls); the tiered step replay and the per-module watch's replay of the call "
    "(replay/producer_call.replay_into) start from it")

CASES = [
    Case("hunt19_procrustes_svd_polar_factor_of_the_identity", lambda: _procrustes(True),
         Expect("backward", "", "Procrustes", step=0, op="aten.div.Tensor", marker="polar svd")),
    Case("hunt19_procrustes_newton_schulz_healthy", lambda: _procrustes(False), None),
    Case("hunt19_perspective_warp_divide_by_a_projective_zero", lambda: _perspective(False),
         Expect("forward", "", "PerspectiveWarp", step=2, op="aten.div.Tensor", marker="homogeneous divide")),
    Case("hunt19_perspective_warp_kornia_guard_healthy", lambda: _perspective(True), None),
    Case("hunt19_rank_gauss_icdf_of_a_cdf_of_1", lambda: _rank_gauss(False),
         Expect("data", "", "Sequential", step=2, op="aten.erfinv.default", marker="rank gauss")),
    Case("hunt19_rank_gauss_cdf_clipped_healthy", lambda: _rank_gauss(True), None),
    Case("hunt19_dp_sgd_clipping_by_a_per_sample_norm_of_0", lambda: _dp_sgd(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="dp clip",
                tensor=TensorRef.gradient("0.weight"))),
    Case("hunt19_dp_sgd_opacus_clip_factor_healthy", lambda: _dp_sgd(True), None),
    # The index that picks the gold path's transitions picked the forbidden one (gaps22: the sum after it was named,
    # with the summed-mask advice, before localize/ops/origins.Picked).
    Case("hunt19_crf_forbidden_transition_on_a_mislabelled_path", lambda: _crf(float("-inf")),
         Expect("forward", "", "LinearChainCrf", step=2, op="aten.index.Tensor", marker="gold",
                cause="masked-softmax")),
    Case("hunt19_crf_forbidden_transition_finite_healthy", lambda: _crf(-1e4), None),
    Case("hunt19_vae_kl_divergence_of_an_underflowed_scale", lambda: _vae_kl(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="kl normal")),
    Case("hunt19_vae_kl_divergence_scale_eps_healthy", lambda: _vae_kl(1e-4), None),
    Case("hunt19_categorical_probs_times_mask_of_no_legal_action", lambda: _masked_probs(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="masked probs")),
    Case("hunt19_categorical_probs_times_mask_with_a_no_op_healthy", lambda: _masked_probs(True), None),
    Case("hunt19_where_masked_mse_over_nan_coded_missing_targets", lambda: _missing_targets(False),
         Expect("data", None, step=2, op=None, marker="missing where",
                tensor=TensorRef(TensorRole.INPUT, "aten.sub.Tensor", "other"), cause="bad-input-data")),
    Case("hunt19_where_masked_mse_targets_zero_filled_healthy", lambda: _missing_targets(True), None),
    Case("hunt19_gaussian_nll_by_hand_of_a_variance_0", lambda: _gaussian_nll(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="gaussian nll")),
    Case("hunt19_gaussian_nll_library_healthy", lambda: _gaussian_nll(True), None),
    Case("hunt19_sqrt_of_a_zero_initialised_variance_then_clipped", lambda: _noise_std(0.0),
         Expect("backward", "", "NoisyHead", step=0, op="aten.div.Tensor", marker="noise std")),
    Case("hunt19_sqrt_of_a_variance_with_eps_healthy", lambda: _noise_std(1e-8), None),
    Case("hunt19_float16_autocast_forward_overflow_under_a_grad_scaler", lambda: _autocast_fp16(torch.float16),
         Expect("forward", "0", "Linear", step=1, op="aten.addmm.default", marker="autocast forward",
                cause="half-precision-overflow")),
    Case("hunt19_bfloat16_autocast_healthy", lambda: _autocast_fp16(torch.bfloat16), None),
    Case("hunt19_entropy_bonus_special_entr_of_a_saturated_softmax", lambda: _entropy_bonus("entr"),
         Expect("backward", None, step=2, op="aten.log.default", marker="entr")),
    Case("hunt19_entropy_bonus_from_log_softmax_healthy", lambda: _entropy_bonus("log_softmax"), None),
    Case("hunt19_sdpa_boolean_mask_fully_masked_query_rows_healthy", lambda: _sdpa_padded_queries(False), None),
    Case("hunt19_sdpa_additive_mask_fully_masked_query_rows_healthy", lambda: _sdpa_padded_queries(True), None),
    Case("hunt19_phase_loss_angle_of_silent_bins_healthy", _phase_loss, None),
    Case("hunt19_empty_batch_after_a_quality_filter", lambda: _empty_batch(False),
         Expect("forward", None, step=2, op="aten.mse_loss.default", marker="empty batch")),
    Case("hunt19_empty_batch_skipped_healthy", lambda: _empty_batch(True), None),
    Case("hunt19_class_weights_0_over_a_batch_of_only_that_class", lambda: _zero_class_weights(False),
         Expect("forward", None, step=2, op="aten.nll_loss_forward.default", marker="void weights")),
    Case("hunt19_class_ignore_index_and_skip_healthy", lambda: _zero_class_weights(True), None),
    Case("hunt19_tensor_subclass_log_of_a_dead_filter", lambda: _subclass(0.0),
         Expect("forward", "", "LogMel", step=0, op="aten.log.default", marker="log mel")),
    Case("hunt19_tensor_subclass_log_with_eps_healthy", lambda: _subclass(1e-6), None),
    Case("hunt19_vmap_ensemble_log_of_a_dead_member", lambda: _ensemble(0.0),
         Expect("forward", "", "Ensemble", step=2, op="aten.log.default", marker="ensemble log")),
    Case("hunt19_vmap_ensemble_log_with_eps_healthy", lambda: _ensemble(1e-6), None),
    Case("hunt19_save_on_cpu_backward_of_a_signed_root_at_0", lambda: _offloaded(0.0),
         Expect("backward", "", "SignedRoot", step=2, op="aten.div.Tensor", marker="offloaded root")),
    Case("hunt19_save_on_cpu_signed_root_with_eps_healthy", lambda: _offloaded(1e-8), None),
    Case("hunt19_half_model_adam_eps_rounds_to_0", lambda: _half_adam(1e-8),
         Expect("optimizer", "0", "Linear", step=0, op="aten.addcdiv_.default", marker="half adam")),
    Case("hunt19_half_model_adam_eps_1e_4_healthy", lambda: _half_adam(1e-4), None),
    Case("hunt19_missing_features_as_nan_imputed_in_the_model_healthy", _imputed_features, None),
    Case("hunt19_nan_sentinel_statistics_buffer_healthy", _nan_sentinel, None),
    Case("hunt19_nanmean_over_nan_coded_missing_targets", lambda: _nanmean_targets(False),
         Expect("data", None, step=1, op=None, marker="nanmean",
                tensor=TensorRef(TensorRole.INPUT, "aten.sub.Tensor", "other"))),
    Case("hunt19_missing_targets_boolean_index_healthy", lambda: _nanmean_targets(True), None),
    Case("hunt19_forward_normalises_its_input_in_place_of_a_blank_row", lambda: _in_place_input(True),
         Expect("forward", "", "CosineClassifier", step=2, op="aten.div_.Tensor", marker="in-place input norm",
                op_modes=("ops", "default", "defer", "full")),
         note=IN_PLACE_INPUT),
    Case("hunt19_forward_normalises_its_input_in_place_op_and_line", lambda: _in_place_input(True),
         Expect("forward", "", "CosineClassifier", step=2, op="aten.div_.Tensor", marker="in-place input norm"),
         modes=("default", "defer", "full")),
    Case("hunt19_forward_normalises_a_copy_healthy", lambda: _in_place_input(False), None),
    Case("hunt19_static_input_buffer_nan_in_the_first_micro_batch", lambda: _static_buffer(True),
         Expect("data", "", "Sequential", step=1, op=None)),
    Case("hunt19_static_input_buffer_healthy", lambda: _static_buffer(False), None),
    Case("hunt19_backward_inputs_head_root_at_0", lambda: _backward_inputs(0.0),
         Expect("backward", "1", "RootHead", step=2, op="aten.div.Tensor", marker="head root")),
    Case("hunt19_backward_inputs_head_root_with_eps_healthy", lambda: _backward_inputs(1e-8), None),
    Case("hunt19_hmm_forward_logaddexp_of_two_unreachable_states", lambda: _hmm(float("-inf")),
         Expect("backward", "", "LogSpaceAligner", step=0, op="aten.sub.Tensor", marker="hmm logaddexp")),
    # (A strict xfail to gaps19: mode='full' replayed the module's backward from a gradient of ones, which cannot
    # vouch for a gradient the module computed inside: op None. The step's top-level call, kept for the fix trials,
    # holds the real output gradient: its replay names the op (localize/replay/per_call.py).)
    Case("hunt19_hmm_forward_logaddexp_full_mode_op", lambda: _hmm(float("-inf")),
         Expect("backward", "", "LogSpaceAligner", step=0, op="aten.sub.Tensor", marker="hmm logaddexp"),
         modes=("full",)),
    Case("hunt19_hmm_forward_large_finite_negative_start_healthy", lambda: _hmm(-1e4), None),
    Case("hunt19_maml_inner_gradient_of_a_signed_root_at_0", lambda: _maml(0.0),
         Expect("backward", "", "RootFeatures", step=2, op="aten.div.Tensor", marker="maml root"),
         modes=("full", "ops")),
    # (A strict xfail to gaps20: the inner autograd.grad(create_graph=True)'s backward ran inside the loop code's
    # recorder, its sqrt's backward div recorded at the grad line: 'forward, code outside any watched module'. The
    # recorder notes that line now (patches/backward.marked_graph_grads) and the step replay runs the support call's
    # backward from the gradient that grad sent into its output; judged immediately, inside the query call's
    # functional_call, with the model's own parameters put back (patches/functional_calls.own_tensors).)
    Case("hunt19_maml_inner_gradient_tiered", lambda: _maml(0.0),
         Expect("backward", "", "RootFeatures", step=2, op="aten.div.Tensor", marker="maml root",
                cause="sqrt-domain"), modes=("default", "defer")),
    Case("hunt19_maml_signed_root_with_eps_healthy", lambda: _maml(1e-8), None),
    Case("hunt19_dqn_bootstrap_of_a_terminal_state_with_no_legal_action", lambda: _dqn(False),
         Expect("forward", None, step=2, op="aten.mul.Tensor", marker="dqn bootstrap")),
    Case("hunt19_dqn_bootstrap_where_done_healthy", lambda: _dqn(True), None),
]
