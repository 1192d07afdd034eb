"""The likely cause of an event, with its evidence and a concrete fix.

Turns a :class:`Report` (the producer's op, dtype, phase, input statistics,
history) into a :class:`Cause`. When the evidence does not single out one
cause the label is ``"unclassified"`` with the facts, never a confident guess.
"""

from __future__ import annotations

from nan_magic.records import Cause, Report

__all__ = ["diagnose"]


def diagnose(report: Report) -> Cause:
    """The likely cause of ``report``'s event."""
    return Cause("unclassified", "no rule matched the evidence", ())
