"""hunt_s39, incidents of models the contract had not met, each with its users' fix as a healthy twin.

Zero-initialised layers ("zero_module", as diffusion UNets and ControlNet close each residual branch) meeting a
normalisation of the weight: ``nn.utils.parametrizations.weight_norm`` applied to a zeroed
conv (``g * v / |v|`` with ``v = 0``). Preconditioning: EDM's ``c_noise = log(sigma) / 4`` where the noise level is
drawn uniformly from a grid that includes 0. Optimizers: a hand-written Newton-Schulz ("Muon") optimizer over the
matrices and AdamW over the rest, whose ``G / G.norm()`` meets the auxiliary head whose loss weight warms up from 0 (a
gradient that is exactly 0). Self-supervision: an MAE whose mask-ratio curriculum reaches 1.0 (no visible patch: a
mean over 0 tokens), a MoCo queue of negatives initialised to zeros and normalised by hand, and a spectral norm by
hand whose power-iteration vector starts at zeros.
Healthy, though it looks like one: the Weight Standardization paper's own snippet (``w / (w.std() + 1e-5)``) over a
zeroed conv (torch's ``std`` backward masks its ``0 / 0`` where the std is 0), and timm's ``rsqrt(var + eps)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop


def _zero_module(module: nn.Module) -> nn.Module:
    """Zero every parameter of ``module`` (the diffusion-UNet helper of the same name)."""
    for p in module.parameters():
        p.detach().zero_()
    return module


# ---------------------------------------------------------------- weight standardization of a zeroed conv
class WSConv2d(nn.Conv2d):
    """Weight Standardization, by the paper's snippet (``std + 1e-5``) or as timm's StdConv2d (``rsqrt(var + eps)``)."""

    def __init__(self, *args: int, by_var: bool, **kwargs: int) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.by_var = by_var

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
        if self.by_var:
            w = w * torch.rsqrt(w.pow(2).mean(dim=(1, 2, 3), keepdim=True) + 1e-5)
        else:
            w = w / (w.flatten(1).std(dim=1).view(-1, 1, 1, 1) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class ZeroClosedBlock(nn.Module):
    """A residual block whose last conv is zero-initialised, so the block starts as the identity."""

    def __init__(self, by_var: bool) -> None:
        super().__init__()
        self.conv1 = WSConv2d(4, 4, 3, padding=1, by_var=by_var)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = _zero_module(WSConv2d(4, 4, 3, padding=1, by_var=by_var))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.conv2(F.silu(self.norm(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


def _ws_zero(by_var: bool) -> Scenario:
    """The standardised weight of the zeroed conv is ``0 / 1e-5 = 0`` forward; backward, ``std``'s derivative would
    divide ``w - mean`` (0) by the std (0), but torch masks it where the std is 0: healthy, as timm's form is."""
    torch.manual_seed(0)
    model = ZeroClosedBlock(by_var)
    xs, ys = _batches(2, 4, 5, 5), [torch.randint(0, 3, (2,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- weight_norm over a zeroed conv
class WeightNormedBlock(nn.Module):
    """A residual block whose output conv is weight-normalised and zero-initialised (or only its gain ``g`` is)."""

    def __init__(self, gain_only: bool) -> None:
        super().__init__()
        self.conv1 = parametrizations.weight_norm(nn.Conv2d(4, 4, 3, padding=1))
        self.conv2 = parametrizations.weight_norm(nn.Conv2d(4, 4, 3, padding=1))
        if gain_only:
            _zero_module(self.conv2.parametrizations.weight)  # type: ignore[union-attr]
            self.conv2.parametrizations.weight.original1.data.normal_()  # type: ignore[union-attr]
        else:
            _zero_module(self.conv2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.conv2(F.silu(self.conv1(x)))  # producer: weight norm
        return self.head(h.mean(dim=(2, 3)))


def _weight_norm_zero(gain_only: bool) -> Scenario:
    """``zero_module(weight_norm(conv))`` zeroes both ``g`` and ``v``: the weight is ``g * v / |v| = 0 * 0 / 0`` at
    the first forward. The twin zeroes the gain only (``v`` random): the weight is exactly 0, its gradient finite."""
    torch.manual_seed(0)
    model = WeightNormedBlock(gain_only)
    xs, ys = _batches(2, 4, 5, 5), [torch.randint(0, 3, (2,)) for _ in range(4)]
    return _loop(model, lambda step: (xs[step],), lambda out, step: F.cross_entropy(out, ys[step]))


# ---------------------------------------------------------------- EDM c_noise of a noise level of 0
class EdmPrecond(nn.Module):
    """Karras et al.'s preconditioned denoiser ``c_skip x + c_out F(c_in x, c_noise)``."""

    def __init__(self, sigma_data: float = 0.5) -> None:
        super().__init__()
        self.sigma_data = sigma_data
        self.net = nn.Sequential(nn.Linear(5, 32), nn.SiLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sd2 = self.sigma_data ** 2
        c_skip, c_in = sd2 / (sigma ** 2 + sd2), 1 / (sigma ** 2 + sd2).sqrt()
        c_out = sigma * self.sigma_data / (sigma ** 2 + sd2).sqrt()
        c_noise = sigma.log() / 4  # producer: c noise
        return c_skip * x + c_out * self.net(torch.cat([c_in * x, c_noise], -1))


def _edm_sigma_grid(from_one: bool) -> Scenario:
    """Noise levels drawn uniformly from the grid ``sigma_max * k / 10``, ``k`` in ``0..10``: step 2 draws ``k = 0``
    for a sample, a noise level of exactly 0, whose ``log`` is ``-inf``. The twin's grid starts at ``k = 1``."""
    torch.manual_seed(0)
    model = EdmPrecond()
    x0s, noise = _batches(6, 4), _batches(6, 4)
    ks = [torch.randint(1, 11, (6, 1)).float() for _ in range(4)]
    ks[2][4] = 1.0 if from_one else 0.0
    sigmas = [8.0 * k / 10 for k in ks]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            sigma = sigmas[step]
            denoised = model(x0s[step] + sigma * noise[step], sigma)
            weight = (sigma ** 2 + 0.25) / (sigma * 0.5 + 1e-3) ** 2
            loss = (weight * (denoised - x0s[step]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a Newton-Schulz optimizer over a zero gradient
class NewtonSchulz(torch.optim.Optimizer):
    """Momentum, then the update orthogonalised by a cubic Newton-Schulz iteration (a Muon by hand)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.9, eps: float = 0.0) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr, "momentum": momentum, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                g = buf / (buf.norm() + group["eps"])  # producer: newton schulz
                for _ in range(3):
                    g = 1.5 * g - 0.5 * g @ g.T @ g
                p.add_(g, alpha=-group["lr"])


class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.main = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.main(h), self.aux(h)


def _newton_schulz(eps: float) -> Scenario:
    """Matrices by the Newton-Schulz optimizer, biases by AdamW (two optimizers over one model). The auxiliary loss's
    weight warms up linearly from 0, so at step 0 the auxiliary head's weight has a gradient of exactly 0 and its
    momentum is 0: ``0 / |0|`` is NaN, written into ``aux.weight``. The twin adds Muon's ``eps`` of 1e-7."""
    torch.manual_seed(0)
    model = AuxNet()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    muon, adamw = NewtonSchulz(matrices, eps=eps), torch.optim.AdamW(others, lr=1e-3)
    xs, ys, auxs = _batches(8, 6), [torch.randint(0, 3, (8,)) for _ in range(4)], _batches(8, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            main, aux = model(xs[step])
            loss = F.cross_entropy(main, ys[step]) + min(1.0, step / 2) * F.mse_loss(aux, auxs[step])
            muon.zero_grad()
            adamw.zero_grad()
            loss.backward()
            muon.step()
            adamw.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, muon, adamw), run)


# ---------------------------------------------------------------- MAE with a mask-ratio curriculum reaching 1.0
class TinyMAE(nn.Module):
    """Keeps ``int(L * (1 - ratio))`` patches (by a fixed noise's argsort), encodes them, mean-pools, reconstructs."""

    def __init__(self, patches: int = 6, dim: int = 4) -> None:
        super().__init__()
        self.patches, self.dim = patches, dim
        self.embed = nn.Linear(dim, 16)
        self.encoder = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
        self.decoder = nn.Linear(16, patches * dim)

    def forward(self, x: torch.Tensor, order: torch.Tensor, ratio: float) -> torch.Tensor:
        keep = int(self.patches * (1 - ratio))
        ids = order[:, :keep, None].expand(-1, -1, self.dim)
        tokens = self.encoder(self.embed(x.gather(1, ids)))
        pooled = tokens.mean(1)  # producer: mae pool
        return self.decoder(pooled).view_as(x)


def _mae(cap: float) -> Scenario:
    """The mask ratio grows ``0.5 + 0.25 * step`` (a curriculum), capped at ``cap``: with a cap of 1.0 step 2 keeps
    ``int(6 * 0.0) = 0`` patches and the encoder's mean pools over 0 tokens (``0 / 0``). The twin caps at 0.75."""
    torch.manual_seed(0)
    model = TinyMAE()
    xs = _batches(3, 6, 4)
    orders = [torch.rand(3, 6).argsort(1) for _ in range(4)]
    return _loop(model, lambda step: (xs[step], orders[step], min(cap, 0.5 + 0.25 * step)),
                 lambda out, step: F.mse_loss(out, xs[step]))


# ---------------------------------------------------------------- MoCo's queue of negatives initialised to zeros
class MoCoHead(nn.Module):
    """An InfoNCE head over a queue of negative keys (a buffer), which the loop refills after each step."""

    def __init__(self, zeros: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))
        self.register_buffer("queue", torch.zeros(8, 12) if zeros else torch.randn(8, 12))

    def forward(self, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder(x), dim=1)
        negatives = self.queue / self.queue.norm(dim=0, keepdim=True)  # producer: moco queue
        return torch.cat([(q * key).sum(1, keepdim=True), q @ negatives], 1) / 0.07


def _moco(zeros: bool) -> Scenario:
    """The queue is allocated with ``torch.zeros`` and normalised column-wise by hand at each forward: every column is
    ``0 / 0`` at the first step. The twin allocates it with ``torch.randn`` (as MoCo does)."""
    torch.manual_seed(0)
    model = MoCoHead(zeros)
    xs, keys = _batches(4, 6), [F.normalize(torch.randn(4, 8), dim=1) for _ in range(4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            logits = model(xs[step], keys[step])
            loss = F.cross_entropy(logits, torch.zeros(4, dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():  # enqueue this step's keys, dequeue the oldest
                model.queue.copy_(torch.cat([keys[step].T, model.queue[:, :-4]], 1))
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- spectral norm by hand, power iteration from zeros
class SNLinear(nn.Linear):
    """A linear layer divided by its largest singular value, estimated by one power iteration per forward."""

    def __init__(self, d_in: int, d_out: int, zeros: bool) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("u", torch.zeros(d_out) if zeros else F.normalize(torch.randn(d_out), dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            v = self.weight.T @ self.u
            v = v / v.norm()  # producer: power iteration
            u = self.weight @ v
            self.u.copy_(u / u.norm())
        sigma = self.u @ self.weight @ v
        return F.linear(x, self.weight / sigma, self.bias)


def _spectral(zeros: bool) -> Scenario:
    """A discriminator's spectral norm written by hand; its left vector ``u`` registered as ``torch.zeros``: the first
    power iteration's ``W^T u`` is 0 and ``v / |v|`` is ``0 / 0``. The twin starts ``u`` at a random unit vector."""
    torch.manual_seed(0)
    model = nn.Sequential(SNLinear(6, 16, zeros), nn.LeakyReLU(0.2), SNLinear(16, 1, zeros))
    xs, ys = _batches(6, 6), [torch.randint(0, 2, (6, 1)).float() for _ in range(4)]
    return _loop(model, lambda step: (xs[step],),
                 lambda out, step: F.binary_cross_entropy_with_logits(out, ys[step]))


CASES = [
    Case("hunt_s39_weight_standardization_paper_snippet_over_a_zeroed_conv_healthy", lambda: _ws_zero(False), None),
    Case("hunt_s39_weight_standardization_by_rsqrt_var_healthy", lambda: _ws_zero(True), None),
    Case("hunt_s39_weight_norm_over_a_zeroed_conv", lambda: _weight_norm_zero(False),
         Expect("forward", "conv2.parametrizations.weight.0", "_WeightNorm", step=0,
                op="aten._weight_norm_interface.default", marker="weight norm", cause="division-by-zero")),
    Case("hunt_s39_weight_norm_with_only_its_gain_zeroed_healthy", lambda: _weight_norm_zero(True), None),
    Case("hunt_s39_edm_c_noise_of_a_noise_level_of_zero", lambda: _edm_sigma_grid(False),
         Expect("forward", "", "EdmPrecond", step=2, op="aten.log.default", marker="c noise", cause="log-domain")),
    Case("hunt_s39_edm_noise_levels_from_the_first_nonzero_healthy", lambda: _edm_sigma_grid(True), None),
    Case("hunt_s39_newton_schulz_update_of_a_zero_gradient", lambda: _newton_schulz(0.0),
         Expect("optimizer", "aux", "Linear", step=0, op="aten.div.Tensor", marker="newton schulz",
                cause="optimizer-eps-underflow")),
    Case("hunt_s39_newton_schulz_with_eps_healthy", lambda: _newton_schulz(1e-7), None),
    Case("hunt_s39_mae_mask_ratio_curriculum_reaching_one", lambda: _mae(1.0),
         Expect("forward", "", "TinyMAE", step=2, op="aten.mean.dim", marker="mae pool", cause="empty-reduction")),
    Case("hunt_s39_mae_mask_ratio_capped_healthy", lambda: _mae(0.75), None),
    Case("hunt_s39_moco_queue_initialised_to_zeros", lambda: _moco(True),
         Expect("forward", "", "MoCoHead", step=0, op="aten.div.Tensor", marker="moco queue",
                cause="division-by-zero")),
    Case("hunt_s39_moco_queue_initialised_at_random_healthy", lambda: _moco(False), None),
    Case("hunt_s39_spectral_norm_by_hand_from_a_zero_vector", lambda: _spectral(True),
         Expect("forward", "0", "SNLinear", step=0, op="aten.div.Tensor", marker="power iteration",
                cause="division-by-zero")),
    Case("hunt_s39_spectral_norm_by_hand_from_a_random_vector_healthy", lambda: _spectral(False), None),
]
