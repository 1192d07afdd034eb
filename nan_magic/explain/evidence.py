"""What every rule of the diagnosis reads: the op's name, the dtype's limits, and the event as a cause's fact.

A rule returns a :class:`Cause`: its kind, which reading of it, and the
plain values it rests on. :func:`event` is the fact every reading of a
single event shares (the bad tensor, the producer, the op, its inputs, the
counts), so that ``nan_magic.render.words.causes.readings`` writes each sentence from the
cause alone, in a scene as in the live report.
"""

from __future__ import annotations

import dataclasses

import torch

from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Report, TensorRole

__all__ = ["HALF", "dtype_max", "event", "event_cause", "float_dtype", "node_function", "op_made", "plain_cause"]

#: The half-precision dtypes, by name.
HALF = ("float16", "bfloat16")


def event(report: Report) -> tuple[str, object]:
    """The event as a cause's fact: the report's own fields as plain pairs, less the step's tables and samples."""
    kept = dataclasses.replace(report, cause=None, layers=(), samples=(), history=(), debug_locals=(), frames=())
    return "event", to_pairs(kept)


def event_cause(label: str, reading: str, report: Report, **numbers: object) -> Cause:
    """A cause of ``report``'s event: its kind, its reading, the event and the numbers the reading rests on."""
    return Cause(label, reading, (event(report), *numbers.items()))


def plain_cause(cause: Cause) -> tuple[str, str, tuple[tuple[str, object], ...]]:
    """A cause as a plain fact of another (the reading it led to), so a scene stores it as data."""
    return cause.label, cause.reading, cause.facts


def op_made(report: Report) -> tuple[int, int, int]:
    """``(nan, +inf, -inf)`` that the producing op itself made.

    The report's counts are the op's where its tensor is the op's output (a replay named the op); where it is the
    boundary that showed the event (a loss, a gradient), later ops may have made something else of them: a custom
    Function's backward ``e / e.sum()`` turns its exp's +inf into NaN. The op's output sample counts it whole.
    """
    if report.tensor.role is not TensorRole.OP_OUTPUT:
        for sample in report.samples:
            ref = sample.tensor
            if (sample.producer and ref is not None and ref.role is TensorRole.OP_OUTPUT and ref.name == report.op
                    and sample.nan is not None and sample.posinf is not None and sample.neginf is not None):
                return sample.nan, sample.posinf, sample.neginf
    return report.nan, report.posinf, report.neginf


def node_function(node: str) -> str:
    """The forward function of an autograd node (torch's class name): ``"SqrtBackward0"`` → ``"sqrt"``."""
    return node.rstrip("0123456789").removesuffix("Backward").lower()


def float_dtype(dtype: str | None) -> torch.dtype | None:
    """The floating dtype a report names (``"float16"``), or None when it names none."""
    found = getattr(torch, dtype or "", None)
    return found if isinstance(found, torch.dtype) and found.is_floating_point else None


def dtype_max(dtype: str | None) -> float:
    """Largest finite value of a floating dtype named like ``"float16"`` (float32's when unknown)."""
    return torch.finfo(float_dtype(dtype) or torch.float32).max
