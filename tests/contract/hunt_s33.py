"""hunt_s33, incidents of families the contract had not seen, each a small training loop with its healthy twin.

Flows and distributions: a planar normalizing flow without its invertibility reparametrisation, whose
``log|1 + u^T psi|`` is ``log(0)`` at a padding sample; a Gamma rainfall likelihood (``Gamma.log_prob``) of a dry day
(``xlogy(a - 1, 0)``), fixed by a hurdle model; a Beta policy whose ``softplus`` concentration underflows to 0
(``lgamma(0)``). Hand-written forms: a logistic gate ``1 / (1 + exp(-x))`` whose ``exp`` overflows on an outlier (the
forward stays finite; its backward is ``0 * inf``); a Siamese contrastive loss whose distance is ``pow(0.5)`` of a
duplicate pair (its backward at 0); an energy-based OOD loss ``log(sum(exp(logits)))`` written by hand.
Complex: a modReLU ``z / |z|`` of a silent clip's spectrum. Parametrizations: ``spectral_norm`` of a zero-initialised
layer (its sigma is 0) and ``weight_norm`` of a zero-initialised direction. Each twin applies its users' fix and must
stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- a planar flow without the u_hat reparametrisation
class PlanarFlow(nn.Module):
    """``f(z) = z + u tanh(w^T z + b)``, log-det ``log|1 + u^T (1 - tanh^2) w|``; ``w`` initialised as a unit axis and
    ``u`` as ``-w`` (the user's 'start near the identity's mirror'), the bias at 0."""

    def __init__(self, d: int, constrained: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))
        self.u = nn.Parameter(torch.zeros(d))
        self.b = nn.Parameter(torch.zeros(()))
        with torch.no_grad():
            self.w[0], self.u[0] = 1.0, -1.0
        self.constrained = constrained

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.u
        if self.constrained:  # Rezende and Mohamed's u_hat: w^T u_hat > -1
            wu = self.w @ u
            u = u + (F.softplus(wu) - 1 - wu) * self.w / (self.w @ self.w)
        a = torch.tanh(z @ self.w + self.b)
        psi = (1 - a**2)[:, None] * self.w
        log_det = torch.log((1 + psi @ u).abs())  # producer: planar log det
        return z + u * a[:, None], log_det


def _planar(constrained: bool) -> Scenario:
    """Density estimation with one planar layer and a standard normal base; the first batch holds a zero padding row:
    ``w^T z + b`` is 0, ``1 + u^T w`` is exactly 0 and the log-det is ``log(0)``. The twin reparametrises ``u``
    (``u_hat``)."""
    torch.manual_seed(0)
    model = PlanarFlow(2, constrained)
    xs = [torch.randn(6, 2) + 3.0 for _ in range(4)]
    xs[0][4] = 0.0

    def nll(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        z, log_det = out
        return (0.5 * (z**2).sum(-1) - log_det).mean()

    return _loop(model, lambda step: (xs[step],), nll, lr=1e-3)


# ---------------------------------------------------------------- a Gamma rainfall likelihood of a dry day
class RainHead(nn.Module):
    """Daily rainfall as a Gamma: concentration and rate by softplus, plus the probability of a wet day."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raw = self.net(x)
        return F.softplus(raw[:, 0]) + 1.0, F.softplus(raw[:, 1]), raw[:, 2]


def _rain_nll(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rain: torch.Tensor, hurdle: bool) -> torch.Tensor:
    concentration, rate, wet_logit = out
    if not hurdle:
        return -torch.distributions.Gamma(concentration, rate).log_prob(rain).mean()  # producer: gamma dry day
    wet = rain > 0
    occurrence = F.binary_cross_entropy_with_logits(wet_logit, wet.float())
    amount = torch.distributions.Gamma(concentration[wet], rate[wet]).log_prob(rain[wet])
    return occurrence - amount.sum() / len(rain)


