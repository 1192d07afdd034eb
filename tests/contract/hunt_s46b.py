"""hunt_s46b, training code that keeps copies or calls the model several times a step, in every mode.

An EMA copy of the weights updated after each step with a zero-debiased average (``1 - decay ** t`` at ``t = 0``),
parameter by parameter (``%debug``'s locals are the last parameter's: the report says so) and with one foreach op as
timm's ``ModelEmaV3`` writes it; a hand-written foreach SGD and a decoupled weight decay by ``_foreach_mul_`` after
clipping (the recorded modes named no op or line for a parameter an in-place foreach op wrote); FixMatch's
consistency loss over the confident pseudo-labels (none at the start); a Lightning-style GAN (two optimizers,
``toggle_optimizer``, the minimax ``log(1 - D(G(z)))``); R-Drop, the batch through the model twice a step with
dropout. Each with its healthy twin.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.hunt_s46 import LAST_PASS
from contract.loops import batches as _batches


# ---------------------------------------------------------------- an EMA copy with a zero-debiased average
class DebiasedEMA:
    """An EMA of the weights, zero-initialised and debiased as Adam does (TensorFlow's ``zero_debias``): the shadow
    divided by ``1 - decay ** t``. Counting ``t`` from 0 makes the first update's correction ``1 - 1 = 0``."""

    def __init__(self, model: nn.Module, decay: float, first_t: int) -> None:
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.shadow = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        self.decay, self.t = decay, first_t

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        correction = 1 - self.decay ** self.t
        for (name, p), (_, q) in zip(model.named_parameters(), self.model.named_parameters()):
            self.shadow[name].mul_(self.decay).add_(p, alpha=1 - self.decay)
            q.copy_(self.shadow[name] / correction)  # producer: ema debias
        self.t += 1


class ForeachEMA(DebiasedEMA):
    """The same EMA over lists of tensors, as timm's ``ModelEmaV3`` writes it: one foreach op for every parameter."""

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        correction = 1 - self.decay ** self.t
        shadow, params = list(self.shadow.values()), list(model.parameters())
        torch._foreach_lerp_(shadow, params, 1 - self.decay)
        torch._foreach_copy_(list(self.model.parameters()), torch._foreach_div(shadow, correction))  # producer: foreach
        self.t += 1


def _foreach_sgd(guarded: bool) -> Scenario:
    """A hand-written SGD over the parameter list with foreach ops (as torch.optim's foreach path does it), the
    gradients averaged over the batch's real tokens; step 2's batch is all padding: ``g / 0``. Twin: the count
    clamped at 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    params = list(model.parameters())
    xs, ys = _batches(5, 4), _batches(5, 1)
    masks = [torch.ones(5, 1) for _ in range(4)]
    masks[2][:] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = (((model(xs[step]) - ys[step]) ** 2) * masks[step]).sum()
            for p in params:
                p.grad = None
            loss.backward()
            tokens = masks[step].sum().clamp(min=1) if guarded else masks[step].sum()
            with torch.no_grad():
                grads = [p.grad for p in params]
                torch._foreach_add_(params, torch._foreach_div(grads, tokens), alpha=-0.05)  # producer: foreach sgd
            losses.append(loss.detach())
        return losses

    return Scenario((model,), run)


def _foreach_decay(guarded: bool) -> Scenario:
    """Gradients clipped every step (``clip_grad_norm_``: the region between backward and step runs many ops and
    writes no parameter), then, from step 2 on, a decoupled weight decay by hand over the weight matrices with one
    foreach op, scaled per real token: step 2's batch is all padding, ``wd / 0``. Twin: the count clamped at 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    weights = [p for p in model.parameters() if p.dim() > 1]
    xs, ys = _batches(5, 4), _batches(5, 1)
    masks = [torch.ones(5, 1) for _ in range(4)]
    masks[2][:] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = (((model(xs[step]) - ys[step]) ** 2) * masks[step]).sum() / 5
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step >= 2:
                tokens = masks[step].sum().clamp(min=1) if guarded else masks[step].sum()
                with torch.no_grad():
                    torch._foreach_mul_(weights, 1 - 0.05 * 0.01 / tokens)  # producer: foreach decay
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _ema(first_t: int, ema_class: type[DebiasedEMA] = DebiasedEMA) -> Scenario:
    """The EMA copy is updated after each step and evaluated (validation under ``no_grad``). Twin: ``t`` from 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = ema_class(model, 0.99, first_t)
    xs, ys = _batches(4, 4), _batches(4, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema.update(model)
            with torch.no_grad():
                losses.append(F.mse_loss(ema.model(xs[step]), ys[step]))
        return losses

    return Scenario((model, ema.model, opt), run)


# ---------------------------------------------------------------- FixMatch: two views, confident pseudo-labels
def _fixmatch(guarded: bool) -> Scenario:
    """The model is called on a weak and a strong view of the unlabelled batch; the unsupervised loss is averaged
    over the samples whose pseudo-label is confident (> 0.95): at the start none is, ``0 / 0``. Twin: the count
    clamped at 1 (FixMatch's own form, a mean over the whole batch, is the same number)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True)
    labelled, labels = _batches(4, 6), [torch.randint(0, 4, (4,)) for _ in range(4)]
    unlabelled = _batches(8, 6)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            weak = unlabelled[step] + 0.01 * torch.randn(8, 6)
            strong = unlabelled[step] * (torch.rand(8, 6) > 0.3)
            with torch.no_grad():
                probs = model(weak).softmax(-1)
            confidence, pseudo = probs.max(-1)
            mask = (confidence > 0.95).float()
            count = mask.sum().clamp(min=1) if guarded else mask.sum()
            per_sample = F.cross_entropy(model(strong), pseudo, reduction="none")
            unsup = (per_sample * mask).sum() / count  # producer: fixmatch
            loss = F.cross_entropy(model(labelled[step]), labels[step]) + unsup
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a Lightning-style GAN, manual optimization
class LitGAN(nn.Module):
    """Generator and discriminator in one module (the root's forward is the generator), two optimizers, and
    ``toggle_optimizer`` freezing the other's parameters around each step, as Lightning's manual GAN loop does. The
    generator's loss is the minimax ``log(1 - D(G(z)))`` written by hand (the non-saturating BCE is the twin)."""

    def __init__(self, minimax: bool) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid())
        self.minimax = minimax
        self._optimizers: list[torch.optim.Optimizer] = []

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))]

    def toggle_optimizer(self, opt: torch.optim.Optimizer) -> None:
        mine = {id(p) for group in opt.param_groups for p in group["params"]}
        for p in self.parameters():
            p.requires_grad_(id(p) in mine)

    def training_step(self, batch: torch.Tensor, z: torch.Tensor) -> None:
        opt_g, opt_d = self._optimizers
        self.toggle_optimizer(opt_g)
        d_fake = self.discriminator(self(z))
        if self.minimax:
            g_loss = torch.log(1 - d_fake).mean()  # producer: minimax generator loss
        else:
            g_loss = F.binary_cross_entropy(d_fake, torch.ones_like(d_fake))
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        self.toggle_optimizer(opt_d)
        real = F.binary_cross_entropy(self.discriminator(batch), torch.ones(len(batch), 1))
        fake = F.binary_cross_entropy(self.discriminator(self(z).detach()), torch.zeros(len(z), 1))
        opt_d.zero_grad()
        ((real + fake) / 2).backward()
        opt_d.step()


