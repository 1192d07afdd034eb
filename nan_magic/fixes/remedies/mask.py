"""``mask``: a softmax over a fully masked row gives 0 there instead of NaN.

Every score of a fully masked row is -inf, and softmax divides 0 by 0. The
remedy runs the producer's softmax (or attention) call and turns its NaN
into 0 (``.nan_to_num(0.0)``, what the suggested edit writes): the row
attends to nothing. Its backward is finite where the mask was applied by
``masked_fill`` (whose backward drops the masked positions' gradient); an
additive mask's NaN gradient is not, and the trial says so.

``nn.MultiheadAttention`` computes its softmax inside one torch function
(``multi_head_attention_forward``), which a function mode sees whole: there
the remedy calls it with ``need_weights=False``, the fused attention path,
which gives a fully masked row 0 and a finite gradient (torch >= 2.5) where
the weights' softmax gives NaN. A caller that reads the weights gets None,
and the trial says what that raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fixes.site import function_name

__all__ = ["MASKED", "MaskFix"]

#: The functions whose fully masked rows the remedy zeroes.
MASKED = frozenset({"softmax", "_softmax", "scaled_dot_product_attention"})
_ATTENTION_MODULE = "multi_head_attention_forward"


class MaskFix:
    """The remedy: the call with its NaN made 0; None for another function."""

    def __init__(self) -> None:
        #: Values made 0, of how many: every one means every row was masked (an output of zeros, no gradient).
        self.moved = self.total = 0
        #: Whether an nn.MultiheadAttention call was made without its weights (its fused path) instead.
        self.weights_off = False

    def renewed(self) -> MaskFix:
        """The same remedy, nothing counted yet (for a second trial of it)."""
        return MaskFix()

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        name = function_name(func)
        if name == _ATTENTION_MODULE and kwargs.get("need_weights"):  # (nn.MultiheadAttention passes it by name)
            self.weights_off = True
            return func(*args, **{**kwargs, "need_weights": False})
        if name not in MASKED:
            return None
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return None
        self.moved += int(result.isnan().sum())
        self.total += result.numel()
        return result.nan_to_num(0.0)
