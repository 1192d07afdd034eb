"""Deferred stress rows, round 34: more GPU-like loops that defer22..defer_s33 have not.

Each row runs in every mode (``defer=True`` and ``ops=True, defer=True``, what a GPU user runs, must say what the
immediate ones say; tests/test_defer_s34.py also holds the deferred report's module, op, line, phase, step and cause
and its ``%debug`` line to the immediate one's), each incident beside its healthy twin (the same loop with the fix):
cross-entropy over a micro-batch whose every token is ignored (2nd of 4 accumulated); Adam with ``eps=0`` over a
weight whose gradient is always 0 (the NaN born in ``optimizer.step()``); an inf gradient of a gate at 0 that
``clip_grad_norm_`` turns into NaN; a GAN whose NaN is in the generator's backward; forwards returning a dataclass
and a namedtuple; a ``torch.autocast("cpu", bfloat16)`` region; a metric module under ``no_grad`` whose NaN is
logged, not backpropagated, before a real NaN; an in-place ``div_`` on a ``select`` view of the output in the loss
code; the last, shorter batch of an epoch (a batch of one: its unbiased variance is ``0 / 0``); ``ReduceLROnPlateau``
stepped after the optimizer with the loss; ``model.zero_grad()`` before the forward; a teacher's parameters written
by a hand EMA update between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario, defer22
from contract.defer_s33 import STEPS, _data, _rms, _setup, _train


# ---------------------------------------------------------------- every token of the 2nd of 4 micro-batches ignored
def _ignored_tokens(floor: int) -> Scenario:
    """A token classifier accumulates 4 micro-batches a step, the loss a cross-entropy with ``ignore_index=-100``
    normalised by hand over the kept tokens; micro-batch 2 of step 1 is all padding (every label -100): ``0 / 0``
    unless the count is clamped to ``floor``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [[torch.randn(6, 4) for _ in range(4)] for _ in range(3)]
    labels = [[torch.randint(0, 3, (6,)) for _ in range(4)] for _ in range(3)]
    labels[1][1] = torch.full((6,), -100)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                y = labels[step][micro]
                total = F.cross_entropy(model(xs[step][micro]), y, ignore_index=-100, reduction="sum")
                kept = (y != -100).sum().clamp(min=floor)
                loss = total / kept / 4  # producer: kept tokens
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- Adam's denominator 0 with eps=0
def _adam_eps(eps: float) -> Scenario:
    """Every batch's last feature is 0 (a constant column the loader zero-fills): that column's weights get a
    gradient of exactly 0, Adam's ``sqrt(v) + eps`` is 0 and ``m / (sqrt(v) + eps)`` is ``0 / 0`` at step 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps, foreach=False)
    xs, ys = _data(STEPS)
    for x in xs:
        x[:, 3] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: adam step
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an inf gradient clip_grad_norm_ turns to NaN
class _Gated(nn.Module):
    """A regressor whose output is scaled by ``sqrt(gate)``, a learned gate initialised at ``start``: at 0 the
    forward is finite and the gate's gradient ``1 / (2 sqrt(0))`` is inf."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.body, self.gate = nn.Linear(4, 2), nn.Parameter(torch.tensor(start))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * (1 + self.gate.sqrt())  # producer: gate


def _clipped_inf(start: float) -> Scenario:
    torch.manual_seed(0)
    model = _Gated(start)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a GAN whose NaN is in the generator's backward
