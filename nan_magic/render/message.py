"""The one-line summary of a Report: the exception's message, the first line of every view.

Stdlib only: ``Report.message`` calls it, in the hook that raises.
"""

from __future__ import annotations

from nan_magic.locations import name_location
from nan_magic.records import Report, TensorRef

__all__ = ["report_message"]


def report_message(report: Report) -> str:
    """``first non-finite value in forward step 3: encoder.1 (Linear), op aten.div.Tensor at model.py:12 (...)``."""
    kinds = ", ".join(f"{count} {kind}" for kind, count in report.counts.items() if count) or "non-finite values"
    where = report.where
    if report.op:
        where += f", op {report.op}"
    if report.source is not None:
        where += f" at {name_location(report.source.filename, report.source.lineno)}"
    verb = "benign non-finite" if report.benign else "non-finite" if report.follows else "first non-finite"
    # The op's own output needs no second naming: "op aten.div.Tensor" follows.
    tensor = "value" if report.op and report.tensor == TensorRef.op_output(report.op) else str(report.tensor)
    after = ", after the first event" if report.follows else ""
    return f"{verb} {tensor} in {report.phase} step {report.step}: {where} ({kinds} of {report.numel}){after}"
