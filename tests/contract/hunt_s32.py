"""hunt_s32, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Special functions: ``torch.logit`` without its eps, of a distillation teacher's probability that float32 rounded to 1
and of a calibration wrapper's own saturated sigmoid; ``torch.special.ndtri`` of a rank-gauss target transform whose
top rank is n / n; a Tobit likelihood ``log(ndtr(z))`` (or ``log(Normal(0, 1).cdf(z))``) of a censored sample far
in the tail, and an ordinal probit head's; the inverse softplus ``log(expm1(y))`` of a large target (``expm1``
overflows). Learned transforms: a Box-Cox layer whose lambda starts at 0 (``(y^l - 1) / l`` is 0 / 0), and its
one-``where`` fix (the discarded branch's gradient is still 0 * inf); a learned gamma correction ``x ** gamma`` (a
tensor exponent) of a mean-subtracted image. Pooling and norms: x-vector statistics pooling's ``std`` over the frames
of a one-frame utterance (its ``correction=0`` fix is calm: torch masks the backward of a std of 0);
``F.normalize(eps=0)`` of an empty caption's all-zero feature. Losses: a Charbonnier ``sqrt(d^2 + eps)`` with eps 0
against a zero-initialised residual head; float16 ``einsum`` attention without the ``1 / sqrt(d)`` scale; a
differentiable Kalman filter whose gain takes ``reciprocal(P + R)`` at a known initial state; DINO's teacher temperature
warmed up from 0 (the teacher's logits divided by 0).
Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributions import Normal
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- distillation in logit space: logit of a teacher's 1
def _logit_distill(eps: float | None) -> Scenario:
    """A student matches a teacher's multi-label probabilities in logit space (``mse(student, logit(teacher_p))``,
    the teacher's probabilities stored with the dataset). Step 2's batch holds a label the teacher is sure of:
    its probability is exactly 1.0 in float32 and ``logit(1)`` is inf. The twin passes ``eps=1e-6``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    xs = _batches(4, 6)
    teacher = [torch.rand(4, 3) * 0.9 + 0.05 for _ in range(4)]
    teacher[2][1, 2] = torch.sigmoid(torch.tensor(40.0))  # rounds to exactly 1.0

    def loss(out: torch.Tensor, step: int) -> torch.Tensor:
        target = torch.logit(teacher[step], eps=eps)  # producer: teacher logit
        return F.mse_loss(out, target)

    return _loop(model, lambda step: (xs[step],), loss)


# ---------------------------------------------------------------- a calibration wrapper: logit of its own sigmoid
class PlattCalibrated(nn.Module):
    """A binary classifier whose forward returns probabilities, wrapped for temperature scaling: the wrapper goes back
    to logits by ``logit(p)`` and divides them by a learned temperature."""

    def __init__(self, eps: float | None) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
        self.log_t, self.eps = nn.Parameter(torch.zeros(())), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.base(x)
        return torch.logit(p, eps=self.eps) / self.log_t.exp()  # producer: calibrated logit


def _calibration(eps: float | None) -> Scenario:
    """Step 2's batch holds an input 1000 times the usual scale: the classifier is sure, its sigmoid is exactly 1
    and the wrapper's ``logit(1)`` is inf. The twin clamps by ``eps=1e-6`` (better: the base returning logits)."""
    torch.manual_seed(0)
    model = PlattCalibrated(eps)
    xs, ys = _batches(6, 5), [torch.randint(0, 2, (6, 1)).float() for _ in range(4)]
    xs[2][3] *= 1000.0
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.binary_cross_entropy_with_logits(out, ys[step]))


# ---------------------------------------------------------------- rank-gauss targets: ndtri of rank n / n
def _rank_gauss(target: torch.Tensor, offset: float) -> torch.Tensor:
    ranks = target.argsort().argsort().float() + 1.0
    return torch.special.ndtri((ranks - offset) / len(target))  # producer: rank gauss


