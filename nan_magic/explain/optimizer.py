"""The diagnosis of an optimizer step that made a parameter or its state non-finite from finite gradients.

Three readings, from the facts the watch records about the step
(``optimizer``, ``optimizer_lr``, ``optimizer_eps``, the parameter's dtype):
a learning rate whose update alone passes the dtype's max; an ``eps`` that is
0 or rounds to 0 in the parameter's dtype, so that an Adam-like step divides
0 by 0 where a gradient is 0; a half-precision update or state that
overflowed.
"""

from __future__ import annotations

import torch

from nan_magic.explain.cause_text import HALF, counts, dtype_max, float_dtype, fmt, op_base, unclassified
from nan_magic.records import Cause, Report, TensorRole

__all__ = ["optimizer_cause"]

_EPS_OPTIMIZERS = frozenset({
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta", "RMSprop",
})
#: A learning rate within this factor of the dtype's max overflows with an update of ordinary size.
_LR_MARGIN = 1000.0

_EPS_OPS = frozenset({"addcdiv", "div", "foreach_addcdiv", "foreach_div", "fused_adam", "fused_adamw"})


def optimizer_cause(report: Report) -> Cause:
    optimizer = report.optimizer or "optimizer"
    # A parameter by its name; a state tensor as "state exp_avg_sq of fc.weight".
    tensor = report.tensor
    subject = tensor.name if tensor.role is TensorRole.PARAMETER and tensor.name else str(tensor)
    facts = [f"phase optimizer: the {optimizer} step made {subject} {counts(report)}", f"dtype {report.dtype}"]
    facts += [f"{name} = {fmt(value)}" for name, value in (("lr", report.optimizer_lr),
                                                           ("eps", report.optimizer_eps)) if value is not None]
    limit = dtype_max(report.dtype)
    lr = report.optimizer_lr
    if lr is not None and not lr < limit / _LR_MARGIN:
        # Adam-like updates are about ±lr (up to a few tens of lr), SGD's lr·grad: with lr past the max, or
        # within _LR_MARGIN of it (or inf, NaN: a schedule gone wrong), an update of ordinary size overflows,
        # whatever the implementation (fused, foreach, for-loop).
        if lr >= limit:
            size, evidence = "1", f"lr {fmt(lr)} >= {report.dtype} max {fmt(limit)}"
            what = f"itself past the {report.dtype} max {fmt(limit)}"
        elif lr == lr:
            size, evidence = fmt(limit / lr), f"lr {fmt(lr)} >= {report.dtype} max {fmt(limit)} / {_LR_MARGIN:g}"
            what = f"within {fmt(limit / lr)}x of the {report.dtype} max {fmt(limit)}"
        else:
            size, evidence, what = "1", f"lr {fmt(lr)} is not a number", "NaN"
        return Cause(
            "learning-rate-too-high",
            f"the {optimizer} step made {subject} {counts(report)} at step {report.step}: its learning rate "
            f"lr = {fmt(lr)} is {what}, so an update of lr · g is non-finite for any |g| >= {size}; use a "
            "learning rate in the usual range (1e-5 to 1e-1), check how it is computed (a scheduler, a scaling rule)",
            (*facts, evidence),
        )
    infinite = report.posinf + report.neginf
    if report.tensor.role is TensorRole.OPTIMIZER_STATE and infinite and report.dtype in HALF:
        return Cause(
            "half-precision-overflow",
            f"{subject} overflowed {report.dtype} (max {fmt(limit)}) in the {optimizer} step, e.g. a squared "
            "gradient above the limit: keep optimizer state in float32 (float32 master weights under "
            "torch.autocast)",
            tuple(facts),
        )
    divides = report.optimizer is not None and (
        report.optimizer in _EPS_OPTIMIZERS or "adam" in report.optimizer.lower()
    )
    if _eps_vanishes(report.optimizer_eps, report.dtype) and (divides or op_base(report.op) in _EPS_OPS):
        return _eps_cause(report, optimizer, subject, tuple(facts))
    if infinite and report.dtype in HALF:
        return Cause(
            "half-precision-overflow",
            f"the {optimizer} update of {subject} overflowed {report.dtype} (max {fmt(limit)}): keep float32 "
            "master weights",
            tuple(facts),
        )
    return unclassified(
        report,
        f"the {optimizer} step made {subject} {counts(report)} from finite gradients in {report.dtype}; no rule of "
        "the checklist matches",
        tuple(facts),
    )


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


def _eps_cause(report: Report, optimizer: str, subject: str, facts: tuple[str, ...]) -> Cause:
    eps = report.optimizer_eps
    zero = (f"where a gradient of {subject} is 0 (a parameter this batch did not use: an embedding row, a padded "
            f"position) that is 0/0, giving {counts(report)}")
    if eps == 0.0:
        return Cause(
            "optimizer-eps-underflow",
            f"the {optimizer} step divides by sqrt(v) + eps with eps = 0: {zero}; use eps = 1e-8 (the default)",
            (*facts, "eps = 0: sqrt(v) + eps is 0 where v is 0"),
        )
    shown = fmt(eps) if eps is not None else "1e-8 (the default)"
    found = float_dtype(report.dtype) or torch.float16
    smallest = torch.finfo(found).smallest_normal * torch.finfo(found).eps  # the smallest subnormal
    fix = ("keep float32 master weights (float32 parameters under torch.autocast with a GradScaler) or use "
           "eps >= 1e-4 in float16") if report.dtype == "float16" else f"use an eps that {report.dtype} holds"
    return Cause(
        "optimizer-eps-underflow",
        f"the {optimizer} step divides by sqrt(v) + eps, and eps = {shown} rounds to 0 in {report.dtype} "
        f"(smallest positive {fmt(smallest)}): {zero}; {fix}",
        (*facts, f"{report.dtype} cannot hold eps = {shown}"),
    )
