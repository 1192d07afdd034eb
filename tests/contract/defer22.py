"""Training loop shapes, each an incident and its healthy twin, held in every mode: the deferred mode (CUDA's default,
``defer=True``) must say what the immediate one says (defer22).

The NaN is one op (an RMS norm without eps over an all-zero row, ``0 / 0``; in the data and update code, a
normalisation and a hand clip by a norm of 0) placed where the loop's shape makes the deferred check's work hard:
gradient accumulation over 4 micro-batches (the NaN in the third); a GAN's two optimizers (the NaN in the
discriminator's step); more top-level model calls a step than the step replay keeps (MAX_CALLS, the NaN in an early
one); an evaluation loop under ``no_grad`` with no optimizer; a GradScaler's skipped step (inf gradients, benign)
before the real NaN; an LBFGS closure; a scheduler stepping; a loss read with ``.item()`` every step (the user's own
host sync); ``no_grad`` validation between training steps; a batch normalised by the loop; a hand-written gradient
clip. (The watch left mid-step by an exception and entered again: tests/test_defer22.py, two watches a run.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from nan_magic.localize.replay.tiered.step_keeping import MAX_CALLS
from nan_magic.records import TensorRef, TensorRole


class RmsNorm(nn.Module):
    """``x / rms(x)``; without eps an all-zero row is ``0 / 0``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()  # producer: rms norm


def _net(eps: float, width: int = 4, out: int = 2) -> nn.Sequential:
    return nn.Sequential(RmsNorm(eps), nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, out))


def _zero_row(x: torch.Tensor, row: int = 1) -> torch.Tensor:
    x = x.clone()
    x[row] = 0.0
    return x


def _loss(out: torch.Tensor, y: torch.Tensor, where: str, bad: bool, eps: float) -> torch.Tensor:
    """The loop's loss: a weighted mean of squared errors, or (``where="grad"``) a mean distance. Where ``bad``:
    ``"loss"``, every sample's weight is 0 (a batch of ignored samples: 0 / 0 in the loss code); ``"grad"``, one
    sample's target is its prediction (a missing label filled in): the distance's backward at 0 is 0 / 0."""
    if where == "grad":
        target = y.clone()
        if bad:
            target[1] = out[1].detach()
        return (((out - target) ** 2).sum(-1) + eps).sqrt().mean()  # producer: distance
    weights = torch.zeros(len(out)) if where == "loss" and bad else torch.ones(len(out))
    err = ((out - y) ** 2).mean(-1)
    return (weights * err).sum() / (weights.sum() + eps)  # producer: loss weights


#: What every RMS norm incident says: the norm, its div, at its line.
def _rms(step: int, module: str = "0") -> Expect:
    return Expect("forward", module, "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm")


