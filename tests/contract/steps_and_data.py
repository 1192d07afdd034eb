"""The step an event belongs to, and non-finite data that enters the loss code.

PRODUCT.md: the step is the training iteration (optimizer steps completed,
counting optimizers not passed to the watch; where no optimizer steps, a step
begins when the first top-level module call of the previous step is called
again), and a tensor no watched code produced (a NaN label) is phase ``data``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef

# The loss code's ops are recorded (localize/outside/recorder.py) and replayed, forward and backward, at an
# event, immediate or deferred (its small tensors are kept for the deferred check), in every mode but ops=True,
# which traces them.


def _regression(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _log_loss_first_iteration() -> Scenario:
    """The loss code's own log of negatives, in the first iteration; the optimizer is not passed."""
    model, opt = _regression()
    x = torch.randn(16, 4)

    def run() -> None:
        for _ in range(3):
            loss = torch.log(model(x) - 100).mean()  # producer: log loss
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model,), run)


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(((a - b) ** 2).sum(-1)).mean()  # producer: distance


def _sqrt_backward_third_iteration() -> Scenario:
    """sqrt's derivative at a zero distance, in the third iteration; the optimizer is not passed."""
    model, opt = _regression()
    batches = [torch.randn(8, 4) for _ in range(4)]

    def run() -> None:
        for step, x in enumerate(batches):
            out = model(x)
            target = out.detach() if step == 2 else torch.zeros_like(out)  # equal rows: distance 0
            loss = distance(out, target)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model,), run)


class LogLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # producer: inference log


def _third_inference_call() -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), LogLayer())
    batches = [torch.rand(4, 3) + 0.5, torch.rand(4, 3) + 0.5, -torch.rand(4, 3) - 0.5]

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(x) for x in batches]

    return Scenario((model,), run)


