"""The diagnosis of an optimizer step that made a parameter or its state non-finite from finite gradients.

Four readings, from the facts the watch records about the step
(``optimizer``, ``optimizer_lr``, ``optimizer_eps``, the parameter's dtype):
a learning rate that is NaN or infinite (the number itself, set by the loop's line or a scheduler's step, or
where unknown); a finite learning rate whose update alone passes the dtype's max; an ``eps`` that is
0 or rounds to 0 in the parameter's dtype, so that an Adam-like step divides
0 by 0 where a gradient is 0; a half-precision update or state that
overflowed.
"""

from __future__ import annotations

import math

import torch

from nan_magic.explain.evidence import HALF, dtype_max, float_dtype
from nan_magic.plain import to_pairs
from nan_magic.records import Cause, Report, TensorRole
from nan_magic.tensor_refs import op_function

__all__ = ["optimizer_cause"]

_EPS_OPTIMIZERS = frozenset({
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta", "RMSprop",
})
#: A learning rate within this factor of the dtype's max overflows with an update of ordinary size.
_LR_MARGIN = 1000.0

_EPS_OPS = frozenset({"addcdiv", "div", "foreach_addcdiv", "foreach_div", "fused_adam", "fused_adamw"})


def optimizer_cause(report: Report) -> Cause:
    # The parameter or state tensor the step made non-finite, as plain data (render/words names it).
    subject = to_pairs(report.tensor)
    limit = dtype_max(report.dtype)
    facts = (
        ("optimizer", report.optimizer or "optimizer"), ("subject", subject), ("dtype", report.dtype),
        ("nan", report.nan), ("posinf", report.posinf), ("neginf", report.neginf),
        ("lr", report.optimizer_lr), ("eps", report.optimizer_eps), ("limit", limit), ("step", report.step),
    )
    lr = report.optimizer_lr
    set_at = next((note for note in report.note_facts if note.kind == "lr-set-by-loop"), None)
    if set_at is not None:  # (a rate the loop computed in Python, or kept as a tensor: not finite, not too high)
        return Cause("nonfinite-number", "optimizer-lr-set",
                     (*facts, ("name", set_at.fact("name")), ("line", set_at.fact("line"))))
    made = any(note.kind == "lr-made-by-loop" for note in report.note_facts)
    if lr is not None and not math.isfinite(lr) and not made:
        # A NaN or infinite rate is the number itself, no rate too high: every update lr · g is non-finite whatever
        # the gradient, and a lower rate (a tenth of NaN) is no remedy. Where it was set: a scheduler's step.
        scheduled = next((note for note in report.note_facts if note.kind == "lr-set-by-scheduler"), None)
        if scheduled is not None:
            return Cause("nonfinite-number", "optimizer-lr-scheduled", (*facts, *(
                (name, scheduled.fact(name)) for name in ("scheduler", "last_epoch", "initial_lr"))))
        stored = next((note for note in report.note_facts if note.kind == "lr-stored-by-loop"), None)
        return Cause("nonfinite-number", "optimizer-lr-nonfinite", (*facts, *(
            (("stored_line", stored.fact("line")), ("stored_text", stored.fact("text"))) if stored else ())))
    if lr is not None and not lr < limit / _LR_MARGIN and not made:
        # (Not where the loop's own op made a NaN or infinite rate, named at its line: the op says why.)
        # Adam-like updates are about ±lr (up to a few tens of lr), SGD's lr·grad: with lr past the max, or
        # within _LR_MARGIN of it, an update of ordinary size overflows,
        # whatever the implementation (fused, foreach, for-loop).
        return Cause("learning-rate-too-high", "optimizer-lr", (*facts, ("margin", _LR_MARGIN)))
    infinite = report.posinf + report.neginf
    if report.tensor.role is TensorRole.OPTIMIZER_STATE and infinite:
        if report.dtype in HALF:
            return Cause("half-precision-overflow", "optimizer-state-overflow", facts)
        # A float32 square (exp_avg_sq) past the max: gradients of 1e19 and more, the step's own finite ones.
        return Cause("overflow", "optimizer-state-overflow-wide", facts)
    divides = report.optimizer is not None and (
        report.optimizer in _EPS_OPTIMIZERS or "adam" in report.optimizer.lower()
    )
    if _eps_vanishes(report.optimizer_eps, report.dtype) and (divides or op_function(report.op) in _EPS_OPS):
        if report.optimizer_eps == 0.0:
            return Cause("optimizer-eps-underflow", "optimizer-eps-zero",
                         (*facts, ("default_eps", report.optimizer_default_eps)))
        found = float_dtype(report.dtype) or torch.float16
        smallest = torch.finfo(found).smallest_normal * torch.finfo(found).eps  # the smallest subnormal
        return Cause("optimizer-eps-underflow", "optimizer-eps-rounds", (*facts, ("smallest", smallest)))
    if infinite and report.dtype in HALF:
        return Cause("half-precision-overflow", "optimizer-update-overflow", facts)
    if report.optimizer is None:
        # No optimizer stepped it: the loop's own code wrote it (outside/loop_writes.py, param_writes.py), and
        # running that code's ops again named no op.
        return Cause("unclassified", "loop-write-unmatched", facts)
    return Cause("unclassified", "optimizer-unmatched", facts)


def _eps_vanishes(eps: float | None, dtype: str | None) -> bool:
    """Whether ``sqrt(v) + eps`` can be 0: eps is 0, or rounds to 0 in the parameter's dtype.

    Unknown, eps is taken as the usual default 1e-8, which only float16 loses
    (an eps float16 holds, 1e-3, does not vanish: such a step fails otherwise).
    """
    if eps is None:
        return dtype == "float16"
    if eps == 0.0:
        return True
    found = float_dtype(dtype)
    return found is not None and float(torch.tensor(eps, dtype=found)) == 0
