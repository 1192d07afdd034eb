"""hunt_s28b, the numerics of models earlier hunts did not build (the loop's own code: hunt_s28b_loops), each
incident with its twin.

Mamba-2's naive segment sum exponentiated before its causal mask, in a ``ModuleList`` entry picked by an argument;
RealNVP's unbounded coupling scale in a submodule of a submodule of a LightningModule-like wrapper; an IWAE bound
``log mean exp`` in a loss helper of another module; Performer's FAVOR+ features of a long query all underflowing
(its normaliser ``0 / 0``); a neural ODE's fixed-step Euler solver whose state blows up over a long time gap; a
mixture density network's ``log(softmax)`` whose backward divides by a weight of 0; DreamerV3's ``symexp`` of an
unbounded critic; a VAE's Monte-Carlo KL whose posterior sigma underflows to 0; PNA's attenuation scaler at an
isolated node. Each twin applies its users' fix and must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract import hunt_s28b_helpers as _helpers
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- Mamba-2's segment sum, exp before the mask
class SSDBlock(nn.Module):
    """Mamba-2's state-space dual, quadratic form: ``exp(segsum(A dt))`` masked to the causal triangle. The reference
    fills the upper triangle with ``-inf`` before ``exp``; the slip multiplies by the mask after it."""

    def __init__(self, fill_first: bool) -> None:
        super().__init__()
        self.dt, self.inp, self.out, self.fill_first = nn.Linear(4, 1), nn.Linear(4, 4), nn.Linear(4, 4), fill_first
        self.log_a = nn.Parameter(torch.zeros(()))
        with torch.no_grad():
            self.dt.weight.fill_(0.25)
            self.dt.bias.fill_(-2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = -torch.exp(self.log_a) * F.softplus(self.dt(x)).squeeze(-1)
        cs = torch.cumsum(a, -1)
        seg = cs[..., :, None] - cs[..., None, :]
        causal = torch.tril(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool))
        if self.fill_first:  # noqa: SIM108 (the producer's marker goes on the slip's own line)
            decay = torch.exp(seg.masked_fill(~causal, -math.inf))
        else:
            decay = torch.exp(seg) * causal  # producer: segsum exp
        return x + self.out(decay @ self.inp(x))


class MultiRateSSM(nn.Module):
    """One SSD block per sampling rate; ``forward`` picks the block by the batch's rate index."""

    def __init__(self, fill_first: bool) -> None:
        super().__init__()
        self.blocks, self.head = nn.ModuleList([SSDBlock(fill_first) for _ in range(3)]), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, rate: int) -> torch.Tensor:
        return self.head(self.blocks[rate](x).mean(1))


def _segsum(fill_first: bool) -> Scenario:
    """Step 1's batch, at rate 2, holds a spike of 120: its dt is about 118, and the upper triangle's ``exp(118)``
    overflows; the mask multiplies it, ``inf * 0``. The twin fills with ``-inf`` before ``exp``, as Mamba-2 does."""
    torch.manual_seed(0)
    model = MultiRateSSM(fill_first)
    xs, ys, rates = _batches(2, 8, 4), _batches(2, 2), [0, 2, 1, 0]
    xs[1][1, 3] = 120.0
    return _loop(model, lambda step: (xs[step], rates[step]), lambda out, step: F.mse_loss(out, ys[step]), lr=1e-4)


# ---------------------------------------------------------------- RealNVP's unbounded coupling scale
class Coupling(nn.Module):
    """An affine coupling ``b * exp(s(a)) + t(a)``; RealNVP bounds ``s`` by ``tanh`` times a learned scale."""

    def __init__(self, flip: bool, bounded: bool) -> None:
        super().__init__()
        self.net, self.flip, self.bounded = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4)), flip, bounded
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, -1)
        if self.flip:
            a, b = b, a
        s, t = self.net(a).chunk(2, -1)
        if self.bounded:
            s = self.scale * torch.tanh(s)
        b = b * torch.exp(s) + t  # producer: coupling scale
        return torch.cat([b, a] if self.flip else [a, b], -1), s.sum(-1)