# ---------------------------------------------------------------- gradient accumulation over 4 micro-batches
def _accumulation(eps: float, where: str = "model") -> Scenario:
    """Three optimizer steps of 4 micro-batches each; the NaN is born in the third micro-batch of step 1: its
    all-zero row (``where="model"``), its loss code or its backward (see :func:`_loss`)."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [[torch.randn(5, 4) for _ in range(4)] for _ in range(3)]
    ys = [[torch.randn(5, 2) for _ in range(4)] for _ in range(3)]
    if where == "model":
        xs[1][2] = _zero_row(xs[1][2])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                loss = _loss(model(xs[step][micro]), ys[step][micro], where, (step, micro) == (1, 2), eps) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a GAN: two optimizers, the NaN in the discriminator's
def _gan(eps: float, where: str = "model") -> Scenario:
    """A generator and a discriminator, each with its optimizer; the discriminator's real batch at step 2 has an
    all-zero row (its RMS norm: 0 / 0), in the discriminator's step."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4))
    discriminator = _net(eps, out=1)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    reals = [torch.randn(6, 4) for _ in range(4)]
    noises = [torch.randn(6, 3) for _ in range(4)]
    if where == "model":
        reals[2] = _zero_row(reals[2])
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            fake = generator(noises[step])
            d_loss = (_loss(discriminator(reals[step]), ones, where, step == 2, eps)
                      + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            losses += [d_loss.detach(), g_loss.detach()]
        return losses
    return Scenario((generator, discriminator, opt_g, opt_d), run)


# ---------------------------------------------------------------- more top-level calls a step than the replay keeps
def _many_calls(eps: float, where: str = "model", chunks: int = MAX_CALLS + 4, bad: int = 1) -> Scenario:
    """The model runs over MAX_CALLS + 4 chunks a step (a long sequence cut in windows); at step 1 the second
    chunk (``bad``) has an all-zero row: the step replay keeps the last MAX_CALLS calls only."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [[torch.randn(3, 4) for _ in range(chunks)] for _ in range(3)]
    ys = [[torch.randn(3, 2) for _ in range(chunks)] for _ in range(3)]
    if where == "model":
        xs[1][bad] = _zero_row(xs[1][bad])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            pairs = enumerate(zip(xs[step], ys[step]))
            loss = sum(_loss(model(x), y, where, (step, i) == (1, bad), eps) for i, (x, y) in pairs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an evaluation loop: no optimizer, no_grad
def _evaluation(eps: float, where: str = "model") -> Scenario:
    """Inference under ``torch.no_grad()`` over 5 batches, no optimizer watched; batch 3 has an all-zero row."""
    torch.manual_seed(0)
    model = _net(eps).eval()
    xs = [torch.randn(4, 4) for _ in range(5)]
    ys = [torch.randn(4, 2) for _ in range(5)]
    if where == "model":
        xs[3] = _zero_row(xs[3])

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [_loss(model(x), y, where, i == 3, eps) for i, (x, y) in enumerate(zip(xs, ys))]
    return Scenario((model,), run)


# ---------------------------------------------------------------- a GradScaler's skipped step, then a real NaN
def _scaler_skip_then_nan(eps: float, scale: float = 2.0 ** 17) -> Scenario:
    """float16 autocast with a GradScaler whose initial scale overflows the gradients: step 0 is skipped (benign);
    at step 2 the batch has an all-zero row."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]
    xs[2] = _zero_row(xs[2])

    def run() -> tuple[list[torch.Tensor], float]:
        losses = []
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(xs[step]).float(), ys[step])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        return losses, scaler.get_scale()
    return Scenario((model, opt, scaler), run)


