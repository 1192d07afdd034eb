"""The cause of a handled batch: a non-finite value entering a watched model that the program handled (benign).

The watch holds a non-finite batch until its step ends (hot/kept/held_batch.py); a step whose outputs, loss,
gradients and parameters stayed finite handled it, and the event is benign, with this cause. Its facts are the
event and how many steps' batches it stands for (lifecycle/events.py counts the later ones in the first).
"""

from __future__ import annotations

from nan_magic.explain.evidence import event_cause
from nan_magic.records import Cause, Report

__all__ = ["handled_again", "handled_input"]


def handled_input(report: Report, steps: int, last_step: int) -> Cause:
    """``handled-input``: ``report``'s batch carried non-finite values the model handled, in ``steps`` steps' batches
    (the first is the report's step, the last ``last_step``)."""
    return event_cause("handled-input", "handled-input", report, steps=steps, last_step=last_step)


def handled_again(cause: Cause, steps: int, last_step: int) -> Cause:
    """``cause`` (a :func:`handled_input`), now standing for ``steps`` steps' batches, the last at ``last_step``.

    Its event fact is kept as it is, not encoded again: a model whose every batch holds NaN counts one a step.
    """
    kept = tuple((name, value) for name, value in cause.facts if name not in ("steps", "last_step"))
    return Cause(cause.label, cause.reading, (*kept, ("steps", steps), ("last_step", last_step)))