def _rain(hurdle: bool) -> Scenario:
    """A Gamma likelihood of daily rainfall; steps 0 and 1 are rainy weeks, step 2 holds a dry day (0 mm): with a
    concentration above 1 the density at 0 is 0 and ``xlogy(a - 1, 0)`` is -inf (Gamma's support is open at 0; the
    validation torch does passes 0). The twin is the usual hurdle model: a Bernoulli for wet days, the Gamma on the
    wet days only."""
    torch.manual_seed(0)
    model = RainHead()
    xs, rain = _batches(6, 5), [torch.rand(6) * 20 + 0.5 for _ in range(4)]
    rain[2][3] = 0.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: _rain_nll(out, rain[step], hurdle))


# ---------------------------------------------------------------- a Beta policy whose concentration underflows
class BetaPolicy(nn.Module):
    """A continuous-control policy over actions in [0, 1]: ``Beta(softplus(a), softplus(b))`` (the twin adds 1 to
    each, as the Beta-policy paper does)."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.net, self.offset = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)), offset

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = self.net(obs)
        return F.softplus(raw[:, 0]) + self.offset, F.softplus(raw[:, 1]) + self.offset


def _beta_policy(offset: float) -> Scenario:
    """Policy-gradient on logged actions. Step 2's observation holds a raw sensor reading 1000 times the scale (a
    missing normalisation): the concentration's softplus underflows to exactly 0 and ``Beta.log_prob`` takes
    ``lgamma(0)``."""
    torch.manual_seed(0)
    model = BetaPolicy(offset)
    obs, actions = _batches(5, 4), [torch.rand(5) * 0.8 + 0.1 for _ in range(4)]
    advantages = _batches(5)
    with torch.no_grad():
        direction = model.net[2].weight[0] @ model.net[0].weight  # the input direction that lowers alpha most
    obs[2][1] = -1000.0 * direction.sign()

    def loss(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        dist = torch.distributions.Beta(*out, validate_args=False)
        return -(dist.log_prob(actions[step]) * advantages[step]).mean()  # producer: beta policy

    return _loop(model, lambda step: (obs[step],), loss)


# ---------------------------------------------------------------- a hand-written logistic gate
class GatedUnit(nn.Module):
    """A gated linear unit whose gate is written ``1 / (1 + exp(-x))``."""

    def __init__(self, d: int, library: bool) -> None:
        super().__init__()
        self.value, self.gate, self.library = nn.Linear(d, 16), nn.Linear(d, 16), library

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        gate = torch.sigmoid(g) if self.library else 1 / (1 + torch.exp(-g))  # producer: hand sigmoid
        return self.value(x) * gate


def _gate(library: bool) -> Scenario:
    """Step 2's batch holds an unnormalised reading: a gate pre-activation below -88, ``exp(-g)`` overflows to inf
    and the gate is ``1 / inf`` = 0, finite. Its backward multiplies the gate's gradient (0) by ``exp``'s output
    (inf): NaN in the gate's gradients. The twin uses ``torch.sigmoid``."""
    torch.manual_seed(0)
    model = nn.Sequential(GatedUnit(4, library), nn.Linear(16, 1))
    xs, ys = _batches(6, 4), _batches(6, 1)
    with torch.no_grad():
        direction = model[0].gate.weight[0]
    xs[2][2] = -300.0 * direction.sign()
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- a Siamese contrastive loss at a duplicate pair
def _contrastive(a: torch.Tensor, b: torch.Tensor, same: torch.Tensor, eps: float) -> torch.Tensor:
    d = ((a - b) ** 2).sum(-1).add(eps).pow(0.5)  # producer: pair distance pow
    return (same * d**2 + (1 - same) * F.relu(1.0 - d) ** 2).mean() / 2


