"""``stable``: the producer's exp max-subtracted, or the log of a softmax or sigmoid fused (``log_softmax``).

A hand-written softmax (``e = x.exp(); e / e.sum(-1, keepdim=True)``)
overflows in ``exp``; ``exp(x - x.amax(-1, keepdim=True))`` gives the same
ratios and cannot. ``torch.log(torch.softmax(x, -1))`` is -inf where the
softmax underflowed to 0; ``torch.log_softmax(x, -1)`` is finite there, and
``F.logsigmoid(z)`` where ``torch.log(torch.sigmoid(z))`` is -inf. The
remedy sees every softmax and sigmoid the producing module (or the loss code)
runs (its output may be logged on a later line) and replaces a log of one of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fixes.site import function_name

__all__ = ["StableFix"]


class StableFix:
    """The remedy for an ``exp`` (max-subtracted) or a ``log`` (of a softmax: fused)."""

    def __init__(self, function: str) -> None:
        self.function = function
        #: The softmax and sigmoid outputs the module made: ``id(output)`` -> (a weak reference to it, its input,
        #: the softmax's dim; None for a sigmoid).
        self._softmaxes: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int | None]] = {}
        #: The form used, for the description: ``"max-subtracted exp"``, ``"log_softmax"`` or ``"logsigmoid"``.
        self.form: str | None = None

    def seen(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], result: Any) -> None:
        """A call the producing module made (anywhere in it): a softmax's or sigmoid's output is remembered."""
        name = function_name(func)
        if name in ("softmax", "sigmoid") and isinstance(result, torch.Tensor) and args:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None) if name == "softmax" else None
            if isinstance(dim, int) or name == "sigmoid":
                self._softmaxes[id(result)] = (weakref.ref(result), args[0], dim)

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        name = function_name(func)
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return None
        operand = args[0]
        if self.function == "exp" and name == "exp":
            self.form = "max-subtracted exp"
            shift = operand.detach().amax(dim=-1, keepdim=True) if operand.dim() else operand.detach()
            return torch.exp(operand - shift)
        if self.function == "log" and name == "log":
            known = self._softmaxes.get(id(operand))
            if known is not None and known[0]() is operand:
                if known[2] is None:
                    self.form = "logsigmoid"
                    return torch.nn.functional.logsigmoid(known[1])
                self.form = "log_softmax"
                return torch.log_softmax(known[1], dim=known[2])
        return None
