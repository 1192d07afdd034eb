"""hunt_s34, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Likelihoods and losses: a Dirichlet regression of rock compositions whose target holds a zero share
(``xlogy(a - 1, 0)``), fixed by the Smithson-Verkuilen squeeze; a binary-latent VAE whose Bernoulli KL is written
``q log(q / p) + (1 - q) log(...)`` of a code saturated to 1 (fixed by ``kl_divergence`` on logits); a ListMLE
ranking loss over padded documents masked with ``-inf`` (``-inf - -inf``); SI-SDR of a silent reference segment.
Finance and control: a Sharpe-ratio loss over a market holiday (all returns 0), plain (``0 / 0``) and with the
``std() + eps`` 'fix' whose backward is still ``0 / 0``, fixed by ``sqrt(var + eps)``; a log-barrier on an actuator
limit the policy's action oversteps. Geometry: spherical interpolation of two identical latents (``sin(0)``); the
arc-length parametrisation of a tap stroke; a stereo depth head of a zero disparity. Optimizers: a hand-written
Shampoo whose inverse fourth root meets a zero eigenvalue of a row never used. Healthy idioms: a hard-concrete
gate whose uniform sample is exactly 0 (an intermediate ``-inf`` that the sigmoid absorbs), and a ``layer_norm``
over one feature in float16. Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.hunt_s33 import BagOfWords
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a Dirichlet regression of a composition
class CompositionHead(nn.Module):
    """Predicts Dirichlet concentrations of three mineral shares from five assay features."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.net(x)) + 0.1


def _dirichlet(squeeze: bool) -> Scenario:
    """Dirichlet NLL of measured shares; step 2 holds a sample with no quartz (a share of exactly 0): the density's
    ``xlogy(a - 1, 0)`` is infinite. The twin squeezes the shares into the open simplex, ``(y (n - 1) + 1/k) / n``."""
    torch.manual_seed(0)
    model = CompositionHead()
    xs = _batches(6, 5)
    ys = [torch.softmax(torch.randn(6, 3), -1) for _ in range(4)]
    ys[2][1] = torch.tensor([0.0, 0.7, 0.3])

    def nll(alpha: torch.Tensor, step: int) -> torch.Tensor:
        y = ys[step]
        if squeeze:
            y = (y * (len(y) - 1) + 1 / 3) / len(y)
        dist = torch.distributions.Dirichlet(alpha, validate_args=False)
        return -dist.log_prob(y).mean()  # producer: dirichlet share

    return _loop(model, lambda step: (xs[step],), nll)


# ---------------------------------------------------------------- a Beta regression of click-through rates
class RateHead(nn.Module):
    """Beta regression of an ad's click-through rate: concentrations in (0.1, 0.6), a U-shaped prior over rates (most
    ads are clicked almost never or almost always)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.sigmoid(self.net(x)) + 0.1


def _beta_rate(squeeze: bool) -> Scenario:
    """Step 1's batch holds an ad never clicked (a rate of exactly 0): ``Beta.log_prob`` takes ``xlogy(a - 1, 0)``
    with ``a - 1 < 0``, +inf. The twin squeezes the rates into (0, 1) as the Dirichlet's twin does."""
    torch.manual_seed(0)
    model = RateHead()
    xs, rates = _batches(5, 4), [torch.rand(5) * 0.9 + 0.05 for _ in range(4)]
    rates[1][2] = 0.0

    def nll(conc: torch.Tensor, step: int) -> torch.Tensor:
        y = (rates[step] * 4 + 0.5) / 5 if squeeze else rates[step]
        dist = torch.distributions.Beta(conc[:, 0], conc[:, 1], validate_args=False)
        return -dist.log_prob(y).mean()  # producer: beta rate

    return _loop(model, lambda step: (xs[step],), nll)


