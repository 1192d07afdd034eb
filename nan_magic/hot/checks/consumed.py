"""A non-finite output gradient judged by what its consumer's backward returns: one the model drops is no event.

A model that fills illegal logits with -inf (``scores.masked_fill(~legal, -inf)``) and loss code whose backward is
NaN at those entries only (a softmax over a fully masked row replaced by 0, ``torch.where(legal, o ** 2, 0)``, a
ListNet over an empty candidate list) sends a NaN gradient into the model's output there; the output's own node
(``MaskedFillBackward0``) then zeroes exactly those entries, and no parameter's gradient ever sees it. So where the
gradient hook finds a gradient non-finite (an event only: nothing of this runs on a healthy step), it does not judge
at once: a one-shot post-hook on the node about to consume that gradient judges what the node returns. Where every
gradient it returns is finite, the NaN was dropped by the model's own backward: no event. Otherwise the gradient is
judged as it would have been at once (the same finding); nothing ran between but that node's backward.

No saved tensor is read (the mask): under non-reentrant activation checkpointing that uses up its one unpack, and
the user's backward raises. Where the node never runs (``torch.autograd.grad(loss, [output])`` asks for the
output's own gradient; a graph cut there) the gradient is judged as the backward pass ends. A custom Function's
node (reentrant checkpointing's) may compute gradients it does not return (an inner backward): judged at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

__all__ = ["judge_after_consumer"]


def judge_after_consumer(judge: Callable[..., None], *args: Any) -> None:
    """``judge(*args)`` once the node consuming a non-finite gradient (the one autograd runs now) has returned a
    non-finite gradient, or as the backward pass ends if it never runs; never where it returned only finite ones."""
    __tracebackhide__ = True
    node = torch._C._current_autograd_node()
    if node is None or isinstance(node, BackwardCFunction):
        judge(*args)
        return
    pending = [True]

    def consumed(grad_inputs: tuple[torch.Tensor | None, ...], _grad_outputs: Any) -> None:
        __tracebackhide__ = True
        if pending[0]:
            pending[0] = False
            if not _all_finite(grad_inputs):
                judge(*args)

    def pass_ended() -> None:
        __tracebackhide__ = True
        handle.remove()  # (here, not in ``consumed``: not while autograd walks the node's hooks)
        if pending[0]:
            pending[0] = False
            judge(*args)

    handle = node.register_hook(consumed)
    torch.autograd.Variable._execution_engine.queue_callback(pass_ended)


def _all_finite(grads: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether every gradient a node returned is finite (None, or a dtype without infinities, counts as finite)."""
    with torch.no_grad():
        for grad in grads:
            if grad is None or not (grad.is_floating_point() or grad.is_complex()) or grad.numel() == 0:
                continue
            try:
                if not bool(torch.isfinite(grad.coalesce().values() if grad.is_sparse else grad).all()):
                    return False
            except RuntimeError:  # (a layout isfinite cannot read: judged as before)
                return False
    return True
