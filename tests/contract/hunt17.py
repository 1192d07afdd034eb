"""Reported NaN incidents of families the other rows do not hold, each with the healthy twin its users apply (hunt17).

A GNN's scatter-mean (``index_add_``) over a node of degree 0; a Dice loss of an empty mask whose sigmoid
underflowed to 0; Sinkhorn with a small epsilon (a row of the kernel ``exp(-C / eps)`` underflows, then a / 0);
a linear normalizing flow's ``slogdet`` of a singular weight; a Poincare ball's ``artanh`` of a radius rounded to
1; a negative binomial NLL whose dispersion underflowed (``lgamma(0)``); multi-task uncertainty weights
``exp(-log_var)`` overflowing; CLIP's learnable ``logit_scale.exp()`` without its clamp; fake quantisation (QAT)
of a dead ReLU's output, scale 0; a Cox partial likelihood over a batch without events; a Poisson NLL written by
hand of a dead ReLU rate; NeRF's expected depth of an empty ray; an L1/2 sparsity penalty of a pruned weight (the
pow's backward at 0); weight standardisation of a zero-initialised filter; a max-norm constraint written in place
inside the forward; a VQ-VAE's EMA codebook with a dead code; ``F.normalize`` in float16 (its eps rounds to 0),
and in float32 with its gradient cast back to float16 (1 / eps overflows); a LayerNorm by hand by ``rsqrt(var)``
over a constant row; a compiled (aot_eager) CLIP head and a compiled signed square root (a forward and a backward
producer); Glow's ActNorm whose data-dependent init (parameters written in the first forward) divides by the std
of a constant channel; an L-BFGS closure (forward and backward inside ``opt.step``) taking the log of a zero; and
near misses that must stay calm: ``nn.LSTM`` fed a feature near float32's max (its gates saturate), ``atan2`` at
(0, 0) (torch's backward masks its 0 / 0), a logged perplexity ``exp(loss)`` that overflows, and a forward hook
logging the log-variance of a dead layer (-inf in logging code only). Models returning a ``torch.distributions``
object (SAC's Gaussian policy whose std overflows; a masked Categorical policy, and a masked log-softmax, whose state
has no legal action), with the squashed log-probability's saturated tanh in the loss code; a detector returning
its own result object whose box decoding ``exp(dw)`` overflows without Faster R-CNN's clamp.
Each with the fix its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a GNN's scatter-mean over an isolated node
class MeanConv(nn.Module):
    """Mean aggregation of neighbour messages by ``index_add_`` (as written before torch_scatter)."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.msg = nn.Linear(4, 4)
        self.safe = safe

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        summed = x.new_zeros(x.shape[0], 4).index_add_(0, dst, self.msg(x[src]))
        degree = x.new_zeros(x.shape[0]).index_add_(0, dst, x.new_ones(dst.shape[0]))
        if self.safe:
            degree = degree.clamp(min=1)
        return summed / degree[:, None]  # producer: scatter mean


class Gnn(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.conv, self.head = MeanConv(safe), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x, edges)))


def _gnn(safe: bool) -> Scenario:
    """Graphs of 5 nodes; the graph of step 2 leaves node 4 without an incoming edge: 0 / 0."""
    torch.manual_seed(0)
    model = Gnn(safe)
    xs, ys = _batches(5, 4), _batches(5, 1)
    edges = [torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 2]]) for _ in range(4)]
    edges[2] = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 0, 1]])
    return _loop(model, lambda step: (xs[step], edges[step]), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a Dice loss of an empty mask
def _dice(smooth: float) -> Scenario:
    """Per-image soft Dice; at step 2 image 1's mask is empty and the model is certain of it (logits -120:
    sigmoid underflows to exactly 0): 0 / 0. The fix: a smoothing term in both sides."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 16))
    xs = _batches(2, 6)
    masks = [(torch.rand(2, 16) > 0.5).float() for _ in range(4)]
    masks[2][1] = 0.0

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model[2].weight.zero_()
                model[2].bias.fill_(-120.0)
        return (xs[step],)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        probs = torch.sigmoid(logits)
        inter = (probs * masks[step]).sum(-1)
        union = probs.sum(-1) + masks[step].sum(-1)
        return (1 - (2 * inter + smooth) / (union + smooth)).mean()  # producer: dice ratio
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- Sinkhorn with a small epsilon
def _sinkhorn(eps: float) -> Scenario:
    """An entropic OT loss between embeddings and prototypes, 3 Sinkhorn iterations in the kernel form; at step 2
    one sample is an outlier (a reading of 40): its whole row of ``exp(-C / eps)`` underflows to 0 and
    ``a / (K @ v)`` is inf. The users' fix: a larger epsilon (the twin's 4)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.mul_(0.5)
    xs = _batches(5, 4)
    xs[2][3] = 40.0
    protos = torch.randn(4, 3) * 0.3

    def loss_fn(emb: torch.Tensor, step: int) -> torch.Tensor:
        cost = torch.cdist(emb, protos).pow(2)
        kernel = torch.exp(-cost / eps)
        a, b = torch.full((5,), 1 / 5), torch.full((4,), 1 / 4)
        v = torch.ones(4)
        for _ in range(3):
            u = a / (kernel @ v)  # producer: sinkhorn u
            v = b / (kernel.t() @ u)
        plan = u[:, None] * kernel * v[None, :]
        return (plan * cost).sum()
    return _loop(model, lambda step: (xs[step],), loss_fn, lr=0.0)