# ---------------------------------------------------------------- a binary-latent VAE with a hand-written KL
class BinaryVAE(nn.Module):
    """Encoder to 6 Bernoulli codes (relaxed by their probabilities), decoder back to 8 features."""

    def __init__(self, library_kl: bool) -> None:
        super().__init__()
        self.enc, self.dec, self.library_kl = nn.Linear(8, 6), nn.Linear(6, 8), library_kl

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.enc(x)
        q = torch.sigmoid(logits)
        if self.library_kl:
            prior = torch.distributions.Bernoulli(probs=torch.full_like(q, 0.5))
            kl = torch.distributions.kl_divergence(torch.distributions.Bernoulli(logits=logits), prior)
        else:
            kl = q * torch.log(q / 0.5) + (1 - q) * torch.log((1 - q) / 0.5)  # producer: bernoulli kl
        return self.dec(q), kl.sum(-1).mean()


def _bernoulli_vae(library_kl: bool) -> Scenario:
    """Step 2's batch holds a reading 1000 times its scale: a code's logit passes 17, ``sigmoid`` rounds to exactly 1
    and ``log(1 - q)`` is ``log(0)`` (then ``0 * -inf``). The twin takes torch's KL on the logits."""
    torch.manual_seed(0)
    model = BinaryVAE(library_kl)
    xs = _batches(4, 8)
    xs[2][1, 3] = 1000.0

    def loss(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        recon, kl = out
        return F.mse_loss(recon, xs[step]) + 0.1 * kl

    return _loop(model, lambda step: (xs[step],), loss)


# ---------------------------------------------------------------- ListMLE over padded documents
class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, docs: torch.Tensor) -> torch.Tensor:
        return self.net(docs).squeeze(-1)


def _listmle(fill: str) -> Scenario:
    """ListMLE: ``sum_i s_i - logcumsumexp(s_i..s_n)`` over the documents in relevance order; queries are padded to
    5 documents and the padding's scores masked with ``-inf`` so that they drop out of the sums. A query with 2 padded
    slots has a suffix of only ``-inf``: ``-inf - (-inf)`` is NaN. The twin masks with ``finfo.min`` and zeroes the
    padding's terms."""
    torch.manual_seed(0)
    model = Scorer()
    docs = [torch.randn(3, 5, 4) for _ in range(4)]
    valid = [torch.ones(3, 5, dtype=torch.bool) for _ in range(4)]
    valid[2][1, 3:] = False

    def loss(scores: torch.Tensor, step: int) -> torch.Tensor:
        mask = valid[step]
        low = float("-inf") if fill == "inf" else torch.finfo(scores.dtype).min
        s = scores.masked_fill(~mask, low)
        suffix = torch.logcumsumexp(s.flip(-1), -1).flip(-1)
        terms = s - suffix  # producer: listmle suffix
        return -(terms * mask if fill == "finfo" else terms).sum(-1).mean()

    return _loop(model, lambda step: (docs[step],), loss)


# ---------------------------------------------------------------- SI-SDR of a silent reference
class Enhancer(nn.Module):
    """A tiny speech enhancer: a residual 1-D conv over 64-sample chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 1, 5, padding=2)

    def forward(self, noisy: torch.Tensor) -> torch.Tensor:
        return noisy + self.conv(noisy[:, None]).squeeze(1)


def _si_sdr(eps: float) -> Scenario:
    """Negative SI-SDR against the clean reference; step 2 holds a chunk of pure silence between two utterances (the
    clean reference is all 0): its projection ``<est, s> / ||s||^2`` is ``0 / 0``. The twin adds the usual eps."""
    torch.manual_seed(0)
    model = Enhancer()
    clean = _batches(3, 64)
    noisy = [c + 0.1 * torch.randn(3, 64) for c in clean]
    clean[2][0] = 0.0

    def loss(est: torch.Tensor, step: int) -> torch.Tensor:
        s = clean[step]
        alpha = (est * s).sum(-1, keepdim=True) / ((s * s).sum(-1, keepdim=True) + eps)  # producer: si-sdr scale
        target, noise = alpha * s, est - alpha * s
        ratio = ((target**2).sum(-1) + eps) / ((noise**2).sum(-1) + eps)
        return -10 * torch.log10(ratio).mean()

    return _loop(model, lambda step: (noisy[step],), loss, lr=1e-3)


# ---------------------------------------------------------------- a Sharpe-ratio loss over a market holiday
class Allocator(nn.Module):
    """Long-short weights of 4 assets from 6 features."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _sharpe(form: str) -> Scenario:
    """Negative Sharpe ratio of a week of daily portfolio returns; step 2's week is a holiday week: every asset's
    return is 0, so is every portfolio return, and the standard deviation is 0. ``mean / std`` is ``0 / 0``; the
    common patch ``std() + eps`` makes the forward finite but ``std``'s backward is ``(x - mean) / std``, ``0 / 0``
    again. The twin takes ``sqrt(var + eps)``."""
    torch.manual_seed(0)
    model = Allocator()
    xs = _batches(5, 6)
    returns = [0.01 * torch.randn(5, 4) for _ in range(4)]
    returns[2].zero_()

    def loss(weights: torch.Tensor, step: int) -> torch.Tensor:
        daily = (weights * returns[step]).sum(-1)
        if form == "plain":
            return -daily.mean() / daily.std()  # producer: sharpe plain
        if form == "std_eps":
            return -daily.mean() / (daily.std() + 1e-8)
        return -daily.mean() / torch.sqrt(daily.var() + 1e-8)

    return _loop(model, lambda step: (xs[step],), loss)


