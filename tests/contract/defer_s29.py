"""Deferred stress rows: what a GPU training loop does that a CPU loop rarely does (defer-s29).

Each row runs in every mode (the deferred ones, ``defer=True`` and ``ops=True, defer=True``, what a GPU user runs,
must say what the immediate ones say), each incident beside its healthy twin (the same loop with eps): a
double-buffered prefetcher copying the next batch ``non_blocking`` into the other buffer before ``opt.step()``;
a single static batch buffer (a CUDA graph's input) refilled each micro-batch of an 8-way accumulation; static
output and loss buffers written in place each step (a captured graph's outputs); CPU bfloat16 autocast (as
``torch.cuda.amp``); the loss read with ``.item()`` every 3 steps only; loss and accuracy accumulated on device and read
at the end; two optimizers stepping at different cadences (the head every step, the body every 2nd); accumulation
over 8 micro-batches with the NaN in step 1's 5th, in its last, in the last one's loss code and in the last one's
backward; an evaluation loop between steps; ``zero_grad(set_to_none=False)`` with momentum. The NaN is defer22's: the
RMS norm without eps over an all-zero row (``0 / 0``), the loss weights of a batch of ignored samples, the distance's
backward at 0. (``pin_memory()`` needs an accelerator: the prefetcher's buffers are plain; a DataLoader's
``pin_memory=True`` on a CPU only warns.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from contract import Case, Expect, Scenario, defer22
from contract.defer22 import _distance_backward, _loss, _loss_code, _net, _zero_row

STEPS = 4


def _rms(step: int) -> Expect:
    return Expect("forward", "0", "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm")


def _data(count: int, bad: dict[int, int] | None = None, rows: int = 5
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    xs, ys = [torch.randn(rows, 4) for _ in range(count)], [torch.randn(rows, 2) for _ in range(count)]
    for index, row in (bad or {}).items():
        xs[index] = _zero_row(xs[index], row)
    return xs, ys


def _setup(eps: float, momentum: float = 0.0) -> tuple[torch.nn.Sequential, torch.optim.SGD]:
    torch.manual_seed(0)
    model = _net(eps)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)


# ---------------------------------------------------------------- a double-buffered prefetcher, non_blocking copies
def _double_buffered(eps: float) -> Scenario:
    """Two batch buffers: while step k trains on one, the next batch is copied ``non_blocking`` into the other after
    backward, before ``opt.step()`` (a CUDA stream prefetcher's order); step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS + 1, {2: 1} if eps == 0.0 else None)
    buffers = [torch.empty(5, 4), torch.empty(5, 4)]
    buffers[0].copy_(xs[0], non_blocking=True)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            x = buffers[step % 2]
            loss = F.mse_loss(model(x), ys[step])
            opt.zero_grad()
            loss.backward()
            buffers[(step + 1) % 2].copy_(xs[step + 1], non_blocking=True)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- one static buffer, 8 micro-batches
def _static_accumulation(eps: float) -> Scenario:
    """One static input buffer (a CUDA graph's), refilled in place for each of 8 micro-batches a step; step 1's 5th
    micro-batch holds an all-zero row. Its call's argument holds the 8th batch when the deferred check reads it."""
    model, opt = _setup(eps)
    xs, ys = _data(2 * 8, {8 + 4: 2} if eps == 0.0 else None, rows=3)
    static = torch.zeros(3, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            for micro in range(8):
                static.copy_(xs[8 * step + micro], non_blocking=True)
                loss = F.mse_loss(model(static), ys[8 * step + micro]) / 8
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- static output and loss buffers
def _static_outputs(eps: float) -> Scenario:
    """A captured graph's shape: static input, target and loss buffers written in place each step, the loss copied
    into ``static_loss`` and read once at the end (no host sync in the loop)."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 0} if eps == 0.0 else None)
    static_x, static_y, static_loss = torch.zeros(5, 4), torch.zeros(5, 2), torch.zeros(())

    def run() -> list[float]:
        history = []
        for step in range(STEPS):
            static_x.copy_(xs[step], non_blocking=True)
            static_y.copy_(ys[step], non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(static_x), static_y)
            loss.backward()
            opt.step()
            static_loss.copy_(loss.detach())
            history.append(static_loss.clone())
        return [float(value) for value in history]
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- bfloat16 autocast (torch.cuda.amp's shape)
def _bf16_autocast(eps: float) -> Scenario:
    """The forward and loss under ``torch.autocast("cpu", torch.bfloat16)``, backward and step outside it."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 3} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xs[step])
                loss = F.mse_loss(out.float(), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- .item() every 3 steps, metrics on device
def _item_every_3(eps: float) -> Scenario:
    """The loss logged with ``.item()`` at steps 0, 3, ...; the NaN at step 4, read by no host sync of the loop."""
    model, opt = _setup(eps)
    xs, ys = _data(6, {4: 1} if eps == 0.0 else None)

    def run() -> list[float]:
        logged = []
        for step in range(6):
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 3 == 0:
                logged.append(loss.item())
        return logged
    return Scenario((model, opt), run)


def _device_metrics(eps: float) -> Scenario:
    """Loss sum and correct count accumulated in device tensors (``total += loss.detach()``, ``correct +=
    (pred == y).sum()``), read once after the loop; step 2's batch holds an all-zero row."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 4} if eps == 0.0 else None)
    labels = [y.argmax(-1) for y in ys]

    def run() -> tuple[float, int]:
        total, correct = torch.zeros(()), torch.zeros((), dtype=torch.long)
        for step in range(STEPS):
            out = model(xs[step])
            loss = F.cross_entropy(out, labels[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
            correct += (out.detach().argmax(-1) == labels[step]).sum()
        return float(total), int(correct)
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- two optimizers at different cadences
def _two_cadences(eps: float) -> Scenario:
    """The head's optimizer steps every step, the body's (the RMS norm and first layer) every 2nd; the NaN at step 3,
    a step where only the head's steps."""
    torch.manual_seed(0)
    model = _net(eps)
    body = torch.optim.SGD(model[1].parameters(), lr=0.01)
    head = torch.optim.Adam(model[3].parameters(), lr=1e-3)
    xs, ys = _data(6, {3: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(6):
            loss = F.mse_loss(model(xs[step]), ys[step])
            loss.backward()
            head.step()
            head.zero_grad()
            if step % 2 == 1:
                body.step()
                body.zero_grad()
            losses.append(loss.detach())
        return losses
    return Scenario((model, body, head), run)


# ---------------------------------------------------------------- 8 micro-batches: the NaN in the 5th, or the last
def _accumulate_8(eps: float, micro: int, where: str = "model") -> Scenario:
    """Three steps of 8 micro-batches, one ``opt.step()`` after the last; step 1's micro-batch ``micro`` is bad: its
    all-zero row (``where="model"``), its loss weights, or its distance's backward (defer22's ``_loss``)."""
    model, opt = _setup(eps)
    bad = 8 + micro
    xs, ys = _data(3 * 8, {bad: 1} if eps == 0.0 and where == "model" else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for index in range(8 * step, 8 * step + 8):
                loss = _loss(model(xs[index]), ys[index], where, eps == 0.0 and index == bad, eps) / 8
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an evaluation loop, then the NaN in training
def _eval_then_train(eps: float) -> Scenario:
    """After each step the loop evaluates 3 batches (``eval()``, ``no_grad``, device metrics); the NaN is in the
    training batch of step 2, whose step follows an evaluation loop of more top-level calls than its own."""
    model, opt = _setup(eps)
    xs, ys = _data(STEPS, {2: 2} if eps == 0.0 else None)
    vx, vy = _data(3, rows=4)

    def run() -> list[torch.Tensor]:
        seen = []
        for step in range(STEPS):
            model.train()
            loss = F.mse_loss(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            total = torch.zeros(())
            with torch.no_grad():
                for batch in range(3):
                    total += F.mse_loss(model(vx[batch]), vy[batch])
            seen += [loss.detach(), total]
        return seen
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- zero_grad(set_to_none=False), momentum
def _zero_grad_in_place(eps: float) -> Scenario:
    """``opt.zero_grad(set_to_none=False)`` (the gradients kept as zeroed tensors, as CUDA graphs need) with SGD
    momentum; step 2's batch holds an all-zero row."""
    model, opt = _setup(eps, momentum=0.9)
    xs, ys = _data(STEPS, {2: 1} if eps == 0.0 else None)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=False)
            loss = F.mse_loss(model(xs[step]), ys[step])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


def _row(name: str, build: Callable[[], Scenario], expect: Expect, healthy: Callable[[], Scenario],
         gaps: tuple[tuple[str, str], ...] = ()) -> list[Case]:
    return [Case(f"defer_s29_{name}", build, expect, source=defer22, gaps=gaps),
            Case(f"defer_s29_{name}_healthy", healthy, None)]


CASES = [
    *_row("double_buffered_prefetch_non_blocking", lambda: _double_buffered(0.0), _rms(2),
          lambda: _double_buffered(1e-6)),
    *_row("static_buffer_8_micro_batches_nan_in_the_5th", lambda: _static_accumulation(0.0), _rms(1),
          lambda: _static_accumulation(1e-6)),
    *_row("static_output_and_loss_buffers", lambda: _static_outputs(0.0), _rms(2), lambda: _static_outputs(1e-6)),
    *_row("bf16_autocast", lambda: _bf16_autocast(0.0), _rms(2), lambda: _bf16_autocast(1e-6)),
    *_row("loss_item_every_3_steps", lambda: _item_every_3(0.0), _rms(4), lambda: _item_every_3(1e-6)),
    *_row("metrics_accumulated_on_device", lambda: _device_metrics(0.0), _rms(2), lambda: _device_metrics(1e-6)),
    *_row("two_optimizers_at_different_cadences", lambda: _two_cadences(0.0), _rms(3), lambda: _two_cadences(1e-6)),
    *_row("accumulation_8_nan_in_the_5th", lambda: _accumulate_8(0.0, 4), _rms(1), lambda: _accumulate_8(1e-6, 4)),
    *_row("accumulation_8_nan_in_the_last", lambda: _accumulate_8(0.0, 7), _rms(1), lambda: _accumulate_8(1e-6, 7)),
    *_row("accumulation_8_loss_code_nan_in_the_last", lambda: _accumulate_8(0.0, 7, "loss"), _loss_code(1),
          lambda: _accumulate_8(1e-6, 7, "loss")),
    *_row("accumulation_8_backward_nan_in_the_last", lambda: _accumulate_8(0.0, 7, "grad"), _distance_backward(1),
          lambda: _accumulate_8(1e-6, 7, "grad")),
    *_row("eval_loop_then_nan_in_training", lambda: _eval_then_train(0.0), _rms(2), lambda: _eval_then_train(1e-6)),
    *_row("zero_grad_set_to_none_false_momentum", lambda: _zero_grad_in_place(0.0), _rms(2),
          lambda: _zero_grad_in_place(1e-6)),
]