def _ndtri(offset: float) -> Scenario:
    """A regressor on skewed prices whose targets are rank-gauss transformed per batch: ``ndtri(rank / n)``, the top
    rank ``n / n`` is ``ndtri(1)`` = inf at the first step. The twin takes ``(rank - 0.5) / n``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    xs, prices = _batches(8, 4), [torch.rand(8).pow(4) * 1000 for _ in range(4)]
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.mse_loss(out.squeeze(-1), _rank_gauss(prices[step], offset)))


# ---------------------------------------------------------------- a Tobit likelihood: log(ndtr(z)) in the tail
def _tobit_nll(out: torch.Tensor, y: torch.Tensor, censored: torch.Tensor, form: str) -> torch.Tensor:
    mu, log_sigma = out.unbind(-1)
    sigma = log_sigma.exp()
    z = (y - mu) / sigma
    observed = -0.5 * z**2 - log_sigma
    if form == "log_ndtr":
        below = torch.special.log_ndtr(z)
    elif form == "ndtr":
        below = torch.log(torch.special.ndtr(z))  # producer: tobit log cdf
    else:
        below = torch.log(Normal(0.0, 1.0).cdf(z))  # producer: tobit normal cdf
    return -torch.where(censored, below, observed).mean()


def _tobit(form: str) -> Scenario:
    """A Tobit regression on sensor readings left-censored at the detection limit (the likelihood of a censored
    reading is ``P(Y <= limit)``). Step 2 holds a reading whose limit is 60 standard deviations below the prediction:
    the CDF (``special.ndtr``, or ``Normal(0, 1).cdf``) underflows to 0 and ``log(0)`` is -inf. The twin takes
    ``torch.special.log_ndtr``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2))
    xs, ys = _batches(6, 3), [torch.randn(6) * 0.5 for _ in range(4)]
    censored = [torch.tensor([False, True, False, False, True, False]) for _ in range(4)]
    ys[2][4] = -60.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: _tobit_nll(out, ys[step], censored[step], form))


class ProbitHead(nn.Module):
    """An ordinal probit head whose forward returns the log-probability that a sample is below each cutpoint."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.net, self.cuts, self.stable = nn.Linear(4, 1), nn.Parameter(torch.tensor([-1.0, 0.0, 1.0])), stable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.cuts - self.net(x)
        if self.stable:
            return torch.special.log_ndtr(z)
        return torch.log(Normal(0.0, 1.0).cdf(z))  # producer: probit head


def _probit(stable: bool) -> Scenario:
    """Step 2's batch holds an outlier 500 times the usual scale: its score is far past the lowest cutpoint, the
    CDF underflows to 0 and the head's ``log`` is -inf. The twin takes ``torch.special.log_ndtr``."""
    torch.manual_seed(0)
    model = ProbitHead(stable)
    xs, ys = _batches(5, 4), [torch.randint(0, 3, (5,)) for _ in range(4)]
    xs[2][1] = 500.0 * model.net.weight.detach()[0].sign()  # (an outlier along the score's direction)
    return _loop(model, lambda step: (xs[step],), lambda out, step: -out.gather(1, ys[step][:, None]).mean())


# ---------------------------------------------------------------- inverse softplus of a large target: expm1 overflow
def _inv_softplus(y: torch.Tensor, stable: bool) -> torch.Tensor:
    if stable:
        return y + torch.log(-torch.expm1(-y))
    return torch.log(torch.expm1(y))  # producer: inverse softplus