class Flow(nn.Module):
    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.couplings = nn.ModuleList([Coupling(False, bounded), Coupling(True, bounded)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.zeros(x.shape[0])
        for coupling in self.couplings:
            x, ld = coupling(x)
            logdet = logdet + ld
        return x, logdet


class LitFlow(nn.Module):
    """A LightningModule's shape: the flow is ``self.flow``, the negative log-likelihood lives in ``training_step``."""

    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.flow = Flow(bounded)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        z, logdet = self.flow(x)
        return (0.5 * z.pow(2).sum(-1) - logdet).mean()


def _realnvp(bounded: bool) -> Scenario:
    """Step 1's batch holds a sample whose second half is -2000: the first coupling passes it on scaled, the second
    coupling's ReLU network reads it and its log-scale passes 88, ``exp`` overflows. The twin bounds the log-scale."""
    torch.manual_seed(0)
    lit = LitFlow(bounded)
    opt = torch.optim.SGD(lit.parameters(), lr=1e-6)
    xs = _batches(4, 4)
    xs[1][2, 2:] = -2000.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = lit.training_step(xs[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((lit, opt), run)


# ---------------------------------------------------------------- IWAE's log mean exp in a loss helper
class ImportanceVAE(nn.Module):
    """A Gaussian VAE that returns ``K`` importance log-weights ``log p(x|z) + log p(z) - log q(z|x)`` per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(16, 4), nn.Linear(2, 16)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, -1)
        z = mu + torch.exp(0.5 * logvar) * noise  # (K, B, 2)
        log_px = -0.5 * (x - self.dec(z)).pow(2).sum(-1)
        log_pz = -0.5 * z.pow(2).sum(-1)
        log_qz = -0.5 * noise.pow(2).sum(-1) - 0.5 * logvar.sum(-1)
        return log_px + log_pz - log_qz


def _iwae(stable: bool) -> Scenario:
    """Step 2's batch holds a sample 6 times too large: every one of its five log-weights is a few hundred below 0,
    their exponentials underflow to 0 and the helper's ``log`` is -inf. The twin takes ``logsumexp``."""
    torch.manual_seed(0)
    model = ImportanceVAE()
    xs, noises = _batches(3, 16), _batches(5, 3, 2)
    xs[2][1] *= 6.0
    return _loop(model, lambda step: (xs[step], noises[step]),
                 lambda out, step: -_helpers.iwae_bound(out, stable).mean(), lr=1e-6)


# ---------------------------------------------------------------- Performer's FAVOR+ features of a long query
class FavorAttention(nn.Module):
    """Linear attention with FAVOR+'s positive random features ``exp(w x - |x|^2 / 2)``; Performer's code subtracts
    each query's largest exponent (it cancels in the ratio), the slip does not."""

    def __init__(self, stabilised: bool) -> None:
        super().__init__()
        self.qkv, self.stabilised = nn.Linear(8, 24), stabilised
        self.register_buffer("proj", torch.randn(16, 8))

    def features(self, x: torch.Tensor, query: bool) -> torch.Tensor:
        exponent = x @ self.proj.T - x.pow(2).sum(-1, keepdim=True) / 2
        if query and self.stabilised:
            exponent = exponent - exponent.amax(-1, keepdim=True)
        return torch.exp(exponent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (part * 8 ** -0.25 for part in self.qkv(x).chunk(3, -1))
        qf, kf = self.features(q, True), self.features(k, False)
        numerator = qf @ (kf.transpose(-1, -2) @ v)
        denominator = qf @ kf.sum(-2, keepdim=True).transpose(-1, -2)
        return numerator / denominator  # producer: favor normalise


class PerformerBlock(nn.Module):
    def __init__(self, stabilised: bool) -> None:
        super().__init__()
        self.attn, self.norm = FavorAttention(stabilised), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attn(x))


class Performer(nn.Module):
    def __init__(self, stabilised: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.layers = nn.ModuleList([PerformerBlock(stabilised) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def _performer(stabilised: bool) -> Scenario:
    """Step 1's batch holds a token 60 times too large: the first layer's query has a norm of about 30, every one
    of its features ``exp(w q - |q|^2 / 2)`` underflows to 0 and its normaliser is ``0 / 0``."""
    torch.manual_seed(0)
    model = Performer(stabilised)
    xs, ys = _batches(2, 5, 4), _batches(2, 2)
    xs[1][0, 2] *= 60.0
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=1e-3)


# ---------------------------------------------------------------- a neural ODE's Euler solver blowing up
class LinearField(nn.Module):
    """The vector field ``dh/dt = h A`` (or ``tanh(h A)``, bounded, in the twin)."""

    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.weight, self.bounded = nn.Parameter(torch.eye(4) * 2.0 + 0.01 * torch.randn(4, 4)), bounded

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        velocity = h @ self.weight  # producer: ode field
        return torch.tanh(velocity) if self.bounded else velocity


class EulerSolver(nn.Module):
    """A fixed-step Euler solver over the span between two irregular observations."""

    def __init__(self, bounded: bool, dt: float = 0.5) -> None:
        super().__init__()
        self.field, self.dt = LinearField(bounded), dt

    def forward(self, h: torch.Tensor, span: float) -> torch.Tensor:
        for _ in range(int(span / self.dt)):
            h = h + self.dt * self.field(h)
        return h


class LatentODE(nn.Module):
    def __init__(self, bounded: bool) -> None:
        super().__init__()
        self.enc, self.ode, self.dec = nn.Linear(3, 4), EulerSolver(bounded), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, span: float) -> torch.Tensor:
        return self.dec(self.ode(torch.tanh(self.enc(x)), span))


def _neural_ode(bounded: bool) -> Scenario:
    """Observations are 2 time units apart, but step 1's pair is 90 apart (a sensor outage): 180 Euler steps that
    each double the state pass float32's max. The twin bounds the field with ``tanh``."""
    torch.manual_seed(0)
    model = LatentODE(bounded)
    xs, ys, spans = _batches(4, 3), _batches(4, 3), [2.0, 90.0, 2.0, 2.0]
    return _loop(model, lambda step: (xs[step], spans[step]), lambda out, step: F.mse_loss(torch.tanh(out), ys[step]),
                 lr=1e-3)


# ---------------------------------------------------------------- a mixture density network's log(softmax)
class MDNHead(nn.Module):
    """Mixture density head; the slip takes ``log(softmax)`` of the mixture logits, the twin ``log_softmax``."""

    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.pi, self.mu, self.log_sigma, self.stable = nn.Linear(8, 3), nn.Linear(8, 3), nn.Linear(8, 3), stable

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.stable:  # noqa: SIM108 (the producer's marker goes on the slip's own line)
            log_pi = torch.log_softmax(self.pi(h), -1)
        else:
            log_pi = torch.log(torch.softmax(self.pi(h), -1))  # producer: mdn log pi
        log_sigma = self.log_sigma(h).clamp(-5, 5)
        z = (y - self.mu(h)) * torch.exp(-log_sigma)
        return -torch.logsumexp(log_pi - 0.5 * z.pow(2) - log_sigma, -1)


class MixtureDensity(nn.Module):
    def __init__(self, stable: bool) -> None:
        super().__init__()
        self.backbone, self.head = nn.Sequential(nn.Linear(2, 8), nn.ReLU()), MDNHead(stable)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x), y)


def _mdn(stable: bool) -> Scenario:
    """Step 1's batch holds an input of +-800: its mixture logits are hundreds apart, one weight
    underflows to exactly 0 and its ``log`` is -inf; the ``logsumexp`` still gives a finite negative log-likelihood,
    but ``log``'s backward divides the zero gradient by the zero weight. The twin takes ``log_softmax``."""
    torch.manual_seed(0)
    model = MixtureDensity(stable)
    xs, ys = _batches(4, 2), _batches(4, 1)
    xs[1][3] = torch.tensor([-800.0, 800.0])
    return _loop(model, lambda step: (xs[step], ys[step]), lambda out, step: out.mean(), lr=1e-4)


# ---------------------------------------------------------------- DreamerV3's symexp of an unbounded critic
class SymlogCritic(nn.Module):
    """A critic regressing ``symlog`` returns, decoded by ``symexp``; DreamerV3 bounds it by its bins (+-20)."""

    def __init__(self, bound: float | None) -> None:
        super().__init__()
        self.net, self.bound = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)), bound

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.net(h)
        if self.bound is not None:
            x = x.clamp(-self.bound, self.bound)
        return torch.sign(x) * (torch.exp(x.abs()) - 1)  # producer: symexp


class WorldModelAgent(nn.Module):
    def __init__(self, bound: float | None) -> None:
        super().__init__()
        self.encoder, self.critic = nn.Sequential(nn.Linear(5, 6), nn.ReLU()), SymlogCritic(bound)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.encoder(obs))


