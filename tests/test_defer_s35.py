"""The deferred watch (what a GPU runs) names what the immediate one names: round 35.

- ``ops=True, defer=True`` named a backward event by the op's output ('3 +inf, 9 -inf in output of aten.div.Tensor')
  where ``ops=True`` names the boundary gradient and its counts ('12 nan in grad of lin output'): the gradient is
  freed by the deferred check and its probe counted nothing. The deferred tracer keeps the counts of what an op's
  origin reached (localize/ops/origins.Origins.stats_by_ref); these rows were among the 44 that
  ``scripts/defer_diff.py --ops`` listed so (tests/test_defer_s34.py, test_defer_s28.py hold three more).
- A GradScaler whose scale collapses is judged at ``scaler.step``: %debug opened there at once, but at
  ``scaler.scale(loss).backward()`` under ``ops=True, defer=True`` (the deferred check's note of the backward line).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import Case, all_cases

import nan_magic
from nan_magic import NonFiniteError


def _named(name: str) -> Case:
    return next(case for case in all_cases() if case.name == name)


def _report(case: Case, options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    return caught.value.report


@pytest.mark.parametrize("name", [
    "defer_s32_nan_gradient_of_a_branch_weighted_0_in_the_loss",
    "hunt17_normalize_in_float32_gradient_cast_to_float16",
    "hunt21_ema_teacher_of_a_student_whose_backward_went_nan",
    "hunt23_attention_soft_cap_disabled_by_0_backward",
])
def test_ops_deferred_names_the_boundary_and_its_counts_as_ops_does(name: str) -> None:
    now, late = _report(_named(name), {"ops": True}), _report(_named(name), {"ops": True, "defer": True})
    assert str(now.tensor).startswith("grad of"), now.message
    seen = [(str(r.tensor), dict(r.counts), r.op, r.module, r.step, r.source and r.source.lineno) for r in (now, late)]
    assert seen[1] == seen[0]


@pytest.mark.parametrize("name", ["grad_scaler_collapse_inside_the_model",
                                  "variant_grad_scaler_collapse_with_unscale_and_clipping"])
@pytest.mark.parametrize("ops", [pytest.param(False, id="default"), pytest.param(True, id="ops")])
def test_a_collapsed_grad_scaler_opens_debug_at_the_scaler_step_deferred_too(name: str, ops: bool) -> None:
    case = _named(name)
    base = {"ops": True} if ops else {}
    now, late = _report(case, base), _report(case, {**base, "defer": True})
    assert now.cause is not None and now.cause.label == "grad-scaler-collapse", now.message
    where = [(os.path.basename(r.debug_frame.filename), r.debug_frame.lineno) for r in (now, late)]
    assert where[0][0] == "scaler_collapse.py" and where[1] == where[0]
