"""Reported NaN incidents of corners the other rows hold little of, each with its healthy twin (hunt22b).

Diffusion: the noise recovered from an x0-prediction, ``(x_t - sqrt(ab) x0) / sqrt(1 - ab)``, at t = 0 of a schedule
whose first beta is 0 (alpha_bar is exactly 1). Graph nets: a GCN's symmetric normalisation ``deg ** -0.5`` without
self loops, over a graph with an isolated node. RL: GAE advantages normalised by the std of a last rollout of one
transition; the entropy bonus ``-(p * log p)`` of a policy that became one-hot. Metric learning: a cosine triplet loss
written by hand over an embedding a ReLU zeroed. Audio: a spectral loss whose magnitude is ``sqrt(re^2 + im^2)`` of a
vocoder's gated output (sqrt's backward at 0). Shared weights and calls: an RNN cell called in a Python loop that
normalises its state, reset to zeros at a new episode; an encoder reused by two models, watched together. Calls: a
model called with keyword arguments that returns a dataclass, whose child (called by keyword too) takes a masked mean
over a sample that is all padding. Parameters created lazily: an ``nn.LazyLinear`` materialised inside the watch, whose
weight's gradient goes NaN through its neighbour's sqrt. In-place ops on a parameter's view: Poisson rates kept
non-negative by ``rate.data.clamp_(min=0)`` in the loop, then ``log(rate)`` in the forward. v-prediction's loss
weight ``snr / (snr + 1)`` at t = 0 (SNR 1 / 0); volume rendering whose last interval is written inf (0 * inf where a
density is 0). A parameter used by code other than its owner's: a parent's orthogonality penalty on its child's
identity-initialised weight (sqrt's backward at 0); the root's gate applied by a user's forward hook on a child, and by
a pre-hook (the hooked module is named); a forward hook on the root itself (the root is named, ``""``: its call ran
the hook, though torch runs it after the watch took the root off its stack).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- diffusion: the noise recovered at t = 0
class X0Diffusion(nn.Module):
    """A denoiser that predicts x0; the loss is taken on the noise it implies, ``(x_t - sqrt(ab) x0) / sqrt(1 - ab)``.
    A linear beta schedule written from 0 makes alpha_bar[0] exactly 1: at t = 0 that is 0 / 0. The twin starts the
    schedule at 1e-4, as DDPM does."""

    def __init__(self, beta_start: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4))
        self.register_buffer("alpha_bar", torch.cumprod(1 - torch.linspace(beta_start, 0.02, 10), 0))

    def forward(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar[t][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        x0_hat = self.net(torch.cat([x_t, t[:, None].float() / 10], 1))
        return (x_t - ab.sqrt() * x0_hat) / (1 - ab).sqrt()  # producer: noise from x0


def _diffusion(beta_start: float) -> Scenario:
    torch.manual_seed(0)
    model = X0Diffusion(beta_start)
    xs, noises = _batches(6, 4), _batches(6, 4)
    ts = [torch.tensor([3, 7, 5, 9, 1, 4]), torch.tensor([2, 8, 6, 1, 3, 5]), torch.tensor([4, 0, 7, 2, 9, 6]),
          torch.tensor([1, 5, 0, 8, 3, 2])]
    return _loop(model, lambda step: (xs[step], noises[step], ts[step]),
                 lambda out, step: F.mse_loss(out, noises[step]))


# ---------------------------------------------------------------- GCN: deg ** -0.5 of an isolated node
class GcnLayer(nn.Module):
    """``D^-1/2 A D^-1/2 X W``; written without self loops, an isolated node's degree is 0 and ``0 ** -0.5`` is inf
    (then 0 * inf in the product). The twin adds the self loops, as Kipf and Welling do."""

    def __init__(self, loops: bool) -> None:
        super().__init__()
        self.linear, self.loops = nn.Linear(4, 4), loops

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        if self.loops:
            adj = adj + torch.eye(adj.shape[0])
        norm = adj.sum(1).pow(-0.5)  # producer: gcn degree
        return torch.relu(norm[:, None] * adj * norm[None, :] @ self.linear(x))


class Gcn(nn.Module):
    def __init__(self, loops: bool) -> None:
        super().__init__()
        self.conv, self.head = GcnLayer(loops), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x, adj))


def _gcn(loops: bool) -> Scenario:
    torch.manual_seed(0)
    model = Gcn(loops)
    graphs = []
    ring = torch.roll(torch.eye(6), 1, 1)
    for step in range(4):
        adj = ((torch.rand(6, 6) < 0.3).float().triu(1) + ring).clamp(max=1.0)
        adj = (adj + adj.T).clamp(max=1.0)
        if step == 2:
            adj[4] = 0.0  # a molecule with a lone ion: the one isolated node
            adj[:, 4] = 0.0
        graphs.append(adj)
    xs, ys = _batches(6, 4), _batches(6, 1)
    return _loop(model, lambda step: (xs[step], graphs[step]), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- GAE advantages normalised over one transition
def _gae(unbiased: bool) -> Scenario:
    """An actor-critic; each rollout's GAE advantages are normalised by their std. The last rollout of an epoch holds
    one transition: ``std`` with Bessel's correction over one value is NaN. The twin: ``unbiased=False`` and eps."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam([*policy.parameters(), *critic.parameters()], lr=1e-3)
    lengths = [5, 5, 1, 5]
    states = [torch.randn(n + 1, 4) for n in lengths]
    actions = [torch.randint(0, 3, (n,)) for n in lengths]
    rewards = [torch.randn(n) for n in lengths]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            values = critic(states[step]).squeeze(-1)
            with torch.no_grad():
                deltas = rewards[step] + 0.99 * values[1:] - values[:-1]
                adv, running = torch.zeros_like(deltas), torch.zeros(())
                for i in reversed(range(len(deltas))):
                    running = deltas[i] + 0.99 * 0.95 * running
                    adv[i] = running
                returns = adv + values[:-1]
                if unbiased:
                    adv = (adv - adv.mean()) / adv.std()  # producer: gae std
                else:
                    adv = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-8)
            logp = F.log_softmax(policy(states[step][:-1]), -1).gather(1, actions[step][:, None]).squeeze(1)
            loss = -(adv * logp).mean() + F.mse_loss(values[:-1], returns)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((policy, critic, opt), run)


