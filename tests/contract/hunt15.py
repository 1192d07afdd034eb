"""Reported NaN incidents the other rows do not hold, each with the healthy twin its users apply (hunt15).

A PPO loss whose probability ratio ``exp(new - old)`` overflows where the clipped term wins (forward finite, the
exp's backward 0 * inf); a PPO advantage normalised by the std of a last mini-batch of one; an entropy bonus
``-(p * log p)`` of a saturated softmax; an ArcFace-style angle ``acos`` of a cosine of exactly 1; a gamma
correction ``x ** (1 / 2.2)`` of an augmented image gone negative; DETR's ``inverse_sigmoid`` written without
a clamp, of a saturated box; a log-softmax by hand, ``x - log(sum(exp(x)))``, of large logits; a Gaussian
policy's ``Normal(mu, sigma).log_prob`` whose sigma underflowed to 0; a ZCA whitening through ``eigh`` of a
covariance with repeated eigenvalues.
Each with the fix its users apply (a clamp, ``log_softmax``, ``logsumexp``, a std without Bessel's correction,
``softplus + eps``): the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- PPO: the ratio's exp, the advantage's std
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.logits = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.logits(torch.tanh(self.body(obs))), -1)


def _ppo_ratio(safe: bool) -> Scenario:
    """At step 2 the stored old log-prob of sample 0 is stale (-100): ``exp(new - old)`` is inf there; its
    advantage is positive, so ``min(ratio * adv, clip(ratio) * adv)`` takes the clipped term: the loss is finite
    and the exp's backward is ``grad * result`` = 0 * inf."""
    torch.manual_seed(0)
    obs, actions = _batches(5, 4), [torch.randint(0, 3, (5,)) for _ in range(4)]
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7])

    def batch(step: int) -> tuple[torch.Tensor]:
        return (obs[step],)

    def loss_fn(logp_all: torch.Tensor, step: int) -> torch.Tensor:
        logp = logp_all.gather(1, actions[step][:, None]).squeeze(1)
        old = logp.detach() - 0.1
        if step == 2:
            old = old.clone()
            old[0] = -100.0
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            ratio = torch.exp((logp - old).clamp(max=20.0))
        else:
            ratio = torch.exp(logp - old)  # producer: ppo ratio
        clipped = ratio.clamp(0.8, 1.2)
        return -torch.min(ratio * advantages, clipped * advantages).mean()
    return _loop(Policy(), batch, loss_fn)


def _ppo_advantage_std(safe: bool) -> Scenario:
    """The advantages of each mini-batch are standardised; the last mini-batch (step 3) holds one sample:
    ``adv.std()`` (Bessel's correction) of one element is 0 / 0."""
    torch.manual_seed(0)
    sizes = (4, 4, 4, 1)
    obs = [torch.randn(n, 4) for n in sizes]
    actions = [torch.randint(0, 3, (n,)) for n in sizes]
    returns = [torch.randn(n) for n in sizes]

    def loss_fn(logp_all: torch.Tensor, step: int) -> torch.Tensor:
        adv = returns[step] - 0.1
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            adv = (adv - adv.mean()) / (adv.std(correction=0) + 1e-8)
        else:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # producer: advantage std
        return -(logp_all.gather(1, actions[step][:, None]).squeeze(1) * adv).mean()
    return _loop(Policy(), lambda step: (obs[step],), loss_fn)


# ---------------------------------------------------------------- an entropy bonus of a saturated softmax
class Classifier(nn.Module):
    temperature = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.temperature


