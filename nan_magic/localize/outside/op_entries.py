"""What the code recorders do with an op: let it by (a profiler marker, an op that makes no tensor), record it, or
record it after taking the generators' state (it draws random numbers); looked up once per op, cached on the op.

Split from recorder.py, whose dispatch reads these entries at every op of the code outside the models.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from nan_magic.localize.ops.plans import Plan, plan_of

__all__ = ["PASS", "SEEDED_OP", "ZERO_GRAD_CODES", "op_entry", "passes"]

# torch's own zero_grad functions: one the loop bound before the watch began (``zero = opt.zero_grad``) runs
# without the patch that steps the recorder aside (patches/zero_grad.py), and its ops (a ``zero_`` per gradient
# with ``set_to_none=False``) are let by here instead, found as the user's frame is looked for.
ZERO_GRAD_CODES = frozenset(
    id(inspect.unwrap(vars(owner)["zero_grad"]).__code__) for owner in (torch.optim.Optimizer, torch.nn.Module)
)

# What the recorder does with an op (cached per op in _OPS with the callable it runs): pass a profiler
# marker through; record an op; record an op that draws random numbers (taking the generators' state first).
PASS, _RECORD, SEEDED_OP = "pass", "record", "seeded"
# id(op) -> (kind, callable, the op, kept so its id stays unique, its plan where it writes in place)
_OPS: dict[int, tuple[str, Any, Any, Plan | None]] = {}


def op_entry(func: Any) -> tuple[str, Any, Any, Plan | None]:
    """``(kind, callable, op, writes)`` of an op, cached: an ``OpOverload`` runs through its C++ ``_op``, skipping
    ``__call__``; ``writes``: its plan, where it writes a tensor in place (``out=`` too). Kept as an attribute of
    the op, and by id for a callable that takes none (then looked up here at each op)."""
    if (entry := _OPS.get(id(func))) is None:
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())  # (draws random numbers)
        kind = PASS if passes(func) else SEEDED_OP if seeded else _RECORD
        overload = isinstance(func, torch._ops.OpOverload)
        plan = plan_of(func) if overload and kind is not PASS else None
        entry = _OPS[id(func)] = (kind, func._op if overload else func, func, plan if plan and plan.writes else None)
        with contextlib.suppress(AttributeError, TypeError):
            func._nan_magic_outside = entry
    return entry


def passes(func: Any) -> bool:
    """Whether the recorders let an op by unrecorded: a profiler marker (``opt.step()``'s, ``zero_grad()``'s), or
    an op that returns no tensor and writes none (``.item()``'s ``_local_scalar_dense``, ``torch.equal``,
    ``bool(t)``'s ``is_nonzero``): it makes no value a NaN could be in, and no later op reads what it returned
    but as a number already in that op's arguments, so a replay never needs it. Looked up once per op.
    """
    if getattr(func, "namespace", None) == "profiler":
        return True
    if not isinstance(func, torch._ops.OpOverload) or plan_of(func).writes:
        return False
    return not any("Tensor" in str(returned.type) for returned in func._schema.returns)
