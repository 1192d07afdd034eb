"""hunt23, the loss code, the loop's data and the optimizers: reported incidents, each with its healthy twin (hunt23b).

Loss code: PSNR used as a loss, ``-10 log10(mse)``, of a residual denoiser whose zero-initialised last layer returns a
clean input exactly (mse 0); MS-SSIM's contrast-structure term of an inverted image raised to its fractional scale
weight (a negative base: NaN; pytorch_msssim clamps it with a ReLU); counterfactual learning's inverse propensity
weight ``pi(a|x) / mu`` of a record logged with propensity 0 (the twin clips it); a decoupled contrastive loss (the
positive left out of the denominator) whose false-negative elimination masks every negative of a batch drawn from one
class (``logsumexp`` of a row of -inf); a Tweedie deviance of a rate head ending in a ReLU (``mu ** (1 - p)`` at 0).
The loop's data: a ``collate_fn`` padding sequences with NaN ("never mistaken for a reading") before a masked mean
that multiplies the padding by 0. Optimizers: Muon written by hand (Newton-Schulz in bfloat16) without the eps of its
normalisation, over a LoRA adapter whose A matrix has a gradient of exactly 0 at the first step (B starts at 0).
Each with the fix its users apply: the twin must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop as _loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- PSNR as a loss, of a perfect reconstruction
class ResidualDenoiser(nn.Module):
    """``x + net(x)`` with the last layer zero-initialised (as residual nets are): at step 0 it returns x exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 3, padding=1))
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def _psnr(eps: float) -> Scenario:
    """Per-image PSNR ``-10 log10(mse)``; the batch of step 0 holds a clean image (noise level 0) whose target is
    itself: its mse is exactly 0 and log10(0) is -inf. The twin adds eps to the mse."""
    torch.manual_seed(0)
    model = ResidualDenoiser()
    clean = [torch.rand(3, 1, 8, 8) for _ in range(4)]
    noisy = [c + 0.1 * torch.randn_like(c) for c in clean]
    noisy[0][1] = clean[0][1]  # a sample drawn at noise level 0

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        mse = ((out - clean[step]) ** 2).mean((1, 2, 3))
        psnr = -10 * torch.log10(mse + eps)  # producer: psnr
        return -psnr.mean()
    return _loop(model, lambda step: (noisy[step],), loss_fn, lr=1e-3)


# ---------------------------------------------------------------- MS-SSIM of an inverted image
MS_WEIGHTS = (0.0448, 0.2856, 0.3001)


def _ms_ssim(x: torch.Tensor, y: torch.Tensor, relu: bool) -> torch.Tensor:
    """MS-SSIM over three scales with a uniform 3x3 window: ``prod(cs_i ** w_i) * ssim_last ** w_last``."""
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    result = torch.ones(x.shape[0])
    for i, w in enumerate(MS_WEIGHTS):
        mu_x, mu_y = F.avg_pool2d(x, 3, 1), F.avg_pool2d(y, 3, 1)
        var_x = F.avg_pool2d(x * x, 3, 1) - mu_x ** 2
        var_y = F.avg_pool2d(y * y, 3, 1) - mu_y ** 2
        cov = F.avg_pool2d(x * y, 3, 1) - mu_x * mu_y
        cs = ((2 * cov + c2) / (var_x + var_y + c2)).mean((1, 2, 3))
        if i == len(MS_WEIGHTS) - 1:
            cs = cs * ((2 * mu_x * mu_y + c1) / (mu_x ** 2 + mu_y ** 2 + c1)).mean((1, 2, 3))
        if relu:
            cs = F.relu(cs)
        result = result * cs ** w  # producer: ms-ssim power
        x, y = F.avg_pool2d(x, 2), F.avg_pool2d(y, 2)
    return result


def _ms_ssim_loss(relu: bool) -> Scenario:
    """A residual image-to-image model trained on ``1 - MS-SSIM``; a negative scan (1 - x) slipped into the targets
    of step 2: its contrast-structure term is negative, and a negative number to the power 0.0448 is NaN. The twin:
    the ReLU."""
    torch.manual_seed(0)
    model = ResidualDenoiser()
    images = [torch.rand(3, 1, 16, 16) for _ in range(4)]
    targets = [(im + 0.05 * torch.randn_like(im)).clamp(0, 1) for im in images]
    targets[2][0] = 1 - images[2][0]  # a negative scan

    def loss_fn(out: torch.Tensor, step: int) -> torch.Tensor:
        return 1 - _ms_ssim(out, targets[step], relu).mean()
    return _loop(model, lambda step: (images[step],), loss_fn)


