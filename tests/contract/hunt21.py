"""Reported NaN incidents of families the other rows do not hold, each with the healthy twin its users apply (hunt21).

Loss code: an evidential classifier's ``digamma`` of a Dirichlet concentration of 0 (evidence by ReLU without the
+1); a keypoint loss by ``torch.hypot`` whose invisible keypoints are filled with the prediction (the distance's
backward at 0 is 0 / 0); a mixture density network's likelihood summed in probability space (every component's pdf
underflows on an outlier target: log of 0); ``nn.GaussianNLLLoss(eps=0)`` of a softplus variance that underflowed; an
auxiliary head "switched off" by a weight of 0.0 (``0.0 * aux`` where aux is -inf); a log-cosh loss whose cosh
overflows on an outlier residual; logit adjustment by the log of class priors counted on a training set that lacked a
class; a geolocation model's haversine distance to missing coordinates coded as (0, 0) ("Null Island"), the sqrt's
backward at 0; prototypical networks' prototype of a class with no support example (a mean of nothing).

Modules: a learned Yeo-Johnson power transform whose lambda starts at 0 (``((x + 1) ** lam - 1) / lam``); an
axis-angle pose layer (Rodrigues' formula) initialised to the identity pose, its axis ``r / |r|`` of a zero vector;
a custom row-stochastic ``register_parametrization`` whose row went all non-positive (the parametrization named,
plainly and under ``parametrize.cached()``); a running variance buffer updated by hand over a batch of one; a causal
mask built as ``-inf * triu(ones)`` (0 * -inf below the diagonal); a VAE's KL ``logvar.exp()`` left in float16 by
autocast. Loop code: an observation normaliser (``RunningMeanStd``) whose batch variance is unbiased over the one
environment still running; an EMA teacher, watched too, fed by a student whose backward went NaN (the student's
backward is named); an epsilon-greedy explorer picking an action the policy masks (strict xfail). Healthy near
misses: ``swa_utils.AveragedModel`` as an EMA teacher with ``update_bn``, and a Lookahead wrapper over SGD (slow
weights written by the loop in ``torch.no_grad``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef, TensorRole

#: A gather of a -inf masked log-probability stays benign (beam search gathers -inf scores of finished beams on
#: purpose) until a sum adds what it picked up: then the gather is named (localize/ops/origins.Picked), with the
#: picked-mask advice (explain/attention.masked_pick_cause), not the mean with the summed-mask one (gaps22; named the
#: mean in every mode before).
PICKED_MASK = "the gather is named once the mean adds up what it picked (localize/ops/origins.Picked)"


# ---------------------------------------------------------------- evidential deep learning: digamma of alpha = 0
def _evidential(offset: float) -> Scenario:
    """Dirichlet evidence by ReLU, the expected cross-entropy ``sum y (digamma(S) - digamma(alpha))``; written
    without the +1 (alpha = evidence), a class with no evidence has alpha 0 and digamma(0) is -inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = _batches(6, 4)
    ys = [torch.randint(0, 3, (6,)) for _ in range(4)]

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        alpha = F.relu(out) + offset
        strength = alpha.sum(-1, keepdim=True)
        onehot = F.one_hot(ys[step], 3).float()
        return (onehot * (torch.digamma(strength) - torch.digamma(alpha))).sum(-1).mean()  # producer: edl digamma
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- keypoints: hypot backward at a zero offset
def _keypoints(hypot: bool) -> Scenario:
    """Two keypoints per sample; an invisible keypoint's target is the prediction itself (``pred.detach()``), so it
    adds nothing: hypot(0, 0)'s backward is 0 / 0. The twin is the smoothed distance ``sqrt(dx^2 + dy^2 + eps)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    xs, targets = _batches(5, 8), [torch.rand(5, 2, 2) for _ in range(4)]
    visible = [torch.ones(5, 2, dtype=torch.bool) for _ in range(4)]
    visible[2][3, 1] = False

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        pred = out.view(-1, 2, 2)
        target = torch.where(visible[step][..., None], targets[step], pred.detach())
        d = pred - target
        if not hypot:
            return torch.sqrt(d[..., 0] ** 2 + d[..., 1] ** 2 + 1e-12).mean()
        return torch.hypot(d[..., 0], d[..., 1]).mean()  # producer: keypoint hypot
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a mixture density network summed in probability space
class Mdn(nn.Module):
    """Three Gaussian components over a scalar target."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 16), nn.Tanh())
        self.pi, self.mu, self.log_sigma = nn.Linear(16, 3), nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.pi(h), self.mu(h), self.log_sigma(h)


