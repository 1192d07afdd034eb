"""A non-finite gradient into a model output that the output's own deliberate fill drops: no event.

A model that fills illegal logits with -inf (``scores.masked_fill(~legal, -inf)``, ``torch.where(legal, scores,
-inf)``) and loss code whose backward is NaN at those entries only (a softmax over a fully masked row replaced by 0,
``torch.where(legal, o ** 2, 0)``, a ListNet over an empty candidate list) sends a NaN gradient into the output
there; the fill's backward zeroes the filled entries, so no gradient of the model's parameters ever sees it. (The
same NaN may reach a learnable of the loss code that multiplies the output, ``where(legal, (o * t) ** 2, 0)``, or an
unwatched critic's: their gradients go NaN and the watch, which reads neither, reports the NaN loss of the next step.)

Judged at an event only (a gradient found non-finite, immediate or at the deferred check), from what the forward
left: the output tensor itself, unchanged since the forward judged its infinities deliberate (its record's status
``benign``), every non-finite entry of the gradient at an infinite entry of the output, and the output made by a
fill whose backward drops the filled entries (a ``masked_fill`` or a ``where`` with one differentiable side, reached
through copies and views only). No saved tensor is read (activation checkpointing unpacks each once). A gradient
where the output is finite (a dead ReLU's 0 under ``sqrt``) or made by an add (``x + mask_bias``: its backward hands
the NaN to ``x``) stays an event.
"""

from __future__ import annotations

from typing import Any

import torch

from nan_magic.hot.kept.call_records import TensorRecord

__all__ = ["dropped_by_its_fill"]

#: Backward nodes that zero the gradient of the entries their forward filled (one differentiable input).
_FILLS = frozenset({"MaskedFillBackward0", "MaskedFillBackward1", "WhereBackward0"})
#: Backward nodes that hand each entry's gradient to the same entry (a copy, a view): walked through to a fill.
_CARRIERS = frozenset({"CloneBackward0", "ToCopyBackward0", "NegBackward0", "AliasBackward0", "ViewBackward0",
                       "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0", "TransposeBackward0",
                       "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
                       "SqueezeBackward2", "SliceBackward0", "SelectBackward0", "ExpandBackward0"})
_WALK = 8


def dropped_by_its_fill(grad: torch.Tensor | None, output_record: TensorRecord | None) -> bool:
    """Whether every non-finite entry of ``grad`` (the gradient of ``output_record``'s tensor) is one the output's
    deliberate fill drops (the module docstring). False where anything needed is gone or changed: an event."""
    record = output_record
    benign = False
    while record is not None:
        benign = benign or record.status == "benign"
        record = record.outer
    if grad is None or output_record is None or not benign:
        return False
    output = output_record.ref()
    if output is None or output.shape != grad.shape or not _made_by_a_fill(output.grad_fn):
        return False
    try:
        if output._version != output_record.version:  # (changed in place since the forward judged it)
            return False
    except RuntimeError:  # an inference tensor: no version counter
        return False
    try:
        with torch.no_grad():
            return not bool((~torch.isfinite(grad) & ~torch.isinf(output)).any())
    except (RuntimeError, TypeError, NotImplementedError):  # (a sparse gradient, a subclass: not judged here)
        return False


def _made_by_a_fill(node: Any) -> bool:
    for _ in range(_WALK):
        if node is None:
            return False
        name = type(node).__name__
        edges = [edge for edge, _ in node.next_functions if edge is not None]
        if len(edges) != 1:
            return False
        if name in _FILLS:
            return True
        if name not in _CARRIERS:
            return False
        node = edges[0]
    return False
