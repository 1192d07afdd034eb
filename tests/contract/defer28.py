"""Deferred-only stress rows: what a GPU user's loop does that a CPU test does not think of (defer-s28).

Each row is a loop shape that only matters where a step's values are read late (``defer=True``, CUDA's default),
run in every mode and held to one answer: the batch copied in with ``non_blocking=True`` into a fresh buffer; a loop
that reads the loss with ``.item()`` only every 100 steps (its one host sync, never at the NaN's step); the next
batch prefetched into the same buffer before ``opt.step()`` (the check reads a buffer that holds the next batch);
gradient accumulation whose NaN lands in the first of 4 micro-batches, read only after the last; an evaluation
under ``no_grad`` between two training steps that makes the NaN. The NaN is one op: the RMS norm without eps over an
all-zero row (defer22's). (A watch entered again each epoch: tests/test_defer_s28.py.)
"""

from __future__ import annotations

import torch

from contract import Case, Expect, Scenario, defer22
from contract.defer22 import _net, _zero_row

STEPS = 4


def _batches(bad: dict[int, int] | None = None, count: int = STEPS, rows: int = 5
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    xs, ys = [torch.randn(rows, 4) for _ in range(count)], [torch.randn(rows, 2) for _ in range(count)]
    for step, row in (bad or {}).items():
        xs[step] = _zero_row(xs[step], row)
    return xs, ys


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# ---------------------------------------------------------------- the batch copied in non_blocking
def _non_blocking(healthy: bool) -> Scenario:
    """``x = torch.empty_like(batch).copy_(batch, non_blocking=True)`` each step, as a pinned host batch goes to the
    GPU; step 2's holds an all-zero row."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches({2: 1})

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            x = torch.empty_like(xs[step]).copy_(xs[step], non_blocking=True)
            y = ys[step].to(torch.float32, non_blocking=True, copy=True)
            loss = _mse(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- .item() only every 100 steps
def _item_every_100(healthy: bool) -> Scenario:
    """The loop logs ``loss.item()`` at steps 0, 100, ...: its only host read, at step 0; the NaN is at step 3."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches({3: 2}, count=6)

    def run() -> list[float]:
        logged = []
        for step in range(6):
            loss = _mse(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 100 == 0:
                logged.append(loss.item())
        return logged
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the next batch prefetched into the same buffer
def _prefetch_same_buffer(healthy: bool) -> Scenario:
    """One input buffer (a CUDA graph's static input); after backward the loop copies the next batch into it
    (prefetch without a second stream) before ``opt.step()``: the deferred check runs when the buffer holds the next
    batch, not the one step 2's forward read."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches({2: 1}, count=STEPS + 1)
    static = xs[0].clone()

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = _mse(model(static), ys[step])
            opt.zero_grad()
            loss.backward()
            static.copy_(xs[step + 1], non_blocking=True)  # the next batch, before this step's update
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- accumulation, the NaN in the first micro-batch
def _accumulation_first(healthy: bool) -> Scenario:
    """4 micro-batches a step, one ``opt.step()`` after the last; step 1's first micro-batch holds an all-zero row:
    its NaN is read only after 3 more forwards and backwards."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches({4: 1}, count=3 * 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                loss = _mse(model(xs[4 * step + micro]), ys[4 * step + micro]) / 4
                loss.backward()
                losses.append(loss.detach())
            opt.step()
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a NaN in an eval loop between two training steps
def _eval_between(healthy: bool) -> Scenario:
    """After each training step the loop evaluates 2 batches under ``eval()`` and ``no_grad``; after step 1 the
    second evaluation batch holds an all-zero row. The next training step's check comes after it."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(count=STEPS)
    vx, vy = _batches({3: 1}, count=2 * STEPS, rows=3)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            model.train()
            loss = _mse(model(xs[step]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                for batch in range(2):
                    losses.append(_mse(model(vx[2 * step + batch]), vy[2 * step + batch]))
        return losses
    return Scenario((model, opt), run)


def _rms(step: int) -> Expect:
    return Expect("forward", "0", "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm")


CASES = [
    Case("defer28_batch_copied_non_blocking", lambda: _non_blocking(False), _rms(2), source=defer22),
    Case("defer28_batch_copied_non_blocking_healthy", lambda: _non_blocking(True), None),
    Case("defer28_loss_read_every_100_steps", lambda: _item_every_100(False), _rms(3), source=defer22),
    Case("defer28_loss_read_every_100_steps_healthy", lambda: _item_every_100(True), None),
    # (Deferred, the step replay starts the model call from the copy of the buffer the update region took before the
    # loop's copy_ wrote the next batch into it: defer-s29; it named the model's output, unreproduced, before.)
    Case("defer28_next_batch_prefetched_into_the_same_buffer", lambda: _prefetch_same_buffer(False), _rms(2),
         source=defer22),
    Case("defer28_next_batch_prefetched_healthy", lambda: _prefetch_same_buffer(True), None),
    Case("defer28_accumulation_nan_in_the_first_micro_batch", lambda: _accumulation_first(False), _rms(1),
         source=defer22),
    Case("defer28_accumulation_first_micro_batch_healthy", lambda: _accumulation_first(True), None),
    Case("defer28_eval_between_training_steps", lambda: _eval_between(False), _rms(2), source=defer22),
    Case("defer28_eval_between_training_steps_healthy", lambda: _eval_between(True), None),
]
