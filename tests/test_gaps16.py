"""The gaps16 fixes where the contract table does not reach: a watch given the model only (no optimizer).

The contract table passes each case's optimizer to the watch. A script's ``watch(model)`` sees the optimizer only as
it steps: the loss code's records must still be held until that step's check, where a parameter's gradient that no
output gradient explains is looked for in the loss code's backward (a gradient penalty, a penalty on the weights),
then in the update code's records.
"""

from __future__ import annotations

import os

import pytest
from contract import all_cases, source_line

import nan_magic

CASES = {case.name: case for case in all_cases()}


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("name", ["hunt15_gradient_penalty_sqrt_of_a_zero_gradient",
                                  "gaps16_group_lasso_of_a_pruned_weight",
                                  "opsgaps15_second_loss_through_a_retained_graph",
                                  "opsgaps15_update_code_normalises_gradients",
                                  "gaps16_r1_penalty_of_a_log_sigmoid"])
def test_named_with_the_model_alone_watched(name: str, defer: bool) -> None:
    case = CASES[name]
    scenario = case.build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(scenario.targets[0], defer=defer):
        scenario.run()
    report, expect = caught.value.report, case.expect
    assert expect is not None and expect.marker is not None
    assert (report.phase, report.module, report.step, report.op) == (expect.phase, expect.module, expect.step,
                                                                      expect.op)
    filename, line = source_line(case, expect.marker)
    assert report.source is not None
    assert (os.path.basename(report.source.filename), report.source.lineno) == (os.path.basename(filename), line)