# ---------------------------------------------------------------- the entropy of a policy that became one-hot
def _entropy(builtin: bool) -> Scenario:
    """A policy-gradient loss with an entropy bonus ``-(p * log p).sum()`` by hand; a state the policy is certain of
    (a logit margin past 104) makes a probability exactly 0: ``log 0`` is -inf, and ``0 * -inf`` NaN. The twin:
    ``Categorical(logits=...).entropy()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    xs = _batches(6, 4)
    xs[2][3] *= 1000.0  # an observation in raw units, unnormalised
    actions = [torch.randint(0, 3, (6,)) for _ in range(4)]
    returns = _batches(6)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        logp = F.log_softmax(logits, -1)
        chosen = logp.gather(1, actions[step][:, None]).squeeze(1)
        if builtin:
            entropy = Categorical(logits=logits).entropy()
        else:
            p = F.softmax(logits, -1)
            entropy = -(p * torch.log(p)).sum(-1)  # producer: policy entropy
        return -(returns[step] * chosen).mean() - 0.01 * entropy.mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a cosine triplet loss over a zeroed embedding
def _cosine_triplet(builtin: bool) -> Scenario:
    """A triplet loss on cosine distance written ``1 - a.b / (|a| |b|)``; the encoder ends in a ReLU and a negative
    sample far from the others gets an all-zero embedding: 0 / 0. The twin: ``F.cosine_similarity`` (its eps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False), nn.ReLU())
    anchors, positives, negatives = _batches(4, 5), _batches(4, 5), _batches(4, 5)
    negatives[1][2] = 0.0  # a blank sample mined as a negative

    def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if builtin:
            return F.cosine_similarity(a, b, dim=-1)
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # producer: cosine triplet

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            a, p, n = model(anchors[step]), model(positives[step]), model(negatives[step])
            loss = F.relu(cosine(a, n) - cosine(a, p) + 0.2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a spectral loss on a gated vocoder's output
class GatedVocoder(nn.Module):
    """Upsamples frames to a waveform and zeroes the samples past each clip's length (the padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 64))

    def forward(self, frames: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        wave = self.net(frames)
        return wave * (torch.arange(64) < length[:, None]).float()


def _spectral(eps: float) -> Scenario:
    """The magnitude of the STFT written ``sqrt(re^2 + im^2)``; at step 2 a clip is 16 samples long and the frames
    past it are exactly 0: sqrt's backward there is inf, times the zero gradient of the gate, NaN. The twin adds eps
    under the root."""
    torch.manual_seed(0)
    model = GatedVocoder()
    frames, targets = _batches(3, 8), _batches(3, 64)
    lengths = [torch.tensor([64, 60, 64]), torch.tensor([50, 64, 64]), torch.tensor([64, 16, 64]),
               torch.tensor([64, 64, 40])]
    window = torch.hann_window(16)

    def magnitude(wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave, 16, hop_length=4, window=window, center=False, return_complex=True)
        return torch.sqrt(spec.real ** 2 + spec.imag ** 2 + eps)  # producer: stft magnitude

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        return F.l1_loss(magnitude(out), magnitude(targets[step]))
    return _loop(model, lambda step: (frames[step], lengths[step]), loss_fn)


# ---------------------------------------------------------------- an RNN cell called in a Python loop
class NormalisedCell(nn.Module):
    """A recurrent cell that keeps its state on the unit sphere by hand, ``h / h.norm()``: a new episode resets the
    state to zeros, and the first call divides 0 by 0. The twin: ``F.normalize`` (eps)."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.input, self.hidden, self.builtin = nn.Linear(3, 6), nn.Linear(6, 6), builtin

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.builtin:
            return torch.tanh(self.input(x) + self.hidden(F.normalize(h, dim=-1)))
        h = h / h.norm(dim=-1, keepdim=True)  # producer: cell state norm
        return torch.tanh(self.input(x) + self.hidden(h))


class LoopedRnn(nn.Module):
    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.cell, self.head = NormalisedCell(builtin), nn.Linear(6, 1)

    def forward(self, xs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = []
        for x in xs.unbind(1):
            h = self.cell(x, h)
            outputs.append(self.head(h))
        return torch.cat(outputs, 1), h


def _looped_cell(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = LoopedRnn(builtin)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(2, 5, 3), _batches(2, 5)

    def run() -> list[torch.Tensor]:
        losses, h = [], torch.randn(2, 6)
        for step in range(4):
            if step == 2:
                h = torch.zeros(2, 6)  # a new episode
            out, h = model(xs[step], h.detach())
            loss = F.mse_loss(out, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- called with keywords, returning a dataclass
@dataclass
class TaggerOutput:
    logits: torch.Tensor
    pooled: torch.Tensor


class MaskedMean(nn.Module):
    """``(h * mask).sum() / mask.sum()``: a sample that is all padding divides 0 by 0. The twin clamps the count."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.floor = floor

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        m = mask[..., None].float()
        return (h * m).sum(1) / m.sum(1).clamp(min=self.floor)  # producer: masked mean


class Tagger(nn.Module):
    def __init__(self, floor: float) -> None:
        super().__init__()
        self.embed, self.pool, self.head = nn.Embedding(10, 6), MaskedMean(floor), nn.Linear(6, 3)

    def forward(self, *, tokens: torch.Tensor, mask: torch.Tensor) -> TaggerOutput:
        pooled = self.pool(self.embed(tokens), mask=mask)
        return TaggerOutput(logits=self.head(pooled), pooled=pooled)


def _keyword_call(floor: float) -> Scenario:
    torch.manual_seed(0)
    model = Tagger(floor)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = [torch.randint(0, 10, (3, 5)) for _ in range(4)]
    masks = [torch.ones(3, 5, dtype=torch.bool) for _ in range(4)]
    masks[1][2] = False  # a sample whose every token was truncated away
    labels = [torch.randint(0, 3, (3,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = model(tokens=tokens[step], mask=masks[step])
            loss = F.cross_entropy(out.logits, labels[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a LazyLinear materialised inside the watch
class HandNormalise(nn.Module):
    """``x / (sqrt((x * x).sum()) + 1e-6)``, eps outside the root: an all-zero row is finite forward, and sqrt's
    backward at 0 is inf (0 * inf: NaN). The twin: ``F.normalize``."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.builtin = builtin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.builtin:
            return F.normalize(x, dim=-1)
        return x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6)  # producer: lazy neighbour norm


def _lazy(builtin: bool) -> Scenario:
    """The first layer is ``nn.LazyLinear`` (no bias): its weight is an uninitialised parameter when the watch starts
    and is made at the first forward. A zero input row at step 1 gives a zero row after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(6, bias=False), HandNormalise(builtin), nn.Linear(6, 1))
    xs, ys = _batches(4, 5), _batches(4, 1)
    xs[1][2] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- an encoder reused by two models
class UnitEncoder(nn.Module):
    """``relu(W x) / |relu(W x)|`` by hand: an input the ReLU zeroes entirely gives 0 / 0. The twin: F.normalize."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.linear, self.builtin = nn.Linear(4, 6), builtin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.linear(x))
        if self.builtin:
            return F.normalize(h, dim=-1)
        return h / h.norm(dim=-1, keepdim=True)  # producer: shared encoder


def _two_models(builtin: bool) -> Scenario:
    """A classifier and a regressor share one encoder (multi-task, two models, one optimizer); the regressor's batch
    at step 2 holds an input the encoder's ReLU zeroes."""
    torch.manual_seed(0)
    encoder = UnitEncoder(builtin)
    classifier = nn.Sequential(encoder, nn.Linear(6, 3))
    regressor = nn.Sequential(encoder, nn.Linear(6, 1))
    opt = torch.optim.SGD([*classifier.parameters(), regressor[1].weight, regressor[1].bias], lr=0.01)
    xa, xb, ya, yb = _batches(4, 4), _batches(4, 4), [torch.randint(0, 3, (4,)) for _ in range(4)], _batches(4, 1)
    with torch.no_grad():
        encoder.linear.weight[:, 0] = encoder.linear.weight[:, 0].abs() + 0.5
        encoder.linear.bias.fill_(1.0)
    for x in (*xa, *xb):
        x[:, 0] = x[:, 0].abs() + 1.0  # the first feature is a positive count
    xb[2][1] = torch.tensor([-30.0, 0.0, 0.0, 0.0])  # a corrupt record, its count negative

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(classifier(xa[step]), ya[step]) + F.mse_loss(regressor(xb[step]), yb[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((classifier, regressor, opt), run)


# ---------------------------------------------------------------- rates clamped in place, then their log
class PoissonRates(nn.Module):
    """Per-class Poisson rates, kept non-negative by the loop's in-place clamp of the parameter's data; the
    log-likelihood takes ``log(rate)``. A rate the step pushed below 0 is clamped to exactly 0: log 0 is -inf. The
    twin clamps at 1e-6."""

    def __init__(self) -> None:
        super().__init__()
        self.rate = nn.Parameter(torch.tensor([2.0, 0.01, 1.5, 4.0]))

    def forward(self, labels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rate = self.rate[labels]
        return counts * torch.log(rate) - rate - torch.lgamma(counts + 1)  # producer: poisson log rate


def _clamped_rates(floor: float) -> Scenario:
    torch.manual_seed(0)
    model = PoissonRates()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = [torch.tensor([0, 1, 2, 1, 1, 2]), torch.tensor([0, 1, 3, 3, 0, 2]), torch.tensor([1, 0, 2, 3, 1, 2]),
              torch.tensor([3, 1, 2, 0, 1, 2])]
    counts = [torch.tensor([2.0, 0.0, 1.0, 0.0, 0.0, 2.0]), torch.tensor([1.0, 2.0, 4.0, 3.0, 2.0, 1.0]),
              torch.tensor([0.0, 2.0, 1.0, 4.0, 0.0, 1.0]), torch.tensor([5.0, 0.0, 2.0, 1.0, 0.0, 2.0])]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = -model(labels[step], counts[step]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.rate.data[1:].clamp_(min=floor)  # the first class's rate is pinned from outside
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- v-prediction's SNR weight at t = 0
def _v_prediction(beta_start: float) -> Scenario:
    """v-prediction trained with the loss weight ``snr / (snr + 1)``, ``snr = ab / (1 - ab)``; a schedule written from
    beta 0 makes alpha_bar[0] exactly 1, and at t = 0 the SNR is 1 / 0 (then inf / inf). The twin starts at 1e-4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4))
    alpha_bar = torch.cumprod(1 - torch.linspace(beta_start, 0.02, 10), 0)
    xs, noises = _batches(6, 4), _batches(6, 4)
    ts = [torch.tensor([3, 7, 5, 9, 1, 4]), torch.tensor([2, 8, 6, 1, 3, 5]), torch.tensor([4, 0, 7, 2, 9, 6]),
          torch.tensor([1, 5, 0, 8, 3, 2])]

    def batch(step: int) -> tuple[torch.Tensor]:
        ab = alpha_bar[ts[step]][:, None]
        x_t = ab.sqrt() * xs[step] + (1 - ab).sqrt() * noises[step]
        return (torch.cat([x_t, ts[step][:, None].float() / 10], 1),)

    def loss_fn(v_hat: torch.Tensor, step: int) -> torch.Tensor:
        ab = alpha_bar[ts[step]][:, None]
        v = ab.sqrt() * noises[step] - (1 - ab).sqrt() * xs[step]
        snr = ab / (1 - ab)  # producer: v snr
        return (snr / (snr + 1) * (v_hat - v) ** 2).mean()
    return _loop(model, batch, loss_fn)


# ---------------------------------------------------------------- volume rendering: the last interval written inf
class VolumeRenderer(nn.Module):
    """NeRF's compositing: ``alpha = 1 - exp(-sigma * delta)``, transmittance the exclusive cumprod of ``1 - alpha``;
    the last sample's interval is written ``inf`` ("the ray runs on forever") where NeRF writes 1e10: a sample whose
    density the ReLU made 0 there gives 0 * inf. The twin: 1e10."""

    def __init__(self, far: float) -> None:
        super().__init__()
        self.field = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 4))
        self.far = far

    def forward(self, points: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        raw = self.field(points)
        sigma, rgb = torch.relu(raw[..., 0]), torch.sigmoid(raw[..., 1:])
        delta = torch.cat([depths[:, 1:] - depths[:, :-1], torch.full_like(depths[:, :1], self.far)], 1)
        alpha = 1 - torch.exp(-sigma * delta)  # producer: volume interval
        transmittance = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], 1), 1)[:, :-1]
        return ((transmittance * alpha)[..., None] * rgb).sum(1)


def _volume(far: float) -> Scenario:
    torch.manual_seed(0)
    model = VolumeRenderer(far)
    with torch.no_grad():
        model.field[2].bias[0] = -0.5  # densities start near 0, as NeRF's do in empty space
    points = [torch.randn(4, 6, 3) for _ in range(4)]
    depths = [torch.linspace(2.0, 6.0, 6).expand(4, 6) for _ in range(4)]
    colours = _batches(4, 3)
    return _loop(model, lambda step: (points[step], depths[step]), lambda out, step: F.mse_loss(out, colours[step]))


# ---------------------------------------------------------------- an orthogonality penalty on a child's weight
class OrthoMixer(nn.Module):
    """A mixing layer kept near orthogonal by a penalty the parent computes on the child's weight, the Frobenius norm
    of ``W W^T - I`` written ``sqrt(sum(d ** 2))``. The child is initialised to the identity (``nn.init.eye_``): the
    difference is exactly 0 and sqrt's backward there is inf: the weight's gradient is NaN, in the parent's code. The
    twin: ``torch.linalg.matrix_norm`` (its gradient at 0 is 0)."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.mix, self.head, self.builtin = nn.Linear(4, 4), nn.Linear(4, 1), builtin
        nn.init.eye_(self.mix.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.mix.weight
        d = w @ w.T - torch.eye(4)
        out = self.head(torch.tanh(self.mix(x)))
        if self.builtin:
            return out, torch.linalg.matrix_norm(d)
        return out, torch.sqrt((d ** 2).sum())  # producer: ortho penalty


def _ortho(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = OrthoMixer(builtin)
    xs, ys = _batches(5, 4), _batches(5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out[0], ys[step]) + 0.1 * out[1])


# ---------------------------------------------------------------- a user's forward hook gating by the root's parameter
class HookGated(nn.Module):
    """A gate the root owns, applied by a forward hook the user registered on the body's first layer (an adapter
    added without editing the body): ``out + out * sqrt(g * g)``, a sign-free |g|. The gate starts at 0: sqrt's
    backward is inf there and the gate's gradient NaN, in the hook, run by that layer's call. The twin: ``g.abs()``."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(4))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        self.builtin = builtin
        self.body[0].register_forward_hook(self.adapt)

    def adapt(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if self.builtin:
            return out + out * self.gate.abs()
        return out + out * torch.sqrt(self.gate * self.gate)  # producer: hook gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _hook_gate(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = HookGated(builtin)
    xs, ys = _batches(5, 4), _batches(5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a user's pre-hook, and hooks on the root itself
class PreHookGated(nn.Module):
    """The root's gate applied to the head's input by a forward pre-hook the user registered on the head:
    ``x + x * sqrt(g * g)``; the gate starts at 0, and its gradient is NaN, in the hook that the head's call ran."""

    def __init__(self, builtin: bool) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(4))
        self.body, self.head, self.builtin = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1), builtin
        self.head.register_forward_pre_hook(self.adapt)

    def adapt(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor]:
        (x,) = args
        if self.builtin:
            return (x + x * self.gate.abs(),)
        return (x + x * torch.sqrt(self.gate * self.gate),)  # producer: pre-hook gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _pre_hook_gate(builtin: bool) -> Scenario:
    torch.manual_seed(0)
    model = PreHookGated(builtin)
    xs, ys = _batches(5, 4), _batches(5, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


def _root_hook(builtin: bool, backward: bool) -> Scenario:
    """A forward hook on the model itself (a calibration added from outside): ``out * sqrt(t * t)`` with a temperature
    parameter registered on the root and started at 0 (backward: sqrt's backward at 0), or ``out / |out|`` of a zero
    output row (forward: 0 / 0). The twins: ``t.abs()`` and ``F.normalize``. The root's call ran the hook: ``""``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.ReLU(), nn.Linear(6, 3, bias=False))
    model.register_parameter("temperature", nn.Parameter(torch.zeros(3)))
    xs, ys = _batches(5, 4), _batches(5, 3)
    xs[1][2] = 0.0  # a blank record: every layer's output is 0

    def calibrate(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if backward:
            if builtin:
                return out + out * module.temperature.abs()
            return out + out * torch.sqrt(module.temperature * module.temperature)  # producer: root hook gate
        if builtin:
            return F.normalize(out, dim=-1)
        return out / out.norm(dim=-1, keepdim=True)  # producer: root hook norm

    model.register_forward_hook(calibrate)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


CASES = [
    Case("hunt22b_diffusion_noise_from_x0_at_t0_of_a_schedule_from_0", lambda: _diffusion(0.0),
         Expect("forward", "", "X0Diffusion", step=2, op="aten.div.Tensor", marker="noise from x0")),
    Case("hunt22b_diffusion_schedule_from_1e_4_healthy", lambda: _diffusion(1e-4), None),
    Case("hunt22b_gcn_degree_normalisation_of_an_isolated_node", lambda: _gcn(False),
         Expect("forward", "conv", "GcnLayer", step=2, op="aten.pow.Tensor_Scalar", marker="gcn degree")),
    Case("hunt22b_gcn_with_self_loops_healthy", lambda: _gcn(True), None),
    Case("hunt22b_gae_advantages_std_of_one_transition", lambda: _gae(True),
         Expect("forward", None, step=2, op="aten.std.correction", marker="gae std")),
    Case("hunt22b_gae_advantages_biased_std_with_eps_healthy", lambda: _gae(False), None),
    Case("hunt22b_entropy_bonus_of_a_one_hot_policy", lambda: _entropy(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="policy entropy")),
    Case("hunt22b_entropy_bonus_categorical_healthy", lambda: _entropy(True), None),
    Case("hunt22b_cosine_triplet_of_a_zeroed_embedding", lambda: _cosine_triplet(False),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="cosine triplet")),
    Case("hunt22b_cosine_triplet_cosine_similarity_healthy", lambda: _cosine_triplet(True), None),
    Case("hunt22b_stft_magnitude_sqrt_backward_of_gated_silence", lambda: _spectral(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="stft magnitude")),
    Case("hunt22b_stft_magnitude_with_eps_healthy", lambda: _spectral(1e-9), None),
    Case("hunt22b_rnn_cell_in_a_python_loop_state_reset_to_zeros", lambda: _looped_cell(False),
         Expect("forward", "cell", "NormalisedCell", step=2, op="aten.div.Tensor", marker="cell state norm")),
    Case("hunt22b_rnn_cell_in_a_python_loop_normalize_healthy", lambda: _looped_cell(True), None),
    Case("hunt22b_keyword_call_dataclass_output_masked_mean_of_all_padding", lambda: _keyword_call(0.0),
         Expect("forward", "pool", "MaskedMean", step=1, op="aten.div.Tensor", marker="masked mean")),
    Case("hunt22b_keyword_call_dataclass_output_count_clamped_healthy", lambda: _keyword_call(1.0), None),
    Case("hunt22b_lazy_linear_gradient_through_a_hand_norm", lambda: _lazy(False),
         Expect("backward", "1", "HandNormalise", step=1, op="aten.div.Tensor", marker="lazy neighbour norm")),
    Case("hunt22b_lazy_linear_normalize_healthy", lambda: _lazy(True), None),
    Case("hunt22b_encoder_reused_by_two_models_zero_norm", lambda: _two_models(False),
         Expect("forward", "0", "UnitEncoder", step=2, op="aten.div.Tensor", marker="shared encoder")),
    Case("hunt22b_encoder_reused_by_two_models_normalize_healthy", lambda: _two_models(True), None),
    Case("hunt22b_rates_clamped_in_place_to_0_then_log", lambda: _clamped_rates(0.0),
         Expect("forward", "", "PoissonRates", step=1, op="aten.log.default", marker="poisson log rate")),
    Case("hunt22b_rates_clamped_in_place_to_a_floor_healthy", lambda: _clamped_rates(1e-6), None),
    Case("hunt22b_v_prediction_snr_weight_at_t0_of_a_schedule_from_0", lambda: _v_prediction(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="v snr")),
    Case("hunt22b_v_prediction_schedule_from_1e_4_healthy", lambda: _v_prediction(1e-4), None),
    Case("hunt22b_volume_rendering_last_interval_inf_times_zero_density", lambda: _volume(float("inf")),
         Expect("forward", "", "VolumeRenderer", step=0, op="aten.mul.Tensor", marker="volume interval")),
    Case("hunt22b_volume_rendering_last_interval_1e10_healthy", lambda: _volume(1e10), None),
    Case("hunt22b_parent_orthogonality_penalty_on_an_identity_child_weight", lambda: _ortho(False),
         Expect("backward", "", "OrthoMixer", step=0, op="aten.div.Tensor", marker="ortho penalty")),
    Case("hunt22b_parent_orthogonality_penalty_matrix_norm_healthy", lambda: _ortho(True), None),
    Case("hunt22b_forward_hook_gates_by_the_root_parameter_sqrt_backward_at_0", lambda: _hook_gate(False),
         Expect("backward", "body.0", "Linear", step=0, op="aten.div.Tensor", marker="hook gate")),
    Case("hunt22b_forward_hook_gates_by_the_root_parameter_abs_healthy", lambda: _hook_gate(True), None),
    Case("hunt22b_forward_pre_hook_gates_by_the_root_parameter_sqrt_backward_at_0", lambda: _pre_hook_gate(False),
         Expect("backward", "head", "Linear", step=0, op="aten.div.Tensor", marker="pre-hook gate")),
    Case("hunt22b_forward_pre_hook_gates_by_the_root_parameter_abs_healthy", lambda: _pre_hook_gate(True), None),
    Case("hunt22b_root_forward_hook_temperature_sqrt_backward_at_0", lambda: _root_hook(False, backward=True),
         Expect("backward", "", "Sequential", step=0, op="aten.div.Tensor", marker="root hook gate")),
    Case("hunt22b_root_forward_hook_temperature_abs_healthy", lambda: _root_hook(True, backward=True), None),
    Case("hunt22b_root_forward_hook_normalises_a_zero_output", lambda: _root_hook(False, backward=False),
         Expect("forward", "", "Sequential", step=1, op="aten.div.Tensor", marker="root hook norm")),
    Case("hunt22b_root_forward_hook_normalize_healthy", lambda: _root_hook(True, backward=False), None),
]