# ---------------------------------------------------------------- an LBFGS closure
def _lbfgs(eps: float, where: str = "model") -> Scenario:
    """``opt.step(closure)``: the model runs in the closure, twice a step (max_iter=2); step 2's batch has an
    all-zero row."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]
    if where == "model":
        xs[2] = _zero_row(xs[2])

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = _loss(model(xs[step]), ys[step], where, step == 2, eps)
                loss.backward()
                return loss
            losses.append(opt.step(closure).detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a plain loop: a scheduler, .item(), validation
def _plain(eps: float, scheduler: bool = False, item: bool = False, validate: bool = False, where: str = "model"
           ) -> Scenario:
    """SGD over 4 steps, with a StepLR scheduler stepping, the loss read by ``.item()`` every step, or a validation
    batch under ``no_grad`` after every step. The all-zero row: step 2's batch, or (validate) step 1's validation
    batch, run after step 1's optimizer step."""
    torch.manual_seed(0)
    model = _net(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]
    vals = [torch.randn(6, 4) for _ in range(4)]
    if validate and where == "model":
        vals[1] = _zero_row(vals[1])
    elif not validate:
        xs[2] = _zero_row(xs[2])

    def run() -> list[object]:
        seen: list[object] = []
        for step in range(4):
            model.train()
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if scheduler:
                sched.step()
            seen.append(loss.item() if item else loss.detach())
            if validate:
                model.eval()
                with torch.no_grad():
                    seen.append(_loss(model(vals[step]), ys[step], where, step == 1, eps))
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN born in the data code: the loop normalises
def _normalised_in_loop(eps: float) -> Scenario:
    """The loop standardises each batch per feature, ``(x - mean) / std``; at step 2 a feature is constant over the
    batch (a dead sensor): 0 / 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]
    xs[2][:, 1] = 3.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            x = xs[step]
            x = (x - x.mean(0)) / (x.std(0) + eps)  # producer: batch standardised
            loss = F.mse_loss(model(x), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN born in the update code: a clip by hand
def _hand_clip(eps: float) -> Scenario:
    """The loop scales the gradients to a norm of 1 by hand, ``g * (1 / norm)``; at step 2 every target is masked
    out, the gradients are all 0, and the scale is 1 / 0: 0 * inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]
    masks = [torch.ones(6, 1) for _ in range(4)]
    masks[2].zero_()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            loss = ((model(xs[step]) - ys[step]).pow(2) * masks[step]).sum() / masks[step].sum().clamp_min(1)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
                for p in model.parameters():
                    p.grad.mul_(1.0 / (norm + eps))  # producer: hand clip
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- two losses, two backward passes before the step
def _two_backwards(eps: float) -> Scenario:
    """``l1.backward(retain_graph=True); l2.backward()`` (a multi-task loss backpropagated loss by loss); at step 2
    the first loss's backward is 0 / 0, judged at the deferred check after the second backward ran."""
    torch.manual_seed(0)
    model = _net(1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(6, 4) for _ in range(4)], [torch.randn(6, 2) for _ in range(4)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(4):
            out = model(xs[step])
            first, second = _loss(out, ys[step], "grad", step == 2, eps), out.pow(2).mean()
            opt.zero_grad()
            first.backward(retain_graph=True)
            second.backward()
            opt.step()
            losses += [first.detach(), second.detach()]
        return losses
    return Scenario((model, opt), run)


def _loss_code(step: int) -> Expect:
    return Expect("forward", None, step=step, op="aten.div.Tensor", marker="loss weights")


#: The gradient flowing into the model's output, which the check saw (its counts: 2 nan of 6).
OUTPUT_GRADIENT = TensorRef(TensorRole.OUTPUT_GRADIENT, "", "output")


def _distance_backward(step: int) -> Expect:
    return Expect("backward", None, step=step, op="aten.div.Tensor", marker="distance", tensor=OUTPUT_GRADIENT,
                  kinds=frozenset({"nan"}))


CASES = [
    Case("defer22_accumulation_nan_in_micro_batch_3", lambda: _accumulation(0.0), _rms(1)),
    Case("defer22_accumulation_healthy", lambda: _accumulation(1e-6), None),
    Case("defer22_accumulation_loss_code_nan_in_micro_batch_3", lambda: _accumulation(0.0, "loss"), _loss_code(1)),
    Case("defer22_accumulation_backward_nan_in_micro_batch_3", lambda: _accumulation(0.0, "grad"),
         _distance_backward(1)),
    Case("defer22_accumulation_distance_healthy", lambda: _accumulation(1e-6, "grad"), None),
    # The discriminator is the second model watched: its modules are named within it ("0"), report.model says which.
    Case("defer22_gan_nan_in_the_discriminator_step", lambda: _gan(0.0), _rms(2)),
    Case("defer22_gan_loss_code_nan_in_the_discriminator_step", lambda: _gan(0.0, "loss"), _loss_code(2)),
    Case("defer22_gan_backward_nan_in_the_discriminator_step", lambda: _gan(0.0, "grad"), _distance_backward(2)),
    Case("defer22_gan_healthy", lambda: _gan(1e-6), None),
    Case("defer22_gan_distance_healthy", lambda: _gan(1e-6, "grad"), None),
    Case("defer22_more_calls_than_max_calls_nan_in_an_early_one", lambda: _many_calls(0.0), _rms(1)),
    Case("defer22_more_calls_than_max_calls_loss_code_nan", lambda: _many_calls(0.0, "loss"), _loss_code(1)),
    # Deferred, the gradient into call 1 (let go of by the step replay) is held for the check to count it
    # (StepKeeping.capture_gradient); past 2 * MAX_CALLS calls the step is judged mid-backward as MAX_CALLS are held
    # (tests/test_defer22.py: the NaN's gradient judged there).
    Case("defer22_more_calls_than_max_calls_backward_nan", lambda: _many_calls(0.0, "grad"), _distance_backward(1)),
    Case("defer22_twice_max_calls_distance_healthy", lambda: _many_calls(1e-6, "grad", 2 * MAX_CALLS + 4), None),
    Case("defer22_more_calls_than_max_calls_healthy", lambda: _many_calls(1e-6), None),
    Case("defer22_more_calls_than_max_calls_distance_healthy", lambda: _many_calls(1e-6, "grad"), None),
    # No optimizer: a step is a top-level call (the fourth batch is step 3).
    Case("defer22_evaluation_no_grad_nan_in_batch_3", lambda: _evaluation(0.0), _rms(3)),
    Case("defer22_evaluation_no_grad_healthy", lambda: _evaluation(1e-6), None),
    # The skipped step is not counted: the NaN's iteration 2 is step 1.
    Case("defer22_scaler_skipped_step_then_a_real_nan", lambda: _scaler_skip_then_nan(0.0),
         Expect("forward", "0", "RmsNorm", step=1, op="aten.div.Tensor", marker="rms norm", benign_events=1)),
    Case("defer22_scaler_skipped_step_healthy", lambda: _scaler_skip_then_nan(1e-6), None, benign=1),
    Case("defer22_lbfgs_closure_nan", lambda: _lbfgs(0.0), _rms(2)),
    Case("defer22_lbfgs_closure_loss_code_nan", lambda: _lbfgs(0.0, "loss"), _loss_code(2)),
    Case("defer22_lbfgs_closure_backward_nan", lambda: _lbfgs(0.0, "grad"), _distance_backward(2)),
    Case("defer22_lbfgs_closure_healthy", lambda: _lbfgs(1e-6), None),
    Case("defer22_scheduler_stepping_nan", lambda: _plain(0.0, scheduler=True), _rms(2)),
    Case("defer22_scheduler_stepping_healthy", lambda: _plain(1e-6, scheduler=True), None),
    Case("defer22_loss_item_every_step_nan", lambda: _plain(0.0, item=True), _rms(2)),
    Case("defer22_loss_item_every_step_healthy", lambda: _plain(1e-6, item=True), None),
    # Run after step 1's optimizer step, the validation call belongs to step 2.
    Case("defer22_no_grad_validation_between_steps_nan", lambda: _plain(0.0, validate=True), _rms(2)),
    Case("defer22_no_grad_validation_between_steps_healthy", lambda: _plain(1e-6, validate=True), None),
    Case("defer22_batch_normalised_in_the_loop_nan", lambda: _normalised_in_loop(0.0),
         Expect("data", "", "Sequential", step=2, op="aten.div.Tensor", marker="batch standardised",
                tensor=TensorRef(TensorRole.INPUT, None, "input[0]"))),
    Case("defer22_batch_normalised_in_the_loop_healthy", lambda: _normalised_in_loop(1e-6), None),
    # As gaps16's clip by hand: the gradient of the first parameter written, 1 / 0 its op.
    Case("defer22_hand_clip_by_a_norm_of_0", lambda: _hand_clip(0.0),
         Expect("backward", None, step=2, op="aten.reciprocal.default", marker="hand clip",
                tensor=TensorRef(TensorRole.PARAMETER_GRADIENT, "0.weight", ""))),
    Case("defer22_hand_clip_with_eps_healthy", lambda: _hand_clip(1e-6), None),
    # The op, its line and cause: the first loss's code replayed (defer named none before GradientChecks.judge took
    # the loss of the backward that made the gradient, not the last backward's); its gradient's counts (deferred: the
    # first backward's gradient, replaced in the step replay's capture by the second's, is kept for the check to
    # count: StepKeeping.capture_gradient, RootCall.earlier_grads).
    Case("defer22_two_backward_passes_nan_in_the_first", lambda: _two_backwards(0.0),
         Expect("backward", None, step=2, op="aten.div.Tensor", marker="distance", cause="sqrt-domain")),
    Case("defer22_two_backward_passes_nan_in_the_first_counted", lambda: _two_backwards(0.0), _distance_backward(2)),
    Case("defer22_two_backward_passes_healthy", lambda: _two_backwards(1e-6), None),
]
