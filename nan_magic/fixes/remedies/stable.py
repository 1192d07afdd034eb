"""``stable``: the producer's exp max-subtracted, or the log of a softmax or sigmoid fused (``log_softmax``).

A hand-written softmax (``e = x.exp(); e / e.sum(-1, keepdim=True)``)
overflows in ``exp``; ``exp(x - x.amax(-1, keepdim=True))`` gives the same
ratios and cannot. ``torch.log(torch.softmax(x, -1))`` is -inf where the
softmax underflowed to 0; ``torch.log_softmax(x, -1)`` is finite there, and
``F.logsigmoid(z)`` where ``torch.log(torch.sigmoid(z))`` is -inf. The
remedy sees every softmax and sigmoid the producing module (or the loss code)
runs (its output may be logged on a later line) and replaces a log of one of them.

The max-subtracted exp is the same computation only where the max cancels: a
softmax, a logsumexp, a Sinkhorn's normalisation, where ``exp(x)`` is divided
by its own sum. A PPO probability ratio ``exp(logp - old)``, a logit scale's
``exp(s)`` or an exp activation is not normalised: divided by ``exp(max)``
it is another value, finite or not. So a finite trial is run once more with
another shift per row (:func:`changes_value`); where the step's loss or
outputs move with it by more than the exp's own rounding (bfloat16's under
autocast), the trial is no fix and says so.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fixes.site import Site, function_name
from nan_magic.fixes.step import FailingStep, StepOutcome, replay_step

__all__ = ["StableFix", "changes_value"]


class StableFix:
    """The remedy for an ``exp`` (max-subtracted) or a ``log`` (of a softmax: fused)."""

    def __init__(self, function: str, offsets: bool = False) -> None:
        self.function = function
        #: Whether the exp's shift is moved by a different amount per row (1 to 2): the check of changes_value.
        self.offsets = offsets
        #: The softmax and sigmoid outputs the module made: ``id(output)`` -> (a weak reference to it, its input,
        #: the softmax's dim; None for a sigmoid).
        self._softmaxes: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int | None]] = {}
        #: The form used, for the description: ``"max-subtracted exp"``, ``"log_softmax"`` or ``"logsigmoid"``.
        self.form: str | None = None
        #: The seconds :func:`changes_value`'s second replay took (the trial's time includes them).
        self.checked = 0.0
        #: The dtype the exp ran in (bfloat16 under autocast): its rounding bounds what a moved max may change.
        self.dtype: torch.dtype | None = None

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
            self.dtype = operand.dtype
            shift = operand.detach().amax(dim=-1, keepdim=True) if operand.dim() else operand.detach()
            if self.offsets:
                rows = torch.arange(shift.numel(), dtype=shift.dtype, device=shift.device).reshape(shift.shape)
                shift = shift + 1 + rows / max(shift.numel(), 1)
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


def changes_value(step: FailingStep, site: Site, fix: StableFix, outcome: StepOutcome) -> str | None:
    """Why ``fix``'s finite max-subtracted exp (``outcome``) computes another value than the user's line, or None.

    The step is replayed with the max moved by a different amount per row: where the max cancels (the exp is
    normalised by its own sum) the loss and the outputs are the same up to rounding; where they move, the
    rewrite changed what the line means, and the step was made finite by computing something else.
    """
    if fix.form != "max-subtracted exp" or outcome.failed is not None:
        return None
    moved = replay_step(step, site, StableFix(fix.function, offsets=True))
    fix.checked = moved.seconds
    if moved.failed is not None:
        return ("it changes what the line computes: with the max moved by 1 to 2 more the step was non-finite "
                "(the max does not cancel out of what the line's exp computes, as it does out of a softmax)")
    pairs = [(_named(path), outcome.outputs[path], after) for path, after in moved.outputs.items()
             if path in outcome.outputs]
    if outcome.loss is not None and moved.loss is not None:
        pairs.append(("loss", torch.tensor(outcome.loss, dtype=torch.float64),
                      torch.tensor(moved.loss, dtype=torch.float64)))
    for name, before, after in pairs:
        if before.shape != after.shape:
            continue
        tolerance = _rounding(before, fix.dtype)
        # Relative to the tensor's largest value, not each element's own: an exp in bfloat16 rounds each of its
        # weights by ~0.4%, and the weighted sums it feeds carry that as an absolute error, which an element near 0
        # holds as a large relative one (a ViT's bf16 attention: its logits moved by 0.002 around 0.45).
        scale = float(before.double().abs().max()) if before.numel() else 0.0
        if not torch.allclose(after.double(), before.double(), rtol=tolerance, atol=max(1e-6, tolerance * scale),
                              equal_nan=True):
            change = float((after.double() - before.double()).abs().max())
            return (f"it changes what the line computes: exp(x - max) is exp(x) / exp(max), and the max does not "
                    f"cancel here (the exp is not normalised by its own sum, as a softmax's is): with the max moved "
                    f"by 1 to 2 more the {name} moved by {change:.3g}; a log of the exp's sum needs the max added "
                    f"back (torch.logsumexp), a ratio or a scale has no max to take out: clamp the exponent")
    return None


def _rounding(value: torch.Tensor, exp_dtype: torch.dtype | None) -> float:
    """The relative change that rounding alone explains: 4 eps of the coarser of the value's and the exp's dtype."""
    if not value.is_floating_point():
        return 0.0
    eps = torch.finfo(value.dtype).eps
    if exp_dtype is not None and exp_dtype.is_floating_point:
        eps = max(eps, torch.finfo(exp_dtype).eps)
    return max(1e-4, 4 * eps)


def _named(path: str) -> str:
    return "model's output" if path == "output" else f"model's output {path}"