class TinyVAE(nn.Module):
    """A diffusers-style autoencoder: ``decode`` is a method, not ``forward``, and calls two submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.post_quant_conv = nn.Conv2d(2, 2, 1)
        self.decoder = nn.Sequential(nn.Conv2d(2, 2, 1), LogLayer())
        with torch.no_grad():
            for conv in (self.post_quant_conv, self.decoder[0]):
                conv.weight.copy_(torch.eye(2).view(2, 2, 1, 1))
                conv.bias.zero_()

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))


def _third_vae_decode() -> Scenario:
    """Each ``vae.decode`` is one step (two top-level submodule calls); the third decodes negative latents."""
    torch.manual_seed(0)
    vae = TinyVAE()
    latents = [torch.rand(1, 2, 4, 4) + 0.5, torch.rand(1, 2, 4, 4) + 0.5, -torch.rand(1, 2, 4, 4) - 0.5]

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [vae.decode(z) for z in latents]

    return Scenario((vae,), run)


def _gan_inference() -> Scenario:
    """A generator and a discriminator called twice per iteration, no optimizer: the generator fails at iteration 2."""
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(2, 4), LogLayer()), nn.Linear(4, 1)
    noise, real = [torch.randn(4, 2) for _ in range(4)], torch.rand(4, 4)

    def run() -> list[torch.Tensor]:
        scores = []
        with torch.no_grad():
            for step, z in enumerate(noise):
                gen[0].bias.fill_(-1000.0 if step == 2 else 1000.0)  # log of negatives in iteration 2
                scores += [disc(gen(z)), disc(real)]
        return scores

    return Scenario((gen, disc), run)


def _two_optimizers() -> Scenario:
    """A GAN-like loop: two models, two optimizers (neither passed); the generator's log at iteration 2."""
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(2, 4), LogLayer()), nn.Linear(4, 1)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.0)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.0)
    noise = [torch.randn(4, 2) for _ in range(4)]

    def run() -> None:
        for step, z in enumerate(noise):
            with torch.no_grad():
                gen[0].bias.fill_(-1000.0 if step == 2 else 1000.0)  # log of negatives in iteration 2
            d_loss = disc(gen(z).detach()).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = -disc(gen(z)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()

    return Scenario((gen, disc), run)


def _accumulation() -> Scenario:
    """Gradient accumulation over 4 micro-batches (optimizer passed); micro-batch 6 is the first bad one."""
    model, opt = _regression()
    micro = [torch.randn(4, 4) for _ in range(8)]

    def run() -> None:
        for index, x in enumerate(micro):
            loss = torch.log(model(x) + (-100.0 if index == 5 else 100.0)).mean()
            loss.backward()
            if index % 4 == 3:
                opt.step()
                opt.zero_grad()

    return Scenario((model, opt), run)


def _nan_label(hand_written: bool = False) -> Scenario:
    model, opt = _regression()
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    y[5, 0] = float("nan")

    def run() -> None:
        out = model(x)
        loss = ((out - y) ** 2).mean() if hand_written else F.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Scenario((model, opt), run)


def _nan_soft_labels() -> Scenario:
    """Cross entropy with class probabilities as targets, one row of them NaN."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, probabilities = torch.randn(8, 4), torch.softmax(torch.randn(8, 3), -1)
    probabilities[2] = float("nan")

    def run() -> None:
        F.cross_entropy(model(x), probabilities).backward()
        opt.step()

    return Scenario((model,), run)


def _loader_with_workers() -> Scenario:
    """Targets from a DataLoader with a worker process; the batch of step 2 holds a NaN label."""
    model, opt = _regression()
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    y[21, 0] = float("nan")  # batch 2 of 8 rows
    loader = DataLoader(TensorDataset(x, y), batch_size=8, num_workers=1)

    def run() -> None:
        for features, labels in loader:
            loss = F.l1_loss(model(features), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


def prepare(raw: torch.Tensor) -> torch.Tensor:
    """A batch's features, log-scaled in a helper the loop calls (its frame has returned by the event)."""
    return torch.log(raw)  # producer: prepare log


def _data_code_in_the_loop(step_of_bad: int | None, helper: bool = False) -> Scenario:
    """The loop standardises each batch (or log-scales it in a helper); the batch of ``step_of_bad`` makes a NaN.

    A constant feature (std 0) in that batch, or a zero count for the log. The data code is recorded from the
    optimizer step to the next model call; the deferred check judges the batch at the optimizer step, after
    the loss code ran, with the data code's records held for it.
    """
    model, opt = _regression()
    raws = [torch.rand(8, 4) + 0.5 for _ in range(4)]
    if step_of_bad is not None:
        if helper:
            raws[step_of_bad][3, 1] = -1.0  # a negative count
        else:
            raws[step_of_bad][:, 2] = 7.0  # a constant feature: its std is 0

    def run() -> None:
        for raw in raws:
            x = prepare(raw) if helper else (raw - raw.mean(0)) / raw.std(0)  # producer: loop standardise
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    return Scenario((model, opt), run)


CASES = [
    Case("loss_log_first_iteration_optimizer_not_passed", _log_loss_first_iteration,
         Expect("forward", None, step=0, op="aten.log.default", marker="log loss")),
    Case("loss_sqrt_backward_third_iteration_optimizer_not_passed", _sqrt_backward_third_iteration,
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="distance")),
    Case("third_inference_call", _third_inference_call,
         Expect("forward", "1", "LogLayer", step=2, op="aten.log.default", marker="inference log")),
    Case("third_vae_decode_of_two_submodules", _third_vae_decode,
         Expect("forward", "decoder.1", "LogLayer", step=2, op="aten.log.default", marker="inference log")),
    Case("gan_inference_discriminator_called_twice", _gan_inference,
         Expect("forward", "1", "LogLayer", step=2, op="aten.log.default", marker="inference log")),
    Case("two_optimizers_not_passed", _two_optimizers,
         Expect("forward", "1", "LogLayer", step=2, op="aten.log.default", marker="inference log")),
    Case("gradient_accumulation_second_iteration", _accumulation,
         Expect("forward", None, step=1, op="aten.log.default", op_modes=()),
         note="the loss code's op is asserted in the other loss cases"),
    Case("nan_label_given_to_mse_loss", _nan_label,
         Expect("data", None, step=0, tensor=TensorRef.argument("y"), op_modes=())),
    Case("nan_label_in_hand_written_loss", lambda: _nan_label(hand_written=True),
         Expect("data", None, step=0, tensor=TensorRef.argument("y"), op_modes=())),
    Case("nan_soft_labels_to_cross_entropy", _nan_soft_labels,
         Expect("data", None, step=0, tensor=TensorRef.argument("probabilities"), op_modes=())),
    Case("nan_label_from_a_loader_worker", _loader_with_workers,
         Expect("data", None, step=2, tensor=TensorRef.argument("labels"), op_modes=())),
    Case("data_code_in_the_loop_standardises_a_constant_feature", lambda: _data_code_in_the_loop(2),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="loop standardise",
                tensor=TensorRef.argument("input[0]"))),
    Case("data_code_in_the_loop_first_batch", lambda: _data_code_in_the_loop(0),
         Expect("data", "", "Sequential", step=0, op="aten.div.Tensor", marker="loop standardise")),
    Case("data_code_in_a_helper_log_of_a_negative", lambda: _data_code_in_the_loop(3, helper=True),
         Expect("data", "", "Sequential", step=3, op="aten.log.default", marker="prepare log")),
    Case("data_code_in_the_loop_healthy", lambda: _data_code_in_the_loop(None), None),
]