# ---------------------------------------------------------------- a linear flow's slogdet of a singular weight
class LinearFlow(nn.Module):
    """z = W x with log|det W| (a 1x1 invertible convolution); the twin parametrises W as Glow does, by an LU
    form whose diagonal is exp(log_s), so its log-determinant is log_s.sum()."""

    def __init__(self, lu: bool) -> None:
        super().__init__()
        self.lu = lu
        self.weight = nn.Parameter(torch.eye(3) + 0.1 * torch.randn(3, 3))
        self.log_s = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lu:
            upper = torch.triu(self.weight, 1) + torch.diag(self.log_s.exp())
            lower = torch.tril(self.weight, -1) + torch.eye(3)
            return x @ (lower @ upper).t(), self.log_s.sum()
        return x @ self.weight.t(), torch.linalg.slogdet(self.weight)[1]  # producer: slogdet


def _flow(lu: bool) -> Scenario:
    """Maximum likelihood under a standard normal base; at step 2 the weight has drifted to a rank-2 matrix
    (two equal rows): log|det| is -inf and the NLL +inf."""
    torch.manual_seed(0)
    model = LinearFlow(lu)
    xs = _batches(6, 3)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.weight.copy_(torch.tensor([[1.0, 0.5, 0.2], [1.0, 0.5, 0.2], [0.0, 0.3, 1.0]]))
        return (xs[step],)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        z, logdet = out
        return (0.5 * z.pow(2).sum(-1)).mean() - logdet
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- a Poincare ball's artanh at radius 1
class PoincareEncoder(nn.Module):
    """Points in the Poincare ball by radius ``tanh(r)``; the distance to the origin is 2 artanh(radius)."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        radius = torch.tanh(self.lin(x).abs()).squeeze(-1)
        if self.safe:
            radius = radius.clamp(max=1 - 1e-5)
        return 2 * torch.atanh(radius)  # producer: artanh


def _poincare(safe: bool) -> Scenario:
    """At step 1 a sample's pre-radius is 12: tanh(12) rounds to 1.0 in float32, artanh(1) is inf."""
    torch.manual_seed(0)
    model = PoincareEncoder(safe)
    xs, ys = _batches(4, 4), [torch.rand(4) for _ in range(4)]
    xs[1][2] = torch.tensor([30.0, 30.0, 30.0, 30.0])
    with torch.no_grad():
        model.lin.weight.fill_(0.1)
        model.lin.bias.zero_()
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- a negative binomial NLL, lgamma of a dispersion 0
def _negative_binomial(eps: float) -> Scenario:
    """scVI-style counts: mean by softplus, dispersion ``theta`` by exp of a head gone to -120 at step 2, which
    underflows to 0: lgamma(y + 0) - lgamma(0) is inf - inf. The fix: theta + eps."""
    torch.manual_seed(0)
    model = nn.Linear(5, 6)
    xs = _batches(3, 5)
    counts = [torch.poisson(torch.full((3, 3), 4.0)) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.bias[3:] = -120.0
                model.weight[3:] = 0.0
        return (xs[step],)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        y = counts[step]
        mu, theta = F.softplus(out[:, :3]), out[:, 3:].exp() + eps
        log_theta_mu = torch.log(theta + mu + 1e-8)
        ll = (torch.lgamma(y + theta) - torch.lgamma(theta)  # producer: lgamma theta
              - torch.lgamma(y + 1) + theta * (torch.log(theta + 1e-8) - log_theta_mu)
              + y * (torch.log(mu + 1e-8) - log_theta_mu))
        return -ll.mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- multi-task uncertainty weights
class UncertaintyWeights(nn.Module):
    """Kendall et al.'s homoscedastic weighting: sum_i exp(-log_var_i) L_i + log_var_i."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(2))
        self.safe = safe

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        log_var = self.log_var.clamp(min=-10.0) if self.safe else self.log_var
        return (torch.exp(-log_var) * losses + log_var).sum()  # producer: precision


class TwoTasks(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.body, self.weighting = nn.Linear(4, 2), UncertaintyWeights(safe)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_task = (self.body(x) - y).pow(2).mean(0)
        return self.weighting(per_task)


def _uncertainty(safe: bool) -> Scenario:
    """Task 1's loss is near 0 and its log variance is driven down; at step 2 it reaches -100: exp(100) is inf."""
    torch.manual_seed(0)
    model = TwoTasks(safe)
    xs, ys = _batches(4, 4), _batches(4, 2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.weighting.log_var[1] = -100.0
        return xs[step], ys[step]
    return _loop(model, batch, lambda loss, step: loss, lr=0.0)


# ---------------------------------------------------------------- CLIP's learnable logit scale without its clamp
class Clip(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(6, 4), nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.safe = safe

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        img, txt = F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)
        scale = self.logit_scale.clamp(max=math.log(100)) if self.safe else self.logit_scale
        return scale.exp() * img @ txt.t()  # producer: logit scale


def _clip_batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _batches(4, 6), _batches(4, 5)


def _clip(safe: bool) -> Scenario:
    """The logit scale (learnt, no clamp) has grown to 100 by step 2: exp(100) overflows float32."""
    torch.manual_seed(0)
    model = Clip(safe)
    images, texts = _clip_batches()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.logit_scale.fill_(100.0)
        return images[step], texts[step]
    return _loop(model, batch, lambda logits, step: F.cross_entropy(logits, torch.arange(4)), lr=0.0)


# ---------------------------------------------------------------- fake quantisation of a dead ReLU, scale 0
class FakeQuant(nn.Module):
    """Per-tensor min/max fake quantisation to 8 bits with a straight-through estimator."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = ((x.max() - x.min()) / 255).clamp(min=self.eps) if self.eps else (x.max() - x.min()) / 255
        q = torch.round(x / scale).clamp(-128, 127) * scale  # producer: quant scale
        return x + (q - x).detach()


class QatNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.fc1, self.quant, self.fc2 = nn.Linear(4, 6), FakeQuant(eps), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.quant(torch.relu(self.fc1(x))))


def _fake_quant(eps: float) -> Scenario:
    """At step 2 the first layer's ReLU is dead for the whole batch: min = max = 0, scale 0, 0 / 0. The fix:
    clamp the scale to an eps, as torch's observers do."""
    torch.manual_seed(0)
    model = QatNet(eps)
    xs, ys = [torch.rand(4, 4) for _ in range(4)], _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.fc1.weight.abs_()
                model.fc1.bias.fill_(-10.0)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- a Cox partial likelihood without events
def _cox(safe: bool) -> Scenario:
    """DeepSurv's loss: risks sorted by time, minus (risk - logcumsumexp(risk)) over the observed events, divided
    by the number of events; the batch of step 2 holds only censored patients: 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    xs = _batches(6, 5)
    events = [(torch.rand(6) > 0.4).float() for _ in range(4)]
    events[0][0] = events[1][0] = events[3][0] = 1.0
    events[2] = torch.zeros(6)

    def loss_fn(risk: torch.Tensor, step: int) -> torch.Tensor:
        risk = risk.squeeze(-1)
        log_risk_set = torch.logcumsumexp(risk, 0)
        count = events[step].sum().clamp(min=1) if safe else events[step].sum()
        return -((risk - log_risk_set) * events[step]).sum() / count  # producer: cox mean
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a Poisson NLL by hand of a dead ReLU rate
def _poisson(library: bool) -> Scenario:
    """Rates by ReLU (counts data); at step 1 a rate is exactly 0 where the count is 3: 0 - 3 * log(0) is +inf.
    The fix: F.poisson_nll_loss(log_input=False), which adds its eps inside the log."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.ReLU())
    with torch.no_grad():
        model[2].weight.mul_(0.1)
        model[2].bias.fill_(2.0)
    xs = _batches(4, 4)
    counts = [torch.poisson(torch.full((4, 3), 2.0)) for _ in range(4)]
    counts[1][0, 0] = 3.0

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model[2].weight[0] = 0.0
                model[2].bias[0] = -1.0
        return (xs[step],)

    def loss_fn(rate: torch.Tensor, step: int) -> torch.Tensor:
        if library:
            return F.poisson_nll_loss(rate, counts[step], log_input=False)
        return (rate - counts[step] * torch.log(rate)).mean()  # producer: poisson log
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- NeRF's expected depth of an empty ray
class VolumeRenderer(nn.Module):
    """Densities along each ray, alpha compositing, and the expected depth normalised by the accumulated weight."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.density = nn.Linear(3, 1)
        self.eps = eps

    def forward(self, points: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        sigma = torch.relu(self.density(points)).squeeze(-1)
        alpha = 1 - torch.exp(-sigma * 0.1)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha[:, :-1]], -1), -1)
        weights = alpha * trans
        return (weights * depths).sum(-1) / (weights.sum(-1) + self.eps)  # producer: expected depth


def _nerf(eps: float) -> Scenario:
    """4 rays of 8 samples; at step 2 ray 3 passes through empty space (every density 0): 0 / 0. The fix (as in
    nerf-pytorch): + 1e-10."""
    torch.manual_seed(0)
    model = VolumeRenderer(eps)
    with torch.no_grad():
        model.density.weight.fill_(1.0)
        model.density.bias.fill_(0.5)
    points = [torch.rand(4, 8, 3) for _ in range(4)]
    points[2][3] = -1.0
    depths, gt = torch.linspace(1, 2, 8).expand(4, 8), _batches(4)
    return _loop(model, lambda step: (points[step], depths), lambda d, step: F.mse_loss(d, gt[step]), lr=0.0)


# ---------------------------------------------------------------- an L1/2 penalty of a pruned weight
def _half_norm_penalty(eps: float) -> Scenario:
    """A sparsity penalty sum |w|^(1/2) after magnitude pruning has zeroed weights (at step 1): the pow's backward
    at 0 is 0.5 * 0^(-1/2) = inf, times sign(0) = 0 in abs's backward: NaN gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    xs, ys = _batches(4, 4), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model[0].weight[model[0].weight.abs() < 0.1] = 0.0
        return (xs[step],)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        penalty = (model[0].weight.abs() + eps).pow(0.5).sum()  # producer: half norm
        return F.mse_loss(out, ys[step]) + 1e-3 * penalty
    return _loop(model, batch, loss_fn)


# ---------------------------------------------------------------- weight standardisation of a zero filter
class WSConv(nn.Conv1d):
    """A Conv1d with weight standardisation (BiT / NFNet style), per output filter."""

    def __init__(self, eps: float) -> None:
        super().__init__(2, 3, 3, padding=1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean, std = w.mean(dim=(1, 2), keepdim=True), w.std(dim=(1, 2), keepdim=True)
        return F.conv1d(x, (w - mean) / (std + self.eps), self.bias, padding=1)  # producer: standardise


def _weight_standardisation(eps: float) -> Scenario:
    """At step 1 filter 2 has been zero-initialised (a residual branch's last conv, zero-init for stability):
    its std is 0, (0 - 0) / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(WSConv(eps), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 8, 1))
    xs, ys = _batches(4, 2, 8), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model[0].weight[2] = 0.0
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- a max-norm constraint in place in the forward
class MaxNormLinear(nn.Linear):
    """A Linear whose rows are renormalised to unit norm in place at each training call (a max-norm constraint
    written as in old Keras ports)."""

    def __init__(self, eps: float) -> None:
        super().__init__(4, 3)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.div_(self.weight.norm(dim=1, keepdim=True) + self.eps)  # producer: max norm
        return super().forward(x)


def _max_norm(eps: float) -> Scenario:
    """At step 2 row 1 of the weight is 0 (a pruned unit): the in-place division writes 0 / 0 into the parameter,
    in the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(MaxNormLinear(eps), nn.Tanh(), nn.Linear(3, 1))
    xs, ys = _batches(4, 4), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model[0].weight[1] = 0.0
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- a VQ-VAE's EMA codebook with a dead code
class EmaQuantizer(nn.Module):
    """Vector quantisation with an EMA codebook (van den Oord et al.): buffers updated in the training forward."""

    def __init__(self, smoothing: bool) -> None:
        super().__init__()
        self.register_buffer("embed", torch.randn(4, 3))
        self.register_buffer("cluster_size", torch.ones(4))
        self.register_buffer("embed_sum", self.embed.clone())
        self.smoothing = smoothing

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        codes = torch.cdist(z, self.embed).argmin(-1)
        onehot = F.one_hot(codes, 4).float()
        quantised = self.embed[codes]
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(0.5).add_(onehot.sum(0), alpha=0.5)
                self.embed_sum.mul_(0.5).add_(onehot.t() @ z, alpha=0.5)
                n = self.cluster_size
                if self.smoothing:
                    n = (n + 1e-5) / (n.sum() + 4e-5) * n.sum()
                self.embed.copy_(self.embed_sum / n[:, None])  # producer: ema codebook
        return z + (quantised - z).detach()


class VqAutoencoder(nn.Module):
    def __init__(self, smoothing: bool) -> None:
        super().__init__()
        self.enc, self.vq, self.dec = nn.Linear(5, 3), EmaQuantizer(smoothing), nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.vq(self.enc(x)))


def _vq_ema(smoothing: bool) -> Scenario:
    """Code 3 sits far from every encoding (never chosen) and its EMA cluster size starts at 0, as in
    implementations that initialise ``cluster_size`` to zeros: the first update's embed_sum / 0 is 0 / 0, written
    into the codebook buffer at step 0 while that step's output stays finite (it quantised with the old codebook);
    the NaN code wins every argmin at step 1. The fix: Laplace smoothing of the cluster sizes."""
    torch.manual_seed(0)
    model = VqAutoencoder(smoothing)
    with torch.no_grad():
        model.vq.embed[3] = 100.0
        model.vq.cluster_size[3] = 0.0
        model.vq.embed_sum[3] = 0.0
    xs = _batches(6, 5)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, xs[step]), lr=0.0)


