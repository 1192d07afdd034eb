"""``lr`` for a run that diverged before its event: the previous update redone at a tenth of the learning rate.

The event is in the failing step's forward or backward, so the update that
pushed the parameters too far is the previous step's, already written.
With ``keep_last_good`` the watch keeps the models' state after each of the
last two finite steps (scene/last_good.py): before the previous update
(``p0``) and after it (``p1``, what the failing step read: the parameters
now). An optimizer of
:data:`LINEAR` moves a parameter by ``lr * u`` with ``u`` independent of the
learning rate (momentum, moments and weight decay included), so that update
at a tenth is ``p0 + (p1 - p0) / 10``, its state unchanged. The failing step
is then replayed from those parameters (fixes/step.py): forward, backward and the
optimizer step, on copies.

This lowers one update, not the ones before it: a run that diverged over
many steps may need more, and the trial then says the step stayed non-finite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch import nn

from nan_magic.fixes.remedies.optimizer_step import NO_LAST_GOOD
from nan_magic.fixes.step import FailingStep, StepOutcome, replay_step
from nan_magic.fixes.trial_facts import at_producer, output_change, step_facts
from nan_magic.records import FixTrial, Report
from nan_magic.scene.last_good import LastGood
from nan_magic.step_records import StepSummary

__all__ = ["DIVERGED", "LINEAR", "diverged_before", "lowered_update", "lr_trial"]

#: A loss this many times the lowest before it: the run had diverged (a lowered update from there is no fix).
DIVERGED = 1e3

#: Optimizers whose whole update is the learning rate times a step that does not depend on it.
LINEAR = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta"})


def lowered_update(step: FailingStep, failing: int, roots: Iterable[nn.Module], last_good: LastGood
                   ) -> tuple[FailingStep | None, str | None, dict[str, object]]:
    """``(step from the lowered update, why not, facts)``: ``step`` (step ``failing``) from ``p0 + (p1 - p0) / 10``.

    ``p1`` is what the failing step read (the parameters now); ``p0`` the state kept after step
    ``failing - 2``, before the previous update: the last capture in the deferred mode (it captures a
    step at the next one's check, and this one's check found the event), the one before it otherwise.
    """
    if last_good.where is None:
        return None, NO_LAST_GOOD, {}
    stepping = [opt for opt in step.optimizers if _steps(opt, step.target)]
    if not stepping:
        return None, "no optimizer of the model was seen stepping: there is no update to redo", {}
    other = next((type(opt).__name__ for opt in stepping if not _linear(opt)), None)
    if other is not None:
        return None, f"a {other} update is not its learning rate times a step that does not depend on it", {}
    kept = last_good.state_of if last_good.step == failing - 2 else last_good.before
    if failing - 2 not in (last_good.step, last_good.before_step):
        return None, (f"no state was kept after step {failing - 2}, before the previous update (fewer than two "
                      f"optimizer steps ended finite): there is no update to redo"), {}
    owners = {id(parameter): (root, name) for root in roots for name, parameter in root.named_parameters()}
    parameters: dict[str, torch.Tensor] = {}
    for name, parameter in step.target.named_parameters():
        root, root_name = owners.get(id(parameter), (None, None))
        before = kept(root) if root is not None else None
        if before is None or root_name not in before:
            return None, f"the state kept after step {failing - 2} does not hold {name}", {}
        with torch.no_grad():
            p0, p1 = before[root_name].to(parameter.device, parameter.dtype), parameter.detach()
            parameters[name] = p0 + (p1 - p0) / 10
    lr = _number(stepping[0].param_groups[0]["lr"])
    decay = max((_number(group["lr"]) * float(group.get("weight_decay") or 0.0) for opt in stepping
                 if type(opt).__name__ in _DECAY_SCALES for group in opt.param_groups), default=0.0)
    if decay / 10 > 2:
        # The step after this one diverges again (by hand, at a tenth, weight_decay=5e4 overflowed two steps later):
        # the lowered update is no fix, however finite this step comes out.
        return None, (f"at a tenth of the learning rate, lr * weight_decay is still {decay / 10:g}: the decay alone "
                      f"multiplies each parameter by {1 - decay / 10:g} a step, and the run diverges again (the "
                      f"weight decay is the setting to lower)"), {}
    facts = {"optimizer": type(stepping[0]).__name__, "from_step": failing - 2, "lr": lr, "new_lr": lr / 10}
    return dataclasses.replace(step, parameters=parameters), None, facts


#: Optimizers whose weight decay multiplies each parameter by ``1 - lr * weight_decay`` a step (SGD's, added to the
#: gradient; AdamW's, decoupled): past 2 the decay alone makes it grow, whatever the gradient.
_DECAY_SCALES = frozenset({"SGD", "AdamW"})


def diverged_before(history: Iterable[StepSummary], from_step: int) -> tuple[int, float, int, float] | None:
    """``(step, its loss, the step of the lowest loss before it, that loss)`` where the state a lowered update is
    redone from (the one kept after ``from_step``, whose loss step ``from_step + 1`` computed) had already diverged:
    its loss :data:`DIVERGED`-fold over the lowest before it. Lowering the one update after it makes the failing
    step finite at best, from parameters that no longer train (by hand, a loss of 7e35 where the run began at 5):
    the learning rate was too high long before."""
    losses = [(entry.step, abs(entry.loss)) for entry in history
              if entry.loss is not None and math.isfinite(entry.loss)]
    at = next((loss for step, loss in losses if step == from_step + 1), None)
    earlier = [(loss, step) for step, loss in losses if step <= from_step]
    if at is None or not earlier:
        return None
    lowest, lowest_step = min(earlier)
    return (from_step + 1, at, lowest_step, lowest) if at > DIVERGED * max(lowest, 1e-30) else None


def _number(value: float | torch.Tensor) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _steps(optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
    mine = {id(parameter) for parameter in module.parameters()}
    return any(id(parameter) in mine for group in optimizer.param_groups for parameter in group["params"])


def _linear(optimizer: torch.optim.Optimizer) -> bool:
    """Whether its update scales with lr: a listed class, without Adagrad's learning-rate decay."""
    return type(optimizer).__name__ in LINEAR and not any(group.get("lr_decay") for group in optimizer.param_groups)


def lr_trial(report: Report, step: FailingStep, roots: Iterable[nn.Module], last_good: LastGood,
              base: StepOutcome) -> FixTrial:
    """``lr`` after a divergence (remedies/diverged.py): the previous update at a tenth, then the failing step."""
    lowered, untried, facts = lowered_update(step, report.step, roots, last_good)
    if lowered is None:
        return at_producer("lr", report, facts=(("redone", "previous"),), untried=untried)
    outcome = replay_step(lowered, None, None)
    # (from a state that had already diverged, a finite step is no fix: not counted as one, and said why)
    gone = diverged_before(report.history, report.step - 2) if outcome.failed is None else None
    facts |= {"diverged_before": gone} if gone else {}
    return at_producer("lr", report, facts=(*step_facts(lowered, outcome), ("redone", "previous"), *facts.items()),
                       finite=None if gone else outcome.failed is None, loss=outcome.loss,
                       output_change=output_change(base, outcome),
                       seconds=outcome.seconds, failed=outcome.failed, error=outcome.error)