# ---------------------------------------------------------------- a log barrier on an actuator limit
class Controller(nn.Module):
    """A policy whose action is a torque, bounded in the plant by ``U_MAX``."""

    U_MAX = 2.0

    def __init__(self, squash: bool) -> None:
        super().__init__()
        self.net, self.squash = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1)), squash

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        u = self.net(state).squeeze(-1)
        return 0.99 * self.U_MAX * torch.tanh(u / self.U_MAX) if self.squash else u


def _barrier(squash: bool) -> Scenario:
    """Tracking cost plus ``-log(U_MAX - |u|)``, a log barrier that keeps the torque inside its limit. Step 2 holds a
    state far out of the training range; the unbounded head asks for a torque beyond the limit and the barrier's
    ``log`` is of a negative number. The twin squashes the action inside the limit (``tanh``)."""
    torch.manual_seed(0)
    model = Controller(squash)
    states = [0.1 * torch.randn(4, 3) for _ in range(4)]
    with torch.no_grad():
        direction = model.net[2].weight[0] @ model.net[0].weight
    states[2][1] = 40.0 * direction.sign()
    targets = [0.1 * torch.randn(4) for _ in range(4)]

    def cost(u: torch.Tensor, step: int) -> torch.Tensor:
        barrier = -torch.log(Controller.U_MAX - u.abs())  # producer: log barrier
        return F.mse_loss(u, targets[step]) + 0.01 * barrier.mean()

    return _loop(model, lambda step: (states[step],), cost)


# ---------------------------------------------------------------- spherical interpolation of identical latents
class LatentMixer(nn.Module):
    """Encodes to the unit sphere and mixes each latent with a partner's by slerp (latent-space mixup)."""

    def __init__(self, guard: str) -> None:
        super().__init__()
        self.enc, self.head, self.guard = nn.Linear(6, 4), nn.Linear(4, 3), guard

    def forward(self, x: torch.Tensor, partner: torch.Tensor, t: float) -> torch.Tensor:
        z = F.normalize(self.enc(x), dim=-1)
        a, b = z, z[partner]
        cos = (a * b).sum(-1, keepdim=True)
        if self.guard == "clamp":  # acos is steep at 1: keep the cosine strictly inside (-1, 1)
            cos = cos.clamp(-1 + 1e-6, 1 - 1e-6)
        omega = torch.acos(cos.clamp(-1, 1))  # producer: slerp angle
        if self.guard == "where":  # the usual guard: nearly parallel latents are interpolated linearly
            near = omega < 1e-4
            safe = torch.where(near, torch.ones_like(omega), omega)
            mixed = torch.where(near, (1 - t) * a + t * b,
                                (torch.sin((1 - t) * safe) * a + torch.sin(t * safe) * b) / torch.sin(safe))
        else:
            mixed = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)  # producer: slerp
        return self.head(mixed)


