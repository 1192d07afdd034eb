"""The deferred watch (what a GPU runs) names what the immediate one names: round 32.

- Every incident row of tests/contract/defer_s32.py: the deferred report names the module, op, line, phase, step
  and cause the immediate one names, and ``%debug`` opens at the same line (ops=True likewise with defer=True).
- A NaN reading in a jagged nested-tensor batch that the model's own code passes to its head (no op names it): the
  immediate watch raises in the forward and ``%debug`` opens there; the deferred one opened at the loop's model call
  (that forward had returned by the step's check). It now opens the replay's forward at the same line, and says so.
- ``%nanwatch on model`` with the model on a GPU defers its checks (hot/timing.py chooses, the user asked nothing):
  its confirmation line said nothing of it, so a GPU user did not know the report comes at the step's check. The
  device is faked at the one place each path reads it (``timing_for``'s parameters' device; the namespace's
  ``models_on_a_device`` for ``%nanwatch on`` with no target).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from contract import Case, all_cases, defer_s32
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.hot import timing
from nan_magic.ipython import magics


def _line(pointer: Any) -> tuple[str, int] | None:
    return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)


def _seen(case: Case, options: dict[str, Any]) -> dict[str, Any]:
    """What a user reads off the row's report: where, what, why, and where %debug opens."""
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    report = caught.value.report
    return {"module": report.module, "op": report.op, "source": _line(report.source), "phase": report.phase,
            "step": report.step, "cause": None if report.cause is None else report.cause.label,
            "debug": _line(report.debug_frame)}


INCIDENTS = [pytest.param(case, id=case.name, marks=case.marks) for case in defer_s32.CASES
             if case.expect is not None]


@pytest.mark.parametrize("case", INCIDENTS)
@pytest.mark.parametrize("ops", [pytest.param(False, id="default"), pytest.param(True, id="ops")])
def test_deferred_report_and_debug_line_are_the_immediate_ones(case: Case, ops: bool) -> None:
    base = {"ops": True} if ops else {}
    now, late = _seen(case, base), _seen(case, {**base, "defer": True})
    assert now["op"] is not None and now["source"] is not None and now["debug"] is not None, now
    assert late == now


# ---------------------------------------------------------------- a value no op names: %debug in the forward
def test_a_submodules_input_no_op_names_opens_debug_in_the_forward_as_immediate() -> None:
    case = next(case for case in all_cases() if case.name == "hunt_s30_nan_in_a_jagged_nested_tensor_batch")
    now, late = _seen(case, {}), _seen(case, {"defer": True})
    assert now["op"] is None and now["debug"] is not None and now["debug"][0] == "hunt_s30.py", now
    assert late == now
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, defer=True):
        scenario.run()
    assert f"opens a replay of step 1's model call, at line {now['debug'][1]}" in caught.value.report.to_text()


# ---------------------------------------------------------------- %nanwatch on a GPU model says it defers

@pytest.fixture
def gpu_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model reads as living on a GPU where the watch chooses its timing."""
    chosen = timing.timing_for

    def on_a_gpu(config: Any, roots: Any) -> Any:
        return chosen(config, roots) if config.defer is not None else timing.Deferred()

    monkeypatch.setattr("nan_magic.lifecycle.watch.timing_for", on_a_gpu)
    monkeypatch.setattr(magics, "models_on_a_device", lambda namespace: True)


@pytest.mark.parametrize(("line", "said"), [
    ("on model", "nan_magic: watching every cell (model; deferred: checked once a step, as a model is on a GPU) "
                 "until %nanwatch off"),
    ("on", "nan_magic: watching every cell (every module called; deferred: checked once a step, as a model is on "
           "a GPU) until %nanwatch off"),
    ("on model --defer", "nan_magic: watching every cell (model; deferred: checked once a step) until %nanwatch off"),
])
def test_nanwatch_on_a_gpu_model_says_it_defers(ip, gpu_models: None, line: str, said: str) -> None:
    from IPython.utils.capture import capture_output

    ip.user_ns["model"] = nn.Linear(2, 2)
    try:
        with capture_output() as captured:
            ip.run_line_magic("nanwatch", line)
        assert captured.stdout.strip() == said
    finally:
        with capture_output():
            ip.run_line_magic("nanwatch", "off")
        ip.user_ns.pop("model", None)


def test_nanwatch_on_a_cpu_model_says_nothing_of_defer(ip) -> None:
    from IPython.utils.capture import capture_output

    ip.user_ns["model"] = nn.Linear(2, 2)
    try:
        with capture_output() as captured:
            ip.run_line_magic("nanwatch", "on model")
        assert captured.stdout.strip() == "nan_magic: watching every cell (model) until %nanwatch off"
    finally:
        with capture_output():
            ip.run_line_magic("nanwatch", "off")
        ip.user_ns.pop("model", None)