def _siamese(eps: float) -> Scenario:
    """Hadsell's contrastive loss on pairs of product photos; step 2's batch holds a pair that is the same photo
    twice (a duplicate in the catalogue): the distance is ``pow(0, 0.5)`` = 0 and its backward ``0.5 * 0^-0.5`` is
    inf, times the difference 0: NaN. The twin adds 1e-9 under the root."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    lefts, rights = _batches(4, 6), _batches(4, 6)
    rights[2][1] = lefts[2][1]
    same = [torch.tensor([1.0, 1.0, 0.0, 0.0]) for _ in range(4)]
    return _loop(model, lambda step: (torch.cat([lefts[step], rights[step]]),),
                 lambda out, step: _contrastive(out[:4], out[4:], same[step], eps))


# ---------------------------------------------------------------- an energy-based OOD loss with a hand log-sum-exp
def _free_energy(logits: torch.Tensor, stable: bool) -> torch.Tensor:
    if stable:
        return -torch.logsumexp(logits, -1)
    return -torch.log(torch.exp(logits).sum(-1))  # producer: energy lse


def _energy_loss(logits: torch.Tensor, labels: torch.Tensor, outlier: torch.Tensor, stable: bool) -> torch.Tensor:
    energy = _free_energy(logits, stable)
    ce = F.cross_entropy(logits[~outlier], labels[~outlier])
    return ce + 0.1 * (F.relu(energy[~outlier] + 25) ** 2).mean() + 0.1 * (F.relu(-7 - energy[outlier]) ** 2).mean()


def _energy(stable: bool) -> Scenario:
    """Energy-based OOD fine-tuning (Liu et al.): the free energy ``-log sum exp(logits)`` written by hand. Step 2's
    outlier images hold saturated pixels 1000 times the usual scale: a logit passes 88 and ``exp`` overflows. The twin
    takes ``torch.logsumexp``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
    xs, labels = _batches(6, 8), [torch.randint(0, 5, (6,)) for _ in range(4)]
    outlier = torch.tensor([False, False, False, False, True, True])
    xs[2][5] *= 1000.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: _energy_loss(out, labels[step], outlier, stable))


# ---------------------------------------------------------------- modReLU of a silent clip's spectrum
class ModReLU(nn.Module):
    """modReLU for complex activations: ``relu(|z| + b) * z / |z|``."""

    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.b, self.eps = nn.Parameter(torch.full((n,), 0.1)), eps

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        mag = z.abs()
        return F.relu(mag + self.b) * (z / (mag + self.eps))  # producer: modrelu phase


class SpectralNet(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.act = ModReLU(9, eps)
        self.head = nn.Linear(18, 2)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        h = self.act(torch.fft.rfft(audio))
        return self.head(torch.cat([h.real, h.imag], -1))


def _modrelu(eps: float) -> Scenario:
    """A complex-valued front end on 16-sample clips; step 2's batch holds a digitally silent clip: every bin of its
    spectrum is exactly 0 and modReLU's phase ``z / |z|`` is ``0 / 0``. The twin adds 1e-8 to the magnitude."""
    torch.manual_seed(0)
    model = SpectralNet(eps)
    clips, ys = _batches(3, 16), [torch.randint(0, 2, (3,)) for _ in range(4)]
    clips[2][1] = 0.0
    return _loop(model, lambda step: (clips[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- spectral_norm, weight_norm of a zero-initialised one
def _parametrized(kind: str, zero: bool) -> Scenario:
    """A discriminator-like MLP whose last layer is reparametrised, and zero-initialised (as a residual branch's last
    layer often is). ``spectral_norm``'s power iteration finds sigma 0 and divides the weight 0 by 0;
    ``weight_norm``'s direction ``v / |v|`` is 0 / 0. The twin keeps the default initialisation."""
    torch.manual_seed(0)
    last = nn.Linear(16, 1)
    if zero:
        nn.init.zeros_(last.weight)
    if kind == "spectral":
        last = nn.utils.parametrizations.spectral_norm(last)
    else:
        last = nn.utils.parametrizations.weight_norm(last)
    model = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), last)
    xs, ys = _batches(8, 6), _batches(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])  # producer: parametrized call
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)



