"""What a division's divisor is a spread of: read at an origin only, from the divisor's own autograd node.

``mean / std`` of values all equal (a holiday week's returns, a constant row) is ``0 / 0`` as a masked sum over a
count of nothing is, and the op's operands are the same two zeros: what tells them apart is what made the divisor.
A std, a variance or a norm (torch's, or the square root of a variance, a mean or a sum written by hand) is 0 only
where its values are all equal or all 0, and wants an eps added; a count wants ``clamp_min(1)``. The divisor's
``grad_fn`` names its maker where it requires grad (views and copies between are passed over); no per-op work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nan_magic.tensor_refs import op_function

__all__ = ["recorded_spread", "spread_divisor"]

#: Autograd nodes (their names without the trailing number) of the spreads, and what each is.
_SPREADS = {"StdBackward": "std", "StdMeanBackward": "std", "VarBackward": "variance", "VarMeanBackward": "variance",
            "LinalgVectorNormBackward": "norm", "NormBackward": "norm", "LinalgMatrixNormBackward": "norm"}
#: What a square root of each node's output is: ``sqrt(var)`` a std, ``sqrt(mean(d ** 2))`` or ``sqrt(sum(...))``
#: a norm (an RMS).
_ROOTED = {"VarBackward": "std", "VarMeanBackward": "std", "MeanBackward": "norm", "SumBackward": "norm"}
#: Nodes that only view, reshape or copy values: the divisor seen through them is their input.
_MOVES = ("ViewBackward", "ExpandBackward", "UnsqueezeBackward", "SqueezeBackward", "CloneBackward",
          "ToCopyBackward", "UnsafeViewBackward", "ReshapeAlias", "AliasBackward")


def _name(node: Any) -> str:
    return str(node.name()).rstrip("0123456789")


def _only_input(node: Any) -> Any:
    following = [step for step, _output in node.next_functions if step is not None]
    return following[0] if len(following) == 1 else None


def spread_divisor(op: str, inputs: list[tuple[str, Any]]) -> str | None:
    """``"std"``, ``"variance"`` or ``"norm"``: the spread a division's ``other`` is the output of; None for another op,
    a divisor made otherwise (a count, a parameter), or one with no autograd node (made under no_grad)."""
    if op_function(op) != "div":
        return None
    other = next((value for name, value in inputs if name == "other"), None)
    node = other.grad_fn if isinstance(other, torch.Tensor) else None
    for _hop in range(4):
        if node is None:
            return None
        name = _name(node)
        if name in _SPREADS:
            return _SPREADS[name]
        if name == "SqrtBackward":
            inner = _only_input(node)
            return _ROOTED.get(_name(inner)) if inner is not None else None
        if not name.startswith(_MOVES):
            return None
        node = _only_input(node)
    return None


#: The aten functions (``op_function``) of the spreads, as the loss code's recorded ops name them, and of the moves.
_SPREAD_OPS = {"std": "std", "std_mean": "std", "var": "variance", "var_mean": "variance", "linalg_vector_norm": "norm",
               "norm": "norm", "linalg_matrix_norm": "norm"}
_ROOTED_OPS = {"var": "std", "var_mean": "std", "mean": "norm", "sum": "norm"}
_MOVE_OPS = frozenset({"view", "expand", "unsqueeze", "squeeze", "clone", "_to_copy", "_unsafe_view", "reshape",
                       "alias"})


def recorded_spread(op: str, args: tuple[Any, ...], makers: Callable[[Any], tuple[str, tuple[Any, ...]] | None]
                    ) -> str | None:
    """:func:`spread_divisor` of a division the loss code ran, replayed under no_grad (no autograd node): its
    divisor's maker read from the recorded ops instead. ``args``: the division's recorded arguments; ``makers(value)``:
    the op name and arguments of the recorded op that returned ``value``, or None."""
    if op_function(op) != "div" or len(args) < 2:
        return None
    made = makers(args[1])
    for _hop in range(4):
        if made is None:
            return None
        function = op_function(made[0])
        if function in _SPREAD_OPS:
            return _SPREAD_OPS[function]
        if function == "sqrt":
            inner = makers(made[1][0]) if made[1] else None
            return _ROOTED_OPS.get(op_function(inner[0])) if inner is not None else None
        if function not in _MOVE_OPS or not made[1]:
            return None
        made = makers(made[1][0])
    return None
