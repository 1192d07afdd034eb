"""``lr`` for a run that diverged before its event: the previous update redone at a tenth of the learning rate.

The event is in the failing step's forward or backward, so the update that
pushed the parameters too far is the previous step's, already written.
With ``keep_last_good`` the watch keeps the models' state after each of the
last two finite steps (scene/last_good.py): before the previous update
(``p0``) and after it (``p1``, what the failing step read). An optimizer of
:data:`LINEAR` moves a parameter by ``lr * u`` with ``u`` independent of the
learning rate (momentum, moments and weight decay included), so that update
at a tenth is ``p0 + (p1 - p0) / 10``, its state unchanged. The failing step
is then replayed from those parameters (step.py): forward, backward and the
optimizer step, on copies.

This lowers one update, not the ones before it: a run that diverged over
many steps may need more, and the trial then says the step stayed non-finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from nan_magic.fixes.optimizer_step import NO_LAST_GOOD
from nan_magic.fixes.step import FailingStep
from nan_magic.scene.last_good import LastGood

__all__ = ["LINEAR", "lowered_update"]

#: Optimizers whose whole update is the learning rate times a step that does not depend on it.
LINEAR = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta"})


def lowered_update(step: FailingStep, roots: Iterable[nn.Module], last_good: LastGood
                   ) -> tuple[FailingStep | None, str | None, dict[str, object]]:
    """``(step from the lowered update, why not, facts)``: ``step`` starting from ``p0 + (p1 - p0) / 10``."""
    if last_good.where is None:
        return None, NO_LAST_GOOD, {}
    stepping = [opt for opt in step.optimizers if _steps(opt, step.target)]
    if not stepping:
        return None, "no optimizer of the model was seen stepping: there is no update to redo", {}
    other = next((type(opt).__name__ for opt in stepping if not _linear(opt)), None)
    if other is not None:
        return None, f"a {other} update is not its learning rate times a step that does not depend on it", {}
    owners = {id(parameter): (root, name) for root in roots for name, parameter in root.named_parameters()}
    parameters: dict[str, torch.Tensor] = {}
    for name, parameter in step.target.named_parameters():
        root, root_name = owners.get(id(parameter), (None, None))
        after = last_good.state_of(root) if root is not None else None
        before = last_good.before(root) if root is not None else None
        if after is None or before is None or root_name not in after or root_name not in before:
            return None, ("fewer than two optimizer steps ended finite before this one: there is no earlier "
                          "state to redo the last update from"), {}
        p0, p1 = before[root_name], after[root_name]
        if not torch.equal(p1.to(parameter.device), parameter.detach()):
            return None, "the kept state is not what the failing step read (the parameters changed since)", {}
        with torch.no_grad():
            parameters[name] = (p0 + (p1 - p0) / 10).to(parameter.device, parameter.dtype)
    lr = stepping[0].param_groups[0].get("lr")
    lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    facts = {"optimizer": type(stepping[0]).__name__, "from_step": last_good.before_step, "lr": lr,
             "new_lr": lr / 10, "redone": "previous"}
    return dataclasses.replace(step, parameters=parameters), None, facts


def _steps(optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
    mine = {id(parameter) for parameter in module.parameters()}
    return any(id(parameter) in mine for group in optimizer.param_groups for parameter in group["params"])


def _linear(optimizer: torch.optim.Optimizer) -> bool:
    """Whether its update scales with lr: a listed class, without Adagrad's learning-rate decay."""
    return type(optimizer).__name__ in LINEAR and not any(group.get("lr_decay") for group in optimizer.param_groups)