class _Generator(nn.Module):
    """A generator whose samples are pushed apart by a distance term ``sqrt(|a - b|^2 + eps)`` between sample pairs:
    two equal samples (a collapsed mode) make its backward ``0 / 0``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.net, self.eps = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)), eps

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fake = self.net(z)
        spread = ((fake[0::2] - fake[1::2]).pow(2).sum(-1) + self.eps).sqrt()  # producer: spread
        return fake, spread


def _gan_generator(eps: float) -> Scenario:
    """Discriminator step, then generator step; at step 2 two noise vectors are equal (a repeated seed)."""
    torch.manual_seed(0)
    generator = _Generator(eps)
    discriminator = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    reals = [torch.randn(6, 4) for _ in range(STEPS)]
    noises = [torch.randn(6, 3) for _ in range(STEPS)]
    noises[2][1] = noises[2][0]
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            fake, spread = generator(noises[step])
            d_loss = (F.binary_cross_entropy_with_logits(discriminator(reals[step]), ones)
                      + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones) - 0.01 * spread.mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
            losses += [d_loss.detach(), g_loss.detach()]
        return losses
    return Scenario((generator, discriminator, opt_g, opt_d), run)


# ---------------------------------------------------------------- forwards returning a dataclass, a namedtuple
@dataclass
class _Output:
    logits: torch.Tensor
    embedding: torch.Tensor


class _Pair(NamedTuple):
    logits: torch.Tensor
    embedding: torch.Tensor


class _Structured(nn.Module):
    """Returns its logits and an L2-normalised embedding as a dataclass (``named=False``) or a namedtuple."""

    def __init__(self, eps: float, named: bool) -> None:
        super().__init__()
        self.body, self.head, self.eps, self.named = nn.Linear(4, 8, bias=False), nn.Linear(8, 2), eps, named

    def forward(self, x: torch.Tensor) -> _Output | _Pair:
        h = self.body(x)
        embedding = h / (h.norm(dim=-1, keepdim=True) + self.eps)  # producer: embedding
        kind = _Pair if self.named else _Output
        return kind(self.head(torch.tanh(h)), embedding)


def _structured(eps: float, named: bool) -> Scenario:
    torch.manual_seed(0)
    model = _Structured(eps, named)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {2 if named else 1: 3})
    anchors = [torch.randn(5, 8) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step])
            loss = F.mse_loss(out.logits, ys[step]) + 0.1 * (out.embedding * anchors[step]).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a torch.autocast("cpu", bfloat16) region
def _autocast(eps: float) -> Scenario:
    """The forward and loss run under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the backward and step out of
    it; step 1's batch holds an all-zero row the RMS norm meets."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {1: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(xs[step]).float(), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a no_grad metric's NaN logged, then a real one
