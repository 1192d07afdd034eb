"""hunt_s43_defer (2 of 2), an optimizer's step hooks, and a module that writes its own weight in forward.

The user's code inside ``opt.step()``: a post-hook's max-norm projection of an embedding (``0 / 0`` on its zero padding
row, at the first step, and on a row the loop resets at step 3, a step the bounded-step argument skips the parameter
check of), the same projection as a *global* post-hook (a library's), and a pre-hook that normalises an auxiliary
head's gradients (``0 / 0`` where the head's loss weight is 0). Every mode said the projection's step 0 was phase
``data`` ("written outside the optimizer") with no op in the tiered and per-module modes, and the pre-hook's NaN
surfaced a step late in the next forward as a parameter already non-finite: a bounded step's argument covers the
optimizer's update, not hooks that run inside it. Now the hooks are loop code around the step (patches/step_hooks.py):
the projection is phase ``optimizer`` at the step that ran it, named by its op and line; the pre-hook's gradient is
named as the same code written before ``opt.step()`` is (hunt_s42b's loop normalisation).
Further: weight standardisation written in place in a module's forward (``w.div_(w.std())`` under ``no_grad``) on a
row of equal weights: only ``ops=True`` names the op; the replays meet the parameter already non-finite.
Each with a healthy twin: the norm floored, the std given an eps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import optimizer as optimizers

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from contract.loops import sgd_loop
from nan_magic.records import TensorRef


# ---------------------------------------------------------------- a post-hook's max-norm projection
def _projected(floor: float, reset_at: int | None = None, global_hook: bool = False) -> Scenario:
    """An embedding with ``padding_idx=0`` (its row 0 starts at 0 and its gradient is always 0) whose rows an
    optimizer post-hook projects to unit norm after every step; at ``reset_at`` the loop resets row 5 to 0 (a
    dead-token reset, never looked up again). ``reset_at`` None: the padding row is projected (``0 / 0``) from step 0.
    ``global_hook``: the hook registered with ``register_optimizer_step_post_hook`` before the watch. Twin: the norm
    floored."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4, padding_idx=None if reset_at is not None else 0), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def project(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            table = model[0].weight
            table /= table.norm(dim=1, keepdim=True).clamp_min(floor)  # producer: max-norm projection

    # (A global one registered as a library does, before the watch; removed as the run ends.)
    handle = (optimizers.register_optimizer_step_post_hook if global_hook else opt.register_step_post_hook)(project)
    with torch.no_grad():  # (unit rows from the start: the projection's own first step is a no-op on them)
        model[0].weight /= model[0].weight.norm(dim=1, keepdim=True).clamp_min(1e-12)
    ids = [torch.randint(1, 5, (5,)) for _ in range(6)]
    ys = _batches(5, 1, steps=6)

    def run() -> list[torch.Tensor]:
        losses = []
        try:
            for step in range(6):
                if step == reset_at:
                    with torch.no_grad():
                        model[0].weight[5] = 0.0
                loss = F.mse_loss(model(ids[step]), ys[step])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        finally:
            if global_hook:
                handle.remove()
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- a pre-hook normalising gradients
def _pre_normalised(eps: float) -> Scenario:
    """A body, a head and an auxiliary head, one SGD; a step pre-hook normalises the auxiliary head's gradients
    (``g / ||g||``); at step 1 the auxiliary loss is weighted 0 (a schedule), its gradients are exactly 0: ``0 / 0``.
    Twin: an eps."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "aux": nn.Linear(4, 1), "head": nn.Linear(4, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def normalise(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p in model["aux"].parameters():
            assert p.grad is not None
            p.grad /= p.grad.norm() + eps  # producer: pre-hook normalise

    opt.register_step_pre_hook(normalise)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            h = model["body"](xs[step]).tanh()
            weight = 0.0 if step == 1 else 0.1
            loss = F.mse_loss(model["head"](h), ys[step]) + weight * model["aux"](h).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


# ---------------------------------------------------------------- an EMA teacher updated by a post-hook
def _ema_hook(first: int) -> Scenario:
    """An EMA teacher (a watched copy) updated by an optimizer post-hook, ``ema.lerp_(p, w)`` with the bias-corrected
    weight ``w = (1 - d) / (1 - d ** n)``, ``n`` the hook's own count from ``first``: from 0 the weight is
    ``x / 0`` = inf (a numpy float) at the first step, and the teacher's weights inf/NaN. Twin: counted from 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    decay, count = np.float64(0.99), [first]

    def update(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with np.errstate(invalid="ignore", divide="ignore"):
            weight = float((1 - decay) / (1 - decay ** count[0]))
        count[0] += 1
        with torch.no_grad():
            for average, parameter in zip(ema.parameters(), model.parameters()):
                average.lerp_(parameter, weight)  # producer: ema hook

    opt.register_step_post_hook(update)
    xs, ys = _batches(5, 4), _batches(5, 1)

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(3):
            loss = F.mse_loss(model(xs[step]), ys[step]) + 0.1 * F.mse_loss(model(xs[step]), ema(xs[step]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, ema), run)


# ---------------------------------------------------------------- weight standardisation in place, in forward
class StandardisedLinear(nn.Linear):
    """Weight standardisation (each output row to mean 0, std 1), written in place on the weight itself."""

    eps = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w = self.weight
            w.sub_(w.mean(1, keepdim=True))
            w.div_(w.std(1, keepdim=True) + self.eps)  # producer: in-place standardise
        return super().forward(x)


def _standardised(eps: float) -> Scenario:
    """Row 2 of the weight starts with equal entries (a constant init): its std is 0, ``0 / 0``. Twin: an eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), StandardisedLinear(4, 4), nn.Linear(4, 1))
    model[1].eps = eps
    with torch.no_grad():
        model[1].weight[2] = 0.5
    xs, ys = _batches(6, 4), _batches(6, 1)
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: F.mse_loss(out, ys[step]), lr=1e-3)


_PROJECTION = TensorRef.parameter("0.weight")

_WRITTEN_IN_FORWARD = (
    "names the module, phase and step, but no op, and calls the parameter already non-finite: the replay of the "
    "failing call (and the per-module watch's) starts from the parameter as the forward left it, its in-place write "
    "already done; only ops=True saw the div_ run on finite values. A replay from stand-ins (the values the write "
    "left, non-finite ones as 0) was tried and taken back: it guessed the values before the call, and where zeros "
    "were not the cause it named a wrong op with false cause words (a mul_ overflow then a div_ by the norm named "
    "as div_ division-by-zero, 'reproduced') and lost the module where it did not reproduce.")


def _gaps(why: str, *modes: str) -> tuple[tuple[str, str], ...]:
    return tuple((mode, why) for mode in modes)


def _expect_projection(step: int) -> Callable[[], Expect]:
    return lambda: Expect("optimizer", "0", "Embedding", step=step, op="aten.div_.Tensor", marker="max-norm projection",
                          tensor=_PROJECTION, cause="division-by-zero")


CASES = [
    Case("hunt_s43_step_post_hook_projection_of_a_zero_padding_row", lambda: _projected(0.0),
         _expect_projection(0)()),
    Case("hunt_s43_step_post_hook_projection_healthy", lambda: _projected(1e-12), None),
    Case("hunt_s43_step_post_hook_projection_of_a_row_reset_at_step_3", lambda: _projected(0.0, reset_at=3),
         _expect_projection(3)()),
    Case("hunt_s43_step_post_hook_projection_of_a_row_reset_healthy", lambda: _projected(1e-12, reset_at=3), None),
    Case("hunt_s43_global_step_post_hook_projection", lambda: _projected(0.0, reset_at=3, global_hook=True),
         _expect_projection(3)()),
    Case("hunt_s43_global_step_post_hook_projection_healthy",
         lambda: _projected(1e-12, reset_at=3, global_hook=True), None),
    Case("hunt_s43_step_pre_hook_normalises_a_zero_gradient", lambda: _pre_normalised(0.0),
         Expect("backward", None, step=1, op="aten.div_.Tensor", marker="pre-hook normalise",
                tensor=TensorRef.gradient("aux.weight"), cause="division-by-zero")),
    Case("hunt_s43_step_pre_hook_normalises_healthy", lambda: _pre_normalised(1e-12), None),
    Case("hunt_s43_step_post_hook_ema_teacher_inf_weight", lambda: _ema_hook(0),
         Expect("optimizer", "0", "Linear", step=0, op="aten.lerp_.Scalar", marker="ema hook",
                tensor=TensorRef.parameter("0.weight"), model="Sequential#2")),
    Case("hunt_s43_step_post_hook_ema_teacher_healthy", lambda: _ema_hook(1), None),
    Case("hunt_s43_weight_standardised_in_place_in_forward", lambda: _standardised(0.0),
         Expect("forward", "1", "StandardisedLinear", step=0, op="aten.div_.Tensor", marker="in-place standardise"),
         gaps=_gaps(f"op, line and cause: {_WRITTEN_IN_FORWARD}", "default", "defer", "full")),
    Case("hunt_s43_weight_standardised_in_place_healthy", lambda: _standardised(1e-5), None),
]
