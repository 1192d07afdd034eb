"""Where an ``x * log(y)`` op's infinities sit on its log's edge: read at an origin only, from the op's own operands.

``xlogy(x, y)`` is ``x * log(y)`` (±inf where y = 0 and x != 0) and ``xlog1py(x, y)`` is ``x * log1p(y)`` (±inf
where y = -1). Their common uses hold y at the edge on purpose, paired with x = 0 (an entropy's ``xlogy(p, p)``, a
Poisson's ``k.xlogy(rate)``), so that y held zeros says nothing of where an infinity is: ``20000 * log(3000)`` in
float16 is an overflow beside them. The count of infinities where y is at the edge, taken while both tensors are
alive, is the typed fact the log rule (explain/forward.py) reads.
"""

from __future__ import annotations

from typing import Any

import torch

from nan_magic.tensor_refs import op_function

__all__ = ["LOG_EDGES", "log_edge_infinities"]

#: The log's operand's value where each ``x * log(·)`` op is infinite (for x != 0).
LOG_EDGES: dict[str, float] = {"xlogy": 0.0, "special_xlogy": 0.0, "special_xlog1py": -1.0, "xlog1py": -1.0}


def log_edge_infinities(op: str, output: torch.Tensor, inputs: list[tuple[str, Any]]) -> int | None:
    """The infinities of ``output`` where the op's ``other`` is at its log's edge; None for another op, or where
    ``other`` cannot be read against the output."""
    edge = LOG_EDGES.get(op_function(op))
    other = next((value for name, value in inputs if name == "other"), None)
    if edge is None or other is None or output.is_sparse or output.is_complex():
        return None
    with torch.no_grad():
        infinite = torch.isinf(output)
        if isinstance(other, torch.Tensor):
            if other.is_sparse or (other.device != output.device and other.dim()):
                return None
            at_edge = other.to(output.device) == edge
            return int((infinite & at_edge).sum())
        if isinstance(other, (int, float)):
            return int(infinite.sum()) if other == edge else 0
    return None
