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
from nan_magic.records import FixTrial, Note, Report
from nan_magic.scene.last_good import LastGood
from nan_magic.step_records import StepSummary

__all__ = ["DIVERGED", "LINEAR", "diverged_before", "diverged_loss", "lowered_update", "lr_trial"]

#: A loss this many times the run's scale (its first losses' magnitude) over the lowest before it: the run had
#: diverged (a lowered update from there, or to there, is no fix).
DIVERGED = 1e3

#: Optimizers whose whole update is the learning rate times a step that does not depend on it.
LINEAR = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta"})


def lowered_update(step: FailingStep, failing: int, roots: Iterable[nn.Module], last_good: LastGood
                   ) -> tuple[FailingStep | None, Note | None, dict[str, object]]:
    """``(step from the lowered update, why not, facts)``: ``step`` (step ``failing``) from ``p0 + (p1 - p0) / 10``.

    ``p1`` is what the failing step read (the parameters now); ``p0`` the state kept after step
    ``failing - 2``, before the previous update: the last capture in the deferred mode (it captures a
    step at the next one's check, and this one's check found the event), the one before it otherwise.
    """
    if last_good.where is None:
        return None, NO_LAST_GOOD, {}
    stepping = [opt for opt in step.optimizers if _steps(opt, step.target)]
    if not stepping:
        return None, Note("no-optimizer-stepping"), {}
    other = next((type(opt).__name__ for opt in stepping if not _linear(opt)), None)
    if other is not None:
        return None, Note.of("update-not-linear", optimizer=other), {}
    kept = last_good.state_of if last_good.step == failing - 2 else last_good.before
    if failing - 2 not in (last_good.step, last_good.before_step):
        return None, Note.of("no-state-before-update", step=failing - 2), {}
    owners = {id(parameter): (root, name) for root in roots for name, parameter in root.named_parameters()}
    parameters: dict[str, torch.Tensor] = {}
    for name, parameter in step.target.named_parameters():
        root, root_name = owners.get(id(parameter), (None, None))
        before = kept(root) if root is not None else None
        if before is None or root_name not in before:
            return None, Note.of("kept-state-lacks", step=failing - 2, parameter=name), {}
        with torch.no_grad():
            p0, p1 = before[root_name].to(parameter.device, parameter.dtype), parameter.detach()
            parameters[name] = p0 + (p1 - p0) / 10
    lr = _number(stepping[0].param_groups[0]["lr"])
    decay = max((_number(group["lr"]) * float(group.get("weight_decay") or 0.0) for opt in stepping
                 if type(opt).__name__ in _DECAY_SCALES for group in opt.param_groups), default=0.0)
    if decay / 10 > 2:
        # The step after this one diverges again (by hand, at a tenth, weight_decay=5e4 overflowed two steps later):
        # the lowered update is no fix, however finite this step comes out.
        return None, Note.of("weight-decay-too-high", decay=decay / 10), {}
    facts = {"optimizer": type(stepping[0]).__name__, "from_step": failing - 2, "lr": lr, "new_lr": lr / 10}
    return dataclasses.replace(step, parameters=parameters), None, facts


#: Optimizers whose weight decay multiplies each parameter by ``1 - lr * weight_decay`` a step (SGD's, added to the
#: gradient; AdamW's, decoupled): past 2 the decay alone makes it grow, whatever the gradient.
_DECAY_SCALES = frozenset({"SGD", "AdamW"})


def _lowest(history: Iterable[StepSummary], upto: int) -> tuple[int, float, float] | None:
    """``(step, loss, scale)``: the lowest signed loss of the steps up to ``upto``, and the magnitude of the losses
    up to it and of the first five (the run's own scale: a loss crossing 0, negative, or 0 at a warmup's first step is
    measured against it, never against the lowest's own size); None where that scale is 0 or nothing is known."""
    earlier = [(entry.step, float(entry.loss)) for entry in history if entry.loss is not None and
               math.isfinite(entry.loss) and entry.step <= upto]
    if not earlier:
        return None
    at = min(range(len(earlier)), key=lambda index: earlier[index][1])
    scale = max(abs(loss) for _step, loss in earlier[:max(at + 1, 5)])
    return (earlier[at][0], earlier[at][1], scale) if scale > 0 else None


def diverged_loss(history: Iterable[StepSummary], upto: int, loss: float | None) -> tuple[int, float] | None:
    """``(the step of the lowest loss up to step upto, that loss)`` where ``loss`` rose above it by more than
    :data:`DIVERGED` times the run's scale (:func:`_lowest`): a run diverged, not one that crossed 0 or improved."""
    lowest = _lowest(history, upto)
    if lowest is None or loss is None or not math.isfinite(loss):
        return None
    step, low, scale = lowest
    return (step, low) if loss - low > DIVERGED * scale else None


def diverged_before(history: Iterable[StepSummary], from_step: int) -> tuple[int, float, int, float] | None:
    """``(step, its loss, the step of the lowest loss before it, that loss)`` where the state a lowered update is
    redone from (the one kept after ``from_step``, whose loss step ``from_step + 1`` computed) had already diverged
    (:func:`diverged_loss`). Lowering the one update after it makes the failing step finite at best, from parameters
    that no longer train (by hand, a loss of 7e35 where the run began at 3): the learning rate was too high long
    before."""
    history = list(history)
    at = next((entry.loss for entry in history if entry.step == from_step + 1), None)
    gone = diverged_loss(history, from_step, at)
    return None if gone is None or at is None else (from_step + 1, float(at), *gone)


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
    lowered, reason, facts = lowered_update(step, report.step, roots, last_good)
    if lowered is None:
        return at_producer("lr", report, facts=(("redone", "previous"),), reason=reason)
    outcome = replay_step(lowered, None, None)
    # (from a state that had already diverged, or to a loss the run's scale over its lowest, a finite step is no fix:
    # not counted as one, and said why)
    gone = diverged_before(report.history, report.step - 2) if outcome.failed is None else None
    still = diverged_loss(report.history, report.step - 1, outcome.loss) if outcome.failed is None else None
    facts |= {"diverged_before": gone} if gone else {"still_diverged": still} if still else {}
    return at_producer("lr", report, facts=(*step_facts(lowered, outcome, report), ("redone", "previous"),
                                            *facts.items()),
                       finite=None if gone or still else outcome.failed is None, loss=outcome.loss,
                       output_change=output_change(base, outcome),
                       seconds=outcome.seconds, failed=outcome.failed, error=outcome.error)