def _lit_gan(minimax: bool) -> Scenario:
    """At iteration 2 the noise is drawn with a std of 1000 (a scale of 1e-3 misread): the generator's
    samples are far out, the discriminator's sigmoid rounds to exactly 1 for some, and ``log(1 - 1)`` is ``-inf``.
    Twin: the non-saturating loss (``binary_cross_entropy`` clamps its log at -100)."""
    torch.manual_seed(0)
    module = LitGAN(minimax)
    reals = _batches(6, 2)
    noise = _batches(6, 3)
    noise[2] = noise[2] * 1000.0

    def run() -> list[torch.Tensor]:
        module._optimizers = module.configure_optimizers()
        for step in range(4):
            module.training_step(reals[step], noise[step])
        return [p.detach().clone() for p in module.parameters()]

    return Scenario((module,), run)


# ---------------------------------------------------------------- R-Drop: two dropout passes of one batch a step
class DroppedDirection(nn.Module):
    """Dropout over a small feature vector, then its direction (a cosine head's input)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.drop, self.eps = nn.Dropout(0.5), eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.drop(h)
        return h / (h.norm(dim=-1, keepdim=True) + self.eps)  # producer: dropped direction


def _r_drop(eps: float) -> Scenario:
    """R-Drop: the batch goes through the model twice a step (two dropout masks), the loss is the cross-entropy of
    both plus their symmetric KL. A row whose four features all drop (1 in 16 a row) has no direction: ``0 / 0``,
    in one of the two passes. Twin: eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), DroppedDirection(eps), nn.Linear(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xs, ys = _batches(4, 6, steps=6), [torch.randint(0, 3, (4,)) for _ in range(6)]

    def run() -> list[torch.Tensor]:
        torch.manual_seed(3)  # the masks: step 2's second pass drops a whole row
        losses = []
        for step in range(6):
            a, b = model(xs[step]), model(xs[step])
            kl = F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="batchmean")
            kl = kl + F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
            loss = F.cross_entropy(a, ys[step]) + F.cross_entropy(b, ys[step]) + 0.5 * kl
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