def _symexp(bound: float | None) -> Scenario:
    """Step 2's observation holds a reading 2000 times too large: the critic's symlog value passes 88 and
    ``symexp`` overflows. The twin clamps to DreamerV3's bin range."""
    torch.manual_seed(0)
    model = WorldModelAgent(bound)
    xs, ys = _batches(4, 5), _batches(4, 1)
    xs[2][0] = xs[2][0].abs() * 2000.0
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.mse_loss(torch.sign(out) * torch.log1p(out.abs()), ys[step]), lr=1e-6)


# ---------------------------------------------------------------- a VAE's Monte-Carlo KL at sigma 0
class GaussianEncoder(nn.Module):
    """Returns the reparameterised sample and the single-sample KL ``log q(z|x) - log p(z)``."""

    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.body, self.mu, self.logvar, self.clamp = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 2), clamp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        mu, logvar = self.mu(h), self.logvar(h)
        if self.clamp:
            logvar = logvar.clamp(-30.0, 20.0)
        sigma = torch.exp(0.5 * logvar)
        z = mu + sigma * torch.randn_like(mu)
        log_q = -(z - mu).pow(2) / (2 * sigma.pow(2)) - torch.log(sigma)  # producer: mc kl log q
        log_p = -0.5 * z.pow(2)
        return z, (log_q - log_p).sum(-1)


