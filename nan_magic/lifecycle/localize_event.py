"""Which replay localizes an event, and its fixes' trials: the watch's ``localize`` callable (events.py).

Out of lifecycle/watch.py (at its 500 lines), with one route added: a running statistic read non-finite at the
optimizer step (hot/checks/running_stats.py: a finding with no call) is localized by the step's top-level calls run
again from their buffers as they were (replay/buffer_writes.py). The tiered watch's step replay does it; a per-call
(``mode="full"``) or traced (``ops=True``) watch keeps the same calls for its fix trials (localize/modes.py
``kept``) and now names the buffer's op from them too, its hooks and dispatch modes standing aside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nan_magic.fixes.runner import KeptStep, LossSource, untried, with_fixes
from nan_magic.hot.kept.finding import Finding
from nan_magic.localize.replay.buffer_writes import buffer_written
from nan_magic.records import Phase, Report, TensorRole

if TYPE_CHECKING:
    from nan_magic.lifecycle.events import Replayed
    from nan_magic.lifecycle.watch import Watch

__all__ = ["localize_event"]


def localize_event(watch: Watch, finding: Finding, seen: Report) -> Replayed | None:
    """An event's replay (a bad batch's samples fetched again, else the tiered step replay, else a buffer's writer
    found on the kept calls); its fixes' trials."""
    replays, replayed = watch.localizing.replays, None
    if replays is not None:
        replays.replayed = None
    if finding.phase == Phase.DATA and finding.op is None:
        replayed = watch.samples.localize(finding, seen, watch._build_report)  # None: no DataLoader gave it
    if replayed is None and replays is not None:
        replayed = replays.localize(finding, seen)
    loss = LossSource(watch.outside, watch.gradients.loss_key, watch.optimizers.scalers, watch.timing.deferred)
    kept = KeptStep.of(watch.localizing, finding.call, loss, watch.call_replay.standing_aside)  # fixes/kept.py
    if replays is None and kept.replays is not None and finding.tensor.role is TensorRole.BUFFER and (
            finding.call is None):
        # (kept.aside: the op tracer and the recorder do not see the replay's ops, as in a fix trial)
        replayed = buffer_written(kept.replays.calls, finding, seen, kept.aside), (finding.frame, None)
    if replays is None and watch.config.fixes and watch.outcome.report is None and watch.replay_of is None:
        return untried(seen, replayed, finding.frame, kept, watch.optimizers.seen, watch._roots(), watch.last_good)
    if replayed is None or replays is None:
        return replayed
    report, producer = replayed
    if not watch.config.fixes or report.benign or watch.outcome.report is not None:
        return replayed  # trials for the first real event only (warn/log mode goes on after it)
    return with_fixes(report, replays, watch.optimizers.seen, watch._roots(), watch.last_good,
                      watch.call_replay.standing_aside, loss), producer
