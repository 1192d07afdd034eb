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

#: Autograd nodes (their names without the trailing number) of the spreads, and what each is. std_mean's and var_mean's
#: second output is a mean (a fraction of a mask: a count), read only where the divisor is their first.
_SPREADS = {"StdBackward": "std", "StdMeanBackward": "std", "VarBackward": "variance", "VarMeanBackward": "variance",
            "LinalgVectorNormBackward": "norm", "NormBackward": "norm"}
#: Nodes whose output a square root of is a std (``sqrt(var)``) and, over a square (``sqrt(mean(d ** 2))``, an RMS),
#: a norm: the root of a mean or a sum of anything else may be that of a count (``mask.sum().sqrt()``).
_ROOTED = {"VarBackward": "std", "VarMeanBackward": "std"}
_ROOTED_SQUARES = {"MeanBackward": "norm", "SumBackward": "norm"}
#: Nodes that only view, reshape or copy values: the divisor seen through them is their input.
_MOVES = ("ViewBackward", "ExpandBackward", "UnsqueezeBackward", "SqueezeBackward", "CloneBackward",
          "ToCopyBackward", "UnsafeViewBackward", "ReshapeAlias", "AliasBackward")


def _name(node: Any) -> str:
    return str(node.name()).rstrip("0123456789")


def _only_input(node: Any) -> tuple[Any, int] | None:
    following = [(step, output) for step, output in node.next_functions if step is not None]
    return following[0] if len(following) == 1 else None


def _euclidean(order: Any) -> bool:
    """Whether a norm's order is 2 (a length, an RMS's): p=1 of a mask is its count, p=0 its count of non-zeros."""
    try:
        return order is None or float(order) == 2.0
    except (TypeError, ValueError):  # ('fro' is 2's; 'nuc', inf: not a spread's)
        return order == "fro"


def _node_spread(node: Any, output: int) -> str | None:
    name = _name(node)
    if name not in _SPREADS or (output != 0 and name in ("StdMeanBackward", "VarMeanBackward")):
        return None
    if name == "LinalgVectorNormBackward" or name == "NormBackward":
        saved = "_saved_ord" if name == "LinalgVectorNormBackward" else "_saved_p"
        return "norm" if _euclidean(getattr(node, saved, None)) else None
    return _SPREADS[name]


def _squared(node: Any) -> bool:
    """Whether ``node`` squares its input: ``d ** 2``, ``d.square()``, ``d * d``."""
    name = _name(node)
    if name == "PowBackward":
        return getattr(node, "_saved_exponent", None) == 2
    inputs = [step for step, _output in node.next_functions]
    return name == "MulBackward" and len(inputs) == 2 and inputs[0] is not None and inputs[0] is inputs[1]


def _rooted(node: Any, output: int) -> str | None:
    name = _name(node)
    if name in _ROOTED:
        return _ROOTED[name] if output == 0 else None
    inner = _only_input(node) if name in _ROOTED_SQUARES else None
    return _ROOTED_SQUARES[name] if inner is not None and _squared(inner[0]) else None


def spread_divisor(op: str, inputs: list[tuple[str, Any]]) -> str | None:
    """``"std"``, ``"variance"`` or ``"norm"``: the spread a division's ``other`` is the output of; None for another op,
    a divisor made otherwise (a count, a parameter), or one with no autograd node (made under no_grad)."""
    if op_function(op) != "div":
        return None
    other = next((value for name, value in inputs if name == "other"), None)
    at = (other.grad_fn, other.output_nr) if isinstance(other, torch.Tensor) and other.grad_fn is not None else None
    for _hop in range(4):
        if at is None:
            return None
        node, output = at
        name = _name(node)
        if name in _SPREADS:
            return _node_spread(node, output)
        if name == "SqrtBackward":
            inner = _only_input(node)
            return _rooted(*inner) if inner is not None else None
        if not name.startswith(_MOVES):
            return None
        at = _only_input(node)
    return None


#: The aten functions (``op_function``) of the spreads, as the loss code's recorded ops name them, and of the moves.
_SPREAD_OPS = {"std": "std", "std_mean": "std", "var": "variance", "var_mean": "variance", "linalg_vector_norm": "norm",
               "norm": "norm"}
_ROOTED_OPS = {"var": "std", "var_mean": "std"}
_MOVE_OPS = frozenset({"view", "expand", "unsqueeze", "squeeze", "clone", "_to_copy", "_unsafe_view", "reshape",
                       "alias"})
#: A recorded op: its name, arguments, keyword arguments and which of its outputs (``tree_leaves``) the value is.
Made = tuple[str, tuple[Any, ...], dict[str, Any], int]


def _recorded_kind(made: Made) -> str | None:
    function, args, kwargs, output = made[0], made[1], made[2], made[3]
    function = op_function(function)
    if function in ("std_mean", "var_mean") and output != 0:
        return None
    if function in ("linalg_vector_norm", "norm"):
        order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p"))
        return "norm" if _euclidean(order) else None
    return _SPREAD_OPS[function]


def _recorded_square(made: Made | None) -> bool:
    if made is None:
        return False
    function, args = op_function(made[0]), made[1]
    if function == "pow":
        return len(args) > 1 and not isinstance(args[1], torch.Tensor) and args[1] == 2
    return function == "mul" and len(args) == 2 and _key(args[0]) is not None and _key(args[0]) == _key(args[1])


def _key(value: Any) -> int | None:
    """A recorded argument's tensor id: a tensor's own, a weak record's ``key`` (recorded_ops.py's WeakRecord)."""
    return id(value) if isinstance(value, torch.Tensor) else getattr(value, "key", None)


def recorded_spread(op: str, args: tuple[Any, ...], makers: Callable[[Any], Made | None]) -> str | None:
    """:func:`spread_divisor` of a division the loss code ran, replayed under no_grad (no autograd node): its
    divisor's maker read from the recorded ops instead. ``args``: the division's recorded arguments; ``makers(value)``:
    the recorded op that returned ``value`` (:data:`Made`), or None."""
    if op_function(op) != "div" or len(args) < 2:
        return None
    made = makers(args[1])
    for _hop in range(4):
        if made is None:
            return None
        function = op_function(made[0])
        if function in _SPREAD_OPS:
            return _recorded_kind(made)
        if function == "sqrt":
            inner = makers(made[1][0]) if made[1] else None
            if inner is None:
                return None
            if op_function(inner[0]) in _ROOTED_OPS:
                return _ROOTED_OPS[op_function(inner[0])] if inner[3] == 0 else None
            squared = op_function(inner[0]) in ("mean", "sum") and inner[1] and _recorded_square(makers(inner[1][0]))
            return "norm" if squared else None
        if function not in _MOVE_OPS or not made[1]:
            return None
        made = makers(made[1][0])
    return None
