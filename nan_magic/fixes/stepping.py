"""An optimizer's step run alone, for a trial: without the global step hooks the watch counts steps by."""

from __future__ import annotations

import torch

__all__ = ["step_alone"]


def step_alone(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` of a trial's rebuilt optimizer, without the global step hooks.

    The watch's hook (hot/step_cycle.py) would take the trial's step for the user's: under a process
    group, the step of a trial run from inside the user's optimizer step settled that step's agreement
    collective early, and the ranks fell out of step. ``Optimizer`` wraps each class's ``step`` once
    (``profile_hook_step``); the function it wraps runs the update alone.
    """
    step = type(optimizer).step
    getattr(step, "__wrapped__", step)(optimizer)