# ---------------------------------------------------------------- a hand-written tanh of a large activation
class HandTanhMLP(nn.Module):
    """An MLP whose activation is written ``(exp(2x) - 1) / (exp(2x) + 1)`` (ported from a NumPy paper's code)."""

    def __init__(self, library: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.library = nn.Linear(4, 16), nn.Linear(16, 1), library

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.library:
            return self.fc2(torch.tanh(h))
        e = torch.exp(2 * h)  # producer: hand tanh
        return self.fc2((e - 1) / (e + 1))


def _hand_tanh(library: bool) -> Scenario:
    """Step 2's batch holds a reading 200 times the usual scale: a pre-activation passes 44, ``exp(2h)`` overflows
    and ``inf / inf`` is NaN. The twin calls ``torch.tanh``."""
    torch.manual_seed(0)
    model = HandTanhMLP(library)
    xs, ys = _batches(6, 4), _batches(6, 1)
    xs[2][0] *= 200.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- log(det) of a 48-dimensional covariance
class GaussianHead(nn.Module):
    """A full-covariance Gaussian over 48 targets: ``Sigma = L L^T``, L lower-triangular with a softplus diagonal."""

    def __init__(self, d: int, stable: bool) -> None:
        super().__init__()
        self.mean = nn.Linear(6, d)
        self.raw = nn.Parameter(torch.full((d,), -2.0))
        self.d, self.stable = d, stable

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scale = torch.diag(F.softplus(self.raw))
        sigma = scale @ scale.T
        r = y - self.mean(x)
        quad = (r @ torch.linalg.inv(sigma) * r).sum(-1)
        log_det = torch.logdet(sigma) if self.stable else torch.log(torch.det(sigma))  # producer: log det
        return 0.5 * (quad + log_det).mean()


def _log_det(stable: bool) -> Scenario:
    """The variances start near 0.016: their product over 48 dimensions is 1e-86, below float32's smallest number;
    ``det`` is 0 and ``log(0)`` is -inf at the first step. The twin calls ``torch.logdet``."""
    torch.manual_seed(0)
    model = GaussianHead(48, stable)
    xs, ys = _batches(5, 6), [torch.randn(5, 48) * 0.1 for _ in range(4)]
    return _loop(model, lambda step: (xs[step], ys[step]), lambda out, step: out, lr=1e-3)


# ---------------------------------------------------------------- a Gaussian process with jitter
class ExactGP(nn.Module):
    """An RBF Gaussian process's negative marginal likelihood over a batch of points (Cholesky of ``K + jitter I``)."""

    def __init__(self, jitter: float) -> None:
        super().__init__()
        self.log_ls, self.log_noise, self.jitter = nn.Parameter(torch.zeros(())), nn.Parameter(torch.tensor(-20.0)), \
            jitter

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        k = torch.exp(-torch.cdist(x, x) ** 2 / (2 * self.log_ls.exp() ** 2))  # producer: gp kernel
        k = k + (self.log_noise.exp() + self.jitter) * torch.eye(len(x))
        chol = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], chol)
        return 0.5 * (y @ alpha.squeeze(-1)) + chol.diagonal().log().sum()


def _gp(jitter: float) -> Scenario:
    """Step 2's batch holds a sensor logged twice, its second reading 2e-3 off the first in each coordinate: ``K`` is
    nearly singular, and with jitter 0 (the noise ``exp(-20)`` adds nothing in float32) the Cholesky's smallest pivot
    is about 2e-6, the loss about 1e6 and the update throws the log-lengthscale below -6e4: at step 3 the lengthscale
    is exactly 0, the kernel's division is ``0 / 0`` and ``x / 0``, and ``torch.linalg.cholesky`` of that NaN matrix
    raises ``LinAlgError``. Every mode names the division (the error comes after it). The twin adds GPyTorch's jitter
    of 1e-4 (pivot 2e-4, log-lengthscale about -12.5, finite).

    The offset is what makes this any CPU's run: 2e-6 is some thirty float32 roundings of a kernel entry near 1, so
    the pivot's sign and the step's size do not hang on LAPACK's or a BLAS's last bits (float32 gives -6.5e4 to
    -7.7e4 across ATen's CPU kernels, float64 -7.8e4; ``exp`` is 0 below -104). An exact duplicate's pivot was
    rounding noise: its sign, and the incident, differed between CPUs."""
    torch.manual_seed(0)
    model = ExactGP(jitter)
    xs, ys = _batches(8, 2), _batches(8)
    xs[2][5] = xs[2][2] + 2e-3
    return _loop(model, lambda step: (xs[step], ys[step]), lambda out, step: out)


