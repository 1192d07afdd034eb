"""A trial's outputs that hold only deliberate infinities: no failure of the remedied step.

A model that masks its own logits (``logits.masked_fill(~legal, -inf)``, a
``torch.where(legal, logits, -inf)``, an additive ``-inf`` mask bias) returns
-inf on every step, and the watch takes it as benign for as long as what
consumes it stays finite (PRODUCT.md: benign). A remedy that moves the
producer's operand (a ``log`` of an exact 0 beside that mask) leaves those
-inf where they were: the trial's outputs are not all finite, yet the step,
loss and gradients, is. Judging the outputs by ``isfinite`` alone said "went
non-finite in forward" for every remedy of such a model, a working one too.

So where a remedied trial's outputs hold an infinity and no NaN, the forward runs once
more under the op tracer (the watch's own rule for what is deliberate: an op
given an infinite scalar or mask, and what carries it on), and an output whose
non-finite values all began at a deliberate infinity is no failure: the step
goes on to its loss and backward, which judge it. Only the user's loss can (an
entropy bonus ``p * logp`` is NaN at every masked entry): where the loss code did
not run and the backward started from a stand-in, the trial cannot tell
(loss.py ``unjudged``). An output an op made
non-finite (an overflowed ``exp``, the unremedied ``log``) still fails. That
second forward starts from the same copies and generators, with the remedy
in place, and what the remedy counted stays the first forward's.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from nan_magic.hot.reads import iter_tensors, values_to_read
from nan_magic.localize.ops.tracer import OpTracer

__all__ = ["deliberate_outputs", "floating_outputs", "held_remedy", "holds_only_infinities"]


def floating_outputs(output: Any) -> list[tuple[str, torch.Tensor]]:
    """The floating tensors of a call's output, by path (``output[0]``)."""
    return [(path, tensor) for path, tensor in iter_tensors(output, "output", attributes=True)
            if tensor.is_floating_point()]


def holds_only_infinities(output: Any) -> bool:
    """Whether some floating tensor of ``output`` is not finite and none holds a NaN (a deliberate infinity can be
    carried as -inf or +inf; a NaN is never one at a model's output)."""
    values = [values_to_read(tensor) for _path, tensor in floating_outputs(output)]
    return any(not bool(torch.isfinite(value).all()) for value in values) and not any(
        bool(value.isnan().any()) for value in values)


def deliberate_outputs(forward: Callable[[], Any]) -> frozenset[str]:
    """The paths of the floating outputs of ``forward()``, run under the op tracer, whose non-finite values all
    began at a deliberate infinity (the tracer's ``"benign"`` origin); a finite output is not among them."""
    tracer = OpTracer(at_boundary=True)
    # (The watch's own dispatch modes stand aside, as for the trials of kept.py: under the loop-code recorder the
    # tracer saw none of the forward's ops, and an output it never saw made has no origin to tell.)
    with _disable_current_modes(), tracer:
        again = forward()
    return frozenset(path for path, tensor in floating_outputs(again)
                     if not bool(torch.isfinite(values_to_read(tensor)).all())
                     and tracer.origin_of(tensor) == "benign")


@contextlib.contextmanager
def held_remedy(remedy: Any, mode: Any) -> Iterator[None]:
    """What ``remedy`` counted (the values it moved, the calls it changed) and ``mode``'s ``applied`` as they were
    before a second forward ran with them in place: the step's, not that check's."""
    # (one level of each container copied: a dict, list or set the second forward adds to is put back as it was)
    state = {key: copy.copy(value) if isinstance(value, (dict, list, set)) else value
             for key, value in vars(remedy).items()} if hasattr(remedy, "__dict__") else {}
    applied = getattr(mode, "applied", None)
    try:
        yield
    finally:
        if state:
            vars(remedy).update(state)
        if applied is not None:
            mode.applied = applied
