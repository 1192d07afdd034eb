"""Reported NaN incidents of families the other rows do not hold, each with the healthy twin its users apply (hunt22).

Modules: a CLIP/InfoNCE dual encoder whose learned temperature is clamped at 0 instead of a positive floor; a
normalising flow whose elementwise layer is a ReLU (the log of a derivative of 0 in its log-determinant); SincNet's
band-pass filters written as ``sin(2 pi f t) / (pi t)`` over taps that include t = 0; a Conv-BatchNorm fold written
without eps, over a pruned channel's running variance of 0; an ordinal-regression head (cumulative link) whose
cutpoints were initialised unsorted (the log of a negative class probability); a GAN discriminator's minibatch
standard deviation without eps over a last batch of one (sqrt's backward at 0); sinusoidal positions built by
``arange`` in a float16 model over a sequence longer than 65504 (the cast overflows); a causal running mean divided by
``arange(T)`` (off by one: position 0 divided by 0); an RBF layer whose precisions were initialised by ``randn``
(exp of a positive exponent on an outlier); a Stiefel layer kept orthonormal by the QR decomposition of a child
Linear's weight with a pruned row, in the parent's forward (QR's backward solves with a singular R: the parent is the
producer, not the Linear that owns the weight and never ran); an output layer tied to the input embedding and
normalised by hand, in the root's code and, tied as transformers do (one Parameter on two modules), in the head's;
a ReZero gain of 0 owned by the root and passed to its blocks, whose code takes ``sqrt(g * g)`` (the block is named).

Loss code: a metric-learning loss over pairwise distances by the expansion ``|a|^2 + |b|^2 - 2 a.b`` (rounding makes a
distance of an embedding to itself negative: sqrt is NaN); every loss term normalised by its own detached value,
where the box loss of a batch without a positive anchor is 0 (0 / 0); a von Mises likelihood's ``log(i0(kappa))``
overflowing for a confident prediction; behaviour cloning's tanh-squashed Gaussian ``log_prob`` of a dataset action
clipped to exactly 1 (atanh inside torch.distributions); a sequence likelihood taken as the product of its token
probabilities (it underflows on a long sequence: log of 0); SI-SDR of a silent reference without eps (0 / 0);
distillation by ``F.kl_div`` over a vocabulary teacher and student both mask with -inf (0 * -inf); a causal pool whose
normaliser is ``logcumsumexp`` over left padding masked by adding -inf (finite forward, NaN backward). Optimizer: a
hand-written Adafactor without eps1, stepping an auxiliary head whose loss weight 0.0 gave it all-zero gradients.
Healthy near misses: BatchNorm2d in training over a channel constant across a batch of one (its variance 0, eps
keeps it finite), and ``F.binary_cross_entropy`` of a saturated sigmoid (torch clamps its log at -100).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform
from torch.nn import functional as F

from contract import MODES, Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- InfoNCE: a learned temperature clamped at 0
class DualEncoder(nn.Module):
    """CLIP-style image and text towers with a learned temperature ``tau`` (0.07), kept positive by a clamp; the
    clamp's floor is 0 ("it only has to stay non-negative"). The twin clamps at 0.01, as CLIP clamps its scale."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(6, 8), nn.Linear(6, 8)
        self.text.load_state_dict(self.image.state_dict())
        self.tau = nn.Parameter(torch.tensor(0.07))
        self.floor = floor

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)
        return a @ b.T / self.tau.clamp(min=self.floor)  # producer: infonce temperature


