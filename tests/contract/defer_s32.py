"""Deferred stress rows, round 32: more of what a GPU loop does that defer_s29..defer_s31 have not.

Each row runs in every mode (``defer=True`` and ``ops=True, defer=True``, what a GPU user runs, must say what the
immediate ones say; tests/test_defer_s32.py also holds the deferred report's line and ``%debug`` frame to the
immediate one's), each incident beside its healthy twin (the same loop with the fix): a NaN in step k while the loop
reads step k-1's loss late (lagged logging, the usual way to spare a sync); bf16 autocast with the NaN in an op
autocast keeps in float32 (a cross entropy over a batch all ``ignore_index``); a model returning a tuple whose 2nd
element alone goes bad; a loss summed over micro-batches into a running tensor, one backward, no ``.item()``; a NaN
only in the gradient of a branch the loss multiplies by 0 (DDP's unused-parameter trick); a forward that writes a
buffer in place (a running variance by hand) which turns NaN; an evaluation pass under ``torch.inference_mode``
between training steps, the NaN in the evaluation; a teacher under ``no_grad`` and a student, the NaN in the
teacher; an infinite learning rate from a scheduler's lambda, whose NaN parameters the next forward meets; a NaN in
the 50th step; a GAN's ``update(opt, loss)`` helper called for D then G, G's Adam at fault (judged in D's call). The
NaN is defer22's (an RMS norm without eps over an all-zero row) or one of the row's own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario, defer22
from contract.defer22 import _net, _zero_row

STEPS = 4


def _rms(step: int, module: str = "0") -> Expect:
    return Expect("forward", module, "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm",
                  cause="division-by-zero")


def _data(count: int, bad: dict[int, int] | None = None, rows: int = 5, width: int = 4
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    xs, ys = [torch.randn(rows, width) for _ in range(count)], [torch.randn(rows, 2) for _ in range(count)]
    for index, row in (bad or {}).items():
        xs[index] = _zero_row(xs[index], row)
    return xs, ys


def _setup(eps: float) -> tuple[nn.Sequential, torch.optim.SGD]:
    torch.manual_seed(0)
    model = _net(eps)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


# ---------------------------------------------------------------- step k's NaN while step k-1's loss is unread
def _lagged_logging(eps: float) -> Scenario:
    """The loop logs the previous step's loss after this step's forward (``prev.item()``: the sync a GPU loop puts
    off by a step); step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 1} if eps == 0.0 else None)

    def run() -> list[float]:
        logged: list[float] = []
        prev = None
        for step in range(STEPS):
            loss = F.mse_loss(model(xs[step]), ys[step])
            if prev is not None:
                logged.append(prev.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
            prev = loss.detach()
        return logged
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- bf16 autocast, the NaN in a float32-kept op
def _autocast_cross_entropy(eps: float) -> Scenario:
    """A classifier under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (CUDA's ``amp`` on a GPU); the cross
    entropy, which autocast runs in float32, over a batch whose labels are all ``ignore_index`` at step 2 (0 / 0);
    the twin sums and divides by the count of labels plus eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(6, 4) for _ in range(STEPS)]
    labels = [torch.randint(0, 3, (6,)) for _ in range(STEPS)]
    labels[2] = torch.full((6,), -100)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(xs[step])
                if eps == 0.0:
                    loss = F.cross_entropy(logits, labels[step])  # producer: all ignored
                else:
                    counted = (labels[step] != -100).sum() + eps
                    loss = F.cross_entropy(logits, labels[step], reduction="sum") / counted
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a tuple output, the NaN in its 2nd element only
class _TwoHeads(nn.Module):
    """``(prediction, embedding)``: the embedding is the hidden state over its norm (0 / 0 at an all-zero row)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.body, self.head, self.eps = nn.Linear(4, 8, bias=False), nn.Linear(8, 2), eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        embedding = h / (h.norm(dim=-1, keepdim=True) + self.eps)  # producer: embedding norm
        return self.head(torch.tanh(h)), embedding


def _tuple_output(eps: float) -> Scenario:
    torch.manual_seed(0)
    model = _TwoHeads(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {2: 1})  # the prediction is finite at a zero row (the head's bias): only the embedding
    anchors = [torch.randn(5, 8) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            prediction, embedding = model(xs[step])
            loss = F.mse_loss(prediction, ys[step]) + 0.1 * (embedding * anchors[step]).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- micro-batch losses summed into a running tensor
def _running_loss(eps: float) -> Scenario:
    """Each step sums 4 micro-batches' losses into a running tensor (no ``.item()``), one backward of the sum;
    step 1's third micro-batch holds an all-zero row."""
    model, opt = _setup(eps)
    torch.manual_seed(0)
    xs = [[torch.randn(5, 4) for _ in range(4)] for _ in range(3)]
    ys = [[torch.randn(5, 2) for _ in range(4)] for _ in range(3)]
    if eps == 0.0:
        xs[1][2] = _zero_row(xs[1][2])

    def run() -> list[torch.Tensor]:
        totals = []
        for step in range(3):
            running = torch.zeros(())
            for micro in range(4):
                running = running + F.mse_loss(model(xs[step][micro]), ys[step][micro]) / 4
            opt.zero_grad()
            running.backward()
            opt.step()
            totals.append(running.detach())
        return totals
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a branch the loss multiplies by 0
class _WithAux(nn.Module):
    """A regressor and an auxiliary distance head the loss keeps at weight 0 (DDP's unused-parameter trick)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.main, self.aux, self.eps = nn.Linear(4, 2), nn.Linear(4, 3, bias=False), eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.aux(x)
        return self.main(x), (a.pow(2).sum(-1) + self.eps).sqrt()  # producer: aux distance


def _zero_weight_branch(eps: float) -> Scenario:
    """Step 2's batch holds an all-zero row: the aux distance is 0 there, finite; its backward is 0 * inf, NaN in
    the aux head's weight gradient only."""
    torch.manual_seed(0)
    model = _WithAux(eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS, {2: 1})

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            prediction, aux = model(xs[step])
            loss = F.mse_loss(prediction, ys[step]) + 0.0 * aux.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a buffer written in place by the forward
class _HandNorm(nn.Module):
    """A batch norm by hand: a running variance buffer updated in place each training forward, the batch scaled by
    it; the batch variance is unbiased (``x.var(0)``), 0 / 0 for a batch of one sample."""

    def __init__(self, correction: int) -> None:
        super().__init__()
        self.register_buffer("running_var", torch.ones(4))
        self.correction = correction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            batch_var = x.var(0, correction=self.correction)  # producer: batch variance
            with torch.no_grad():
                self.running_var.mul_(0.9).add_(0.1 * batch_var)
        return x / (self.running_var + 1e-5).sqrt()


def _buffer_in_place(correction: int) -> Scenario:
    """Step 2's batch is one sample (the loader's last, ``drop_last=False``)."""
    torch.manual_seed(0)
    model = nn.Sequential(_HandNorm(correction), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _data(STEPS)
    xs[2], ys[2] = xs[2][:1], ys[2][:1]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an evaluation under inference_mode between steps
def _inference_eval(eps: float) -> Scenario:
    """After each training step, an evaluation batch under ``torch.inference_mode()``; the one after step 1 holds
    an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS)
    evals, _ = _data(STEPS, {1: 2} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        seen = []
        for step in range(STEPS):
            model.train()
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            with torch.inference_mode():
                seen.append(model(evals[step]).abs().mean().clone())
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a teacher under no_grad, the NaN in the teacher
def _distillation(eps: float) -> Scenario:
    """A student distilled from a teacher run under ``no_grad`` each step; step 2's batch holds an all-zero row the
    teacher's RMS norm (no eps) divides by 0."""
    torch.manual_seed(0)
    teacher = _net(eps)
    student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    xs, _ = _data(STEPS, {2: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.no_grad():
                target = teacher(xs[step])
            loss = F.mse_loss(student(xs[step]), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((teacher, student, opt), run)


# ---------------------------------------------------------------- an infinite learning rate from a scheduler
def _infinite_lr(eps: float) -> Scenario:
    """``LambdaLR`` whose lambda divides by the distance to a warm-up's end: at step 2 it is 1 / 0, lr inf; the
    optimizer's step writes inf and NaN into the weights, which the next forward meets."""
    model, opt = _setup(1e-6)
    xs, ys = _data(STEPS + 1)
    # numpy's float divides by 0 as a GPU does (inf, a warning), where Python's raises
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: float(1.0 / np.float64(abs(epoch - 2) + eps)))

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS + 1):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: infinite lr step
            schedule.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN in the 50th step
def _fiftieth_step(eps: float) -> Scenario:
    """50 steps; the 50th (step 49) batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(50, {49: 3} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(50):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a GAN's shared update helper, G's Adam at fault
def _gan_shared_update(eps: float) -> Scenario:
    """``update(opt, loss)`` called for D, then for G, each step; G's Adam (``eps`` 0 in the incident) also steps an
    auxiliary head whose loss joins at step 2 with weight 0: its first update is ``0 / sqrt(0)``. Judged deferred at
    step 3's first ``step()``, D's call of the same line."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 4))
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    aux = nn.Linear(4, 1)
    g_side = nn.ModuleDict({"generator": generator, "aux": aux})
    g_opt = torch.optim.Adam(g_side.parameters(), lr=1e-3, eps=eps, foreach=False)
    d_opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    zs, reals = [torch.randn(6, 2) for _ in range(STEPS)], [torch.randn(6, 4) for _ in range(STEPS)]

    def update(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()  # producer: shared update

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            fake = generator(zs[step])
            d_loss = F.softplus(-critic(reals[step])).mean() + F.softplus(critic(fake.detach())).mean()
            update(d_opt, d_loss)
            g_loss = F.softplus(-critic(fake)).mean() + (0.0 * aux(fake).mean() if step == 2 else 0.0)
            update(g_opt, g_loss)
            losses += [d_loss.detach(), g_loss.detach()]
        return losses
    return Scenario((g_side, critic, g_opt, d_opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect | None, healthy: Callable[[], Scenario],
         source: object = None) -> list[Case]:
    return [Case(f"defer_s32_{name}", build, expect, source=source),
            Case(f"defer_s32_{name}_healthy", healthy, None)]


CASES = [
    *_row("nan_while_the_last_steps_loss_is_read_late", lambda: _lagged_logging(0.0), _rms(2),
          lambda: _lagged_logging(1e-6), defer22),
    *_row("bf16_autocast_nan_in_a_float32_cross_entropy", lambda: _autocast_cross_entropy(0.0),
          Expect("forward", None, step=2, op="aten.nll_loss_forward.default", marker="all ignored",
                 cause="empty-reduction"),
          lambda: _autocast_cross_entropy(1e-6)),
    *_row("tuple_output_nan_in_the_second_element", lambda: _tuple_output(0.0),
          Expect("forward", "", "_TwoHeads", step=2, op="aten.div.Tensor", marker="embedding norm",
                 cause="division-by-zero"),
          lambda: _tuple_output(1e-6)),
    *_row("micro_batch_losses_summed_into_a_running_tensor", lambda: _running_loss(0.0), _rms(1),
          lambda: _running_loss(1e-6), defer22),
    *_row("nan_gradient_of_a_branch_weighted_0_in_the_loss", lambda: _zero_weight_branch(0.0),
          Expect("backward", "", "_WithAux", step=2, op="aten.div.Tensor", marker="aux distance",
                 cause="sqrt-domain"),
          lambda: _zero_weight_branch(1e-6)),
    *_row("forward_writes_a_buffer_in_place_that_turns_nan", lambda: _buffer_in_place(1),
          Expect("forward", "0", "_HandNorm", step=2, op="aten.var.correction", marker="batch variance"),
          lambda: _buffer_in_place(0)),
    *_row("eval_under_inference_mode_between_steps", lambda: _inference_eval(0.0), _rms(2),
          lambda: _inference_eval(1e-6), defer22),
    *_row("teacher_under_no_grad_nan_in_the_teacher", lambda: _distillation(0.0), _rms(2),
          lambda: _distillation(1e-6), defer22),
    *_row("infinite_lr_from_a_scheduler_seen_at_the_next_forward", lambda: _infinite_lr(0.0),
          Expect("optimizer", "1", "Linear", step=2, op="aten.add_.Tensor", marker="infinite lr step",
                 cause="nonfinite-number"),
          lambda: _infinite_lr(1e-6)),
    *_row("gan_shared_update_helper_nan_in_gs_adam_step", lambda: _gan_shared_update(0.0),
          Expect("optimizer", "aux", "Linear", step=2, op="aten.addcdiv_.default", marker="shared update",
                 cause="optimizer-eps-underflow"),
          lambda: _gan_shared_update(1e-8)),
    *_row("nan_in_the_50th_step", lambda: _fiftieth_step(0.0), _rms(49), lambda: _fiftieth_step(1e-6), defer22),
]