def _mdn(log_space: bool) -> Scenario:
    """At step 2 a target lies 100 away (a sensor glitch): every component's density underflows to 0 and the
    likelihood summed in probability space is 0, its log -inf. The twin: ``logsumexp`` of the log densities."""
    torch.manual_seed(0)
    model = Mdn()
    xs, ys = _batches(6, 3), _batches(6, 1)
    ys[2][4] = 100.0

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        logits, mu, log_sigma = out
        z = (ys[step] - mu) / log_sigma.exp()
        log_density = -0.5 * z ** 2 - log_sigma - 0.5 * math.log(2 * math.pi)
        if log_space:
            return -torch.logsumexp(F.log_softmax(logits, -1) + log_density, -1).mean()
        likelihood = (F.softmax(logits, -1) * log_density.exp()).sum(-1)
        return -torch.log(likelihood).mean()  # producer: mdn log
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- GaussianNLLLoss(eps=0) of an underflowed variance
def _gaussian_nll_loss(eps: float) -> Scenario:
    """A mean and a softplus variance; at step 2 an outlier input drives the variance's pre-activation to about
    -1000: softplus is 0, and ``nn.GaussianNLLLoss(eps=0.0)`` (set to 0 "to be exact") takes log(0). The twin keeps
    the default eps 1e-6."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    criterion = nn.GaussianNLLLoss(eps=eps)
    xs, ys = _batches(6, 4), _batches(6, 1)
    xs[2][1] = -1000.0 * model.weight.detach()[1].sign()

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        mean, var = out[:, :1], F.softplus(out[:, 1:])
        return criterion(mean, ys[step], var)  # producer: gaussian nll loss
    return _loop(model, lambda step: (xs[step],), loss_fn, lr=0.0)


# ---------------------------------------------------------------- an auxiliary head switched off by a weight of 0.0
class TwoHeads(nn.Module):
    """A main regression head and an auxiliary log-depth head only the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head, self.aux = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), self.aux(h)


