"""``mask``: a softmax over a fully masked row gives 0 there instead of NaN.

Every score of a fully masked row is -inf, and softmax divides 0 by 0. The
remedy runs the producer's softmax (or attention) call and turns its NaN
into 0 (``.nan_to_num(0.0)``, what the suggested edit writes): the row
attends to nothing. Its backward is finite where the mask was applied by
``masked_fill`` (whose backward drops the masked positions' gradient); an
additive mask's NaN gradient is not, and the trial says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nan_magic.fixes.site import function_name

__all__ = ["MASKED", "MaskFix"]

#: The functions whose fully masked rows the remedy zeroes.
MASKED = frozenset({"softmax", "_softmax", "scaled_dot_product_attention"})


class MaskFix:
    """The remedy: the call with its NaN made 0; None for another function."""

    def __init__(self) -> None:
        #: Values made 0, of how many: every one means every row was masked (an output of zeros, no gradient).
        self.moved = self.total = 0

    def renewed(self) -> MaskFix:
        """The same remedy, nothing counted yet (for a second trial of it)."""
        return MaskFix()

    def __call__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if function_name(func) not in MASKED:
            return None
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return None
        self.moved += int(result.isnan().sum())
        self.total += result.numel()
        return result.nan_to_num(0.0)