def _entropy_bonus(safe: bool) -> Scenario:
    """At step 2 the temperature is 0.001: the softmax saturates, its small entries are exactly 0, ``p.log()``
    is -inf there and ``p * log p`` is 0 * -inf."""
    torch.manual_seed(0)
    model = Classifier()
    xs, ys = _batches(5, 4), [torch.randint(0, 6, (5,)) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        model.temperature = 0.001 if step == 2 else 1.0
        return (xs[step],)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        p = logits.softmax(-1)
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            entropy = -(p * logits.log_softmax(-1)).sum(-1).mean()
        else:
            entropy = -(p * p.log()).sum(-1).mean()  # producer: entropy log
        return F.cross_entropy(logits, ys[step]) - 0.01 * entropy
    return _loop(model, batch, loss_fn)


# ---------------------------------------------------------------- ArcFace: acos of a cosine of exactly 1
class AngularHead(nn.Module):
    """The angle between each embedding and its class centre, as ArcFace-style losses compute it."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.centres = nn.Parameter(torch.eye(3, 4))
        self.safe = safe

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cos = (F.normalize(self.embed(x), dim=-1) * F.normalize(self.centres[y], dim=-1)).sum(-1)
        if self.safe:
            return torch.acos(cos.clamp(-1 + 1e-7, 1 - 1e-7))
        return torch.acos(cos)  # producer: acos


def _arcface(safe: bool) -> Scenario:
    """At step 2 the embedding Linear is set so that every embedding lies on axis 0, as does class 0's centre:
    sample 0 (class 0) has a cosine of exactly 1, and acos' derivative -1 / sqrt(1 - x^2) is -inf there."""
    torch.manual_seed(0)
    model = AngularHead(safe)
    xs = [torch.rand(3, 4) + 0.5 for _ in range(4)]
    ys = torch.tensor([0, 1, 2])

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.embed.weight.zero_()
                model.embed.weight[0] = 1.0
                model.embed.bias.zero_()
        return xs[step], ys
    return _loop(model, batch, lambda angle, step: angle.mean(), lr=0.0)


# ---------------------------------------------------------------- gamma correction of a negative pixel
class GammaCorrect(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 2, 3, padding=1), nn.Linear(2 * 4 * 4, 1)
        self.safe = safe

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.safe:  # noqa: SIM108  (the producer's line stands alone)
            image = image.clamp_min(0).pow(1 / 2.2)
        else:
            image = image.pow(1 / 2.2)  # producer: gamma
        return self.head(self.conv(image).flatten(1))


def _gamma(safe: bool) -> Scenario:
    """Images in [0, 1]; at step 1 the augmentation's noise pushes some pixels below 0: x ** (1 / 2.2) is NaN."""
    torch.manual_seed(0)
    images = [torch.rand(2, 1, 4, 4) for _ in range(4)]
    images[1] = images[1] + 0.3 * torch.randn(2, 1, 4, 4)
    return _loop(GammaCorrect(safe), lambda step: (images[step],), lambda out, step: out.pow(2).mean())


# ---------------------------------------------------------------- DETR's inverse_sigmoid without a clamp
class BoxRefine(nn.Module):
    """Iterative box refinement: the reference points of the previous layer go back through the inverse sigmoid."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.delta = nn.Linear(4, 4)
        self.safe = safe

    def forward(self, reference: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        if self.safe:
            x = reference.clamp(0, 1)
            inverse = torch.log(x.clamp(min=1e-5) / (1 - x).clamp(min=1e-5))
        else:
            inverse = torch.log(reference / (1 - reference))  # producer: inverse sigmoid
        return torch.sigmoid(inverse + self.delta(query))


class BoxDecoder(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.reference = nn.Linear(4, 4)
        self.refine = BoxRefine(safe)

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        return self.refine(torch.sigmoid(self.reference(query)), query)


def _inverse_sigmoid(safe: bool) -> Scenario:
    """At step 2 the first layer's box coordinate 2 saturates: sigmoid(40) is exactly 1 in float32, x / (1 - x)
    is inf, its log inf, the refined box sigmoid(inf) = 1 finite; the division's backward is 0 * inf."""
    torch.manual_seed(0)
    model = BoxDecoder(safe)
    queries = _batches(3, 4)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.reference.bias[2] = 40.0
        return (queries[step],)
    return _loop(model, batch, lambda out, step: out.pow(2).mean(), lr=0.0)


# ---------------------------------------------------------------- log-softmax by hand in the loss
def _hand_log_softmax(safe: bool) -> Scenario:
    """``logits - log(sum(exp(logits)))``; at step 1 the logits reach 100 (a batch of unnormalised features):
    exp overflows to inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))
    xs, ys = _batches(3, 4), [torch.randint(0, 5, (3,)) for _ in range(4)]
    xs[1] = xs[1] * 300

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        if safe:
            logp = logits - torch.logsumexp(logits, -1, keepdim=True)
        else:
            logp = logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))  # producer: hand log softmax
        return -logp.gather(1, ys[step][:, None]).mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a Gaussian policy's sigma underflows
class GaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(4, 2)
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mu(obs), self.log_std


def _gaussian_policy(safe: bool) -> Scenario:
    """At step 2 log_std has collapsed to -200 (an entropy term pushing it down): exp(-200) is 0 in float32, and
    ``Normal(mu, 0).log_prob(a)`` takes log(0) (validation off, as in many RL codebases for speed)."""
    torch.manual_seed(0)
    model = GaussianPolicy()
    obs, actions = _batches(5, 4), _batches(5, 2)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.log_std.fill_(-200.0)
        return (obs[step],)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        mu, log_std = out
        sigma = F.softplus(log_std) + 1e-5 if safe else log_std.exp()
        dist = torch.distributions.Normal(mu, sigma, validate_args=False)
        return -dist.log_prob(actions[step]).sum(-1).mean()  # producer: log_prob
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- ZCA whitening through eigh
class Whiten(nn.Module):
    """ZCA whitening of a feature batch (as in decorrelated batch norm and some SSL losses)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h = h - h.mean(0)
        cov = h.T @ h / h.shape[0] + 1e-3 * torch.eye(3)
        values, vectors = torch.linalg.eigh(cov)  # producer: eigh
        return h @ vectors @ torch.diag(values.rsqrt()) @ vectors.T


def _whitening() -> Scenario:
    """At step 2 the projection is zeroed: the covariance is 1e-3 * I, three equal eigenvalues, and eigh's
    backward divides by their differences."""
    torch.manual_seed(0)
    model = Whiten()
    xs = _batches(6, 3)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.proj.weight.zero_()
                model.proj.bias.zero_()
        return (xs[step],)
    return _loop(model, batch, lambda out, step: out.pow(2).mean() + out.sum(), lr=0.0)


CASES = [
    Case("hunt15_ppo_ratio_exp_overflow_behind_the_clip", lambda: _ppo_ratio(False),
         Expect("backward", None, step=2, op="aten.mul.Tensor", marker="ppo ratio", cause="exp-overflow")),
    Case("hunt15_ppo_ratio_clamped_healthy", lambda: _ppo_ratio(True), None),
    Case("hunt15_ppo_advantage_std_of_a_last_batch_of_one", lambda: _ppo_advantage_std(False),
         Expect("forward", None, step=3, op="aten.std.correction", marker="advantage std",
                cause="division-by-zero")),
    Case("hunt15_ppo_advantage_std_without_correction_healthy", lambda: _ppo_advantage_std(True), None),
    Case("hunt15_entropy_bonus_of_a_saturated_softmax", lambda: _entropy_bonus(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="entropy log", cause="log-domain")),
    Case("hunt15_entropy_bonus_with_log_softmax_healthy", lambda: _entropy_bonus(True), None),
    Case("hunt15_arcface_acos_of_a_cosine_of_one", lambda: _arcface(False),
         Expect("backward", "", "AngularHead", step=2, op="aten.rsqrt.default", marker="acos",
                cause="sqrt-domain")),
    Case("hunt15_arcface_acos_clamped_healthy", lambda: _arcface(True), None),
    Case("hunt15_gamma_correction_of_a_negative_pixel", lambda: _gamma(False),
         Expect("forward", "", "GammaCorrect", step=1, op="aten.pow.Tensor_Scalar", marker="gamma",
                cause="pow-domain")),
    Case("hunt15_gamma_correction_clamped_healthy", lambda: _gamma(True), None),
    Case("hunt15_inverse_sigmoid_of_a_border_box", lambda: _inverse_sigmoid(False),
         Expect("backward", "refine", "BoxRefine", step=2, op="aten.div.Tensor", marker="inverse sigmoid",
                cause="division-by-zero")),
    Case("hunt15_inverse_sigmoid_clamped_healthy", lambda: _inverse_sigmoid(True), None),
    Case("hunt15_log_softmax_by_hand_of_large_logits", lambda: _hand_log_softmax(False),
         Expect("forward", None, step=1, op="aten.exp.default", marker="hand log softmax")),
    Case("hunt15_log_softmax_by_logsumexp_healthy", lambda: _hand_log_softmax(True), None),
    Case("hunt15_gaussian_policy_sigma_underflows_to_zero", lambda: _gaussian_policy(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="log_prob", cause="log-domain")),
    Case("hunt15_gaussian_policy_softplus_sigma_healthy", lambda: _gaussian_policy(True), None),
    Case("hunt15_zca_whitening_eigh_of_repeated_eigenvalues", _whitening,
         Expect("backward", "", "Whiten", step=2, op="aten.div_.Tensor", marker="eigh",
                cause="division-by-zero")),
]


# ================================================================ second round
# ---------------------------------------------------------------- a soft Dice loss over a fully ignored image
class Segmenter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv(image))


