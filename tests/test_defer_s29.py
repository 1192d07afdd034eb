"""The deferred watch (CUDA's default) names what the immediate one names on a GPU loop's shapes (defer-s29).

tests/contract/defer_s29.py holds the rows (phase, module, step, op, line in every mode); here each incident row's
whole report is compared, deferred against immediate, as scripts/defer_diff.py does: cause, whether the replay
reproduced it, the fixes tried and verified, the histograms, the tensor named and where %debug opens.

Fixed in this round:

- a batch buffer the loop refilled in place before ``opt.step()`` (a prefetch into a CUDA graph's static input, the
  next micro-batch copied into it): the deferred step replay ran the model on the buffer as the check found it,
  finite, and named the model's output, no op, no line, no fix; it starts from the copy the update region took
  before the user's write now (StepReplays._inputs_as_read; contract rows defer28 and defer_s29_static_buffer_*);
- two optimizers stepping at different cadences (the head's every step, the body's every 2nd): every other step
  was reported one step early, in both timings (optimizer/iterations.py: a member an iteration closed without is
  dropped, not waited for again);
- a NaN batch a DataLoader gave, judged at the deferred check and localized by fetching its samples again: %debug
  opened at ``opt.step()``, not at the loop's model call (lifecycle/watch_events.py: the model's caller is taken
  whichever localizer ran).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import Case, all_cases, defer_s29
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.hot.checks.optimizer.iterations import Iterations

_INCIDENTS = {case.name: case for case in defer_s29.CASES if case.expect is not None}


def _summary(case: Case, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    report = caught.value.report

    def where(pointer: Any) -> Any:
        return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)
    return {
        "module": report.module, "phase": report.phase, "step": report.step, "op": report.op,
        "source": where(report.source), "cause": None if report.cause is None else report.cause.label,
        "reproduced": report.reproduced, "tensor": str(report.tensor), "histograms": bool(report.samples),
        "fixes": [(fix.kind, fix.finite) for fix in report.fixes], "debug_frame": where(report.debug_frame),
    }


def _differing(name: str, **options: Any) -> dict[str, tuple[Any, Any]]:
    now, late = _summary(_INCIDENTS[name], **options), _summary(_INCIDENTS[name], **options, defer=True)
    assert now["op"] is not None and now["source"] is not None, now  # (the row localizes, immediate)
    return {key: (now[key], late[key]) for key in now if now[key] != late[key]}


@pytest.mark.parametrize("name", sorted(_INCIDENTS))
def test_the_deferred_report_is_the_immediate_one(name: str) -> None:
    assert _differing(name) == {}


_OPS_FIXES = ("ops=True, defer=True: the fix trials replay the failing micro-batch's call from its argument, the "
              "static buffer the loop has refilled with the 8th micro-batch by the check (ops mode keeps no update "
              "region's copies: its tracer judged every op as it ran), so no fix is tried; ops=True tries them at once")


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=_OPS_FIXES)) if "static_buffer" in name else name
    for name in sorted(_INCIDENTS)])
def test_the_traced_deferred_report_is_the_traced_one(name: str) -> None:
    assert _differing(name, ops=True) == {}


def _completed_at_each_forward(sequence: str, passed: str) -> list[int]:
    """The iterations completed as each iteration's forward starts; ``sequence`` is each iteration's steps, by name."""
    torch.manual_seed(0)
    optimizers = {name: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1) for name in "HB"}
    iterations, seen = Iterations(optimizers[name] for name in passed), []
    for steps in sequence.split():
        seen.append(iterations.completed)
        for name in steps:
            iterations.stepped(optimizers[name])
    return seen


def test_an_optimizer_stepping_every_second_iteration_does_not_hold_the_count_back() -> None:
    """The head's optimizer steps every iteration, the body's every 2nd: after the first iteration the body missed
    (when nothing yet says it steps less often), every iteration's forward is its own step, not every other one a
    step early (it was 0 0 2 2 4 5 6, and 3 4 4 5 with the body stepping first)."""
    assert _completed_at_each_forward("H HB H HB H HB H", passed="HB") == [0, 0, 2, 3, 4, 5, 6]
    assert _completed_at_each_forward("H BH H BH H BH H", passed="HB")[3:] == [3, 4, 5, 6]


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True},
                                     {"ops": True, "defer": True}],
                         ids=["default", "defer", "full", "ops", "ops-defer"])
def test_the_step_goes_on_when_the_optimizers_take_turns(options: dict[str, Any]) -> None:
    # (review of defer-s29: a rule that dropped a member an iteration closed without froze the count at 3 for the
    # rest of the run where the head trained alone for two iterations, then the body alone: "data, step 3")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    body, head = (torch.optim.SGD(model[n].parameters(), lr=0.01) for n in (0, 2))
    turns = [(head, body), (head,), (head,), *[(body,)] * 11]
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, head, body, **options):
        for iteration, stepping in enumerate(turns):
            x = torch.randn(8, 4)
            if iteration == 12:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            head.zero_grad()
            body.zero_grad()
            loss.backward()
            for opt in stepping:
                opt.step()
    assert (caught.value.report.phase, caught.value.report.step) == ("data", 12)


def _debug_frame(case: Case, **options: Any) -> tuple[str, int] | None:
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    frame = caught.value.report.debug_frame
    return None if frame is None else (os.path.basename(frame.filename), frame.lineno)


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("name", [
    "hunt_s28c_memmap_numpy_record_holding_a_nan",
    "hunt_s28c_iterable_dataset_sharded_over_two_workers_log_of_a_count_of_0",
])
def test_a_batch_refetched_from_its_loader_opens_at_the_model_call_deferred(name: str, traced: bool) -> None:
    """A NaN batch from a DataLoader, judged at the deferred check (``opt.step()``) and localized by fetching its
    samples again: %debug opened at ``opt.step()``; it opens at the loop's model call, as the immediate check's does
    (the model's caller was taken only where the step replay, not the samples' refetch, localized it)."""
    case = next(case for case in all_cases() if case.name == name)
    now = _debug_frame(case, ops=traced)
    assert now is not None and _debug_frame(case, ops=traced, defer=True) == now


@pytest.mark.parametrize("name", [
    "gaps20_keras_max_norm_through_data_of_a_zero_row",
    "hunt17_max_norm_in_place_in_the_forward_of_a_zero_row",
    "hunt17_actnorm_data_dependent_init_of_a_constant_channel",
])
def test_a_forward_that_writes_its_parameter_is_reported_as_its_op_traced_and_deferred(name: str) -> None:
    """A max-norm renorm (``w.div_(norm)``) or an ActNorm's data-dependent init written in place in the forward:
    ``ops=True`` stops at the op and describes its output ('output of aten.div_.Tensor'); judged at the deferred check
    (loop_writes.LoopWrites._report_traced) the report described the parameter ('parameter 0.weight'), with the
    op's name beside it. It describes the op's output, as at the op."""
    case = next(case for case in all_cases() if case.name == name)

    def said(**options: Any) -> tuple[str, str]:
        torch.manual_seed(0)
        scenario = case.build()
        with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options,
                                                                     **scenario.options):
            scenario.run()
        return str(caught.value.report.tensor), caught.value.report.message
    now = said(ops=True)
    assert now[0].startswith("output of aten.") and said(ops=True, defer=True) == now