def _infonce(floor: float) -> Scenario:
    """Paired views that the towers already match: a lower temperature lowers the loss, and Adam (lr 0.05) walks
    tau from 0.07 through 0 in two steps; at step 2 the clamp gives 0 and the logits are divided by it."""
    torch.manual_seed(0)
    model = DualEncoder(floor)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    xs = _batches(6, 6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logits = model(xs[step], xs[step] + 0.01)
            labels = torch.arange(6)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- pairwise distances by expansion: a negative square
def _expansion(clamped: bool) -> Scenario:
    """A contrastive (pair) loss over every pair's Euclidean distance, computed as ``|a|^2 + |b|^2 - 2 a.b`` (the
    fast form); the embeddings sit far from the origin (norms near 80), and rounding makes some squared distances of
    an embedding to itself a little negative: sqrt is NaN. The twin clamps at 1e-12 first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16))
    with torch.no_grad():
        model[2].bias.fill_(20.0)
    xs = _batches(8, 6)
    labels = [torch.randint(0, 3, (8,)) for _ in range(4)]

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        square = (out * out).sum(1)
        d2 = square[:, None] + square[None, :] - 2 * out @ out.T
        if clamped:
            d2 = d2.clamp_min(1e-12)
        dist = d2.sqrt()  # producer: expansion sqrt
        same = (labels[step][:, None] == labels[step][None, :]).float()
        return (same * d2 + (1 - same) * F.relu(1.0 - dist) ** 2).mean()
    return _loop(model, lambda step: (xs[step],), loss_fn, lr=1e-4)


# ---------------------------------------------------------------- a flow layer whose activation is a ReLU
class ElementwiseFlow(nn.Module):
    """``y = act(W x + b)`` with ``log|det dy/dx| = sum log act'(h) + log|det W|``; with a LeakyReLU the derivative is
    1 or the slope. Written with a slope of 0 (a ReLU), the derivative is 0 for every negative h: log(0) is -inf."""

    def __init__(self, slope: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.slope = slope

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        derivative = torch.where(h > 0, torch.ones_like(h), torch.full_like(h, self.slope))
        logdet = torch.log(derivative).sum(-1) + torch.slogdet(self.linear.weight)[1]  # producer: flow log derivative
        return F.leaky_relu(h, self.slope), logdet


def _relu_flow(slope: float) -> Scenario:
    torch.manual_seed(0)
    model = ElementwiseFlow(slope)
    xs = _batches(6, 4)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        y, logdet = out
        return (0.5 * (y ** 2).sum(-1) - logdet).mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- SincNet's band-pass filters at the centre tap
class SincConv(nn.Module):
    """Learned band-pass filters, each the difference of two low-pass sinc filters ``2 f sinc(2 f t)``; written as
    ``sin(2 pi f t) / (pi t)`` over the taps t = -4..4, the centre tap is 0 / 0. The twin uses ``torch.sinc``."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.low, self.band = nn.Parameter(torch.rand(4) * 0.2 + 0.05), nn.Parameter(torch.rand(4) * 0.1 + 0.05)
        self.builtin = builtin

    def lowpass(self, f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.builtin:
            return 2 * f[:, None] * torch.sinc(2 * f[:, None] * t)
        return torch.sin(2 * math.pi * f[:, None] * t) / (math.pi * t)  # producer: sinc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(-4, 5, dtype=x.dtype)
        f1 = self.low.abs()
        filters = (self.lowpass(f1 + self.band.abs(), t) - self.lowpass(f1, t)) * torch.hamming_window(9, False)
        return F.conv1d(x, filters[:, None])


def _sinc(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(SincConv(builtin), nn.Flatten(), nn.Linear(4 * 24, 1))
    xs, ys = _batches(3, 1, 32), _batches(3, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a Conv-BatchNorm fold without eps
class FoldedConvBn(nn.Module):
    """Quantisation-aware fine-tuning folds the BatchNorm into the convolution's weight and bias by hand,
    ``w * gamma / sqrt(running_var)``; the loaded checkpoint pruned channel 2, whose running variance is 0. The twin
    adds the BatchNorm's eps, as torch.ao's fold does."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(2, 4, 3, bias=False), nn.BatchNorm1d(4)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = (self.bn.running_var + self.eps).sqrt()
        weight = self.conv.weight * (self.bn.weight / std)[:, None, None]  # producer: folded weight
        bias = self.bn.bias - self.bn.running_mean * self.bn.weight / std
        return F.conv1d(x, weight, bias)


def _conv_bn_fold(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(FoldedConvBn(eps), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8, 1))
    with torch.no_grad():
        model[0].conv.weight[2] = 0.0
        model[0].bn.running_var.uniform_(0.5, 2.0)
        model[0].bn.running_var[2] = 0.0
    xs, ys = _batches(4, 2, 10), _batches(4, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- each loss normalised by its own detached value
class Detector(nn.Module):
    """A class head and a box head over anchor features."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
        self.cls, self.box = nn.Linear(16, 3), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.cls(h), self.box(h)


def _self_normalised(eps: float) -> Scenario:
    """``sum(l / l.detach())`` balances the terms (each contributes a gradient of unit scale); the box loss is summed
    over the positive anchors, and step 2's batch has none: its loss is 0 and 0 / 0 is NaN. The twin divides by
    ``l.detach() + eps``."""
    torch.manual_seed(0)
    model = Detector()
    xs, boxes = _batches(8, 5), _batches(8, 4)
    labels = [torch.randint(0, 3, (8,)) for _ in range(4)]
    labels[2] = torch.zeros(8, dtype=torch.long)  # class 0: background, no positive anchor

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        logits, box = out
        positive = labels[step] > 0
        terms = [F.cross_entropy(logits, labels[step]),
                 F.l1_loss(box[positive], boxes[step][positive], reduction="sum")]
        return sum(term / (term.detach() + eps) for term in terms)  # producer: self normalised
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- ordinal regression with unsorted cutpoints
class CumulativeLink(nn.Module):
    """A cumulative-link (ordinal logistic) head over 4 ordered grades: ``P(y <= k) = sigmoid(c_k - f(x))`` and each
    grade's probability the difference of two of them. The cutpoints were initialised by ``torch.randn(3)``, not
    sorted: a difference is negative and its log NaN. The twin orders them by construction (a first cutpoint and
    softplus increments)."""

    def __init__(self, ordered: bool) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self.raw = nn.Parameter(torch.tensor([0.4, -0.8, 1.1]))  # what torch.randn(3) drew
        self.ordered = ordered

    def cutpoints(self) -> torch.Tensor:
        if not self.ordered:
            return self.raw
        return self.raw[:1] + torch.cat([self.raw.new_zeros(1), F.softplus(self.raw[1:]).cumsum(0)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdf = torch.sigmoid(self.cutpoints() - self.score(x))
        cdf = torch.cat([torch.zeros_like(cdf[:, :1]), cdf, torch.ones_like(cdf[:, :1])], -1)
        return torch.log(cdf[:, 1:] - cdf[:, :-1])  # producer: ordinal log


def _ordinal(ordered: bool) -> Scenario:
    torch.manual_seed(0)
    model = CumulativeLink(ordered)
    xs, grades = _batches(6, 5), [torch.randint(0, 4, (6,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.nll_loss(out, grades[step]))


# ---------------------------------------------------------------- von Mises likelihood: log(i0(kappa)) overflows
def _von_mises(scaled: bool) -> Scenario:
    """A heading regressor predicting a mean angle and a concentration kappa (softplus); the normaliser's
    ``log(i0(kappa))`` overflows in float32 once kappa passes about 89, here on step 2's confident outlier. The
    twin: ``log(i0e(kappa)) + kappa``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    xs, angles = _batches(6, 4), [torch.rand(6) * 6.28 - 3.14 for _ in range(4)]
    xs[2][1] = 300.0 * model.weight.detach()[1].sign()

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        mu, kappa = out[:, 0], F.softplus(out[:, 1])
        nll = -kappa * torch.cos(angles[step] - mu) + math.log(2 * math.pi)
        if scaled:
            return (nll + torch.log(torch.special.i0e(kappa)) + kappa).mean()
        return (nll + torch.log(torch.special.i0(kappa))).mean()  # producer: von mises
    return _loop(model, lambda step: (xs[step],), loss_fn, lr=0.0)


# ---------------------------------------------------------------- behaviour cloning: tanh log_prob of an action at 1
def _tanh_behaviour_cloning(clip: bool) -> Scenario:
    """Offline RL's behaviour cloning with a tanh-squashed Gaussian policy; the dataset's actions were clipped to the
    action space [-1, 1], and at step 2 one sits at exactly 1.0: ``TanhTransform``'s inverse is atanh(1) = inf. The
    twin clips the dataset's actions to 1 - 1e-6 first, as IQL's and CQL's loaders do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4))
    xs = _batches(6, 5)
    actions = [torch.rand(6, 2) * 1.8 - 0.9 for _ in range(4)]
    actions[2][3, 0] = 1.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        mean, log_std = out.chunk(2, -1)
        policy = TransformedDistribution(Normal(mean, log_std.clamp(-5, 2).exp()), [TanhTransform()])
        action = actions[step].clamp(-1 + 1e-6, 1 - 1e-6) if clip else actions[step]
        return -policy.log_prob(action).sum(-1).mean()  # producer: tanh log prob
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a sequence likelihood as a product of probabilities
def _sequence_product(log_space: bool) -> Scenario:
    """A tagger scoring each sequence by the product of its gold tokens' probabilities; the short sequences of steps
    0 and 1 are fine, step 2's document of 80 tokens has a product near 8^-80, which underflows to 0: log(0). The twin
    sums the log-probabilities."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Tanh(), nn.Linear(16, 8))
    lengths = [24, 24, 80, 24]
    tokens = [torch.randint(0, 20, (2, n)) for n in lengths]
    tags = [torch.randint(0, 8, (2, n)) for n in lengths]

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        if log_space:
            return -F.log_softmax(out, -1).gather(-1, tags[step][..., None]).sum((1, 2)).mean()
        gold = F.softmax(out, -1).gather(-1, tags[step][..., None]).squeeze(-1)
        return -torch.log(gold.prod(-1)).mean()  # producer: sequence product
    return _loop(model, lambda step: (tokens[step],), loss_fn)


# ---------------------------------------------------------------- minibatch standard deviation without eps
class MinibatchStd(nn.Module):
    """ProGAN's minibatch standard deviation (one extra feature: the mean over features of the batch's std), written
    without the reference's eps 1e-8. A last batch of one has variance 0: sqrt(0) is 0, but its backward is inf."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = (((x - x.mean(0)) ** 2).mean(0) + self.eps).sqrt()  # producer: minibatch std
        return torch.cat([x, std.mean().expand(x.shape[0], 1)], 1)


def _minibatch_std(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), MinibatchStd(eps), nn.Linear(9, 1))
    xs = _batches(5, 4)
    xs[2] = xs[2][:1]
    targets = [torch.ones(x.shape[0], 1) for x in xs]
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.binary_cross_entropy_with_logits(out, targets[step]))


# ---------------------------------------------------------------- float16 positions past 65504
class SinusoidalPositions(nn.Module):
    """Adds sinusoidal position encodings, the positions made by ``arange`` in the input's dtype; in a float16 model
    over a recording of 70000 frames, the positions past 65504 are inf and their sine NaN. The twin makes the
    encodings in float32 and casts them."""

    def __init__(self, in_float32: bool) -> None:
        super().__init__()
        self.in_float32 = in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.in_float32 else x.dtype
        positions = torch.arange(x.shape[1], dtype=dtype)  # producer: half positions
        freq = torch.exp(torch.arange(0, x.shape[2], 2, dtype=dtype) * (-math.log(10000.0) / x.shape[2]))
        angles = positions[:, None] * freq
        return x + torch.cat([angles.sin(), angles.cos()], -1).to(x.dtype)


def _half_positions(in_float32: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), SinusoidalPositions(in_float32), nn.Linear(4, 1)).half()
    lengths = [3000, 3000, 70000, 3000]
    xs = [torch.randn(1, n, 2).half() for n in lengths]
    return _loop(model, lambda step: (xs[step],), lambda out, step: out.float().pow(2).mean())


# ---------------------------------------------------------------- a causal running mean off by one
class CausalMeanPool(nn.Module):
    """Each position's mean of the features so far, ``cumsum / count``, the count written ``arange(T)`` (from 0):
    position 0 is divided by 0. The twin counts from 1."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.proj, self.start = nn.Linear(3, 4), start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        count = torch.arange(self.start, h.shape[1] + self.start, dtype=h.dtype)
        return h.cumsum(1) / count[None, :, None]  # producer: cumulative mean


def _causal_mean(start: int) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(CausalMeanPool(start), nn.Tanh(), nn.Linear(4, 1))
    xs, ys = _batches(3, 5, 3), _batches(3, 5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- an RBF layer with precisions from randn
class RbfLayer(nn.Module):
    """Gaussian radial basis units ``exp(-gamma * |x - c|^2)``; the precisions gamma were initialised by
    ``0.1 * torch.randn`` and are used raw, so some are negative: on step 2's outlier input the exponent passes 88 and
    exp is inf. The twin takes ``softplus`` of them."""

    def __init__(self, positive: bool) -> None:
        super().__init__()
        self.centres, self.gamma = nn.Parameter(torch.randn(8, 3)), nn.Parameter(0.1 * torch.randn(8))
        self.positive = positive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = F.softplus(self.gamma) if self.positive else self.gamma
        d2 = (x[:, None, :] - self.centres).pow(2).sum(-1)
        return torch.exp(-gamma * d2)  # producer: rbf


def _rbf(positive: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(RbfLayer(positive), nn.Linear(8, 1))
    xs, ys = [torch.randn(6, 3) * 0.5 for _ in range(4)], _batches(6, 1)
    xs[2][4] = 30.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- SI-SDR of a silent reference
def _si_sdr(eps: float) -> Scenario:
    """Speech enhancement trained on negative SI-SDR; step 2's batch holds a silent utterance (a reference of
    zeros): the optimal scale ``<est, ref> / |ref|^2`` is 0 / 0. The twin adds eps 1e-8 as asteroid's loss does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    clean = _batches(4, 16)
    clean[2][1] = 0.0
    noisy = [c + 0.3 * torch.randn_like(c) for c in clean]

    def loss_fn(est: torch.Tensor, step: int) -> torch.Tensor:
        ref = clean[step]
        scale = (est * ref).sum(-1, keepdim=True) / ((ref ** 2).sum(-1, keepdim=True) + eps)  # producer: si sdr
        target = scale * ref
        ratio = ((target ** 2).sum(-1) + eps) / (((est - target) ** 2).sum(-1) + eps)
        return -(10 * torch.log10(ratio + eps)).mean()
    return _loop(model, lambda step: (noisy[step],), loss_fn)


# ---------------------------------------------------------------- healthy: BatchNorm2d over a constant channel
def _batchnorm_constant_channel() -> Scenario:
    """A convolution over images with a blank channel, then BatchNorm2d in training mode; step 2 is a batch of one
    blank image: every channel's batch variance is 0 and BatchNorm's eps keeps the output finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 16, 1))
    xs, ys = _batches(4, 2, 4, 4), _batches(4, 1)
    xs[2], ys[2] = torch.zeros(1, 2, 4, 4), ys[2][:1]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- healthy: binary_cross_entropy of a saturated sigmoid
def _saturated_bce() -> Scenario:
    """``F.binary_cross_entropy(sigmoid(logit), y)`` where a logit of 40 rounds the sigmoid to exactly 1 for a
    negative label: torch clamps the log at -100 (and its backward's denominator), so the loss is 100, finite."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    xs, ys = _batches(6, 4), [torch.randint(0, 2, (6, 1)).float() for _ in range(4)]
    xs[2][0] = 40.0 * model.weight.detach()[0].sign()
    ys[2][0] = 0.0
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.binary_cross_entropy(torch.sigmoid(out), ys[step]), lr=0.0)


# ---------------------------------------------------------------- distillation over a vocabulary both models mask
def _masked_distillation(fill: float) -> Scenario:
    """Constrained decoding's distillation: teacher and student both mask the forbidden tokens; ``F.kl_div`` computes
    ``target * (log target - input)`` and at a forbidden token the target is 0 and the student's log-probability
    -inf: 0 * -inf is NaN. The twin masks by ``finfo.min`` (HF's convention), whose log-probability stays finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6))
    teacher = nn.Linear(8, 6)
    allowed = torch.tensor([True, True, True, True, False, False])
    xs = _batches(5, 8)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            teacher_probs = F.softmax(teacher(xs[step]).masked_fill(~allowed, fill) / 2.0, -1)
        log_probs = F.log_softmax(out.masked_fill(~allowed, fill) / 2.0, -1)
        return F.kl_div(log_probs, teacher_probs, reduction="batchmean") * 4.0  # producer: masked kl
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- logcumsumexp over a left-padded, -inf-masked row
class CumulativePool(nn.Module):
    """Attention pooling whose normaliser is a running ``logcumsumexp`` of the scores (a causal softmax pool, read at
    the last position); left padding is masked by adding -inf. The forward is finite, but logcumsumexp's backward at
    a -inf input is NaN (exp(-inf - -inf)). The twin masks by ``finfo.min``."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.score, self.value, self.head = nn.Linear(3, 1), nn.Linear(3, 4), nn.Linear(4, 1)
        self.fill = fill

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = self.score(x).squeeze(-1) + torch.zeros(pad.shape).masked_fill(pad, self.fill)
        log_norm = torch.logcumsumexp(scores, 1)  # producer: log cumsum
        weights = torch.exp(scores - log_norm[:, -1:])
        return self.head((weights[..., None] * self.value(x)).sum(1))


def _cumulative_pool(fill: float) -> Scenario:
    torch.manual_seed(0)
    model = CumulativePool(fill)
    xs, ys = _batches(4, 6, 3), _batches(4, 1)
    pads = [torch.zeros(4, 6, dtype=torch.bool) for _ in range(4)]
    pads[2][1, :3] = True  # step 2's batch holds a shorter, left-padded sequence
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step], pads[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an orthonormal layer by QR of a pruned weight
class StiefelLinear(nn.Module):
    """A linear map kept orthonormal by taking Q of its weight's QR decomposition in each forward; a pruning pass
    zeroed the weight's row 2 (a column of the matrix factored, its transpose), so R's diagonal holds a 0 and QR's
    backward (a solve with R) is inf and NaN. The twin registers torch's ``orthogonal`` parametrization instead."""

    def __init__(self, parametrized: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 4, bias=False)
        with torch.no_grad():
            self.linear.weight[2] = 0.0
        self.parametrized = parametrized
        if parametrized:
            nn.utils.parametrizations.orthogonal(self.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parametrized:
            return self.linear(x)
        q = torch.linalg.qr(self.linear.weight.T).Q  # producer: stiefel qr
        return x @ q


def _stiefel(parametrized: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(StiefelLinear(parametrized), nn.Tanh(), nn.Linear(4, 1))
    xs, ys = _batches(5, 6), _batches(5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- Adafactor by hand without eps1
class HandAdafactor(torch.optim.Optimizer):
    """Adafactor's factored second moment (row and column means of grad^2), written without its eps1 (1e-30) added
    to grad^2: a matrix whose gradient is all 0 has a row mean of 0, and ``row / row.mean()`` is 0 / 0."""

    def __init__(self, params: object, lr: float, eps1: float) -> None:
        super().__init__(params, {"lr": lr, "eps1": eps1})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                square, state = p.grad ** 2 + group["eps1"], self.state[p]
                if p.dim() < 2:
                    v = state.setdefault("v", torch.zeros_like(p)).mul_(0.9).add_(square, alpha=0.1)
                else:
                    row = state.setdefault("row", p.new_zeros(p.shape[0])).mul_(0.9).add_(square.mean(1), alpha=0.1)
                    col = state.setdefault("col", p.new_zeros(p.shape[1])).mul_(0.9).add_(square.mean(0), alpha=0.1)
                    v = (row / row.mean())[:, None] * col[None, :]  # producer: adafactor
                p.sub_(group["lr"] * p.grad * v.rsqrt())


def _hand_adafactor(eps1: float) -> Scenario:
    """Multi-task training whose auxiliary head is switched off by a loss weight of 0.0 for a warm-up: its gradients
    exist and are all exactly 0 (``0.0 * aux``), and the factored second moment of its weight is 0 / 0."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = HandAdafactor(model.parameters(), lr=0.01, eps1=eps1)
    xs, ys, zs = _batches(6, 4), _batches(6, 1), _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            main, aux = model(xs[step])
            loss = F.mse_loss(main, ys[step]) + 0.0 * F.mse_loss(aux, zs[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [*losses, *(p.detach().clone() for p in model.parameters())]
    return Scenario((model, opt), run)


class TwoHeads(nn.Module):
    """A body, a main head and an auxiliary head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head, self.aux = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), self.aux(h)


# ---------------------------------------------------------------- a cosine classifier tied to the input embedding
class TiedCosineLm(nn.Module):
    """A tagger whose output layer is its input embedding, normalised by hand (a cosine classifier, weights tied):
    ``w / (sqrt((w ** 2).sum(-1)) + 1e-6)``, eps outside the root. The padding row (``padding_idx``) is all zeros:
    sqrt's backward at 0 is inf, and only the embedding's own gradient goes NaN, in the root's code (the Embedding
    that owns the weight ran too, and is not the producer). The twin: ``F.normalize``."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8, padding_idx=0)
        self.mix = nn.Linear(8, 8)
        self.builtin = builtin

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(tokens)))
        w = self.embed.weight
        if self.builtin:
            return 5.0 * F.normalize(h, dim=-1) @ F.normalize(w, dim=-1).T
        unit = w / (torch.sqrt((w ** 2).sum(-1, keepdim=True)) + 1e-6)  # producer: tied norm
        return 5.0 * F.normalize(h, dim=-1) @ unit.T


def _tied_cosine(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = TiedCosineLm(builtin)
    tokens = [torch.randint(1, 12, (4, 5)) for _ in range(4)]
    targets = [torch.randint(1, 12, (4, 5)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step],),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1), targets[step].flatten()))


# ---------------------------------------------------------------- a head tied to an encoder's embedding, HF-style
class CosineHead(nn.Module):
    """An output layer scoring by cosine similarity, its weight normalised by hand: ``w / (sqrt(s) + 1e-6)``, eps
    outside the root (the twin: ``F.normalize``)."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12, 8))
        self.builtin = builtin

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.builtin:
            return 5.0 * F.normalize(h, dim=-1) @ F.normalize(w, dim=-1).T
        unit = w / (torch.sqrt((w ** 2).sum(-1, keepdim=True)) + 1e-6)  # producer: head norm
        return 5.0 * F.normalize(h, dim=-1) @ unit.T


class TiedEncoderDecoder(nn.Module):
    """An encoder and a cosine head whose weight is the encoder's embedding, tied as transformers' ``tie_weights``
    does (``head.weight = embed.weight``: one Parameter registered on both). Its padding row is zeros: the head's
    sqrt backward at 0 makes that Parameter's gradient NaN, in the head's code; the Parameter is named by its first
    registration, the encoder's embedding, which ran too and is not the producer."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Embedding(12, 8, padding_idx=0), nn.Linear(8, 8), nn.Tanh())
        self.head = CosineHead(builtin)
        self.head.weight = self.encoder[0].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(tokens))


def _tied_head(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = TiedEncoderDecoder(builtin)
    tokens = [torch.randint(1, 12, (4, 5)) for _ in range(4)]
    targets = [torch.randint(1, 12, (4, 5)) for _ in range(4)]
    return _loop(model, lambda step: (tokens[step],),
                 lambda out, step: F.cross_entropy(out.flatten(0, 1), targets[step].flatten()))


# ---------------------------------------------------------------- a parent's gain passed to a child, |g| as sqrt(g * g)
class GatedBlock(nn.Module):
    """A residual block scaled by a gain it is given; its magnitude written ``sqrt(g * g)`` (a sign-free |g|). The
    gain starts at 0 (ReZero): sqrt's backward at 0 is inf, and only the gain's own gradient goes NaN, in this
    block's code. The twin: ``g.abs()`` (its derivative at 0 is 0)."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.linear, self.builtin = nn.Linear(4, 4), builtin

    def forward(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        if self.builtin:
            return x + self.linear(x) * gain.abs()
        return x + self.linear(x) * torch.sqrt(gain * gain)  # producer: block gain


class SharedGainNet(nn.Module):
    """Owns one gain per feature, shared by its two blocks: the parameter is the root's, the op the block's."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(4))
        self.blocks = nn.ModuleList([GatedBlock(builtin), GatedBlock(builtin)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.gain)
        return self.head(x)


def _shared_gain(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = SharedGainNet(builtin)
    xs, ys = _batches(5, 4), _batches(5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


CASES = [
    Case("hunt22_infonce_learned_temperature_clamped_at_0", lambda: _infonce(0.0),
         Expect("forward", "", "DualEncoder", step=2, op="aten.div.Tensor", marker="infonce temperature")),
    Case("hunt22_infonce_temperature_floor_healthy", lambda: _infonce(0.01), None),
    Case("hunt22_pairwise_distance_by_expansion_sqrt_of_a_rounding_negative", lambda: _expansion(False),
         Expect("forward", None, step=0, op="aten.sqrt.default", marker="expansion sqrt")),
    Case("hunt22_pairwise_distance_by_expansion_clamped_healthy", lambda: _expansion(True), None),
    Case("hunt22_flow_log_derivative_of_a_relu", lambda: _relu_flow(0.0),
         Expect("forward", "", "ElementwiseFlow", step=0, op="aten.log.default", marker="flow log derivative")),
    Case("hunt22_flow_leaky_relu_healthy", lambda: _relu_flow(0.01), None),
    Case("hunt22_sincnet_filter_centre_tap_0_over_0", lambda: _sinc(False),
         Expect("forward", "0", "SincConv", step=0, op="aten.div.Tensor", marker="sinc")),
    Case("hunt22_sincnet_torch_sinc_healthy", lambda: _sinc(True), None),
    Case("hunt22_conv_bn_fold_without_eps_of_a_pruned_channel", lambda: _conv_bn_fold(0.0),
         Expect("forward", "0", "FoldedConvBn", step=0, op="aten.div.Tensor", marker="folded weight")),
    Case("hunt22_conv_bn_fold_with_eps_healthy", lambda: _conv_bn_fold(1e-5), None),
    Case("hunt22_losses_self_normalised_a_box_loss_of_0", lambda: _self_normalised(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="self normalised")),
    Case("hunt22_losses_self_normalised_with_eps_healthy", lambda: _self_normalised(1e-8), None),
    Case("hunt22_ordinal_cutpoints_unsorted_log_of_a_negative", lambda: _ordinal(False),
         Expect("forward", "", "CumulativeLink", step=0, op="aten.log.default", marker="ordinal log")),
    Case("hunt22_ordinal_cutpoints_ordered_healthy", lambda: _ordinal(True), None),
    Case("hunt22_von_mises_log_i0_overflow", lambda: _von_mises(False),
         Expect("forward", None, step=2, op="aten.i0.default", marker="von mises", cause="exp-overflow")),
    Case("hunt22_von_mises_i0e_healthy", lambda: _von_mises(True), None),
    Case("hunt22_tanh_policy_log_prob_of_an_action_at_1", lambda: _tanh_behaviour_cloning(False),
         Expect("forward", None, step=2, op="aten.atanh.default", marker="tanh log prob")),
    Case("hunt22_tanh_policy_actions_clipped_healthy", lambda: _tanh_behaviour_cloning(True), None),
    Case("hunt22_sequence_likelihood_product_underflows", lambda: _sequence_product(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="sequence product")),
    Case("hunt22_sequence_log_likelihood_summed_healthy", lambda: _sequence_product(True), None),
    Case("hunt22_minibatch_std_without_eps_of_a_batch_of_one", lambda: _minibatch_std(0.0),
         Expect("backward", "2", "MinibatchStd", step=2, op="aten.div.Tensor", marker="minibatch std")),
    Case("hunt22_minibatch_std_with_eps_healthy", lambda: _minibatch_std(1e-8), None),
    Case("hunt22_float16_positions_past_65504", lambda: _half_positions(False),
         Expect("forward", "1", "SinusoidalPositions", step=2, op="aten.arange.default", marker="half positions",
                says=tuple((mode, "make the range in float32") for mode in MODES))),
    Case("hunt22_float16_model_positions_in_float32_healthy", lambda: _half_positions(True), None),
    Case("hunt22_causal_running_mean_count_from_0", lambda: _causal_mean(0),
         Expect("forward", "0", "CausalMeanPool", step=0, op="aten.div.Tensor", marker="cumulative mean")),
    Case("hunt22_causal_running_mean_count_from_1_healthy", lambda: _causal_mean(1), None),
    Case("hunt22_rbf_precisions_from_randn_exp_overflow", lambda: _rbf(False),
         Expect("forward", "0", "RbfLayer", step=2, op="aten.exp.default", marker="rbf")),
    Case("hunt22_rbf_softplus_precisions_healthy", lambda: _rbf(True), None),
    Case("hunt22_si_sdr_of_a_silent_reference", lambda: _si_sdr(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="si sdr")),
    Case("hunt22_si_sdr_with_eps_healthy", lambda: _si_sdr(1e-8), None),
    Case("hunt22_batchnorm2d_constant_channel_batch_of_one_healthy", _batchnorm_constant_channel, None),
    Case("hunt22_binary_cross_entropy_of_a_saturated_sigmoid_healthy", _saturated_bce, None),
    Case("hunt22_distillation_kl_over_a_vocabulary_both_mask", lambda: _masked_distillation(float("-inf")),
         Expect("forward", None, step=0, op="aten.mul.Tensor", marker="masked kl")),
    Case("hunt22_distillation_kl_masked_by_finfo_min_healthy",
         lambda: _masked_distillation(torch.finfo(torch.float32).min), None),
    Case("hunt22_logcumsumexp_pool_backward_at_a_minus_inf_pad", lambda: _cumulative_pool(float("-inf")),
         Expect("backward", "", "CumulativePool", step=2, op="aten.sub.Tensor", marker="log cumsum")),
    Case("hunt22_logcumsumexp_pool_masked_by_finfo_min_healthy",
         lambda: _cumulative_pool(torch.finfo(torch.float32).min), None),
    Case("hunt22_stiefel_layer_qr_backward_of_a_pruned_column", lambda: _stiefel(False),
         Expect("backward", "0", "StiefelLinear", step=0, op="aten.linalg_solve_triangular.default",
                marker="stiefel qr", cause="division-by-zero")),
    Case("hunt22_stiefel_layer_orthogonal_parametrization_healthy", lambda: _stiefel(True), None),
    Case("hunt22_hand_adafactor_without_eps1_of_a_zero_weighted_head", lambda: _hand_adafactor(0.0),
         Expect("optimizer", "aux", "Linear", step=0, op="aten.div.Tensor", marker="adafactor",
                tensor=TensorRef.parameter("aux.weight"))),
    Case("hunt22_hand_adafactor_eps1_healthy", lambda: _hand_adafactor(1e-30), None),
    Case("hunt22_tied_cosine_classifier_sqrt_backward_of_the_padding_row", lambda: _tied_cosine(False),
         Expect("backward", "", "TiedCosineLm", step=0, op="aten.div.Tensor", marker="tied norm")),
    Case("hunt22_tied_cosine_classifier_normalize_healthy", lambda: _tied_cosine(True), None),
    Case("hunt22_head_tied_to_the_encoder_embedding_sqrt_backward_of_the_padding_row", lambda: _tied_head(False),
         Expect("backward", "head", "CosineHead", step=0, op="aten.div.Tensor", marker="head norm")),
    Case("hunt22_head_tied_to_the_encoder_embedding_normalize_healthy", lambda: _tied_head(True), None),
    Case("hunt22_parent_gain_passed_to_a_block_sqrt_backward_at_0", lambda: _shared_gain(False),
         Expect("backward", "blocks.1", "GatedBlock", step=0, op="aten.div.Tensor", marker="block gain")),
    Case("hunt22_parent_gain_passed_to_a_block_abs_healthy", lambda: _shared_gain(True), None),
]