class MonteCarloVAE(nn.Module):
    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.encoder, self.decoder = GaussianEncoder(clamp), nn.Linear(2, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, kl = self.encoder(x)
        return self.decoder(z), kl


def _mc_kl(clamp: bool) -> Scenario:
    """Step 1's batch holds an input 5000 times too large: its log-variance is a few hundred below 0, sigma
    underflows to 0, ``z - mu`` is 0 and ``log q`` divides ``0 / 0``. The twin clamps the log-variance."""
    torch.manual_seed(0)
    model = MonteCarloVAE(clamp)
    with torch.no_grad():
        model.encoder.logvar.bias.fill_(-1.0)
        model.encoder.logvar.weight.fill_(-0.3)
    xs = [x.abs() for x in _batches(4, 6)]
    xs[1][2] *= 5000.0
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.mse_loss(out[0], xs[step]) + out[1].mean(), lr=1e-6)


# ---------------------------------------------------------------- PNA's attenuation scaler at an isolated node
class PNALayer(nn.Module):
    """Principal neighbourhood aggregation: mean aggregation times the identity, amplification
    ``log(d + 1) / delta`` and attenuation ``delta / log(d + 1)`` scalers; PyG clamps the degree at 1."""

    def __init__(self, delta: float, clamp: bool) -> None:
        super().__init__()
        self.lin, self.clamp = nn.Linear(16, 4), clamp
        self.register_buffer("delta", torch.tensor(delta))

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        deg = torch.zeros(x.shape[0]).index_add_(0, dst, torch.ones(dst.shape[0]))
        mean = torch.zeros_like(x).index_add_(0, dst, x[src]) / deg.clamp(min=1)[:, None]
        log_deg = torch.log((deg.clamp(min=1) if self.clamp else deg) + 1)[:, None]
        attenuation = self.delta / log_deg  # producer: pna attenuation
        scaled = torch.cat([x, mean, mean * log_deg / self.delta, mean * attenuation], -1)
        return torch.relu(self.lin(scaled))


class PNA(nn.Module):
    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.layers, self.head = nn.ModuleList([PNALayer(1.2, clamp) for _ in range(2)]), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, edges)
        return self.head(x).mean()