# ---------------------------------------------------------------- F.normalize in float16
class HalfEmbedder(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.form == "float32":
            return F.normalize(h.float(), dim=-1).to(h.dtype)  # producer: float32 normalize
        if self.form == "eps":
            return F.normalize(h, dim=-1, eps=1e-3)
        return F.normalize(h, dim=-1)  # producer: half normalize


def _half_normalize(form: str) -> Scenario:
    """A float16 embedder (``.half()`` for memory): F.normalize's eps 1e-12 rounds to 0 in float16, so the zero
    embedding of a blank input at step 2 is 0 / 0. Normalising in float32 instead is finite in forward, but its
    gradient at the zero vector is 1 / eps = 1e12, +-inf once cast back to float16 (a backward producer). The fix
    that holds both ways: an eps that float16 holds and whose reciprocal it holds too (1e-3)."""
    torch.manual_seed(0)
    model = HalfEmbedder(form).half()
    xs = [x.half() for x in _batches(3, 4)]
    xs[2][1] = 0.0
    targets = [torch.randn(3, 4).half() for _ in range(4)]
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: (out.float() - targets[step].float()).pow(2).mean(), lr=0.0)


# ---------------------------------------------------------------- a LayerNorm by hand, rsqrt(var) of a constant row
class HandLayerNorm(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(6)), nn.Parameter(torch.zeros(6))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias  # producer: rsqrt var


