"""hunt25, layers and losses: reported incidents, each with its healthy twin (loops, optimizers, data: hunt25b).

Layers: a mixture of experts whose auxiliary centring penalty takes each expert's mean output (an expert the router
sends no token: the mean of nothing); linear attention with a ReLU feature map (a query with no positive feature: its
normaliser is 0, 0 / 0); Gaussian splatting's 2D covariance inverted by hand for a splat flattened to a line (its
determinant 0); an optical-flow warp whose sampling grid is normalised by ``W - 1`` at a pyramid level one pixel wide;
a vector quantiser's codebook perplexity ``exp(-sum(p log p))`` over a code no vector chose. Losses: sMAPE of a
ReLU forecast over a closed store's zero demand (0 / 0); a contractive penalty, the Jacobian's norm by
``torch.func.vmap(jacrev(encoder))``, whose square root's derivative at a dead sample is 1 / 0. Each with the fix
its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


# ---------------------------------------------------------------- an expert with no token: the mean of nothing
class CentredMoE(nn.Module):
    """Top-1 routing over three experts; an auxiliary penalty keeps each expert's mean output near 0."""

    def __init__(self, counted: bool) -> None:
        super().__init__()
        self.router, self.head = nn.Linear(6, 3), nn.Linear(6, 1)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.counted = counted
        with torch.no_grad():
            self.router.bias[2] = -20.0  # an expert the router has stopped choosing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = self.router(x).argmax(-1)
        out, means = torch.zeros_like(x), []
        for e, expert in enumerate(self.experts):
            chosen = choice == e
            y = expert(x[chosen])
            out[chosen] = y
            if self.counted:
                means.append(y.sum(0) / chosen.sum().clamp(min=1))
            else:
                means.append(y.mean(0))  # producer: expert mean
        return self.head(out), torch.stack(means).pow(2).mean()


def _moe(counted: bool) -> Scenario:
    """The mean over an expert's tokens is 0 / 0 for an expert that got none. The twin divides a sum by the count
    clamped to 1 (as Switch Transformer implementations count tokens per expert)."""
    torch.manual_seed(0)
    model = CentredMoE(counted)
    xs, ys = _batches(8, 6), _batches(8, 1)

    def loss_fn(out: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        pred, centring = out
        return F.mse_loss(pred, ys[step]) + 0.01 * centring
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- linear attention, a ReLU feature map
class LinearAttention(nn.Module):
    """``phi(Q) (phi(K)^T V) / (phi(Q) . sum phi(K))`` (Katharopoulos et al.), with ``phi`` ReLU or ``elu + 1``."""

    def __init__(self, elu: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.elu = elu
        with torch.no_grad():
            self.q.bias.fill_(-1.5)

    def feature(self, t: torch.Tensor) -> torch.Tensor:
        return F.elu(t) + 1 if self.elu else F.relu(t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.feature(self.q(x)), self.feature(self.k(x))
        kv = torch.einsum("bnd,bne->bde", k, self.v(x))
        z = torch.einsum("bnd,bd->bn", q, k.sum(1))
        return torch.einsum("bnd,bde->bne", q, kv) / z.unsqueeze(-1)  # producer: linear attention


class LinearAttentionModel(nn.Module):
    def __init__(self, elu: bool) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(4, 8), LinearAttention(elu), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.attn(h)).squeeze(-1)


def _linear_attention(elu: bool) -> Scenario:
    """A query whose every feature is negative has ``phi(q) = 0``: numerator and normaliser are 0. The twin uses the
    paper's ``elu + 1``, positive everywhere."""
    torch.manual_seed(0)
    model = LinearAttentionModel(elu)
    xs, ys = _batches(2, 5, 4), _batches(2, 5)
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]))


# ---------------------------------------------------------------- Gaussian splatting: a flat splat's inverse
class Splatter(nn.Module):
    """Axis-aligned 2D Gaussians splatted onto a 6x6 image; the conic (inverse covariance) is written by hand."""

    def __init__(self, low_pass: float) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.means = nn.Parameter(torch.rand(5, 2, generator=g) * 6)
        self.log_scales = nn.Parameter(torch.randn(5, 2, generator=g) * 0.2)
        self.colors = nn.Parameter(torch.rand(5, generator=g))
        self.low_pass = low_pass
        with torch.no_grad():
            self.log_scales[3, 1] = -60.0  # a splat the optimiser flattened to a line: its variance underflows to 0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        var = (2 * self.log_scales).exp() + self.low_pass
        a, c = var[:, 0], var[:, 1]
        b = torch.zeros_like(a)
        det = a * c - b * b
        conic = torch.stack((c, -b, a), -1) / det[:, None]  # producer: conic
        d = pixels[:, None, :] - self.means[None]
        power = -0.5 * (conic[:, 0] * d[..., 0] ** 2 + 2 * conic[:, 1] * d[..., 0] * d[..., 1]
                        + conic[:, 2] * d[..., 1] ** 2)
        return (power.exp() * self.colors).sum(-1)