def _slerp(guard: str) -> Scenario:
    """Latent mixup by slerp with a shuffled partner; step 2's partner list maps a sample onto a copy of itself (a
    duplicated sample): the angle is 0 and ``sin(0) / sin(0)`` is ``0 / 0``. The usual guard (linear interpolation
    of near-parallel pairs, a safe angle on both sides of the ``where``) makes the forward finite, but the cosine is
    exactly 1 and ``acos``'s backward there is ``-1 / sqrt(0)``: the ``where``'s zero gradient times ``-inf`` is NaN.
    The twin keeps the cosine strictly inside (-1, 1)."""
    torch.manual_seed(0)
    model = LatentMixer(guard)
    xs, ys = _batches(4, 6), [torch.randint(0, 3, (4,)) for _ in range(4)]
    partners = [torch.tensor([1, 2, 3, 0]) for _ in range(4)]
    xs[2][3] = xs[2][0]
    partners[2] = torch.tensor([3, 2, 1, 0])

    def loss(logits: torch.Tensor, step: int) -> torch.Tensor:
        return F.cross_entropy(logits, ys[step])

    return _loop(model, lambda step: (xs[step], partners[step], 0.3), loss)


# ---------------------------------------------------------------- arc-length parametrisation of a tap stroke
class StrokeEncoder(nn.Module):
    """Encodes a pen stroke of 8 points with their arc-length position ``t`` in [0, 1]."""

    def __init__(self, guard: bool) -> None:
        super().__init__()
        self.net, self.guard = nn.Sequential(nn.Linear(8 * 3, 16), nn.ReLU(), nn.Linear(16, 4)), guard

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        seg = (points[:, 1:] - points[:, :-1]).norm(dim=-1)
        length = torch.cat([torch.zeros_like(seg[:, :1]), seg.cumsum(-1)], -1)
        total = length[:, -1:]
        if self.guard:
            total = total.clamp_min(1e-6)
        t = length / total  # producer: arc length
        return self.net(torch.cat([points, t[..., None]], -1).flatten(1))


