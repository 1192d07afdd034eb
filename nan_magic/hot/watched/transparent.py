"""Modules that cannot turn a finite input into a non-finite output: no check of their own.

A ReLU, a GELU or a dropout is often every third module call of a model. When
its input is known finite (the probe of the call that returned it was read,
and the tensor was not written since), its output is finite too, and its
backward cannot make a finite gradient non-finite either: checking it would
cost a probe, a gradient hook and a record, and could never name it. Such a
call is *passed through*: nothing is recorded, and its output stands for its
input's record, so that the module consuming it is still found as the
consumer in backward (``StepLog.alias``). With a non-finite input, or an
input of unknown finiteness (deferred mode, a tensor from outside the
watch), the call is checked like any other, with one exception: an input
its parent's own code computed (``softmax`` before an attention dropout)
is left to the parent's check (:func:`passes_through_unseen`); should a
module consume that call's output, the gradient it computes for it is still
checked, so its backward is still named (``StepLog.adopt``).

The list is strict. The factor by which each backward multiplies the
gradient is at most 1 for ``ANY_DTYPE``; it exceeds 1 slightly for
``WIDE_ONLY`` modules (GELU up to 1.13, dropout ``1/(1-p)``), which a
float16 gradient near its limit could overflow, so those pass through only
in float32 and float64. A dropout's forward also multiplies by ``1/(1-p)``:
it passes through only when the input's largest magnitude times that stays
below the dtype's maximum. Subclasses are not trusted (their forward may
differ), and functions that map an infinite input to NaN (GELU of ``-inf``)
are harmless here because only finite inputs pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from nan_magic.hot.reads import WIDE_FLOATS, finite_max

__all__ = [
    "ANY_DTYPE",
    "WIDE_ONLY",
    "Transparency",
    "dropped_by_a_pass_through",
    "output_bound",
    "passes_through",
    "passes_through_unseen",
    "transparency",
]

Transparency = Literal["any", "wide", "dropout"]

#: Finite in, finite out; the backward multiplies the gradient by at most 1.
ANY_DTYPE: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Tanh, nn.Sigmoid, nn.Softsign, nn.Hardsigmoid,
)

#: Finite in, finite out; the backward may multiply the gradient by a little more than 1.
WIDE_ONLY: tuple[type[nn.Module], ...] = (nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish)

_DROPOUTS: tuple[type[nn.Module], ...] = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def transparency(module: nn.Module) -> Transparency | None:
    """How ``module`` may be passed through (None: it is always checked)."""
    cls = type(module)
    if cls in ANY_DTYPE:
        return "any"
    if cls is nn.LeakyReLU:
        return "any" if abs(float(getattr(module, "negative_slope", math.inf))) <= 1 else None
    if cls is nn.ELU:
        return "wide" if math.isfinite(float(getattr(module, "alpha", math.inf))) else None
    if cls in WIDE_ONLY:
        return "wide"
    if cls in _DROPOUTS:
        return "dropout"
    return None


def passes_through(kind: Transparency, module: nn.Module, tensor: torch.Tensor, low: float, high: float) -> bool:
    """Whether a call on ``tensor``, known finite with range ``[low, high]``, needs no check."""
    if not passes_through_unseen(kind, tensor):
        return False
    if kind != "dropout" or not module.training:
        return True
    keep = 1.0 - float(getattr(module, "p", 1.0))
    return keep > 0 and max(-low, high) / keep < finite_max(tensor.dtype)


def passes_through_unseen(kind: Transparency, tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor``, a value its parent's own code computed, needs no check.

    The parent's output is checked, and a non-finite value its code computed
    is the parent's (``functional code in a parent is blamed on the
    parent``), whether or not a pass-through sits between. A check of the
    call itself could only add the call's own overflow: none for an
    activation; for a dropout, an input beyond ``finfo.max * (1 - p)``, which
    the replay of the parent then names at the dropout's op. The caller
    allows this only where that replay runs (immediate mode). It is also
    the dtype rule of :func:`passes_through`: a backward factor above 1
    only in float32 and float64.
    """
    return kind == "any" or tensor.dtype in WIDE_FLOATS


def output_bound(kind: Transparency, module: nn.Module, low: float, high: float) -> float:
    """A bound on ``|output|`` of a passed-through call whose input lies in ``[low, high]``.

    The activations listed never grow a magnitude above ``max(|x|, 1)``
    (sigmoid-like ones stay within 1, ReLU-like ones within ``|x|``), except
    by their own constants: an ELU's ``alpha`` below zero, a Hardtanh's
    bounds. A training dropout scales by ``1/(1-p)``. A chain of
    pass-throughs (a dropout after a GELU) is judged on this bound.
    """
    magnitude = max(-low, high)
    if kind == "dropout":
        return magnitude / (1.0 - float(getattr(module, "p", 0.0))) if module.training else magnitude
    # Read from the instance dict: a missing attribute sent through
    # ``nn.Module.__getattr__`` costs about 10 us (it formats an error).
    attributes = vars(module)
    bound = magnitude if magnitude > 1.0 else 1.0
    for name in _CONSTANTS:
        value = attributes.get(name)
        if value is not None:
            bound = max(bound, abs(float(value)))
    return bound


#: The attributes of the listed activations that can bound their output.
_CONSTANTS = ("alpha", "min_val", "max_val")


def dropped_by_a_pass_through(call: Any, later: Iterable[Any]) -> bool:
    """Whether the deferred check's non-finite gradient ``call`` is one the immediate mode never judges.

    The deferred mode cannot know a pass-through's input finite at the call (its probe is read at the check), so it
    checks the call and hooks its output; the immediate mode passed the call through, its output standing for its
    input's record, and judges the gradient into that input only. Where the input read finite (unchanged since) and
    the gradient into it, judged by its own hook after this one (``later``: the calls finished after ``call``), is
    finite, the pass-through's backward dropped the non-finite values (a ReLU's ``threshold_backward`` over units
    that were inactive: a Hessian-vector product's NaN at a zero feature): the immediate mode saw nothing, and the
    deferred one must say the same. Where that gradient is non-finite too, ``call`` is judged: its consumer is the
    one the immediate mode names. A dropout is left checked (its bound needs the module's ``p`` and mode).
    """
    record = getattr(call, "target", None)
    through = record.call if record is not None else None
    if through is None or through.info is None:
        return False
    kind = through.info.transparent
    if kind is None or kind == "dropout" or len(through.inputs) != 1:
        return False
    outermost = record  # (not None: ``through`` is its call)
    assert outermost is not None
    while outermost.outer is not None:
        outermost = outermost.outer
    if outermost.call is None or outermost.call.parent is None:
        # The pass-through's output is a model's output (a model ending in a ReLU, under ops+defer recorded as the
        # ReLU's): the gradient into it is a boundary every mode judges, whatever the ReLU's backward makes of it.
        return False
    entering, version = through.inputs[0][2], through.inputs[0][4]
    if (entering is None or entering.kinds or not entering.ranged or version != entering.version
            or not (kind == "any" or entering.dtype in WIDE_FLOATS)):
        return False
    # The gradient hook sits on the innermost record of a tensor (GradientChecks.hook_output): where the input came
    # out of a nested module (Sequential(Sequential(Linear)), ReLU), its judged gradient is an inner record's.
    records = []
    while entering is not None:
        records.append(entering)
        entering = entering.inner
    for other in later:
        if any(getattr(other, "target", None) is record for record in records):
            return not other.outputs[0].kinds
    return False