def _splat(low_pass: float) -> Scenario:
    """The covariance of the flattened splat has determinant 0: its conic is 0 / 0 and a / 0. The twin adds the
    0.3-pixel low-pass filter 3D Gaussian splatting adds to every 2D covariance."""
    torch.manual_seed(0)
    model = Splatter(low_pass)
    ys, xs = torch.meshgrid(torch.arange(6.0), torch.arange(6.0), indexing="ij")
    pixels = torch.stack((xs.flatten(), ys.flatten()), -1)
    targets = [torch.rand(36) for _ in range(4)]
    return _loop(model, lambda step: (pixels,), lambda out, step: F.mse_loss(out, targets[step]), lr=0.001)


# ---------------------------------------------------------------- a flow warp at a level one pixel wide
class Warp(nn.Module):
    """Backward warping by ``grid_sample``, its grid normalised to [-1, 1] by ``align_corners=True``'s ``2x/(W-1)-1``
    (the twin: ``align_corners=False``'s ``(2x+1)/W-1``)."""

    def __init__(self, corners: bool) -> None:
        super().__init__()
        self.corners = corners

    def forward(self, feat: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
        h, w = feat.shape[-2:]
        ys, xs = torch.meshgrid(torch.arange(h, dtype=feat.dtype), torch.arange(w, dtype=feat.dtype), indexing="ij")
        x, y = xs + flow[:, 0], ys + flow[:, 1]
        if self.corners:
            grid = torch.stack((2 * x / (w - 1) - 1, 2 * y / (h - 1) - 1), -1)  # producer: warp grid
        else:
            grid = torch.stack(((2 * x + 1) / w - 1, (2 * y + 1) / h - 1), -1)
        return F.grid_sample(feat, grid, align_corners=self.corners)


class FlowPyramid(nn.Module):
    """Coarse-to-fine flow over three levels of an 8x4 image pair: the coarsest level is 2x1."""

    def __init__(self, corners: bool) -> None:
        super().__init__()
        self.encode = nn.Conv2d(1, 4, 3, padding=1)
        self.estimate = nn.Conv2d(8, 2, 3, padding=1)
        self.warp = Warp(corners)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        fa, fb = self.encode(a), self.encode(b)
        pyramid = [(fa, fb)]
        for _ in range(2):
            fa, fb = F.avg_pool2d(fa, 2), F.avg_pool2d(fb, 2)
            pyramid.append((fa, fb))
        flow = torch.zeros(a.shape[0], 2, *pyramid[-1][0].shape[-2:])
        for fa, fb in reversed(pyramid):
            if flow.shape[-2:] != fa.shape[-2:]:
                flow = 2 * F.interpolate(flow, size=fa.shape[-2:], mode="bilinear", align_corners=False)
            flow = flow + self.estimate(torch.cat((fa, self.warp(fb, flow)), 1))
        return flow


def _flow(corners: bool) -> Scenario:
    """At the level one pixel wide, ``W - 1`` is 0: the grid's x is ``x / 0``. The twin normalises as
    ``align_corners=False`` does, dividing by W."""
    torch.manual_seed(0)
    model = FlowPyramid(corners)
    frames, flows = _batches(2, 1, 8, 4), _batches(2, 2, 8, 4)
    shifted = [f.roll(1, -1) for f in frames]
    return _loop(model, lambda step: (frames[step], shifted[step]), lambda out, step: F.l1_loss(out, flows[step]))


# ---------------------------------------------------------------- a VQ codebook's perplexity, a code unused
class VectorQuantizer(nn.Module):
    """VQ-VAE's quantiser; it returns the codebook perplexity its users log, ``exp(-sum(p log p))``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.codebook, self.eps = nn.Embedding(8, 4), eps

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = (z[:, None] - self.codebook.weight[None]).pow(2).sum(-1).argmin(-1)
        q = self.codebook(idx)
        usage = F.one_hot(idx, 8).float().mean(0)
        perplexity = torch.exp(-(usage * torch.log(usage + self.eps)).sum())  # producer: perplexity
        commit = (q.detach() - z).pow(2).mean() + (q - z.detach()).pow(2).mean()
        return z + (q - z).detach(), commit, perplexity


class VQAutoencoder(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.enc, self.vq, self.dec = nn.Linear(6, 4), VectorQuantizer(eps), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, commit, perplexity = self.vq(self.enc(x))
        return self.dec(q), commit, perplexity


def _vq(eps: float) -> Scenario:
    """Six vectors over eight codes leave codes unused: ``usage * log(usage)`` is ``0 * log 0``. The twin adds the
    1e-10 the reference implementation adds inside the log."""
    torch.manual_seed(0)
    model = VQAutoencoder(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = _batches(6, 6)

    def run() -> list[torch.Tensor]:
        logged = []
        for step in range(4):
            recon, commit, perplexity = model(xs[step])
            loss = F.mse_loss(recon, xs[step]) + 0.25 * commit
            opt.zero_grad()
            loss.backward()
            opt.step()
            logged.append(torch.stack((loss.detach(), perplexity.detach())))
        return logged
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- sMAPE over a closed store's zero demand
def _smape(clamped: bool) -> Scenario:
    """Demand forecasts through a final ReLU (demand is not negative); the store closed at step 2, its demand 0 where
    the forecast is 0 too: ``|y - f| / (|y| + |f|)`` is 0 / 0. The twin clamps the denominator."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU())
    with torch.no_grad():
        model[2].bias[3] = -30.0  # a product line the forecaster has learned to predict 0 for
    history = _batches(5, 12)
    demand = [torch.rand(5, 4) + 0.5 for _ in range(4)]
    demand[2][1] = 0.0

    def loss_fn(forecast: torch.Tensor, step: int) -> torch.Tensor:
        y = demand[step]
        scale = forecast.abs() + y.abs()
        if clamped:
            scale = scale.clamp(min=1e-8)
        return (2 * (forecast - y).abs() / scale).mean()  # producer: smape
    return _loop(model, lambda step: (history[step],), loss_fn)


# ---------------------------------------------------------------- a contractive penalty by torch.func
def _contractive(eps: float) -> Scenario:
    """A contractive autoencoder's penalty, the Frobenius norm of the encoder's Jacobian per sample, computed with
    ``vmap(jacrev(encoder))``; a blank sample (step 1) leaves every ReLU unit off: the Jacobian is 0 and the
    derivative of its square root 1 / 0. The twin adds eps under the root."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    model = nn.Sequential(encoder, nn.Linear(8, 6))
    with torch.no_grad():
        encoder[0].bias.fill_(-0.5)
    xs = _batches(4, 6)
    xs[1][2] = 0.0

    def loss_fn(recon: torch.Tensor, step: int) -> torch.Tensor:
        jac = torch.func.vmap(torch.func.jacrev(encoder))(xs[step])
        penalty = (jac.pow(2).sum((1, 2)) + eps).sqrt().mean()  # producer: contractive
        return F.mse_loss(recon, xs[step]) + 0.1 * penalty
    return _loop(model, lambda step: (xs[step],), loss_fn)


CASES = [
    Case("hunt25_moe_centring_mean_of_an_expert_without_tokens", lambda: _moe(False),
         Expect("forward", "", "CentredMoE", step=0, op="aten.mean.dim", marker="expert mean",
                cause="empty-reduction")),
    Case("hunt25_moe_centring_sum_over_clamped_count_healthy", lambda: _moe(True), None),
    Case("hunt25_relu_linear_attention_query_without_a_positive_feature", lambda: _linear_attention(False),
         Expect("forward", "attn", "LinearAttention", step=0, op="aten.div.Tensor", marker="linear attention",
                cause="division-by-zero")),
    Case("hunt25_elu_plus_one_linear_attention_healthy", lambda: _linear_attention(True), None),
    Case("hunt25_splat_conic_of_a_flattened_gaussian", lambda: _splat(0.0),
         Expect("forward", "", "Splatter", step=0, op="aten.div.Tensor", marker="conic", cause="division-by-zero")),
    Case("hunt25_splat_conic_with_the_low_pass_filter_healthy", lambda: _splat(0.3), None),
    Case("hunt25_flow_warp_grid_over_w_minus_1_at_a_level_one_pixel_wide", lambda: _flow(True),
         Expect("forward", "warp", "Warp", step=0, op="aten.div.Tensor", marker="warp grid",
                cause="division-by-zero")),
    Case("hunt25_flow_warp_grid_align_corners_false_healthy", lambda: _flow(False), None),
    Case("hunt25_vq_perplexity_of_an_unused_code", lambda: _vq(0.0),
         Expect("forward", "vq", "VectorQuantizer", step=0, op="aten.log.default", marker="perplexity",
                cause="log-domain")),
    Case("hunt25_vq_perplexity_with_eps_healthy", lambda: _vq(1e-10), None),
    Case("hunt25_smape_of_a_relu_forecast_over_zero_demand", lambda: _smape(False),
         Expect("forward", None, step=2, op="aten.div.Tensor", marker="smape", cause="division-by-zero")),
    Case("hunt25_smape_denominator_clamped_healthy", lambda: _smape(True), None),
    Case("hunt25_contractive_jacrev_norm_backward_of_a_dead_sample", lambda: _contractive(0.0),
         Expect("backward", None, step=1, op="aten.div.Tensor", marker="contractive", cause="sqrt-domain")),
    Case("hunt25_contractive_jacrev_norm_with_eps_healthy", lambda: _contractive(1e-8), None),
]