def _stroke(guard: bool) -> Scenario:
    """Sketch classification; step 2 holds a tap, a stroke whose 8 points are one point: its length is 0 and the
    arc-length position is ``0 / 0``. The twin floors the length."""
    torch.manual_seed(0)
    model = StrokeEncoder(guard)
    strokes = [torch.randn(4, 8, 2).cumsum(1) for _ in range(4)]
    strokes[2][2] = strokes[2][2, :1]
    ys = [torch.randint(0, 4, (4,)) for _ in range(4)]
    return _loop(model, lambda step: (strokes[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- stereo depth from a zero disparity
class DisparityHead(nn.Module):
    """Predicts a (non-negative) disparity per patch from 8 matching-cost features."""

    def __init__(self, floor: float) -> None:
        super().__init__()
        self.net, self.floor = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.ReLU()), floor

    def forward(self, cost: torch.Tensor) -> torch.Tensor:
        disparity = self.net(cost).squeeze(-1) + self.floor
        return 0.5 * 700.0 / disparity  # producer: depth from disparity


def _stereo(floor: float) -> Scenario:
    """Depth supervised by lidar, ``depth = baseline * focal / disparity``; step 2's batch holds a textureless patch
    whose matching costs drive the ReLU head to a disparity of exactly 0: the depth is ``350 / 0`` = inf. The twin
    adds a minimum disparity."""
    torch.manual_seed(0)
    model = DisparityHead(floor)
    costs = [torch.randn(4, 8) for _ in range(4)]
    with torch.no_grad():
        model.net[2].bias.fill_(1.0)
        direction = model.net[2].weight[0] @ model.net[0].weight
    costs[2][1] = -30.0 * direction.sign()
    lidar = [torch.rand(4) * 50 + 300 for _ in range(4)]
    return _loop(model, lambda step: (costs[step],), lambda depth, step: F.l1_loss(depth, lidar[step]), lr=1e-4)


# ---------------------------------------------------------------- a hand-written Shampoo
class Shampoo(torch.optim.Optimizer):
    """Shampoo for matrices: ``L += G G^T``, ``R += G^T G``, update ``L^-1/4 G R^-1/4``."""

    def __init__(self, params, lr: float, eps: float) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @staticmethod
    def _inv_root(m: torch.Tensor, eps: float) -> torch.Tensor:
        vals, vecs = torch.linalg.eigh(m)
        root = (vals.clamp_min(0) + eps) ** -0.25  # producer: shampoo root
        return vecs @ torch.diag(root) @ vecs.T

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if p.dim() == 2 else p.grad[:, None]
                state = self.state[p]
                if not state:
                    state["L"], state["R"] = g.new_zeros(g.shape[0], g.shape[0]), g.new_zeros(g.shape[1], g.shape[1])
                state["L"] += g @ g.T
                state["R"] += g.T @ g
                update = self._inv_root(state["L"], group["eps"]) @ g @ self._inv_root(state["R"], group["eps"])
                p.sub_(group["lr"] * update.view_as(p))


def _shampoo(eps: float) -> Scenario:
    """A bag-of-words classifier trained by a hand-written Shampoo without its epsilon (the paper's 'exact' root):
    the embedding's rows of tokens no batch used yet have a gradient of 0, its ``L`` has zero eigenvalues and
    ``0 ** -0.25`` is inf at the first step. The twin keeps an epsilon of 1e-6."""
    torch.manual_seed(0)
    model = BagOfWords()
    tokens, ys = [torch.randint(0, 8, (4, 5)) for _ in range(4)], [torch.randint(0, 2, (4,)) for _ in range(4)]
    opt = Shampoo(model.parameters(), lr=0.01, eps=eps)
    return _loop(model, lambda step: (tokens[step],), lambda out, step: F.cross_entropy(out, ys[step]), opt=opt)


# ---------------------------------------------------------------- healthy idioms
class HardConcreteGate(nn.Module):
    """Louizos et al.'s L0 gate: ``s = sigmoid((log u - log(1 - u) + log_alpha) / beta)``, stretched and clamped."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.log_alpha, self.lin = nn.Parameter(torch.zeros(d)), nn.Linear(d, 2)

    def forward(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid((torch.log(u) - torch.log(1 - u) + self.log_alpha) / (2 / 3))
        gate = (s * 1.2 - 0.1).clamp(0, 1)
        return self.lin(x * gate)


def _hard_concrete() -> Scenario:
    """The uniform noise of step 2 holds an exact 0 (``torch.rand`` can give it): ``log(0)`` is ``-inf``, the
    sigmoid takes it to 0 and the gate closes, as the method intends; nothing is wrong."""
    torch.manual_seed(0)
    model = HardConcreteGate(6)
    xs, ys = _batches(4, 6), [torch.randint(0, 2, (4,)) for _ in range(4)]
    us = [torch.rand(6) * 0.98 + 0.01 for _ in range(4)]
    us[2][3] = 0.0
    return _loop(model, lambda step: (xs[step], us[step]), lambda out, step: F.cross_entropy(out, ys[step]))


class HalfScalarNorm(nn.Module):
    """A float16 tabular model whose per-feature ``LayerNorm`` normalises a single value (its variance is 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(1), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.norm(x[:, :1]), x[:, 1:]], -1))