def _pna(clamp: bool) -> Scenario:
    """Step 2's graph has an isolated node (a molecule's lone ion): its degree is 0, ``log(0 + 1)`` is 0 and the
    attenuation ``delta / 0`` is inf, times its mean of 0 NaN. The twin clamps the degree at 1, as PyG does."""
    torch.manual_seed(0)
    model = PNA(clamp)
    xs, ys = _batches(5, 4), _batches(1)
    ring = torch.tensor([[0, 1, 2, 3, 4, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 0, 1, 2, 3, 4]])
    lone = torch.tensor([[0, 1, 2, 3, 1, 2, 3, 0], [1, 2, 3, 0, 0, 1, 2, 3]])  # node 4 has no edge
    edges = [ring, ring, lone, ring]
    return _loop(model, lambda step: (xs[step], edges[step]), lambda out, step: (out - ys[step][0]).pow(2))


CASES = [
    Case("hunt_s28b_mamba2_segsum_exp_before_the_causal_mask_in_a_block_picked_by_index", lambda: _segsum(False),
         Expect("forward", "blocks.2", "SSDBlock", step=1, op="aten.exp.default", marker="segsum exp",
                cause="exp-overflow")),
    Case("hunt_s28b_mamba2_segsum_filled_before_exp_healthy", lambda: _segsum(True), None),
    Case("hunt_s28b_realnvp_coupling_scale_overflows_in_a_lightning_like_wrapper", lambda: _realnvp(False),
         Expect("forward", "flow.couplings.1", "Coupling", step=1, op="aten.exp.default", marker="coupling scale",
                cause="exp-overflow")),
    Case("hunt_s28b_realnvp_coupling_scale_tanh_bounded_healthy", lambda: _realnvp(True), None),
    Case("hunt_s28b_iwae_log_mean_exp_in_a_loss_helper_of_another_module", lambda: _iwae(False),
         Expect("forward", None, step=2, op="aten.log.default", marker="iwae log mean exp", cause="log-domain"),
         source=_helpers),
    Case("hunt_s28b_iwae_logsumexp_healthy", lambda: _iwae(True), None),
    Case("hunt_s28b_performer_favor_features_of_a_long_query_underflow", lambda: _performer(False),
         Expect("forward", "layers.0.attn", "FavorAttention", step=1, op="aten.div.Tensor", marker="favor normalise",
                cause="division-by-zero")),
    Case("hunt_s28b_performer_favor_features_max_subtracted_healthy", lambda: _performer(True), None),
    Case("hunt_s28b_neural_ode_euler_state_blows_up_over_a_long_gap", lambda: _neural_ode(False),
         Expect("forward", "ode.field", "LinearField", step=1, op="aten.mm.default", marker="ode field",
                cause="overflow")),
    Case("hunt_s28b_neural_ode_tanh_bounded_field_healthy", lambda: _neural_ode(True), None),
    Case("hunt_s28b_mdn_log_of_a_softmax_weight_0_backward", lambda: _mdn(False),
         Expect("backward", "head", "MDNHead", step=1, op="aten.div.Tensor", marker="mdn log pi",
                cause="log-domain")),
    Case("hunt_s28b_mdn_log_softmax_healthy", lambda: _mdn(True), None),
    Case("hunt_s28b_dreamer_symexp_of_an_unbounded_critic", lambda: _symexp(None),
         Expect("forward", "critic", "SymlogCritic", step=2, op="aten.exp.default", marker="symexp",
                cause="exp-overflow")),
    Case("hunt_s28b_dreamer_symexp_clamped_to_its_bins_healthy", lambda: _symexp(20.0), None),
    Case("hunt_s28b_vae_monte_carlo_kl_at_an_underflowed_sigma", lambda: _mc_kl(False),
         Expect("forward", "encoder", "GaussianEncoder", step=1, op="aten.div.Tensor", marker="mc kl log q",
                cause="division-by-zero")),
    Case("hunt_s28b_vae_monte_carlo_kl_logvar_clamped_healthy", lambda: _mc_kl(True), None),
    Case("hunt_s28b_pna_attenuation_at_an_isolated_node", lambda: _pna(False),
         Expect("forward", "layers.0", "PNALayer", step=2, op="aten.div.Tensor", marker="pna attenuation",
                cause="division-by-zero")),
    Case("hunt_s28b_pna_degree_clamped_healthy", lambda: _pna(True), None),
]
