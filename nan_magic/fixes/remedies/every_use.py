"""``eps`` at every use of the operand on the line: the operand clamped once where it enters the line.

The eps remedy clamps the producer's function's operand (``torch.log(sigma)``'s sigma). Where the line uses the same
tensor again (a Gaussian NLL ``torch.log(sigma) + 0.5 * ((y - mu) / sigma) ** 2``, ``torch.log(var) + (y - mu) ** 2
/ var``), the clamp inside the log alone leaves the division by the same 0: the step stays non-finite, though clamping
sigma once (``sigma.clamp_min(eps)`` for each of its uses on the line, as ``sigma = sigma.clamp_min(eps)`` before it
does) makes it finite. So where the first trial stayed non-finite and its line used a clamped operand again, the step
is replayed with that same tensor clamped in those calls too (the n-th call at the line, the argument that was the
operand: the replay makes the line's calls in the same order), and that trial is the one reported (``every_use``: how
many other uses were clamped), with the edit that clamps every use of the operand's name on the line
(render/edits.py). Runs only at an event, inside a trial.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fix_records import BOUNDED_FUNCTIONS, DOMAIN_USES, SHIFTED_FUNCTIONS, UNIT_FUNCTIONS
from nan_magic.fixes.loss import LossCode
from nan_magic.fixes.remedies.domain import DomainFix, denominator_form, holds_of
from nan_magic.fixes.site import Site, function_name
from nan_magic.fixes.step import FailingStep, StepOutcome, replay_step

__all__ = ["EveryUse", "at_every_use"]


class EveryUse(DomainFix):
    """:class:`DomainFix`, and the operand it clamps clamped in the calls at ``uses`` too (``{ordinal: arguments}``,
    :meth:`DomainFix.other_uses`)."""

    def __init__(self, function: str, uses: dict[int, tuple[int | str, ...]], period: int) -> None:
        super().__init__(function)
        self.uses = uses
        #: The calls the first trial saw at the line: the ordinals of a later run of it (the trial's check of the next
        #: forward, step.py) counted from 0 again, as its forward makes the line's calls in the same order.
        self.period = max(period, 1)
        #: How many calls it clamped a use in (a use whose argument is no floating tensor: left as it was).
        self.clamped = 0
        self._moved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def renewed(self) -> EveryUse:
        return EveryUse(self.function, self.uses, self.period)

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        # (where the first trial saw the use, and any argument that is an operand already clamped on this run)
        given_keys: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
        keys = (*self.uses.get(self.calls % self.period, ()), *(
            key for key, value in given_keys if any(holds_of(value, operand) for operand in self.operands)))
        # Only where a 0 is out of the call's domain (a log, a division by it, a root): not the user's guard around
        # the same operand (``where(sigma > 0, ..., zeros_like(sigma))``, ``* (sigma > 0)``), which a clamp defeats.
        name = function_name(func)
        keys = tuple(key for key in keys if (name, key) in DOMAIN_USES)
        if not keys:  # (a property read, ``sigma.shape``, is no use either)
            return super().__call__(func, args, kwargs)
        self.calls += 1
        given, named = list(args), dict(kwargs)
        changed = False
        for key in dict.fromkeys(keys):
            value = given[key] if isinstance(key, int) and key < len(given) else named.get(str(key))
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            moved = self._clamp(value)
            self.note_quotient(name, given, key, value, moved)
            if isinstance(key, int):
                given[key] = moved
            else:
                named[key] = moved
            changed = True
        if not changed:
            return None
        self.clamped += 1
        return self.note_output(func(*given, **named))

    def _clamp(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` moved into the function's domain as the producer's operand is (domain.py), once per tensor."""
        for seen, moved in self._moved:
            if seen is value:
                return moved
        eps = torch.finfo(value.dtype).eps
        if self.function in BOUNDED_FUNCTIONS:
            moved = value.clamp(eps if self.function in UNIT_FUNCTIONS else -1 + eps, 1 - eps)
        elif self.function in SHIFTED_FUNCTIONS:
            moved = value.clamp_min(-1 + eps)
        elif self.function in ("div", "reciprocal") and denominator_form(value) == "zeros":
            moved = torch.where(value == 0, eps, value)
        else:
            moved = value.clamp_min(eps)
        self._moved.append((value, moved))
        return moved


def at_every_use(step: FailingStep, site: Site, remedy: Any, outcome: StepOutcome
                 ) -> tuple[StepOutcome, Any] | None:
    """The step replayed with :class:`EveryUse`, where ``remedy``'s trial (``outcome``) stayed non-finite and its line
    used a clamped operand again; None where it did not (or the wider trial clamped no other use)."""
    if not isinstance(remedy, DomainFix) or isinstance(remedy, EveryUse) or remedy.form == "add":
        return None
    uses = remedy.other_uses()
    # (a step made finite whose update overflowed the next forward, ``failed="next forward"``: its other uses are not
    # why, and clamping them too only cuts the operand's gradient: a learned ``lam`` of ``(x ** lam - 1) / lam``)
    if outcome.failed in (None, "next forward", "raised") or not outcome.applied or not uses or (
            isinstance(step.loss_code, LossCode) and step.loss_code.differentiates):
        return None  # (a loss code's own autograd.grad: its recorded backward reads the operand too; runner.py)
    wider = EveryUse(remedy.function, uses, remedy.calls)
    again = replay_step(step, site, wider)
    if not wider.clamped or _REACHED.index(again.failed) <= _REACHED.index(outcome.failed):
        return None  # (no further than the clamp at the producer's function alone: that simpler trial is reported)
    again.seconds += outcome.seconds
    return again, wider


#: How far a replay got: where it failed, None (finite) the furthest; a replay that raised got nowhere.
_REACHED: tuple[str | None, ...] = ("raised", "forward", "loss", "backward", "optimizer step", "next forward", None)