# ---------------------------------------------------------------- class weights from the last validation's recall
def _recall(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    with torch.no_grad():
        pred = model(x).argmax(-1)
        hits = F.one_hot(y, classes).float() * F.one_hot(pred, classes).float()
        return hits.sum(0) / F.one_hot(y, classes).float().sum(0)  # producer: recall


def _class_weights(guard: str) -> Scenario:
    """After each training step a validation batch gives each class's recall, and the next step weights the
    cross-entropy by ``2 - recall`` (focus on the classes it misses). Step 1's validation batch holds no sample of
    class 3: its recall is ``0 / 0`` (after two optimizer steps: step 2), and the NaN weight makes the next loss NaN.
    The twins: the metric read by ``nan_to_num`` before it is used, and a metric only logged with ``nanmean`` (never
    reaching a loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(8, 5), [torch.randint(0, 4, (8,)) for _ in range(4)]
    vx, vy = _batches(8, 5), [torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]) for _ in range(4)]
    vy[1] = torch.tensor([0, 1, 2, 0, 0, 1, 2, 1])

    def run() -> list[torch.Tensor]:
        weights, losses, logged = torch.ones(4), [], []
        for step in range(4):
            loss = F.cross_entropy(model(xs[step]), ys[step], weight=weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            recall = _recall(model, vx[step], vy[step], 4)
            logged.append(torch.nanmean(recall))
            if guard == "none":
                weights = 2 - recall
            elif guard == "nan_to_num":
                weights = 2 - recall.nan_to_num(1.0)
        return losses + logged

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Adagrad with eps 0 over an unused embedding row
class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def _adagrad(eps: float) -> Scenario:
    """A bag-of-words classifier trained by Adagrad with ``eps=0`` (copied from a paper's 'no epsilon' setting); the
    embedding's gradient is dense, and a token no batch has used yet has a gradient of exactly 0: its accumulated
    sum is 0 and the update ``0 / sqrt(0)`` is NaN at the first step. The twin keeps Adagrad's eps of 1e-10."""
    torch.manual_seed(0)
    model = BagOfWords()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, eps=eps)
    tokens, ys = [torch.randint(0, 15, (4, 6)) for _ in range(4)], [torch.randint(0, 2, (4,)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.cross_entropy(model(tokens[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: adagrad step
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)

CASES = [
    Case("hunt_s33_planar_flow_log_det_of_0_at_a_padding_row", lambda: _planar(False),
         Expect("forward", "", "PlanarFlow", step=0, op="aten.log.default", marker="planar log det",
                cause="log-domain")),
    Case("hunt_s33_planar_flow_u_hat_healthy", lambda: _planar(True), None),
    Case("hunt_s33_gamma_rainfall_log_prob_of_a_dry_day", lambda: _rain(False),
         Expect("forward", None, step=2, op="aten.xlogy.Tensor", marker="gamma dry day", cause="log-domain")),
    Case("hunt_s33_gamma_rainfall_hurdle_healthy", lambda: _rain(True), None),
    Case("hunt_s33_beta_policy_softplus_concentration_underflows", lambda: _beta_policy(0.0),
         Expect("forward", None, step=2, op="aten.lgamma.default", marker="beta policy")),
    Case("hunt_s33_beta_policy_concentration_plus_1_healthy", lambda: _beta_policy(1.0), None),
    Case("hunt_s33_hand_sigmoid_gate_exp_overflow_backward", lambda: _gate(False),
         Expect("backward", "0", "GatedUnit", step=2, op="aten.mul.Tensor", marker="hand sigmoid")),
    Case("hunt_s33_torch_sigmoid_gate_healthy", lambda: _gate(True), None),
    Case("hunt_s33_contrastive_pow_half_of_a_duplicate_pair", lambda: _siamese(0.0),
         Expect("backward", None, step=2, op="aten.pow.Tensor_Scalar", marker="pair distance pow",
                cause="pow-domain")),
    Case("hunt_s33_contrastive_pow_half_with_eps_healthy", lambda: _siamese(1e-9), None),
    Case("hunt_s33_energy_ood_hand_logsumexp_overflow", lambda: _energy(False),
         Expect("forward", None, step=2, op="aten.exp.default", marker="energy lse", cause="exp-overflow")),
    Case("hunt_s33_energy_ood_logsumexp_healthy", lambda: _energy(True), None),
    Case("hunt_s33_modrelu_phase_of_a_silent_clip", lambda: _modrelu(0.0),
         Expect("forward", "act", "ModReLU", step=2, op="aten.div.Tensor", marker="modrelu phase",
                cause="division-by-zero")),
    Case("hunt_s33_modrelu_with_eps_healthy", lambda: _modrelu(1e-8), None),
    Case("hunt_s33_spectral_norm_of_a_zero_initialised_layer", lambda: _parametrized("spectral", True),
         Expect("forward", "2.parametrizations.weight.0", "_SpectralNorm", step=0, op="aten.div.Tensor",
                marker="parametrized call")),
    Case("hunt_s33_spectral_norm_default_init_healthy", lambda: _parametrized("spectral", False), None),
    Case("hunt_s33_weight_norm_of_a_zero_initialised_direction", lambda: _parametrized("weight", True),
         Expect("forward", "2.parametrizations.weight.0", "_WeightNorm", step=0,
                op="aten._weight_norm_interface.default", marker="parametrized call")),
    Case("hunt_s33_weight_norm_default_init_healthy", lambda: _parametrized("weight", False), None),
    Case("hunt_s33_hand_tanh_exp_overflow", lambda: _hand_tanh(False),
         Expect("forward", "", "HandTanhMLP", step=2, op="aten.exp.default", marker="hand tanh",
                cause="exp-overflow")),
    Case("hunt_s33_torch_tanh_healthy", lambda: _hand_tanh(True), None),
    Case("hunt_s33_log_of_an_underflowed_det", lambda: _log_det(False),
         Expect("forward", "", "GaussianHead", step=0, op="aten.log.default", marker="log det", cause="log-domain")),
    Case("hunt_s33_logdet_healthy", lambda: _log_det(True), None),
    Case("hunt_s33_gp_without_jitter_kernel_of_a_lengthscale_0_then_cholesky_raises", lambda: _gp(0.0),
         Expect("forward", "", "ExactGP", step=3, op="aten.div.Tensor", marker="gp kernel",
                cause="division-by-zero")),
    Case("hunt_s33_gp_with_jitter_over_a_duplicated_point_healthy", lambda: _gp(1e-4), None),
    Case("hunt_s33_class_weights_from_a_recall_of_an_absent_class", lambda: _class_weights("none"),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="recall", cause="division-by-zero")),
    Case("hunt_s33_class_weights_from_a_recall_nan_to_num_healthy", lambda: _class_weights("nan_to_num"), None),
    Case("hunt_s33_recall_of_an_absent_class_only_logged_by_nanmean_healthy", lambda: _class_weights("logged"), None),
    Case("hunt_s33_adagrad_eps_0_over_an_unused_embedding_row", lambda: _adagrad(0.0),
         Expect("optimizer", "emb", "Embedding", step=0, op="aten.addcdiv_.default", marker="adagrad step")),
    Case("hunt_s33_adagrad_default_eps_healthy", lambda: _adagrad(1e-10), None),
]