# ---------------------------------------------------------------- inverse propensity weighting of a propensity 0
def _ips(floor: float) -> Scenario:
    """Off-policy learning from logged bandit feedback, ``-(r * pi(a|x) / mu)``; the logging system wrote
    propensity 0 for the actions of a greedy fallback rule, and one is in the batch of step 1. The twin clips the
    propensity (clipped IPS)."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    contexts = _batches(8, 6)
    actions = [torch.randint(0, 4, (8,)) for _ in range(4)]
    rewards = [torch.rand(8) for _ in range(4)]
    propensities = [torch.rand(8) * 0.5 + 0.2 for _ in range(4)]
    propensities[1][5] = 0.0  # the fallback rule's action, logged with propensity 0

    def loss_fn(logits: torch.Tensor, step: int) -> torch.Tensor:
        pi = F.softmax(logits, -1).gather(1, actions[step][:, None]).squeeze(1)
        weight = pi / propensities[step].clamp(min=floor)  # producer: inverse propensity
        return -(rewards[step] * weight).mean()
    return _loop(policy, lambda step: (contexts[step],), loss_fn)


# ---------------------------------------------------------------- decoupled contrastive loss over one class
def _dcl(positive_in_denominator: bool) -> Scenario:
    """Two views per sample; the loss of a view is ``-pos + logsumexp(negatives)`` with the positive left out of the
    denominator (decoupled contrastive learning) and the negatives of the same class masked with -inf (false-negative
    elimination). A batch drawn from one class has no negative left: logsumexp of a row of -inf is -inf. The twin is
    InfoNCE, its positive in the denominator."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
    xs = _batches(6, 6)
    labels = [torch.randint(0, 3, (6,)) for _ in range(4)]
    labels[2] = torch.full((6,), 1)  # the sampler's last batch of the epoch: one class only
    noises = [(0.1 * torch.randn(6, 6), 0.1 * torch.randn(6, 6)) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            z1 = F.normalize(encoder(xs[step] + noises[step][0]), dim=-1)
            z2 = F.normalize(encoder(xs[step] + noises[step][1]), dim=-1)
            sim = z1 @ z2.T / 0.1
            pos = sim.diagonal()
            same = labels[step][:, None] == labels[step][None, :]
            negatives = sim.masked_fill(same, float("-inf"))
            if positive_in_denominator:
                denominator = torch.logsumexp(torch.cat([pos[:, None], negatives], 1), 1)
            else:
                denominator = torch.logsumexp(negatives, 1)  # producer: dcl negatives
            loss = (denominator - pos).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((encoder, opt), run)


# ---------------------------------------------------------------- a Tweedie deviance of a ReLU rate head
class ClaimsModel(nn.Module):
    """Insurance claims: the expected claim amount by a ReLU head (the twin: by ``exp``, the log link)."""

    def __init__(self, log_link: bool) -> None:
        super().__init__()
        self.net, self.log_link = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1)), log_link

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x).squeeze(-1)
        return out.exp() if self.log_link else torch.relu(out)


def _tweedie(log_link: bool) -> Scenario:
    """The Tweedie deviance with power 1.5, ``-y mu^(1-p) / (1-p) + mu^(2-p) / (2-p)``: a policy whose predicted
    amount the ReLU cut to exactly 0 gives ``0 ** -0.5``, inf (then 0 * inf for a policy without a claim)."""
    torch.manual_seed(0)
    model = ClaimsModel(log_link)
    with torch.no_grad():
        model.net[2].bias.fill_(0.3)
    xs = _batches(8, 5)
    xs[1][6] = torch.tensor([4.0, -4.0, 4.0, -4.0, 4.0])  # a policy the head prices below 0
    claims = [torch.where(torch.rand(8) < 0.7, torch.zeros(8), torch.rand(8) * 3) for _ in range(4)]
    p = 1.5

    def loss_fn(mu: torch.Tensor, step: int) -> torch.Tensor:
        y = claims[step]
        return (-y * mu ** (1 - p) / (1 - p) + mu ** (2 - p) / (2 - p)).mean()  # producer: tweedie
    return _loop(model, lambda step: (xs[step],), loss_fn)