def _hand_layer_norm(eps: float) -> Scenario:
    """A hand-written LayerNorm with eps=0 (ported from a reference that had none): at step 1 a token's features
    are constant (a padding embedding of all 0.5): rsqrt(0) is inf, times (x - mean) = 0 is NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), HandLayerNorm(eps), nn.Linear(6, 1))
    xs, ys = _batches(4, 6), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model[0].weight[:, :] = 0.0
                model[0].bias.fill_(0.5)
        return (xs[step],)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- compiled (aot_eager): CLIP, and a signed sqrt
def _compiled_clip(safe: bool) -> Scenario:
    """The CLIP head above, compiled with ``torch.compile(backend="aot_eager")``."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Clip(safe)
    compiled = torch.compile(model, backend="aot_eager")
    images, texts = _clip_batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.logit_scale.fill_(100.0)
            loss = F.cross_entropy(compiled(images[step], texts[step]), torch.arange(4))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((compiled, opt), run)


class SignedRoot(nn.Module):
    """A signed square root of the features (as for Fisher vectors / bilinear pooling), then a head."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(torch.sign(h) * torch.sqrt(h.abs() + self.eps))  # producer: signed root


def _compiled_signed_root(eps: float) -> Scenario:
    """Compiled with aot_eager; at step 1 a feature is exactly 0 (a zero row of the batch, bias 0): sqrt(0) is
    finite, its backward 1 / (2 * 0) is inf, times sign's 0: NaN gradients."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = SignedRoot(eps)
    with torch.no_grad():
        model.lin.bias.zero_()
    compiled = torch.compile(model, backend="aot_eager")
    xs, ys = _batches(3, 4), _batches(3, 1)
    xs[1][0] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(compiled(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((compiled, opt), run)


# ---------------------------------------------------------------- nn.LSTM fed a feature near float32's max
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(3, 5, batch_first=True), nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _lstm_saturated() -> Scenario:
    """A sensor feature that reads 3e38 at step 2 (a sentinel for 'no reading'): the input projection passes
    float32's max inside ``nn.LSTM``, and its gates saturate (sigmoid and tanh of +-inf are finite, their
    derivatives 0): every boundary stays finite. A near miss that must stay calm: no event, nothing changed."""
    torch.manual_seed(0)
    model = Tagger()
    xs, ys = _batches(2, 6, 3), _batches(2, 1)
    xs[2][1, 3, :2] = 3e38
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- atan2 at (0, 0): torch's backward handles it
def _atan2() -> Scenario:
    """The heading of a predicted 2-D vector by atan2; a blank input gives (0, 0): atan2 is 0 and its backward
    divides by x^2 + y^2 = 0, but torch masks that to 0. Healthy: nothing to report."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    xs, ys = _batches(4, 3), [torch.rand(4) for _ in range(4)]
    xs[1][2] = 0.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        return F.mse_loss(torch.atan2(out[:, 1], out[:, 0]), ys[step])
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- Glow's ActNorm: data-dependent init
class ActNorm(nn.Module):
    """Glow's activation normalisation: at its first training call, scale and bias are set from the batch's
    statistics (``.data.copy_`` in the forward), so the first output has zero mean and unit variance."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.bias, self.log_scale = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
        self.register_buffer("initialised", torch.tensor(False))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialised:
            with torch.no_grad():
                self.bias.data.copy_(-x.mean(0))
                self.log_scale.data.copy_(torch.log(1 / (x.std(0) + self.eps)))  # producer: actnorm init
                self.initialised.fill_(True)
        return (x + self.bias) * self.log_scale.exp()


def _actnorm(eps: float) -> Scenario:
    """The first batch's channel 2 is constant (a padded channel): its std is 0, 1 / 0 = inf and log(inf) = inf
    written into log_scale at step 0, whose exp makes the output inf there. The fix: an eps in the std."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), ActNorm(eps), nn.Linear(3, 1))
    with torch.no_grad():
        model[0].weight[2] = 0.0
        model[0].bias[2] = 0.5
    xs, ys = _batches(4, 3), _batches(4, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=0.0)


# ---------------------------------------------------------------- L-BFGS: the forward and backward inside opt.step()
def _lbfgs(eps: float) -> Scenario:
    """A PINN-style fit with ``torch.optim.LBFGS``: the forward and backward run in the closure that
    ``opt.step(closure)`` calls. At step 2 a collocation point sits where the predicted density is 0, and the loss
    takes its log. The step is the optimizer's: the closure's calls belong to the step that called them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1), nn.ReLU())
    with torch.no_grad():
        model[2].bias.fill_(1.0)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.0, max_iter=2)
    points = [torch.rand(6, 1) for _ in range(4)]

    def batch(step: int) -> torch.Tensor:
        if step == 2:
            with torch.no_grad():
                model[2].weight.zero_()
                model[2].bias.fill_(-1.0)
        return points[step]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x = batch(step)

            def closure(x: torch.Tensor = x) -> torch.Tensor:
                opt.zero_grad()
                density = model(x)
                loss = -torch.log(density + eps).mean()  # producer: lbfgs log
                loss.backward()
                return loss
            losses.append(opt.step(closure).detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- near misses: logging code that overflows
def _perplexity_logged() -> Scenario:
    """The loop logs the perplexity ``exp(loss)`` every step; the untrained model's loss of ~100 nats (logits of
    a large scale) makes it inf, in logging code only: no boundary holds it, nothing to report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 50))
    with torch.no_grad():
        model[0].weight.mul_(60.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xs, ys = _batches(8, 4), [torch.randint(0, 50, (8,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        logged = []
        for step in range(4):
            loss = F.cross_entropy(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            logged.append(torch.exp(loss.detach()))
        return logged
    return Scenario((model, opt), run)


class LoggedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.act, self.head = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)
        self.logged: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)))


def _hook_logs_a_dead_layer() -> Scenario:
    """A forward hook logs each activation's log-variance (a dead-unit monitor); at step 1 the ReLU is dead for the
    whole batch: log(0) = -inf, in the hook's logging only (the output is untouched). Nothing to report."""
    torch.manual_seed(0)
    model = LoggedNet()
    model.act.register_forward_hook(lambda module, args, out: model.logged.append(out.detach().var().log()))
    xs, ys = _batches(4, 4), _batches(4, 1)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model.body.bias.fill_(-50.0)
        return (xs[step],)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        return F.mse_loss(out, ys[step])
    scenario = _loop(model, batch, loss_fn, lr=0.0)
    inner = scenario.run

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return inner(), model.logged
    return Scenario(scenario.targets, run)


# ---------------------------------------------------------------- SAC: a policy returning a Distribution
class GaussianPolicy(nn.Module):
    """SAC's actor: returns ``Normal(mu, exp(log_std))`` itself (a Distribution, no tensor, as many RL codebases
    do); ``clamped`` keeps log_std in [-20, 2] as SAC implementations do."""

    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.body, self.mu, self.log_std = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.clamped = clamped

    def forward(self, obs: torch.Tensor) -> torch.distributions.Normal:
        h = torch.relu(self.body(obs))
        log_std = self.log_std(h).clamp(-20.0, 2.0) if self.clamped else self.log_std(h)
        return torch.distributions.Normal(self.mu(h), log_std.exp(), validate_args=False)  # producer: policy std


def _sac(fault: str) -> Scenario:
    """The squashed-Gaussian log-probability ``log_prob(u) - log(1 - tanh(u)^2)``. Fault "squash": at step 2 the
    mean head's bias is 20: tanh(u) rounds to 1 and log(1 - 1) is -inf (the fix: the softplus form). Fault "std":
    at step 2 the log_std head's bias is 100, exp(100) is inf inside the Distribution the policy returns (the
    fix: the clamp). Neither: the fixed policy and the softplus form."""
    torch.manual_seed(0)
    model = GaussianPolicy(clamped=fault != "std")
    obs, q_weights = _batches(6, 4), torch.randn(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    (model.mu if fault == "squash" else model.log_std).bias.fill_(
                        100.0 if fault == "std" else 20.0 if fault == "squash" else 0.0)
            dist = model(obs[step])
            u = dist.rsample()
            if fault == "squash":
                log_prob = dist.log_prob(u) - torch.log(1 - torch.tanh(u).pow(2))  # producer: squash log
            else:
                log_prob = dist.log_prob(u) - 2 * (math.log(2) - u - F.softplus(-2 * u))
            loss = (0.2 * log_prob.sum(-1) - torch.tanh(u) @ q_weights).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a masked policy returning a Categorical
class MaskedPolicy(nn.Module):
    """An actor returning ``Categorical(logits=...)`` with illegal actions masked by -inf (its output holds -inf
    on purpose: a deliberate infinity while each state keeps a legal action)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.distributions.Categorical:
        logits = self.net(obs).masked_fill(~legal, float("-inf"))
        return torch.distributions.Categorical(logits=logits, validate_args=False)  # producer: policy categorical


def _masked_policy(no_legal_action: bool) -> Scenario:
    """REINFORCE with action masking; at step 2 state 1 has no legal action when ``no_legal_action``: the
    Categorical the model returns normalises a row of -inf (logsumexp -inf, then -inf - -inf)."""
    torch.manual_seed(0)
    model = MaskedPolicy()
    obs = _batches(3, 4)
    legal = [torch.tensor([[True, False, True], [True, True, False], [False, True, True]]) for _ in range(4)]
    if no_legal_action:
        legal[2] = legal[2].clone()
        legal[2][1] = False
    actions, advantages = torch.tensor([0, 1, 2]), torch.tensor([0.5, -0.2, 1.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            dist = model(obs[step], legal[step])
            loss = -(dist.log_prob(actions) * advantages).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


class MaskedLogSoftmax(nn.Module):
    """The same actor returning the masked log-probabilities themselves (a tensor holding -inf on purpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.net(obs).masked_fill(~legal, float("-inf")).log_softmax(-1)  # producer: masked log_softmax


def _masked_log_softmax(no_legal_action: bool) -> Scenario:
    """As ``_masked_policy``, the model returning log-probabilities: a row with no legal action is NaN."""
    torch.manual_seed(0)
    model = MaskedLogSoftmax()
    obs = _batches(3, 4)
    legal = [torch.tensor([[True, False, True], [True, True, False], [False, True, True]]) for _ in range(4)]
    if no_legal_action:
        legal[2] = legal[2].clone()
        legal[2][1] = False
    actions, advantages = torch.tensor([0, 1, 2]), torch.tensor([0.5, -0.2, 1.0])
    return _loop(model, lambda step: (obs[step], legal[step]),
                 lambda logp, step: -(logp.gather(1, actions[:, None]).squeeze(1) * advantages).mean())


# ---------------------------------------------------------------- a detector returning its own result object
class Detections:
    """A detector's result as a plain object (as detectron2's ``Instances`` or a user's class): no tuple, no
    dict, no dataclass."""

    def __init__(self, boxes: torch.Tensor, scores: torch.Tensor) -> None:
        self.boxes, self.scores = boxes, scores


class BoxHead(nn.Module):
    """Box regression decoded from anchors: width = anchor width * exp(dw); Faster R-CNN clamps dw at
    log(1000 / 16) first, for this very reason."""

    def __init__(self, clamped: bool) -> None:
        super().__init__()
        self.reg, self.cls = nn.Linear(6, 4), nn.Linear(6, 1)
        self.clamped = clamped

    def forward(self, feats: torch.Tensor, anchors: torch.Tensor) -> Detections:
        deltas = self.reg(feats)
        dwh = deltas[:, 2:].clamp(max=math.log(1000 / 16)) if self.clamped else deltas[:, 2:]
        centre = anchors[:, :2] + deltas[:, :2] * anchors[:, 2:]
        size = anchors[:, 2:] * torch.exp(dwh)  # producer: box exp
        return Detections(torch.cat([centre, size], -1), self.cls(feats).squeeze(-1))


def _detector(clamped: bool) -> Scenario:
    """At step 2 the width regression has drifted to 100 (its bias: a loss spike the step before): exp(100)
    overflows float32."""
    torch.manual_seed(0)
    model = BoxHead(clamped)
    feats, anchors = _batches(5, 6), torch.rand(5, 4) + 0.5
    gt = [torch.rand(5, 4) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.reg.bias[2] = 100.0
        return feats[step], anchors

    def loss_fn(det: Detections, step: int) -> torch.Tensor:
        return F.smooth_l1_loss(det.boxes, gt[step]) + det.scores.sigmoid().mean()
    return _loop(model, batch, loss_fn, lr=0.0)


CASES = [
    Case("hunt17_gnn_scatter_mean_over_an_isolated_node", lambda: _gnn(False),
         Expect("forward", "conv", "MeanConv", step=2, op="aten.div.Tensor", marker="scatter mean")),
    Case("hunt17_gnn_scatter_mean_degree_clamped_healthy", lambda: _gnn(True), None),
    Case("hunt17_dice_loss_of_an_empty_mask", lambda: _dice(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="dice ratio")),
    Case("hunt17_dice_loss_smoothed_healthy", lambda: _dice(1.0), None),
    Case("hunt17_sinkhorn_kernel_row_underflows_at_a_small_epsilon", lambda: _sinkhorn(0.05),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="sinkhorn u")),
    Case("hunt17_sinkhorn_larger_epsilon_healthy", lambda: _sinkhorn(4.0), None),
    Case("hunt17_flow_slogdet_of_a_singular_weight", lambda: _flow(False),
         Expect("forward", "", "LinearFlow", step=2, op="aten._linalg_slogdet.default", marker="slogdet")),
    Case("hunt17_flow_lu_parametrised_healthy", lambda: _flow(True), None),
    Case("hunt17_poincare_artanh_of_a_radius_rounded_to_1", lambda: _poincare(False),
         Expect("forward", "", "PoincareEncoder", step=1, op="aten.atanh.default", marker="artanh")),
    Case("hunt17_poincare_radius_clamped_healthy", lambda: _poincare(True), None),
    Case("hunt17_negative_binomial_lgamma_of_a_dispersion_0", lambda: _negative_binomial(0.0),
         Expect("forward", None, step=2, op="aten.lgamma.default", marker="lgamma theta")),
    Case("hunt17_negative_binomial_dispersion_eps_healthy", lambda: _negative_binomial(1e-4), None),
    Case("hunt17_uncertainty_weights_exp_of_a_log_var_of_minus_100", lambda: _uncertainty(False),
         Expect("forward", "weighting", "UncertaintyWeights", step=2, op="aten.exp.default", marker="precision")),
    Case("hunt17_uncertainty_weights_clamped_healthy", lambda: _uncertainty(True), None),
    Case("hunt17_clip_logit_scale_exp_without_its_clamp", lambda: _clip(False),
         Expect("forward", "", "Clip", step=2, op="aten.exp.default", marker="logit scale")),
    Case("hunt17_clip_logit_scale_clamped_healthy", lambda: _clip(True), None),
    Case("hunt17_fake_quant_scale_0_of_a_dead_relu", lambda: _fake_quant(0.0),
         Expect("forward", "quant", "FakeQuant", step=2, op="aten.div.Tensor", marker="quant scale")),
    Case("hunt17_fake_quant_scale_clamped_healthy", lambda: _fake_quant(1e-8), None),
    Case("hunt17_cox_partial_likelihood_of_a_batch_without_events", lambda: _cox(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="cox mean")),
    Case("hunt17_cox_event_count_clamped_healthy", lambda: _cox(True), None),
    Case("hunt17_poisson_nll_by_hand_of_a_rate_0", lambda: _poisson(False),
         Expect("forward", None, step=1, op="aten.log.default", marker="poisson log")),
    Case("hunt17_poisson_nll_library_healthy", lambda: _poisson(True), None),
    Case("hunt17_nerf_expected_depth_of_an_empty_ray", lambda: _nerf(0.0),
         Expect("forward", "", "VolumeRenderer", step=2, op="aten.div.Tensor", marker="expected depth")),
    Case("hunt17_nerf_expected_depth_with_eps_healthy", lambda: _nerf(1e-10), None),
    Case("hunt17_half_norm_penalty_of_a_pruned_weight", lambda: _half_norm_penalty(0.0),
         Expect("backward", None, step=1, op="aten.pow.Tensor_Scalar", marker="half norm")),
    Case("hunt17_half_norm_penalty_with_eps_healthy", lambda: _half_norm_penalty(1e-8), None),
    Case("hunt17_weight_standardisation_of_a_zero_filter", lambda: _weight_standardisation(0.0),
         Expect("forward", "0", "WSConv", step=1, op="aten.div.Tensor", marker="standardise")),
    Case("hunt17_weight_standardisation_with_eps_healthy", lambda: _weight_standardisation(1e-5), None),
    Case("hunt17_max_norm_in_place_in_the_forward_of_a_zero_row", lambda: _max_norm(0.0),
         Expect("forward", "0", "MaxNormLinear", step=2, op="aten.div_.Tensor", marker="max norm")),
    # Where the tracer names the write, the cause is the op's (0 / 0), not a parameter found already non-finite.
    Case("hunt17_max_norm_in_place_in_the_forward_cause_of_its_op", lambda: _max_norm(0.0),
         Expect("forward", "0", "MaxNormLinear", step=2, op="aten.div_.Tensor", marker="max norm",
                cause="division-by-zero"), modes=("ops",)),
    # (A strict xfail to gaps19: the replays started from the parameter as the write left it, op None and cause
    # parameter-already-nonfinite. The step replay now starts from the values the forward's writes found
    # (hot/kept/parameter_writes.py); mode="full" replays the step's call where it wrote its own state (per_call.py).)
    Case("hunt17_max_norm_in_place_in_the_forward_op_and_line", lambda: _max_norm(0.0),
         Expect("forward", "0", "MaxNormLinear", step=2, op="aten.div_.Tensor", marker="max norm",
                cause="division-by-zero"), modes=("default", "defer", "full")),
    Case("hunt17_max_norm_in_place_with_eps_healthy", lambda: _max_norm(1e-7), None),
    Case("hunt17_vq_ema_codebook_of_a_dead_code", lambda: _vq_ema(False),
         Expect("forward", "vq", "EmaQuantizer", step=0, op="aten.div.Tensor", marker="ema codebook")),
    Case("hunt17_vq_ema_codebook_laplace_smoothed_healthy", lambda: _vq_ema(True), None),
    Case("hunt17_normalize_in_float16_of_a_blank_input", lambda: _half_normalize("half"),
         Expect("forward", "", "HalfEmbedder", step=2, op="aten.div.Tensor", marker="half normalize")),
    Case("hunt17_normalize_in_float32_gradient_cast_to_float16", lambda: _half_normalize("float32"),
         Expect("backward", "", "HalfEmbedder", step=2, op="aten._to_copy.default", marker="float32 normalize")),
    # (A strict xfail to gaps19: mode='full' replayed the module's backward from a gradient of ones and named torch's
    # masked 0 / 0 in the norm's backward, aten.div.Tensor. The kept top-level call's real output gradient reaches
    # the float16 cast that overflows (localize/replay/per_call.py).)
    Case("hunt17_normalize_in_float32_gradient_cast_full_mode_op", lambda: _half_normalize("float32"),
         Expect("backward", "", "HalfEmbedder", step=2, op="aten._to_copy.default", marker="float32 normalize",
                cause="half-precision-overflow"), modes=("full",)),
    Case("hunt17_normalize_in_float16_eps_1e_3_healthy", lambda: _half_normalize("eps"), None),
    Case("hunt17_hand_layer_norm_rsqrt_of_a_constant_row", lambda: _hand_layer_norm(0.0),
         Expect("forward", "1", "HandLayerNorm", step=1, op="aten.rsqrt.default", marker="rsqrt var")),
    Case("hunt17_hand_layer_norm_with_eps_healthy", lambda: _hand_layer_norm(1e-5), None),
    Case("hunt17_compiled_clip_logit_scale_exp", lambda: _compiled_clip(False),
         Expect("forward", "", "Clip", step=2, op="aten.exp.default", marker="logit scale")),
    Case("hunt17_compiled_clip_logit_scale_clamped_healthy", lambda: _compiled_clip(True), None),
    Case("hunt17_compiled_signed_root_backward_at_0", lambda: _compiled_signed_root(0.0),
         Expect("backward", "", "SignedRoot", step=1, op="aten.div.Tensor", marker="signed root")),
    Case("hunt17_compiled_signed_root_with_eps_healthy", lambda: _compiled_signed_root(1e-8), None),
    Case("hunt17_lstm_saturated_by_a_feature_near_float32_max_healthy", _lstm_saturated, None),
    Case("hunt17_atan2_at_the_origin_healthy", _atan2, None),
    Case("hunt17_actnorm_data_dependent_init_of_a_constant_channel", lambda: _actnorm(0.0),
         Expect("forward", "1", "ActNorm", step=0, op="aten.reciprocal.default", marker="actnorm init")),
    # (A strict xfail to gaps19: mode="full" replayed the module with its 'initialised' flag as the call left it,
    # skipping the init, op None. Its call wrote its own buffer: the kept step call is replayed from before it.)
    Case("hunt17_actnorm_data_dependent_init_full_mode_op", lambda: _actnorm(0.0),
         Expect("forward", "1", "ActNorm", step=0, op="aten.reciprocal.default", marker="actnorm init",
                cause="division-by-zero"), modes=("full",)),
    Case("hunt17_actnorm_init_with_eps_healthy", lambda: _actnorm(1e-6), None),
    Case("hunt17_lbfgs_closure_log_of_a_zero_density", lambda: _lbfgs(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="lbfgs log")),
    Case("hunt17_lbfgs_closure_log_with_eps_healthy", lambda: _lbfgs(1e-6), None),
    Case("hunt17_sac_squashed_log_prob_of_a_saturated_tanh", lambda: _sac("squash"),
         Expect("forward", None, step=2, op="aten.log.default", marker="squash log")),
    Case("hunt17_sac_policy_distribution_std_overflows", lambda: _sac("std"),
         Expect("forward", "", "GaussianPolicy", step=2, op="aten.exp.default", marker="policy std")),
    Case("hunt17_sac_clamped_std_and_softplus_form_healthy", lambda: _sac("none"), None),
    Case("hunt17_policy_categorical_of_a_state_with_no_legal_action", lambda: _masked_policy(True),
         Expect("forward", "", "MaskedPolicy", step=2, op="aten.logsumexp.default", marker="policy categorical")),
    Case("hunt17_policy_categorical_masked_with_inf_healthy", lambda: _masked_policy(False), None),
    Case("hunt17_masked_log_softmax_output_of_a_state_with_no_legal_action", lambda: _masked_log_softmax(True),
         Expect("forward", "", "MaskedLogSoftmax", step=2, op="aten._log_softmax.default",
                marker="masked log_softmax")),
    Case("hunt17_masked_log_softmax_output_healthy", lambda: _masked_log_softmax(False), None),
    # A plain result object's own tensor attributes are the model's output (hot/reads.object_tensors): read at the
    # boundary, so every mode names the box head (it was the loss code's, op None, but with ops=True).
    Case("hunt17_detector_result_object_box_exp_overflows", lambda: _detector(False),
         Expect("forward", "", "BoxHead", step=2, op="aten.exp.default", marker="box exp")),
    Case("hunt17_detector_result_object_box_deltas_clamped_healthy", lambda: _detector(True), None),
    Case("hunt17_perplexity_logged_overflows_healthy", _perplexity_logged, None),
    Case("hunt17_forward_hook_logs_log_var_of_a_dead_layer_healthy", _hook_logs_a_dead_layer, None),
]
