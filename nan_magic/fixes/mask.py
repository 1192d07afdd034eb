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

__all__ = ["MASKED", "zero_masked_rows"]

#: The functions whose fully masked rows the remedy zeroes.
MASKED = frozenset({"softmax", "_softmax", "scaled_dot_product_attention"})


def zero_masked_rows(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The call with its NaN made 0; None for another function."""
    if function_name(func) not in MASKED:
        return None
    result = func(*args, **kwargs)
    return result.nan_to_num(0.0) if isinstance(result, torch.Tensor) else None