def _rates(stable: bool) -> Scenario:
    """A head whose rate is ``softplus(raw)`` is fitted on the raw scale: its target ``log(expm1(rate))``. Rates are
    counts per hour, step 2's batch holds a burst of 120: ``expm1(120)`` is inf in float32. The twin writes the
    inverse as ``y + log(-expm1(-y))``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    xs, rates = _batches(5, 4), [torch.rand(5) * 8 + 0.5 for _ in range(4)]
    rates[2][3] = 120.0
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.mse_loss(out.squeeze(-1), _inv_softplus(rates[step], stable)))


# ---------------------------------------------------------------- Box-Cox with a learned lambda that starts at 0
class BoxCox(nn.Module):
    """A learned Box-Cox transform of positive features, ``(y^lambda - 1) / lambda`` (``log y`` at lambda 0),
    lambda starting at 0: the log transform."""

    def __init__(self, n: int, guard: str) -> None:
        super().__init__()
        self.lam, self.guard = nn.Parameter(torch.zeros(n)), guard

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        lam = self.lam
        if self.guard == "none":
            return (y**lam - 1) / lam  # producer: boxcox plain
        small = lam.abs() < 1e-4
        if self.guard == "where":
            return torch.where(small, torch.log(y), (y**lam - 1) / lam)  # producer: boxcox where
        safe = torch.where(small, torch.ones_like(lam), lam)
        return torch.where(small, torch.log(y), (y**safe - 1) / safe)


def _boxcox(guard: str) -> Scenario:
    """A demand model with a learned Box-Cox front on its positive features. Written plainly the first forward is
    ``0 / 0``. Guarded by one ``torch.where`` the forward is finite, but the discarded branch's backward is
    ``0 * (1 / 0)``: NaN in lambda's gradient. The twin replaces lambda inside the discarded branch too (the double
    ``where``)."""
    torch.manual_seed(0)
    model = nn.Sequential(BoxCox(4, guard), nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    xs, ys = [torch.rand(8, 4) * 50 + 1 for _ in range(4)], _batches(8, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- x-vector statistics pooling over one frame
class StatsPool(nn.Module):
    """x-vector statistics pooling: the mean and the standard deviation of each channel over the frames."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.style == "std":
            std = h.std(-1)  # producer: pool std
        elif self.style == "biased":
            std = h.std(-1, correction=0)
        else:
            std = (h.var(-1, correction=0) + 1e-5).sqrt()
        return torch.cat([h.mean(-1), std], -1)


class XVector(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.frames = nn.Sequential(nn.Conv1d(8, 16, 1), nn.ReLU())
        self.pool = StatsPool(style)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.frames(x)))


def _xvector(style: str) -> Scenario:
    """A speaker classifier over MFCC chunks; step 2's chunk is the one-frame tail of an utterance. ``std`` with
    Bessel's correction over one frame is 0 / 0. The twins: ``correction=0`` (a std of 0, whose backward torch
    masks to 0: a near miss that must stay calm) and ``sqrt(var + 1e-5)``, as SpeechBrain pools."""
    torch.manual_seed(0)
    model = XVector(style)
    xs, ys = [torch.randn(3, 8, 10) for _ in range(4)], [torch.randint(0, 4, (3,)) for _ in range(4)]
    xs[2] = torch.randn(3, 8, 1)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- a learned gamma correction of a normalised image
class LearnedGamma(nn.Module):
    """A learned per-channel gamma correction in front of a CNN: ``x ** gamma``."""

    def __init__(self, before_norm: bool) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((3, 1, 1), 1.0 / 2.2))
        self.before_norm = before_norm
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.before_norm:
            return x.clamp(min=1e-6) ** self.gamma - self.mean
        return (x - self.mean) ** self.gamma  # producer: gamma pow