class _MaskedError(nn.Module):
    """A metric module (not part of the model): the mean absolute error over the samples a mask keeps."""

    def forward(self, prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        err = (prediction - target).abs().mean(-1)
        return (err * mask).sum() / mask.sum()  # producer: metric


def _metric(eps: float) -> Scenario:
    """Each step logs ``_MaskedError`` under ``torch.no_grad()``; step 1's mask keeps nothing (a NaN metric nothing
    backpropagates), and step 3's batch holds an all-zero row the model's RMS norm meets (the twin: eps)."""
    model, opt = _setup(eps)
    metric = _MaskedError()
    xs, ys = _data(STEPS, {3: 2} if eps == 0.0 else None)
    masks = [torch.ones(5) for _ in range(STEPS)]
    masks[1] = torch.zeros(5)

    def run() -> list[torch.Tensor]:
        logged = []
        for step in range(STEPS):
            out = model(xs[step])
            loss = F.mse_loss(out, ys[step])
            with torch.no_grad():
                logged.append(metric(out, ys[step], masks[step]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            logged.append(loss.detach())
        return logged
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an in-place div_ on a select view in the loss
def _select_div(floor: float) -> Scenario:
    """The loop turns the output's second column into a ratio in place (``out.select(1, 1).div_(counts)``); step 2's
    counts hold a 0 (the twin clamps them to ``floor``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)
    counts = [torch.rand(5) + 1.0 for _ in range(STEPS)]
    counts[2][3] = 0.0

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            out = model(xs[step]) * 1.0
            out.select(1, 1).div_(counts[step].clamp(min=floor))  # producer: select div
            loss = F.mse_loss(out, ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the last, shorter batch of an epoch
class _Standardise(nn.Module):
    """Standardises its input over the batch with the unbiased variance (a hand batch norm): ``0 / 0`` for a batch
    of one (no degree of freedom left)."""

    def __init__(self, correction: int) -> None:
        super().__init__()
        self.correction = correction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.var(0, correction=self.correction, keepdim=True)  # producer: batch variance
        return (x - x.mean(0, keepdim=True)) / (var + 1e-5).sqrt()


def _last_batch(correction: int) -> Scenario:
    """Two epochs over 16 samples in batches of 5: each epoch's last batch holds one sample."""
    torch.manual_seed(0)
    model = nn.Sequential(_Standardise(correction), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data, targets = torch.randn(16, 4), torch.randn(16, 2)

    def run() -> list[torch.Tensor]:
        losses = []
        for _epoch in range(2):
            for start in range(0, 16, 5):
                losses.append(_train(model, opt, data[start:start + 5], targets[start:start + 5]))
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- ReduceLROnPlateau after the optimizer
def _plateau(eps: float) -> Scenario:
    """The scheduler steps after the optimizer on the step's loss (``ReduceLROnPlateau.step(loss.item())``, a host
    read a step); step 2's batch holds an all-zero row the RMS norm meets."""
    model, opt = _setup(eps)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    xs, ys = _data(STEPS, {2: 0} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            losses.append(_train(model, opt, xs[step], ys[step]))
            scheduler.step(losses[-1].item())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- model.zero_grad() before the forward
def _zero_grad_first(eps: float) -> Scenario:
    """``model.zero_grad()`` opens each step, before the forward (not the optimizer's); the loss is a mean distance
    whose backward at a prediction equal to its target (step 1's filled-in label) is ``0 / 0``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            model.zero_grad()
            out = model(xs[step])
            target = ys[step].clone()
            if step == 1:
                target[2] = out[2].detach()
            loss = (((out - target) ** 2).sum(-1) + eps).sqrt().mean()  # producer: distance
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a teacher written by a hand EMA update
def _ema_teacher(first: int) -> Scenario:
    """A mean teacher: the student trains on the teacher's targets; after each step the loop updates a running
    average of the student's weights and writes its bias-corrected value into the teacher,
    ``avg / (1 - decay ** k)``. Counting ``k`` from ``first=0`` makes step 0's correction ``0 / 0`` in the teacher's
    weights; the teacher's next forward carries it (the twin counts from 1)."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    teacher = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    teacher.load_state_dict(student.state_dict())
    averages = [torch.zeros_like(p) for p in student.parameters()]
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    xs, _ = _data(STEPS)
    decay = 0.9

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.no_grad():
                target = teacher(xs[step])
            loss = F.mse_loss(student(xs[step] + 0.1), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for avg, s, t in zip(averages, student.parameters(), teacher.parameters(), strict=True):
                    avg.mul_(decay).add_(s, alpha=1 - decay)
                    t.copy_(avg / (1 - decay ** (step + first)))  # producer: ema
            losses.append(loss.detach())
        return losses
    return Scenario((student, teacher, opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect | None, healthy: Callable[[], Scenario],
         source: object = None, gaps: tuple[tuple[str, str], ...] = ()) -> list[Case]:
    return [Case(f"defer_s34_{name}", build, expect, source=source, gaps=gaps),
            Case(f"defer_s34_{name}_healthy", healthy, None)]


#: The gate's gradient was born +inf (``1 / (2 sqrt(0))``); clip_grad_norm_ then multiplied it by 0 (NaN). Only the
#: default and deferred watches count the birth's +inf; deferred and immediate agree in every mode (ops-defer as ops).
_CLIPPED_INF_GAPS = (
    ("full", "the full watch's replay of the root module sends a gradient of ones into its outputs, not the step's "
             "own: it reports '1 -inf' for a gradient that was born +inf"),
    ("ops", "ops=True counts the gate's gradient as the optimizer was about to step with it, after clip_grad_norm_ "
            "made inf * 0 of it: '1 nan', and the cause says 'its backward gave 1 nan (aten.div.Tensor)', where "
            "that op gave +inf"),
    ("ops-defer", "as ops=True (its immediate twin): '1 nan' for a gradient aten.div.Tensor made +inf"),
)
#: The spread term is computed from the generator's output inside its own forward: in graph terms downstream of
#: ``output[0]``, so the full watch's backward hooks see its NaN first in the gradient of that output.
_GAN_FULL_GAP = ("the full watch names 'code outside any watched module' (module None, 'grad of model output[0]') "
                 "for the generator's own sqrt backward; every other mode names _Generator")

CASES = [
    *_row("every_token_ignored_in_the_2nd_of_4_micro_batches", lambda: _ignored_tokens(0),
          Expect("forward", None, step=1, op="aten.div.Tensor", marker="kept tokens", cause="empty-reduction"),
          lambda: _ignored_tokens(1)),
    *_row("adam_eps_0_over_a_weight_whose_gradient_is_0", lambda: _adam_eps(0.0),
          Expect("optimizer", "0", "Linear", step=0, op="aten.addcdiv_.default", marker="adam step",
                 cause="optimizer-eps-underflow"),
          lambda: _adam_eps(1e-8)),
    *_row("inf_gradient_turned_nan_by_clip_grad_norm", lambda: _clipped_inf(0.0),
          Expect("backward", "", "_Gated", step=0, op="aten.div.Tensor", marker="gate", cause="sqrt-domain",
                 kinds=frozenset({"+inf"})),
          lambda: _clipped_inf(0.25), gaps=_CLIPPED_INF_GAPS),
    *_row("gan_nan_in_the_generators_backward", lambda: _gan_generator(0.0),
          Expect("backward", "", "_Generator", step=2, op="aten.div.Tensor", marker="spread", cause="sqrt-domain"),
          lambda: _gan_generator(1e-6), gaps=(("full", _GAN_FULL_GAP),)),
    *_row("forward_returns_a_dataclass", lambda: _structured(0.0, False),
          Expect("forward", "", "_Structured", step=1, op="aten.div.Tensor", marker="embedding",
                 cause="division-by-zero"),
          lambda: _structured(1e-6, False)),
    *_row("forward_returns_a_namedtuple", lambda: _structured(0.0, True),
          Expect("forward", "", "_Structured", step=2, op="aten.div.Tensor", marker="embedding",
                 cause="division-by-zero"),
          lambda: _structured(1e-6, True)),
    *_row("autocast_cpu_bfloat16_region", lambda: _autocast(0.0), _rms(1), lambda: _autocast(1e-6), defer22),
    *_row("no_grad_metric_nan_logged_then_a_real_nan", lambda: _metric(0.0), _rms(3), lambda: _metric(1e-6),
          defer22),
    *_row("in_place_div_on_a_select_view_in_the_loss", lambda: _select_div(0.0),
          Expect("forward", None, step=2, op="aten.div_.Tensor", marker="select div", cause="division-by-zero"),
          lambda: _select_div(1e-3)),
    *_row("last_shorter_batch_of_an_epoch", lambda: _last_batch(1),
          Expect("forward", "0", "_Standardise", step=3, op="aten.var.correction", marker="batch variance",
                 cause="division-by-zero"),
          lambda: _last_batch(0)),
    *_row("reduce_lr_on_plateau_after_the_optimizer", lambda: _plateau(0.0), _rms(2), lambda: _plateau(1e-6),
          defer22),
    *_row("model_zero_grad_before_the_forward", lambda: _zero_grad_first(0.0),
          Expect("backward", None, step=1, op="aten.div.Tensor", marker="distance", cause="sqrt-domain"),
          lambda: _zero_grad_first(1e-6)),
    *_row("teacher_written_by_a_hand_ema_update", lambda: _ema_teacher(0),
          Expect("optimizer", "0", "Linear", step=1, op="aten.div.Tensor", marker="ema", cause="division-by-zero"),
          lambda: _ema_teacher(1)),
]
