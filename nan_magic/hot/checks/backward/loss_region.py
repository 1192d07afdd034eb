"""The autograd nodes of the code between the watched modules and the loss.

A gradient that first turns non-finite in the backward of that code (a
``sqrt`` of a zero distance in a hand-written loss) has no module to replay.
Its nodes are still reachable from the loss when the gradient hook fires
(their saved tensors are freed, their names and links are not), and the
nodes created after the last top-level module call belong to that code (the
autograd sequence counter orders node creation). Listing them, and those
whose derivative can be infinite, points at the op; its line needs the op
tracer (``ops=True``), which records where each node was created.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from nan_magic.records import Note

__all__ = ["SINGULAR_NODES", "loss_region_nodes", "loss_region_note"]

#: Backward nodes of ops whose derivative is infinite somewhere in their finite domain.
SINGULAR_NODES = frozenset({
    "SqrtBackward0", "RsqrtBackward0", "AcosBackward0", "AsinBackward0", "AtanhBackward0", "LogBackward0",
    "Log2Backward0", "Log10Backward0", "Log1pBackward0", "ReciprocalBackward0", "DivBackward0", "DivBackward1",
    "PowBackward1", "PowBackward2", "NormBackward0", "NormBackward1", "LinalgVectorNormBackward0",
    "CdistBackward0", "Atan2Backward0", "ExpBackward0", "StdBackward0", "VarBackward0", "XlogyBackward0",
})

_ACCUMULATE = "torch::autograd::AccumulateGrad"
_MAX_NODES = 256


def loss_region_nodes(start: Any, boundary: int, limit: int = _MAX_NODES) -> list[Any]:
    """Nodes reachable from ``start`` (a loss's ``grad_fn``) created at or after sequence number ``boundary``.

    Breadth first from the loss, so in about the order backward ran them;
    at most ``limit`` (a loss region is a few ops; anything longer is cut:
    256 at each backward, more for a walk at an event).
    """
    found: list[Any] = []
    seen: set[int] = set()
    queue: deque[Any] = deque([start])
    while queue and len(found) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() == _ACCUMULATE or node._sequence_nr() < boundary:
            continue
        found.append(node)
        queue.extend(child for child, _index in node.next_functions)
    return found


def loss_region_note(nodes: list[Any]) -> Note | None:
    """The loss region's nodes by name, and the ones among them whose derivative can be infinite (render/ says it).

    Runs at each backward of the deferred watch whose loss code was not recorded: names only, nothing joined or
    counted.
    """
    if not nodes:
        return None
    names = tuple([node.name() for node in nodes])
    singular = tuple([name for node, name in zip(nodes, names) if _singular(node, name)])
    return Note("loss-region", (("nodes", names), ("singular", singular)))


def _singular(node: Any, name: str) -> bool:
    if name == "PowBackward0":  # x ** c: singular at 0 only for c < 1
        exponent = getattr(node, "_saved_exponent", None)
        return not isinstance(exponent, (int, float)) or exponent < 1
    return name in SINGULAR_NODES