CASES = [
    Case("hunt_s46_ema_zero_debias_at_t_0", lambda: _ema(0),
         Expect("optimizer", "0", "Linear", step=1, op="aten.div.Tensor", marker="ema debias", model="Sequential#2",
                kinds=frozenset({"+inf", "-inf"}), says=LAST_PASS)),
    Case("hunt_s46_ema_zero_debias_from_t_1_healthy", lambda: _ema(1), None),
    Case("hunt_s46_foreach_ema_zero_debias_at_t_0", lambda: _ema(0, ForeachEMA),
         Expect("optimizer", "0", "Linear", step=1, op="aten._foreach_div.Scalar", marker="foreach",
                model="Sequential#2", cause="division-by-zero")),
    Case("hunt_s46_foreach_ema_zero_debias_from_t_1_healthy", lambda: _ema(1, ForeachEMA), None),
    Case("hunt_s46_foreach_hand_sgd_all_padding_batch", lambda: _foreach_sgd(False),
         Expect("optimizer", "0", "Linear", step=2, op="aten._foreach_div.Tensor", marker="foreach sgd",
                cause="division-by-zero")),
    Case("hunt_s46_foreach_hand_sgd_clamped_count_healthy", lambda: _foreach_sgd(True), None),
    Case("hunt_s46_foreach_weight_decay_after_clipping_all_padding_batch", lambda: _foreach_decay(False),
         Expect("optimizer", "0", "Linear", step=2, op="aten.reciprocal.default", marker="foreach decay")),
    Case("hunt_s46_foreach_weight_decay_after_clipping_healthy", lambda: _foreach_decay(True), None),
    Case("hunt_s46_fixmatch_no_confident_pseudo_label_0_over_0", lambda: _fixmatch(False),
         Expect("forward", None, step=0, op="aten.div.Tensor", marker="fixmatch")),
    Case("hunt_s46_fixmatch_confident_count_clamped_healthy", lambda: _fixmatch(True), None),
    Case("hunt_s46_lightning_gan_minimax_log_of_a_saturated_discriminator", lambda: _lit_gan(True),
         Expect("forward", None, step=2, op="aten.log.default", marker="minimax generator loss",
                kinds=frozenset({"-inf"}))),
    Case("hunt_s46_lightning_gan_non_saturating_healthy", lambda: _lit_gan(False), None),
    Case("hunt_s46_r_drop_second_pass_drops_a_whole_row", lambda: _r_drop(0.0),
         Expect("forward", "2", "DroppedDirection", step=2, op="aten.div.Tensor", marker="dropped direction",
                kinds=frozenset({"nan"}))),
    Case("hunt_s46_r_drop_with_eps_healthy", lambda: _r_drop(1e-6), None),
]
