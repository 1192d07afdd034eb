"""Deferred-only stress rows: where reading a step late could name another value, step or nothing (defer-s27).

The deferred mode (``defer=True``, CUDA's default) judges a step's values at its optimizer step, or as the watch is
left. Each row puts the NaN where that is hard, and holds the deferred answer to the immediate one (every mode runs):
a batch buffer the loop repairs in place before the step ends (the check reads a finite tensor: its probe knew); the
NaN in the loop's last step; a loop that breaks out on a non-finite loss (no optimizer step: the exit judges it); an
exception of the user's own between the NaN and the next step (the check runs as it leaves the watch); and NaNs in
two consecutive steps (the first is named). ``on_detect="warn"``'s events, order and steps: tests/test_defer_s27.py.
"""

from __future__ import annotations

import torch

from contract import Case, Expect, Scenario, defer22
from contract.defer22 import _loss, _net, _zero_row
from nan_magic.records import TensorRef, TensorRole

STEPS = 4


def _batches(bad: dict[int, int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    xs, ys = [torch.randn(5, 4) for _ in range(STEPS)], [torch.randn(5, 2) for _ in range(STEPS)]
    for step, row in (bad or {}).items():
        xs[step] = _zero_row(xs[step], row)
    return xs, ys


# ---------------------------------------------------------------- a batch buffer repaired before the step ends
def _repaired_buffer(healthy: bool) -> Scenario:
    """A static input buffer (as a CUDA graph's) filled in place each step; step 2's batch holds a NaN, which the loop
    replaces with 0 after backward (``nan_to_num_``, a repair after the fact), before ``opt.step()``: the deferred
    check, at that step, reads a finite buffer. Its probe, taken as the model was called, knew."""
    torch.manual_seed(0)
    model = _net(1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches()
    if not healthy:
        xs[2][1, 3] = float("nan")
    static = torch.zeros(5, 4)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            static.copy_(xs[step])
            loss = ((model(static) - ys[step]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            static.nan_to_num_(0.0)
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the NaN in the last step, or in two steps in a row
def _plain(bad: dict[int, int], where: str = "model") -> Scenario:
    """SGD over 4 steps; the steps in ``bad`` have an all-zero row (``where="model"``: the RMS norm's 0 / 0), or
    ``where="both"``: that and, the step after the first, a missing label (the distance's backward, 0 / 0)."""
    torch.manual_seed(0)
    model = _net(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches(bad)
    first = min(bad)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = _loss(model(xs[step]), ys[step], "grad", where == "both" and step == first + 1, 1e-6)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a loop that breaks out on a non-finite loss
def _breaks_out(healthy: bool) -> Scenario:
    """``if not torch.isfinite(loss): break`` (the loop's own guard, a host read): step 2's NaN ends the loop before
    its backward and optimizer step; deferred, nothing judges the step but the watch's exit."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches({2: 1})

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = ((model(xs[step]) - ys[step]) ** 2).mean()
            if not torch.isfinite(loss):
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


# ---------------------------------------------------------------- the user's exception between the NaN and the next
class Diverged(Exception):
    """The loop's own error for a loss it cannot train on."""


def _users_exception(healthy: bool) -> Scenario:
    """The loop raises its own exception on a non-finite loss after ``backward()``, before ``opt.step()``: deferred,
    the watch is left by it with step 2 unjudged; the check runs at the exit and raises the event from it."""
    torch.manual_seed(0)
    model = _net(1e-6 if healthy else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches({2: 1})

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = ((model(xs[step]) - ys[step]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            if loss.item() != loss.item():
                raise Diverged(f"loss is {loss.item()} at step {step}")
            opt.step()
            losses.append(loss.detach())
        return losses
    return Scenario((model, opt), run)


def _rms(step: int) -> Expect:
    return Expect("forward", "0", "RmsNorm", step=step, op="aten.div.Tensor", marker="rms norm")


INPUT = TensorRef(TensorRole.INPUT, None, "input[0]")

CASES = [
    # The batch as the model was called is the producer: its counts are those of the tensor as it was then where the
    # check reads it at once (deferred: a repaired buffer holds none, and the report says its counts are not known).
    Case("defer27_batch_buffer_repaired_before_the_step_ends", lambda: _repaired_buffer(False),
         Expect("data", "", "Sequential", step=2, tensor=INPUT)),
    Case("defer27_batch_buffer_repaired_healthy", lambda: _repaired_buffer(True), None),
    Case("defer27_nan_in_the_last_step", lambda: _plain({STEPS - 1: 1}), _rms(STEPS - 1), source=defer22),
    Case("defer27_loop_breaks_out_on_the_nan", lambda: _breaks_out(False), _rms(2), source=defer22),
    Case("defer27_loop_breaks_out_healthy", lambda: _breaks_out(True), None),
    Case("defer27_users_exception_between_the_nan_and_the_next_step", lambda: _users_exception(False), _rms(2),
         source=defer22),
    Case("defer27_users_exception_healthy", lambda: _users_exception(True), None),
    # Step 1's forward NaN, then step 2's backward NaN (its all-zero row too): step 1's is named.
    Case("defer27_nans_in_two_steps_in_a_row_the_first_named", lambda: _plain({1: 1, 2: 1}, "both"), _rms(1),
         source=defer22),
]


# ---------------------------------------------------------------- the last step's update, no next step to read it
def _last_update_overflows(healthy: bool) -> Scenario:
    """A warm-restart schedule's jump sets the learning rate to 3e38 for the last step (a typo's), whose update
    overflows float32 (``p - lr * g`` past 3.4e38 where ``|g| > 1``): the parameters go infinite at the loop's last
    ``opt.step()``. The deferred mode carries a step's result to the next check: here, the watch's exit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _batches()

    def run() -> list[torch.Tensor]:
        for step in range(STEPS):
            if step == STEPS - 1 and not healthy:
                opt.param_groups[0]["lr"] = 3e38
            loss = ((model(xs[step]) - ys[step]) ** 2).mean() * 100
            opt.zero_grad()
            loss.backward()
            opt.step()  # producer: last update
        return [p.detach().clone() for p in model.parameters()]
    return Scenario((model, opt), run)


CASES += [
    Case("defer27_last_steps_update_overflows_no_next_step", lambda: _last_update_overflows(False),
         Expect("optimizer", "0", "Linear", step=STEPS - 1, op="aten.add_.Tensor", marker="last update",
                tensor=TensorRef(TensorRole.PARAMETER, "0.weight", ""))),
    Case("defer27_last_steps_update_healthy", lambda: _last_update_overflows(True), None),
]