def _dice(smooth: float) -> Scenario:
    """A Dice loss over the labelled pixels; at step 2 image 1 has no labelled pixel (an ignore mask of zeros):
    its intersection and its sums are 0, and 0 / 0 without the smoothing term."""
    torch.manual_seed(0)
    images = [torch.randn(2, 1, 6, 6) for _ in range(4)]
    targets = [(torch.rand(2, 1, 6, 6) > 0.5).float() for _ in range(4)]
    valid = [torch.ones(2, 1, 6, 6) for _ in range(4)]
    valid[2][1] = 0.0

    def loss_fn(pred: torch.Tensor, step: int) -> torch.Tensor:
        p, t = (pred * valid[step]).flatten(1), (targets[step] * valid[step]).flatten(1)
        inter = (p * t).sum(1)
        dice = (2 * inter + smooth) / (p.sum(1) + t.sum(1) + smooth)  # producer: dice
        return (1 - dice).mean()
    return _loop(Segmenter(), lambda step: (images[step],), loss_fn)


# ---------------------------------------------------------------- SwAV's Sinkhorn under no_grad
def _sinkhorn(form: str) -> Scenario:
    """SwAV's codes: ``Q = exp(scores / eps)`` normalised in place, under ``no_grad``, as the targets of the
    loss. At step 1 the prototype scores reach 16 (a layer's weights scaled up): exp(16 / 0.05) is inf; with the
    global max subtracted (``form="max"``) a prototype far below it underflows to 0 in every sample, and its row's
    normalisation is 0 / 0; in the log domain (``form="log"``, logsumexp) it stays finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = _batches(6, 4)

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model[2].weight.mul_(30.0)
        return (xs[step],)

    def loss_fn(scores: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            if form == "log":
                log_q = (scores / 0.05).t()
                for _ in range(3):
                    log_q = log_q - torch.logsumexp(log_q, 1, keepdim=True)
                    log_q = log_q - torch.logsumexp(log_q, 0, keepdim=True)
                q = log_q.exp()
            else:
                if form == "max":  # noqa: SIM108  (the producer's line stands alone)
                    q = torch.exp((scores - scores.max()) / 0.05).t()
                else:
                    q = torch.exp(scores / 0.05).t()  # producer: sinkhorn exp
                q /= q.sum()
                for _ in range(3):
                    q /= q.sum(1, keepdim=True)  # producer: sinkhorn row
                    q /= q.sum(0, keepdim=True)
            q = q.t()
        return -(q * F.log_softmax(scores / 0.1, -1)).sum(-1).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- CLIP's logit scale without its clamp
class ClipHead(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(4, 4), nn.Linear(4, 4)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.safe = safe

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)
        if self.safe:  # noqa: SIM108  (the producer's line stands alone)
            scale = self.logit_scale.clamp(max=math.log(100)).exp()
        else:
            scale = self.logit_scale.exp()  # producer: logit scale
        return scale * a @ b.T


def _clip(safe: bool) -> Scenario:
    """The learned temperature has grown to 90 by step 2 (no clamp, as OpenCLIP warns): exp(90) is inf."""
    torch.manual_seed(0)
    model = ClipHead(safe)
    images, texts = _batches(4, 4), _batches(4, 4)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.logit_scale.fill_(90.0)
        return images[step], texts[step]

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        labels = torch.arange(4)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- a negative binomial likelihood, scVI-style
class CountDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean, self.log_theta = nn.Linear(4, 3), nn.Parameter(torch.zeros(3))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.softplus(self.mean(z)), self.log_theta.exp()


def _negative_binomial(safe: bool) -> Scenario:
    """At step 2 the dispersion of gene 1 has collapsed (log theta -120: theta is 0 in float32): lgamma(theta)
    is inf, and the likelihood's lgamma(x + theta) - lgamma(theta) is -inf; NaN once two infinities meet."""
    torch.manual_seed(0)
    model = CountDecoder()
    zs = _batches(5, 4)
    counts = [torch.poisson(torch.full((5, 3), 2.0)) for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.log_theta[1] = -120.0
        return (zs[step],)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        mu, theta = out
        if safe:
            theta = theta + 1e-4
        x, eps = counts[step], 1e-8
        log_nb = (torch.lgamma(x + theta) - torch.lgamma(theta) - torch.lgamma(x + 1)  # producer: lgamma
                  + theta * (torch.log(theta + eps) - torch.log(theta + mu + eps))
                  + x * (torch.log(mu + eps) - torch.log(theta + mu + eps)))
        return -log_nb.sum(-1).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- a one-pass variance, E[x^2] - E[x]^2
class OnePassNorm(nn.Module):
    """A feature normaliser with the one-pass variance: cancellation makes it slightly negative on a constant
    feature of large magnitude, and its sqrt NaN."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        var = (h * h).mean(0) - h.mean(0) ** 2
        if self.safe:  # noqa: SIM108  (the producer's line stands alone)
            std = (var.clamp_min(0) + 1e-5).sqrt()
        else:
            std = var.sqrt()  # producer: one-pass std
        return self.head((h - h.mean(0)) / (std + 1e-5))


def _one_pass(safe: bool) -> Scenario:
    """At step 2 feature 0 of the batch is the constant 1000.1 (a sensor stuck at one reading)."""
    torch.manual_seed(0)
    xs = _batches(8, 4)
    xs[2][:, 0] = 1000.1
    model = OnePassNorm(safe)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
    return _loop(model, lambda step: (xs[step],), lambda out, step: out.pow(2).mean(), lr=0.0)


# ---------------------------------------------------------------- class weights from the batch's counts
def _class_weights(safe: bool) -> Scenario:
    """Inverse-frequency class weights computed per batch, normalised to sum 1; at step 2 class 2 is absent from
    the batch: 1 / 0 is inf, and inf / inf NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    xs = _batches(6, 4)
    ys = [torch.tensor([0, 1, 2, 0, 1, 2]) for _ in range(4)]
    ys[2] = torch.tensor([0, 1, 0, 0, 1, 1])

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        counts = torch.bincount(ys[step], minlength=3).float()
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            weights = 1.0 / counts.clamp(min=1)
        else:
            weights = 1.0 / counts  # producer: class weights
        return F.cross_entropy(logits, ys[step], weight=weights / weights.sum())
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- WGAN-GP with the gradient norm by hand
def _gradient_penalty(safe: bool) -> Scenario:
    """``sqrt((g ** 2).sum(1))`` of the critic's input gradient; at step 2 the critic's first layer is dead (all
    ReLUs off): g is 0, and sqrt's backward at 0, in the penalty's double backward, is 1 / 0."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=0.0)
    reals, fakes = _batches(4, 4), _batches(4, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    critic[0].weight.zero_()
                    critic[0].bias.fill_(-1.0)
            alpha = torch.rand(4, 1)
            mixed = (alpha * reals[step] + (1 - alpha) * fakes[step]).requires_grad_(True)
            (g,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
            if safe:  # noqa: SIM108  (the producer's line stands alone)
                norm = g.norm(2, dim=1)
            else:
                norm = torch.sqrt((g ** 2).sum(1))  # producer: penalty sqrt
            loss = critic(fakes[step]).mean() - critic(reals[step]).mean() + 10 * ((norm - 1) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((critic, opt), run)


CASES += [
    Case("hunt15_dice_loss_of_a_fully_ignored_image", lambda: _dice(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="dice", cause="division-by-zero")),
    Case("hunt15_dice_loss_smoothed_healthy", lambda: _dice(1.0), None),
    Case("hunt15_swav_sinkhorn_exp_under_no_grad", lambda: _sinkhorn("plain"),
         Expect("forward", None, step=1, op="aten.exp.default", marker="sinkhorn exp", cause="exp-overflow")),
    Case("hunt15_swav_sinkhorn_max_subtracted_row_underflows", lambda: _sinkhorn("max"),
         Expect("forward", None, step=1, op="aten.div_.Tensor", marker="sinkhorn row", cause="division-by-zero")),
    Case("hunt15_swav_sinkhorn_in_the_log_domain_healthy", lambda: _sinkhorn("log"), None),
    Case("hunt15_clip_logit_scale_unclamped", lambda: _clip(False),
         Expect("forward", "", "ClipHead", step=2, op="aten.exp.default", marker="logit scale",
                cause="exp-overflow")),
    Case("hunt15_clip_logit_scale_clamped_healthy", lambda: _clip(True), None),
    Case("hunt15_negative_binomial_lgamma_of_a_zero_dispersion", lambda: _negative_binomial(False),
         Expect("forward", None, step=2, op="aten.lgamma.default", marker="lgamma", cause="log-domain")),
    Case("hunt15_negative_binomial_dispersion_floored_healthy", lambda: _negative_binomial(True), None),
    Case("hunt15_one_pass_variance_of_a_stuck_feature", lambda: _one_pass(False),
         Expect("forward", "", "OnePassNorm", step=2, op="aten.sqrt.default", marker="one-pass std",
                cause="sqrt-domain")),
    Case("hunt15_one_pass_variance_clamped_healthy", lambda: _one_pass(True), None),
    Case("hunt15_class_weights_of_an_absent_class", lambda: _class_weights(False),
         Expect("forward", None, step=2, op="aten.reciprocal.default", marker="class weights",
                cause="division-by-zero", says=tuple((mode, "divided by zero (`self` (3,) held 1 zero of 3)")
                                                     for mode in ("default", "defer", "full", "ops")))),
    Case("hunt15_class_weights_of_clamped_counts_healthy", lambda: _class_weights(True), None),
    Case("hunt15_gradient_penalty_sqrt_of_a_zero_gradient", lambda: _gradient_penalty(False),
         # (the parameter's gradient, which no output gradient explains, is looked for in the loss code's backward
         # first: its records hold the autograd.grad's ops, run again with their double backward: op_origins.py)
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="penalty sqrt", cause="sqrt-domain")),
    Case("hunt15_gradient_penalty_by_norm_healthy", lambda: _gradient_penalty(True), None),
]


# ================================================================ third round
# ---------------------------------------------------------------- a log taken before the selection
def _log_then_select(safe: bool) -> Scenario:
    """``-log(softmax(masked))[:, kept]``: from step 2 the vocabulary has a padding entry, masked to -inf; its
    probability is 0 and its log -inf, which the selection drops: the forward stays finite, and log's backward
    at 0 is 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
    xs = _batches(3, 4)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        padded = torch.zeros(5, dtype=torch.bool)
        if step >= 2:
            padded[4] = True  # the vocabulary grew a padding entry
        masked = logits.masked_fill(padded, float("-inf"))
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            log_p = F.log_softmax(masked, -1)
        else:
            log_p = torch.log(F.softmax(masked, -1))  # producer: log before select
        return -log_p[:, ~padded].mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a Poincaré ball's logarithmic map
class PoincareLogmap(nn.Module):
    """The logarithmic map at 0 of the Poincaré ball: artanh(|x|) x / |x| (hyperbolic embeddings)."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h / h.norm(dim=-1, keepdim=True).clamp_min(1.0)  # projected into the closed unit ball
        norm = h.norm(dim=-1, keepdim=True).clamp_min(1e-15)
        if self.safe:
            norm = norm.clamp_max(1 - 1e-5)
        return self.head(torch.atanh(norm) * h / norm)  # producer: artanh


def _poincare(safe: bool) -> Scenario:
    """At step 2 the embeddings lie on axis 0 outside the ball: projected onto its boundary, |x| is exactly 1 and
    artanh(1) is inf."""
    torch.manual_seed(0)
    model = PoincareLogmap(safe)
    with torch.no_grad():
        model.embed.weight.mul_(0.1)  # (inside the ball at first)
        model.embed.bias.mul_(0.1)
    xs = [torch.rand(3, 4) + 0.5 for _ in range(4)]

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 2:
            with torch.no_grad():
                model.embed.weight.zero_()
                model.embed.weight[0] = 2.0
                model.embed.bias.zero_()
        return (xs[step],)
    return _loop(model, batch, lambda out, step: out.pow(2).mean(), lr=0.0)


# ---------------------------------------------------------------- a survival loss, log(1 - cdf)
def _survival(safe: bool) -> Scenario:
    """A discrete-time survival likelihood: the event's probability mass, and log(1 - cdf) for the censored
    samples. At step 1 sample 0's mass sits all in the first bin (a saturated softmax): cdf is 1 from there on,
    and log(1 - 1) is -inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    xs = _batches(4, 4)
    times = torch.tensor([3, 1, 4, 2])
    censored = torch.tensor([True, False, True, False])

    def batch(step: int) -> tuple[torch.Tensor]:
        if step == 1:
            with torch.no_grad():
                model[2].bias.zero_()
                model[2].bias[0] = 200.0
        return (xs[step],)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        pmf = F.softmax(logits, -1)
        cdf = pmf.cumsum(-1).gather(1, times[:, None]).squeeze(1)
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            survival = torch.log((1 - cdf).clamp_min(1e-7))
        else:
            survival = torch.log(1 - cdf)  # producer: survival
        event = torch.log(pmf.gather(1, times[:, None]).squeeze(1).clamp_min(1e-7))
        return -torch.where(censored, survival, event).mean()
    return _loop(model, batch, loss_fn, lr=0.0)


# ---------------------------------------------------------------- NeRF's expected depth along an empty ray
class VolumeRenderer(nn.Module):
    """NeRF's volume rendering along each ray: densities, alphas, transmittance, weights, and the expected depth."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.density = nn.Linear(3, 1)
        self.safe = safe

    def forward(self, points: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        sigma = torch.relu(self.density(points)).squeeze(-1)
        alpha = 1 - torch.exp(-sigma * 0.1)
        transmittance = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        weights = alpha * transmittance
        if self.safe:
            return (weights * z).sum(-1) / weights.sum(-1).clamp_min(1e-10)
        return (weights * z).sum(-1) / weights.sum(-1)  # producer: depth


def _nerf(safe: bool) -> Scenario:
    """At step 2 ray 1 passes through empty space (every sample's density is 0 after the ReLU): its weights are 0,
    and its expected depth 0 / 0."""
    torch.manual_seed(0)
    model = VolumeRenderer(safe)
    with torch.no_grad():
        model.density.weight.fill_(1.0)
        model.density.bias.fill_(0.0)
    points = [torch.rand(2, 8, 3) for _ in range(4)]
    points[2][1] = -points[2][1]
    z = torch.linspace(0.1, 1.0, 8).expand(2, 8)
    return _loop(model, lambda step: (points[step], z), lambda depth, step: depth.pow(2).mean(), lr=0.0)


CASES += [
    Case("hunt15_log_of_a_softmax_then_a_selection", lambda: _log_then_select(False),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="log before select", cause="log-domain")),
    Case("hunt15_log_softmax_then_a_selection_healthy", lambda: _log_then_select(True), None),
    Case("hunt15_poincare_artanh_at_the_boundary", lambda: _poincare(False),
         Expect("forward", "", "PoincareLogmap", step=2, op="aten.atanh.default", marker="artanh",
                cause="log-domain")),
    Case("hunt15_poincare_artanh_clamped_healthy", lambda: _poincare(True), None),
    Case("hunt15_survival_log_of_one_minus_a_full_cdf", lambda: _survival(False),
         Expect("forward", None, step=1, op="aten.log.default", marker="survival", cause="log-domain")),
    Case("hunt15_survival_log_clamped_healthy", lambda: _survival(True), None),
    Case("hunt15_nerf_expected_depth_of_an_empty_ray", lambda: _nerf(False),
         Expect("forward", "", "VolumeRenderer", step=2, op="aten.div.Tensor", marker="depth")),
    Case("hunt15_nerf_expected_depth_clamped_healthy", lambda: _nerf(True), None),
]


# ================================================================ fourth round
# ---------------------------------------------------------------- a detection loss normalised by its positives
def _positives(safe: bool) -> Scenario:
    """RetinaNet's loss: summed over every anchor, divided by the number of positive anchors; at step 2 the
    batch holds no object (a background-only image): the count is 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    xs = _batches(6, 4)
    labels = [(torch.rand(6) > 0.5).float() for _ in range(4)]
    labels[2] = torch.zeros(6)

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        per_anchor = F.binary_cross_entropy_with_logits(logits.squeeze(-1), labels[step], reduction="none")
        positives = labels[step].sum()
        if safe:
            return per_anchor.sum() / positives.clamp(min=1.0)
        return per_anchor.sum() / positives  # producer: positives
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- batch-hard triplet loss, sqrt of a distance matrix
def _batch_hard(safe: bool) -> Scenario:
    """Pairwise distances by ``sqrt(|a|² + |b|² - 2ab)``: its diagonal is 0 (clamped), masked out of the hardest
    positive; sqrt's backward at 0 is 0 / 0 there, from the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    xs, ys = _batches(6, 4), [torch.tensor([0, 0, 1, 1, 2, 2]) for _ in range(4)]

    def loss_fn(emb: torch.Tensor, step: int) -> torch.Tensor:
        square = (emb * emb).sum(1)
        d2 = (square[:, None] + square[None, :] - 2 * emb @ emb.T).clamp(min=0)
        if safe:  # noqa: SIM108  (the producer's line stands alone)
            dist = torch.sqrt(d2 + 1e-12)
        else:
            dist = torch.sqrt(d2)  # producer: pairwise sqrt
        same = ys[step][:, None] == ys[step][None, :]
        hardest_positive = (dist * (same & ~torch.eye(6, dtype=torch.bool))).amax(1)
        hardest_negative = dist.masked_fill(same, float("inf")).amin(1)
        return F.relu(hardest_positive - hardest_negative + 0.3).mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- -1e9 as a mask value in float16
class HalfAttention(nn.Module):
    """A hand-written attention run in float16, masking by an additive bias of a large negative number (as older
    BERT ports did, ``(1 - mask) * -1e9``); ``masked_fill`` with -1e9 refuses float16 now, the product does not."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24).half()
        self.safe = safe

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        fill = torch.finfo(scores.dtype).min if self.safe else -1e9
        bias = padding[:, None, :].to(scores.dtype) * fill  # producer: half mask bias
        scores = scores + bias
        return (scores.softmax(-1) @ v).float()


def _half_mask(safe: bool) -> Scenario:
    """At step 1 sequence 1 is all padding: in float32 -1e9 everywhere gives a uniform row, in float16 -1e9 is
    -inf and the softmax of that row is 0 / 0."""
    torch.manual_seed(0)
    model = HalfAttention(safe)
    xs = [torch.randn(2, 3, 8).half() for _ in range(3)]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        padding = torch.zeros(2, 3, dtype=torch.bool)
        padding[0, 2] = True
        if step == 1:
            padding[1] = True
        return xs[step], padding
    return _loop(model, batch, lambda out, step: out.pow(2).mean(), steps=3, lr=0.0)


CASES += [
    Case("hunt15_detection_loss_over_no_positive_anchor", lambda: _positives(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="positives", cause="division-by-zero")),
    Case("hunt15_detection_loss_count_clamped_healthy", lambda: _positives(True), None),
    Case("hunt15_batch_hard_triplet_sqrt_of_the_diagonal", lambda: _batch_hard(False),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="pairwise sqrt", cause="sqrt-domain")),
    Case("hunt15_batch_hard_triplet_sqrt_with_eps_healthy", lambda: _batch_hard(True), None),
    Case("hunt15_fp16_attention_masked_with_minus_1e9", lambda: _half_mask(False),
         Expect("forward", "", "HalfAttention", step=1, op="aten.mul.Tensor", marker="half mask bias",
                cause="half-precision-overflow",
                says=tuple((mode, "-1e9, is past that max and becomes -inf in float16")
                           for mode in ("default", "defer", "full", "ops")))),
    Case("hunt15_fp16_attention_masked_with_finfo_min_healthy", lambda: _half_mask(True), None),
]


# ================================================================ fifth round
# ---------------------------------------------------------------- weight standardisation of a zero-initialised conv
class StdConv2d(nn.Conv2d):
    """Weight Standardization (BiT's StdConv2d): each filter standardised before the convolution."""

    safe = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean, std = w.mean((1, 2, 3), keepdim=True), w.std((1, 2, 3), keepdim=True)
        if self.safe:  # noqa: SIM108  (the producer's line stands alone)
            w = (w - mean) / (std + 1e-5)
        else:
            w = (w - mean) / std  # producer: weight standardisation
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class ResidualBranch(nn.Module):
    """A residual block whose last conv is zero-initialised (Goyal et al.'s zero-init residual), standardised."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.conv1, self.conv2 = StdConv2d(2, 2, 3, padding=1), StdConv2d(2, 2, 3, padding=1)
        self.conv1.safe = self.conv2.safe = safe
        self.head = nn.Linear(2 * 4 * 4, 1)
        nn.init.zeros_(self.conv2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.conv2(torch.relu(self.conv1(x)))).flatten(1))


def _std_conv(safe: bool) -> Scenario:
    """From the first step: the zero-initialised conv's filters have std 0, and standardising them is 0 / 0."""
    torch.manual_seed(0)
    model = ResidualBranch(safe)
    xs = _batches(2, 2, 4, 4)
    return _loop(model, lambda step: (xs[step],), lambda out, step: out.pow(2).mean())


# ---------------------------------------------------------------- a Gaussian process without jitter
class ExactGP(nn.Module):
    """The marginal log likelihood of an RBF-kernel Gaussian process, by logdet and solve."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.log_lengthscale = nn.Parameter(torch.zeros(()))
        self.safe = safe

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kernel = torch.exp(-torch.cdist(x, x).pow(2) / (2 * self.log_lengthscale.exp() ** 2))
        if self.safe:
            kernel = kernel + 1e-4 * torch.eye(len(x))
        fit = y @ torch.linalg.pinv(kernel) @ y
        return 0.5 * (fit + torch.logdet(kernel))  # producer: logdet


def _gp(safe: bool) -> Scenario:
    """At step 2 the batch holds the same input twice (a duplicated record): two equal rows, a singular kernel,
    and its logdet -inf (or NaN where rounding makes the determinant negative)."""
    torch.manual_seed(0)
    model = ExactGP(safe)
    xs, ys = [torch.randn(5, 2) for _ in range(4)], _batches(5)
    xs[2][3] = xs[2][1]
    return _loop(model, lambda step: (xs[step], ys[step]), lambda nll, step: nll, lr=0.0)


CASES += [
    Case("hunt15_weight_standardisation_of_a_zero_init_conv", lambda: _std_conv(False),
         Expect("forward", "conv2", "StdConv2d", step=0, op="aten.div.Tensor", marker="weight standardisation",
                cause="division-by-zero")),
    Case("hunt15_weight_standardisation_with_eps_healthy", lambda: _std_conv(True), None),
    Case("hunt15_gaussian_process_logdet_of_a_duplicated_input", lambda: _gp(False),
         Expect("forward", "", "ExactGP", step=2, op="aten._linalg_slogdet.default", marker="logdet",
                cause="log-domain")),
    Case("hunt15_gaussian_process_with_jitter_healthy", lambda: _gp(True), None),
]


# ================================================================ sixth round
# ---------------------------------------------------------------- SupCon: a sample with no positive in the batch
def _supcon(safe: bool) -> Scenario:
    """Supervised contrastive loss (Khosla et al.): the mean log-probability of each anchor's positives; at step 2
    the batch holds a class seen once, whose anchor has no positive: 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    xs = _batches(6, 4)
    ys = [torch.tensor([0, 0, 1, 1, 2, 2]) for _ in range(4)]
    ys[2] = torch.tensor([0, 0, 1, 1, 1, 2])

    def loss_fn(emb: torch.Tensor, step: int) -> torch.Tensor:
        z = F.normalize(emb, dim=-1)
        logits = z @ z.T / 0.1
        self_mask = torch.eye(6, dtype=torch.bool)
        logits = logits.masked_fill(self_mask, -1e4)
        log_prob = logits - torch.logsumexp(logits, 1, keepdim=True)
        positives = ((ys[step][:, None] == ys[step][None, :]) & ~self_mask).float()
        if safe:
            mean_log_prob = (positives * log_prob).sum(1) / positives.sum(1).clamp(min=1.0)
        else:
            mean_log_prob = (positives * log_prob).sum(1) / positives.sum(1)  # producer: supcon
        return -mean_log_prob.mean()
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a model that computes its loss, every label ignored
class LanguageModel(nn.Module):
    """A Hugging Face-style model: given labels, its forward returns the loss with the logits."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)
        self.safe = safe

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(tokens)))
        flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
        if self.safe:
            kept = (flat_labels != -100).sum().clamp(min=1)
            loss = F.cross_entropy(flat_logits, flat_labels, reduction="sum") / kept
        else:
            loss = F.cross_entropy(flat_logits, flat_labels)  # producer: all ignored
        return {"loss": loss, "logits": logits}


def _all_ignored(safe: bool) -> Scenario:
    """At step 2 the batch is prompts only (every label -100, as a collator masks the prompt): the mean over no
    label is 0 / 0."""
    torch.manual_seed(0)
    model = LanguageModel(safe)
    tokens = [torch.randint(0, 10, (2, 5)) for _ in range(4)]
    labels = [t.clone() for t in tokens]
    labels[2] = torch.full((2, 5), -100)
    return _loop(model, lambda step: (tokens[step], labels[step]), lambda out, step: out["loss"])


CASES += [
    Case("hunt15_supcon_anchor_without_a_positive", lambda: _supcon(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="supcon", cause="division-by-zero")),
    Case("hunt15_supcon_positive_count_clamped_healthy", lambda: _supcon(True), None),
    Case("hunt15_model_loss_with_every_label_ignored", lambda: _all_ignored(False),
         Expect("forward", "", "LanguageModel", step=2, op="aten.nll_loss_forward.default", marker="all ignored",
                cause="empty-reduction")),
    Case("hunt15_model_loss_over_a_clamped_count_healthy", lambda: _all_ignored(True), None),
]


# ================================================================ seventh round
# ---------------------------------------------------------------- an eps that float16 rounds to 0
class HalfPolicyHead(nn.Module):
    """A policy head run in float16 (a model cast with ``.half()``), taking log(p + eps) of its probabilities."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5).half()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.lin(x).softmax(-1)
        return torch.log(p + self.eps).float()  # producer: half log eps


def _half_eps(eps: float) -> Scenario:
    """At step 1 one logit is far above the others: their probabilities are 0 in float16, and 1e-8 added to 0
    is still 0 in float16 (its smallest subnormal is 6e-8; 1e-8 rounds down): log(0)."""
    torch.manual_seed(0)
    model = HalfPolicyHead(eps)
    xs = [torch.randn(3, 4).half() for _ in range(3)]

    def batch(step: int) -> tuple[torch.Tensor]:
        with torch.no_grad():
            model.lin.bias[0] = 30.0 if step == 1 else 0.0
        return (xs[step],)
    return _loop(model, batch, lambda log_p, step: -log_p.mean(), steps=3, lr=0.0)


CASES += [
    Case("hunt15_fp16_log_of_p_plus_an_eps_that_rounds_to_0", lambda: _half_eps(1e-8),
         Expect("forward", "", "HalfPolicyHead", step=1, op="aten.log.default", marker="half log eps",
                cause="log-domain", says=tuple((mode, "clamp to eps first (x.clamp_min(1e-4)) (in float16 an eps "
                                                      "below 3e-8, such as 1e-8, rounds to 0)")
                                               for mode in ("default", "defer", "full", "ops")))),
    Case("hunt15_fp16_log_of_p_plus_a_float16_eps_healthy", lambda: _half_eps(1e-4), None),
]