def _zero_weighted_aux(skip: bool) -> Scenario:
    """``loss = main + aux_weight * aux`` with ``aux_weight = 0.0`` to disable the auxiliary task; its log of a ReLU
    depth is -inf where the depth is 0, and 0.0 * -inf is NaN. The twin adds the term only when its weight is set."""
    torch.manual_seed(0)
    model = TwoHeads()
    xs, ys, depth = _batches(6, 4), _batches(6, 1), [torch.rand(6, 1) + 0.5 for _ in range(4)]
    aux_weight = 0.0

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        main, aux_depth = out
        loss = F.mse_loss(main, ys[step])
        if skip and not aux_weight:
            return loss
        aux = F.mse_loss(torch.log(F.relu(aux_depth)), depth[step].log())  # producer: aux log depth
        return loss + aux_weight * aux
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- log-cosh loss: cosh overflows on an outlier
def _log_cosh(stable: bool) -> Scenario:
    """``log(cosh(pred - y))`` as written in most blog posts; at step 2 a target is 200 off and cosh(200) is inf in
    float32. The twin: ``d + softplus(-2d) - log 2``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    xs, ys = _batches(6, 4), _batches(6, 1)
    ys[2][0] = 200.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        d = out - ys[step]
        if stable:
            return (d + F.softplus(-2.0 * d) - math.log(2.0)).mean()
        return torch.log(torch.cosh(d)).mean()  # producer: log cosh
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- logit adjustment by a prior with a class absent
def _logit_adjustment(smoothed: bool) -> Scenario:
    """Long-tail logit adjustment: logits + log(class prior), the prior counted on the training set, where class 3
    never occurred (its log prior -inf, a mask in effect); at step 2 a batch holds class 3 and the cross-entropy is
    inf. The twin smooths the counts by 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    counts = torch.tensor([50.0, 30.0, 20.0, 0.0]) + (1.0 if smoothed else 0.0)
    log_prior = torch.log(counts / counts.sum())
    xs = _batches(6, 4)
    ys = [torch.randint(0, 3, (6,)) for _ in range(4)]
    ys[2][5] = 3

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        return F.cross_entropy(out + log_prior, ys[step])  # producer: logit adjusted
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- haversine distance to "Null Island"
def _haversine(clamped: bool) -> Scenario:
    """A geolocation head (zero-initialised output layer: it predicts (0, 0) at first) trained on the haversine
    distance; missing coordinates are coded as (0, 0) in the data, so the first batch's distance is 0 for that
    sample and sqrt's backward at 0 is inf (0 * inf downstream). The twin clamps the haversine term at 1e-12."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.zero_()
    xs = _batches(5, 6)
    coords = [torch.rand(5, 2) - 0.5 for _ in range(4)]
    coords[0][2] = 0.0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        lat1, lon1, lat2, lon2 = out[:, 0], out[:, 1], coords[step][:, 0], coords[step][:, 1]
        a = torch.sin((lat2 - lat1) / 2) ** 2 + torch.cos(lat1) * torch.cos(lat2) * torch.sin((lon2 - lon1) / 2) ** 2
        if clamped:
            a = a.clamp_min(1e-12)
        return (2 * torch.asin(torch.sqrt(a))).mean()  # producer: haversine
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- prototypical networks: a class with no support shot
def _prototypes(skip_empty: bool) -> Scenario:
    """Few-shot episodes: each class's prototype is the mean of its support embeddings; at step 2 the sampler drew
    no support example of class 2 (a class with too few images): the mean of nothing is NaN. The twin scores only
    the classes present in the support set."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 4))
    support_x, query_x = _batches(6, 5), _batches(4, 5)
    support_y = [torch.tensor([0, 0, 1, 1, 2, 2]) for _ in range(4)]
    support_y[2] = torch.tensor([0, 0, 1, 1, 1, 0])
    query_y = [torch.tensor([0, 1, 2, 1]) for _ in range(4)]
    query_y[2] = torch.tensor([0, 1, 1, 0])

    def batch(step: int) -> tuple[torch.Tensor]:
        return (torch.cat([support_x[step], query_x[step]]),)

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        support, query = out[:6], out[6:]
        classes = [c for c in range(3) if not skip_empty or bool((support_y[step] == c).any())]
        prototypes = torch.stack([support[support_y[step] == c].mean(0) for c in classes])  # producer: prototype
        logits = -torch.cdist(query, prototypes) ** 2
        return F.cross_entropy(logits, torch.tensor([classes.index(int(y)) for y in query_y[step]]))
    return _loop(model, batch, loss_fn)


# ---------------------------------------------------------------- a learned Yeo-Johnson transform, lambda = 0
class PowerTransform(nn.Module):
    """Yeo-Johnson on non-negative features with a learned lambda, initialised to 0 (the log transform); the twin
    branches to ``log1p`` where lambda is 0, as sklearn does."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.lam = nn.Parameter(torch.zeros(()))
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch and bool(self.lam.abs() < 1e-6):
            return torch.log1p(x)
        return ((x + 1) ** self.lam - 1) / self.lam  # producer: yeo johnson


def _yeo_johnson(branch: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(PowerTransform(branch), nn.Linear(4, 1))
    xs, ys = [torch.rand(6, 4) * 3 for _ in range(4)], _batches(6, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- Rodrigues' formula at the identity pose
class AxisAngleRotation(nn.Module):
    """Rotates 3-D points by a learned axis-angle vector, initialised to 0 (the identity pose). The axis is
    ``r / |r|``: 0 / 0 at the identity. The twin takes the norm of ``r + 1e-8``, as SMPL's ``batch_rodrigues``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.rotation = nn.Parameter(torch.zeros(3))
        self.eps = eps

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        theta = (self.rotation + self.eps).norm()
        axis = self.rotation / theta  # producer: rodrigues axis
        zero = axis.new_zeros(())
        k = torch.stack([torch.stack([zero, -axis[2], axis[1]]), torch.stack([axis[2], zero, -axis[0]]),
                         torch.stack([-axis[1], axis[0], zero])])
        rotation = torch.eye(3) + torch.sin(theta) * k + (1 - torch.cos(theta)) * (k @ k)
        return points @ rotation.t()


