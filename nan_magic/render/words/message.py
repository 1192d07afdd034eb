"""The one-line summary of a Report: the exception's message, the first line of every view.

Stdlib only: ``Report.message`` calls it, in the hook that raises.
"""

from __future__ import annotations

from nan_magic.locations import name_location
from nan_magic.records import EventRef, Phase, Report, TensorRef, module_label

__all__ = ["UNCOUNTED", "count_words", "first_event", "message_parts", "uncounted"]


def message_parts(report: Report) -> tuple[str, str, str, str]:
    """``first non-finite value in forward step 3: encoder.1 (Linear), op aten.div.Tensor at model.py:12 (...)``.

    In four parts that join into the message: what and where (up to ``(Linear)``), the separator,
    the op and its line (``op aten.div.Tensor at model.py:12``, or ``""``), the counts.
    """
    kinds = count_words(report)
    at = f"op {report.op}" if report.op else ""
    if report.source is not None:
        at += f"{' ' if at else ''}at {name_location(report.source.filename, report.source.lineno)}"
    separator = ", " if report.op else " " if at else ""
    verb = "benign non-finite" if report.benign else "first non-finite" if report.follows is None else "non-finite"
    # The op's own output needs no second naming: "op aten.div.Tensor" follows.
    tensor = "value" if report.op and report.tensor == TensorRef.op_output(report.op) else str(report.tensor)
    if report.unlocated:  # no check saw the value: neither which tensor it was nor its counts are known
        return f"{verb} value in {report.phase} step {report.step}: {report.where}", "", "", ""
    after = "" if report.follows is None else f", after the first event ({first_event(report.follows, report)})"
    if uncounted(report):
        # The probe kept which kinds the tensor held, not how many: the kinds, among how many values, and why.
        return (f"{verb} {tensor} in {report.phase} step {report.step}: {report.where}", separator, at,
                f" ({kinds} among {report.numel} values, {UNCOUNTED}){after}")
    elif report.op and report.phase == Phase.BACKWARD:
        # Which tensor the counts are of: a backward op's own output (the per-module and deferred op-level watch
        # replay or keep it) or the module's gradient it went into (ops=True), whose counts may differ.
        whose = " in the op's output" if tensor == "value" else f" in {report.tensor}"
    else:
        whose = ""
    return (f"{verb} {tensor} in {report.phase} step {report.step}: {report.where}", separator, at,
            f" ({kinds} of {report.numel}{whose}){after}")


#: Why a report has no counts: a deferred check keeps of a tensor it no longer holds its probe (min, max), which says
#: which kinds of non-finite value it held, not how many.
UNCOUNTED = "not counted: the tensor was freed before the report was made"


def uncounted(report: Report) -> bool:
    """Whether the tensor's counts were never read (the deferred check's gradient, freed by then)."""
    stats = report.output_stats
    return stats is not None and None in (stats.nan, stats.posinf, stats.neginf)


def count_words(report: Report) -> str:
    """``"1 nan, 2 +inf"``; ``"nan"`` for a kind present but not counted; ``"non-finite values"`` if none known."""
    stats = report.output_stats
    counts = ((stats.nan, "nan"), (stats.posinf, "+inf"), (stats.neginf, "-inf")) if uncounted(report) and stats \
        else ((count, kind) for kind, count in report.counts.items())
    # (A "?" in place of a number read as a name or count gone missing: a kind not counted is named alone.)
    return ", ".join(kind if count is None else f"{count} {kind}" for count, kind in counts if count != 0) \
        or "non-finite values"


def first_event(first: EventRef, report: Report) -> str:
    """``forward step 0: encoder.1 (Linear), op aten.log.default``: where the event ``report`` follows was found."""
    # The same watch found both: its count of models says whether the first one's model needs naming.
    where = module_label(first.module, first.module_type, first.model if report.models_watched > 1 else None)
    return f"{first.phase} step {first.step}: {where}" + (f", op {first.op}" if first.op else "")
