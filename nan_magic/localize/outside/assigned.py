"""What the loop's code *assigned* to a parameter or a gradient, which no in-place write shows: at an event only.

``p.grad = total / count`` (federated averaging over a gradient made by ``autograd.grad``), ``p.data = v``
(``vector_to_parameters``, a renormalisation written ``w.data = w.data / w.data.norm()``) run no op on the parameter:
the value assigned was made by a recorded op, which is found here by the memory it left the parameter on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nan_magic.localize.ops.origins import OpFinding
from nan_magic.localize.ops.plans import arguments, plan_of
from nan_magic.localize.outside.recorded_ops import RecordedOp, WeakRecord, finite_now, record_key
from nan_magic.localize.outside.region_records import RegionRecords

__all__ = ["assigned_gradient", "claim_assigned"]


def assigned_gradient(ops: list[RecordedOp], produced: dict[int, int],
                      parameters: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Whether a watched parameter's gradient is the output of a recorded op that did not write it in place
    (``produced``: the records' outputs by id, to the latest op's index): the region's code assigned it (``p.grad =
    total / count``). ``p.grad.div_(2.0)`` returns the gradient itself, read as its operand: no assignment."""
    for _name, parameter in parameters:
        grad = parameter.grad
        index = produced.get(id(grad)) if grad is not None else None
        while index is not None and index >= 0:
            op = ops[index]
            if any(record_key(out) == id(grad) for out in tree_leaves(op.out)) and all(
                    record_key(value) != id(grad) for value in tree_leaves((op.args, op.kwargs))):
                return True  # (made by an op that did not read it: assigned)
            index -= 1
    return False


def _tensor(value: Any) -> torch.Tensor | None:
    tensor = value.ref() if isinstance(value, WeakRecord) else value
    if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided and tensor.numel():
        return tensor
    return None


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _on_memory(ops: list[RecordedOp], end: int, address: int) -> int | None:
    """The latest of ``ops[:end]`` that returned a tensor on the storage at ``address``, or None."""
    for index in range(end - 1, -1, -1):
        for out in tree_leaves(ops[index].out):
            if (tensor := _tensor(out)) is not None and _storage(tensor) == address:
                return index
    return None


def _unexplained(ops: list[RecordedOp], produced: dict[int, int], tensor: torch.Tensor) -> int | None:
    """The index of the recorded op that made ``tensor``'s memory non-finite from finite operands, walked back from
    the latest op whose output lies on that memory, through the first non-finite operand of each, as they are now
    (an operand a recorded op made, by its id; one read by reference, a parameter rebound since, by the memory the
    op's output still shares with it: a view); None where the walk leaves the records (a value read non-finite)."""
    at = _on_memory(ops, len(ops), _storage(tensor))
    for _ in range(len(ops)):
        if at is None:
            return None
        op = ops[at]
        bad = next((read for value in _read_arguments(op) if (read := _tensor(value)) is not None
                    and read.is_floating_point() and not finite_now(read)), None)
        if bad is None:
            return at
        made = produced.get(id(bad))
        if made is not None and made < at:
            at = made
            continue
        outs = [out for value in tree_leaves(op.out) if (out := _tensor(value)) is not None]
        # (Read by reference and rebound since: the view the op returned still lies on the memory it read.)
        address = _storage(bad) if not outs or _storage(outs[0]) == _storage(bad) else _storage(outs[0])
        at = _on_memory(ops, at, address)
    return None


def _overwritten(op: RecordedOp) -> list[Any]:
    """The arguments ``op`` overwrote without reading them (``w.fill_(nan)``, then ``nn.Parameter(w)`` assigned:
    ``w`` is non-finite now because of it, not an operand that was); empty for any other op."""
    func = op.func
    plan = plan_of(func) if isinstance(func, torch._ops.OpOverload) else None
    if plan is None or not plan.overwrites:  # (copy_, fill_, zero_: their target, non-finite now, is no operand)
        return []
    return tree_leaves([value for name, value in arguments(plan, op.args, op.kwargs) if name in plan.writes])


def _read_arguments(op: RecordedOp) -> list[Any]:
    """The values ``op`` read: every argument, but those it overwrote without reading (:func:`_overwritten`)."""
    unread = {id(value) for value in _overwritten(op)}
    return [value for value in tree_leaves((op.args, op.kwargs)) if id(value) not in unread]


def claim_assigned(records: RegionRecords | None, tensor: torch.Tensor) -> OpFinding | None:
    """The recorded op that made the memory ``tensor`` (a parameter) was assigned, run again on its operands as they
    are now under the op tracer (records.claim's replay, of that one op); None where no recorded op explains it.
    Looked for in the region's records, then in those held past the model call that ended it (``_data``: the deferred
    check's). A cold walk of the records: asked only where a parameter is found non-finite that no recorded write
    explains."""
    if records is None or tensor.layout is not torch.strided or not tensor.numel():
        return None
    for ops, produced, rng in ((records._ops, records._produced, records._rng), records._data or ([], {}, None)):
        at = _unexplained(ops, produced, tensor) if ops else None
        if at is not None:
            target = next((key for key in map(record_key, tree_leaves(ops[at].out)) if key is not None), None)
            # (What it overwrote unread is replayed from a finite stand-in: as it is now, it holds the op's own NaN.)
            stand_ins: dict[int, torch.Tensor] = {}
            for value in _overwritten(ops[at]):
                if (key := record_key(value)) is not None and (written := _tensor(value)) is not None:
                    stand_ins[key] = torch.zeros_like(written)
            return records._claim_ops([ops[at]], rng, stand_ins, target, ops)
    return None