def _half_scalar_norm() -> Scenario:
    torch.manual_seed(0)
    model = HalfScalarNorm().half()
    xs, ys = [b.half() for b in _batches(4, 5)], [torch.randint(0, 2, (4,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out.float(), ys[step]))


CASES = [
    Case("hunt_s34_dirichlet_composition_with_a_zero_share", lambda: _dirichlet(False),
         Expect("forward", None, step=2, op="aten.xlogy.Tensor", marker="dirichlet share", cause="log-domain")),
    Case("hunt_s34_dirichlet_composition_squeezed_healthy", lambda: _dirichlet(True), None),
    Case("hunt_s34_beta_regression_of_a_rate_of_0", lambda: _beta_rate(False),
         Expect("forward", None, step=1, op="aten.xlogy.Tensor", marker="beta rate", cause="log-domain",
                says=(("default", "xlogy got 1 zero and 0 negatives"), ("ops", "+inf where x < 0"),
                      ("full", "made 1 +inf from finite inputs")))),
    Case("hunt_s34_beta_regression_rates_squeezed_healthy", lambda: _beta_rate(True), None),
    Case("hunt_s34_bernoulli_kl_by_hand_of_a_saturated_code", lambda: _bernoulli_vae(False),
         Expect("forward", "", "BinaryVAE", step=2, op="aten.log.default", marker="bernoulli kl",
                cause="log-domain")),
    Case("hunt_s34_bernoulli_kl_divergence_on_logits_healthy", lambda: _bernoulli_vae(True), None),
    Case("hunt_s34_listmle_padding_masked_with_minus_inf", lambda: _listmle("inf"),
         Expect("forward", None, step=2, op="aten.sub.Tensor", marker="listmle suffix")),
    Case("hunt_s34_listmle_padding_masked_with_finfo_min_healthy", lambda: _listmle("finfo"), None),
    Case("hunt_s34_si_sdr_of_a_silent_reference", lambda: _si_sdr(0.0),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="si-sdr scale", cause="division-by-zero")),
    Case("hunt_s34_si_sdr_with_eps_healthy", lambda: _si_sdr(1e-8), None),
    Case("hunt_s34_sharpe_ratio_of_a_holiday_week", lambda: _sharpe("plain"),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="sharpe plain", cause="division-by-zero",
                says=tuple((mode, "divided by a std of 0") for mode in ("default", "defer", "full", "ops")))),
    Case("hunt_s34_sharpe_ratio_std_plus_eps_healthy", lambda: _sharpe("std_eps"), None),
    Case("hunt_s34_sharpe_ratio_sqrt_of_var_plus_eps_healthy", lambda: _sharpe("var_eps"), None),
    Case("hunt_s34_log_barrier_of_a_torque_past_its_limit", lambda: _barrier(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="log barrier", cause="log-domain")),
    Case("hunt_s34_log_barrier_of_a_squashed_torque_healthy", lambda: _barrier(True), None),
    Case("hunt_s34_slerp_of_a_latent_with_its_duplicate", lambda: _slerp("none"),
         Expect("forward", "", "LatentMixer", step=2, op="aten.div.Tensor", marker="slerp",
                cause="division-by-zero")),
    Case("hunt_s34_slerp_where_guarded_acos_backward_at_a_cosine_of_1", lambda: _slerp("where"),
         Expect("backward", "", "LatentMixer", step=2, op="aten.rsqrt.default", marker="slerp angle",
                cause="sqrt-domain")),
    Case("hunt_s34_slerp_cosine_clamped_inside_healthy", lambda: _slerp("clamp"), None),
    Case("hunt_s34_arc_length_of_a_tap_stroke", lambda: _stroke(False),
         Expect("forward", "", "StrokeEncoder", step=2, op="aten.div.Tensor", marker="arc length",
                cause="division-by-zero")),
    Case("hunt_s34_arc_length_floored_healthy", lambda: _stroke(True), None),
    Case("hunt_s34_stereo_depth_of_a_zero_disparity", lambda: _stereo(0.0),
         Expect("forward", "", "DisparityHead", step=2, op="aten.reciprocal.default", marker="depth from disparity",
                cause="division-by-zero")),
    Case("hunt_s34_stereo_depth_minimum_disparity_healthy", lambda: _stereo(0.1), None),
    Case("hunt_s34_shampoo_inverse_root_of_a_zero_eigenvalue", lambda: _shampoo(0.0),
         Expect("optimizer", "emb", "Embedding", step=0, op="aten.pow.Tensor_Scalar", marker="shampoo root")),
    Case("hunt_s34_shampoo_with_eps_healthy", lambda: _shampoo(1e-6), None),
    Case("hunt_s34_hard_concrete_gate_of_a_uniform_0_healthy", _hard_concrete, None),
    Case("hunt_s34_layer_norm_of_one_feature_in_float16_healthy", _half_scalar_norm, None),
]
