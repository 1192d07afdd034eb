"""A watch's events: from a finding to the report, the event list, the log file and the stop.

:class:`Events` is the watch's outcome (``report``, ``events``, ``raised``)
and the one way into it, :meth:`Events.emit`. It gets a narrow context from
the watch: callables that build a finding's report, localize it by a replay
and save its scene, and whether the ranks step together (agreement.py).
It decides how the run stops: raise now (alone, or with the other ranks at
an agreement point), hold the event for the next point, or warn; and, as the
watch is left by an exception, whether a non-finite value made before it
explains it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

import torch

from nan_magic.distributed.agreement import Agreement
from nan_magic.distributed.ranks import per_rank_path, stamp
from nan_magic.errors.exceptions import NanMagicWarning, NonFiniteError, PeerNonFiniteError
from nan_magic.errors.frames import (
    end_at_producer,
    frames_of,
    line_start,
    pointer_at,
    running_frame_at,
    running_frame_of,
    user_frames_of,
)
from nan_magic.errors.warning_lines import heard_in_the_step, warn_at_user, watch_warning
from nan_magic.explain.handled import handled_again, handled_input
from nan_magic.hot.kept.finding import Finding
from nan_magic.hot.kept.held_batch import HeldBatch
from nan_magic.hot.reads import is_checkable
from nan_magic.hot.stats import tensor_stats
from nan_magic.options import WatchConfig
from nan_magic.patches.loads import loaded_nonfinite
from nan_magic.phases import Phase
from nan_magic.plain import to_pairs
from nan_magic.records import EarlyWarning, Note, Report, TensorRole

if TYPE_CHECKING:  # pragma: no cover
    from nan_magic.localize.replay.tiered.step import Producer

__all__ = ["EventContext", "Events"]

#: A replay's report and the producer's (frame, position) it found.
Replayed = tuple[Report, "Producer"]


@dataclasses.dataclass
class EventContext:
    """What :class:`Events` needs of its watch, as callables (the watch wires them)."""

    #: The finding's report as the step's boundary saw it (rank stamped).
    build: Callable[[Finding], Report]
    #: The tiered watch's replay of the failing step, or None where it has none or it found nothing.
    localize: Callable[[Finding, Report], Replayed | None]
    #: Save the crash scene and arm the roll-back at the first real event; the report, noted.
    record_scene: Callable[[Finding, Report], Report]
    #: Whether the op tracer (``ops=True``) has already reported this step's producer at its op.
    traced: Callable[[], bool]
    #: Whether the ranks step together: an event found between agreement points waits for the next.
    lockstep: Callable[[], bool]
    #: Floating tensors the watch could not read, by reason (every report carries the counts).
    skipped: Counter[str]
    #: The norm layers' running statistics the step has already made non-finite (explain/norm_stats.py).
    nonfinite_stats: Callable[[], tuple[str, ...]] = tuple
    #: Keep the state copied right after the last step whose deferred check is still to come, where it is finite
    #: (scene/last_good.py): before the trials and the roll-back read it.
    settle_last_good: Callable[[], None] = lambda: None


class Events:
    """The outcome of one entry of a watch, and how it stops the run (see the module docstring)."""

    def __init__(self, config: WatchConfig, context: EventContext, held: HeldBatch, *, alone: bool) -> None:
        self.config = config
        self.context = context
        #: The step's non-finite batch, held until the step shows whether the program handled it (held_batch.py).
        self.held = held
        # The first handled batch's event, where it is in :attr:`events`, and how many steps' batches it stands for.
        self._handled: tuple[int, int] | None = None
        #: Every event, benign ones included, in order (at most ``max_events``).
        self.events: list[Report] = []
        #: The Report of the first non-benign event, or None.
        self.report: Report | None = None
        #: The NonFiniteError raised, once it has been (the magics adopt its traceback after IPython showed it).
        self.raised: NonFiniteError | None = None
        #: The frame that ran the first real event's producing op, where a replay named it (for %debug),
        #: and its ``(f_lasti, f_lineno)`` then.
        self.producer_frame: FrameType | None = None
        self.producer_position: tuple[int, int] | None = None
        #: How the producer's frame was reached where the traceback lacks it (Finding.frame_calls).
        self.producer_calls: tuple[tuple[FrameType, int, int], ...] = ()
        #: The watch is being left by an exception: an event found now raises at once, from it.
        self.leaving = False
        # A forward that raised after a non-finite value: what the watch raises on exit (hold_explained).
        self._explained: tuple[Finding, Replayed, BaseException] | None = None
        #: This watch's part in every rank stopping together (a replay's watch runs on one rank alone).
        self.agreement = Agreement(alone=alone)
        # warn: the events warned of that no op made (a value already non-finite, met again at a boundary), by what
        # they name but the step; and the steps of those not warned again since (said as the watch is left).
        self._warned_kinds: set[tuple[object, ...]] = set()
        self._repeated_steps: list[int] = []
        # The places (phase, module, tensor) a deliberate infinity was recorded at: one benign event each per watch,
        # as the op tracer and the mask rule record it (ops/masks.py), not one a step where the tiered watch replays it.
        self._deliberate_seen: set[tuple[object, ...]] = set()

    # -- the one way in -------------------------------------------------------------------

    def emit(self, finding: Finding, replayed: Replayed | None = None) -> None:
        """Record an event; raise or warn for the first non-benign one as configured.

        In the tiered mode a real forward or backward event is first
        localized by a replay of its step (localize/replay/tiered/step.py); ``replayed`` is
        a replay's report and producer (frame, position) already made.
        """
        if self.agreement.holding:
            return  # this rank's first event waits for the next agreement point (agreement.py)
        if not finding.benign and finding.op is None and self.context.traced() and finding is not self.held.released:
            return  # the op tracer already reported this step's producer, at its op (not a held batch's)
        if not finding.benign and self.report is None:
            self.context.settle_last_good()
        _name_the_load(finding)
        if replayed is None:
            report = self.context.build(finding)
            if not finding.benign:
                # (torch's anomaly mode off: the user may run under it, and a replay's backward would raise)
                with torch.autograd.set_detect_anomaly(False):
                    replayed = self._localized(finding, report)
        position = None
        if replayed is not None:
            report, (finding.frame, position) = stamp(replayed[0]), replayed[1]
            if report.benign and finding.record is not None:
                # The replay found a deliberate infinity (a -inf fill): so says the step's record, which the loss
                # code's replay reads (RegionRecords.benign_input), not the producer the first build marked it.
                finding.record.status = "benign"
        if not report.benign and self.held.finding is not None:
            # A value of the step went non-finite (its replay found no deliberate infinity) after a non-finite batch
            # entered: the batch is the event, as it was where it entered (held_batch.py); warn/log: this follows.
            self.held.release()
        if self.context.skipped:
            report = dataclasses.replace(report, skipped=tuple(sorted(self.context.skipped.items())))
        if (nth := _model_call(finding)) is not None:
            report = dataclasses.replace(report, model_call=nth)
        if report.benign and any(note.kind == "deliberate" for note in report.note_facts):
            place = (report.phase, report.module, report.tensor)
            if place in self._deliberate_seen:
                return
            self._deliberate_seen.add(place)
        if not report.benign and self.report is not None:
            # The run went on after the first event (warn, log): a check that meets the same producer again
            # (the optimizer's gradient check replaying the step the forward check reported) adds nothing.
            if any(_same_event(report, earlier) for earlier in self.events):
                return
            report = dataclasses.replace(report, follows=self.report.ref)
        if not report.benign and self.report is None:
            if stats := self.context.nonfinite_stats():  # (the user's model as the step left it: said, not mended)
                report = dataclasses.replace(report, note_facts=(*report.note_facts,
                                                                 Note.of("norm-stats-nonfinite", buffers=stats)))
            # The first real event: save the scene / arm the roll-back (scene.py).
            report = self.context.record_scene(finding, report)
            self.report = report
            if finding.frame is None and report.phase in _LINE_STILL_RUNS and report.source is not None:
                # Data named by the line that read it (a NaN label at ``loss = mse(out, y)``), judged lines later
                # (``loss.backward()``): %debug opens at the report's line where that frame still runs. So does a
                # backward producer made by the loss code (``loss = gap.sqrt()`` in the loop, outside every module):
                # no replay re-runs that code, but the loop's frame that ran the line is the one calling backward.
                finding.frame, finding.frame_position = running_frame_at(report.source) or (None, None)
            if finding.frame is None and report.phase in _LINE_STILL_RUNS and finding.backward_caller is not None:
                # A gradient judged at the deferred check, no replay naming a frame: %debug opens where the loop
                # called backward, as where it is judged at once, not at ``opt.step()`` (nor, accumulating, at the
                # next micro-batch's model call) where the check ran.
                found = running_frame_of(*finding.backward_caller)
                if found is not None and report.source is not None and (
                        start := line_start(found[0].f_code, report.source)) is not None:
                    # The loss code's line that made it (``distance = squared.sqrt()``) in the frame that called
                    # backward, where the loop may since have gone back to the next micro-batch (running_frame_at
                    # then finds it short of that line): %debug opens at that line, as where it is judged at once.
                    found = found[0], (start, report.source.lineno)
                finding.frame, finding.frame_position = found or (None, None)
            if (caller := finding.model_caller) is not None and (finding.frame is None or (
                    id(finding.frame) == caller[1] and (report.source is None or report.source.lineno == caller[3]))):
                # A model call's output or batch judged at the deferred check: %debug opens at the loop's line that
                # called the model, as where it is judged as the call returns, where that very frame still runs
                # (the check found it at ``opt.step()``: a batch no line names, a replay of a model all torch's code,
                # whose ops' user frame is the loop's, hold it there).
                found = running_frame_of(caller[0], caller[2], caller[3])
                if found is not None and id(found[0]) == caller[1]:
                    (finding.frame, finding.frame_position), position = found, None
            self.producer_frame, self.producer_calls = finding.frame, finding.frame_calls
            if finding.frame is not None:
                # Where the op ran: the frame of a replay that went on to its end has moved since.
                self.producer_position = (
                    position or finding.frame_position or (finding.frame.f_lasti, finding.frame.f_lineno)
                )
        if len(self.events) < self.config.max_events:
            self.events.append(report)
        if self.config.log_file:
            self._append_log(report)
        if report.benign or (self.config.on_detect == "warn" and self._repeated(report)):
            return
        # warn: a warnings filter that makes the warning an error (``-W error``, pytest's ``filterwarnings = error``)
        # stops the run as raise does, with the report, not with a bare RuntimeWarning from inside our hook.
        if self.config.on_detect == "raise" or (self.config.on_detect == "warn" and not _warned(report.message)):
            own = NonFiniteError(report, producer_frame=finding.frame, producer_position=self.producer_position,
                                 producer_calls=finding.frame_calls)
            if not self.leaving and self.agreement.hold(own, finding, self.context.lockstep):
                return  # between agreement points: this rank checks nothing more, stops with the others at the next
            self.raise_agreed(self.agreement.settle(own, finding))

    def _repeated(self, report: Report) -> bool:
        """warn: whether ``report`` repeats an event already warned of, counted instead of warned.

        A NaN that reached the parameters is met again at every boundary of every later step (the parameter in the
        next forward, the loss, the optimizer's step): three warnings a step for the rest of the run. An event no
        op made (its value was already non-finite) is warned of once for what it names (phase, module, tensor,
        line), whatever the step; one an op made from finite values is new each time, and warned of.
        """
        if report.op is not None:
            return False
        kind = (report.phase, report.module, report.tensor, report.source)
        if kind not in self._warned_kinds:
            self._warned_kinds.add(kind)
            return False
        self._repeated_steps.append(report.step)
        return True

    def say_repeated(self) -> None:
        """warn: one warning, as the watch is left, for the events :meth:`_repeated` did not warn of again."""
        steps, self._repeated_steps = self._repeated_steps, []
        if not steps:
            return
        facts = (("events", len(steps)), ("first_step", min(steps)), ("last_step", max(steps)))
        message = EarlyWarning(step=max(steps), kind="repeated-events", facts=facts).message
        warn_at_user(NanMagicWarning(message))

    def absorb(self, inner: Events) -> None:
        """The events a nested watch recorded while it had taken over from this one are this watch's too.

        A script watched by ``python -m nan_magic run`` (or a test by the pytest marker) that enters its own watch
        over the same model: the outer watch's hooks were off meanwhile, and it said "no real non-finite event",
        exit 0, after the script's watch had raised or logged one. Recorded, not raised: the inner watch's
        ``on_detect`` already decided how the run went on.
        """
        room = max(0, self.config.max_events - len(self.events))
        self.events.extend(inner.events[:room])
        if self.report is None and inner.report is not None:
            self.report = inner.report

    def _localized(self, finding: Finding, report: Report) -> Replayed | None:
        """``context.localize``; where the user stops it, ``report`` as the boundary saw it, and a note.

        The replay that names the producer traces every op of a step: seconds on a large model, and the user may
        press stop then. Where the event stops the run anyway (``raise``), the interrupt ends the replay alone and
        the cell stops with what the step's check saw, saying the producer was not named, rather than with a bare
        KeyboardInterrupt and no report. Where the run goes on after the event (warn, log), it stops the run.
        """
        try:
            with heard_in_the_step():  # (the user's step run again: its warnings were said as it ran)
                return self.context.localize(finding, report)
        except KeyboardInterrupt:
            if self.config.on_detect != "raise":
                raise
            return dataclasses.replace(report, note_facts=(*report.note_facts, Note("replay-interrupted"))), (
                finding.frame, None)

    def handled(self, finding: Finding) -> None:
        """A held batch's step ended with everything else finite: the program handled it, a benign event.

        Not one event a step for a whole epoch of such batches: the first is recorded (and logged), and each
        later one counts in it (its cause's ``steps`` and ``last_step``), as the report in :attr:`events`.
        """
        step = finding.step if finding.step is not None else 0
        if self._handled is not None:
            index, steps = self._handled
            self._handled = index, steps + 1
            first = self.events[index] if index >= 0 else None  # (-1: the event list was full as the first came)
            if first is not None and first.cause is not None:
                self.events[index] = dataclasses.replace(first, cause=handled_again(first.cause, steps + 1, step))
            return
        finding.benign = True
        report = self.context.build(finding)
        report = dataclasses.replace(report, cause=handled_input(report, 1, step))
        if self.context.skipped:
            report = dataclasses.replace(report, skipped=tuple(sorted(self.context.skipped.items())))
        self._handled = (len(self.events) if len(self.events) < self.config.max_events else -1), 1
        if self._handled[0] >= 0:
            self.events.append(report)
        if self.config.log_file:
            self._append_log(report)

    def _append_log(self, report: Report) -> None:
        """One JSON line per event; a failing log (disk full) must not stop the user's run."""
        try:
            with open(per_rank_path(self.config.log_file), "a", encoding="utf-8") as handle:  # type: ignore[arg-type]
                handle.write(report.to_json() + "\n")
        except OSError as error:
            warnings.warn(f"nan_magic could not write the event log {self.config.log_file}: {error}",
                          NanMagicWarning, stacklevel=4)

    # -- stopping -----------------------------------------------------------------------------

    def raise_agreed(self, error: NonFiniteError | None) -> None:
        """Raise what the ranks agreed on: this rank's event, another rank's, or nothing."""
        agreed = self.agreed(error)
        if agreed is not None:
            raise agreed

    def agreed(self, error: NonFiniteError | None) -> NonFiniteError | None:
        """Note ``error`` as what the watch raises; another rank's report becomes the watch's report."""
        if error is None:
            return None
        if isinstance(error, PeerNonFiniteError):
            self.report = error.report
            if len(self.events) < self.config.max_events:
                self.events.append(error.report)
        self.raised = error
        return error

    @property
    def stopped(self) -> bool:
        """A real event was raised or is held: the watch's checks stand down."""
        return self.raised is not None or self.agreement.holding

    @contextlib.contextmanager
    def agreement_point(self, opened: bool) -> Iterator[None]:
        """Run a step's checks as an agreement point (``opened``: this rank takes part), then stop as agreed.

        Whatever the checks find is settled in the point's one collective;
        once settled, or failed in our own code, no later check takes part.
        """
        if opened:
            self.agreement.open()
        try:
            yield
            agreed = self.agreement.settle(None)
        finally:
            self.agreement.close()
        self.raise_agreed(agreed)

    def leave(self, together: bool) -> None:
        """The watch is left normally: raise what the ranks agree on at the exit (agreement.py)."""
        self.raise_agreed(self.agreement.leave(together))

    def left_by(self, exception: BaseException, together: bool, explainable: bool) -> NonFiniteError | None:
        """The watch is left by ``exception``: what to raise from it, where ``explainable`` (agreement.py)."""
        left = self.agreement.left_by(exception, together)
        return self.agreed(left) if explainable else None

    def check_peers(self) -> None:
        """After an inference step under a process group: stop if another rank posted an event (agreement.py)."""
        if self.agreement.several and not self.stopped and self.config.on_detect == "raise":
            self.raise_agreed(self.agreement.peer_stop())

    def hold_explained(self, finding: Finding, replayed: Replayed, error: BaseException) -> None:
        """A forward raised ``error`` after the non-finite value ``replayed`` found: the watch raises it on exit.

        torch silences an exception raised by a forward hook while another
        propagates, so in ``raise`` mode the event waits for the watch's
        exit (:meth:`explain`); ``warn``/``log`` record it now.
        """
        if self.config.on_detect == "raise":
            self._explained = (finding, replayed, error)
        else:
            self.emit(finding, replayed=replayed)

    def explain(self, exc: BaseException | None) -> NonFiniteError | None:
        """The NonFiniteError of a forward that raised ``exc`` after a non-finite value (:meth:`hold_explained`)."""
        explained, self._explained = self._explained, None
        if explained is None or exc is None or explained[2] is not exc:
            return None
        finding, replayed, _error = explained
        try:
            self.emit(finding, replayed=replayed)
        except NonFiniteError as stop:
            return stop
        return None

    def adopt_traceback(self, error: NonFiniteError, tb: TracebackType | None) -> None:
        """Cut ``tb`` after the user's frame and record that frame in the report.

        ``%debug`` and ``pdb.post_mortem`` open the last frame of a traceback;
        after this, that is the user's line nearest the producer (the line that
        called the producing module, ``loss.backward()`` or ``opt.step()``).
        Called as the watch is left, and by the magics where IPython catches
        the exception first.
        """
        holder = error if error.__traceback__ is tb else None
        last = end_at_producer(tb, error.producer_frame, error.producer_position, error.producer_calls, holder)
        if last is None:
            return
        if holder is not None:
            tb = error.__traceback__  # its first entry moved to the producer's line (or the call of its helper)
        frame = last.tb_frame
        # A cell's (a script's) top level: its locals are the whole namespace, every tensor of every earlier
        # cell; the ones its own code names are the ones to show.
        named = set(frame.f_code.co_names) if frame.f_locals is frame.f_globals else None
        tensor_locals = tuple(
            (name, tensor_stats(value))
            for name, value in frame.f_locals.items()
            if isinstance(value, torch.Tensor) and is_checkable(value) and (named is None or name in named)
        )
        report = dataclasses.replace(
            error.report, debug_frame=frames_of(last)[0], debug_locals=tensor_locals,
            frames=user_frames_of(tb, error.producer_calls)
        )
        error.report = report
        if self.report is not None and self.report is not report:
            self.report = report
        if self.events:
            self.events[-1] = report


#: The phases whose report's line may be in a frame still running when the event is judged (the loop's).
_LINE_STILL_RUNS = (Phase.DATA, Phase.BACKWARD)


def _warned(message: str) -> bool:
    """Warn of an event; False where the user's warnings filter raised the warning instead of showing it."""
    warning = watch_warning(message)
    try:
        # Named at the user's line (the cell's), not at the hook several frames below it.
        warn_at_user(warning)
    except Warning as raised:
        if raised is not warning:
            raise
        return False
    return True


def _name_the_load(finding: Finding) -> None:
    """A parameter or optimizer state that no op made non-finite, loaded so by ``load_state_dict`` while the watch
    was active (a checkpoint saved after the run went bad): that call's line is the report's (patches/loads.py)."""
    if finding.benign or finding.op is not None or finding.source is not None or (
            finding.tensor.role not in _LOADABLE):
        return
    loaded = loaded_nonfinite(finding.bad)
    if loaded is not None:
        finding.source = pointer_at(*loaded.where)
        finding.notes.append(Note.of("loaded-nonfinite", tensor=to_pairs(finding.tensor), loader=loaded.loader,
                                     line=loaded.where[1]))


#: What ``load_state_dict`` fills: a module's parameters (and buffers), an optimizer's state.
_LOADABLE = frozenset({TensorRole.PARAMETER, TensorRole.OPTIMIZER_STATE, TensorRole.BUFFER})


def _model_call(finding: Finding) -> int | None:
    """Which of its step's top-level model calls ``finding`` came from (Report.model_call), from the second on:
    gradient accumulation's micro-batch, a GAN's second call. Read from the call the boundary recorded, not from the
    count at the check (the deferred check judges a micro-batch's backward at the next one's model call). The first
    is not said: where the check runs at once, no later call has run to tell it from a step of one call."""
    call = finding.record.call if finding.record is not None else None
    if call is None or call.model_call < 2 or finding.phase not in (Phase.FORWARD, Phase.BACKWARD, Phase.DATA):
        return None
    return call.model_call


def _same_event(report: Report, earlier: Report) -> bool:
    """Whether ``report`` names the producer an earlier event of the same step named; or names no op or line where
    that one did, of the same tensor: a later check meeting the batch the loop wrote (``x[3, 2] = nan``) once the
    data region's records that named the write are gone."""
    return (
        not earlier.benign and report.step == earlier.step and report.phase == earlier.phase
        and report.module == earlier.module and report.tensor == earlier.tensor
        and ((report.op == earlier.op and report.source == earlier.source) or (
            report.op is None and report.source is None and earlier.op is not None))
    )