# ---------------------------------------------------------------- a collate_fn padding with NaN
def _nan_padding(pad: float) -> Scenario:
    """Variable-length sensor sequences padded by ``pad_sequence(padding_value=nan)`` so that padding is "never
    mistaken for a reading"; the model's masked mean multiplies the padding by 0, and NaN * 0 is NaN. Step 0's
    sequences are all of one length; step 1's are not. The twin pads with 0."""
    torch.manual_seed(0)
    lengths = [6, 6, 6, 6, 4, 6, 3, 6, 6, 5, 6, 6]
    data = [(torch.randn(n, 3), torch.randn(1)) for n in lengths]

    def collate(samples):
        seqs = [s[0] for s in samples]
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad)  # producer: nan padding
        mask = torch.zeros(x.shape[:2])
        for i, s in enumerate(seqs):
            mask[i, :len(s)] = 1.0
        return x, mask, torch.stack([s[1] for s in samples])

    loader = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=collate)
    model = MaskedMeanRegressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> list[torch.Tensor]:
        losses = []
        for x, mask, y in loader:
            loss = F.mse_loss(model(x, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


class MaskedMeanRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


# ---------------------------------------------------------------- Muon by hand over a LoRA adapter
class HandMuon(torch.optim.Optimizer):
    """Muon (Keller Jordan): momentum, then the update orthogonalised by a quintic Newton-Schulz iteration in
    bfloat16, started from ``G / |G|``; written without the eps of that normalisation. Vectors step by SGD."""

    def __init__(self, params, lr: float, eps: float) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() < 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(0.95).add_(p.grad)
                x = buf.bfloat16()
                x = x / (x.norm() + group["eps"])  # producer: muon normalise
                for _ in range(5):
                    a = x @ x.T
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                p.add_(x.to(p.dtype), alpha=-group["lr"])
        return None


class LoraLinear(nn.Module):
    """A frozen base weight plus ``B A``, B zero-initialised as LoRA does: A's gradient is exactly 0 at step 0."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(2, 8) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _muon_lora(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), LoraLinear(), nn.Linear(8, 1))
    opt = HandMuon(model.parameters(), lr=0.02, eps=eps)
    xs, ys = _batches(6, 5), _batches(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


CASES = [
    Case("hunt23b_psnr_loss_of_a_perfect_reconstruction", lambda: _psnr(0.0),
         Expect("forward", None, step=0, op="aten.log10.default", marker="psnr")),
    Case("hunt23b_psnr_loss_with_eps_healthy", lambda: _psnr(1e-10), None),
    Case("hunt23b_ms_ssim_negative_contrast_structure_to_a_fractional_power", lambda: _ms_ssim_loss(False),
         Expect("forward", None, step=2, op="aten.pow.Tensor_Scalar", marker="ms-ssim power")),
    Case("hunt23b_ms_ssim_relu_healthy", lambda: _ms_ssim_loss(True), None),
    Case("hunt23b_inverse_propensity_of_a_record_logged_with_propensity_0", lambda: _ips(0.0),
         Expect("forward", None, step=1, op="aten.div.Tensor", marker="inverse propensity")),
    Case("hunt23b_inverse_propensity_clipped_healthy", lambda: _ips(1e-2), None),
    Case("hunt23b_decoupled_contrastive_over_a_batch_of_one_class", lambda: _dcl(False),
         Expect("forward", None, step=2, op="aten.logsumexp.default", marker="dcl negatives")),
    Case("hunt23b_infonce_positive_in_the_denominator_healthy", lambda: _dcl(True), None),
    Case("hunt23b_tweedie_deviance_of_a_relu_rate_of_0", lambda: _tweedie(False),
         Expect("forward", None, step=1, op="aten.pow.Tensor_Scalar", marker="tweedie")),
    Case("hunt23b_tweedie_deviance_log_link_healthy", lambda: _tweedie(True), None),
    Case("hunt23b_collate_pads_with_nan_before_a_masked_mean", lambda: _nan_padding(float("nan")),
         Expect("data", "", "MaskedMeanRegressor", step=1, op="aten.full.default", marker="nan padding")),
    Case("hunt23b_collate_pads_with_zero_healthy", lambda: _nan_padding(0.0), None),
    Case("hunt23b_hand_muon_without_eps_over_a_lora_a_of_zero_gradient", lambda: _muon_lora(0.0),
         Expect("optimizer", "2", "LoraLinear", step=0, op="aten.div.Tensor", marker="muon normalise",
                tensor=TensorRef.parameter("2.lora_a"))),
    Case("hunt23b_hand_muon_with_eps_healthy", lambda: _muon_lora(1e-7), None),
]