def _rodrigues(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(AxisAngleRotation(eps), nn.Linear(3, 1))
    xs, ys = _batches(6, 3), _batches(6, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a custom row-stochastic parametrization
class RowStochastic(nn.Module):
    """Keeps a mixing matrix's rows non-negative and summing to 1: ``relu(w) / relu(w).sum(row)``. A row whose
    weights are all <= 0 sums to 0: 0 / 0. The twin adds eps to the sum."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        positive = F.relu(weight)
        return positive / (positive.sum(-1, keepdim=True) + self.eps)  # producer: row stochastic


def _row_stochastic(eps: float, cached: bool) -> Scenario:
    """Row 1 of the mixing weights is all negative from the start (an init that drew them from N(-1, 0.1))."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[1] = -1.0 - 0.1 * torch.rand(4)
    parametrize.register_parametrization(model[0], "weight", RowStochastic(eps))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 4), _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if cached:
                with parametrize.cached():
                    loss = F.mse_loss(model(xs[step]), ys[step])
            else:
                loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- RunningMeanStd over one environment
class RunningMeanStd:
    """The observation normaliser of PPO code bases (parallel mean/variance update), written with torch's default
    unbiased ``var``; the twin uses the population variance (``correction=0``), as baselines' numpy code does."""

    def __init__(self, dim: int, correction: int) -> None:
        self.mean, self.var, self.count = torch.zeros(dim), torch.ones(dim), 1e-4
        self.correction = correction

    def update(self, x: torch.Tensor) -> None:
        batch_mean, batch_var, n = x.mean(0), x.var(0, correction=self.correction), x.shape[0]  # producer: rms var
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta ** 2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total


def _running_mean_std(correction: int) -> Scenario:
    """At step 2 only one of the environments is still running: the batch has one row, its unbiased variance is
    NaN, and the normalised observations of every later step are NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    normaliser = RunningMeanStd(3, correction)
    obs = [torch.randn(4, 3) * 2 + 1 for _ in range(4)]
    obs[2] = obs[2][:1]
    returns = [torch.randn(o.shape[0], 1) for o in obs]

    def batch(step: int) -> tuple[torch.Tensor]:
        normaliser.update(obs[step])
        return (((obs[step] - normaliser.mean) / (normaliser.var + 1e-8).sqrt()).clamp(-10, 10),)
    return _loop(model, batch, lambda out, step: F.mse_loss(out, returns[step]))


# ---------------------------------------------------------------- healthy: AveragedModel as an EMA teacher
def _averaged_teacher() -> Scenario:
    """A student trained against an EMA teacher kept by ``swa_utils.AveragedModel`` (``get_ema_multi_avg_fn``), its
    BatchNorm statistics refreshed by ``update_bn`` at the end."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    teacher = torch.optim.swa_utils.AveragedModel(
        student, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    xs = _batches(8, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.no_grad():
                target = teacher(xs[step]).softmax(-1)
            loss = F.cross_entropy(student(xs[step]), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            teacher.update_parameters(student)
            losses.append(loss.detach())
        torch.optim.swa_utils.update_bn([(x,) for x in xs], teacher)
        return [*losses, *(p.detach().clone() for p in teacher.parameters())]
    return Scenario((student, opt), run)


# ---------------------------------------------------------------- healthy: a Lookahead wrapper
def _lookahead() -> Scenario:
    """Lookahead (k=2, alpha=0.5) over SGD: every second step the slow weights move halfway to the fast ones and the
    fast weights are reset to them, in loop code under ``torch.no_grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    slow = [p.detach().clone() for p in model.parameters()]
    xs, ys = _batches(6, 4, steps=6), _batches(6, 1, steps=6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(6):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 2 == 1:
                with torch.no_grad():
                    for fast, s in zip(model.parameters(), slow):
                        s.add_(fast - s, alpha=0.5)
                        fast.copy_(s)
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a running variance buffer updated by hand
class FeatureNorm(nn.Module):
    """Normalises features by running statistics it updates itself in training (a BatchNorm by hand, as for a
    reward or observation normaliser inside the model), the batch variance torch's default unbiased one."""

    def __init__(self, dim: int, correction: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.correction = correction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.running_var.mul_(0.9).add_(0.1 * x.var(0, correction=self.correction))  # producer: hand var
        return (x - self.running_mean) / (self.running_var + 1e-5).sqrt()


def _hand_running_var(correction: int) -> Scenario:
    """At step 2 the last batch of the epoch holds one sample: its unbiased variance is NaN, written into the
    buffer, and the output is NaN. The twin: the population variance."""
    torch.manual_seed(0)
    model = nn.Sequential(FeatureNorm(3, correction), nn.Linear(3, 1))
    xs, ys = _batches(5, 3), _batches(5, 1)
    xs[2], ys[2] = xs[2][:1], ys[2][:1]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a causal mask built as -inf * triu(ones)
class CausalSelfAttention(nn.Module):
    """One head of causal self-attention; the mask built as ``float('-inf') * torch.triu(ones, 1)``, a pitfall:
    0 * -inf is NaN below the diagonal. The twin: ``masked_fill`` of the boolean triangle."""

    def __init__(self, multiplied: bool) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(4, 12), nn.Linear(4, 1)
        self.multiplied = multiplied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        if self.multiplied:
            mask = float("-inf") * torch.triu(torch.ones(t, t), diagonal=1)  # producer: causal mask product
        else:
            mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        weights = F.softmax(q @ k.transpose(1, 2) / 2.0 + mask, -1)
        return self.out((weights @ v).mean(1))


def _causal_mask(multiplied: bool) -> Scenario:
    torch.manual_seed(0)
    model = CausalSelfAttention(multiplied)
    xs, ys = _batches(3, 5, 4), _batches(3, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- an EMA teacher fed by a student gone non-finite
class RootNormHead(nn.Module):
    """Embeds and scales each sample by its L2 norm written by hand, ``sqrt((h ** 2).sum())``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.eps = nn.Linear(4, 4), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h / (1.0 + torch.sqrt((h ** 2).sum(-1, keepdim=True) + self.eps))  # producer: student root


def _ema_teacher(eps: float) -> Scenario:
    """Mean-teacher training: the student matches an EMA teacher's output; at step 2 a blank sample makes the
    student's hidden row 0 (its bias zeroed by a pruning pass), sqrt's backward at 0 is inf and the student's step
    NaN, which the EMA then carries into the teacher. Both models are watched: the student's backward is named."""
    torch.manual_seed(0)
    student = RootNormHead(eps)
    teacher = RootNormHead(eps)
    teacher.load_state_dict(student.state_dict())
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    xs = _batches(5, 4)
    xs[2][3] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    student.body.bias.zero_()
            with torch.no_grad():
                target = teacher(xs[step] + 0.01)
            loss = F.mse_loss(student(xs[step]), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)
            losses.append(loss.detach())
        return losses
    return Scenario((student, teacher, opt), run)


# ---------------------------------------------------------------- an epsilon-greedy action the policy masked out
def _epsilon_greedy(on_policy_mask: bool) -> Scenario:
    """Policy gradient over actions with an illegal-action mask (logits filled with -inf); the behaviour policy is
    epsilon-greedy and its random branch ignores the mask: at step 2 it picks an illegal action, whose log-probability
    under the policy is -inf, and the loss is inf. The twin draws the random action among the legal ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = _batches(6, 4)
    legal = [torch.ones(6, 3, dtype=torch.bool) for _ in range(4)]
    for mask in legal:
        mask[:, 2] = False
    actions = [torch.randint(0, 2, (6,)) for _ in range(4)]
    actions[2][1] = 1 if on_policy_mask else 2
    advantages = [torch.randn(6) for _ in range(4)]

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        log_probs = F.log_softmax(out.masked_fill(~legal[step], float("-inf")), -1)
        chosen = log_probs.gather(1, actions[step][:, None]).squeeze(1)  # producer: illegal action
        return -(chosen * advantages[step]).mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a VAE's exp in float16 under autocast
class AutocastVae(nn.Module):
    """A VAE computing its KL term in its forward; under float16 autocast the logvar head's output is float16 and
    ``logvar.exp()`` stays float16. The twin takes the KL in float32 (``logvar.float()``)."""

    def __init__(self, in_float32: bool) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar, self.dec = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 2), nn.Linear(2, 6)
        self.in_float32 = in_float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        if self.in_float32:
            mu, logvar = mu.float(), logvar.float()
        kl = -0.5 * (1 + logvar - mu * mu - logvar.exp()).sum(-1).mean()  # producer: half exp
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(logvar)
        return self.dec(z), kl


def _autocast_vae(in_float32: bool) -> Scenario:
    """At step 2 the logvar head's bias has drifted to 12: exp(12) is 162755, past float16's 65504, though finite
    in the float32 the same code computes without autocast."""
    torch.manual_seed(0)
    model = AutocastVae(in_float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (the drifted head kept: a step would undo it)
    xs = _batches(5, 6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.logvar.weight.zero_()
                    model.logvar.bias.fill_(12.0)
            with torch.autocast("cpu", dtype=torch.float16):
                recon, kl = model(xs[step])
            loss = F.mse_loss(recon.float(), xs[step]) + 1e-6 * kl.float()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)

CASES = [
    Case("hunt21_evidential_digamma_of_a_concentration_of_0", lambda: _evidential(0.0),
         Expect("forward", None, step=0, op="aten.digamma.default", marker="edl digamma")),
    Case("hunt21_evidential_concentration_plus_1_healthy", lambda: _evidential(1.0), None),
    Case("hunt21_keypoint_hypot_backward_at_a_zero_offset", lambda: _keypoints(True),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="keypoint hypot")),
    Case("hunt21_keypoint_smoothed_distance_healthy", lambda: _keypoints(False), None),
    Case("hunt21_mdn_likelihood_summed_in_probability_space", lambda: _mdn(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="mdn log")),
    Case("hunt21_mdn_logsumexp_healthy", lambda: _mdn(True), None),
    Case("hunt21_gaussian_nll_loss_eps_0_of_an_underflowed_variance", lambda: _gaussian_nll_loss(0.0),
         Expect("forward", None, step=2, op="aten.log.default", marker="gaussian nll loss")),
    Case("hunt21_gaussian_nll_loss_default_eps_healthy", lambda: _gaussian_nll_loss(1e-6), None),
    Case("hunt21_aux_head_weighted_0_of_a_log_of_0", lambda: _zero_weighted_aux(False),
         Expect("forward", None, step=0, op="aten.log.default", marker="aux log depth")),
    Case("hunt21_aux_head_skipped_when_weight_0_healthy", lambda: _zero_weighted_aux(True), None),
    Case("hunt21_log_cosh_overflow_on_an_outlier", lambda: _log_cosh(False),
         Expect("forward", None, step=2, op="aten.cosh.default", marker="log cosh")),
    Case("hunt21_log_cosh_softplus_form_healthy", lambda: _log_cosh(True), None),
    # The -inf log prior is the data the loss read (it came from the class counts, before the watch): named as the
    # add's operand at its line, phase data, as a class weight of 1 / 0 would be. (ops=True said 'first non-finite
    # loss', unclassified, before backward/gradient_checks.py counted the traced loss code's reads from outside.)
    Case("hunt21_logit_adjustment_by_the_prior_of_an_absent_class", lambda: _logit_adjustment(False),
         Expect("data", None, step=2, op=None, marker="logit adjusted",
                tensor=TensorRef(TensorRole.INPUT, "aten.add.Tensor", "other"), cause="bad-input-data")),
    Case("hunt21_logit_adjustment_smoothed_counts_healthy", lambda: _logit_adjustment(True), None),
    Case("hunt21_haversine_to_null_island_sqrt_backward_at_0", lambda: _haversine(False),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="haversine")),
    Case("hunt21_haversine_clamped_healthy", lambda: _haversine(True), None),
    Case("hunt21_prototype_of_a_class_with_no_support_example", lambda: _prototypes(False),
         Expect("forward", None, step=2, op="aten.mean.dim", marker="prototype")),
    Case("hunt21_prototypes_of_present_classes_healthy", lambda: _prototypes(True), None),
    Case("hunt21_yeo_johnson_learned_lambda_of_0", lambda: _yeo_johnson(False),
         Expect("forward", "0", "PowerTransform", step=0, op="aten.div.Tensor", marker="yeo johnson")),
    Case("hunt21_yeo_johnson_log1p_branch_healthy", lambda: _yeo_johnson(True), None),
    Case("hunt21_rodrigues_axis_at_the_identity_pose", lambda: _rodrigues(0.0),
         Expect("forward", "0", "AxisAngleRotation", step=0, op="aten.div.Tensor", marker="rodrigues axis")),
    Case("hunt21_rodrigues_norm_with_eps_healthy", lambda: _rodrigues(1e-8), None),
    Case("hunt21_row_stochastic_parametrization_of_a_negative_row", lambda: _row_stochastic(0.0, False),
         Expect("forward", "0.parametrizations.weight.0", "RowStochastic", step=0, op="aten.div.Tensor",
                marker="row stochastic")),
    Case("hunt21_row_stochastic_parametrization_cached", lambda: _row_stochastic(0.0, True),
         Expect("forward", "0.parametrizations.weight.0", "RowStochastic", step=0, op="aten.div.Tensor",
                marker="row stochastic")),
    Case("hunt21_row_stochastic_parametrization_with_eps_healthy", lambda: _row_stochastic(1e-6, False), None),
    Case("hunt21_running_mean_std_unbiased_var_of_one_environment", lambda: _running_mean_std(1),
         Expect("data", "", "Sequential", step=2, op="aten.var.correction", marker="rms var")),
    Case("hunt21_running_mean_std_population_var_healthy", lambda: _running_mean_std(0), None),
    Case("hunt21_averaged_model_ema_teacher_healthy", _averaged_teacher, None),
    Case("hunt21_lookahead_over_sgd_healthy", _lookahead, None),
    Case("hunt21_hand_running_var_buffer_of_a_batch_of_one", lambda: _hand_running_var(1),
         Expect("forward", "0", "FeatureNorm", step=2, op="aten.var.correction", marker="hand var")),
    Case("hunt21_hand_running_var_population_healthy", lambda: _hand_running_var(0), None),
    Case("hunt21_causal_mask_as_minus_inf_times_triu", lambda: _causal_mask(True),
         Expect("forward", "", "CausalSelfAttention", step=0, op="aten.mul.Tensor", marker="causal mask product")),
    Case("hunt21_causal_mask_masked_fill_healthy", lambda: _causal_mask(False), None),
    Case("hunt21_ema_teacher_of_a_student_whose_backward_went_nan", lambda: _ema_teacher(0.0),
         Expect("backward", "", "RootNormHead", step=2, op="aten.div.Tensor", marker="student root")),
    Case("hunt21_ema_teacher_root_with_eps_healthy", lambda: _ema_teacher(1e-8), None),
    Case("hunt21_epsilon_greedy_action_the_policy_masked", lambda: _epsilon_greedy(False),
         Expect("forward", None, step=2, op="aten.gather.default", marker="illegal action", cause="masked-softmax",
                kinds=frozenset({"-inf"})),
         note=PICKED_MASK),
    Case("hunt21_epsilon_greedy_among_legal_actions_healthy", lambda: _epsilon_greedy(True), None),
    Case("hunt21_autocast_float16_vae_exp_overflow", lambda: _autocast_vae(False),
         Expect("forward", "", "AutocastVae", step=2, op="aten.exp.default", marker="half exp")),
    Case("hunt21_autocast_vae_exp_in_float32_healthy", lambda: _autocast_vae(True), None),
]
