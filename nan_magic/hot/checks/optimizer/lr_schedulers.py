"""The learning-rate scheduler that set an optimizer's non-finite rate: asked at such an event only.

A scheduler's ``step()`` writes every group's ``lr`` from its own formula (a warm-up over 0 steps, a finder's
growth past the float max); the loop's code names no line for it. torch's schedulers keep the optimizer as their
``optimizer`` attribute and each group's starting rate as ``initial_lr``: the scheduler is found among the
objects that refer to the optimizer (a scan of the referrers: cold, at the event).
"""

from __future__ import annotations

import gc
import math
from typing import Any

import torch

from nan_magic.records import Note

__all__ = ["scheduler_note"]


def scheduler_note(optimizer: torch.optim.Optimizer, lr: float) -> Note | None:
    """``lr-set-by-scheduler`` where a scheduler drives ``optimizer`` and its last rate is the non-finite ``lr`` (or
    a group carries a scheduler's ``initial_lr`` and no scheduler object was found); else None."""
    scheduler = _scheduler_of(optimizer)
    groups = optimizer.param_groups
    initial = next((group["initial_lr"] for group in groups if "initial_lr" in group), None)
    if scheduler is None:
        if initial is None:
            return None
        return Note.of("lr-set-by-scheduler", lr=lr, scheduler=None, last_epoch=None, initial_lr=_number(initial))
    last = getattr(scheduler, "_last_lr", None)
    if isinstance(last, (list, tuple)) and last and not any(_same(value, lr) for value in last):
        return None  # (the loop wrote the rate after the scheduler's step: not the scheduler's)
    if _carried(scheduler):
        return None  # (its formula scales the rate the group held: a NaN written there before its step, passed on)
    epoch = getattr(scheduler, "last_epoch", None)
    return Note.of("lr-set-by-scheduler", lr=lr, scheduler=type(scheduler).__name__,
                   last_epoch=epoch if isinstance(epoch, int) else None, initial_lr=_number(initial))


#: Schedulers with no closed form whose step scales the rate the group holds (``group["lr"] * factor``).
_CHAINED = frozenset({"MultiplicativeLR", "ReduceLROnPlateau", "ChainedScheduler", "SequentialLR"})


def _carried(scheduler: Any) -> bool:
    """Whether ``scheduler``'s last rate may be one it was given, not one its formula made: a chainable scheduler
    (ExponentialLR, StepLR: ``group["lr"] * gamma``) whose closed form, from its finite ``base_lrs``, is finite; or
    one that only scales the rate it holds. A scheduler computed from its base rates (LambdaLR, OneCycleLR) made it."""
    closed = getattr(scheduler, "_get_closed_form_lr", None)
    if closed is None:
        return type(scheduler).__name__ in _CHAINED
    try:
        rates = closed()
    except Exception:
        return True
    numbers = [_number(rate) for rate in rates]
    return all(number is not None and math.isfinite(number) for number in numbers)


def _scheduler_of(optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler whose ``optimizer`` is ``optimizer``: the latest made where several are (a chain's last)."""
    base = torch.optim.lr_scheduler.LRScheduler
    found = []
    for referrer in gc.get_referrers(optimizer):
        # (Python 3.11's managed dicts: the instance refers to it; before, its __dict__ does)
        owners = [referrer] if isinstance(referrer, base) else [
            owner for owner in gc.get_referrers(referrer) if isinstance(owner, base)
            and getattr(owner, "__dict__", None) is referrer] if isinstance(referrer, dict) else []
        found += [owner for owner in owners if getattr(owner, "optimizer", None) is optimizer]
    return found[-1] if found else None


def _same(value: object, lr: float) -> bool:
    number = _number(value)
    return number is not None and ((math.isnan(number) and math.isnan(lr)) or number == lr)


def _number(value: object) -> float | None:
    """A rate as a Python float (a one-element tensor's too), or None."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and value.is_floating_point() else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
