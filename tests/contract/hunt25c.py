"""hunt25c, loop shapes the deferred check judges late: reported incidents, each with its healthy twin.

Gradient accumulation over four micro-batches whose third one's batch the loop standardises by a feature's std
that is 0 in it (a constant sensor), judged by the deferred check at the optimizer step, after the fourth micro-batch
fetched and standardised its own; a GAN whose discriminator's real batch gets instance noise of scale
``sqrt(1 - step / T)``, computed past its end (``T`` counted from 0); ``OneCycleLR`` given the ``max_lr`` of a learning
rate range test whose smoothed losses were NaN (the suggestion is the NaN); a watched teacher run under
``torch.inference_mode()`` whose cosine head normalises a blank sample. Each with the fix its users apply: the twin
must stay silent and bit-identical, in every mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- accumulation, the loop's standardisation
def _accumulated_standardise(eps: float) -> Scenario:
    """Four micro-batches a step, each standardised in the loop by its own mean and std; the third micro-batch of
    step 1 comes from a sensor stuck at one value in feature 2: its std is 0, ``(x - m) / s`` is 0 / 0. The twin
    adds eps to the std."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [[torch.randn(5, 4) for _ in range(4)] for _ in range(3)]
    ys = [[torch.randn(5, 1) for _ in range(4)] for _ in range(3)]
    xs[1][2][:, 2] = 3.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                x = xs[step][micro]
                x = (x - x.mean(0)) / (x.std(0) + eps)  # producer: micro standardise
                loss = F.mse_loss(model(x), ys[step][micro]) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a GAN's instance noise past its end
def _instance_noise(floored: bool) -> Scenario:
    """Instance noise on the discriminator's real batch, annealed as ``sqrt(1 - step / T)`` with ``T = 3`` steps
    counted from 0: at step 4 the root is of a negative. The twin clamps the fraction at 0."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
    discriminator = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    g_opt = torch.optim.SGD(generator.parameters(), lr=0.01)
    d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    reals = [torch.randn(6, 4) for _ in range(5)]
    zs = [torch.randn(6, 3) for _ in range(5)]
    noises = [torch.randn(6, 4) for _ in range(5)]
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(5):
            fake = generator(zs[step])
            left = torch.tensor(1.0 - step / 3)
            if floored:
                left = left.clamp(min=0.0)
            sigma = left.sqrt()  # producer: noise scale
            real = reals[step] + sigma * noises[step]
            d_loss = (F.binary_cross_entropy_with_logits(discriminator(real), ones)
                      + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros))
            d_opt.zero_grad()
            d_loss.backward()
            d_opt.step()
            g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            g_opt.zero_grad()
            g_loss.backward()
            g_opt.step()
            losses.append(torch.stack((d_loss.detach(), g_loss.detach())))
        return losses
    return Scenario((generator, discriminator, g_opt, d_opt), run)


# ---------------------------------------------------------------- OneCycleLR from a range test's NaN suggestion
def _one_cycle(suggested: bool) -> Scenario:
    """``max_lr`` is the range test's suggestion, the learning rate at the steepest descent of its smoothed losses;
    the test ran on into divergence and its smoothing carried the NaN back over every loss, so the suggestion is NaN
    and every learning rate OneCycleLR sets from it too: the first step writes NaN into every parameter. The twin
    falls back to a default where the suggestion is not finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    suggestion = float("nan")
    max_lr = suggestion if suggested else 0.01
    opt = torch.optim.SGD(model.parameters(), lr=max_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=8)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 1) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: one cycle step
            schedule.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a watched teacher under inference_mode
class CosineTeacher(nn.Module):
    """A teacher whose bias-free features are L2-normalised before its head (a cosine classifier)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.head, self.eps = nn.Linear(6, 8, bias=False), nn.Linear(8, 3), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h / (h.norm(dim=-1, keepdim=True) + self.eps))  # producer: teacher norm


def _inference_teacher(eps: float) -> Scenario:
    """Distillation with both models watched, the teacher run under ``torch.inference_mode()`` (its outputs are
    inference tensors, cloned for the loss); a blank sample at step 2 makes its feature 0: 0 / |0|. The twin adds
    eps to the norm."""
    torch.manual_seed(0)
    teacher = CosineTeacher(eps).eval()
    student = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(student.parameters(), lr=0.05)
    xs = [torch.randn(5, 6) for _ in range(4)]
    xs[2][4] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            with torch.inference_mode():
                soft = F.softmax(teacher(xs[step]) / 2.0, -1)
            loss = F.kl_div(F.log_softmax(student(xs[step]) / 2.0, -1), soft.clone(), reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((teacher, student, opt), run)


CASES = [
    Case("hunt25c_accumulation_standardised_third_micro_batch_of_a_stuck_sensor", lambda: _accumulated_standardise(0.0),
         Expect("data", "", "Sequential", step=1, op="aten.div.Tensor", marker="micro standardise",
                tensor=TensorRef.argument("input[0]"), cause="division-by-zero")),
    Case("hunt25c_accumulation_standardised_with_eps_healthy", lambda: _accumulated_standardise(1e-6), None),
    Case("hunt25c_gan_instance_noise_scale_past_its_end", lambda: _instance_noise(False),
         Expect("data", "", "Sequential", step=4, op="aten.sqrt.default", marker="noise scale",
                cause="sqrt-domain")),
    Case("hunt25c_gan_instance_noise_scale_clamped_healthy", lambda: _instance_noise(True), None),
    Case("hunt25c_one_cycle_lr_from_a_nan_range_test_suggestion", lambda: _one_cycle(True),
         Expect("optimizer", "0", "Linear", step=0, op="aten.add_.Tensor", marker="one cycle step",
                tensor=TensorRef.parameter("0.weight"), cause="nonfinite-number")),
    Case("hunt25c_one_cycle_lr_default_max_lr_healthy", lambda: _one_cycle(False), None),
    Case("hunt25c_inference_mode_teacher_normalises_a_blank_sample", lambda: _inference_teacher(0.0),
         Expect("forward", "", "CosineTeacher", step=2, op="aten.div.Tensor", marker="teacher norm",
                cause="division-by-zero")),
    Case("hunt25c_inference_mode_teacher_norm_eps_healthy", lambda: _inference_teacher(1e-6), None),
]
