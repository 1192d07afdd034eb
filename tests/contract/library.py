"""The fault library of tests/faults.py, as rows of the contract table."""

from __future__ import annotations

import faults
from faults import FORWARD_FAULTS, Fault

from contract import Case, Expect, Scenario
from nan_magic.records import TensorRef


def _scenario(fault: Fault) -> Scenario:
    model, run = fault.build()
    return Scenario((model,), run)


def _case(fault: Fault) -> Case:
    expect = Expect(
        fault.phase, fault.module, fault.module_type, op=fault.op, marker=fault.marker,
        # Where no op is named (a parameter already non-finite, the data) the module's tensor is the report's.
        tensor=fault.tensor if fault.op is None else TensorRef.op_output(fault.op),
    )
    return Case(f"library_{fault.name}", lambda: _scenario(fault), expect, source=faults)


CASES = [_case(fault) for fault in FORWARD_FAULTS]
