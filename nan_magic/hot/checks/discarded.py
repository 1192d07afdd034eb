"""A non-finite output gradient that the output's own ``masked_fill`` discards: no event.

A model that fills illegal logits with -inf (``scores.masked_fill(~legal, -inf)``) and loss code whose backward is
NaN at those entries only (a softmax over a fully masked row replaced by 0, ``torch.where(legal, o ** 2, 0)``, a
ListNet over an empty candidate list) sends a NaN gradient into the model's output there; ``masked_fill``'s
backward then zeroes exactly those entries, so no parameter's gradient ever sees it. The check runs in the gradient
hook itself, at an event only (a gradient found non-finite), where the node autograd is running is the output's.
"""

from __future__ import annotations

import torch

__all__ = ["discarded_by_a_fill"]


def discarded_by_a_fill(grad: torch.Tensor | None) -> bool:
    """Whether every non-finite element of ``grad``, the gradient of the output whose backward node autograd is
    running, is one that node's ``masked_fill`` (of a Python number: ``MaskedFillBackward0``) drops: in its mask.
    False outside a backward (the deferred check) or for any other node."""
    node = torch._C._current_autograd_node()
    if grad is None or node is None or type(node).__name__ != "MaskedFillBackward0":
        return False
    try:
        mask = node._saved_mask  # type: ignore[attr-defined]  # (MaskedFillBackward0 saves it)
        with torch.no_grad():
            return not bool((~torch.isfinite(grad) & ~mask.expand_as(grad)).any())
    except RuntimeError:  # (freed, or a shape that does not broadcast: not this output's)
        return False
