"""``lr`` and the optimizer's ``eps``: the failing optimizer step redone on copies from the last good state.

An optimizer step that made a parameter non-finite has already written it:
the step is redone from the state the watch kept after the last step that
ended finite (``keep_last_good``), with the same gradients, on copies of the
parameters and of the optimizer state: once as it ran (it must come out
non-finite again, or the trial says it does not reproduce) and once with the
remedy: the learning rate at a tenth (``lr``), or an ``eps`` the parameters'
dtype can hold (``eps``: a float16 Adam's 1e-8 rounds to 0, and a parameter
that got no gradient divides 0 by 0).

This redoes the failing step's update, not the steps before it: a run that
diverged over several steps may need more than its last update lowered.

The gradients are the ones the parameters hold at the event. A watch that
judged the step a step later (the deferred watch, its note ``debug-later-step``)
holds the later step's; where those are non-finite (computed from the
non-finite parameters) they cannot stand for the failing step's, which were
finite: a redo with them said "still non-finite" for an eps that, by hand,
trains on. The trial is then not run, and says why.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from nan_magic.fixes.scale_check import OFF_SCALE
from nan_magic.fixes.stepping import step_alone
from nan_magic.records import Note, Report
from nan_magic.scene.last_good import LastGood

__all__ = ["FIRST_STEP", "NO_LAST_GOOD", "redo_step"]

#: (A notebook's user runs the magics, a script's the API: every way to keep it is said; a user of ``%nanwatch on``
#: was told only of %%nantrace's option.)
NO_LAST_GOOD = Note("no-last-good-state")
#: At the first step that advice is a dead end: a last good state is kept from the first step that ends finite.
FIRST_STEP = Note("first-optimizer-step")


def redo_step(optimizer: torch.optim.Optimizer, roots: Iterable[nn.Module], last_good: LastGood,
              remedy: str, report: Report) -> tuple[Note | None, bool | None, dict[str, Any], float]:
    """``(why not tried, finite, facts, seconds)`` of ``report``'s failing step redone with ``remedy`` (``"lr"`` or
    ``"eps"``)."""
    start = time.perf_counter()
    first = report.step == 0
    if last_good.where is None:  # (the settings still say what the trial would change)
        return FIRST_STEP if first else NO_LAST_GOOD, None, _settings(optimizer, remedy), 0.0
    kept_optimizer = last_good.state_of(optimizer)
    later = next((note for note in report.note_facts if note.kind == "debug-later-step"), None)
    if later is not None and not _finite_gradients(optimizer):
        return (Note.of("gradients-overwritten", step=later.fact("step"), judged=later.fact("judged")),
                None, _settings(optimizer, remedy), 0.0)
    names = {id(parameter): (root, name) for root in roots for name, parameter in root.named_parameters()}
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    kept = {}
    for parameter in parameters:
        root, name = names.get(id(parameter), (None, None))
        state = last_good.state_of(root) if root is not None else None
        if state is None or name not in state:
            kept_optimizer = None
            break
        kept[id(parameter)] = state[name]
    if last_good.step is None or kept_optimizer is None:
        return FIRST_STEP if first else Note("no-finite-step-before"), None, _settings(optimizer, remedy), 0.0
    as_ran, _sizes = _redo(optimizer, parameters, kept, kept_optimizer, None)
    if as_ran:
        return Note("redo-not-reproduced"), None, {}, time.perf_counter() - start
    finite, (update, size) = _redo(optimizer, parameters, kept, kept_optimizer, remedy)
    facts = {"from_step": last_good.step, **_settings(optimizer, remedy)}
    if finite and update > OFF_SCALE * max(size, 1.0):
        # Finite is not fixed: a tenth of lr = 3e38 moves the weights by 1e37 (fixes/scale_check.py's rule).
        facts["off_scale"] = (("update", update, size),)
    return None, finite, facts, time.perf_counter() - start


def _finite_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer's parameters hold is finite (an optimizer event's own were)."""
    return all(bool(torch.isfinite(parameter.grad).all()) for group in optimizer.param_groups
               for parameter in group["params"] if parameter.grad is not None)


def _settings(optimizer: torch.optim.Optimizer, remedy: str) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    if remedy == "lr":
        return {"lr": group.get("lr"), "new_lr": _number(group.get("lr")) / 10}
    # An eps a group holds apart from the one the optimizer was built with (set in a param group, or given to
    # add_param_group): the edit goes where that group's is set, not into the optimizer's constructor.
    apart = any(other.get("eps") != optimizer.defaults.get("eps") for other in optimizer.param_groups)
    return {"eps": group.get("eps"), "new_eps": _eps_for(optimizer), **({"group_eps": True} if apart else {})}


def _number(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _eps_for(optimizer: torch.optim.Optimizer) -> float:
    """An eps every parameter's dtype holds: its machine epsilon (9.8e-4 in float16), at least the one set."""
    dtypes = {parameter.dtype for group in optimizer.param_groups for parameter in group["params"]}
    return max([torch.finfo(dtype).eps for dtype in dtypes if dtype.is_floating_point] + [
        _number(group.get("eps", 0.0)) for group in optimizer.param_groups])


def _redo(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor], kept: dict[int, torch.Tensor],
          kept_state: dict[str, Any], remedy: str | None) -> tuple[bool, tuple[float, float]]:
    """Whether the step, redone on copies from the kept state (with ``remedy``), leaves everything finite; and the
    largest finite change it made to a parameter, and the largest parameter value before it."""
    copies = {id(parameter): kept[id(parameter)].detach().to(parameter.device, parameter.dtype, copy=True)
              .requires_grad_(parameter.requires_grad) for parameter in parameters}
    groups = [{**group, "params": [copies[id(parameter)] for parameter in group["params"]]}
              for group in optimizer.param_groups]
    redone = type(optimizer)(groups)  # type: ignore[call-arg]  # its defaults are in the groups
    # The kept state with the groups as the failing step ran them: load_state_dict would otherwise put back the
    # last good step's settings (an eps the loop set to 0 since, at step 3, redone with the old one: "does not
    # reproduce") and refuse a group added since (add_param_group), whose parameters start with no state.
    loaded = copy.deepcopy(kept_state)
    loaded["param_groups"] = optimizer.state_dict()["param_groups"]
    redone.load_state_dict(loaded)
    if remedy == "eps":
        eps = _eps_for(optimizer)
    for group in redone.param_groups:
        if remedy == "lr":
            group["lr"] = _number(group["lr"]) / 10
        elif remedy == "eps" and "eps" in group:
            group["eps"] = eps
    for parameter in parameters:
        copies[id(parameter)].grad = None if parameter.grad is None else parameter.grad.detach().clone()
    step_alone(redone)
    state = [value for entry in redone.state.values() for value in entry.values()
             if isinstance(value, torch.Tensor) and value.is_floating_point()]
    finite = all(bool(torch.isfinite(tensor).all()) for tensor in [*copies.values(), *state])
    with torch.no_grad():
        changes = [float((copies[id(p)].double() - kept[id(p)].to(copies[id(p)].device).double()).abs().nan_to_num(
            0.0, 0.0, 0.0).max()) for p in parameters if copies[id(p)].numel()]
        sizes = [float(kept[id(p)].double().abs().nan_to_num(0.0, 0.0, 0.0).max()) for p in parameters
                 if kept[id(p)].numel()]
    return finite, (max(changes, default=0.0), max(sizes, default=0.0))