def _gamma(before_norm: bool) -> Scenario:
    """The correction applied after the mean is subtracted: any pixel darker than the mean is a negative base, and
    a negative base to a fractional power is NaN at the first forward. The twin corrects the [0, 1] image first."""
    torch.manual_seed(0)
    model = nn.Sequential(LearnedGamma(before_norm), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.rand(1, 3, 6, 6))
    xs, ys = [torch.rand(2, 3, 6, 6) for _ in range(4)], [torch.randint(0, 2, (2,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- Charbonnier against a zero-initialised residual head
class ResidualDenoiser(nn.Module):
    """A denoiser predicting the residual; its last convolution zero-initialised (the output starts as the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))
        nn.init.zeros_(self.body[2].weight)
        nn.init.zeros_(self.body[2].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _charbonnier_loss(pred: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sqrt((pred - target) ** 2 + eps).mean()  # producer: charbonnier


def _charbonnier(eps: float) -> Scenario:
    """The noisy crops hold clean pixels (the noise masked to the image's texture): at the first step the output is
    the input, the difference is exactly 0 there and ``sqrt(0)``'s backward is ``g / 0``. The twin keeps the
    Charbonnier eps of 1e-6."""
    torch.manual_seed(0)
    model = ResidualDenoiser()
    clean = _batches(2, 1, 6, 6)
    noisy = [c + 0.1 * torch.randn_like(c) * (torch.rand_like(c) > 0.5) for c in clean]
    return _loop(model, lambda step: (noisy[step],), lambda out, step: _charbonnier_loss(out, clean[step], eps))


# ---------------------------------------------------------------- float16 einsum attention without the scale
class HalfAttention(nn.Module):
    """Single-head attention written with einsum, run in float16 (a model cast by ``.half()`` for memory)."""

    def __init__(self, d: int, scaled: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.d, self.scaled = nn.Linear(d, 3 * d), nn.Linear(d, d), d, scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.scaled:
            q = q * self.d**-0.5
        scores = torch.einsum("bqd,bkd->bqk", q, k)  # producer: einsum scores
        return self.out(torch.einsum("bqk,bkd->bqd", scores.softmax(-1), v))


def _einsum_half(scaled: bool) -> Scenario:
    """Tokens of 64 features; step 2's batch holds embeddings 150 times the usual scale (an unnormalised feature
    column): ``q . k`` passes float16's 65504 and the softmax reads inf. The twin scales q by ``1 / sqrt(d)``."""
    torch.manual_seed(0)
    model = nn.Sequential(HalfAttention(64, scaled), nn.LayerNorm(64)).half()
    xs = [torch.randn(2, 5, 64).half() for _ in range(4)]
    xs[2] = xs[2] * 150
    return _loop(model, lambda step: (xs[step],), lambda out, step: out.float().pow(2).mean(), lr=1e-3)


# ---------------------------------------------------------------- F.normalize(eps=0) of a dead sample
def _supcon(features: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    z = F.normalize(features, dim=-1, eps=eps)  # producer: normalize eps 0
    sim = z @ z.T / 0.1
    sim = sim - torch.eye(len(z)) * 1e4
    positives = (labels[:, None] == labels[None, :]).float() - torch.eye(len(z))
    log_prob = sim - torch.logsumexp(sim, 1, keepdim=True)
    return -((positives * log_prob).sum(1) / positives.sum(1).clamp(min=1)).mean()


class CaptionEncoder(nn.Module):
    """Token features by a small MLP, masked mean pooling over the caption's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) * mask[..., None]
        return h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)


def _normalize(eps: float) -> Scenario:
    """Supervised contrastive learning on caption embeddings; step 2's batch holds an empty caption (every token
    masked): its pooled feature is all 0 and ``F.normalize(eps=0)`` divides 0 by 0. The twin keeps the default
    eps of 1e-12."""
    torch.manual_seed(0)
    model = CaptionEncoder()
    xs, labels = _batches(6, 5, 6), [torch.tensor([0, 0, 1, 1, 2, 2]) for _ in range(4)]
    masks = [torch.ones(6, 5) for _ in range(4)]
    masks[2][4] = 0.0
    return _loop(model, lambda step: (xs[step], masks[step]), lambda out, step: _supcon(out, labels[step], eps))


# ---------------------------------------------------------------- a differentiable Kalman filter's gain at P = 0
class LearnedKalman(nn.Module):
    """A 1-D Kalman filter over a sequence; a network gives each measurement's noise variance R (by ReLU)."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.noise = nn.Sequential(nn.Linear(2, 1), nn.ReLU())
        self.q, self.floor = nn.Parameter(torch.tensor(0.1)), floor

    def forward(self, z: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        x, p = z[:, 0], torch.zeros_like(z[:, 0])  # the start is known exactly: P = 0
        estimates = []
        for t in range(1, z.shape[1]):
            r = self.noise(feats[:, t]).squeeze(-1) + self.floor
            gain = p * torch.reciprocal(p + r)  # producer: kalman gain
            x = x + gain * (z[:, t] - x)
            p = (1 - gain) * p + self.q.abs()
            estimates.append(x)
        return torch.stack(estimates, 1)


def _kalman(floor: float) -> Scenario:
    """Tracking with a learned measurement noise; at the first update P is 0, and where the noise net's ReLU gives
    R = 0 the gain is ``0 * (1 / 0)``. Step 2's sequences carry a sensor flag that drives R to 0. The twin adds
    1e-4 to R."""
    torch.manual_seed(0)
    model = LearnedKalman(floor)
    zs, truths = _batches(3, 6), _batches(3, 5)
    feats = [torch.rand(3, 6, 2) for _ in range(4)]
    feats[2][1] = -20.0
    with torch.no_grad():
        model.noise[0].weight.fill_(0.1)
        model.noise[0].bias.fill_(0.5)
    return _loop(model, lambda step: (zs[step], feats[step]), lambda out, step: F.mse_loss(out, truths[step]))


# ---------------------------------------------------------------- DINO with a teacher temperature warmed up from 0
def _dino(start: float) -> Scenario:
    """DINO self-distillation: the student's log-softmax at 0.1 against the teacher's centred softmax at a temperature
    warmed up linearly (``linspace(warmup_temp, 0.04, 3)``, then 0.04). Set to start the warmup at 0, the first
    step's teacher logits are divided by 0: +-inf, and the softmax of a row holding both is NaN. The twin starts the
    warmup at 0.04, as DINO's default."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
    teacher = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 8))
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad_(False)
    model = nn.ModuleDict({"student": student, "teacher": teacher})
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    temps = [float(t) for t in torch.linspace(start, 0.04, 3)] + [0.04]
    views = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(4)]
    center = torch.zeros(8)

    def run() -> list[torch.Tensor]:
        nonlocal center
        losses = []
        for step in range(4):
            a, b = views[step]
            with torch.no_grad():
                t_out = teacher(a)
                t_prob = F.softmax((t_out - center) / temps[step], -1)  # producer: dino teacher temp
            loss = -(t_prob * F.log_softmax(student(b) / 0.1, -1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pt, ps in zip(teacher.parameters(), student.parameters()):
                    pt.mul_(0.996).add_(ps.detach(), alpha=0.004)
                center = 0.9 * center + 0.1 * t_out.mean(0)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s32_logit_of_a_teacher_probability_of_1", lambda: _logit_distill(None),
         Expect("forward", None, step=2, op="aten.logit.default", marker="teacher logit")),
    Case("hunt_s32_logit_of_a_teacher_with_eps_healthy", lambda: _logit_distill(1e-6), None),
    Case("hunt_s32_calibration_logit_of_a_saturated_sigmoid", lambda: _calibration(None),
         Expect("forward", "", "PlattCalibrated", step=2, op="aten.logit.default", marker="calibrated logit")),
    Case("hunt_s32_calibration_logit_with_eps_healthy", lambda: _calibration(1e-6), None),
    Case("hunt_s32_rank_gauss_ndtri_of_the_top_rank", lambda: _ndtri(0.0),
         Expect("forward", None, step=0, op="aten.special_ndtri.default", marker="rank gauss",
                cause="log-domain")),
    Case("hunt_s32_rank_gauss_half_offset_healthy", lambda: _ndtri(0.5), None),
    Case("hunt_s32_tobit_log_of_an_underflowed_cdf", lambda: _tobit("ndtr"),
         Expect("forward", None, step=2, op="aten.log.default", marker="tobit log cdf", cause="log-domain")),
    Case("hunt_s32_tobit_log_of_an_underflowed_normal_cdf", lambda: _tobit("normal"),
         Expect("forward", None, step=2, op="aten.log.default", marker="tobit normal cdf", cause="log-domain")),
    Case("hunt_s32_tobit_log_ndtr_healthy", lambda: _tobit("log_ndtr"), None),
    Case("hunt_s32_probit_head_log_of_an_underflowed_normal_cdf", lambda: _probit(False),
         Expect("forward", "", "ProbitHead", step=2, op="aten.log.default", marker="probit head",
                cause="log-domain")),
    Case("hunt_s32_probit_head_log_ndtr_healthy", lambda: _probit(True), None),
    Case("hunt_s32_inverse_softplus_expm1_overflow", lambda: _rates(False),
         Expect("forward", None, step=2, op="aten.expm1.default", marker="inverse softplus")),
    Case("hunt_s32_inverse_softplus_stable_healthy", lambda: _rates(True), None),
    Case("hunt_s32_boxcox_lambda_0_plain", lambda: _boxcox("none"),
         Expect("forward", "0", "BoxCox", step=0, op="aten.div.Tensor", marker="boxcox plain",
                cause="division-by-zero")),
    Case("hunt_s32_boxcox_lambda_0_one_where", lambda: _boxcox("where"),
         Expect("backward", "0", "BoxCox", step=0, op="aten.div.Tensor", marker="boxcox where")),
    Case("hunt_s32_boxcox_double_where_healthy", lambda: _boxcox("double"), None),
    Case("hunt_s32_xvector_std_of_a_one_frame_chunk", lambda: _xvector("std"),
         Expect("forward", "pool", "StatsPool", step=2, op="aten.std.correction", marker="pool std")),
    Case("hunt_s32_xvector_biased_std_of_one_frame_healthy", lambda: _xvector("biased"), None,
         note="torch's std backward masks a std of 0 (its gradient is 0 there), so correction=0 alone is safe"),
    Case("hunt_s32_xvector_var_plus_eps_healthy", lambda: _xvector("eps"), None),
    Case("hunt_s32_learned_gamma_of_a_negative_pixel", lambda: _gamma(False),
         Expect("forward", "0", "LearnedGamma", step=0, op="aten.pow.Tensor_Tensor", marker="gamma pow")),
    Case("hunt_s32_learned_gamma_before_normalisation_healthy", lambda: _gamma(True), None),
    Case("hunt_s32_charbonnier_eps_0_on_a_zero_initialised_head", lambda: _charbonnier(0.0),
         Expect("backward", None, step=0, op="aten.div.Tensor", marker="charbonnier", cause="sqrt-domain")),
    Case("hunt_s32_charbonnier_with_eps_healthy", lambda: _charbonnier(1e-6), None),
    Case("hunt_s32_float16_einsum_attention_unscaled", lambda: _einsum_half(False),
         Expect("forward", "0", "HalfAttention", step=2, op="aten.bmm.default", marker="einsum scores")),
    Case("hunt_s32_float16_einsum_attention_scaled_healthy", lambda: _einsum_half(True), None),
    Case("hunt_s32_normalize_eps_0_of_a_dead_feature", lambda: _normalize(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="normalize eps 0", cause="division-by-zero")),
    Case("hunt_s32_normalize_default_eps_healthy", lambda: _normalize(1e-12), None),
    Case("hunt_s32_kalman_gain_reciprocal_at_p_0", lambda: _kalman(0.0),
         Expect("forward", "", "LearnedKalman", step=2, op="aten.reciprocal.default", marker="kalman gain")),
    Case("hunt_s32_kalman_noise_floored_healthy", lambda: _kalman(1e-4), None),
    Case("hunt_s32_dino_teacher_temperature_warmed_up_from_0", lambda: _dino(0.0),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="dino teacher temp", cause="division-by-zero")),
    Case("hunt_s32_dino_teacher_temperature_from_default_healthy", lambda: _dino(0.04), None),
]
