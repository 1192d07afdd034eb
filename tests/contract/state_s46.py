"""state_s46: a non-finite value the loop puts into a gradient or an optimizer's state, each with its healthy twin.

- A number written into a gradient by indexing between ``backward()`` and the step (``p.grad[0, 0] = inf``, a
  "poison one entry" debugging idiom, a hand-rolled sentinel): Python lifts it (``aten.lift_fresh``) and copies it
  into a view of the gradient. Before session 46 no mode named an op ("unclassified", the backward's story of
  infinite derivatives); now every mode names the lift at its line, cause ``nonfinite-number``, phase backward as
  for any loop write into a gradient.
- A non-finite value in an Adam or SGD state tensor (written by the loop, or loaded with a checkpoint's state):
  the next step is a bounded one (step_layout.py), whose parameter check is skipped, so the parameter it made
  non-finite was met by the forward of the step after, "parameter-already-nonfinite" in phase forward, a step
  late, in every mode but with ``keep_last_good``. Now the forward that meets it runs the skipped check of that
  step, which names the state tensor, at the step that carried it (phase data: no watched code made it).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from contract import Case, Expect, Scenario
from contract.loops import batches as _batches
from nan_magic.records import TensorRef, TensorRole

STEPS = 6
AT = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _gradient_written(value: float, row: bool) -> Scenario:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.cross_entropy(model(xs[step % len(xs)]), ys[step])
            opt.zero_grad()
            loss.backward()
            if step == AT and row:
                model[2].weight.grad[1] = value  # producer: gradient row
            elif step == AT:
                model[0].weight.grad[0, 0] = value  # producer: gradient element
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _state_written(kind: str, value: float) -> Scenario:
    """``kind``: ``"adam"`` (exp_avg_sq written by indexing after step 2), ``"loaded"`` (Adam's state_dict saved
    at step 1, its exp_avg poisoned, loaded after step 2), ``"momentum"`` (SGD's momentum buffer scaled in place)."""
    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if kind == "momentum"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(STEPS)]
    saved: dict[str, object] = {}

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            loss = F.cross_entropy(model(xs[step % len(xs)]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if kind == "loaded" and step == 1:
                saved.update(copy.deepcopy(opt.state_dict()))  # (a state_dict holds the live tensors)
                saved["state"][0]["exp_avg"][0, 0] = value  # a checkpoint whose state went bad
            if step == AT:
                state = opt.state[model[0].weight]
                if kind == "adam":
                    state["exp_avg_sq"][0, 0] = value
                elif kind == "loaded":
                    opt.load_state_dict(saved)  # producer: checkpoint loaded
                else:
                    state["momentum_buffer"].mul_(value)
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


class _Grown(nn.Module):
    """A model that gains a parameter mid-run (``self.extra``, added to the optimizer by ``add_param_group``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(5, 8), nn.Linear(8, 3)
        self.extra: nn.Parameter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h) if self.extra is None else self.head(h) + h @ self.extra


def _filled(value: float, how: str) -> Scenario:
    """A parameter the loop fills before assigning it (``torch.empty(...).fill_(v)``): ``"grown"`` adds one to the
    model and the optimizer at step 2, ``"reassigned"`` gives ``head.weight`` new memory (``w.data = ...``)."""
    torch.manual_seed(0)
    model = _Grown()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    xs, ys = _batches(6, 5), [torch.randint(0, 3, (6,)) for _ in range(STEPS)]

    def run() -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            if step == AT and how == "grown":
                model.extra = nn.Parameter(torch.empty(8, 3).fill_(value))  # producer: grown filled
                opt.add_param_group({"params": [model.extra], "lr": 0.001})
            elif step == AT:
                model.head.weight.data = torch.empty_like(model.head.weight).fill_(value)  # producer: data filled
            loss = F.cross_entropy(model(xs[step % len(xs)]), ys[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return Scenario((model, opt), run)


def _state(key: str, marker: str | None = None) -> Expect:
    """``marker``: the line the report names (session 47: a state loaded non-finite, at its load_state_dict)."""
    return Expect("data", "0", "Linear", step=AT + 1, tensor=TensorRef(TensorRole.OPTIMIZER_STATE, "0.weight", key),
                  cause="parameter-already-nonfinite", marker=marker)


#: ops=True: the tracer follows the loop's ``mul_`` into the parameter and names that op and line, but at the next
#: forward, as the parameter (optimizer, step 4), not the state tensor at the step that carried it (data, step 3).
_OPS_LATE = ("ops=True names the loop's mul_ and its line, but as parameter 0.weight in optimizer step 4 (the forward "
             "that read it), where the other modes name state momentum_buffer in data step 3 (the step that carried "
             "it into the parameter), without the op")

CASES = [
    Case("state_s46_inf_written_into_a_gradient_element", lambda: _gradient_written(math.inf, False),
         Expect("backward", None, step=AT, op="aten.lift_fresh.default", marker="gradient element",
                cause="nonfinite-number")),
    Case("state_s46_nan_written_into_a_gradient_row", lambda: _gradient_written(math.nan, True),
         Expect("backward", None, step=AT, op="aten.lift_fresh.default", marker="gradient row",
                cause="nonfinite-number")),
    Case("state_s46_finite_number_written_into_a_gradient_healthy", lambda: _gradient_written(0.0, False), None),
    Case("state_s46_nan_written_into_adams_second_moment", lambda: _state_written("adam", math.nan),
         _state("exp_avg_sq")),
    Case("state_s46_adam_state_loaded_from_a_checkpoint_with_a_nan", lambda: _state_written("loaded", math.nan),
         _state("exp_avg", "checkpoint loaded")),
    Case("state_s46_sgd_momentum_buffer_scaled_by_inf", lambda: _state_written("momentum", math.inf),
         _state("momentum_buffer"), modes=("default", "defer", "full")),
    Case("state_s46_sgd_momentum_buffer_scaled_by_inf_ops", lambda: _state_written("momentum", math.inf),
         _state("momentum_buffer"), modes=("ops",), marks=(pytest.mark.xfail(strict=True, reason=_OPS_LATE),)),
    # (a filled parameter assigned, which no in-place write shows: the fill's replay, from a stand-in for the memory
    # it overwrote; before session 46 the recorded modes replayed it on its own NaN: forward, already-bad, no op)
    Case("state_s46_parameter_added_mid_run_filled_with_nan", lambda: _filled(math.nan, "grown"),
         Expect("optimizer", "", "_Grown", step=AT, op="aten.fill_.Scalar", marker="grown filled",
                cause="nonfinite-number")),
    # (A fill of an infinity reads as a deliberate one, a mask's: no op made it; only a NaN fill is named.)
    Case("state_s46_parameter_reassigned_memory_filled_with_nan", lambda: _filled(math.nan, "reassigned"),
         Expect("optimizer", "head", "Linear", step=AT, op="aten.fill_.Scalar", marker="data filled",
                cause="nonfinite-number")),
    Case("state_s46_parameter_added_mid_run_filled_finite_healthy", lambda: _filled(0.0, "grown"), None),
    Case("state_s46_parameter_reassigned_memory_filled_finite_healthy", lambda: _filled(0.01, "reassigned"), None),
    Case("state_s46_adam_state_written_finite_healthy", lambda: _state_written("adam", 0.5), None),
    Case("state_s46_adam_state_loaded_finite_healthy", lambda: _state_written("loaded", 0.0), None),
    Case("state_s46_sgd_momentum_buffer_scaled_finite_healthy", lambda: _state_written("momentum", 0.5), None),
]
