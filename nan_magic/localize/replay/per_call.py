"""A per-module watch's event that its module replay cannot vouch for, named by a replay of the step's call instead.

``mode="full"`` replays the producer's module call alone (replay/producer_call.py), from its arguments as they are
when the event is judged. Two events it cannot name right: a forward whose call wrote its own parameters or buffers
in place (a max-norm renorm, Glow's ActNorm init: the module's replay starts from what the write left, a parameter
already NaN, an init skipped), and a backward, which it replays from a gradient of ones into the module's outputs
(the real gradient is not kept per module: another op may make a value first, a masked 0 / 0 before the real
gradient's overflow, or none). The watch keeps the step's top-level calls for the fix trials (modes.py): their copies
from before the call and the real gradients into the model's outputs, which the tiered watch's step replay runs from
(replay/tiered/step.py). Cold: at an event only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from nan_magic.locations import SourcePointer
from nan_magic.records import Phase, Report

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nan_magic.hot.kept.finding import Finding
    from nan_magic.localize.replay.tiered.step import Producer, StepReplays

__all__ = ["replayed_from_the_step"]


def replayed_from_the_step(kept: StepReplays, finding: Finding, seen: Report) -> tuple[Report, Producer] | None:
    """The step replay's report of ``finding`` where it names an op the module's replay did not; else None."""
    top = finding.call
    while top is not None and top.parent is not None:
        top = top.parent
    if top is None and finding.in_graph_grad:
        # The loop's own ``autograd.grad(create_graph=True)`` ran the formula (a PINN's derivative by its input, through
        # sqrt at 0), recorded at the grad's line: the step replay runs the model calls' backward from the gradients
        # grad sent into their outputs, as the tiered watch does, and names the formula's op and forward line.
        report, producer = kept.localize(finding, seen)
        return (report, producer) if report.phase == Phase.BACKWARD and report.op is not None else None
    if top is None and not (finding.phase == Phase.BACKWARD and finding.op is None):
        # (A parameter's gradient judged at the optimizer step has no call: the model calls' backward is replayed
        # from the real gradients into their outputs where no module replay named an op, as the tiered watch does.)
        return None
    if top is not None and top.info is None:
        return None
    if finding.phase == Phase.FORWARD:
        if finding.op is not None or not any(root.call is top and root.wrote_its_state() for root in kept.calls):
            return None
    elif finding.phase != Phase.BACKWARD or not any(root.output_grads for root in kept.calls):
        return None
    probe = dataclasses.replace(finding, op=None)  # (the step replay names a backward op only where none is named)
    report, producer = kept.localize(probe, seen)
    if not report.reproduced or report.op is None or (report.op, report.module, _line(report.source)) == (
            finding.op, finding.module, _line(finding.source)):
        return None
    finding.frame_calls = probe.frame_calls
    return report, producer


def _line(source: SourcePointer | None) -> tuple[str, int] | None:
    """Where ``source`` points: the same op of the same module at another line is another producer (a masked
    0 / 0 in a norm's backward, found from ones, before a custom Function's division by the real gradient)."""
    return None if source is None else (source.filename, source.lineno)
